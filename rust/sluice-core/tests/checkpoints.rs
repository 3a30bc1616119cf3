//! Checkpoints and backfill through the engine: backfill consistency while writers run, the
//! switch from backfill to a cursor without gaps or duplicates, and cursor dropping when
//! checkpoint memory passes its quota.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sluice_core::checkpoint::CursorRead;
use sluice_core::wal::WalMode;
use sluice_core::{Engine, StoreRequest};

/// What a writer did: per vbucket, seqno -> (key, value or None for a deletion).
type History = HashMap<u16, BTreeMap<u64, (Vec<u8>, Option<Vec<u8>>)>>;

fn writer(
    engine: Arc<Engine>,
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<History>>,
    seed: u64,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let bucket = engine.bucket("default").unwrap();
        let mut x = seed;
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) && n < 200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            n += 1;
            let key = format!("key-{}", x % 500).into_bytes();
            let (r, value) = if x.is_multiple_of(5) {
                match engine.delete(&bucket, &key, 0, None) {
                    Ok(r) => (r, None),
                    Err(_) => continue,
                }
            } else {
                let v = format!("{seed}-{n}").into_bytes();
                (
                    engine.store(&bucket, &StoreRequest::set(&key, &v)).unwrap(),
                    Some(v),
                )
            };
            history
                .lock()
                .unwrap()
                .entry(r.vbucket)
                .or_default()
                .insert(r.seqno, (key, value));
        }
    })
}

/// The latest version of each key with seqno <= end, from the writers' history.
fn expected(
    history: &BTreeMap<u64, (Vec<u8>, Option<Vec<u8>>)>,
    end: u64,
) -> BTreeMap<Vec<u8>, (u64, Option<Vec<u8>>)> {
    let mut out = BTreeMap::new();
    for (&s, (k, v)) in history.range(..=end) {
        out.insert(k.clone(), (s, v.clone()));
    }
    out
}

