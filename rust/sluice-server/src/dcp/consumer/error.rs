//! Why a consumer connection failed: what `Event::Failed` carries (as text) and what
//! `vbucket_positions` and `Probe` return.

use std::time::Duration;

use sluice_proto::dcp::DcpError;
use sluice_proto::mcbp::FrameError;

use crate::tls::TlsError;

#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    #[error("cannot resolve {address}")]
    Resolve { address: String },
    #[error("cannot connect to {address}: {source}")]
    Connect {
        address: String,
        source: std::io::Error,
    },
    /// Boxed: a TLS error is large, and every result of the consumer carries this type.
    #[error(transparent)]
    Tls(Box<TlsError>),
    /// Setting up the socket (timeouts) or reading an answer during the setup.
    #[error("{0}")]
    Socket(std::io::Error),
    #[error("{0}")]
    Encode(DcpError),
    #[error("writing to the producer: {0}")]
    Write(std::io::Error),
    #[error("the consumer is closing")]
    Closing,
    /// A setup request (authentication, SELECT_BUCKET, DCP_OPEN, a control, ...) that could
    /// not be sent or whose answer did not come; `what` names the request.
    #[error("{what}: {source}")]
    Setup {
        what: String,
        source: Box<ConsumerError>,
    },
    #[error("{what} refused with status {status:#04x}: {message}")]
    Refused {
        what: String,
        status: u16,
        message: String,
    },
    /// A frame that is no mcbp frame (during the setup, or an answer while streaming).
    #[error("{0}")]
    Frame(FrameError),
    #[error("no answer from the producer in time")]
    NoAnswer,
    #[error("GET_FAILOVER_LOG of vbucket {vbucket}: {source}")]
    FailoverLog { vbucket: u16, source: DcpError },
    #[error("stream request for vbucket {vbucket}: {source}")]
    StreamRequest {
        vbucket: u16,
        source: Box<ConsumerError>,
    },
    #[error("stream request for vbucket {vbucket} refused with status {status:#04x}: {message}")]
    StreamRefused {
        vbucket: u16,
        status: u16,
        message: String,
    },
    #[error("bad stream request answer for vbucket {vbucket}: {source}")]
    BadStreamAnswer { vbucket: u16, source: DcpError },
    #[error("DCP connection lost: {0}")]
    ConnectionLost(std::io::Error),
    #[error("no message from the producer for {0:?} (twice the noop interval): dead connection")]
    Silent(Duration),
    #[error("bad frame from the producer: {0}")]
    BadFrame(FrameError),
    #[error("bad message: {0}")]
    BadMessage(FrameError),
    #[error("bad document: {0}")]
    BadDocument(DcpError),
    #[error("vbucket {vbucket}: seqno {seqno} outside the stream's order (last {last}, snapshot end {snap_end})")]
    OutOfOrder {
        vbucket: u16,
        seqno: u64,
        last: u64,
        snap_end: u64,
    },
    #[error("bad marker: {0}")]
    BadMarker(DcpError),
    #[error("bad SET_VBUCKET_STATE: {0}")]
    BadSetVbucketState(DcpError),
    #[error("bad stream end: {0}")]
    BadStreamEnd(DcpError),
    /// An answer that does not say what its request asks (STAT topics).
    #[error("{0}")]
    BadAnswer(String),
}

impl ConsumerError {
    /// `source` as the failure of the setup request `what`.
    pub(super) fn during(what: &str, source: ConsumerError) -> ConsumerError {
        ConsumerError::Setup {
            what: what.to_string(),
            source: Box::new(source),
        }
    }
}

impl From<TlsError> for ConsumerError {
    fn from(e: TlsError) -> ConsumerError {
        ConsumerError::Tls(Box::new(e))
    }
}

/// The text earlier releases returned, for callers that report errors as strings.
impl From<ConsumerError> for String {
    fn from(e: ConsumerError) -> String {
        e.to_string()
    }
}
