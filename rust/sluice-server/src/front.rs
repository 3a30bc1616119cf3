//! The registry of fronts: what a front declares, and what the server builds it from. A front
//! is its folder plus one registration line (`server::FRONTS`); its listeners (plain and TLS),
//! the bounds of its connections (the driver's), its metrics and its section of `/status`, its
//! configuration keys and its command-line flag all come from its `Registration`, so the server,
//! the admin endpoint and the Python side never name it.

use std::any::Any;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use sluice_core::Engine;
use tokio::sync::watch;

use crate::auth::UserTable;
use crate::clustermap::ClusterMap;
use crate::config::ServerConfig;
use crate::driver::{Conn, Port};
use crate::policy::PolicyHost;
use crate::stats::ConnectionStats;
use crate::throttle::LoginThrottle;
use crate::tls::MaybeTls;

/// What a front says of itself.
#[derive(Debug, Clone, Copy)]
pub struct Declaration {
    /// Its name: its `/status` section goes under it.
    pub name: &'static str,
    /// What people call it, in log lines and the ready line ("iproto", "TANK").
    pub title: &'static str,
    /// Its listener's configuration key (`<name>_listen`, or `listen` for the memcached port);
    /// its command-line flag is the key with dashes (`--iproto-listen`).
    pub listen_key: &'static str,
    /// Where it listens unless the configuration says otherwise ("" for nowhere).
    pub default_listen: &'static str,
    /// Its TLS listener's key (`<name>_tls_listen`): the same protocol inside TLS, with the
    /// node's `[tls]` certificate, on a port of its own (as 11207 is next to 11210).
    pub tls_listen_key: &'static str,
    /// Where its TLS listener is when a certificate is configured and its key says "auto"
    /// ("": it has no such default, and listens with TLS only where its key says).
    pub default_tls_listen: &'static str,
    /// One line for the configuration reference and `--help`.
    pub doc: &'static str,
    /// Whether its clients log in. A listener beyond loopback of a front without a login is
    /// served only when the operator insists.
    pub login: bool,
    /// The kind its protocol errors are counted and rate-limited under.
    pub kind: &'static str,
    /// What a log line calls one of its connections.
    pub noun: &'static str,
    /// Whether it is the node's KV port: it always listens, and its addresses are the node's
    /// in the cluster map. Exactly one registered front is.
    pub kv_port: bool,
}

/// A running front: the server hands it each connection the driver admitted.
pub trait Front: Send + Sync + 'static {
    /// Runs one connection to its end (picks its session and calls `driver::run`).
    fn serve(self: Arc<Self>, conn: Conn) -> Serving;

    /// What the driver holds its connections to.
    fn port(&self) -> Arc<Port>;

    /// A connection was accepted (counted before the driver admits it).
    fn accepted(&self) {}

    /// Its Prometheus lines.
    fn metrics(&self, _out: &mut String) {}

    /// Its section of `/status`.
    fn status(&self) -> serde_json::Value {
        serde_json::Value::Null
    }

    /// The server stopped and its connections ended (or their grace ran out): what the front
    /// holds for connections that may come back is let go.
    fn stopped(&self) {}

    /// Connections taken before the server started (a warm-up), to run first.
    fn resume(
        self: Arc<Self>,
        _warm: Box<dyn Any + Send>,
        _stop: watch::Receiver<bool>,
    ) -> Vec<Resumed> {
        Vec::new()
    }
}

/// A connection a front took before the server started, and how it goes on.
pub struct Resumed {
    pub socket: std::net::TcpStream,
    pub peer: SocketAddr,
    pub run: Box<dyn FnOnce(tokio::net::TcpStream) -> Serving + Send>,
}

/// A connection's run to its end, as a front hands it to the server.
pub type Serving = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How a front is built from the node's shared pieces and its port.
pub type Build = fn(&Shared<'_>, Arc<Port>) -> std::io::Result<Arc<dyn Front>>;

/// What a front is built from: the node's shared pieces, never another front or the server.
pub struct Shared<'a> {
    pub engine: &'a Arc<Engine>,
    pub users: &'a Arc<UserTable>,
    /// Failed logins slow the next ones, on every port.
    pub throttle: &'a Arc<LoginThrottle>,
    pub clustermap: &'a Arc<ClusterMap>,
    /// The node's settings, with the addresses bound.
    pub config: &'a ServerConfig,
    /// The policy plugins (change streams consult them).
    pub policies: &'a Arc<PolicyHost>,
    /// The node's connection counters, every port's.
    pub io: &'a Arc<ConnectionStats>,
    /// Where it listens (the ports bound): in plain, and with TLS.
    pub listen: Option<SocketAddr>,
    pub tls_listen: Option<SocketAddr>,
    /// The server's stop, for work a front runs besides its connections.
    pub stop: &'a watch::Receiver<bool>,
    /// The runtime the server's own tasks run on.
    pub runtime: &'a tokio::runtime::Handle,
}

/// How the server builds a front: its declaration and its constructor.
pub struct Registration {
    pub declaration: Declaration,
    /// The largest frame its connections may send once logged in, from the largest request
    /// body the node takes (its largest item and room for framing).
    pub max_frame: fn(usize) -> usize,
    pub build: Build,
}

/// A registered front that runs, where it listens.
pub struct Running {
    pub declaration: Declaration,
    pub front: Arc<dyn Front>,
    /// Its plain listener's address, if it has one.
    pub addr: Option<SocketAddr>,
    /// Its TLS listener's address, if it has one.
    pub tls_addr: Option<SocketAddr>,
}

/// A listener a front bound before the server started (its warm-up), with what it holds.
pub struct Prebound {
    pub name: &'static str,
    pub listener: std::net::TcpListener,
    pub warm: Box<dyn Any + Send>,
}

/// Runs one accepted connection of `front` to its end: admitted by the driver under the
/// front's port, then served. What the server does with every connection of a registered
/// front, plain or TLS, once counted (`Front::accepted`) and past its handshake.
pub async fn serve_accepted(
    front: Arc<dyn Front>,
    socket: MaybeTls,
    peer: SocketAddr,
    stop: watch::Receiver<bool>,
) {
    let port = front.port();
    crate::driver::serve_connection(socket, peer, stop, port, |conn| front.serve(conn)).await
}
