//! The server's settings, as the Python side builds them from the configuration file: the
//! listeners, limits, users, TLS, replication and TAP.

use std::net::SocketAddr;
use std::time::Duration;

/// The defaults of the settings below that every caller sets (the Python side's keyword
/// defaults and config.py's `DEFAULTS` read them from here): their one definition.
pub mod defaults {
    use std::time::Duration;

    pub const MAX_CONNECTIONS: usize = 10_000;
    /// Zero: a silent connection is never closed.
    pub const IDLE_TIMEOUT: Duration = Duration::ZERO;
    pub const IO_THREADS: usize = 2;
    pub const REPLICATION_NOOP_INTERVAL: u32 = 1;
    /// Whether the admin endpoint serves HTTPS when a certificate is configured.
    pub const TLS_ADMIN: bool = true;
    /// Whether replication connections use TLS.
    pub const REPLICATION_TLS: bool = false;
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
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
    /// The certificate and key of the TLS listeners (and of the admin endpoint when
    /// `tls.admin`).
    pub tls: Option<crate::tls::TlsSettings>,
    /// Refuse logins on plain-text connections from beyond loopback.
    pub require_tls: bool,
    /// The registered fronts' listeners by the keys they declare (`listen`, `iproto_listen`);
    /// a front with neither a listener nor a TLS one does not run.
    pub listeners: std::collections::BTreeMap<String, SocketAddr>,
    /// Their TLS listeners by key (`tls_listen`, `iproto_tls_listen`); they need `tls`.
    pub tls_listeners: std::collections::BTreeMap<String, SocketAddr>,
    /// The spaces iproto serves (`[spaces.NAME]`), each in its bucket.
    pub spaces: Vec<crate::space::SpaceConfig>,
    /// A Tarantool whose rows this node applies to its spaces (`[tarantool_upstream]`).
    pub tarantool_upstream: Option<crate::upstream::FollowConfig>,
    /// Bind the client listeners but accept no connection until `Server::accept_connections`:
    /// a node of a cluster first converges on the map, so that no client finds the vbuckets
    /// it held before it was failed over.
    pub hold_connections: bool,
}

impl ServerConfig {
    /// How this node logs in to and talks with the nodes it replicates from.
    pub fn replication(&self) -> crate::cluster::Replication {
        crate::cluster::Replication {
            username: self.replication_login.0.clone(),
            password: self.replication_login.1.clone(),
            noop_interval: self.replication_noop_interval,
            tls: self.replication_tls.clone(),
        }
    }
}
