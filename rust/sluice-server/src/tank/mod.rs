//! TANK's protocol on its own listener (`tank_listen`): topics produced to and consumed from
//! as TANK's broker serves them (`sluice_proto::tank` for the bytes, the engine's topics for
//! the logs). TANK has no login: the listener is for loopback or a trusted network, as a TANK
//! broker is.

mod session;

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use std::future::Future;
use std::pin::Pin;

use sluice_core::Engine;

use crate::driver::Conn;
use crate::front::{Declaration, Front, Registration, Shared};
use crate::metrics::{label_value, metric};

/// What TANK sessions work with.
pub struct TankContext {
    /// What the connection driver holds this port's connections to.
    pub port: Arc<crate::driver::Port>,
    pub stats: TankStats,
    /// When the server started, for Status.
    pub started_unix: u32,
    /// Who leads each partition, in a cluster.
    pub clustermap: Arc<crate::clustermap::ClusterMap>,
}

/// The TANK front's counters (`/metrics`).
#[derive(Default)]
pub struct TankStats {
    pub connections: AtomicU64,
    pub connections_total: AtomicU64,
    pub produced_messages: AtomicU64,
    pub produced_bundles: AtomicU64,
    pub consumes: AtomicU64,
    pub consumed_bytes: AtomicU64,
    /// Consumes waiting at a partition's tail now.
    pub long_polls: AtomicU64,
    /// Requests refused for want of a permission on their topic.
    pub refused: AtomicU64,
}

impl TankStats {
    pub fn metrics(&self, o: &mut String) {
        use std::fmt::Write;
        for (name, kind, help, v) in [
            (
                "sluice_tank_connections",
                "gauge",
                "Open TANK connections.",
                &self.connections,
            ),
            (
                "sluice_tank_connections_total",
                "counter",
                "TANK connections accepted.",
                &self.connections_total,
            ),
            (
                "sluice_tank_refused_total",
                "counter",
                "TANK requests refused for want of a permission on their topic ([users.guest] topics).",
                &self.refused,
            ),
            (
                "sluice_tank_produced_messages_total",
                "counter",
                "Messages produced over TANK.",
                &self.produced_messages,
            ),
            (
                "sluice_tank_produced_bundles_total",
                "counter",
                "Bundles produced over TANK.",
                &self.produced_bundles,
            ),
            (
                "sluice_tank_consumes_total",
                "counter",
                "TANK consume requests answered.",
                &self.consumes,
            ),
            (
                "sluice_tank_consumed_bytes_total",
                "counter",
                "Bundle bytes sent to TANK consumers.",
                &self.consumed_bytes,
            ),
            (
                "sluice_tank_long_polls",
                "gauge",
                "TANK consumes waiting at a partition's tail.",
                &self.long_polls,
            ),
        ] {
            let _ = writeln!(
                o,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                v.load(Relaxed)
            );
        }
    }
}

/// Per topic and partition: the first and last sequence numbers kept, bytes kept, messages
/// produced and bytes consumed since start; per topic, consumes waiting at a tail. Topics are
/// the engine's, whichever front produced to them.
pub fn topic_metrics(engine: &Engine, o: &mut String) {
    use std::fmt::Write;
    let topics = engine.topics();
    if topics.is_empty() {
        return;
    }
    type Field = fn(&sluice_core::topic::Partition) -> u64;
    let families: [(&str, &str, &str, Field); 5] = [
        (
            "sluice_topic_first_seq",
            "gauge",
            "The oldest sequence number a partition keeps (its next one when it keeps none).",
            |p| p.log.first_available(),
        ),
        (
            "sluice_topic_high_water_mark",
            "gauge",
            "A partition's last sequence number (0 before the first message).",
            |p| p.log.high_water_mark(),
        ),
        (
            "sluice_topic_bytes",
            "gauge",
            "Bundle bytes a partition keeps.",
            |p| p.log.bytes(),
        ),
        (
            "sluice_topic_produced_messages_total",
            "counter",
            "Messages produced to a partition since start.",
            |p| p.produced_messages,
        ),
        (
            "sluice_topic_consumed_bytes_total",
            "counter",
            "Bundle bytes read from a partition by consumers since start.",
            |p| p.consumed_bytes,
        ),
    ];
    // One look per partition: the families' lines are gathered, then written family by family.
    let mut lines = vec![String::new(); families.len()];
    for t in &topics {
        for p in 0..t.num_partitions() {
            let part = t.lock_partition(p).expect("in range");
            for (i, (name, _, _, field)) in families.iter().enumerate() {
                let _ = writeln!(
                    lines[i],
                    "{name}{{topic=\"{}\",partition=\"{p}\"}} {}",
                    label_value(&t.name),
                    field(&part)
                );
            }
        }
    }
    for ((name, kind, help, _), body) in families.iter().zip(lines) {
        metric(o, name, kind, help);
        o.push_str(&body);
    }
    let name = "sluice_topic_long_polls";
    metric(o, name, "gauge", "Consumes waiting at a tail of the topic.");
    for t in &topics {
        let _ = writeln!(
            o,
            "{name}{{topic=\"{}\"}} {}",
            label_value(&t.name),
            t.long_polls.load(Relaxed)
        );
    }
}

/// The TANK front's registration (`server::FRONTS`).
pub static FRONT: Registration = Registration {
    declaration: Declaration {
        name: "tank",
        title: "TANK",
        listen_key: "tank_listen",
        default_listen: "127.0.0.1:11011",
        tls_listen_key: "tank_tls_listen",
        default_tls_listen: "",
        doc: "Address of the TANK listener (docs/tank.md): topics produced to and consumed \
              from by tank-cli and TANK clients.",
        login: false,
        kind: "tank",
        noun: "TANK connection",
        kv_port: false,
    },
    max_frame: |max_body| max_body,
    build,
};

fn build(shared: &Shared<'_>, port: Arc<crate::driver::Port>) -> std::io::Result<Arc<dyn Front>> {
    Ok(Arc::new(TankContext {
        port,
        clustermap: shared.clustermap.clone(),
        stats: Default::default(),
        started_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as u32),
    }))
}

impl Front for TankContext {
    fn serve(self: Arc<Self>, conn: Conn) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut session = session::Session::new(self.clone(), conn.peer);
            let run = async move {
                let mut conn = conn;
                crate::driver::run(&mut conn, &mut session).await;
            };
            crate::listener::counted(&self.stats.connections, run).await
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
