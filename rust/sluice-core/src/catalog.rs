//! The live buckets of an engine, shared with the WAL writer's callback and the snapshot writer.

use std::sync::Arc;

use parking_lot::RwLock;

use crate::bucket::Bucket;

/// The live buckets, shared with the WAL writer's callback.
#[derive(Default)]
pub struct Catalog {
    buckets: RwLock<Vec<Arc<Bucket>>>,
}

impl Catalog {
    /// The buckets recovery installed, replacing any before.
    pub(crate) fn install(&self, live: Vec<Arc<Bucket>>) {
        *self.buckets.write() = live;
    }

    pub fn all(&self) -> Vec<Arc<Bucket>> {
        self.buckets.read().clone()
    }

    pub fn by_id(&self, id: u16) -> Option<Arc<Bucket>> {
        self.buckets.read().iter().find(|b| b.id == id).cloned()
    }

    pub fn by_name(&self, name: &str) -> Option<Arc<Bucket>> {
        self.buckets
            .read()
            .iter()
            .find(|b| b.name() == name)
            .cloned()
    }

    /// The WAL writer reports synced seqnos: advance each vbucket's persistence cursor.
    pub(crate) fn persisted(&self, upto: &[(u16, u16, u64)]) {
        let buckets = self.buckets.read();
        for &(b, v, seqno) in upto {
            let Some(bucket) = buckets.iter().find(|x| x.id == b) else {
                continue;
            };
            let Some(mut vb) = bucket.lock_vbucket(v) else {
                continue;
            };
            vb.persisted_seqno = vb.persisted_seqno.max(seqno);
            if let Some(c) = vb.persistence_cursor {
                vb.checkpoints.advance(c, seqno);
            }
        }
    }
}
