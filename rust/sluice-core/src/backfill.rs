//! Backfill: a chunked walk over one vbucket's seqno-ordered items for a reader whose start is
//! older than the checkpoints hold. It yields the latest version of each key (tombstones
//! included) as of the end seqno fixed when it began, while writes go on: the item store keeps
//! replaced versions readable for as long as the backfill is open.

use std::sync::Arc;

use crate::bucket::Bucket;
use crate::item::Item;
use crate::item_store::ItemRef;
use crate::vbucket::VBucket;

pub struct Backfill {
    bucket: Arc<Bucket>,
    vbucket: u16,
    start: u64,
    end: u64,
    next: Option<u64>,
}

impl Backfill {
    /// Begins under the caller's lock on `vb`; `end` is capped at the high seqno now.
    pub(crate) fn begin_locked(
        bucket: Arc<Bucket>,
        vb: &mut VBucket,
        start: u64,
        end: u64,
    ) -> Backfill {
        let end = end.min(vb.high_seqno);
        let next = if start <= end {
            vb.store.begin_range_read();
            Some(start)
        } else {
            None
        };
        Backfill {
            bucket,
            vbucket: vb.id,
            start,
            end,
            next,
        }
    }

    /// The snapshot this backfill delivers: `[start, end]`.
    pub fn range(&self) -> (u64, u64) {
        (self.start, self.end)
    }

    pub fn vbucket(&self) -> u16 {
        self.vbucket
    }

    pub fn is_done(&self) -> bool {
        self.next.is_none()
    }

    /// Up to `limit` items in seqno order; an empty result means the backfill is complete.
    pub fn next_chunk(&mut self, limit: usize) -> Vec<Item> {
        let mut out = Vec::with_capacity(limit.min(4096));
        self.read_with(limit, |i| {
            out.push(i.to_item());
            true
        });
        out
    }

    /// Up to `limit` items in seqno order, each lent to `emit` under the vbucket's lock (a
    /// stream encodes them straight into its output: no copy per item); `emit` returns false to
    /// stop before the item it was shown, which the next read starts with. Returns how many.
    pub fn read_with(&mut self, limit: usize, mut emit: impl FnMut(ItemRef<'_>) -> bool) -> usize {
        let Some(from) = self.next else {
            return 0;
        };
        let mut n = 0;
        let mut vb = self
            .bucket
            .lock_vbucket(self.vbucket)
            .expect("vbucket exists");
        self.next = vb.store.read_range(from, self.end, limit.max(1), |i| {
            let taken = emit(i);
            n += taken as usize;
            taken
        });
        if self.next.is_none() {
            vb.store.end_range_read();
            self.bucket.account(&mut vb);
        }
        n
    }
}

impl Iterator for Backfill {
    type Item = Vec<Item>;
    fn next(&mut self) -> Option<Vec<Item>> {
        let chunk = self.next_chunk(1024);
        if chunk.is_empty() {
            None
        } else {
            Some(chunk)
        }
    }
}

impl Drop for Backfill {
    fn drop(&mut self) {
        if self.next.is_some() {
            if let Some(mut vb) = self.bucket.lock_vbucket(self.vbucket) {
                vb.store.end_range_read();
                self.bucket.account(&mut vb);
            }
        }
    }
}
