//! Tarantool's binary protocol (iproto) as Tarantool 2.6 speaks it: pure functions over bytes,
//! checked against what tarantool-python 1.3 and net.box 2.6 send and what a real 2.6 server
//! answers (shared/reference/tarantool-captures).
//!
//! `codes` names request types, map keys and error codes; `frame` finds where a packet ends;
//! `request` decodes a packet into a header and a typed request, with Tarantool's error codes
//! and texts for what it refuses; `response` writes answers byte for byte as Tarantool does;
//! `greeting` is the 128-byte text a server sends first; `tuple` checks tuples against a space
//! format and extracts keys; `update` parses and applies UPDATE and UPSERT operations; `json` prints tuples as JSON; `xrow` reads the rows of Tarantool's files and replication
//! streams, `xlog` the files' meta block and block headers; `client`
//! writes requests and reads answers, for a client of a Tarantool or a sluice.
//!
//! Every decoder checks a length against the bytes that remain before it slices or allocates,
//! and bounds nesting by [`MAX_DEPTH`], so hostile input costs at most a small multiple of its
//! own size.

pub mod client;
pub mod codes;
pub mod frame;
pub mod greeting;
pub mod json;
pub mod request;
pub mod response;
pub mod tuple;
pub mod update;
pub mod xlog;
pub mod xrow;

/// The deepest nesting of arrays and maps accepted anywhere in a packet (a tuple, a key, an
/// operation's argument). Tarantool itself has no limit; 128 levels is beyond any real tuple and
/// keeps a hostile packet from costing more than a few kilobytes of bookkeeping.
pub const MAX_DEPTH: usize = 128;

/// The MessagePack extension types Tarantool defines for field values.
pub const EXT_DECIMAL: i8 = 1;
pub const EXT_UUID: i8 = 2;

/// The largest packet (header and body, length prefix excluded) a server should accept by
/// default. Tarantool allows 2 GiB; a front passes its own bound to [`frame::check`].
pub const MAX_PACKET_SIZE: usize = 16 * 1024 * 1024;

/// A value's type as Tarantool's MessagePack library classifies its first byte (`mp_typeof`).
/// Tarantool checks request fields by this class, so a non-negative number written with a
/// signed marker (`d0 05`) is an `Int`, not a `UInt`, and is refused where a `UInt` is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MpType {
    Nil,
    UInt,
    Int,
    Str,
    Bin,
    Array,
    Map,
    Bool,
    Float,
    Double,
    Ext,
}

#[inline]
pub(crate) fn mp_type(marker: u8) -> MpType {
    match marker {
        0x00..=0x7f | 0xcc..=0xcf => MpType::UInt,
        0x80..=0x8f | 0xde | 0xdf => MpType::Map,
        0x90..=0x9f | 0xdc | 0xdd => MpType::Array,
        0xa0..=0xbf | 0xd9..=0xdb => MpType::Str,
        // 0xc1 is never a value; the readers refuse it before its class matters.
        0xc0 | 0xc1 => MpType::Nil,
        0xc2 | 0xc3 => MpType::Bool,
        0xc4..=0xc6 => MpType::Bin,
        0xc7..=0xc9 | 0xd4..=0xd8 => MpType::Ext,
        0xca => MpType::Float,
        0xcb => MpType::Double,
        0xd0..=0xd3 | 0xe0..=0xff => MpType::Int,
    }
}

/// Bytes from the hex the captures print.
#[cfg(test)]
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
