//! Greenstack on its own listener (`greenstack_listen`): Couchbase's full-duplex protocol
//! (seed 001, `sluice_proto::greenstack`; docs/greenstack.md). A connection says HELLO first,
//! may log in (SASL PLAIN) and selects a bucket; its requests run on lanes (the flex header's
//! lane id; none is a lane too): within a lane replies may come out of order (a GET answers
//! while a durable write before it waits), a fenced request waits for every earlier one of its
//! lane and holds back the later ones, and quiet requests answer only failures. `connection`
//! runs one connection in the driver; `session` is its state and lane scheduler, with one file
//! per request family (`sasl`, `kv`, `dcp_requests`, `notices`); `dcp` its DCP streams;
//! `reply` the reply and notice frames; `patch` is MUTATION's JSON merge patch; `warmup` the
//! port while the engine recovers.

mod connection;
mod dcp;
mod dcp_requests;
mod kv;
mod notices;
mod patch;
mod reply;
mod sasl;
mod session;
mod warmup;

pub use warmup::{WarmConnection, Warmed, Warmup};

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use std::any::Any;
use std::future::Future;
use std::pin::Pin;

use tokio::sync::watch;

use crate::driver::Conn;
use crate::front::{Declaration, Front, Registration, Resumed, Shared};
use crate::metrics::metric;
use crate::throttle::LoginThrottle;

/// What Greenstack sessions work with, built by the server.
pub struct GreenstackContext {
    /// What the connection driver holds this port's connections to.
    pub port: Arc<crate::driver::Port>,
    pub stats: GreenstackStats,
    /// Failed logins slow the next ones, shared with SASL on the memcached front.
    pub throttle: Arc<LoginThrottle>,
    /// Failed Greenstack logins of the last minute, told to the connections of admins.
    pub failed_logins: FailedLogins,
    /// The vbucket map: a change is told to the connections with a bucket selected.
    pub clustermap: Arc<crate::clustermap::ClusterMap>,
}

/// A failed login, as the admins' connections are told of it.
#[derive(Debug, Clone)]
pub struct FailedLogin {
    pub user: String,
    pub from: std::net::IpAddr,
    /// Failed Greenstack logins in the minute up to this one.
    pub last_minute: u64,
}

/// Counts failed logins over the last minute and tells every session that listens.
pub struct FailedLogins {
    times: parking_lot::Mutex<std::collections::VecDeque<std::time::Instant>>,
    tell: tokio::sync::broadcast::Sender<FailedLogin>,
}

impl Default for FailedLogins {
    fn default() -> FailedLogins {
        FailedLogins {
            times: Default::default(),
            tell: tokio::sync::broadcast::channel(64).0,
        }
    }
}

impl FailedLogins {
    pub fn record(&self, user: &str, from: std::net::IpAddr) {
        let now = std::time::Instant::now();
        let last_minute = {
            let mut times = self.times.lock();
            while times
                .front()
                .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(60))
            {
                times.pop_front();
            }
            // Bounded: past this many a minute, the count says "at least".
            if times.len() < 100_000 {
                times.push_back(now);
            }
            times.len() as u64
        };
        // No session listening is no error.
        let _ = self.tell.send(FailedLogin {
            user: user.to_string(),
            from,
            last_minute,
        });
    }

    pub fn listen(&self) -> tokio::sync::broadcast::Receiver<FailedLogin> {
        self.tell.subscribe()
    }
}

/// The Greenstack front's counters (`/metrics`).
#[derive(Default)]
pub struct GreenstackStats {
    pub connections: AtomicU64,
    pub connections_total: AtomicU64,
    pub requests: AtomicU64,
    /// Replies sent before the reply of a request of the same lane that came earlier.
    pub out_of_order: AtomicU64,
    pub unknown_commands: AtomicU64,
    /// Notices sent to clients (back off, shutting down).
    pub notices: AtomicU64,
    /// Requests dropped for waiting past their "ignore unless executed before".
    pub not_executed: AtomicU64,
    /// DCP streams open over Greenstack, and the changes they sent.
    pub dcp_streams: AtomicU64,
    pub dcp_items: AtomicU64,
}

