//! Changes followed from another system, where sluice is the replica of a source that is not
//! sluice (a Tarantool upstream, see the server's `follower`). Each change is applied as a
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
        validate_key(key)?;
        self.admit_write(bucket, Durability::None, ChangeOp::Mutation)?;
        let vbid = bucket.vbucket_of(key);
        let mut vb = bucket.lock_vbucket(vbid).expect("vbucket_of is in range");
        check_writable(&vb, 1)?;
        let now = now_secs();
        // The stored value is lent to `decide`, not copied: a copy of the upstream mostly
        // stores keys that are not here yet, and an UPDATE reads the value once.
        let (rev, live, decided) = {
            let existing = vb.store.get(key);
            let rev = existing.as_ref().map_or(1, |i| i.meta().rev_seqno + 1);
            let live = existing.filter(|i| {
                let m = i.meta();
                !m.deleted && !is_expired(&m, now)
            });
            (
                rev,
                live.is_some(),
                decide(live.as_ref().map(|i| i.value())),
            )
        };
        let change = match decided {
            FollowedChange::Store(value) => {
                if value.len() > bucket.config.max_item_size {
                    return Err(crate::Error::TooBig {
                        size: value.len(),
                        max: bucket.config.max_item_size,
                    });
                }
                bucket.stats.sets.fetch_add(1, Ordering::Relaxed);
                let meta = ItemMeta {
                    rev_seqno: rev,
                    ..Default::default()
                };
                Some((ChangeOp::Mutation, value, meta))
            }
            FollowedChange::Delete if live => {
                bucket.stats.deletes.fetch_add(1, Ordering::Relaxed);
                let meta = ItemMeta {
                    expiry: now,
                    rev_seqno: rev,
                    deleted: true,
                    ..Default::default()
                };
                Some((ChangeOp::Deletion, Vec::new(), meta))
            }
            FollowedChange::Delete | FollowedChange::Keep => None,
        };
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(crate::Error::Closed);
        }
        let mut wal = self.inner.wal.appender()?;
        let mut lsn = vb.last_lsn;
        if let Some((op, value, meta)) = change {
            let c = vb.apply_local(op, key, &value, meta, crate::hlc::now_nanos());
            lsn = wal.push(WalPayload::Change(c));
            vb.locks.unlock(key);
        }
        if let Some(p) = position {
            lsn = wal.push(WalPayload::meta(
                bucket.id,
                vbid,
                MetaRecord::FollowPosition(p.to_vec()),
            ));
            vb.follow_position = Some(p.into());
        }
        drop(wal);
        vb.last_lsn = lsn;
        bucket.account(&mut vb);
        drop(vb);
        bucket.changes.notify();
        self.note_checkpoint_pressure(bucket, lsn);
        Ok(lsn)
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
