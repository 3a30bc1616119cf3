//! vbucket states and history: state changes and promotion (failover entries), changes applied
//! as a replica receives them, and rollback to a seqno the active and this node agree on.

use std::sync::Arc;

use super::{Engine, Written};
use crate::bucket::Bucket;
use crate::checkpoint::PERSISTENCE_CURSOR;
use crate::config::Durability;
use crate::error::{Error, Result};
use crate::failover::FailoverEntry;
use crate::item::{ChangeOp, ItemMeta};
use crate::vbucket::{VBucket, VbState};
use crate::wal::writer::{MetaRecord, WalPayload};
use crate::wal::WalMode;

impl Engine {
    /// Changes a vbucket's state and returns once the WAL holds the change (see
    /// `write_vbucket_state`); becoming active adds a failover entry.
    pub fn set_vbucket_state(&self, bucket: &Bucket, vbid: u16, state: VbState) -> Result<()> {
        let w = self.write_vbucket_state(bucket, vbid, state)?;
        self.settle(bucket, w)
    }

    /// Changes a vbucket's state now and queues its WAL record: like a write, whoever
    /// acknowledges the change (a TAP ACK, an answer to SET_VBUCKET_STATE) waits for the
    /// `Written` first (`settle` or `settled`), so that a crash cannot undo an acknowledged state.
    pub fn write_vbucket_state(
        &self,
        bucket: &Bucket,
        vbid: u16,
        state: VbState,
    ) -> Result<Written<()>> {
        self.check_open()?;
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        if vb.state == state {
            return Ok(Written::new((), Durability::None.into(), vb.last_lsn, &[]));
        }
        let high = vb.high_seqno;
        // The WAL first: a writer that refuses (closed, failing) leaves the state as it was.
        let mut a = self.inner.wal.appender()?;
        vb.state = state;
        // Locks belong to the vbucket's active: a state change ends them, as a failover or a
        // move does in Couchbase.
        vb.locks.clear();
        vb.last_lsn = a.push(WalPayload::meta(
            bucket.id,
            vbid,
            MetaRecord::VbucketState {
                state,
                high_seqno: high,
            },
        ));
        if state == VbState::Active {
            let e = vb.failover.create_entry(high);
            vb.last_lsn = a.push(WalPayload::meta(
                bucket.id,
                vbid,
                MetaRecord::FailoverEntry(e),
            ));
        }
        // Streams of the vbucket look at its state when woken.
        bucket.changed(&mut vb);
        bucket.changes.notify();
        Ok(Written::new((), Durability::None.into(), vb.last_lsn, &[]))
    }

    /// Promotion after a failover: every replica or pending vbucket of the bucket becomes
    /// active, each with a new failover entry. Returns the vbuckets promoted.
    pub fn promote(&self, bucket: &Bucket) -> Result<Vec<u16>> {
        let mut promoted = Vec::new();
        let mut last = None;
        for v in 0..bucket.num_vbuckets() {
            let state = self.vbucket_state(bucket, v);
            if matches!(state, Some(VbState::Replica | VbState::Pending)) {
                last = Some(self.write_vbucket_state(bucket, v, VbState::Active)?);
                promoted.push(v);
            }
        }
        // One wait for all of them: the last record written means every earlier one is.
        if let Some(w) = last {
            self.settle(bucket, w)?;
        }
        Ok(promoted)
    }

