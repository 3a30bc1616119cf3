//! memcached's text and meta protocols in-process: any bytes through `TextSession::step` as the
//! connection's loop feeds it, over one engine (no WAL). A command that lets the loop go on
//! must have taken bytes, or the connection would spin on it.
#![no_main]

use std::net::SocketAddr;

use libfuzzer_sys::fuzz_target;
use sluice_server::kv::text::{Flow, TextSession};

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let peer = SocketAddr::from(([127, 0, 0, 1], 40000));
        let mut session = TextSession::new(sluice_fuzz::kv_context("text"), 1 << 20, peer);
        let mut rest = data;
        let mut out = Vec::new();
        loop {
            out.clear();
            let (took, flow) = session.step(rest, &mut out).await;
            rest = &rest[took..];
            match flow {
                Flow::Continue => assert!(took > 0, "Continue without taking a byte"),
                Flow::More | Flow::Close => break,
            }
        }
    });
});
