//! What the in-process server tests share: a scratch engine and the server's settings.

use std::time::Duration;

use sluice_core::{BucketConfig, Engine, EngineConfig};
use sluice_server::config::ServerConfig;
use sluice_server::settings::Settings;

/// An engine over `dir` with the bucket `default` of 4 vbuckets and no background snapshots.
pub fn engine(dir: &std::path::Path) -> Engine {
    let mut bucket = BucketConfig::named("default");
    bucket.num_vbuckets = 4;
    Engine::open(EngineConfig {
        data_dir: dir.to_path_buf(),
        snapshot_interval: Duration::ZERO,
        buckets: vec![bucket],
        ..Default::default()
    })
    .expect("an engine")
}

/// The server's configuration from settings as the Python side sends them (JSON), checked.
pub fn config(json: &str) -> ServerConfig {
    Settings::from_json(json)
        .and_then(|s| s.check(1 << 20, false))
        .expect("valid settings")
        .config
}
