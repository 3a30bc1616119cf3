//! The listener: accepts connections up to a limit, runs each on the server's own runtime,
//! and shuts down gracefully: stop accepting, let connections finish the requests they hold,
//! then return.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_core::Engine;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::connection;
use crate::metrics::metric;
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The admin HTTP endpoint (/metrics, /status, /promote, /takeover), if any.
    pub admin_listen: Option<SocketAddr>,
    pub max_connections: usize,
    /// Largest request body accepted; larger frames get E2BIG and the connection closes.
    pub max_body: usize,
    /// A connection silent for this long is closed; zero means never.
    pub idle_timeout: Duration,
    pub worker_threads: usize,
    /// Users allowed in; none configured means no authentication.
    pub users: crate::auth::Users,
    /// Follow this active node: every bucket's replica vbuckets stream from it.
    pub replica_of: Option<crate::replica::ReplicaConfig>,
    /// The user and password this node logs in with on other nodes (replication, takeover).
    pub replication_login: (Option<String>, Option<String>),
    /// Seconds between NOOPs on this node's replication and takeover streams.
    pub replication_noop_interval: u32,
    /// TLS for the connections this node opens to others (replication, takeover): whom it
    /// trusts and its own certificate.
    pub replication_tls: Option<crate::tls::ClientTls>,
    pub tap: crate::tap::producer::TapConfig,
    /// Bounds on connections that have not logged in (when users are configured).
    pub login: crate::limits::LoginLimits,
    /// The TLS KV listener (next to `listen`); needs `tls`.
    pub tls_listen: Option<SocketAddr>,
    /// The certificate and key of the TLS listener (and of the admin endpoint when
    /// `tls.admin`).
    pub tls: Option<crate::tls::TlsSettings>,
}

/// Counters the metrics endpoint and STAT read.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub connections_total: AtomicU64,
    pub connections_rejected: AtomicU64,
    pub curr_connections: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub protocol_warnings: WarningLimiter,
    /// Connections to the TLS listener that failed their handshake (plain-text clients too).
    pub tls_handshake_failures: AtomicU64,
}

/// At most one warning per kind in this long about what peers do wrong (protocol errors,
/// refused admin requests): a flood of bad connections must not flood the log (the metrics
/// still count every one).
pub const WARNING_EVERY: Duration = Duration::from_secs(10);

/// One `RateLimitedLog` per kind of warning.
#[derive(Debug, Default)]
pub struct WarningLimiter {
    kinds:
        parking_lot::Mutex<std::collections::HashMap<&'static str, crate::limits::RateLimitedLog>>,
}

impl WarningLimiter {
    /// Some(held back since the last one logged) when a warning of `kind` may be logged now.
    pub fn admit(&self, kind: &'static str, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock();
        let log = kinds
            .entry(kind)
            .or_insert_with(|| crate::limits::RateLimitedLog::new(WARNING_EVERY));
        log.due_at(now).map(|n| n - 1)
    }
}

impl ServerStats {
    /// A peer's bad input: counted, and logged as a warning unless one of its kind was logged
    /// in the last `WARNING_EVERY` (then at debug level), the next warning saying how
    /// many were held back.
    pub fn protocol_error(&self, kind: &'static str, message: std::fmt::Arguments<'_>) {
        self.protocol_errors.fetch_add(1, Ordering::Relaxed);
        match self.protocol_warnings.admit(kind, Instant::now()) {
            Some(0) => log::warn!("{message}"),
            Some(held) => log::warn!(
                "{message} (and {held} more {kind} errors since the last such warning, not logged)"
            ),
            None => log::debug!("{message}"),
        }
    }
}

pub struct Shared {
    pub engine: Arc<Engine>,
    pub config: ServerConfig,
    /// Replaced whole on reload; sessions read it per request.
    pub users: parking_lot::RwLock<Arc<crate::auth::Users>>,
    pub stats: ServerStats,
    pub started: std::time::Instant,
    pub dcp_names: crate::dcp::producer::Names,
    pub dcp: crate::dcp::producer::DcpStats,
    /// Running while this node follows an active; emptied by a promotion.
    pub replicators: parking_lot::Mutex<Vec<crate::replica::Replicator>>,
    pub tap_sessions: Arc<crate::tap::session::Sessions<crate::tap::producer::TapSession>>,
    pub tap: crate::tap::TapStats,
    /// Policy plugins (Python) and their questions.
    pub policies: Arc<crate::policy::PolicyHost>,
    /// Connections not yet logged in, and failed logins.
    pub prelogin: crate::limits::PreLogin,
    /// The certificate in use, replaced by a reload (SIGHUP).
    pub tls: Option<Arc<crate::tls::ReloadableTls>>,
}

