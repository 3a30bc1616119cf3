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
use crate::front::{Declaration, Front, Prebound, Registration, Running, Shared};
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
    /// The registered fronts that listen, with the addresses bound.
    running: Arc<[Running]>,
    stop: watch::Sender<bool>,
    /// False while the client listeners wait (`ServerConfig::hold_connections`).
    accepting: watch::Sender<bool>,
    done: Option<tokio::sync::oneshot::Receiver<()>>,
    fronts: Arc<Fronts>,
    followers: Arc<Followers>,
    tls: Option<Arc<crate::tls::ReloadableTls>>,
    replication: crate::cluster::Replication,
}

/// The fronts this build serves besides the memcached port, a line each. A front declares
/// everything else itself (`front::Registration`).
pub static FRONTS: &[&Registration] = &[
    &crate::iproto::FRONT,
    &crate::tank::FRONT,
    &crate::greenstack::FRONT,
];

impl Server {
    /// Binds (errors come back here, not later) and starts serving. A TLS certificate that
    /// cannot be used is an `InvalidInput` error naming the key and the file.
    pub fn start(engine: Arc<Engine>, config: ServerConfig) -> std::io::Result<Server> {
        Server::start_with(engine, config, Default::default(), Vec::new(), FRONTS)
    }

    /// Starts with a policy host the caller keeps (the Python side installs plugins in it).
    /// `prebound`: listeners fronts bound while the engine opened (Greenstack's warm-up), used
    /// instead of binding theirs. `fronts`: the registered fronts (`FRONTS`, or more).
    pub fn start_with(
        engine: Arc<Engine>,
        config: ServerConfig,
        policies: Arc<crate::policy::PolicyHost>,
        prebound: Vec<Prebound>,
        fronts: &[&'static Registration],
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
        // Each registered front's listener: the one it bound already, or its configured address.
        let mut prebound = prebound;
        let mut bound = Vec::new();
        for r in fronts {
            let d = &r.declaration;
            let pre = prebound
                .iter()
                .position(|p| p.name == d.name)
                .map(|i| prebound.swap_remove(i));
            let Some(addr) = config.listeners.get(d.name).copied() else {
                continue;
            };
            let (listener, warm) = match pre {
                Some(p) => (p.listener, Some(p.warm)),
                None => {
                    let what = format!("{} listener", d.title);
                    let l = bind(&what, &format!("{}_listen", d.name), addr)?;
                    l.set_nonblocking(true)?;
                    (l, None)
                }
            };
            bound.push((*r, listener.local_addr()?, listener, warm));
        }
        // The spaces' buckets must exist and keep their keys in order; a mistake names its key.
        let catalog = crate::iproto::Catalog::build(&engine, &config.spaces)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        // What was bound (a port 0 becomes the real one), for STAT and /status.
        let mut config = config;
        config.listen = local_addr;
        config.admin_listen = admin_addr;
        config.tls_listen = tls_addr;
        for (r, addr, _, _) in &bound {
            config
                .listeners
                .insert(r.declaration.name.to_string(), *addr);
        }
        let (stop_tx, stop_rx) = watch::channel(false);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        // Each front gets what it works with; none sees the others' state.
        let stats = Arc::new(ConnectionStats::default());
        let clustermap = Arc::new(ClusterMap::new(local_addr, tls_addr));
        let users = Arc::new(UserTable::new(config.users.clone()));
        let prelogin = Arc::new(PreLogin::new(config.login.clone()));
        let throttle = Arc::new(crate::throttle::LoginThrottle::default());
        let catalog = Arc::new(catalog);
        let follow = config.tarantool_upstream.clone();
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
            users: users.clone(),
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
            io: stats.clone(),
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
            throttle: throttle.clone(),
        });
        // The registered fronts, each built from the node's shared pieces and its own port.
        let mut running = Vec::new();
        let mut registered = Vec::new();
        for (r, addr, listener, warm) in bound {
            let d = r.declaration;
            let shared = Shared {
                engine: &engine,
                users: &users,
                throttle: &throttle,
                clustermap: &clustermap,
                spaces: &config.spaces,
                followed: config.tarantool_upstream.as_ref().map(|f| &f.spaces[..]),
                listen: addr,
                stop: &stop_rx,
                runtime: runtime.handle(),
            };
            let front = (r.build)(
                &shared,
                port(d.kind, d.noun, (r.max_frame)(config.max_body)),
            )?;
            running.push(Running {
                declaration: d,
                front: front.clone(),
                addr,
            });
            registered.push((d, front, listener, warm));
        }
        let running: Arc<[Running]> = running.into();
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
                registered: running.clone(),
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
        let registered = {
            let _enter = runtime.enter();
            registered
                .into_iter()
                .map(|(d, front, l, warm)| Ok((d, front, TcpListener::from_std(l)?, warm)))
                .collect::<std::io::Result<Vec<_>>>()?
        };
        let (fr, tls_) = (fronts.clone(), tls.clone());
        // One limit for every listener: max_connections counts every client connection.
        let limit = Arc::new(Semaphore::new(config.max_connections));
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
            let others = registered.into_iter().map(|(d, front, l, warm)| {
                serve_front(
                    d,
                    front,
                    l,
                    warm,
                    stop_rx.clone(),
                    limit.clone(),
                    loops.clone(),
                    stats.clone(),
                )
            });
            tokio::join!(plain, tls, join_all(others));
            let _ = done_tx.send(());
        });
        Ok(Server {
            runtime: Some(runtime),
            loops: Some(loops),
            local_addr,
            admin_addr,
            tls_addr,
            running,
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

    /// The registered fronts that run, where each listens.
    pub fn fronts(&self) -> &[Running] {
        &self.running
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

/// Accepts connections of a registered front until the stop signal, under the server's
/// connection limit, each admitted by the driver and served by the front; those it took before
/// the server started (`warm`) go on first.
#[allow(clippy::too_many_arguments)]
async fn serve_front(
    d: Declaration,
    front: Arc<dyn Front>,
    listener: TcpListener,
    warm: Option<Box<dyn std::any::Any + Send>>,
    stop: watch::Receiver<bool>,
    limit: Arc<Semaphore>,
    loops: Arc<crate::listener::IoLoops>,
    io: Arc<ConnectionStats>,
) {
    let mut resumed = tokio::task::JoinSet::new();
    for r in warm
        .map(|w| front.clone().resume(w, stop.clone()))
        .unwrap_or_default()
    {
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            io.connections_rejected.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "closing {} from {} after warm-up: max_connections reached",
                d.noun,
                r.peer
            );
            continue;
        };
        front.accepted();
        resumed.spawn_on(
            async move {
                // Registered with the event loop of the thread it runs on.
                match tokio::net::TcpStream::from_std(r.socket) {
                    Ok(s) => (r.run)(s).await,
                    Err(e) => log::info!("{} from {} lost after warm-up: {e}", d.noun, r.peer),
                }
                drop(permit);
            },
            loops.next(),
        );
    }
    crate::listener::serve(
        listener,
        d.title,
        io,
        stop,
        limit,
        loops,
        move |socket, peer, stop| crate::front::serve_accepted(front.clone(), socket, peer, stop),
    )
    .await;
    while resumed.join_next().await.is_some() {}
}

/// Waits for every future of `all`.
async fn join_all<F: std::future::Future<Output = ()>>(all: impl Iterator<Item = F>) {
    let mut all: Vec<_> = all.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        all.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if all.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}
