//! The listener: accepts connections up to a limit, runs each on the server's own runtime,
//! and shuts down gracefully: stop accepting, let connections finish the requests they hold,
//! then return.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use sluice_core::Engine;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::admin::NodeView;
use crate::auth::UserTable;
use crate::clustermap::ClusterMap;
use crate::config::ServerConfig;
use crate::connection::{self, Fronts};
use crate::dcp::producer::DcpContext;
use crate::kv::KvContext;
use crate::limits::PreLogin;
use crate::replica::Followers;
use crate::stats::ConnectionStats;
use crate::tap::TapContext;

pub struct Server {
    runtime: Option<tokio::runtime::Runtime>,
    /// The connections' threads; stopped after the runtime whose accept loops hand them work.
    loops: Option<Arc<crate::listener::IoLoops>>,
    local_addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    tls_addr: Option<SocketAddr>,
    iproto_addr: Option<SocketAddr>,
    tank_addr: Option<SocketAddr>,
    greenstack_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    /// False while the client listeners wait (`ServerConfig::hold_connections`).
    accepting: watch::Sender<bool>,
    done: Option<tokio::sync::oneshot::Receiver<()>>,
    fronts: Arc<Fronts>,
    followers: Arc<Followers>,
    tls: Option<Arc<crate::tls::ReloadableTls>>,
    replication: crate::cluster::Replication,
}

impl Server {
    /// Binds (errors come back here, not later) and starts serving. A TLS certificate that
    /// cannot be used is an `InvalidInput` error naming the key and the file.
    pub fn start(engine: Arc<Engine>, config: ServerConfig) -> std::io::Result<Server> {
        Server::start_with(engine, config, Default::default(), None)
    }

