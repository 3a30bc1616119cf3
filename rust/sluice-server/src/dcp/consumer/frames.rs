//! Typed DCP requests as the frames the consumer sends.

use sluice_proto::dcp;

use super::ConsumerError;

/// A typed DCP request as its frame.
pub(super) fn encoded(r: &impl dcp::DcpRequest, opaque: u32) -> Result<Vec<u8>, ConsumerError> {
    let mut out = Vec::new();
    r.encode(&mut out, opaque).map_err(ConsumerError::Encode)?;
    Ok(out)
}
