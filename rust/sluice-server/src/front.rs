//! The registry of fronts: what a front declares, and what the server builds it from. A front
//! is its folder plus one registration line (`server::FRONTS`); its listener, the bounds of its
//! connections (the driver's), its metrics and its section of `/status`, its configuration key
//! and its command-line flag all come from its `Registration`, so the server, the admin endpoint
//! and the Python side never name it.

use std::any::Any;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use sluice_core::Engine;
use tokio::sync::watch;

use crate::auth::UserTable;
use crate::clustermap::ClusterMap;
use crate::driver::{Conn, Port};
use crate::throttle::LoginThrottle;

/// What a front says of itself.
#[derive(Debug, Clone, Copy)]
pub struct Declaration {
    /// Its name: its listener's key is `<name>_listen`, its flag `--<name>-listen`, and its
    /// metrics and `/status` section go under it.
    pub name: &'static str,
    /// What people call it, in log lines and the ready line ("iproto", "TANK").
    pub title: &'static str,
    /// Where it listens unless the configuration says otherwise ("" for nowhere).
    pub default_listen: &'static str,
    /// One line for the configuration reference and `--help`.
    pub doc: &'static str,
    /// Whether its clients log in. A listener beyond loopback of a front without a login is
    /// served only when the operator insists.
    pub login: bool,
    /// The kind its protocol errors are counted and rate-limited under.
    pub kind: &'static str,
    /// What a log line calls one of its connections.
    pub noun: &'static str,
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
    /// The configured spaces (`[spaces.NAME]`).
    pub spaces: &'a [crate::space::SpaceConfig],
    /// The spaces a Tarantool is followed into (`[tarantool_upstream]`; empty: all of them),
    /// if one is.
    pub followed: Option<&'a [String]>,
    /// Where it listens (the port bound).
    pub listen: SocketAddr,
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
    pub addr: SocketAddr,
}

/// A listener a front bound before the server started (its warm-up), with what it holds.
pub struct Prebound {
    pub name: &'static str,
    pub listener: std::net::TcpListener,
    pub warm: Box<dyn Any + Send>,
}

/// Runs one accepted connection of `front` to its end: counted, admitted by the driver under
/// the front's port, then served. What the server does with every connection of a registered
/// front (and how the fuzz targets drive one over loopback sockets).
pub async fn serve_accepted(
    front: Arc<dyn Front>,
    socket: tokio::net::TcpStream,
    peer: SocketAddr,
    stop: watch::Receiver<bool>,
) {
    front.accepted();
    let port = front.port();
    crate::driver::serve_connection(socket.into(), peer, stop, port, |conn| front.serve(conn)).await
}