#[test]
fn backfill_is_a_consistent_snapshot_while_writers_run() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap());
    let bucket = engine.bucket("default").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let history = Arc::new(Mutex::new(History::new()));
    let writers: Vec<_> = (1..=2)
        .map(|s| writer(engine.clone(), stop.clone(), history.clone(), s * 7919))
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut checked = 0;
    for round in 0..20 {
        let vb = round % 4;
        let mut bf = engine.backfill(&bucket, vb, 1, u64::MAX).unwrap();
        let (_, end) = bf.range();
        let mut got: Vec<(u64, Vec<u8>, Option<Vec<u8>>)> = Vec::new();
        loop {
            let chunk = bf.next_chunk(7);
            if chunk.is_empty() {
                break;
            }
            for it in chunk {
                let v = if it.meta.deleted {
                    None
                } else {
                    Some(it.value().to_vec())
                };
                got.push((it.meta.by_seqno, it.key().to_vec(), v));
            }
            std::thread::yield_now();
        }
        assert!(
            got.windows(2).all(|w| w[0].0 < w[1].0),
            "seqnos strictly increasing"
        );
        assert!(got.iter().all(|g| g.0 <= end), "nothing past the end seqno");
        // A writer records its change just after the engine returns: wait until every seqno up
        // to the end (contiguous: only these writers touch the bucket) is in the history. The
        // lock is let go between looks, so that the writers can record (a mutex is not fair,
        // and a loop taking it back at once can starve them on two cores).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let want = loop {
            {
                let h = history.lock().unwrap();
                let hv = h.get(&vb);
                let recorded = hv.map_or(0, |hv| hv.range(..=end).count() as u64);
                if recorded == end {
                    break hv.map(|hv| expected(hv, end)).unwrap_or_default();
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the writers recorded {recorded} of vbucket {vb}'s {end} changes"
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        let n = got.len();
        let got_map: BTreeMap<Vec<u8>, (u64, Option<Vec<u8>>)> =
            got.into_iter().map(|(s, k, v)| (k, (s, v))).collect();
        assert_eq!(got_map.len(), n, "each key once");
        let differ: Vec<_> = want
            .keys()
            .chain(got_map.keys())
            .filter(|k| want.get(*k) != got_map.get(*k))
            .map(|k| {
                (
                    String::from_utf8_lossy(k).into_owned(),
                    want.get(k).map(|w| w.0),
                    got_map.get(k).map(|g| g.0),
                )
            })
            .collect();
        assert!(
            differ.is_empty(),
            "backfill of vbucket {vb} up to {end}: (key, want seqno, got seqno) {differ:?}"
        );
        checked += want.len();
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    assert!(checked > 100, "the test saw real data ({checked} items)");
}

#[test]
fn backfill_then_cursor_has_no_gap_and_no_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), WalMode::Write, 1);
    cfg.checkpoint.max_items = 50;
    let engine = Arc::new(Engine::open(cfg).unwrap());
    let bucket = engine.bucket("default").unwrap();
    for i in 0..2_000 {
        engine
            .store(
                &bucket,
                &StoreRequest::set(format!("k{}", i % 300).as_bytes(), b"v"),
            )
            .unwrap();
    }
    engine
        .wal()
        .wait_durable(engine.wal().last_lsn(), None)
        .unwrap();
    let (reg, handle, backfill) = engine.open_cursor(&bucket, 0, "stream", 0).unwrap();
    let mut backfill = backfill.expect("the checkpoints no longer hold seqno 1");
    let (start, end) = backfill.range();
    assert_eq!(start, 1);
    // Writes go on between registration and reading.
    for i in 0..500 {
        engine
            .store(
                &bucket,
                &StoreRequest::set(format!("k{}", i % 300).as_bytes(), b"w"),
            )
            .unwrap();
    }
    let mut seen: Vec<u64> = Vec::new();
    let mut state: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for chunk in backfill.by_ref() {
        for it in chunk {
            seen.push(it.meta.by_seqno);
            state.insert(it.key().to_vec(), it.value().to_vec());
        }
    }
    assert_eq!(*seen.last().unwrap(), end);
    let mut batches = 0;
    loop {
        match engine.read_cursor(&bucket, 0, reg.id, 64) {
            CursorRead::Batches(b) if b.is_empty() => break,
            CursorRead::Batches(b) => {
                for batch in b {
                    batches += 1;
                    assert!(
                        batch.start > *seen.last().unwrap(),
                        "snapshot starts after what was delivered"
                    );
                    for c in batch.changes {
                        assert!(c.seqno() >= batch.start && c.seqno() <= batch.end);
                        seen.push(c.seqno());
                        state.insert(c.key().to_vec(), c.value().to_vec());
                    }
                }
            }
            CursorRead::Dropped => panic!("not dropped"),
        }
    }
    assert!(!handle.is_dropped());
    assert!(batches > 0);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "no duplicate, in order"
    );
    assert_eq!(*seen.last().unwrap(), engine.high_seqnos(&bucket)[0]);
    assert_eq!(
        state,
        common::live(&engine, &bucket),
        "the stream's final state equals the bucket's"
    );
}

