//! The write path: admission (closed engine, failing or backlogged WAL, memory, durability
//! the node can give), applying a change under its vbucket's lock, and settling it: the WAL
//! writing it, a sync, replicas' acknowledgements, as its durability level asks.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::cursors::{enforce_checkpoint_quota, release_checkpoints};
use super::{Engine, Inner};
use crate::bucket::Bucket;
use crate::config::{Durability, Eviction};
use crate::durability::{replicas_for_majority, Requirement, WaitError};
use crate::error::{Error, Result};
use crate::hlc::{now_nanos, now_secs};
use crate::item::{absolute_expiry, is_expired, validate_key, ChangeOp, Item, ItemMeta};
use crate::vbucket::{VBucket, VbState};
use crate::wal::writer::WalPayload;
use crate::wal::WalMode;
use sluice_proto::xattr::{with_system_attrs, DATATYPE_XATTR as XATTR};

/// How long a writer past twice the checkpoint quota waits for the WAL to take its changes.
pub(super) const WAL_CATCH_UP: Duration = Duration::from_secs(1);

/// How a store treats an existing key (memcached's SET, ADD, REPLACE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMode {
    Set,
    Add,
    Replace,
}

#[derive(Debug, Clone)]
pub struct StoreRequest<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub flags: u32,
    /// memcached rules: 0 never, up to 30 days relative, else absolute Unix time.
    pub expiry: u32,
    pub datatype: u8,
    /// Non-zero: only if the current CAS matches.
    pub cas: u64,
    pub mode: StoreMode,
    /// None: the bucket's default level.
    pub durability: Option<Requirement>,
    /// An existing document keeps its expiry; `expiry` applies to a new one (Couchbase's
    /// PreserveTTL).
    pub preserve_expiry: bool,
}

impl<'a> StoreRequest<'a> {
    pub fn set(key: &'a [u8], value: &'a [u8]) -> StoreRequest<'a> {
        StoreRequest {
            key,
            value,
            flags: 0,
            expiry: 0,
            datatype: 0,
            cas: 0,
            mode: StoreMode::Set,
            durability: None,
            preserve_expiry: false,
        }
    }
}

/// What a read-modify-write stores (see `Engine::update`); `expiry` is absolute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub value: Vec<u8>,
    pub flags: u32,
    pub expiry: u32,
    pub datatype: u8,
}

/// A document as `Engine::write_document` makes it: its new version, and whether that version
/// is a deleted one (a tombstone that keeps its value: extended attributes).
pub struct DocumentUpdate {
    pub update: Update,
    pub deleted: bool,
}

/// Where a write under `Engine::write_document` lands, known before it is made: the CAS and
/// seqno it takes (what Couchbase's macros `${Mutation.CAS}` and `${Mutation.seqno}` expand to).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landing {
    pub cas: u64,
    pub seqno: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MutationResult {
    pub cas: u64,
    pub vbucket: u16,
    pub seqno: u64,
    pub lsn: u64,
    /// The vbucket's uuid (its failover log's newest entry) when the change took `seqno`: what
    /// a reply carries with the seqno, read under the lock the write holds.
    pub vbucket_uuid: u64,
}

/// A write applied in memory and queued for the WAL, not yet acknowledged: its reply waits
/// until `Engine::settle` (blocking) or `Engine::settled` (async) says it meets its level. At
/// level `none` that is the WAL having written it (`lsn`); the other levels add a sync and
/// replicas' acknowledgements.
#[must_use = "a write is acknowledged only once it is settled"]
#[derive(Debug)]
pub struct Written<T> {
    pub value: T,
    requirement: Requirement,
    lsn: u64,
    /// The (vbucket, seqno) the replicas must acknowledge: the last write of each vbucket.
    first: (u16, u64),
    more: Vec<(u16, u64)>,
}

impl<T> Written<T> {
    pub(super) fn new(
        value: T,
        requirement: Requirement,
        lsn: u64,
        writes: &[(u16, u64)],
    ) -> Written<T> {
        Written {
            value,
            requirement,
            lsn,
            first: writes.first().copied().unwrap_or_default(),
            more: writes.get(1..).map(|m| m.to_vec()).unwrap_or_default(),
        }
    }

    /// The WAL record the reply must wait for.
    pub fn lsn(&self) -> u64 {
        self.lsn
    }

    /// Whether the write waits for more than the WAL writing it (a sync or replicas).
    pub fn needs_settling(&self) -> bool {
        self.requirement.level != Durability::None
    }

    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Written<U> {
        Written {
            value: f(self.value),
            requirement: self.requirement,
            lsn: self.lsn,
            first: self.first,
            more: self.more,
        }
    }

    pub(super) fn writes(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        std::iter::once(self.first).chain(self.more.iter().copied())
    }
}

/// Who a write comes from: a client (locks apply) or another node's feed (they do not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    Client,
    Feed,
}

