//! Checkpoint cursors for streams: opened, read and removed per vbucket, backfill from the
//! seqno index, and the checkpoint memory quota (dropping the slowest cursors past it).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Engine, Inner};
use crate::backfill::Backfill;
use crate::bucket::Bucket;
use crate::checkpoint::{CursorDropPolicy, CursorHandle, CursorId, CursorRead, Registration};
use crate::error::{Error, Result};

pub(super) fn enforce_checkpoint_quota(inner: &Inner) -> usize {
    let mut dropped = 0;
    for bucket in inner.catalog.all() {
        // One reading of the counter: writers move it concurrently.
        let over_by = bucket
            .checkpoint_mem()
            .saturating_sub(bucket.config.checkpoint_quota_bytes());
        if over_by == 0 {
            continue;
        }
        let mut infos = Vec::new();
        for v in 0..bucket.num_vbuckets() {
            let vb = bucket.lock_vbucket(v).expect("in range");
            infos.extend(vb.checkpoints.cursor_infos(bucket.id, v));
        }
        let policy = inner.drop_policy.read().clone();
        for (_, v, id) in policy.choose(over_by, &infos) {
            if let Some(mut vb) = bucket.lock_vbucket(v) {
                if Some(id) != vb.persistence_cursor {
                    vb.checkpoints.drop_cursor(id);
                    bucket.account(&mut vb);
                    bucket.stats.cursors_dropped.fetch_add(1, Ordering::Relaxed);
                    dropped += 1;
                }
            }
        }
    }
    dropped
}

/// Closes checkpoints past their period and frees what every cursor has passed.
pub(super) fn release_checkpoints(bucket: &Bucket) {
    for v in 0..bucket.num_vbuckets() {
        let mut vb = bucket.lock_vbucket(v).expect("in range");
        vb.checkpoints.check_period();
        vb.checkpoints.release();
        bucket.account(&mut vb);
    }
}

impl Engine {
    /// Registers a cursor for a reader holding everything up to `have_seqno`; when the
    /// checkpoints no longer hold what comes next, also starts the backfill that covers the
    /// gap, atomically with the registration so that nothing falls between them.
    pub fn open_cursor(
        &self,
        bucket: &Arc<Bucket>,
        vbid: u16,
        name: &str,
        have_seqno: u64,
    ) -> Result<(Registration, CursorHandle, Option<Backfill>)> {
        self.check_open()?;
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        let have = have_seqno.min(vb.high_seqno);
        let (reg, handle) = vb.checkpoints.register_cursor(name, have);
        let backfill = reg
            .backfill
            .map(|(start, end)| Backfill::begin_locked(bucket.clone(), &mut vb, start, end));
        bucket.account(&mut vb);
        Ok((reg, handle, backfill))
    }

    /// Where a reader holding all of checkpoint `id` of a vbucket resumes, if memory still
    /// holds that checkpoint closed.
    pub fn closed_checkpoint_end(&self, bucket: &Bucket, vbid: u16, id: u64) -> Option<u64> {
        bucket
            .lock_vbucket(vbid)?
            .checkpoints
            .closed_checkpoint_end(id)
    }

    pub fn read_cursor(
        &self,
        bucket: &Bucket,
        vbid: u16,
        id: CursorId,
        limit: usize,
    ) -> CursorRead {
        let Some(mut vb) = bucket.lock_vbucket(vbid) else {
            return CursorRead::Dropped;
        };
        let (read, _) = vb.checkpoints.read(id, limit);
        bucket.account(&mut vb);
        read
    }

    pub fn remove_cursor(&self, bucket: &Bucket, vbid: u16, id: CursorId) {
        if let Some(mut vb) = bucket.lock_vbucket(vbid) {
            vb.checkpoints.remove_cursor(id);
            bucket.account(&mut vb);
        }
    }

    /// A backfill of `[start, end]` (end capped at the high seqno now) for a reader with no cursor.
    pub fn backfill(
        &self,
        bucket: &Arc<Bucket>,
        vbid: u16,
        start: u64,
        end: u64,
    ) -> Result<Backfill> {
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        Ok(Backfill::begin_locked(bucket.clone(), &mut vb, start, end))
    }

    pub fn set_cursor_drop_policy(&self, policy: Arc<dyn CursorDropPolicy>) {
        *self.inner.drop_policy.write() = policy;
    }

    /// Drops cursors chosen by the policy while a bucket's checkpoints are over quota.
    pub fn enforce_checkpoint_quota(&self) -> usize {
        enforce_checkpoint_quota(&self.inner)
    }
}