impl GreenstackStats {
    pub fn metrics(&self, o: &mut String) {
        use std::fmt::Write;
        for (name, kind, help, v) in [
            (
                "sluice_greenstack_connections",
                "gauge",
                "Open Greenstack connections.",
                &self.connections,
            ),
            (
                "sluice_greenstack_connections_total",
                "counter",
                "Greenstack connections accepted.",
                &self.connections_total,
            ),
            (
                "sluice_greenstack_requests_total",
                "counter",
                "Greenstack requests taken.",
                &self.requests,
            ),
            (
                "sluice_greenstack_out_of_order_replies_total",
                "counter",
                "Greenstack replies sent ahead of an earlier request of their lane.",
                &self.out_of_order,
            ),
            (
                "sluice_greenstack_notices_total",
                "counter",
                "Notices sent to Greenstack clients (back off, shutting down).",
                &self.notices,
            ),
            (
                "sluice_greenstack_not_executed_total",
                "counter",
                "Greenstack requests dropped for waiting past their \"ignore unless executed before\".",
                &self.not_executed,
            ),
            (
                "sluice_greenstack_dcp_streams",
                "gauge",
                "DCP streams open over Greenstack.",
                &self.dcp_streams,
            ),
            (
                "sluice_greenstack_dcp_items_total",
                "counter",
                "Changes sent by DCP streams over Greenstack.",
                &self.dcp_items,
            ),
            (
                "sluice_greenstack_unknown_commands_total",
                "counter",
                "Greenstack requests of an opcode this server does not serve.",
                &self.unknown_commands,
            ),
        ] {
            metric(o, name, kind, help);
            let _ = writeln!(o, "{name} {}", v.load(Relaxed));
        }
    }
}

/// The Greenstack front's registration (`server::FRONTS`).
pub static FRONT: Registration = Registration {
    declaration: Declaration {
        name: "greenstack",
        title: "Greenstack",
        listen_key: "greenstack_listen",
        default_listen: "127.0.0.1:11220",
        tls_listen_key: "greenstack_tls_listen",
        default_tls_listen: "",
        doc: "Address of the Greenstack listener (docs/greenstack.md): HELLO, login, buckets, GET \
              and MUTATION on lanes with out-of-order replies.",
        login: true,
        kind: "greenstack",
        noun: "Greenstack connection",
        kv_port: false,
    },
    max_frame: |max_body| max_body,
    build,
};

fn build(shared: &Shared<'_>, port: Arc<crate::driver::Port>) -> std::io::Result<Arc<dyn Front>> {
    Ok(Arc::new(GreenstackContext {
        port,
        stats: Default::default(),
        throttle: shared.throttle.clone(),
        failed_logins: Default::default(),
        clustermap: shared.clustermap.clone(),
    }))
}

impl GreenstackContext {
    /// Runs one admitted connection; `warm`: one taken during warm-up.
    async fn run(self: Arc<Self>, conn: Conn, warm: Option<session::WarmStart>) {
        let ctx = self.clone();
        crate::listener::counted(&ctx.stats.connections, connection::run(conn, self, warm)).await
    }
}

impl Front for GreenstackContext {
    fn serve(self: Arc<Self>, conn: Conn) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(self.run(conn, None))
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

    /// The connections taken during warm-up go on as sessions, told warm-up is done.
    fn resume(
        self: Arc<Self>,
        warm: Box<dyn Any + Send>,
        stop: watch::Receiver<bool>,
    ) -> Vec<Resumed> {
        let Ok(connections) = warm.downcast::<Vec<WarmConnection>>() else {
            return Vec::new();
        };
        connections
            .into_iter()
            .map(|c| {
                let (ctx, stop, peer, start) = (self.clone(), stop.clone(), c.peer, c.start);
                Resumed {
                    socket: c.socket,
                    peer,
                    run: Box::new(move |socket| {
                        Box::pin(async move {
                            let port = ctx.port.clone();
                            crate::driver::serve_connection(
                                socket.into(),
                                peer,
                                stop,
                                port,
                                |conn| ctx.run(conn, Some(start)),
                            )
                            .await
                        })
                    }),
                }
            })
            .collect()
    }
}