    /// A replica's stream: stores changes decided by the active, with its seqnos, CAS and rev
    /// seqnos, under one lock of the vbucket, and logs them to this node's WAL. The vbucket
    /// must not be active here, and seqnos must rise. Returns the last LSN written.
    pub fn apply_replicated<'a>(
        &self,
        bucket: &Bucket,
        vbid: u16,
        changes: impl Iterator<Item = (ChangeOp, &'a [u8], &'a [u8], ItemMeta)>,
    ) -> Result<u64> {
        self.check_open()?;
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        if vb.state == VbState::Active || vb.state == VbState::Dead {
            return Err(Error::InvalidArgument(format!(
                "vbucket {vbid} is {} here and takes no replicated changes",
                vb.state.as_str()
            )));
        }
        let mut a = self.inner.wal.appender()?;
        let mut last = vb.last_lsn;
        for (op, key, value, mut meta) in changes {
            // An active that is not sluice may send keys sluice would refuse from a client.
            crate::item::validate_key(key)?;
            if meta.by_seqno <= vb.high_seqno {
                return Err(Error::InvalidArgument(format!(
                    "vbucket {vbid}: replicated seqno {} is not above {}",
                    meta.by_seqno, vb.high_seqno
                )));
            }
            meta.deleted = op != ChangeOp::Mutation;
            let c = vb.apply(op, key, value, meta);
            last = a.push(WalPayload::Change(c));
        }
        drop(a);
        vb.last_lsn = last;
        bucket.changed(&mut vb);
        drop(vb);
        bucket.changes.notify();
        self.note_checkpoint_pressure(bucket, last);
        Ok(last)
    }

    /// A replica takes its active's failover log (newest first) as its own, so that it can
    /// resume from it and a promotion continues the same history.
    pub fn adopt_failover_log(
        &self,
        bucket: &Bucket,
        vbid: u16,
        entries: &[FailoverEntry],
    ) -> Result<()> {
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        // Compared as it would be kept: a longer log than a vbucket keeps would never match
        // and be logged again with every batch.
        let kept = &entries[..entries.len().min(crate::failover::MAX_FAILOVER_ENTRIES)];
        if vb.failover.entries() == kept {
            return Ok(());
        }
        vb.failover.replace_all(kept.to_vec());
        self.log_failover_log(bucket, &mut vb)
    }

    pub(super) fn log_failover_log(&self, bucket: &Bucket, vb: &mut VBucket) -> Result<()> {
        // Streams compare the history they opened on.
        bucket.changed(vb);
        let mut a = self.inner.wal.appender()?;
        vb.last_lsn = a.push(WalPayload::meta(
            bucket.id,
            vb.id,
            MetaRecord::FailoverReset,
        ));
        for e in vb.failover.entries().iter().rev() {
            vb.last_lsn = a.push(WalPayload::meta(
                bucket.id,
                vb.id,
                MetaRecord::FailoverEntry(*e),
            ));
        }
        Ok(())
    }

    /// Rolls non-active vbuckets back, each to its seqno: what lies beyond goes. The items as
    /// they stood come from this node's snapshot and WAL files when they can say; when they
    /// cannot, the vbucket is emptied for a full re-stream. One snapshot then makes the results
    /// the starting point of recovery (WAL records after a rollback belong to a new branch, and
    /// recovery replays no rollback), so the vbuckets must take no change until this returns.
    /// Returns the seqno each vbucket now stands at.
    pub fn rollback_vbuckets(&self, bucket: &Arc<Bucket>, to: &[(u16, u64)]) -> Result<Vec<u64>> {
        let mut done = Vec::with_capacity(to.len());
        for &(vb, seqno) in to {
            done.push(self.rollback_vbucket(bucket, vb, seqno)?);
        }
        self.inner.write_snapshot()?;
        Ok(done)
    }

    /// Starts a new history on every active vbucket of the bucket that has one: its items go
    /// without tombstones, its failover log becomes one new entry at its high seqno (seqnos go
    /// on rising), and its streams end with ROLLBACK. A consumer asking again with the old
    /// history is told to roll back to 0 and re-streams what the bucket then holds, instead of
    /// being shown deletions of items that were never deleted. This is for a bucket whose
    /// contents are about to be replaced whole from elsewhere (a followed Tarantool copied
    /// again). One snapshot then holds the result, as after a rollback (recovery replays
    /// neither); a crash before it leaves the bucket as it was. Returns the vbuckets restarted.
    pub fn restart_history(&self, bucket: &Arc<Bucket>) -> Result<Vec<u16>> {
        self.check_open()?;
        let mut restarted = Vec::new();
        for vbid in 0..bucket.num_vbuckets() {
            let mut vb = bucket.lock_vbucket(vbid).expect("in range");
            if vb.state != VbState::Active || vb.high_seqno == 0 {
                continue;
            }
            let high = vb.high_seqno;
            let mut a = self.inner.wal.appender()?;
            vb.locks.clear();
            vb.store.replace_keeping_readers(Default::default());
            vb.purge_seqno = high;
            vb.follow_position = None;
            vb.history += 1;
            self.restart_checkpoints(&mut vb, high);
            vb.failover.replace_all(Vec::new());
            vb.failover.create_entry(high);
            vb.last_lsn = a.push(WalPayload::meta(
                bucket.id,
                vbid,
                MetaRecord::Rollback(high),
            ));
            drop(a);
            self.log_failover_log(bucket, &mut vb)?;
            bucket.account(&mut vb);
            restarted.push(vbid);
        }
        if restarted.is_empty() {
            return Ok(restarted);
        }
        bucket.changes.notify();
        self.inner.write_snapshot()?;
        log::info!(
            "bucket {:?}: a new history starts on {} vbucket(s); their consumers roll back to 0",
            bucket.name(),
            restarted.len()
        );
        Ok(restarted)
    }

    /// The vbucket's checkpoints start over at `high`: its readers (streams, a chained
    /// replica's) lose their cursors, and the WAL's persistence cursor is registered again.
    fn restart_checkpoints(&self, vb: &mut VBucket, high: u64) {
        vb.checkpoints.reset(high);
        vb.persistence_cursor = None;
        if self.inner.wal.mode() != WalMode::None {
            let (reg, _) = vb.checkpoints.register_cursor(PERSISTENCE_CURSOR, high);
            vb.persistence_cursor = Some(reg.id);
        }
    }

    pub(super) fn rollback_vbucket(
        &self,
        bucket: &Arc<Bucket>,
        vbid: u16,
        seqno: u64,
    ) -> Result<u64> {
        self.check_open()?;
        let last_lsn = {
            let vb = bucket
                .lock_vbucket(vbid)
                .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
            if vb.state == VbState::Active {
                return Err(Error::InvalidArgument(format!(
                    "vbucket {vbid} is active; only a replica rolls back"
                )));
            }
            vb.last_lsn
        };
        let with_history = seqno > 0 && self.inner.wal.mode() != WalMode::None;
        let past = if with_history {
            self.inner.wal.wait_durable(last_lsn, None)?;
            let _files = self.inner.snapshot_lock.lock();
            match crate::history::vbucket_at(
                &self.inner.snap_dir,
                &self.inner.wal_dir,
                bucket.id,
                vbid,
                seqno,
            ) {
                Ok(p) => p,
                Err(e) => {
                    log::warn!(
                        "vbucket {vbid}: cannot read its history ({e}); re-streaming it whole"
                    );
                    None
                }
            }
        } else {
            None
        };
        let mut vb = bucket.lock_vbucket(vbid).expect("checked above");
        let (store, high, purge) = match past {
            Some(p) => {
                vb.clock.observe(p.clock.last());
                (p.store, p.high_seqno, p.purge_seqno)
            }
            None => (Default::default(), 0, 0),
        };
        vb.store.replace_keeping_readers(store);
        vb.history += 1;
        vb.high_seqno = high;
        vb.purge_seqno = purge;
        vb.persisted_seqno = high;
        self.restart_checkpoints(&mut vb, high);
        let kept: Vec<FailoverEntry> = if high == 0 {
            Vec::new()
        } else {
            vb.failover
                .entries()
                .iter()
                .filter(|e| e.seqno <= high)
                .copied()
                .collect()
        };
        vb.failover.replace_all(kept);
        vb.last_lsn = self.inner.wal.appender()?.push(WalPayload::meta(
            bucket.id,
            vbid,
            MetaRecord::Rollback(high),
        ));
        self.log_failover_log(bucket, &mut vb)?;
        bucket.account(&mut vb);
        drop(vb);
        bucket.changes.notify();
        log::info!(
            "vbucket {vbid} of bucket {:?} rolled back to seqno {high} (asked {seqno}){}",
            bucket.name(),
            if high == 0 && seqno > 0 {
                "; its history was not on disk, so it is re-streamed whole"
            } else {
                ""
            }
        );
        Ok(high)
    }
}
