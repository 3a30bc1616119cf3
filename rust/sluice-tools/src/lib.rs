//! Tools that measure a server from the outside, kept out of the server crate: the pipelined
//! load generator behind `sluice bench` (`bench`) and the native TAP reader the TAP benchmark
//! drains a stream with (`tap_reader`), and `sluice tarantool-tail`, which prints what a
//! Tarantool replicates (`tarantool_tail`). Clients of the wire only; they work against sluice and
//! memcached alike. `tarantool_schema` reads a Tarantool's spaces for `sluice serve
//! --follow-tarantool`.
//!
//! May depend on sluice-proto and sluice-server (for its TLS client settings); only sluice-py
//! depends on it.

pub mod bench;
pub mod tap_reader;
pub mod tarantool_schema;
pub mod tarantool_tail;
