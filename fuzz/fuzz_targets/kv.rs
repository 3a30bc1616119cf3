//! The memcached front in-process: any bytes, cut into frames as a connection cuts them, through
//! `KvSession::handle` over one engine (no WAL), as a client that never logged in would send
//! them. Every opcode's handler (sub-document paths, arithmetic, touch, stats, HELLO, SASL,
//! collections, GET_META and the rest) sees what libFuzzer makes of them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::mcbp;
use sluice_server::kv::{Flow, KvSession};

fuzz_target!(|data: &[u8]| {
    let mut session = KvSession::new(sluice_fuzz::kv_context("kv"));
    let mut rest = data;
    let mut out = Vec::new();
    while let Ok(Some(n)) = mcbp::frame_len(rest, 1 << 20) {
        out.clear();
        if let Flow::Close = session.handle(&rest[..n], &mut out) {
            break;
        }
        rest = &rest[n..];
    }
});
