//! memcached's text and meta protocols in-process: any bytes through `TextSession::step` as the
//! connection's loop feeds it, over one engine (no WAL). A command that lets the loop go on
//! must have taken bytes, or the connection would spin on it.
#![no_main]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use sluice_server::auth::Users;
use sluice_server::kv::KvContext;
use sluice_server::text::{Flow, TextSession};

fn context() -> Arc<KvContext> {
    static CTX: OnceLock<Arc<KvContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let dir = PathBuf::from(format!("/dev/shm/sluice-fuzz-text-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Arc::new(KvContext::scratch(&dir, Users::default()).expect("engine"))
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let peer = SocketAddr::from(([127, 0, 0, 1], 40000));
        let mut session = TextSession::new(context(), 1 << 20, peer);
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
