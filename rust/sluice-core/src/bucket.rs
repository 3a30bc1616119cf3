//! A bucket: a named keyspace of vbuckets with a memory quota.

use std::sync::atomic::{AtomicIsize, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use crate::config::BucketConfig;
use crate::durability::ReplicaAcks;
use crate::hash::vbucket_of;
use crate::item_store::KeyShape;
use crate::signal::ChangeSignal;
use crate::vbucket::VBucket;

#[derive(Debug, Default)]
pub struct BucketStats {
    pub sets: AtomicU64,
    pub deletes: AtomicU64,
    pub gets: AtomicU64,
    pub get_misses: AtomicU64,
    pub tmp_failures: AtomicU64,
    pub expired_on_access: AtomicU64,
    pub expired_by_pager: AtomicU64,
    pub tombstones_purged: AtomicU64,
    pub cursors_dropped: AtomicU64,
    /// Items evicted to make room (`eviction = "lru"`).
    pub evictions: AtomicU64,
    /// Durable writes waiting now for their level (the WAL's sync, replicas' acks).
    pub durable_waiting: AtomicU64,
    /// memcached's command counters (`stats`): touches of live and of missing keys, deletes
    /// of missing keys, counters changed and missed, writes with a CAS that matched, found no
    /// item, or found another CAS, and flushes.
    pub touch_hits: AtomicU64,
    pub touch_misses: AtomicU64,
    pub delete_misses: AtomicU64,
    pub incr_hits: AtomicU64,
    pub incr_misses: AtomicU64,
    pub decr_hits: AtomicU64,
    pub decr_misses: AtomicU64,
    pub cas_hits: AtomicU64,
    pub cas_misses: AtomicU64,
    pub cas_badval: AtomicU64,
    pub flushes: AtomicU64,
}

/// Counts a hit or a miss (an item that was not there) of a command, by its outcome.
pub fn count_outcome<T>(r: &crate::error::Result<T>, hits: &AtomicU64, misses: &AtomicU64) {
    use std::sync::atomic::Ordering::Relaxed;
    match r {
        Ok(_) => hits.fetch_add(1, Relaxed),
        Err(crate::error::Error::NotFound) => misses.fetch_add(1, Relaxed),
        Err(_) => 0,
    };
}

/// Counts a durable write in `BucketStats::durable_waiting` while it waits.
pub struct DurableWait<'a>(&'a AtomicU64);

impl<'a> DurableWait<'a> {
    pub fn new(gauge: &'a AtomicU64) -> DurableWait<'a> {
        gauge.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        DurableWait(gauge)
    }
}

impl Drop for DurableWait<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

pub struct Bucket {
    pub id: u16,
    pub config: BucketConfig,
    vbuckets: Vec<Mutex<VBucket>>,
    /// Bytes held by items and checkpoints, kept current under each vbucket's lock.
    mem_used: AtomicIsize,
    checkpoint_mem: AtomicIsize,
    pub stats: BucketStats,
    /// Wakes stream readers when any of the bucket's vbuckets has new changes.
    pub changes: ChangeSignal,
    /// Per vbucket, moves (under its lock) on every change a stream reads: items, state,
    /// history. A stream caught up on a vbucket whose version has not moved has nothing to
    /// send, which it learns from one load instead of taking locks.
    versions: Box<[AtomicU64]>,
    /// Replicas following each vbucket and what they acknowledged (durable writes).
    pub acks: ReplicaAcks,
    /// The vbucket eviction visits next (taken modulo the vbucket count).
    eviction_cursor: AtomicUsize,
    /// With `ordered_keys`: what the keys of its vbuckets' ordered indexes look like.
    pub key_shape: Arc<KeyShape>,
}

impl Bucket {
    /// Takes the vbuckets as recovery (or creation) left them; with `ordered_keys`, their
    /// stores index the keys they hold in key order now, and keep them so.
    pub fn new(id: u16, config: BucketConfig, mut vbuckets: Vec<VBucket>) -> Bucket {
        let vbuckets_len = vbuckets.len() as u16;
        let key_shape = Arc::new(KeyShape::default());
        for vb in vbuckets.iter_mut() {
            vb.store
                .set_ordered(config.ordered_keys.then(|| key_shape.clone()));
        }
        let b = Bucket {
            id,
            config,
            vbuckets: vbuckets.into_iter().map(Mutex::new).collect(),
            mem_used: AtomicIsize::new(0),
            checkpoint_mem: AtomicIsize::new(0),
            stats: BucketStats::default(),
            changes: ChangeSignal::default(),
            versions: (0..vbuckets_len).map(|_| AtomicU64::new(0)).collect(),
            acks: ReplicaAcks::new(vbuckets_len),
            eviction_cursor: AtomicUsize::new(0),
            key_shape,
        };
        for vb in &b.vbuckets {
            b.account(&mut vb.lock());
        }
        b
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn num_vbuckets(&self) -> u16 {
        self.vbuckets.len() as u16
    }

    pub fn vbucket_of(&self, key: &[u8]) -> u16 {
        vbucket_of(key, self.num_vbuckets())
    }

    pub fn lock_vbucket(&self, vb: u16) -> Option<MutexGuard<'_, VBucket>> {
        self.vbuckets.get(vb as usize).map(|m| m.lock())
    }

    /// Brings the bucket's memory counters up to date with one vbucket; call with its lock held.
    /// The vbucket took a change streams read (items, state, history; its lock is held): its
    /// version moves, and its memory is accounted.
    pub fn changed(&self, vb: &mut VBucket) {
        self.touch(vb);
        self.account(vb);
    }

    pub fn account(&self, vb: &mut VBucket) {
        let total = vb.mem_bytes();
        let cp = vb.checkpoints.mem_bytes();
        self.mem_used
            .fetch_add(total as isize - vb.accounted.0 as isize, Ordering::Relaxed);
        self.checkpoint_mem
            .fetch_add(cp as isize - vb.accounted.1 as isize, Ordering::Relaxed);
        vb.accounted = (total, cp);
    }

    /// The vbucket changed (its lock is held): its version moves.
    fn touch(&self, vb: &VBucket) {
        if let Some(v) = self.versions.get(vb.id as usize) {
            v.fetch_add(1, Ordering::Release);
        }
    }

    /// The vbucket's version: read it before looking at the vbucket; if it has not moved
    /// since, neither has anything a stream reads from it.
    pub fn version(&self, vbid: u16) -> u64 {
        self.versions
            .get(vbid as usize)
            .map_or(0, |v| v.load(Ordering::Acquire))
    }

    pub fn mem_used(&self) -> usize {
        self.mem_used.load(Ordering::Relaxed).max(0) as usize
    }

    pub fn checkpoint_mem(&self) -> usize {
        self.checkpoint_mem.load(Ordering::Relaxed).max(0) as usize
    }

    pub fn above_high_watermark(&self) -> bool {
        self.mem_used() > self.config.high_watermark_bytes()
    }

    /// The next vbucket in eviction's round over the bucket.
    pub fn next_eviction_vbucket(&self) -> u16 {
        (self.eviction_cursor.fetch_add(1, Ordering::Relaxed) % self.vbuckets.len()) as u16
    }

    pub fn over_checkpoint_quota(&self) -> bool {
        self.checkpoint_mem() > self.config.checkpoint_quota_bytes()
    }
}
