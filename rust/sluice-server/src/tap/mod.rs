//! TAP over mcbp (seed 000): the producer a connection becomes after TAP_CONNECT (`producer`),
//! the named sessions that outlive a dropped connection (`session`), the messages staged from
//! the vbucket streams and encoded as TAP (`staged`), a node applying a TAP feed it is sent
//! (`apply`), and a native reader for benchmarks (`client`).

pub mod apply;
pub mod client;
pub mod producer;
pub mod session;
pub mod staged;

use std::sync::atomic::AtomicU64;

/// Counters the admin endpoint exports.
#[derive(Debug, Default)]
pub struct TapStats {
    pub connections: AtomicU64,
    pub parked_sessions: AtomicU64,
    pub resumed_sessions: AtomicU64,
    pub expired_sessions: AtomicU64,
    /// TAP_CONNECTs refused: `tap.max_sessions` named sessions exist.
    pub refused_sessions: AtomicU64,
    pub messages: AtomicU64,
    pub acks: AtomicU64,
    pub resent: AtomicU64,
    pub temp_failures: AtomicU64,
    pub filtered: AtomicU64,
    pub loop_stopped: AtomicU64,
    pub applied: AtomicU64,
}
