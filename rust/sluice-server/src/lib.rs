//! sluice's network side: a tokio runtime of its own, listeners, connections, and the
//! memcached binary protocol over the engine, with its DCP and TAP change streams. `Server` owns
//! the runtime; `connection` runs one client; `kv` turns one request into its response;
//! `stream` is the protocol-neutral change stream that `dcp` and `tap` encode.
//!
//! May depend on sluice-proto and sluice-core, never on sluice-py.

pub mod admin;
pub mod auth;
pub mod config;
pub mod connection;
pub mod dcp;
pub mod kv;
pub mod limits;
pub mod login;
pub mod metrics;
pub mod policy;
pub mod ratelimit;
pub mod replica;
pub mod server;
pub mod stats;
pub mod stream;
pub mod tap;
pub mod tls;

pub use config::ServerConfig;
pub use server::Server;
