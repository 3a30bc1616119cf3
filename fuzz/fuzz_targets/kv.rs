//! The memcached front in-process: any bytes, cut into frames as a connection cuts them, through
//! `KvSession::handle` over one engine (no WAL), as a client that never logged in would send
//! them. Every opcode's handler (sub-document paths, arithmetic, touch, stats, HELLO, SASL,
//! collections, GET_META and the rest) sees what libFuzzer makes of them.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sluice_core::wal::WalMode;
use sluice_core::{BucketConfig, Engine, EngineConfig};
use sluice_proto::mcbp;
use sluice_server::auth::{UserTable, Users};
use sluice_server::clustermap::ClusterMap;
use sluice_server::kv::{Flow, KvContext, KvSession};

fn context() -> Arc<KvContext> {
    static CTX: OnceLock<Arc<KvContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let dir =
            std::path::PathBuf::from(format!("/dev/shm/sluice-fuzz-kv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut b = BucketConfig::named("default");
        b.num_vbuckets = 4;
        let engine = Engine::open(EngineConfig {
            data_dir: dir,
            wal_mode: WalMode::None,
            snapshot_interval: Duration::ZERO,
            buckets: vec![b],
            ..Default::default()
        })
        .expect("engine");
        Arc::new(KvContext {
            engine: Arc::new(engine),
            users: Arc::new(UserTable::new(Users::default())),
            stats: Default::default(),
            started: std::time::Instant::now(),
            tap_applied: Default::default(),
            clustermap: Arc::new(ClusterMap::new("127.0.0.1:11210".parse().unwrap(), None)),
            spaces: Arc::from([]),
        })
    })
    .clone()
}

fuzz_target!(|data: &[u8]| {
    let mut session = KvSession::new(context());
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
