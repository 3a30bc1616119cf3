//! Eviction for buckets with `eviction = "lru"`: a write that finds the bucket above its high
//! watermark first evicts items until memory is back under the low mark
//! (`BucketConfig::eviction_low_mark_bytes`), before it takes its own vbucket's lock.
//!
//! Which items: each vbucket's eviction clock (`ItemStore::next_victim`, an approximate LRU),
//! the vbuckets visited in turn from a bucket-wide cursor, a few evictions per visit. Keys hash
//! evenly over vbuckets, so every vbucket holds a fair share of hot and cold items and evicting
//! evenly from them approximates one LRU over the bucket, with one vbucket lock held at a time
//! (never two, so no lock order to keep with batched writes) and no lock on the read path but
//! the vbucket's own.
//!
//! What an eviction is: as in Couchbase ephemeral buckets (kv_engine's `pageOut`, the
//! "auto-delete"), a deletion with the next revision and a new seqno, made only on active
//! vbuckets. It goes through the checkpoint and the WAL like a client's delete, so DCP and TAP
//! streams and replicas see a deletion and converge, and a restart does not bring the item back.

use std::sync::atomic::Ordering::{self, Relaxed};

use super::write::check_writable;
use super::Inner;
use crate::bucket::Bucket;
use crate::error::Result;
use crate::hlc::{now_nanos, now_secs};
use crate::item::{ChangeOp, ItemMeta};
use crate::item_store::ITEM_OVERHEAD;
use crate::vbucket::{VBucket, VbState};
use crate::wal::writer::WalPayload;

/// Evictions per visit to a vbucket before the next one's turn: spreads eviction evenly.
const EVICTIONS_PER_VISIT: usize = 32;

impl Inner {
    /// Evicts until the bucket's memory is under its low mark or no vbucket has anything left
    /// to give (every item a tombstone, or memory held by checkpoints). Call with no vbucket
    /// lock held. Returns how many items were evicted.
    pub(super) fn make_room(&self, bucket: &Bucket) -> Result<usize> {
        let target = bucket.config.eviction_low_mark_bytes();
        let n = bucket.num_vbuckets() as usize;
        let mut evicted = 0;
        let mut fruitless_visits = 0;
        while bucket.mem_used() > target && fruitless_visits < n {
            let v = bucket.next_eviction_vbucket();
            let mut vb = bucket.lock_vbucket(v).expect("in range");
            let (items, purged) = self.evict_from(bucket, &mut vb, target)?;
            if items + purged == 0 {
                fruitless_visits += 1;
            } else {
                fruitless_visits = 0;
            }
            evicted += items;
        }
        Ok(evicted)
    }

    /// One visit: up to EVICTIONS_PER_VISIT victims of this vbucket's clock while the bucket
    /// is above `target`. Returns (items evicted, tombstones purged).
    fn evict_from(
        &self,
        bucket: &Bucket,
        vb: &mut VBucket,
        target: usize,
    ) -> Result<(usize, usize)> {
        if vb.state != VbState::Active || check_writable(vb, EVICTIONS_PER_VISIT as u64).is_err() {
            return Ok((0, 0));
        }
        // Tombstones (an eviction leaves one) are small, and the tombstone purger removes them
        // after `tombstone_purge_age`; but a cache taking new keys all day makes them faster
        // than that. Once they hold a quarter of the vbucket's memory the clock purges those it
        // passes too, as Couchbase's ephemeral memory recovery runs its tombstone purger early.
        // Like the purger, that raises the purge seqno (backfills from before it roll back).
        let purge_tombstones = !vb.store.has_range_reads()
            && vb.store.tombstones() * ITEM_OVERHEAD > vb.store.mem_bytes() / 4;
        let now = now_secs();
        let now_ns = now_nanos();
        let (mut purged, mut purged_upto) = (0, vb.purge_seqno);
        // The visit's deletions go to the WAL together, under one lock of its queue.
        let mut changes = Vec::with_capacity(EVICTIONS_PER_VISIT);
        while changes.len() + purged < EVICTIONS_PER_VISIT && bucket.mem_used() > target {
            let Some(victim) = vb.store.next_victim(purge_tombstones) else {
                break;
            };
            if victim.meta.deleted {
                vb.store.purge(victim.key.as_slice());
                purged_upto = purged_upto.max(victim.meta.by_seqno);
                purged += 1;
                bucket.account(vb);
                continue;
            }
            if self.closed.load(Ordering::Acquire) {
                break;
            }
            let meta = ItemMeta {
                expiry: now,
                rev_seqno: victim.meta.rev_seqno + 1,
                deleted: true,
                ..Default::default()
            };
            changes.push(vb.apply_local(
                ChangeOp::Deletion,
                victim.key.as_slice(),
                b"",
                meta,
                now_ns,
            ));
            bucket.changed(vb);
        }
        let evicted = changes.len();
        if evicted > 0 {
            let mut wal = self.wal.appender()?;
            for c in changes {
                vb.last_lsn = wal.push(WalPayload::Change(c));
            }
            drop(wal);
            bucket.stats.evictions.fetch_add(evicted as u64, Relaxed);
            bucket.changes.notify();
        }
        self.note_purged(bucket, vb, purged_upto, purged);
        // Dead slots keep their 40 bytes until compaction.
        if vb.store.compact_under_pressure() {
            bucket.account(vb);
        }
        Ok((evicted, purged))
    }
}