#[test]
fn a_cursor_that_never_reads_is_dropped_and_memory_returns_under_quota() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), WalMode::Write, 4);
    cfg.buckets[0].memory_quota = 64 << 20;
    cfg.buckets[0].checkpoint_memory_ratio = 0.05; // 3.2 MiB of checkpoints
    cfg.checkpoint.max_items = 100;
    let engine = Engine::open(cfg).unwrap();
    let bucket = Arc::new(engine.bucket("default").unwrap());
    let quota = bucket.config.checkpoint_quota_bytes();
    let handles: Vec<_> = (0..4)
        .map(|vb| engine.open_cursor(&bucket, vb, "idle", 0).unwrap().1)
        .collect();
    let value = vec![b'x'; 1000];
    let mut peak = 0;
    for i in 0..20_000 {
        engine
            .store(
                &bucket,
                &StoreRequest::set(format!("k{i}").as_bytes(), &value),
            )
            .unwrap();
        peak = peak.max(bucket.checkpoint_mem());
    }
    // The pager thread enforces the quota when writers signal pressure; give it a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while handles.iter().any(|h| !h.is_dropped()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        handles.iter().all(|h| h.is_dropped()),
        "idle cursors dropped"
    );
    engine
        .wal()
        .wait_durable(engine.wal().last_lsn(), None)
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while bucket.checkpoint_mem() > quota && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(
        bucket.checkpoint_mem() <= quota,
        "checkpoint memory {} back under quota {quota}",
        bucket.checkpoint_mem()
    );
    assert!(
        peak < 4 * quota,
        "memory stayed near the quota: peak {peak}, quota {quota}"
    );
    assert!(bucket.stats.cursors_dropped.load(Ordering::Relaxed) >= 4);
    // The persistence cursor was never dropped: everything is on disk.
    assert_eq!(
        engine.persisted_seqnos(&bucket),
        engine.high_seqnos(&bucket)
    );
}

#[test]
fn above_the_high_watermark_sets_fail_temporarily_and_deletes_still_work() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = common::config(dir.path(), WalMode::Write, 4);
    cfg.buckets[0].memory_quota = 4 << 20;
    let engine = Engine::open(cfg).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let value = vec![b'x'; 8 << 10];
    let mut stored = Vec::new();
    let err = loop {
        let key = format!("k{}", stored.len());
        match engine.store(&bucket, &StoreRequest::set(key.as_bytes(), &value)) {
            Ok(_) => stored.push(key),
            Err(e) => break e,
        }
        assert!(stored.len() < 10_000, "the quota never bit");
    };
    assert!(
        matches!(err, sluice_core::Error::TempFail(ref why) if why.contains("high watermark")),
        "{err}"
    );
    assert!(
        bucket.mem_used() <= bucket.config.memory_quota,
        "never above the quota"
    );
    // Everything stored is intact and readable; deleting makes room again.
    for k in &stored {
        assert_eq!(
            engine.get(&bucket, k.as_bytes()).unwrap().unwrap().value(),
            &value[..]
        );
    }
    for k in stored.iter().take(stored.len() / 2) {
        engine.delete(&bucket, k.as_bytes(), 0, None).unwrap();
    }
    engine
        .store(&bucket, &StoreRequest::set(b"after", &value))
        .unwrap();
}

#[test]
fn a_big_vbucket_snapshots_in_bounded_blocks_and_recovers() {
    use sluice_core::wal::xlog::{FileKind, Next, XlogReader};
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 1);
    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let value = vec![b'v'; 200];
    for i in 0..30_000 {
        engine
            .store(
                &bucket,
                &StoreRequest::set(format!("k{i}").as_bytes(), &value),
            )
            .unwrap();
    }
    let snap = engine.snapshot_now().unwrap();
    let before = common::dump(&engine, &bucket);
    engine.close();
    let mut r = XlogReader::open(&snap).unwrap();
    assert_eq!(r.header().kind, FileKind::Snap);
    let mut blocks = 0;
    loop {
        match r.next_block().unwrap() {
            Next::Block { payload, .. } => {
                assert!(
                    payload.len() < (1 << 20) + 4096,
                    "block of {} bytes",
                    payload.len()
                );
                blocks += 1;
            }
            Next::Eof { .. } => break,
            other => panic!("{other:?}"),
        }
    }
    assert!(
        blocks >= 6,
        "a 6 MB vbucket spans several blocks, got {blocks}"
    );
    let engine = Engine::open(cfg).unwrap();
    let bucket = engine.bucket("default").unwrap();
    assert_eq!(common::dump(&engine, &bucket), before);
}
