//! TAP over mcbp (seed 000): the producer a connection becomes after TAP_CONNECT (`producer`),
//! the named sessions that outlive a dropped connection (`session`), the messages staged from
//! the vbucket streams and encoded as TAP (`staged`). A node applying a TAP feed it is sent
//! does so on its KV connections (`kv::tap_in`). The native reader the TAP benchmark uses lives in sluice-tools.

pub mod producer;
pub mod session;
pub mod staged;

use crate::metrics::single;
use crate::policy::PolicyHost;
use crate::stats::ConnectionStats;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// What the TAP front works with, shared by every producer connection: handed over by the
/// server.
pub struct TapContext {
    pub engine: Arc<sluice_core::Engine>,
    /// The connections' counters (bytes, protocol errors), shared with the other fronts.
    pub io: Arc<ConnectionStats>,
    pub config: producer::TapConfig,
    /// Named sessions, live or parked for a reconnect.
    pub sessions: Arc<session::Sessions<producer::TapSession>>,
    pub stats: TapStats,
    pub policies: Arc<PolicyHost>,
    /// Largest request body accepted (`max_body`).
    pub max_body: usize,
}

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
}

impl TapStats {
    /// The Prometheus lines of the TAP producers' counters (`parked_sessions`: named sessions
    /// kept for a reconnect; `applied`: TAP messages applied from a feed, counted by the KV
    /// front).
    pub fn metrics(&self, o: &mut String, parked_sessions: u64, applied: u64) {
        let t = self;
        single(
            o,
            "sluice_tap_connections",
            "gauge",
            "TAP producer connections open now.",
            t.connections.load(Relaxed),
        );
        single(
            o,
            "sluice_tap_sessions_parked",
            "gauge",
            "Named TAP sessions kept for a reconnect.",
            parked_sessions,
        );
        for (name, help, v) in [
            (
                "sluice_tap_messages_total",
                "TAP messages sent (re-sent ones included).",
                &t.messages,
            ),
            ("sluice_tap_acks_total", "TAP ACKs received.", &t.acks),
            (
                "sluice_tap_resent_total",
                "TAP messages sent again (reconnect or temporary failure).",
                &t.resent,
            ),
            (
                "sluice_tap_temp_failures_total",
                "TMPFAIL or BUSY answers from TAP clients.",
                &t.temp_failures,
            ),
            (
                "sluice_tap_sessions_parked_total",
                "Named TAP sessions kept after their connection dropped.",
                &t.parked_sessions,
            ),
            (
                "sluice_tap_sessions_resumed_total",
                "TAP reconnects that resumed their session.",
                &t.resumed_sessions,
            ),
            (
                "sluice_tap_sessions_refused_total",
                "TAP_CONNECTs refused because tap.max_sessions named sessions exist.",
                &t.refused_sessions,
            ),
            (
                "sluice_tap_sessions_expired_total",
                "Parked TAP sessions whose grace period ran out.",
                &t.expired_sessions,
            ),
            (
                "sluice_tap_filtered_total",
                "Changes a StreamFilter kept off TAP streams.",
                &t.filtered,
            ),
            (
                "sluice_tap_out_of_hops_total",
                "Changes not sent on because their TAP hops ran out.",
                &t.loop_stopped,
            ),
        ] {
            single(o, name, "counter", help, v.load(Relaxed));
        }
        single(
            o,
            "sluice_tap_applied_total",
            "counter",
            "TAP messages this node applied from a feed.",
            applied,
        );
    }
}
