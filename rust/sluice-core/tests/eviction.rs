//! Eviction (`eviction = "lru"`): writes past the memory quota keep succeeding, memory stays
//! under the quota, items read recently survive over items never read, each eviction is a
//! deletion in the WAL (a restart does not bring it back); with `eviction = "none"` the same
//! load gets TMPFAIL.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

use sluice_core::config::Eviction;
use sluice_core::wal::WalMode;
use sluice_core::{Engine, EngineConfig, StoreRequest};

const QUOTA: usize = 4 << 20;
const HOT: usize = 200;
const COLD: usize = 200;
/// Five times the quota in 1 KiB values.
const STREAM: usize = 5 * QUOTA / 1024;

fn cache_config(dir: &std::path::Path, eviction: Eviction) -> EngineConfig {
    let mut cfg = common::config(dir, WalMode::Write, 4);
    cfg.buckets[0].memory_quota = QUOTA;
    cfg.buckets[0].eviction = eviction;
    cfg
}

fn readable(engine: &Engine, keys: impl Iterator<Item = String>) -> BTreeSet<String> {
    let bucket = engine.bucket("default").unwrap();
    keys.filter(|k| engine.get(&bucket, k.as_bytes()).unwrap().is_some())
        .collect()
}

#[test]
fn lru_evicts_cold_items_to_keep_writes_going_under_the_quota() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = cache_config(dir.path(), Eviction::Lru);
    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let value = vec![b'v'; 1024];
    let hot = |i: usize| format!("hot-{i}");
    let cold = |i: usize| format!("cold-{i}");
    for i in 0..HOT {
        engine
            .store(&bucket, &StoreRequest::set(hot(i).as_bytes(), &value))
            .unwrap();
        engine
            .store(&bucket, &StoreRequest::set(cold(i).as_bytes(), &value))
            .unwrap();
    }
    let mut peak = 0;
    for i in 0..STREAM {
        // Every write is accepted: eviction makes room.
        engine
            .store(
                &bucket,
                &StoreRequest::set(format!("new-{i}").as_bytes(), &value),
            )
            .unwrap_or_else(|e| panic!("write {i} refused: {e}"));
        peak = peak.max(bucket.mem_used());
        // Each hot key is read once every HOT writes; cold keys never are.
        engine.get(&bucket, hot(i % HOT).as_bytes()).unwrap();
    }
    assert!(peak <= QUOTA, "memory peaked at {peak}, quota {QUOTA}");
    // The last writes' checkpoint entries are freed once the WAL has written them (the
    // maintenance thread's next turn): under a busy machine that can take a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while bucket.mem_used() > bucket.config.high_watermark_bytes() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} above the high watermark after 30 s",
            bucket.mem_used()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let hot_left = readable(&engine, (0..HOT).map(hot)).len();
    let cold_left = readable(&engine, (0..COLD).map(cold)).len();
    assert!(
        hot_left >= HOT * 9 / 10,
        "recently read keys survive: {hot_left} of {HOT}"
    );
    assert!(
        cold_left <= COLD / 10,
        "never read keys are evicted: {cold_left} of {COLD}"
    );
    let evictions = bucket.stats.evictions.load(Ordering::Relaxed) as usize;
    let stream_left = readable(&engine, (0..STREAM).map(|i| format!("new-{i}")));
    let lost = (HOT - hot_left) + (COLD - cold_left) + (STREAM - stream_left.len());
    assert_eq!(
        evictions, lost,
        "every missing key was evicted, and counted"
    );
    assert!(evictions > STREAM / 2, "{evictions} evictions");
    // Evictions are deletions with their own seqnos: the dump holds no evicted key as live.
    let live = common::live(&engine, &bucket);
    assert!(live.len() <= HOT + COLD + STREAM - evictions);

    // A restart replays the evictions from the WAL: no evicted key comes back.
    let before: BTreeSet<Vec<u8>> = live.into_keys().collect();
    engine.close();
    drop(engine);
    let engine = Engine::open(cfg).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let after: BTreeSet<Vec<u8>> = common::live(&engine, &bucket).into_keys().collect();
    assert_eq!(before, after);
}

#[test]
fn without_eviction_the_same_load_fails_temporarily() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(cache_config(dir.path(), Eviction::None)).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let value = vec![b'v'; 1024];
    let refused = (0..STREAM)
        .map(|i| {
            engine.store(
                &bucket,
                &StoreRequest::set(format!("k{i}").as_bytes(), &value),
            )
        })
        .find_map(|r| r.err())
        .expect("the quota bites");
    assert!(
        matches!(refused, sluice_core::Error::TempFail(ref why) if why.contains("high watermark")),
        "{refused}"
    );
    assert_eq!(bucket.stats.evictions.load(Ordering::Relaxed), 0);
}
