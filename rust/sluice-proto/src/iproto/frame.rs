//! Where one iproto packet ends in a receive buffer: a MessagePack unsigned length, then that
//! many bytes of header and body.

use std::fmt;

use super::codes::ER_INVALID_MSGPACK;

/// The length prefix cannot be used: Tarantool answers with ER_INVALID_MSGPACK (sync 0) and
/// closes the connection, since it can no longer tell where the next packet starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The first byte is not a MessagePack unsigned integer.
    NotUnsigned { marker: u8 },
    /// The announced length is over the server's bound.
    TooBig { len: u64, max: usize },
}

impl FrameError {
    /// The error code to answer with.
    pub fn code(&self) -> u32 {
        ER_INVALID_MSGPACK
    }

    /// The message, in Tarantool's words.
    pub fn message(&self) -> String {
        match self {
            FrameError::NotUnsigned { .. } => "Invalid MsgPack - packet length".to_string(),
            FrameError::TooBig { len, .. } => {
                format!("Invalid MsgPack - too big packet size in the header: {len}")
            }
        }
    }
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::NotUnsigned { marker } => write!(
                f,
                "iproto length prefix starts with 0x{marker:02x}, not an unsigned integer"
            ),
            FrameError::TooBig { len, max } => {
                write!(
                    f,
                    "iproto packet of {len} bytes is over the {max}-byte limit"
                )
            }
        }
    }
}

impl std::error::Error for FrameError {}

/// Whether `buf` starts with a whole packet. `Ok(Some(n))`: the packet is `buf[..n]`, length
/// prefix included (clients send the smallest encoding, Tarantool itself always `ce` + u32);
/// `Ok(None)`: more bytes are needed; `Err`: the prefix is unusable. Reads at most 9 bytes.
pub fn check(buf: &[u8], max_packet: usize) -> Result<Option<usize>, FrameError> {
    let Some(&marker) = buf.first() else {
        return Ok(None);
    };
    let width = match marker {
        0x00..=0x7f => 0,
        0xcc => 1,
        0xcd => 2,
        0xce => 4,
        0xcf => 8,
        _ => return Err(FrameError::NotUnsigned { marker }),
    };
    if buf.len() < 1 + width {
        return Ok(None);
    }
    let len = if width == 0 {
        marker as u64
    } else {
        buf[1..1 + width]
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | *b as u64)
    };
    let total = usize::try_from(len)
        .ok()
        .filter(|&n| n <= max_packet)
        .and_then(|n| n.checked_add(1 + width))
        .ok_or(FrameError::TooBig {
            len,
            max: max_packet,
        })?;
    Ok((buf.len() >= total).then_some(total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iproto::MAX_PACKET_SIZE;

    #[test]
    fn every_length_encoding_frames_the_packet() {
        // tarantool-python's fixint prefix: PING with no body (01_py_auth.txt).
        let py_ping = [0x07, 0x83, 0x00, 0x40, 0x01, 0x00, 0x05, 0x00];
        assert_eq!(check(&py_ping, MAX_PACKET_SIZE), Ok(Some(8)));
        // net.box's ce prefix, with the next packet's first bytes behind it.
        let mut netbox = vec![0xce, 0, 0, 0, 5, 0x82, 0x01, 0x05, 0x00, 0x40];
        netbox.extend_from_slice(&[0xce, 0, 0]);
        assert_eq!(check(&netbox, MAX_PACKET_SIZE), Ok(Some(10)));
        assert_eq!(check(&[0xcc, 2, 0x80, 0x80], 100), Ok(Some(4)));
        assert_eq!(check(&[0xcd, 0, 2, 0x80, 0x80], 100), Ok(Some(5)));
        assert_eq!(
            check(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 1, 0x80], 100),
            Ok(Some(10))
        );
    }

    #[test]
    fn a_partial_prefix_or_body_waits_for_more() {
        assert_eq!(check(&[], 100), Ok(None));
        assert_eq!(check(&[0xce, 0, 0], 100), Ok(None));
        assert_eq!(check(&[0xce, 0, 0, 0, 3, 0x80], 100), Ok(None));
        assert_eq!(check(&[0x05, 0x82], 100), Ok(None));
    }

    #[test]
    fn a_prefix_that_is_not_unsigned_is_refused_as_tarantool_does() {
        // 10_raw_auth_guest_errors.txt: `c1` gets "packet length", then the close.
        let err = check(&[0xc1, 0x00], 100).unwrap_err();
        assert_eq!(err, FrameError::NotUnsigned { marker: 0xc1 });
        assert_eq!(err.code(), 20);
        assert_eq!(err.message(), "Invalid MsgPack - packet length");
        assert!(check(&[0xd0, 0x05], 100).is_err());
        assert!(check(&[0x82], 100).is_err());
    }

    #[test]
    fn a_length_over_the_bound_is_refused_before_the_body_arrives() {
        let err = check(&[0xce, 0x7f, 0xff, 0xff, 0xff], 1024).unwrap_err();
        assert_eq!(
            err,
            FrameError::TooBig {
                len: 0x7fff_ffff,
                max: 1024
            }
        );
        assert_eq!(
            err.message(),
            "Invalid MsgPack - too big packet size in the header: 2147483647"
        );
        // Even an unbounded server cannot be made to overflow the total.
        let huge = [0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
        assert!(check(&huge, usize::MAX).is_err());
    }
}