impl Shared {
    /// Failover: stops following the active, then makes every replica vbucket active (each
    /// with a new failover entry). Returns (bucket, vbuckets promoted) per bucket.
    pub fn promote(&self) -> sluice_core::Result<Vec<(String, Vec<u16>)>> {
        let stopped: Vec<_> = std::mem::take(&mut *self.replicators.lock());
        for mut r in stopped {
            r.stop();
        }
        let mut out = Vec::new();
        for b in self.engine.buckets() {
            let promoted = self.engine.promote(&b)?;
            if !promoted.is_empty() {
                log::warn!(
                    "promoted {} vbucket(s) of bucket {:?} to active",
                    promoted.len(),
                    b.name()
                );
            }
            out.push((b.name().to_string(), promoted));
        }
        Ok(out)
    }
}

pub struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    local_addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    tls_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    done: Option<tokio::sync::oneshot::Receiver<()>>,
    shared: Arc<Shared>,
}

impl Server {
    /// Binds (errors come back here, not later) and starts serving. A TLS certificate that
    /// cannot be used is an `InvalidInput` error naming the key and the file.
    pub fn start(engine: Arc<Engine>, config: ServerConfig) -> std::io::Result<Server> {
        Server::start_with(engine, config, Default::default())
    }

    /// Starts with a policy host the caller keeps (the Python side installs plugins in it).
    pub fn start_with(
        engine: Arc<Engine>,
        config: ServerConfig,
        policies: Arc<crate::policy::PolicyHost>,
    ) -> std::io::Result<Server> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads.max(1))
            .thread_name("sluice-io")
            .enable_all()
            .build()?;
        let std_listener = std::net::TcpListener::bind(config.listen)?;
        std_listener.set_nonblocking(true)?;
        let local_addr = std_listener.local_addr()?;
        let admin = match config.admin_listen {
            Some(a) => {
                let l = std::net::TcpListener::bind(a)?;
                l.set_nonblocking(true)?;
                Some(l)
            }
            None => None,
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
        let tls = match &config.tls {
            Some(t) => Some(Arc::new(
                crate::tls::ReloadableTls::load(t.clone())
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
            )),
            None => None,
        };
        let tls_listener =
            match (config.tls_listen, &tls) {
                (Some(a), Some(_)) => {
                    let l = std::net::TcpListener::bind(a)?;
                    l.set_nonblocking(true)?;
                    Some(l)
                }
                (Some(_), None) => return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "tls_listen: set, but no certificate is configured (tls.certificate, tls.key)",
                )),
                (None, _) => None,
            };
        let tls_addr = tls_listener.as_ref().map(|l| l.local_addr()).transpose()?;
        // What was bound (a port 0 becomes the real one), for STAT and /status.
        let mut config = config;
        config.listen = local_addr;
        config.admin_listen = admin_addr;
        config.tls_listen = tls_addr;
        let (stop_tx, stop_rx) = watch::channel(false);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let tap_sessions = Arc::new(crate::tap::session::Sessions::new(config.tap.max_sessions));
        let shared = Arc::new(Shared {
            engine,
            users: parking_lot::RwLock::new(Arc::new(config.users.clone())),
            config,
            stats: ServerStats::default(),
            started: std::time::Instant::now(),
            dcp_names: Default::default(),
            dcp: Default::default(),
            replicators: Default::default(),
            tap_sessions,
            tap: Default::default(),
            policies: policies.clone(),
            prelogin: Default::default(),
            tls,
        });
        shared
            .engine
            .set_cursor_drop_policy(Arc::new(crate::policy::PluginDropPolicy(policies)));
        if let Some(rc) = &shared.config.replica_of {
            let mut reps = shared.replicators.lock();
            for b in shared.engine.buckets() {
                reps.push(crate::replica::Replicator::start(
                    shared.engine.clone(),
                    b,
                    rc.clone(),
                    shared.policies.clone(),
                ));
            }
        }
        let listener = {
            let _enter = runtime.enter();
            TcpListener::from_std(std_listener)?
        };
        if let (Some(l), Some(addr)) = (admin, admin_addr) {
            let listener = {
                let _enter = runtime.enter();
                TcpListener::from_std(l)?
            };
            let token = crate::admin::Token::create(&shared.engine.config().data_dir)?;
            let https = shared.tls.clone().filter(|t| t.settings().admin);
            if !addr.ip().is_loopback() && shared.config.users.required() && https.is_none() {
                log::warn!(
                    "the admin endpoint {addr} is beyond loopback: HTTP Basic passwords sent to it \
                     cross the network unencrypted"
                );
            }
            runtime.spawn(crate::admin::serve(
                listener,
                shared.clone(),
                Arc::new(crate::admin::Admin::new(addr, token)),
                stop_rx.clone(),
                https,
            ));
        }
        let tls_listener = match tls_listener {
            Some(l) => {
                let _enter = runtime.enter();
                Some(TcpListener::from_std(l)?)
            }
            None => None,
        };
        let sh = shared.clone();
        runtime.spawn(async move {
            // One limit for both listeners: max_connections counts every client connection.
            let limit = Arc::new(Semaphore::new(sh.config.max_connections));
            let plain = accept_loop(listener, sh.clone(), stop_rx.clone(), limit.clone(), None);
            let tls = async {
                if let (Some(l), Some(t)) = (tls_listener, sh.tls.clone()) {
                    accept_loop(l, sh.clone(), stop_rx, limit, Some(t)).await;
                }
            };
            tokio::join!(plain, tls);
            let _ = done_tx.send(());
        });
        Ok(Server {
            runtime: Some(runtime),
            local_addr,
            admin_addr,
            tls_addr,
            stop: stop_tx,
            done: Some(done_rx),
            shared,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Replaces the users and their permissions (SIGHUP); sessions see them on their next
    /// request.
    pub fn set_users(&self, users: crate::auth::Users) {
        *self.shared.users.write() = Arc::new(users);
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The TLS KV listener's address, if it runs.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// Reads the TLS certificate and key again (SIGHUP): connections accepted afterwards get
    /// them. On an error the ones in use stay. Ok(false): no TLS is configured.
    pub fn reload_tls(&self) -> Result<bool, String> {
        match &self.shared.tls {
            Some(t) => t.reload().map(|()| true),
            None => Ok(false),
        }
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops accepting, waits (up to `grace`) for connections to finish what they hold, then
    /// drops the runtime. Blocking; call it from a plain thread.
    pub fn shutdown(&mut self, grace: Duration) {
        for mut r in std::mem::take(&mut *self.shared.replicators.lock()) {
            r.stop();
        }
        let _ = self.stop.send(true);
        if let (Some(rt), Some(done)) = (self.runtime.take(), self.done.take()) {
            rt.block_on(async {
                let _ = tokio::time::timeout(grace, done).await;
            });
            crate::tap::session::close_parked(&self.shared);
            rt.shutdown_timeout(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown(Duration::from_secs(5));
    }
}

/// Accepts on one listener; `tls`: the TLS KV listener, whose connections do their handshake
/// in their own task before the first request.
async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
    limit: Arc<Semaphore>,
    tls: Option<Arc<crate::tls::ReloadableTls>>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => {
                let (socket, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        log::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    // Over the limit: close at once rather than queue without bound.
                    shared.stats.connections_rejected.fetch_add(1, Ordering::Relaxed);
                    log::warn!("refusing connection from {peer}: max_connections ({}) reached", shared.config.max_connections);
                    drop(socket);
                    continue;
                };
                let _ = socket.set_nodelay(true);
                shared.stats.connections_total.fetch_add(1, Ordering::Relaxed);
                let sh = shared.clone();
                let stop = stop.clone();
                let acceptor = tls.as_ref().map(|t| t.kv_acceptor());
                tasks.spawn(async move {
                    sh.stats.curr_connections.fetch_add(1, Ordering::Relaxed);
                    let socket = match acceptor {
                        None => Some(socket.into()),
                        Some(a) => match crate::tls::accept(a, socket).await {
                            Ok(s) => Some(s),
                            Err(e) => {
                                sh.stats.tls_handshake_failures.fetch_add(1, Ordering::Relaxed);
                                log::info!("closing connection from {peer}: {e}");
                                None
                            }
                        },
                    };
                    if let Some(socket) = socket {
                        connection::run(socket, peer, sh.clone(), stop).await;
                    }
                    sh.stats.curr_connections.fetch_sub(1, Ordering::Relaxed);
                    drop(permit);
                });
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    // Graceful: connections see the stop signal after the requests they hold.
    while tasks.join_next().await.is_some() {}
}

impl ServerStats {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_warnings_are_limited_per_kind_and_count_what_they_held_back() {
        let w = WarningLimiter::default();
        let t0 = Instant::now();
        assert_eq!(w.admit("kv", t0), Some(0));
        assert_eq!(w.admit("dcp", t0), Some(0), "kinds are limited apart");
        for _ in 0..5 {
            assert_eq!(w.admit("kv", t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(w.admit("kv", t0 + WARNING_EVERY), Some(5));
        assert_eq!(w.admit("kv", t0 + WARNING_EVERY), None);
        assert_eq!(w.admit("kv", t0 + 2 * WARNING_EVERY), Some(1));
    }
}