/// The CAS check of a local write, locks included. `live`: the key's item when it is live.
/// A locked key takes only its lock's CAS (the write then releases the lock: callers unlock
/// after applying); otherwise a non-zero CAS must be the item's. A lock left on a key that is
/// no longer live (deleted, expired, evicted) is dropped.
pub(super) fn check_cas(
    vb: &mut VBucket,
    key: &[u8],
    live: Option<&ItemMeta>,
    cas: u64,
) -> Result<()> {
    let Some(m) = live else {
        vb.locks.unlock(key);
        return if cas != 0 {
            Err(Error::NotFound)
        } else {
            Ok(())
        };
    };
    match vb.locks.holder(key, Instant::now) {
        Some(lock_cas) if cas == lock_cas => Ok(()),
        Some(_) => Err(Error::Locked),
        None if cas != 0 && m.cas != cas => Err(Error::Exists),
        None => Ok(()),
    }
}

/// An active vbucket with room for `n` more seqnos.
pub(super) fn check_writable(vb: &VBucket, n: u64) -> Result<()> {
    if vb.state == VbState::Pending {
        // Being handed over: it is active here or on its new node within moments.
        return Err(Error::TempFail(format!(
            "vbucket {} is being handed over; retry",
            vb.id
        )));
    }
    if vb.state != VbState::Active {
        return Err(Error::NotMyVbucket(vb.id));
    }
    if vb.high_seqno + n > crate::item_store::MAX_SEQNO {
        return Err(Error::TempFail(format!(
            "vbucket {} has used its 2^48 seqnos",
            vb.id
        )));
    }
    Ok(())
}

impl Engine {
    /// Refuses a write early: closed engine, failing WAL, memory over the high watermark (unless
    /// the write is a deletion, which frees memory: a full bucket can always be emptied; or the
    /// bucket evicts, and eviction made room), or a durability level this node cannot provide.
    /// Called before the write takes any vbucket lock, since eviction takes them in turn.
    /// A temporary failure naming why, while the WAL cannot write (a full disk, an I/O error)
    /// or runs too far behind: writes are refused up front then, rather than queued for a reply
    /// that would wait for the disk.
    pub(super) fn wal_refusal(&self) -> Option<Error> {
        // The atomic flag first (no lock on the hot path), then the reason with it.
        if let Some(why) = self
            .inner
            .wal
            .is_failing()
            .then(|| self.inner.wal.failure())
            .flatten()
        {
            return Some(Error::TempFail(format!(
                "the WAL cannot write ({why}); retry later"
            )));
        }
        self.inner.wal.is_backlogged().then(|| {
            Error::TempFail(format!(
                "the WAL is {} bytes behind (limit {}); retry later",
                self.inner.wal.queued_bytes(),
                crate::wal::writer::QUEUE_LIMIT_BYTES
            ))
        })
    }

    pub(super) fn admit_write(
        &self,
        bucket: &Bucket,
        durability: Durability,
        op: ChangeOp,
    ) -> Result<()> {
        self.check_open()?;
        if let Some(refused) = self.wal_refusal() {
            bucket.stats.tmp_failures.fetch_add(1, Ordering::Relaxed);
            return Err(refused);
        }
        if op == ChangeOp::Mutation && bucket.above_high_watermark() {
            let lru = bucket.config.eviction == Eviction::Lru;
            if lru {
                self.inner.make_room(bucket)?;
            }
            if bucket.above_high_watermark() {
                bucket.stats.tmp_failures.fetch_add(1, Ordering::Relaxed);
                return Err(Error::TempFail(format!(
                    "bucket {:?} memory {} bytes is above its high watermark {}{}",
                    bucket.name(),
                    bucket.mem_used(),
                    bucket.config.high_watermark_bytes(),
                    if lru {
                        " with nothing left to evict"
                    } else {
                        ""
                    }
                )));
            }
        }
        if durability.persist_active() && self.inner.wal.mode() == WalMode::None {
            return Err(Error::DurabilityImpossible(format!(
                "level {} persists on the active and wal.mode is none",
                durability.as_str()
            )));
        }
        Ok(())
    }

    /// Refuses a write at once when too few replicas follow its vbucket for the level.
    pub(super) fn check_replicas(
        &self,
        bucket: &Bucket,
        vbid: u16,
        durability: Durability,
    ) -> Result<()> {
        if !durability.needs_replicas() {
            return Ok(());
        }
        let needed = replicas_for_majority(bucket.config.replicas);
        bucket.acks.check(vbid, needed).map_err(|e| match e {
            WaitError::TooFewReplicas { following, needed } => {
                Error::DurabilityImpossible(format!(
                "level {} needs {needed} replica(s) of vbucket {vbid} and {following} follow it",
                durability.as_str()
            ))
            }
            WaitError::TimedOut => unreachable!("check does not wait"),
        })
    }

