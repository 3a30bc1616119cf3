//! Records queued on a thread whose replies wait for the WAL do not wake the writer thread;
//! the thread still writes any such record no waiter wrote, whether it was napping between
//! batches or asleep.

mod common;

use std::time::{Duration, Instant};

use sluice_core::engine::StoreRequest;
use sluice_core::wal::WalMode;
use sluice_core::Engine;

#[test]
fn a_record_no_waiter_writes_is_written_by_the_thread() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap();
    let b = engine.bucket("default").unwrap();
    sluice_core::wal::writer::replies_wait_here();
    for (i, pause) in [0u64, 0, 30, 200, 0].into_iter().enumerate() {
        // Long pauses let the thread fall asleep without a timer; short ones find it napping.
        std::thread::sleep(Duration::from_millis(pause));
        let key = format!("k{i}");
        let w = engine
            .write_store(&b, &StoreRequest::set(key.as_bytes(), b"v"))
            .unwrap();
        let started = Instant::now();
        // Waits without writing anything itself: the writer thread must.
        engine
            .wal()
            .wait_written(w.lsn(), Some(Duration::from_secs(10)))
            .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "record {i} written after {:?}",
            started.elapsed()
        );
    }
}