    /// Starts with a policy host the caller keeps (the Python side installs plugins in it).
    /// `warm`: the Greenstack listener and connections taken while the engine opened
    /// (`greenstack::Warmup`), used instead of binding `greenstack_listen`.
    pub fn start_with(
        engine: Arc<Engine>,
        config: ServerConfig,
        policies: Arc<crate::policy::PolicyHost>,
        warm: Option<crate::greenstack::Warmed>,
    ) -> std::io::Result<Server> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads.max(1))
            .thread_name("sluice-io")
            .enable_all()
            .build()?;
        let loops = Arc::new(crate::listener::IoLoops::start(config.worker_threads)?);
        let std_listener = bind("KV listener", "listen", config.listen)?;
        std_listener.set_nonblocking(true)?;
        let local_addr = std_listener.local_addr()?;
        let admin = match config.admin_listen {
            Some(a) => {
                let l = bind("admin listener", "admin_listen", a)?;
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
                    let l = bind("TLS listener", "tls_listen", a)?;
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
        let iproto_listener = match config.iproto_listen {
            Some(a) => {
                let l = bind("iproto listener", "iproto_listen", a)?;
                l.set_nonblocking(true)?;
                Some(l)
            }
            None => None,
        };
        let iproto_addr = iproto_listener
            .as_ref()
            .map(|l| l.local_addr())
            .transpose()?;
        let tank_listener = match config.tank_listen {
            Some(a) => {
                let l = bind("TANK listener", "tank_listen", a)?;
                l.set_nonblocking(true)?;
                Some(l)
            }
            None => None,
        };
        let tank_addr = tank_listener.as_ref().map(|l| l.local_addr()).transpose()?;
        let (warm_listener, warm_connections) = match warm {
            Some(w) => (Some(w.listener), w.connections),
            None => (None, Vec::new()),
        };
        let greenstack_listener = match (warm_listener, config.greenstack_listen) {
            (Some(l), _) => Some(l),
            (None, Some(a)) => {
                let l = bind("Greenstack listener", "greenstack_listen", a)?;
                l.set_nonblocking(true)?;
                Some(l)
            }
            (None, None) => None,
        };
        let greenstack_addr = greenstack_listener
            .as_ref()
            .map(|l| l.local_addr())
            .transpose()?;
        // The spaces' buckets must exist and keep their keys in order; a mistake names its key.
        let catalog = crate::iproto::Catalog::build(&engine, &config.spaces)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        // What was bound (a port 0 becomes the real one), for STAT and /status.
        let mut config = config;
        config.listen = local_addr;
        config.admin_listen = admin_addr;
        config.tls_listen = tls_addr;
        let (stop_tx, stop_rx) = watch::channel(false);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        // Each front gets what it works with; none sees the others' state.
        let stats = Arc::new(ConnectionStats::default());
        let clustermap = Arc::new(ClusterMap::new(local_addr, tls_addr));
        let users = Arc::new(UserTable::new(config.users.clone()));
        let prelogin = Arc::new(PreLogin::new(config.login.clone()));
        let throttle = Arc::new(crate::login::LoginThrottle::default());
        let catalog = Arc::new(catalog);
        let follow = config.tarantool_upstream.clone();
        let followed: std::collections::HashSet<u32> = follow
            .as_ref()
            .map(|f| {
                catalog
                    .spaces()
                    .filter(|(_, s)| f.spaces.is_empty() || f.spaces.contains(&s.name))
                    .map(|(id, _)| id)
                    .collect()
            })
            .unwrap_or_default();
        let port = |kind, noun, max_frame| {
            Arc::new(crate::driver::Port {
                kind,
                noun,
                engine: engine.clone(),
                users: users.clone(),
                prelogin: prelogin.clone(),
                io: stats.clone(),
                max_frame,
                idle_timeout: config.idle_timeout,
            })
        };
        let kv_port = port("KV", "connection", config.max_body);
        let iproto = iproto_addr.map(|listen| {
            Arc::new(crate::iproto::IprotoContext {
                engine: engine.clone(),
                users: users.clone(),
                catalog: catalog.clone(),
                port: port(
                    "iproto",
                    "iproto connection",
                    crate::iproto::MAX_PACKET.max(config.max_body),
                ),
                stats: Default::default(),
                throttle: throttle.clone(),
                instance_uuid: crate::iproto::instance_uuid(engine.instance()),
                listen,
                started: std::time::Instant::now(),
                followed,
            })
        });
        let tank = tank_addr.map(|_| {
            Arc::new(crate::tank::TankContext {
                engine: engine.clone(),
                port: port("tank", "TANK connection", config.max_body),
                stats: Default::default(),
                started_unix: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs() as u32),
            })
        });
        let greenstack = greenstack_addr.map(|_| {
            Arc::new(crate::greenstack::GreenstackContext {
                engine: engine.clone(),
                users: users.clone(),
                port: port("greenstack", "Greenstack connection", config.max_body),
                stats: Default::default(),
                throttle: throttle.clone(),
                failed_logins: Default::default(),
                clustermap: clustermap.clone(),
            })
        });
        let tarantool_follower = follow.map(|f| {
            let status = Arc::new(crate::iproto::follow::FollowStatus::new(
                &f.upstream.address,
            ));
            runtime.spawn(crate::iproto::follow::run(
                engine.clone(),
                catalog.clone(),
                f,
                crate::iproto::instance_uuid(engine.instance()),
                status.clone(),
                stop_rx.clone(),
            ));
            status
        });
        let kv = Arc::new(KvContext {
            engine: engine.clone(),
            users,
            stats: stats.clone(),
            started: std::time::Instant::now(),
            tap_applied: Default::default(),
            clustermap: clustermap.clone(),
            spaces: Arc::from(config.spaces.clone()),
        });
        let dcp = Arc::new(DcpContext {
            engine: engine.clone(),
            io: stats.clone(),
            names: Default::default(),
            stats: Default::default(),
            policies: policies.clone(),
            max_body: config.max_body,
            clustermap: clustermap.clone(),
        });
        let tap = Arc::new(TapContext {
            engine: engine.clone(),
            io: stats,
            config: config.tap.clone(),
            sessions: Arc::new(crate::tap::session::Sessions::new(config.tap.max_sessions)),
            stats: Default::default(),
            policies: policies.clone(),
            max_body: config.max_body,
        });
        let fronts = Arc::new(Fronts {
            kv,
            dcp,
            tap,
            port: kv_port,
            throttle,
            iproto: iproto.clone(),
            tank: tank.clone(),
            greenstack: greenstack.clone(),
        });
        engine.set_cursor_drop_policy(Arc::new(crate::policy::PluginDropPolicy(policies.clone())));
        let followers = Arc::new(Followers::start(
            engine.clone(),
            config.replica_of.as_ref(),
            &policies,
            clustermap.clone(),
        ));
        runtime.spawn(watch_layout(engine.clone(), clustermap, stop_rx.clone()));
        let listener = {
            let _enter = runtime.enter();
            TcpListener::from_std(std_listener)?
        };
        if let (Some(l), Some(addr)) = (admin, admin_addr) {
            let listener = {
                let _enter = runtime.enter();
                TcpListener::from_std(l)?
            };
            let token = crate::admin::Token::create(&engine.config().data_dir)?;
            let https = tls.clone().filter(|t| t.settings().admin);
            if !addr.ip().is_loopback() && config.users.required() && https.is_none() {
                log::warn!(
                    "the admin endpoint {addr} is beyond loopback: HTTP Basic passwords sent to it \
                     cross the network unencrypted"
                );
            }
            let view = Arc::new(NodeView {
                fronts: fronts.clone(),
                followers: followers.clone(),
                config: config.clone(),
                tls: tls.clone(),
                tarantool: tarantool_follower.clone(),
            });
            runtime.spawn(crate::admin::serve(
                listener,
                view,
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
        let iproto_listener = match iproto_listener {
            Some(l) => {
                let _enter = runtime.enter();
                Some(TcpListener::from_std(l)?)
            }
            None => None,
        };
        let tank_listener = match tank_listener {
            Some(l) => {
                let _enter = runtime.enter();
                Some(TcpListener::from_std(l)?)
            }
            None => None,
        };
        let greenstack_listener = match greenstack_listener {
            Some(l) => {
                let _enter = runtime.enter();
                Some(TcpListener::from_std(l)?)
            }
            None => None,
        };
        let (fr, tls_) = (fronts.clone(), tls.clone());
        // One limit for every listener: max_connections counts every client connection.
        let limit = Arc::new(Semaphore::new(config.max_connections));
        let (iproto_stop, iproto_limit) = (stop_rx.clone(), limit.clone());
        let (tank_stop, tank_limit) = (stop_rx.clone(), limit.clone());
        let (gs_stop, gs_limit) = (stop_rx.clone(), limit.clone());
        let io_loops = loops.clone();
        let (accepting, mut held) = watch::channel(!config.hold_connections);
        let mut stopped = stop_rx.clone();
        runtime.spawn(async move {
            // Connections wait in the listen backlog meanwhile; a stop ends the wait too.
            tokio::select! {
                _ = held.wait_for(|open| *open) => {}
                _ = stopped.wait_for(|stop| *stop) => {}
            }
            let loops = io_loops;
            let plain = accept_loop(
                listener,
                fr.clone(),
                stop_rx.clone(),
                limit.clone(),
                loops.clone(),
                None,
            );
            let tls = async {
                if let (Some(l), Some(t)) = (tls_listener, tls_) {
                    accept_loop(
                        l,
                        fr.clone(),
                        stop_rx.clone(),
                        limit.clone(),
                        loops.clone(),
                        Some(t),
                    )
                    .await;
                }
            };
            let iproto = async {
                if let (Some(l), Some(ctx)) = (iproto_listener, iproto) {
                    crate::iproto::serve(l, ctx, iproto_stop, iproto_limit, loops.clone()).await;
                }
            };
            let tank_front = async {
                if let (Some(l), Some(ctx)) = (tank_listener, tank) {
                    crate::tank::serve(l, ctx, tank_stop, tank_limit, loops.clone()).await;
                }
            };
            let greenstack_front = async {
                if let (Some(l), Some(ctx)) = (greenstack_listener, greenstack) {
                    crate::greenstack::serve(
                        l,
                        ctx,
                        gs_stop,
                        gs_limit,
                        loops.clone(),
                        warm_connections,
                    )
                    .await;
                }
            };
            tokio::join!(plain, tls, iproto, tank_front, greenstack_front);
            let _ = done_tx.send(());
        });
        Ok(Server {
            runtime: Some(runtime),
            loops: Some(loops),
            local_addr,
            admin_addr,
            tls_addr,
            iproto_addr,
            tank_addr,
            greenstack_addr,
            stop: stop_tx,
            accepting,
            done: Some(done_rx),
            fronts,
            followers,
            tls,
            replication: config.replication(),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Starts accepting on the client listeners held by `ServerConfig::hold_connections`.
    pub fn accept_connections(&self) {
        self.accepting.send_replace(true);
    }

    /// Replaces the users and their permissions (SIGHUP); sessions see them on their next
    /// request.
    pub fn set_users(&self, users: crate::auth::Users) {
        self.fronts.kv.users.replace(users);
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The TANK listener's address, if it runs.
    pub fn tank_addr(&self) -> Option<SocketAddr> {
        self.tank_addr
    }

    /// The Greenstack listener's address, if it runs.
    pub fn greenstack_addr(&self) -> Option<SocketAddr> {
        self.greenstack_addr
    }

    /// The iproto listener's address, if it runs.
    pub fn iproto_addr(&self) -> Option<SocketAddr> {
        self.iproto_addr
    }

    /// The TLS KV listener's address, if it runs.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// Reads the TLS certificate and key again (SIGHUP): connections accepted afterwards get
    /// them. On an error the ones in use stay. Ok(false): no TLS is configured.
    pub fn reload_tls(&self) -> Result<bool, crate::tls::TlsError> {
        match &self.tls {
            Some(t) => t.reload().map(|()| true),
            None => Ok(false),
        }
    }

    /// Keeps what the cluster side reports of the cluster, for /status and /metrics.
    pub fn report_cluster(&self, report: serde_json::Value) {
        self.fronts.kv.clustermap.set_report(report);
    }

    /// The node's parts a cluster map changes, to use without holding the server.
    pub fn member(&self) -> crate::cluster::Member {
        crate::cluster::Member {
            engine: self.fronts.kv.engine.clone(),
            followers: self.followers.clone(),
            clustermap: self.fronts.kv.clustermap.clone(),
            replication: self.replication.clone(),
        }
    }

    /// The replicators of a node that follows an active (promote through them).
    pub fn followers(&self) -> Arc<Followers> {
        self.followers.clone()
    }

    /// Stops accepting, waits (up to `grace`) for connections to finish what they hold, then
    /// drops the runtime. Blocking; call it from a plain thread.
    pub fn shutdown(&mut self, grace: Duration) {
        self.followers.stop();
        let _ = self.stop.send(true);
        if let (Some(rt), Some(done)) = (self.runtime.take(), self.done.take()) {
            rt.block_on(async {
                let _ = tokio::time::timeout(grace, done).await;
            });
            crate::tap::session::close_parked(&self.fronts.tap);
            rt.shutdown_timeout(Duration::from_millis(100));
        }
        self.loops.take();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown(Duration::from_secs(5));
    }
}

/// How often the cluster map is checked for changes nothing announced (a replica's stream
/// starting or ending, a vbucket given away under a replica).
const LAYOUT_CHECK: Duration = Duration::from_secs(1);

/// Keeps the cluster map's revs current, so that connections that asked for change
/// notifications get the new map within `LAYOUT_CHECK` of a change.
async fn watch_layout(engine: Arc<Engine>, map: Arc<ClusterMap>, mut stop: watch::Receiver<bool>) {
    loop {
        let e = engine.clone();
        let m = map.clone();
        // The map reads every vbucket's state under its lock: off the async workers.
        let _ = tokio::task::spawn_blocking(move || m.refresh(&e)).await;
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(LAYOUT_CHECK) => {}
        }
    }
}

/// Accepts on one KV listener; `tls`: the TLS KV listener, whose connections do their
/// handshake in their own task before the first request.
async fn accept_loop(
    listener: TcpListener,
    fronts: Arc<Fronts>,
    stop: watch::Receiver<bool>,
    limit: Arc<Semaphore>,
    loops: Arc<crate::listener::IoLoops>,
    tls: Option<Arc<crate::tls::ReloadableTls>>,
) {
    let stats = fronts.kv.stats.clone();
    let kind = if tls.is_some() { "TLS" } else { "KV" };
    crate::listener::serve(
        listener,
        kind,
        stats.clone(),
        stop,
        limit,
        loops,
        move |socket, peer, stop| {
            stats.connections_total.fetch_add(1, Ordering::Relaxed);
            let (fr, stats) = (fronts.clone(), stats.clone());
            let acceptor = tls.as_ref().map(|t| t.kv_acceptor());
            async move {
                stats.curr_connections.fetch_add(1, Ordering::Relaxed);
                let socket = match acceptor {
                    None => Some(socket.into()),
                    Some(a) => match crate::tls::accept(a, socket).await {
                        Ok(s) => Some(s),
                        Err(e) => {
                            stats.tls_handshake_failures.fetch_add(1, Ordering::Relaxed);
                            log::info!("closing connection from {peer}: {e}");
                            None
                        }
                    },
                };
                if let Some(socket) = socket {
                    let port = fr.port.clone();
                    crate::driver::serve_connection(socket, peer, stop, port, |conn| {
                        connection::run(conn, fr)
                    })
                    .await;
                }
                stats.curr_connections.fetch_sub(1, Ordering::Relaxed);
            }
        },
    )
    .await
}

/// Binds one listener; a failure names the listener, its address and the key that sets it, so
/// that a clash on one port of several (two nodes on one machine) shows which one.
fn bind(
    what: &str,
    key: &str,
    address: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpListener> {
    std::net::TcpListener::bind(address)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{what} {address} ({key}): {e}")))
}