    /// After a write whose last WAL record is `lsn`.
    pub(super) fn note_checkpoint_pressure(&self, bucket: &Bucket, lsn: u64) {
        if !bucket.over_checkpoint_quota() {
            return;
        }
        if !self
            .inner
            .background
            .quota_pressure
            .swap(true, Ordering::AcqRel)
        {
            self.inner.background.wake.notify_all();
        }
        // Writers outrunning the maintenance thread (a busy machine) enforce the quota
        // themselves past twice it, so the overshoot stays bounded whatever the scheduling.
        let hard = 2 * bucket.config.checkpoint_quota_bytes();
        if bucket.checkpoint_mem() > hard {
            enforce_checkpoint_quota(&self.inner);
        }
        // What is left over it is pinned by the persistence cursor: the WAL writer is behind
        // (starved of CPU or a slow disk). The writer waits for it, as memcached's writers get
        // a temporary failure past the quota; the wait is bounded so a stuck disk, which the
        // WAL reports by itself, does not hang writers here.
        if bucket.checkpoint_mem() > hard
            && self.inner.wal.wait_written(lsn, Some(WAL_CATCH_UP)).is_ok()
        {
            release_checkpoints(bucket);
        }
    }

    pub(super) fn written(
        &self,
        bucket: &Bucket,
        durability: Requirement,
        r: MutationResult,
    ) -> Written<MutationResult> {
        self.note_checkpoint_pressure(bucket, r.lsn);
        Written::new(r, durability, r.lsn, &[(r.vbucket, r.seqno)])
    }

    /// Blocks until a write meets its level: written to the WAL (every level, so that nothing
    /// acknowledged is lost to a process crash), synced for the `persist` levels, acknowledged
    /// by replicas for the majority levels; SyncWriteAmbiguous when its time runs out.
    pub fn settle<T>(&self, bucket: &Bucket, w: Written<T>) -> Result<T> {
        let level = w.requirement.level;
        let started = Instant::now();
        let timeout = self.settle_timeout(bucket, &w);
        if !level.persist_active() {
            self.inner.wal.wait_written(w.lsn, None)?;
        }
        if level == Durability::None {
            return Ok(w.value);
        }
        if level.persist_active() {
            self.inner
                .wal
                .wait_durable(w.lsn, Some(timeout))
                .map_err(|e| match e {
                    Error::TempFail(_) => {
                        Error::SyncWriteAmbiguous(format!("not on disk within {timeout:?}"))
                    }
                    other => other,
                })?;
        }
        if !level.needs_replicas() {
            return Ok(w.value);
        }
        let needed = replicas_for_majority(bucket.config.replicas);
        let on_disk = level == Durability::PersistToMajority;
        for (vb, seqno) in w.writes() {
            let left = timeout.saturating_sub(started.elapsed());
            bucket
                .acks
                .wait(vb, seqno, on_disk, needed, left)
                .map_err(|e| {
                    let why = match e {
                        WaitError::TimedOut => format!("not acknowledged in {timeout:?}"),
                        WaitError::TooFewReplicas { following, needed } => {
                            format!("{following} replica(s) follow and {needed} are needed")
                        }
                    };
                    Error::SyncWriteAmbiguous(format!(
                        "vbucket {vb} seqno {seqno} at level {}: {why}",
                        level.as_str()
                    ))
                })?;
        }
        Ok(w.value)
    }

    /// How long a write may wait to meet its level: its request's timeout or the bucket's.
    pub fn settle_timeout<T>(&self, bucket: &Bucket, w: &Written<T>) -> Duration {
        w.requirement
            .timeout
            .unwrap_or(bucket.config.durability_timeout)
    }

    /// `settle` for async callers: completes when the write meets its level, or when `timer`
    /// (a sleep of `settle_timeout`, from the caller's runtime) completes first, which makes
    /// the outcome SyncWriteAmbiguous. Waits on no thread: a connection keeps serving the
    /// requests behind it meanwhile.
    pub async fn settled<T>(
        &self,
        bucket: &Bucket,
        w: Written<T>,
        timer: impl Future<Output = ()>,
    ) -> Result<T> {
        let level = w.requirement.level;
        let timeout = self.settle_timeout(bucket, &w);
        let _waiting = (level.persist_active() || level.needs_replicas())
            .then(|| crate::bucket::DurableWait::new(&bucket.stats.durable_waiting));
        let wait = async {
            let wal = &self.inner.wal;
            if level.persist_active() {
                // Asked for at once: the device's wait overlaps the replicas'.
                wal.synced(w.lsn).await?;
            }
            if !level.needs_replicas() {
                return if level.persist_active() {
                    Ok(())
                } else {
                    wal.written(w.lsn).await
                };
            }
            let needed = replicas_for_majority(bucket.config.replicas);
            let on_disk = level == Durability::PersistToMajority;
            for (vb, seqno) in w.writes() {
                bucket
                    .acks
                    .acked(vb, seqno, on_disk, needed)
                    .await
                    .map_err(|e| {
                        Error::SyncWriteAmbiguous(format!(
                            "vbucket {vb} seqno {seqno} at level {}: {e:?}",
                            level.as_str()
                        ))
                    })?;
            }
            if !level.persist_active() {
                // Written once the replicas have it, not before: the records of the writes
                // that came meanwhile are queued by then, and one write(2) takes them all
                // (it was one per majority write).
                wal.written(w.lsn).await?;
            }
            Ok(())
        };
        {
            let mut wait = std::pin::pin!(wait);
            let mut timer = std::pin::pin!(timer);
            std::future::poll_fn(|cx| {
                if let std::task::Poll::Ready(r) = wait.as_mut().poll(cx) {
                    return std::task::Poll::Ready(r);
                }
                timer.as_mut().poll(cx).map(|()| {
                    Err(Error::SyncWriteAmbiguous(format!(
                        "not durable at level {} within {timeout:?}",
                        level.as_str()
                    )))
                })
            })
            .await?;
        }
        Ok(w.value)
    }

