//! Reads: items by key (an expired item found turns into an EXPIRATION), and where each
//! vbucket stands (state, seqnos, failover log) for streams and statistics.

use std::sync::atomic::Ordering;

use super::write::MutationResult;
use super::{Engine, Inner};
use crate::bucket::Bucket;
use crate::error::{Error, Result};
use crate::failover::FailoverEntry;
use crate::hlc::now_secs;
use crate::item::{is_expired, validate_key, ChangeOp, Item, ItemMeta};
use crate::vbucket::{VBucket, VbState};

/// What a stream request is decided on: one vbucket's state, seqnos and failover log.
#[derive(Debug, Clone)]
pub struct StreamPosition {
    pub state: VbState,
    pub high_seqno: u64,
    pub purge_seqno: u64,
    /// Newest first.
    pub failover: Vec<FailoverEntry>,
}

impl Engine {
    /// The live item, or None. An expired item found here turns into an EXPIRATION change
    /// (on an active vbucket) and reads as missing.
    pub fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<Item>> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Active {
            return Err(Error::NotMyVbucket(vbid));
        }
        bucket.stats.gets.fetch_add(1, Ordering::Relaxed);
        let now = now_secs();
        let found = match vb.store.get_referenced(key) {
            Some(i) if i.meta().deleted => None,
            Some(i) if is_expired(&i.meta(), now) => {
                let meta = i.meta();
                self.inner.expire_locked(bucket, &mut vb, key, &meta, now)?;
                bucket
                    .stats
                    .expired_on_access
                    .fetch_add(1, Ordering::Relaxed);
                None
            }
            Some(i) => Some(i.to_item()),
            None => None,
        };
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

    pub fn failover_log(&self, bucket: &Bucket, vbid: u16) -> Option<Vec<FailoverEntry>> {
        bucket
            .lock_vbucket(vbid)
            .map(|vb| vb.failover.entries().to_vec())
    }

    /// A vbucket's state, seqnos and failover log read together, for a stream request.
    pub fn stream_position(&self, bucket: &Bucket, vbid: u16) -> Option<StreamPosition> {
        bucket.lock_vbucket(vbid).map(|vb| StreamPosition {
            state: vb.state,
            high_seqno: vb.high_seqno,
            purge_seqno: vb.purge_seqno,
            failover: vb.failover.entries().to_vec(),
        })
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
        let meta = ItemMeta {
            flags: old.flags,
            expiry: now,
            rev_seqno: old.rev_seqno + 1,
            deleted: true,
            ..Default::default()
        };
        self.apply_locked(bucket, vb, ChangeOp::Expiration, key, b"", meta)
    }
}
