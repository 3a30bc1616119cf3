//! Background work on threads of the engine's own: the expiry pager, the tombstone purger,
//! the checkpoint quota and periodic snapshots.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cursors::{enforce_checkpoint_quota, release_checkpoints};
use super::{Engine, Inner};
use crate::bucket::Bucket;
use crate::error::{Error, Result};
use crate::hlc::now_secs;
use crate::item::is_expired;
use crate::snapshot;
use crate::vbucket::{VBucket, VbState};
use crate::wal::writer::{MetaRecord, WalPayload};

pub(super) fn run_pager(inner: &Inner) -> usize {
    let now = now_secs();
    let purge_age = inner
        .config
        .tombstone_purge_age
        .as_secs()
        .min(u32::MAX as u64) as u32;
    let mut n = 0;
    for bucket in inner.catalog.all() {
        for v in 0..bucket.num_vbuckets() {
            let mut vb = bucket.lock_vbucket(v).expect("in range");
            vb.checkpoints.check_period();
            vb.checkpoints.release();
            if vb.state == VbState::Active && !inner.wal.is_failing() {
                for key in vb.store.keys_where(|m| is_expired(m, now)) {
                    let meta = vb.store.get(&key).expect("listed above").meta();
                    if inner
                        .expire_locked(&bucket, &mut vb, &key, &meta, now)
                        .is_err()
                    {
                        break; // closing
                    }
                    bucket
                        .stats
                        .expired_by_pager
                        .fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
            }
            if !vb.store.has_range_reads() {
                let old = vb
                    .store
                    .keys_where(|m| m.deleted && m.expiry.saturating_add(purge_age) <= now);
                let mut purged_upto = vb.purge_seqno;
                for key in &old {
                    if let Some(m) = vb.store.purge(key) {
                        purged_upto = purged_upto.max(m.by_seqno);
                    }
                }
                inner.note_purged(&bucket, &mut vb, purged_upto, old.len());
            }
            bucket.account(&mut vb);
        }
    }
    n
}

impl Inner {
    /// After `count` tombstones of a vbucket were purged, the highest at `purged_upto`: the
    /// vbucket's purge seqno moves up, in memory and in the WAL (streams from before it must
    /// roll back, after a restart too).
    pub(super) fn note_purged(
        &self,
        bucket: &Bucket,
        vb: &mut VBucket,
        purged_upto: u64,
        count: usize,
    ) {
        if purged_upto <= vb.purge_seqno {
            return;
        }
        vb.purge_seqno = purged_upto;
        if let Ok(mut a) = self.wal.appender() {
            vb.last_lsn = a.push(WalPayload::meta(
                bucket.id,
                vb.id,
                MetaRecord::PurgeSeqno(purged_upto),
            ));
        }
        bucket
            .stats
            .tombstones_purged
            .fetch_add(count as u64, Ordering::Relaxed);
    }
}

pub(super) fn maintenance_loop(inner: Arc<Inner>) {
    let tick = Duration::from_millis(200);
    let mut last_pager = Instant::now();
    let mut last_release = Instant::now();
    let mut last_retention = Instant::now();
    loop {
        {
            let mut stop = inner.background.stop.lock();
            if *stop {
                return;
            }
            // Under quota pressure the wait is short but never zero, so a pressure that cannot
            // be relieved (the WAL itself lagging) does not spin against the writers.
            let wait = if inner.background.quota_pressure.load(Ordering::Acquire) {
                Duration::from_millis(20)
            } else {
                tick
            };
            inner.background.wake.wait_for(&mut stop, wait);
            if *stop {
                return;
            }
        }
        if inner
            .background
            .quota_pressure
            .swap(false, Ordering::AcqRel)
        {
            enforce_checkpoint_quota(&inner);
        }
        #[cfg(feature = "mimalloc")]
        if last_release.elapsed() >= Duration::from_secs(2) {
            crate::alloc::release_free_memory();
            last_release = Instant::now();
        }
        #[cfg(not(feature = "mimalloc"))]
        let _ = &mut last_release;
        if last_retention.elapsed() >= Duration::from_secs(1) {
            let now_ms = crate::hlc::now_nanos() / 1_000_000;
            let dropped = inner.enforce_topic_retention(now_ms);
            if dropped > 0 {
                log::info!("topic retention dropped {dropped} message(s)");
            }
            last_retention = Instant::now();
        }
        if last_pager.elapsed() >= inner.config.expiry_pager_interval {
            run_pager(&inner);
            last_pager = Instant::now();
        } else {
            for bucket in inner.catalog.all() {
                release_checkpoints(&bucket);
            }
        }
    }
}

pub(super) fn snapshot_loop(inner: Arc<Inner>) {
    let interval = inner.config.snapshot_interval;
    loop {
        {
            let deadline = Instant::now() + interval;
            let mut stop = inner.background.stop.lock();
            while !*stop
                && !inner
                    .background
                    .wake
                    .wait_until(&mut stop, deadline)
                    .timed_out()
            {}
            if *stop {
                return;
            }
        }
        if let Err(e) = inner.write_snapshot() {
            log::error!("periodic snapshot failed: {e}");
        }
    }
}

impl Engine {
    pub(super) fn start_background(&self) -> Result<()> {
        let mut threads = self.threads.lock();
        let inner = self.inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name("sluice-pager".into())
                .spawn(move || maintenance_loop(inner))
                .map_err(|e| Error::io("spawning the pager", e))?,
        );
        if !self.inner.config.snapshot_interval.is_zero() {
            let inner = self.inner.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("sluice-snapshot".into())
                    .spawn(move || snapshot_loop(inner))
                    .map_err(|e| Error::io("spawning the snapshotter", e))?,
            );
        }
        Ok(())
    }

    /// Expires items past their time and purges old tombstones now.
    pub fn run_expiry_pager(&self) -> usize {
        run_pager(&self.inner)
    }

    /// Writes a snapshot now and removes what retention no longer needs.
    pub fn snapshot_now(&self) -> Result<PathBuf> {
        self.check_open()?;
        self.inner.write_snapshot()
    }

    pub(super) fn stop_background(&self) {
        *self.inner.background.stop.lock() = true;
        self.inner.background.wake.notify_all();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }
}

impl Inner {
    pub(super) fn write_snapshot(&self) -> Result<PathBuf> {
        snapshot::write(
            &self.catalog,
            &self.wal,
            &self.snap_dir,
            &self.wal_dir,
            &self.instance,
            self.config.snapshot_count,
            &self.snapshot_lock,
        )
    }
}
