//! Changes followed from another system, where sluice is the replica of a source that is not
//! sluice (a Tarantool upstream, see the server's `iproto::follow`). Each change is applied as a
//! local write on an active vbucket and logged together with the source's position after it,
//! so a restart resumes from exactly the last change it kept: nothing missing, nothing twice,
//! even for changes that are not idempotent (an UPDATE adding to a field).

use std::sync::atomic::Ordering;

use super::write::check_writable;
use super::Engine;
use crate::bucket::Bucket;
use crate::config::Durability;
use crate::error::Result;
use crate::hlc::now_secs;
use crate::item::{is_expired, validate_key, ChangeOp, ItemMeta};
use crate::vbucket::VBucket;
use crate::wal::writer::{MetaRecord, WalPayload};

/// What a followed change does to its key, decided from the key's current item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FollowedChange {
    Store(Vec<u8>),
    Delete,
    /// Nothing to change (a delete of a missing key, an update refused): only the position
    /// moves.
    Keep,
}

/// What one followed write comes to.
enum Followed {
    Apply(ChangeOp, Vec<u8>, ItemMeta),
    Nothing,
    TooBig(usize),
}

/// The most changes a group keeps in one WAL block: a larger transaction is applied row by
/// row (a block must stay far below `xlog::MAX_BLOCK_LEN`, and the group holds the WAL's queue
/// lock while it is applied).
pub const MAX_GROUP: usize = 10_000;

impl Engine {
    /// Applies one followed change to `key`: `decide` sees its live value (None when missing,
    /// deleted or expired). The change and `position` are queued for the WAL under one lock,
    /// in one block, so recovery restores both or neither. No position: a change of a copy
    /// being loaded, which counts once `write_follow_position` ends the copy. Returns the LSN
    /// to wait for; the caller acknowledges the source only once the WAL has written it.
    pub fn write_followed(
        &self,
        bucket: &Bucket,
        key: &[u8],
        position: Option<&[u8]>,
        decide: impl FnOnce(Option<&[u8]>) -> FollowedChange,
    ) -> Result<u64> {
        let mut decide = Some(decide);
        let (lsn, refused) = self.write_followed_group(&[(bucket, key)], position, |_, cur| {
            (decide.take().expect("one write"))(cur)
        })?;
        match refused.first() {
            Some(&(_, size)) => Err(crate::Error::TooBig {
                size,
                max: bucket.config.max_item_size,
            }),
            None => Ok(lsn),
        }
    }

