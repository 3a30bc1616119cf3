//! Reads: items by key (an expired item found turns into an EXPIRATION), and where each
//! vbucket stands (state, seqnos, failover log) for streams and statistics.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::write::MutationResult;
use super::{Engine, Inner};
use crate::bucket::Bucket;
use crate::error::{Error, Result};
use crate::failover::FailoverEntry;
use crate::hlc::now_secs;
use crate::item::{is_expired, validate_key, ChangeOp, Item, ItemMeta};
use crate::locks::lock_time;
use crate::vbucket::{VBucket, VbState};

/// What a stream request is decided on: one vbucket's state, seqnos and failover log.
#[derive(Debug, Clone)]
pub struct StreamPosition {
    pub state: VbState,
    pub high_seqno: u64,
    pub purge_seqno: u64,
    /// Newest first.
    pub failover: Vec<FailoverEntry>,
    /// `VBucket::history`: a stream opened on this position ends when it changes.
    pub history: u64,
}

impl Engine {
    /// The live item, or None. An expired item found here turns into an EXPIRATION change
    /// (on an active vbucket) and reads as missing.
    pub fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<Item>> {
        self.get_with(bucket, key, |value, meta| Item::new(key, value, *meta))
    }

    /// `get`, with the live item's value and metadata handed to `read` where they are stored
    /// (under the vbucket's lock): a reply is written from them without a copy of the item
    /// made and freed per read.
    pub fn get_with<R>(
        &self,
        bucket: &Bucket,
        key: &[u8],
        read: impl FnOnce(&[u8], &ItemMeta) -> R,
    ) -> Result<Option<R>> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Active {
            return Err(Error::NotMyVbucket(vbid));
        }
        bucket.stats.gets.fetch_add(1, Ordering::Relaxed);
        let now = now_secs();
        let mut found = None;
        let v = &mut *vb;
        let expired = match v.store.get_referenced(key) {
            Some(i) if i.meta().deleted => None,
            Some(i) if is_expired(&i.meta(), now) => Some(i.meta()),
            Some(i) => {
                let mut meta = i.meta();
                // A locked item reads with CAS -1, as Couchbase's: only the lock's holder can
                // write it.
                if v.locks.holder(key, Instant::now).is_some() {
                    meta.cas = u64::MAX;
                }
                found = Some(read(i.value(), &meta));
                None
            }
            None => None,
        };
        if let Some(meta) = expired {
            self.inner.expire_locked(bucket, &mut vb, key, &meta, now)?;
            bucket
                .stats
                .expired_on_access
                .fetch_add(1, Ordering::Relaxed);
        }
        if found.is_none() {
            bucket.stats.get_misses.fetch_add(1, Ordering::Relaxed);
        }
        Ok(found)
    }

    /// GET_REPLICA: the key as this node's replica of its vbucket holds it (NOT_MY_VBUCKET
    /// when the vbucket is not a replica here). Expired items read as missing; a replica never
    /// expires anything itself, its active does.
    pub fn get_replica(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<Item>> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Replica {
            return Err(Error::NotMyVbucket(vbid));
        }
        bucket.stats.gets.fetch_add(1, Ordering::Relaxed);
        Ok(vb
            .store
            .get(key)
            .filter(|i| !i.meta().deleted && !is_expired(&i.meta(), now_secs()))
            .map(|i| i.to_item()))
    }

    /// GET_LOCKED: the live item, locked for `lock_secs` seconds (Couchbase's rules, see
    /// `locks::lock_time`) with a new CAS, which the item carries as returned. A key locked
    /// already is LockedTmpFail.
    pub fn get_locked(&self, bucket: &Bucket, key: &[u8], lock_secs: u32) -> Result<Item> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Active {
            return Err(Error::NotMyVbucket(vbid));
        }
        bucket.stats.gets.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let live = vb
            .store
            .get_referenced(key)
            .filter(|i| !i.meta().deleted && !is_expired(&i.meta(), now_secs()))
            .map(|i| i.to_item());
        let Some(mut item) = live else {
            vb.locks.unlock(key);
            bucket.stats.get_misses.fetch_add(1, Ordering::Relaxed);
            return Err(Error::NotFound);
        };
        if vb.locks.holder(key, || now).is_some() {
            return Err(Error::LockedTmpFail);
        }
        // A CAS of the vbucket's clock no change carries: unique, and never the item's own.
        let cas = vb.clock.tick();
        vb.locks.lock(key, cas, now + lock_time(lock_secs), now);
        item.meta.cas = cas;
        Ok(item)
    }

    /// UNLOCK_KEY: releases the lock `cas` holds on a live key. NotLocked when the key is not
    /// locked, LockedTmpFail when another CAS holds it.
    pub fn unlock(&self, bucket: &Bucket, key: &[u8], cas: u64) -> Result<()> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Active {
            return Err(Error::NotMyVbucket(vbid));
        }
        let live = vb
            .store
            .get(key)
            .is_some_and(|i| !i.meta().deleted && !is_expired(&i.meta(), now_secs()));
        if !live {
            vb.locks.unlock(key);
            return Err(Error::NotFound);
        }
        match vb.locks.holder(key, Instant::now) {
            None => Err(Error::NotLocked),
            Some(held) if held == cas => {
                vb.locks.unlock(key);
                Ok(())
            }
            Some(_) => Err(Error::LockedTmpFail),
        }
    }

    /// GET_META: a key's metadata on an active vbucket, tombstones included (an item past its
    /// expiry reads as deleted); None when the key is unknown here (or its tombstone purged).
    pub fn metadata(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<ItemMeta>> {
        let vb = self.active_vbucket_of(bucket, key)?;
        Ok(vb.store.get(key).map(|i| {
            let mut m = i.meta();
            m.deleted |= is_expired(&m, now_secs());
            m
        }))
    }

    /// A key's tombstone with what it kept (extended attributes), from an active vbucket;
    /// None when the key is live or unknown.
    pub fn get_tombstone(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<Item>> {
        let vb = self.active_vbucket_of(bucket, key)?;
        Ok(vb
            .store
            .get(key)
            .filter(|i| i.meta().deleted)
            .map(|i| i.to_item()))
    }

    /// `key`'s vbucket, locked, if it is active here (NOT_MY_VBUCKET otherwise): what reads of
    /// an active's metadata and tombstones start from.
    fn active_vbucket_of<'b>(
        &self,
        bucket: &'b Bucket,
        key: &[u8],
    ) -> Result<parking_lot::MutexGuard<'b, VBucket>> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Active {
            return Err(Error::NotMyVbucket(vbid));
        }
        Ok(vb)
    }

    /// The current version of a key including tombstones, regardless of vbucket state.
    pub fn get_meta(&self, bucket: &Bucket, key: &[u8]) -> Option<Item> {
        let vb = bucket.lock_vbucket(bucket.vbucket_of(key))?;
        vb.store.get(key).map(|i| i.to_item())
    }

    pub fn vbucket_state(&self, bucket: &Bucket, vbid: u16) -> Option<VbState> {
        bucket.lock_vbucket(vbid).map(|vb| vb.state)
    }

    pub fn high_seqnos(&self, bucket: &Bucket) -> Vec<u64> {
        (0..bucket.num_vbuckets())
            .map(|v| bucket.lock_vbucket(v).expect("in range").high_seqno)
            .collect()
    }

    pub fn persisted_seqnos(&self, bucket: &Bucket) -> Vec<u64> {
        (0..bucket.num_vbuckets())
            .map(|v| bucket.lock_vbucket(v).expect("in range").persisted_seqno)
            .collect()
    }

    /// One vbucket's seqno up to which its changes are on disk (0 for a vbucket not there).
    pub fn persisted_seqno(&self, bucket: &Bucket, vbid: u16) -> u64 {
        bucket.lock_vbucket(vbid).map_or(0, |vb| vb.persisted_seqno)
    }

    pub fn failover_log(&self, bucket: &Bucket, vbid: u16) -> Option<Vec<FailoverEntry>> {
        bucket
            .lock_vbucket(vbid)
            .map(|vb| vb.failover.entries().to_vec())
    }

    /// A vbucket's uuid now (its failover log's newest entry), which a write's reply carries
    /// with its seqno.
    pub fn vbucket_uuid(&self, bucket: &Bucket, vbid: u16) -> Option<u64> {
        bucket
            .lock_vbucket(vbid)
            .and_then(|vb| vb.failover.entries().first().map(|e| e.uuid))
    }

    /// A vbucket's state, seqnos and failover log read together, for a stream request.
    pub fn stream_position(&self, bucket: &Bucket, vbid: u16) -> Option<StreamPosition> {
        bucket.lock_vbucket(vbid).map(|vb| StreamPosition {
            state: vb.state,
            high_seqno: vb.high_seqno,
            purge_seqno: vb.purge_seqno,
            failover: vb.failover.entries().to_vec(),
            history: vb.history,
        })
    }

    /// A vbucket's state and `VBucket::history`, for a stream checking that it may go on.
    pub fn stream_state(&self, bucket: &Bucket, vbid: u16) -> Option<(VbState, u64)> {
        bucket.lock_vbucket(vbid).map(|vb| (vb.state, vb.history))
    }

    pub fn purge_seqno(&self, bucket: &Bucket, vbid: u16) -> Option<u64> {
        bucket.lock_vbucket(vbid).map(|vb| vb.purge_seqno)
    }
}

impl Inner {
    /// Turns an expired item into an EXPIRATION change with its own seqno.
    pub(super) fn expire_locked(
        &self,
        bucket: &Bucket,
        vb: &mut VBucket,
        key: &[u8],
        old: &ItemMeta,
        now: u32,
    ) -> Result<MutationResult> {
        // The tombstone keeps the system extended attributes, as a deletion's does.
        let kept = super::write::tombstone_attrs(vb, key, old.datatype);
        let meta = ItemMeta {
            flags: old.flags,
            expiry: now,
            rev_seqno: old.rev_seqno + 1,
            deleted: true,
            datatype: if kept.is_some() {
                sluice_proto::xattr::DATATYPE_XATTR
            } else {
                0
            },
            ..Default::default()
        };
        let value = kept.as_deref().unwrap_or(b"");
        self.apply_locked(bucket, vb, ChangeOp::Expiration, key, value, meta)
    }
}
