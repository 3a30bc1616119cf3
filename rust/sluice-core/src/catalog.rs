//! The live buckets of an engine, shared with the WAL writer's callback and the snapshot writer.

use std::sync::Arc;

use parking_lot::RwLock;

use crate::bucket::Bucket;
use crate::topic::Topic;

/// The live buckets and topics, shared with the WAL writer's callback and the snapshot writer.
#[derive(Default)]
pub struct Catalog {
    buckets: RwLock<Vec<Arc<Bucket>>>,
    topics: RwLock<Vec<Arc<Topic>>>,
}

impl Catalog {
    /// The buckets recovery installed, replacing any before.
    pub(crate) fn install(&self, live: Vec<Arc<Bucket>>) {
        *self.buckets.write() = live;
    }

    pub(crate) fn install_topics(&self, live: Vec<Arc<Topic>>) {
        *self.topics.write() = live;
    }

    pub fn topics(&self) -> Vec<Arc<Topic>> {
        self.topics.read().clone()
    }

    pub fn topic(&self, name: &str) -> Option<Arc<Topic>> {
        self.topics.read().iter().find(|t| t.name == name).cloned()
    }

    /// Changes the topics under their lock (a creation: the id chosen, the WAL record queued
    /// and the topic added as one step).
    pub(crate) fn with_topics<R>(&self, f: impl FnOnce(&mut Vec<Arc<Topic>>) -> R) -> R {
        f(&mut self.topics.write())
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
