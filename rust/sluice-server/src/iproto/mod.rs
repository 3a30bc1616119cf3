//! Tarantool's iproto front: spaces of MessagePack tuples over sluice's buckets, for
//! tarantool-python, net.box and the other connectors (docs/iproto.md).
//!
//! A space (`[spaces.NAME]`) lives in a bucket of its own whose keys the engine keeps in order:
//! a tuple is one item, key = the MessagePack array of its primary key's parts, value = the
//! tuple. So the WAL, replicas, DCP and TAP see iproto writes as any other change.
//!
//! `session` runs one connection (greeting, framing, dispatch); one file per request family:
//! `auth` (chap-sha1), `select`, `write` (INSERT, REPLACE, UPDATE, UPSERT, DELETE), `call`
//! (the built-in CALL/EVAL set) and `schema` (the space catalog and the system views
//! `_vspace`, `_vindex`, `_vcollation`). `follow` applies a real Tarantool's rows to the
//! spaces (`[tarantool_upstream]`). The wire codec is `sluice_proto::iproto`.

mod auth;
mod call;
mod failure;
pub mod follow;
mod forwarded;
mod route;
pub mod schema;
mod select;
mod session;
mod write;

pub use crate::space::{FieldConfig, SpaceConfig};

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use std::future::Future;
use std::pin::Pin;

use crate::driver::Conn;
use crate::front::{Declaration, Front, Registration, Shared};
use crate::metrics::metric;
use crate::throttle::LoginThrottle;

pub use schema::{Catalog, Space};

/// Tarantool 2.6 error codes this front answers with beyond those of
/// `sluice_proto::iproto::codes` (values from Tarantool's errcode.h).
pub(crate) mod more_codes {
    pub const ER_MEMORY_ISSUE: u32 = 2;
    pub const ER_WAL_IO: u32 = 40;
    pub const ER_MEMTX_MAX_TUPLE_SIZE: u32 = 110;
    pub const ER_SYSTEM: u32 = 115;
    pub const ER_NO_SUCH_INDEX_NAME: u32 = 148;
    pub const ER_SYNC_QUORUM_TIMEOUT: u32 = 216;
}

/// The Tarantool version the greeting announces: the protocol the captures of Tarantool 2.6
/// describe, which tarantool-python and net.box speak to it (no IPROTO_ID from them).
pub const TARANTOOL_VERSION: &str = "2.6.0";

/// The largest request accepted; a larger length prefix closes the connection.
pub const MAX_PACKET: usize = 64 << 20;

/// What the iproto front works with, shared by its connections: built by the server.
pub struct IprotoContext {
    pub catalog: Arc<Catalog>,
    /// What the connection driver holds this port's connections to.
    pub port: Arc<crate::driver::Port>,
    pub stats: IprotoStats,
    /// Failed logins slow the next ones, shared with SASL (`login`).
    pub throttle: Arc<LoginThrottle>,
    /// The engine's instance id as a UUID, in the greeting and `box.info`.
    pub instance_uuid: String,
    /// Where it listens (its plain port, else its TLS one), for `box.info.listen`.
    pub listen: Option<SocketAddr>,
    pub started: Instant,
    /// Spaces followed from a Tarantool (`[tarantool_upstream]`): read-only here, as on a
    /// Tarantool replica.
    pub followed: std::collections::HashSet<u32>,
    /// The cluster map, whose router sends requests on to the node their key is active on.
    pub clustermap: Arc<crate::clustermap::ClusterMap>,
}

/// The engine's instance id (32 hex digits) written as a random (version 4, RFC 4122
/// variant) UUID. Tarantool's clients parse the greeting's UUID and refuse one whose variant
/// bits are not NCS, RFC 4122 or Microsoft's ("Invalid greeting"), so the id's digits cannot
/// be taken as they are.
pub fn instance_uuid(instance: &str) -> String {
    // The id's hex digits as 16 bytes (zero-padded), marked as a version 4, RFC 4122 UUID.
    let mut bytes = [0u8; 16];
    let digits = instance.bytes().filter_map(|c| (c as char).to_digit(16));
    for (i, d) in digits.take(32).enumerate() {
        bytes[i / 2] |= (d as u8) << if i % 2 == 0 { 4 } else { 0 };
    }
    bytes[6] = bytes[6] & 0x0f | 0x40;
    bytes[8] = bytes[8] & 0x3f | 0x80;
    sluice_proto::iproto::json::uuid_text(&bytes).expect("16 bytes")
}

/// The request types counted in `sluice_iproto_requests_total`, by label.
const REQUEST_TYPES: [(u32, &str); 15] = [
    (1, "select"),
    (2, "insert"),
    (3, "replace"),
    (4, "update"),
    (5, "delete"),
    (6, "call_16"),
    (7, "auth"),
    (8, "eval"),
    (9, "upsert"),
    (10, "call"),
    (11, "execute"),
    (12, "nop"),
    (13, "prepare"),
    (64, "ping"),
    (73, "id"),
];

/// The iproto front's counters (`/metrics`).
#[derive(Default)]
pub struct IprotoStats {
    /// Per entry of `REQUEST_TYPES`, then one for any other type.
    requests: [AtomicU64; REQUEST_TYPES.len() + 1],
    /// Error replies by Tarantool error code.
    errors: parking_lot::Mutex<BTreeMap<u32, u64>>,
    pub connections: AtomicU64,
    pub connections_total: AtomicU64,
}

