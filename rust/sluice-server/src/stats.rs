//! The client connections' counters (accepted, refused, open, bytes, protocol errors), which
//! every front counts into and STAT and /metrics read.

use std::fmt::Write;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{self, Relaxed};
use std::time::Instant;

use crate::metrics::metric;
use crate::ratelimit::WarningLimiter;

/// Counters the metrics endpoint and STAT read.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    pub connections_total: AtomicU64,
    pub connections_rejected: AtomicU64,
    pub curr_connections: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub protocol_warnings: WarningLimiter,
    /// Connections to the TLS listener that failed their handshake (plain-text clients too).
    pub tls_handshake_failures: AtomicU64,
    /// SASL logins begun on the memcached port, and those refused (memcached's `stats`).
    pub auth_cmds: AtomicU64,
    pub auth_errors: AtomicU64,
}

impl ConnectionStats {
    /// A peer's bad input: counted, and logged as a warning unless one of its kind was logged
    /// in the last `WARNING_EVERY` (then at debug level), the next warning saying how
    /// many were held back.
    pub fn protocol_error(&self, kind: &'static str, message: std::fmt::Arguments<'_>) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
        self.warn_limited(kind, message);
    }

    /// Logs `message` as a warning unless one of its kind was logged in the last
    /// `WARNING_EVERY` (then at debug level), the next warning saying how many were held back:
    /// what a peer can make the node say over and over (bad input, refused requests).
    pub fn warn_limited(&self, kind: &'static str, message: std::fmt::Arguments<'_>) {
        match self.protocol_warnings.admit(kind, Instant::now()) {
            Some(0) => log::warn!("{message}"),
            Some(held) => log::warn!(
                "{message} (and {held} more {kind} errors since the last such warning, not logged)"
            ),
            None => log::debug!("{message}"),
        }
    }

    /// The Prometheus lines of the connection counters.
    pub fn metrics(&self, o: &mut String) {
        let s = self;
        metric(
            o,
            "sluice_connections",
            "gauge",
            "Client connections open now.",
        );
        let _ = writeln!(o, "sluice_connections {}", s.curr_connections.load(Relaxed));
        metric(
            o,
            "sluice_connections_total",
            "counter",
            "Client connections accepted, and refused over max_connections.",
        );
        let _ = writeln!(
            o,
            "sluice_connections_total{{result=\"accepted\"}} {}",
            s.connections_total.load(Relaxed)
        );
        let _ = writeln!(
            o,
            "sluice_connections_total{{result=\"refused\"}} {}",
            s.connections_rejected.load(Relaxed)
        );
        metric(
            o,
            "sluice_tls_handshake_failures_total",
            "counter",
            "Connections to the TLS KV listener that failed their handshake (plain-text clients too).",
        );
        let _ = writeln!(
            o,
            "sluice_tls_handshake_failures_total {}",
            s.tls_handshake_failures.load(Relaxed)
        );
        metric(
            o,
            "sluice_network_bytes_total",
            "counter",
            "Bytes read from and written to clients.",
        );
        let _ = writeln!(
            o,
            "sluice_network_bytes_total{{direction=\"in\"}} {}",
            s.bytes_in.load(Relaxed)
        );
        let _ = writeln!(
            o,
            "sluice_network_bytes_total{{direction=\"out\"}} {}",
            s.bytes_out.load(Relaxed)
        );
        metric(
            o,
            "sluice_protocol_errors_total",
            "counter",
            "Connections closed for malformed input.",
        );
        let _ = writeln!(
            o,
            "sluice_protocol_errors_total {}",
            s.protocol_errors.load(Relaxed)
        );
    }
}
