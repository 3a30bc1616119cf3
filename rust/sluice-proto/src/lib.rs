//! Wire codecs for sluice: pure functions over bytes, no I/O, so every decoder can be fuzzed.
//!
//! `base64` is RFC 4648's (SCRAM, HTTP Basic, the iproto greeting's salt); `msgpack` holds the primitives shared by the WAL row codec (sluice-core) and iproto;
//! `mcbp` is the memcached binary protocol frame (KV, DCP and TAP); `dcp` and `tap` the change
//! stream messages carried in it; `errormap` the statuses as Couchbase's clients learn them
//! (GET_ERROR_MAP); `iproto` is Tarantool's binary protocol (requests, answers, greeting, tuple
//! formats and UPDATE operations); `keyorder` the order of iproto primary keys (MessagePack
//! arrays of parts); `tank` is TANK's protocol (frames, produce and consume, bundles);
//! `greenstack` is Couchbase's Greenstack frame (flag bytes, flex headers, numbering); `xattr`
//! the extended attributes a Couchbase document's value may start with.
//!
//! Depends on no other crate of the workspace (tests/test_layering.py keeps it so); `snap` for
//! TANK's Snappy bundles.

pub mod base64;
pub mod dcp;
pub mod errormap;
pub mod greenstack;
pub mod iproto;
pub mod keyorder;
pub mod mcbp;
pub mod msgpack;
pub mod tank;
pub mod tap;
pub mod xattr;