/// A session's requests by type (`IprotoStats::request_slot`), not yet added to the shared
/// counters.
pub(crate) type RequestCounts = [u64; REQUEST_TYPES.len() + 1];

impl IprotoStats {
    /// Where a request type is counted. Sessions count in their own `RequestCounts` and add
    /// them per batch (`add_requests`): a shared counter written by every request on every
    /// core would bounce its cache line between the cores.
    pub(crate) fn request_slot(code: u32) -> usize {
        REQUEST_TYPES
            .iter()
            .position(|(c, _)| *c == code)
            .unwrap_or(REQUEST_TYPES.len())
    }

    /// Adds a session's counts to the shared counters and zeroes them.
    pub(crate) fn add_requests(&self, counts: &mut RequestCounts) {
        for (shared, n) in self.requests.iter().zip(counts.iter_mut()) {
            if *n != 0 {
                shared.fetch_add(std::mem::take(n), Relaxed);
            }
        }
    }

    pub fn error(&self, code: u32) {
        *self.errors.lock().entry(code).or_insert(0) += 1;
    }

    /// The Prometheus lines of the iproto counters.
    pub fn metrics(&self, o: &mut String) {
        metric(
            o,
            "sluice_iproto_connections",
            "gauge",
            "iproto connections open now.",
        );
        let _ = writeln!(
            o,
            "sluice_iproto_connections {}",
            self.connections.load(Relaxed)
        );
        metric(
            o,
            "sluice_iproto_connections_total",
            "counter",
            "iproto connections accepted.",
        );
        let _ = writeln!(
            o,
            "sluice_iproto_connections_total {}",
            self.connections_total.load(Relaxed)
        );
        metric(
            o,
            "sluice_iproto_requests_total",
            "counter",
            "iproto requests received, by type.",
        );
        let names = REQUEST_TYPES.iter().map(|(_, n)| *n).chain(["other"]);
        for (name, n) in names.zip(&self.requests) {
            let _ = writeln!(
                o,
                "sluice_iproto_requests_total{{type=\"{name}\"}} {}",
                n.load(Relaxed)
            );
        }
        metric(
            o,
            "sluice_iproto_errors_total",
            "counter",
            "iproto error replies, by Tarantool error code.",
        );
        for (code, n) in self.errors.lock().iter() {
            let _ = writeln!(o, "sluice_iproto_errors_total{{code=\"{code}\"}} {n}");
        }
    }
}

/// The iproto front's registration (`server::FRONTS`).
pub static FRONT: Registration = Registration {
    declaration: Declaration {
        name: "iproto",
        title: "iproto",
        listen_key: "iproto_listen",
        default_listen: "127.0.0.1:3301",
        tls_listen_key: "iproto_tls_listen",
        default_tls_listen: "",
        doc: "Address of the Tarantool iproto listener (docs/iproto.md): the spaces \
              of [spaces.NAME] for tarantool-python, net.box and other connectors.",
        login: true,
        kind: "iproto",
        noun: "iproto connection",
        kv_port: false,
    },
    max_frame: |max_body| MAX_PACKET.max(max_body),
    build,
};

fn build(shared: &Shared<'_>, port: Arc<crate::driver::Port>) -> std::io::Result<Arc<dyn Front>> {
    let engine = shared.engine;
    // The spaces' buckets must exist and keep their keys in order; a mistake names its key.
    let config = shared.config;
    let catalog = Catalog::build(engine, &config.spaces)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let followed = config
        .tarantool_upstream
        .as_ref()
        .map(|f| &f.spaces)
        .map(|names| {
            catalog
                .spaces()
                .filter(|(_, s)| names.is_empty() || names.contains(&s.name))
                .map(|(id, _)| id)
                .collect()
        })
        .unwrap_or_default();
    Ok(Arc::new(IprotoContext {
        catalog: Arc::new(catalog),
        port,
        stats: Default::default(),
        throttle: shared.throttle.clone(),
        instance_uuid: instance_uuid(engine.instance()),
        listen: shared.listen.or(shared.tls_listen),
        started: Instant::now(),
        followed,
        clustermap: shared.clustermap.clone(),
    }))
}

impl Front for IprotoContext {
    fn serve(self: Arc<Self>, conn: Conn) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let ctx = self.clone();
            crate::listener::counted(&ctx.stats.connections, session::run(conn, self)).await
        })
    }

    fn port(&self) -> Arc<crate::driver::Port> {
        self.port.clone()
    }

    fn accepted(&self) {
        self.stats.connections_total.fetch_add(1, Relaxed);
    }

    fn metrics(&self, out: &mut String) {
        self.stats.metrics(out)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_instance_id_reads_as_a_uuid() {
        assert_eq!(
            super::instance_uuid("eebdef33efcc4b01be611d02ed76c981"),
            "eebdef33-efcc-4b01-be61-1d02ed76c981"
        );
        // Digits that would give a reserved variant (0xf...) or no version are made valid.
        assert_eq!(
            super::instance_uuid("d8d2ff28675ef423fed0d8ecbdbfb94a"),
            "d8d2ff28-675e-4423-bed0-d8ecbdbfb94a"
        );
        // Short ids are padded with zeros.
        assert_eq!(
            super::instance_uuid("ab"),
            "ab000000-0000-4000-8000-000000000000"
        );
    }
}
