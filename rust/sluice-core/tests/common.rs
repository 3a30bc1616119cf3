//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use sluice_core::bucket::Bucket;
use sluice_core::wal::WalMode;
use sluice_core::{BucketConfig, Engine, EngineConfig};

pub fn config(dir: &Path, mode: WalMode, num_vbuckets: u16) -> EngineConfig {
    let mut b = BucketConfig::named("default");
    b.num_vbuckets = num_vbuckets;
    EngineConfig {
        data_dir: dir.to_path_buf(),
        wal_mode: mode,
        snapshot_interval: Duration::ZERO,
        buckets: vec![b],
        ..Default::default()
    }
}

/// Every current version in the bucket (tombstones included): key -> (value, deleted, seqno).
pub fn dump(
    engine: &Engine,
    bucket: &std::sync::Arc<Bucket>,
) -> BTreeMap<Vec<u8>, (Vec<u8>, bool, u64)> {
    let mut out = BTreeMap::new();
    for (vb, high) in engine.high_seqnos(bucket).into_iter().enumerate() {
        let bf = engine
            .backfill(bucket, vb as u16, 1, high)
            .expect("backfill");
        for chunk in bf {
            for it in chunk {
                out.insert(
                    it.key().to_vec(),
                    (it.value().to_vec(), it.meta.deleted, it.meta.by_seqno),
                );
            }
        }
    }
    out
}

/// Live items only: key -> value.
pub fn live(engine: &Engine, bucket: &std::sync::Arc<Bucket>) -> BTreeMap<Vec<u8>, Vec<u8>> {
    dump(engine, bucket)
        .into_iter()
        .filter(|(_, v)| !v.1)
        .map(|(k, v)| (k, v.0))
        .collect()
}
