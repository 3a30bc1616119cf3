//! Wire codecs for sluice: pure functions over bytes, no I/O, so every decoder can be fuzzed.
//!
//! `msgpack` holds the primitives shared by the WAL row codec (sluice-core) and, later, iproto.

pub mod msgpack;