    /// A transaction of the source applied as one: every vbucket it touches is locked (in
    /// order) while its changes are applied, in order, so a reader sees all of them or none,
    /// and they go to the WAL in one block with `position` after the last, so recovery keeps
    /// all or none. `decide(i, value)` decides the i-th write from its key's live value (after
    /// the group's earlier writes). At most `MAX_GROUP` writes. Returns the LSN to wait for,
    /// and the writes whose value was larger than their bucket's `max_item_size` (index,
    /// size), which were left out (nothing is refused half way through a group).
    pub fn write_followed_group(
        &self,
        writes: &[(&Bucket, &[u8])],
        position: Option<&[u8]>,
        mut decide: impl FnMut(usize, Option<&[u8]>) -> FollowedChange,
    ) -> Result<(u64, Vec<(usize, usize)>)> {
        if writes.is_empty() || writes.len() > MAX_GROUP {
            return Err(crate::Error::InvalidArgument(format!(
                "a followed group holds 1 to {MAX_GROUP} writes, not {}",
                writes.len()
            )));
        }
        let mut places: Vec<(u16, u16, &Bucket)> = Vec::with_capacity(writes.len());
        for (bucket, key) in writes {
            validate_key(key)?;
            self.admit_write(bucket, Durability::None, ChangeOp::Mutation)?;
            places.push((bucket.id, bucket.vbucket_of(key), bucket));
        }
        let mut order: Vec<(u16, u16, &Bucket)> = places.clone();
        order.sort_by_key(|(b, v, _)| (*b, *v));
        order.dedup_by_key(|(b, v, _)| (*b, *v));
        // In (bucket, vbucket) order, as every taker of several vbucket locks does; the WAL's
        // queue lock after them, as every writer does.
        let mut locked = Vec::with_capacity(order.len());
        for (b, v, bucket) in &order {
            let vb = bucket.lock_vbucket(*v).expect("vbucket_of is in range");
            check_writable(&vb, writes.len() as u64)?;
            locked.push(((*b, *v), vb));
        }
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(crate::Error::Closed);
        }
        let now = now_secs();
        let mut wal = self.inner.wal.appender()?;
        if writes.len() > 1 && position.is_some() {
            wal.push(WalPayload::meta(
                places[0].0,
                places[0].1,
                MetaRecord::FollowGroup,
            ));
        }
        let mut last = (places[0].0, places[0].1);
        let mut lsn = 0;
        let mut refused = Vec::new();
        for (i, ((_, key), (b, v, bucket))) in writes.iter().zip(&places).enumerate() {
            let at = locked
                .binary_search_by_key(&(*b, *v), |(k, _)| *k)
                .expect("locked above");
            let vb = &mut *locked[at].1;
            let (op, value, meta) =
                match Self::followed_change(bucket, vb, key, now, |cur| decide(i, cur)) {
                    Followed::Apply(op, value, meta) => (op, value, meta),
                    Followed::Nothing => continue,
                    Followed::TooBig(size) => {
                        refused.push((i, size));
                        continue;
                    }
                };
            let c = vb.apply_local(op, key, &value, meta, crate::hlc::now_nanos());
            lsn = wal.push(WalPayload::Change(c));
            vb.last_lsn = lsn;
            vb.locks.unlock(key);
            last = (*b, *v);
        }
        if let Some(p) = position {
            let at = locked
                .binary_search_by_key(&last, |(k, _)| *k)
                .expect("locked above");
            let vb = &mut *locked[at].1;
            lsn = wal.push(WalPayload::meta(
                last.0,
                last.1,
                MetaRecord::FollowPosition(p.to_vec()),
            ));
            vb.follow_position = Some(p.into());
            vb.last_lsn = lsn;
        }
        drop(wal);
        for ((b, _), vb) in &mut locked {
            let bucket = order.iter().find(|o| o.0 == *b).expect("locked").2;
            bucket.changed(vb);
        }
        drop(locked);
        let mut notified: Vec<u16> = Vec::new();
        for (b, _, bucket) in &order {
            if !notified.contains(b) {
                notified.push(*b);
                bucket.changes.notify();
                self.note_checkpoint_pressure(bucket, lsn);
            }
        }
        Ok((lsn, refused))
    }

    /// One followed write decided from the key's live value. The vbucket is locked by the
    /// caller.
    fn followed_change(
        bucket: &Bucket,
        vb: &VBucket,
        key: &[u8],
        now: u32,
        decide: impl FnOnce(Option<&[u8]>) -> FollowedChange,
    ) -> Followed {
        // The stored value is lent to `decide`, not copied: a copy of the upstream mostly
        // stores keys that are not here yet, and an UPDATE reads the value once.
        let existing = vb.store.get(key);
        let rev = existing.as_ref().map_or(1, |i| i.meta().rev_seqno + 1);
        let live = existing.filter(|i| {
            let m = i.meta();
            !m.deleted && !is_expired(&m, now)
        });
        match decide(live.as_ref().map(|i| i.value())) {
            FollowedChange::Store(value) => {
                if value.len() > bucket.config.max_item_size {
                    return Followed::TooBig(value.len());
                }
                bucket.stats.sets.fetch_add(1, Ordering::Relaxed);
                let meta = ItemMeta {
                    rev_seqno: rev,
                    ..Default::default()
                };
                Followed::Apply(ChangeOp::Mutation, value, meta)
            }
            FollowedChange::Delete if live.is_some() => {
                bucket.stats.deletes.fetch_add(1, Ordering::Relaxed);
                let meta = ItemMeta {
                    expiry: now,
                    rev_seqno: rev,
                    deleted: true,
                    ..Default::default()
                };
                Followed::Apply(ChangeOp::Deletion, Vec::new(), meta)
            }
            FollowedChange::Delete | FollowedChange::Keep => Followed::Nothing,
        }
    }

    /// Records the source's position alone (after a copy of it has been loaded, or after
    /// changes that touch nothing here), on vbucket 0. Returns the LSN to wait for.
    pub fn write_follow_position(&self, bucket: &Bucket, position: &[u8]) -> Result<u64> {
        self.log_follow_position(bucket, 0, position)
    }

    /// The positions the bucket's vbuckets hold (each from its last followed change).
    pub fn follow_positions(&self, bucket: &Bucket) -> Vec<Box<[u8]>> {
        (0..bucket.num_vbuckets())
            .filter_map(|v| bucket.lock_vbucket(v)?.follow_position.clone())
            .collect()
    }

    /// Forgets every position in the bucket, in the WAL too (an empty position), before a
    /// fresh copy of the source is loaded: a crash while loading it leaves no position, so the
    /// next start loads a copy again rather than resuming on a half-loaded one.
    pub fn clear_follow_positions(&self, bucket: &Bucket) -> Result<u64> {
        let mut lsn = 0;
        for v in 0..bucket.num_vbuckets() {
            let held = bucket
                .lock_vbucket(v)
                .is_some_and(|vb| vb.follow_position.is_some());
            if held {
                lsn = self.log_follow_position(bucket, v, b"")?;
            }
        }
        Ok(lsn)
    }

    fn log_follow_position(&self, bucket: &Bucket, vbid: u16, position: &[u8]) -> Result<u64> {
        self.check_open()?;
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        let lsn = self.inner.wal.appender()?.push(WalPayload::meta(
            bucket.id,
            vbid,
            MetaRecord::FollowPosition(position.to_vec()),
        ));
        vb.follow_position = (!position.is_empty()).then(|| position.into());
        vb.last_lsn = lsn;
        Ok(lsn)
    }
}
