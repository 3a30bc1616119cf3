//! sluice's network side: a tokio runtime of its own, listeners, connections, and the
//! memcached binary protocol over the engine, with its DCP and TAP change streams. `Server` owns
//! the runtime; `connection` runs one client; `kv` turns one request into its response;
//! `stream` is the protocol-neutral change stream that `dcp` and `tap` encode.
//!
//! No hub: `server` builds one context per front (`kv::KvContext`, `dcp::producer::DcpContext`,
//! `tap::TapContext`) holding only what that front works with, and a connection that opens a
//! stream hands itself over (`kv::Handoff`). A new front (Greenstack, TANK, iproto) gets its own
//! context the same way and sits beside `dcp` and `tap`. Modules import only from the layers
//! below them (see `tests/test_layering.py`): leaves, then counters and limits, the KV front,
//! the stream fronts, replication, the connection, the admin endpoint, the server.
//!
//! May depend on sluice-proto and sluice-core, never on sluice-py.

pub mod admin;
pub mod armed;
pub mod auth;
pub mod cluster;
pub mod clustermap;
pub mod config;
pub mod connection;
pub mod dcp;
pub mod driver;
pub mod front;
pub mod greenstack;
pub mod iproto;
pub mod kv;
pub mod limits;
pub mod listener;
pub mod login;
pub mod metrics;
pub mod policy;
pub mod ratelimit;
pub mod replica;
pub mod request;
pub mod router;
pub mod scram;
pub mod server;
pub mod settings;
pub mod space;
pub mod stats;
pub mod stream;
pub mod tank;
pub mod tap;
pub mod throttle;
pub mod tls;
pub mod topic_placement;
pub mod topic_replica;
pub mod upstream;

pub use config::ServerConfig;
pub use server::Server;
