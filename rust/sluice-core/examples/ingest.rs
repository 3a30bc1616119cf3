//! Ingest N items (16-byte keys, 100-byte values) through `Engine::set_many` in batches and
//! print items/s as JSON. Used by bench/engine_bench.py; run it by hand with
//! `cargo run --release --example ingest -- DIR [N] [write|fsync|none] [BATCH] [LRU_QUOTA]`.
//! With LRU_QUOTA (bytes) the default bucket has that memory quota and `eviction = "lru"`.

use std::time::Instant;

use sluice_core::{Engine, EngineConfig};

fn main() {
    sluice_core::alloc::tune();
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).expect("usage: ingest DIR [N] [MODE] [BATCH]");
    let n: usize = args
        .get(2)
        .map(|s| s.parse().expect("N"))
        .unwrap_or(1_000_000);
    let mode = args.get(3).map(String::as_str).unwrap_or("write");
    let batch: usize = args
        .get(4)
        .map(|s| s.parse().expect("BATCH"))
        .unwrap_or(10_000);
    let mut cfg = EngineConfig {
        data_dir: dir.into(),
        wal_mode: sluice_core::wal::WalMode::parse(mode).expect("mode is none, write or fsync"),
        snapshot_interval: std::time::Duration::ZERO,
        ..Default::default()
    };
    if let Some(quota) = args.get(5) {
        cfg.buckets[0].memory_quota = quota.parse().expect("LRU_QUOTA");
        cfg.buckets[0].eviction = sluice_core::config::Eviction::Lru;
    }
    let engine = Engine::open(cfg).expect("open");
    let bucket = engine.bucket("default").expect("default bucket");
    let keys: Vec<[u8; 16]> = (0..n)
        .map(|i| {
            let mut k = [b'k'; 16];
            k[6..].copy_from_slice(format!("{i:010}").as_bytes());
            k
        })
        .collect();
    let value = [b'v'; 100];
    let rss_before = rss_bytes();
    let t = Instant::now();
    let mut last = 0;
    for chunk in keys.chunks(batch) {
        let items: Vec<(&[u8], &[u8])> = chunk.iter().map(|k| (&k[..], &value[..])).collect();
        last = engine
            .set_many(&bucket, &items, 0, 0, None)
            .expect("set_many");
    }
    let applied = t.elapsed();
    if mode != "none" {
        engine.wal().wait_durable(last, None).expect("durable");
    }
    let durable = t.elapsed();
    // Checkpoint entries are expelled once persisted; what remains is the items themselves.
    // Wait for two maintenance ticks, which return freed memory to the OS.
    std::thread::sleep(std::time::Duration::from_millis(4500));
    sluice_core::alloc::release_free_memory();
    let rss_after = rss_bytes();
    let stats = engine.bucket("default").expect("bucket");
    println!(
        "{{\"items\": {n}, \"mode\": \"{mode}\", \"batch\": {batch}, \"applied_s\": {:.4}, \"durable_s\": {:.4}, \"items_per_s\": {:.0}, \"rss_before\": {rss_before}, \"rss_after\": {rss_after}, \"mem_used\": {}, \"checkpoint_mem\": {}, \"evictions\": {}}}",
        applied.as_secs_f64(),
        durable.as_secs_f64(),
        n as f64 / durable.as_secs_f64(),
        stats.mem_used(),
        stats.checkpoint_mem(),
        stats
            .stats
            .evictions
            .load(std::sync::atomic::Ordering::Relaxed),
    );
    engine.close();
}

/// Resident set size from /proc/self/statm.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

#[global_allocator]
static GLOBAL: sluice_core::alloc::Allocator = sluice_core::alloc::ALLOCATOR;