    /// SET / ADD / REPLACE, with CAS and a durability level; returns once settled.
    pub fn store(&self, bucket: &Bucket, req: &StoreRequest<'_>) -> Result<MutationResult> {
        self.write_store(bucket, req)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `store` applied and queued, to be settled by the caller.
    pub fn write_store(
        &self,
        bucket: &Bucket,
        req: &StoreRequest<'_>,
    ) -> Result<Written<MutationResult>> {
        let r = self.write_store_by(bucket, req, Writer::Client);
        if req.cas != 0 {
            let s = &bucket.stats;
            match &r {
                Ok(_) => s.cas_hits.fetch_add(1, Ordering::Relaxed),
                Err(Error::NotFound) => s.cas_misses.fetch_add(1, Ordering::Relaxed),
                Err(Error::Exists) => s.cas_badval.fetch_add(1, Ordering::Relaxed),
                Err(_) => 0,
            };
        }
        r
    }

    /// `write_store` of a change another node fed this one (a TAP feed): a lock on the key does
    /// not hold it up (replicated changes never wait for locks), and it ends the lock, as the
    /// item the lock was taken on is gone.
    pub fn write_fed_store(
        &self,
        bucket: &Bucket,
        req: &StoreRequest<'_>,
    ) -> Result<Written<MutationResult>> {
        self.write_store_by(bucket, req, Writer::Feed)
    }

    fn write_store_by(
        &self,
        bucket: &Bucket,
        req: &StoreRequest<'_>,
        writer: Writer,
    ) -> Result<Written<MutationResult>> {
        validate_key(req.key)?;
        if req.value.len() > bucket.config.max_item_size {
            return Err(Error::TooBig {
                size: req.value.len(),
                max: bucket.config.max_item_size,
            });
        }
        let durability = req
            .durability
            .unwrap_or_else(|| bucket.config.durability.into());
        self.admit_write(bucket, durability.level, ChangeOp::Mutation)?;
        let vbid = bucket.vbucket_of(req.key);
        self.check_replicas(bucket, vbid, durability.level)?;
        let mut vb = bucket.lock_vbucket(vbid).expect("vbucket_of is in range");
        check_writable(&vb, 1)?;
        let now = now_secs();
        let existing = vb.store.get(req.key).map(|i| i.meta());
        let live = existing.filter(|m| !m.deleted && !is_expired(m, now));
        match (req.mode, live) {
            (StoreMode::Add, Some(_)) => return Err(Error::Exists),
            (StoreMode::Replace, None) => return Err(Error::NotFound),
            _ => {}
        }
        if writer == Writer::Feed {
            vb.locks.unlock(req.key);
        }
        check_cas(&mut vb, req.key, live.as_ref(), req.cas)?;
        let expiry = match live {
            Some(m) if req.preserve_expiry => m.expiry,
            _ => absolute_expiry(req.expiry, now),
        };
        // A client's whole-document write keeps the system extended attributes the document
        // had (they live as long as its metadata, as Couchbase keeps them); user ones go
        // with the old body.
        let kept = live
            .filter(|m| {
                writer == Writer::Client && m.datatype & XATTR != 0 && req.datatype & XATTR == 0
            })
            .and_then(|_| {
                let it = vb.store.get(req.key).expect("live above").to_item();
                with_system_attrs(it.value(), req.value)
            });
        if let Some(v) = kept
            .as_ref()
            .filter(|v| v.len() > bucket.config.max_item_size)
        {
            return Err(Error::TooBig {
                size: v.len(),
                max: bucket.config.max_item_size,
            });
        }
        let meta = ItemMeta {
            flags: req.flags,
            expiry,
            datatype: if kept.is_some() {
                req.datatype | XATTR
            } else {
                req.datatype
            },
            rev_seqno: existing.map(|m| m.rev_seqno + 1).unwrap_or(1),
            ..Default::default()
        };
        let r = self.inner.apply_locked(
            bucket,
            &mut vb,
            ChangeOp::Mutation,
            req.key,
            kept.as_deref().unwrap_or(req.value),
            meta,
        )?;
        vb.locks.unlock(req.key);
        drop(vb);
        bucket.stats.sets.fetch_add(1, Ordering::Relaxed);
        Ok(self.written(bucket, durability, r))
    }

    /// Many SETs in one call: grouped by vbucket, one lock and one WAL queue lock per group.
    /// Returns the last LSN written; with `persist`, returns once all of them are durable.
    pub fn set_many(
        &self,
        bucket: &Bucket,
        items: &[(&[u8], &[u8])],
        flags: u32,
        expiry: u32,
        durability: Option<Requirement>,
    ) -> Result<u64> {
        let durability = durability.unwrap_or_else(|| bucket.config.durability.into());
        for (k, v) in items {
            validate_key(k)?;
            if v.len() > bucket.config.max_item_size {
                return Err(Error::TooBig {
                    size: v.len(),
                    max: bucket.config.max_item_size,
                });
            }
        }
        self.admit_write(bucket, durability.level, ChangeOp::Mutation)?;
        // Counting sort of item indices by vbucket: one pass, two allocations per call.
        let n = bucket.num_vbuckets() as usize;
        let vbs: Vec<u16> = items.iter().map(|(k, _)| bucket.vbucket_of(k)).collect();
        let mut starts = vec![0u32; n + 1];
        for &v in &vbs {
            starts[v as usize + 1] += 1;
        }
        for i in 0..n {
            starts[i + 1] += starts[i];
        }
        let mut order = vec![0u32; items.len()];
        let mut fill = starts.clone();
        for (i, &v) in vbs.iter().enumerate() {
            order[fill[v as usize] as usize] = i as u32;
            fill[v as usize] += 1;
        }
        // All or nothing: the vbuckets touched are locked together (in ascending order, so two
        // batches cannot deadlock) and all must accept the writes before any is applied.
        let mut locked = Vec::new();
        for vbid in 0..n {
            let count = starts[vbid + 1] - starts[vbid];
            if count > 0 {
                self.check_replicas(bucket, vbid as u16, durability.level)?;
                let vb = bucket.lock_vbucket(vbid as u16).expect("in range");
                check_writable(&vb, count as u64)?;
                locked.push((vbid, vb));
            }
        }
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let now = now_secs();
        for (vbid, vb) in locked.iter_mut() {
            for &i in &order[starts[*vbid] as usize..starts[*vbid + 1] as usize] {
                let k = items[i as usize].0;
                let live = vb.store.get(k).map(|i| i.meta());
                let live = live.filter(|m| !m.deleted && !is_expired(m, now));
                check_cas(vb, k, live.as_ref(), 0)?;
            }
        }
        let now_ns = now_nanos();
        let mut last_lsn = 0;
        let mut written = Vec::with_capacity(locked.len());
        let mut changes = Vec::new();
        // Every vbucket has accepted: each is applied, queued and let go in turn. The WAL
        // writer locks a vbucket to note what it wrote of it (`Catalog::persisted`), so holding
        // them all to the end would leave it waiting, and this call's wait for the WAL would
        // then begin with the whole batch still to write instead of the last vbucket's part.
        for (vbid, mut vb) in locked.drain(..) {
            changes.clear();
            for &i in &order[starts[vbid] as usize..starts[vbid + 1] as usize] {
                let (k, v) = items[i as usize];
                // rev_seqno 0: the store assigns the key's next revision during the same lookup.
                let meta = ItemMeta {
                    flags,
                    expiry: absolute_expiry(expiry, now),
                    ..Default::default()
                };
                changes.push(vb.apply_local(ChangeOp::Mutation, k, v, meta, now_ns));
            }
            {
                let mut a = self.inner.wal.appender()?;
                for c in changes.drain(..) {
                    last_lsn = a.push(WalPayload::Change(c));
                }
            }
            vb.last_lsn = last_lsn;
            written.push((vbid as u16, vb.high_seqno));
            bucket.changed(&mut vb);
        }
        bucket.changes.notify();
        bucket
            .stats
            .sets
            .fetch_add(items.len() as u64, Ordering::Relaxed);
        self.note_checkpoint_pressure(bucket, last_lsn);
        self.settle(
            bucket,
            Written::new(last_lsn, durability, last_lsn, &written),
        )
    }

    pub fn delete(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<MutationResult> {
        self.write_delete(bucket, key, cas, durability)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `delete` applied and queued, to be settled by the caller.
    pub fn write_delete(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<Written<MutationResult>> {
        let r = self.write_delete_by(bucket, key, cas, durability, Writer::Client, false);
        if matches!(r, Err(Error::NotFound)) {
            bucket.stats.delete_misses.fetch_add(1, Ordering::Relaxed);
        }
        r.map(|w| w.map(|(r, _)| r))
    }

    /// Deletes a live key and hands back the item it held (iproto's DELETE answers with the
    /// tuple deleted); None, and nothing written, when the key is missing, deleted or expired.
    /// Applied and queued, to be settled by the caller.
    pub fn write_take(
        &self,
        bucket: &Bucket,
        key: &[u8],
        durability: Option<Requirement>,
    ) -> Result<Written<Option<(MutationResult, Item)>>> {
        match self.write_delete_by(bucket, key, 0, durability, Writer::Client, true) {
            Ok(w) => Ok(w.map(|(r, item)| Some((r, item.expect("asked for"))))),
            // Nothing written: nothing to wait for.
            Err(Error::NotFound) => Ok(Written::new(None, Durability::None.into(), 0, &[])),
            Err(e) => Err(e),
        }
    }

    /// `write_delete` of a deletion another node fed this one: over any lock, which it ends
    /// (see `write_fed_store`).
    pub fn write_fed_delete(&self, bucket: &Bucket, key: &[u8]) -> Result<Written<MutationResult>> {
        self.write_delete_by(bucket, key, 0, None, Writer::Feed, false)
            .map(|w| w.map(|(r, _)| r))
    }

    fn write_delete_by(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
        writer: Writer,
        take: bool,
    ) -> Result<Written<(MutationResult, Option<Item>)>> {
        validate_key(key)?;
        let durability = durability.unwrap_or_else(|| bucket.config.durability.into());
        self.admit_write(bucket, durability.level, ChangeOp::Deletion)?;
        let vbid = bucket.vbucket_of(key);
        self.check_replicas(bucket, vbid, durability.level)?;
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        check_writable(&vb, 1)?;
        let now = now_secs();
        let existing = vb.store.get(key).map(|i| i.meta());
        let Some(old) = existing.filter(|m| !m.deleted && !is_expired(m, now)) else {
            vb.locks.unlock(key);
            return Err(Error::NotFound);
        };
        if writer == Writer::Feed {
            vb.locks.unlock(key);
        }
        check_cas(&mut vb, key, Some(&old), cas)?;
        let taken = take.then(|| vb.store.get(key).expect("live above").to_item());
        // The tombstone keeps the system extended attributes (Couchbase's deletion does).
        let kept = tombstone_attrs(&vb, key, old.datatype);
        let meta = ItemMeta {
            expiry: now,
            rev_seqno: old.rev_seqno + 1,
            deleted: true,
            datatype: if kept.is_some() { XATTR } else { 0 },
            ..Default::default()
        };
        let value = kept.as_deref().unwrap_or(b"");
        let r = self
            .inner
            .apply_locked(bucket, &mut vb, ChangeOp::Deletion, key, value, meta)?;
        vb.locks.unlock(key);
        drop(vb);
        bucket.stats.deletes.fetch_add(1, Ordering::Relaxed);
        Ok(self.written(bucket, durability, r).map(|r| (r, taken)))
    }

    /// A read-modify-write of one live key under its vbucket's lock: `f` sees the current item
    /// (None when missing, deleted or expired) and returns the new value, flags and absolute
    /// expiry, or an error that leaves the item alone. `cas` non-zero must match. This is the
    /// one path for APPEND, PREPEND, INCR, DECR and TOUCH. Applied and queued, to be settled by
    /// the caller.
    pub fn write_update(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
        f: impl FnOnce(Option<&Item>) -> Result<Update>,
    ) -> Result<Written<(MutationResult, Item)>> {
        self.write_document(bucket, key, cas, durability, false, |cur, _| {
            f(cur).map(|update| DocumentUpdate {
                update,
                deleted: false,
            })
        })
    }

    /// A read-modify-write of one key under its vbucket's lock that may see and leave a deleted
    /// version (sub-document commands on extended attributes): `f` gets the live item, or with
    /// `see_deleted` the tombstone if the key has one (its meta says deleted), and where the
    /// write will land. The CAS is checked against what `f` sees. A version made deleted is
    /// written as a deletion that keeps the value `f` gives.
    pub fn write_document(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
        see_deleted: bool,
        f: impl FnOnce(Option<&Item>, Landing) -> Result<DocumentUpdate>,
    ) -> Result<Written<(MutationResult, Item)>> {
        validate_key(key)?;
        let durability = durability.unwrap_or_else(|| bucket.config.durability.into());
        self.admit_write(bucket, durability.level, ChangeOp::Mutation)?;
        let vbid = bucket.vbucket_of(key);
        self.check_replicas(bucket, vbid, durability.level)?;
        let mut vb = bucket.lock_vbucket(vbid).expect("vbucket_of is in range");
        check_writable(&vb, 1)?;
        let now = now_secs();
        let existing = vb.store.get(key).map(|i| i.to_item());
        let rev = existing.as_ref().map(|i| i.meta.rev_seqno + 1).unwrap_or(1);
        let seen = existing.filter(|i| {
            if i.meta.deleted {
                see_deleted
            } else {
                !is_expired(&i.meta, now)
            }
        });
        check_cas(&mut vb, key, seen.as_ref().map(|i| &i.meta), cas)?;
        let now_ns = now_nanos();
        let landing = Landing {
            cas: vb.clock.peek_at(now_ns),
            seqno: vb.high_seqno + 1,
        };
        let d = f(seen.as_ref(), landing)?;
        let u = d.update;
        if u.value.len() > bucket.config.max_item_size {
            return Err(Error::TooBig {
                size: u.value.len(),
                max: bucket.config.max_item_size,
            });
        }
        let (op, meta) = if d.deleted {
            let meta = ItemMeta {
                flags: u.flags,
                // A tombstone's expiry field holds its delete time.
                expiry: now,
                datatype: u.datatype,
                rev_seqno: rev,
                deleted: true,
                ..Default::default()
            };
            (ChangeOp::Deletion, meta)
        } else {
            let meta = ItemMeta {
                flags: u.flags,
                expiry: u.expiry,
                datatype: u.datatype,
                rev_seqno: rev,
                ..Default::default()
            };
            (ChangeOp::Mutation, meta)
        };
        let r = self
            .inner
            .apply_locked_at(bucket, &mut vb, op, key, &u.value, meta, now_ns)?;
        debug_assert_eq!((r.cas, r.seqno), (landing.cas, landing.seqno));
        vb.locks.unlock(key);
        let item = vb.store.get(key).expect("just stored").to_item();
        drop(vb);
        if d.deleted {
            bucket.stats.deletes.fetch_add(1, Ordering::Relaxed);
        } else {
            bucket.stats.sets.fetch_add(1, Ordering::Relaxed);
        }
        Ok(self.written(bucket, durability, r).map(|r| (r, item)))
    }

    /// APPEND (`at_end`) or PREPEND: the key must exist (memcached's NOT_STORED otherwise).
    pub fn concat(
        &self,
        bucket: &Bucket,
        key: &[u8],
        data: &[u8],
        at_end: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<MutationResult> {
        self.write_concat(bucket, key, data, at_end, cas, durability)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `concat` applied and queued, to be settled by the caller.
    pub fn write_concat(
        &self,
        bucket: &Bucket,
        key: &[u8],
        data: &[u8],
        at_end: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<Written<MutationResult>> {
        self.write_update(bucket, key, cas, durability, |cur| {
            let cur = cur.ok_or(Error::NotStored)?;
            // The body grows; extended attributes stay at the front.
            let body = cur.body();
            let attrs = &cur.value()[..cur.value().len() - body.len()];
            let mut value = Vec::with_capacity(cur.value().len() + data.len());
            value.extend_from_slice(attrs);
            if at_end {
                value.extend_from_slice(body);
                value.extend_from_slice(data);
            } else {
                value.extend_from_slice(data);
                value.extend_from_slice(body);
            }
            Ok(Update {
                value,
                flags: cur.meta.flags,
                expiry: cur.meta.expiry,
                // A local change: whatever TAP hops the old value arrived with do not carry over.
                datatype: cur.meta.datatype & crate::item::DATATYPE_CLIENT_BITS,
            })
        })
        .map(|w| w.map(|(r, _)| r))
    }

    /// INCR / DECR with memcached's rules: a missing key is created with `initial` unless
    /// `expiry` is 0xffffffff; the value must be a decimal u64; INCR wraps at 2^64, DECR stops
    /// at 0. Returns the new value.
    #[allow(clippy::too_many_arguments)]
    pub fn arithmetic(
        &self,
        bucket: &Bucket,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        increment: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<(MutationResult, u64)> {
        self.write_arithmetic(
            bucket, key, delta, initial, expiry, increment, cas, durability,
        )
        .and_then(|w| self.settle(bucket, w))
    }

    /// `arithmetic` applied and queued, to be settled by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn write_arithmetic(
        &self,
        bucket: &Bucket,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        increment: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<Written<(MutationResult, u64)>> {
        let w = self.write_arithmetic_touching(
            bucket, key, delta, initial, expiry, increment, cas, durability, None,
        )?;
        Ok(w.map(|(r, item)| (r, counter_value(&item))))
    }

    /// `write_arithmetic` that also gives the item a new expiry (`touch`, memcached's rules;
    /// a created item gets it instead of `expiry`) in the same change, as the meta protocol's `ma ... T<ttl>` asks. Returns the item
    /// as stored (its value is the new number, see `counter_value`).
    #[allow(clippy::too_many_arguments)]
    pub fn write_arithmetic_touching(
        &self,
        bucket: &Bucket,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        increment: bool,
        cas: u64,
        durability: Option<Requirement>,
        touch: Option<u32>,
    ) -> Result<Written<(MutationResult, Item)>> {
        let now = now_secs();
        let s = &bucket.stats;
        let (hits, misses) = if increment {
            (&s.incr_hits, &s.incr_misses)
        } else {
            (&s.decr_hits, &s.decr_misses)
        };
        let mut existed = false;
        let r = self.write_update(bucket, key, cas, durability, |cur| {
            existed = cur.is_some();
            // A counter is the body; extended attributes stay at the front.
            let attrs = cur.map_or(&[][..], |i| &i.value()[..i.value().len() - i.body().len()]);
            let (n, flags, exp) = match cur {
                None if expiry == u32::MAX => return Err(Error::NotFound),
                None => (initial, 0, absolute_expiry(touch.unwrap_or(expiry), now)),
                Some(i) => {
                    let text = std::str::from_utf8(i.body()).map_err(|_| Error::NotNumeric)?;
                    let n: u64 = text.trim().parse().map_err(|_| Error::NotNumeric)?;
                    let n = if increment {
                        n.wrapping_add(delta)
                    } else {
                        n.saturating_sub(delta)
                    };
                    let exp = touch.map_or(i.meta.expiry, |t| absolute_expiry(t, now));
                    (n, i.meta.flags, exp)
                }
            };
            let mut value = attrs.to_vec();
            value.extend_from_slice(n.to_string().as_bytes());
            Ok(Update {
                value,
                flags,
                expiry: exp,
                datatype: if attrs.is_empty() { 0 } else { XATTR },
            })
        });
        // As memcached counts: a counter created from its initial value is a miss.
        match &r {
            Ok(_) if existed => hits.fetch_add(1, Ordering::Relaxed),
            Ok(_) | Err(Error::NotFound) => misses.fetch_add(1, Ordering::Relaxed),
            Err(_) => 0,
        };
        r
    }

    /// TOUCH: a new expiry for a live key (a mutation with its own seqno, as Couchbase does).
    /// Returns the item as touched, for GAT.
    pub fn touch(
        &self,
        bucket: &Bucket,
        key: &[u8],
        expiry: u32,
        durability: Option<Requirement>,
    ) -> Result<(MutationResult, Item)> {
        self.write_touch(bucket, key, expiry, durability)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `touch` applied and queued, to be settled by the caller.
    pub fn write_touch(
        &self,
        bucket: &Bucket,
        key: &[u8],
        expiry: u32,
        durability: Option<Requirement>,
    ) -> Result<Written<(MutationResult, Item)>> {
        let now = now_secs();
        let r = self.write_update(bucket, key, 0, durability, |cur| {
            let cur = cur.ok_or(Error::NotFound)?;
            Ok(Update {
                value: cur.value().to_vec(),
                flags: cur.meta.flags,
                expiry: absolute_expiry(expiry, now),
                datatype: cur.meta.datatype,
            })
        });
        crate::bucket::count_outcome(&r, &bucket.stats.touch_hits, &bucket.stats.touch_misses);
        r
    }

    /// FLUSH: deletes every live item of the bucket (each a DELETION with its own seqno, so
    /// streams and replicas see it). Returns how many.
    pub fn flush(&self, bucket: &Bucket) -> Result<usize> {
        self.write_flush(bucket)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `flush` applied and queued, to be settled by the caller (at level `none`: written).
    pub fn write_flush(&self, bucket: &Bucket) -> Result<Written<usize>> {
        self.check_open()?;
        bucket.stats.flushes.fetch_add(1, Ordering::Relaxed);
        let now = now_secs();
        let mut n = 0;
        let mut lsn = 0;
        for v in 0..bucket.num_vbuckets() {
            let mut vb = bucket.lock_vbucket(v).expect("in range");
            if vb.state != VbState::Active {
                continue;
            }
            vb.locks.clear();
            for key in vb.store.keys_where(|m| !m.deleted) {
                let old = vb.store.get(&key).expect("listed above").meta();
                let meta = ItemMeta {
                    expiry: now,
                    rev_seqno: old.rev_seqno + 1,
                    deleted: true,
                    ..Default::default()
                };
                lsn = self
                    .inner
                    .apply_locked(bucket, &mut vb, ChangeOp::Deletion, &key, b"", meta)?
                    .lsn;
                n += 1;
            }
        }
        bucket.stats.deletes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(Written::new(n, Durability::None.into(), lsn, &[]))
    }
}

impl Inner {
    /// Applies a local change to a locked vbucket and queues it for the WAL. Refused (Closed)
    /// once the engine is closing: no change is acknowledged that the WAL will not write.
    pub(super) fn apply_locked(
        &self,
        bucket: &Bucket,
        vb: &mut VBucket,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: ItemMeta,
    ) -> Result<MutationResult> {
        self.apply_locked_at(bucket, vb, op, key, value, meta, now_nanos())
    }

    /// `apply_locked` at a given time (`now_ns`, the clock's reading its CAS comes from).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply_locked_at(
        &self,
        bucket: &Bucket,
        vb: &mut VBucket,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: ItemMeta,
        now_ns: u64,
    ) -> Result<MutationResult> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        if crate::errinj::KILL_AT_WRITE.count_down() {
            // SAFETY: kill(2) on this process's own id.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            // SIGKILL ends every thread of the process, this one with them; a kill that failed
            // ends it all the same, and the write is never applied.
            std::process::abort();
        }
        let change = vb.apply_local(op, key, value, meta, now_ns);
        let (cas, seqno) = (change.meta().cas, change.seqno());
        let lsn = self.wal.appender()?.push(WalPayload::Change(change));
        vb.last_lsn = lsn;
        bucket.changed(vb);
        bucket.changes.notify();
        Ok(MutationResult {
            cas,
            vbucket: vb.id,
            seqno,
            lsn,
            vbucket_uuid: vb.failover.entries().first().map_or(0, |e| e.uuid),
        })
    }
}

/// What a tombstone of `key` keeps of its live version (`datatype` its datatype): the system
/// extended attributes, as Couchbase's deletions and expirations keep them; None for none.
pub(super) fn tombstone_attrs(vb: &VBucket, key: &[u8], datatype: u8) -> Option<Vec<u8>> {
    if datatype & XATTR == 0 {
        return None;
    }
    let it = vb.store.get(key)?.to_item();
    with_system_attrs(it.value(), b"")
}

/// The number an INCR or DECR stored (its value is the decimal text of a u64).
pub fn counter_value(item: &Item) -> u64 {
    std::str::from_utf8(item.body())
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0)
}
