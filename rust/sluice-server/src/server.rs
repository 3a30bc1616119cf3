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
use crate::front::{Declaration, Front, Prebound, Registration, Running, Shared};
use crate::limits::PreLogin;
use crate::replica::Followers;
use crate::stats::ConnectionStats;

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
    engine: Arc<Engine>,
    users: Arc<UserTable>,
    clustermap: Arc<ClusterMap>,
    followers: Arc<Followers>,
    /// In a cluster, the copies of the topic partitions the map makes this node a replica of.
    topic_copies: Arc<crate::topic_replica::PartitionCopies>,
    tls: Option<Arc<crate::tls::ReloadableTls>>,
    replication: crate::cluster::Replication,
}

/// The fronts this build serves, a line each. A front declares everything else itself
/// (`front::Registration`).
pub static FRONTS: &[&Registration] = &[
    &crate::connection::FRONT,
    &crate::iproto::FRONT,
    &crate::tank::FRONT,
    &crate::greenstack::FRONT,
];

/// A registered front's listeners, bound before anything starts.
struct Bound {
    registration: &'static Registration,
    plain: Option<std::net::TcpListener>,
    tls: Option<std::net::TcpListener>,
    /// What it took before the server started, if it bound its plain listener itself.
    warm: Option<Box<dyn std::any::Any + Send>>,
}

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
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        // Every listener key names a registered front's, and one front is the KV port.
        for key in config.listeners.keys() {
            if !fronts.iter().any(|r| r.declaration.listen_key == key) {
                return Err(invalid(format!(
                    "{key}: no front of this build listens there"
                )));
            }
        }
        for key in config.tls_listeners.keys() {
            if !fronts.iter().any(|r| r.declaration.tls_listen_key == key) {
                return Err(invalid(format!(
                    "{key}: no front of this build listens there"
                )));
            }
        }
        let Some(kv_port) = fronts.iter().find(|r| r.declaration.kv_port) else {
            return Err(invalid("no registered front is the KV port".into()));
        };
        if !config
            .listeners
            .contains_key(kv_port.declaration.listen_key)
        {
            return Err(invalid(format!(
                "{}: required (the node's KV port, which the cluster map names)",
                kv_port.declaration.listen_key
            )));
        }
        let tls = match &config.tls {
            Some(t) => Some(Arc::new(
                crate::tls::ReloadableTls::load(t.clone()).map_err(|e| invalid(e.to_string()))?,
            )),
            None => None,
        };
        if let (Some(key), None) = (config.tls_listeners.keys().next(), &tls) {
            return Err(invalid(format!(
                "{key}: set, but no certificate is configured (tls.certificate, tls.key)"
            )));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads.max(1))
            .thread_name("sluice-io")
            .enable_all()
            .build()?;
        let loops = Arc::new(crate::listener::IoLoops::start(config.worker_threads)?);
        let admin = match config.admin_listen {
            Some(a) => Some(bind("admin listener", "admin_listen", a)?),
            None => None,
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr()).transpose()?;
        // Each registered front's listeners: the one it bound already, or its configured
        // addresses.
        let mut prebound = prebound;
        let mut bound = Vec::new();
        for r in fronts {
            let d = &r.declaration;
            let pre = prebound
                .iter()
                .position(|p| p.name == d.name)
                .map(|i| prebound.swap_remove(i));
            let plain_addr = config.listeners.get(d.listen_key).copied();
            let tls_addr = config.tls_listeners.get(d.tls_listen_key).copied();
            let (plain, warm) = match (plain_addr, pre) {
                (None, _) => (None, None),
                (Some(_), Some(p)) => (Some(p.listener), Some(p.warm)),
                (Some(a), None) => {
                    let what = format!("{} listener", d.title);
                    (Some(bind(&what, d.listen_key, a)?), None)
                }
            };
            let tls = match tls_addr {
                Some(a) => {
                    let what = format!("TLS {} listener", d.title);
                    Some(bind(&what, d.tls_listen_key, a)?)
                }
                None => None,
            };
            if plain.is_some() || tls.is_some() {
                bound.push(Bound {
                    registration: r,
                    plain,
                    tls,
                    warm,
                });
            }
        }
        // What was bound (a port 0 becomes the real one), for STAT and /status.
        let local =
            |l: &Option<std::net::TcpListener>| l.as_ref().map(|l| l.local_addr()).transpose();
        let mut config = config;
        config.admin_listen = admin_addr;
        for b in &bound {
            let d = &b.registration.declaration;
            if let Some(a) = local(&b.plain)? {
                config.listeners.insert(d.listen_key.to_string(), a);
            }
            if let Some(a) = local(&b.tls)? {
                config.tls_listeners.insert(d.tls_listen_key.to_string(), a);
            }
        }
        for b in &bound {
            let d = &b.registration.declaration;
            let beyond = config
                .listeners
                .get(d.listen_key)
                .filter(|a| !a.ip().is_loopback());
            if let Some(a) = beyond.filter(|_| d.login && config.users.required()) {
                if !config.require_tls {
                    log::warn!(
                        "the {} listener {a} ({}) is beyond loopback and takes logins in plain \
                         text: passwords (SASL PLAIN) or their proofs cross the network \
                         unencrypted; give clients its TLS port ({}) and set require_tls",
                        d.title,
                        d.listen_key,
                        d.tls_listen_key
                    );
                }
            }
        }
        let kv = &kv_port.declaration;
        let local_addr = config.listeners[kv.listen_key];
        let tls_addr = config.tls_listeners.get(kv.tls_listen_key).copied();
        let (stop_tx, stop_rx) = watch::channel(false);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        // Each front gets what it works with; none sees the others' state.
        let stats = Arc::new(ConnectionStats::default());
        let clustermap = Arc::new(ClusterMap::new(local_addr, tls_addr));
        // The map the node starts with, before any client connects: a client told of map
        // changes hears of real ones, not of the first look at the vbuckets (`watch_layout`).
        clustermap.refresh(&engine);
        let users = Arc::new(UserTable::new(config.users.clone()));
        let prelogin = Arc::new(PreLogin::new(config.login.clone()));
        let throttle = Arc::new(crate::throttle::LoginThrottle::default());
        let tarantool_follower = match config.tarantool_upstream.clone() {
            Some(f) => {
                // The spaces' buckets must exist and keep their keys in order; a mistake
                // names its key.
                let catalog =
                    crate::iproto::Catalog::build(&engine, &config.spaces).map_err(invalid)?;
                let status = Arc::new(crate::iproto::follow::FollowStatus::new(
                    &f.upstream.address,
                ));
                runtime.spawn(crate::iproto::follow::run(
                    engine.clone(),
                    Arc::new(catalog),
                    f,
                    crate::iproto::instance_uuid(engine.instance()),
                    status.clone(),
                    stop_rx.clone(),
                ));
                Some(status)
            }
            None => None,
        };
        // The registered fronts, each built from the node's shared pieces and its own port.
        let mut running = Vec::new();
        let mut listening = Vec::new();
        for b in bound {
            let (r, d) = (b.registration, b.registration.declaration);
            let (addr, tls_listen) = (local(&b.plain)?, local(&b.tls)?);
            let shared = Shared {
                engine: &engine,
                users: &users,
                throttle: &throttle,
                clustermap: &clustermap,
                config: &config,
                policies: &policies,
                io: &stats,
                listen: addr,
                tls_listen,
                stop: &stop_rx,
                runtime: runtime.handle(),
            };
            let port = Arc::new(crate::driver::Port {
                kind: d.kind,
                noun: d.noun,
                engine: engine.clone(),
                users: users.clone(),
                prelogin: prelogin.clone(),
                io: stats.clone(),
                max_frame: (r.max_frame)(config.max_body),
                idle_timeout: config.idle_timeout,
                require_tls: config.require_tls,
                counters: Default::default(),
            });
            let front = (r.build)(&shared, port)?;
            running.push(Running {
                declaration: d,
                front: front.clone(),
                addr,
                tls_addr: tls_listen,
            });
            listening.push((d, front, b.plain, b.tls, b.warm));
        }
        let running: Arc<[Running]> = running.into();
        engine.set_cursor_drop_policy(Arc::new(crate::policy::PluginDropPolicy(policies.clone())));
        let topic_copies = Arc::new(crate::topic_replica::PartitionCopies::default());
        let followers = Arc::new(Followers::start(
            engine.clone(),
            config.replica_of.as_ref(),
            &policies,
            clustermap.clone(),
        ));
        runtime.spawn(watch_layout(
            engine.clone(),
            clustermap.clone(),
            stop_rx.clone(),
        ));
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
                engine: engine.clone(),
                users: users.clone(),
                clustermap: clustermap.clone(),
                io: stats.clone(),
                prelogin: prelogin.clone(),
                policies: policies.clone(),
                started: std::time::Instant::now(),
                registered: running.clone(),
                followers: followers.clone(),
                topic_copies: topic_copies.clone(),
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
        let listening = {
            let _enter = runtime.enter();
            let tokio = |l: Option<std::net::TcpListener>| l.map(TcpListener::from_std).transpose();
            listening
                .into_iter()
                .map(|(d, front, plain, tls, warm)| {
                    Ok((d, front, tokio(plain)?, tokio(tls)?, warm))
                })
                .collect::<std::io::Result<Vec<_>>>()?
        };
        // One limit for every listener: max_connections counts every client connection.
        let limit = Arc::new(Semaphore::new(config.max_connections));
        let io_loops = loops.clone();
        let (accepting, mut held) = watch::channel(!config.hold_connections);
        let mut stopped = stop_rx.clone();
        let tls_ = tls.clone();
        runtime.spawn(async move {
            // Connections wait in the listen backlog meanwhile; a stop ends the wait too.
            tokio::select! {
                _ = held.wait_for(|open| *open) => {}
                _ = stopped.wait_for(|stop| *stop) => {}
            }
            let each = listening.into_iter().map(|(d, front, plain, tls, warm)| {
                let accept = Accept {
                    declaration: d,
                    front,
                    stop: stop_rx.clone(),
                    limit: limit.clone(),
                    loops: io_loops.clone(),
                    io: stats.clone(),
                };
                let tls = tls.zip(tls_.clone());
                async move {
                    let a = accept.clone();
                    let plain = async move {
                        if let Some(l) = plain {
                            a.plain(l, warm).await
                        }
                    };
                    let tls = async move {
                        if let Some((l, t)) = tls {
                            accept.tls(l, t).await
                        }
                    };
                    tokio::join!(plain, tls);
                }
            });
            join_all(each).await;
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
            engine,
            users,
            clustermap,
            followers,
            topic_copies,
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
        self.users.replace(users);
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The registered fronts that run, where each listens.
    pub fn fronts(&self) -> &[Running] {
        &self.running
    }

    /// The KV port's TLS listener's address, if it runs.
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
        self.clustermap.set_report(report);
    }

    /// The node's parts a cluster map changes, to use without holding the server.
    pub fn member(&self) -> crate::cluster::Member {
        crate::cluster::Member {
            engine: self.engine.clone(),
            followers: self.followers.clone(),
            clustermap: self.clustermap.clone(),
            replication: self.replication.clone(),
            topic_copies: self.topic_copies.clone(),
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
        self.topic_copies.stop();
        let _ = self.stop.send(true);
        if let (Some(rt), Some(done)) = (self.runtime.take(), self.done.take()) {
            rt.block_on(async {
                let _ = tokio::time::timeout(grace, done).await;
            });
            for r in self.running.iter() {
                r.front.stopped();
            }
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

/// Binds one listener; a failure names the listener, its address and the key that sets it, so
/// that a clash on one port of several (two nodes on one machine) shows which one.
fn bind(
    what: &str,
    key: &str,
    address: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpListener> {
    let l = std::net::TcpListener::bind(address)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{what} {address} ({key}): {e}")))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// How one registered front's listeners accept: under the server's connection limit, each
/// connection counted, admitted by the driver and served by the front.
#[derive(Clone)]
struct Accept {
    declaration: Declaration,
    front: Arc<dyn Front>,
    stop: watch::Receiver<bool>,
    limit: Arc<Semaphore>,
    loops: Arc<crate::listener::IoLoops>,
    io: Arc<ConnectionStats>,
}

impl Accept {
    /// Accepts on its plain listener until the stop signal; the connections it took before
    /// the server started (`warm`) go on first.
    async fn plain(self, listener: TcpListener, warm: Option<Box<dyn std::any::Any + Send>>) {
        let d = self.declaration;
        let front = self.front.clone();
        let mut resumed = tokio::task::JoinSet::new();
        for r in warm
            .map(|w| front.clone().resume(w, self.stop.clone()))
            .unwrap_or_default()
        {
            let Ok(permit) = self.limit.clone().try_acquire_owned() else {
                self.io.connections_rejected.fetch_add(1, Ordering::Relaxed);
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
                self.loops.next(),
            );
        }
        self.accept_each(listener, move |socket, peer, stop| {
            front.accepted();
            crate::front::serve_accepted(front.clone(), socket.into(), peer, stop)
        })
        .await;
        while resumed.join_next().await.is_some() {}
    }

    /// Accepts on its TLS listener until the stop signal: each connection does its handshake
    /// in its own task before the driver admits it.
    async fn tls(self, listener: TcpListener, tls: Arc<crate::tls::ReloadableTls>) {
        let d = self.declaration;
        let front = self.front.clone();
        let io = self.io.clone();
        self.accept_each(listener, move |socket, peer, stop| {
            front.accepted();
            let (front, io) = (front.clone(), io.clone());
            let acceptor = tls.kv_acceptor();
            async move {
                match crate::tls::accept(acceptor, socket).await {
                    Ok(s) => crate::front::serve_accepted(front, s, peer, stop).await,
                    Err(e) => {
                        io.tls_handshake_failures.fetch_add(1, Ordering::Relaxed);
                        log::info!("closing TLS {} from {peer}: {e}", d.noun);
                    }
                }
            }
        })
        .await
    }

    /// Accepts on `listener` until the stop signal, under the server's connection limit,
    /// each connection served by `serve` on one of the I/O threads.
    async fn accept_each<F, Fut>(self, listener: TcpListener, serve: F)
    where
        F: Fn(tokio::net::TcpStream, SocketAddr, watch::Receiver<bool>) -> Fut
            + Send
            + Sync
            + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        crate::listener::serve(
            listener,
            self.declaration.title,
            self.io,
            self.stop,
            self.limit,
            self.loops,
            serve,
        )
        .await
    }
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
