//! Durable writes across nodes: which replicas follow each vbucket of a bucket and how far each
//! has acknowledged (DCP's SEQNO_ACKNOWLEDGED), and the waits of writes for a majority of them.
//!
//! A replica acknowledges a seqno once it holds every change up to it consistently (the end of
//! a whole snapshot), and separately once those changes are on its disk. One mutex per bucket:
//! acknowledgements come once per batch per vbucket, never per item.

use std::future::Future;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::config::Durability;

/// Couchbase's durability requirement: a level and the time the write may wait for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requirement {
    pub level: Durability,
    /// None: the bucket's `durability_timeout`.
    pub timeout: Option<Duration>,
}

impl From<Durability> for Requirement {
    fn from(level: Durability) -> Requirement {
        Requirement {
            level,
            timeout: None,
        }
    }
}

impl Durability {
    /// Whether the active's own WAL must hold the write before the reply.
    pub fn persist_active(self) -> bool {
        matches!(
            self,
            Durability::Persist
                | Durability::MajorityAndPersistActive
                | Durability::PersistToMajority
        )
    }

    /// Whether replicas must acknowledge the write.
    pub fn needs_replicas(self) -> bool {
        matches!(
            self,
            Durability::Majority
                | Durability::MajorityAndPersistActive
                | Durability::PersistToMajority
        )
    }
}

/// Replicas needed besides the active for a majority of `1 + replicas` nodes.
pub fn replicas_for_majority(replicas: u8) -> usize {
    // A majority of n = 1 + r nodes is n / 2 + 1; the active is one of them.
    (replicas as usize).div_ceil(2)
}

#[derive(Debug, Clone)]
pub struct ReplicaAck {
    pub name: String,
    /// Every change up to here is held (in memory) by the replica.
    pub seqno: u64,
    /// Every change up to here is on the replica's disk.
    pub persisted: u64,
    /// Its streams attached under this name: a stream that replaces another may attach before
    /// the old one detaches, and the name counts until the last one goes.
    streams: u32,
}

/// One vbucket's replicas, and the async waits for them: an acknowledgement wakes the waits
/// on its vbucket only, not every durable write in flight.
#[derive(Default, Clone)]
struct VbAcks {
    replicas: Vec<ReplicaAck>,
    waiters: Vec<Waker>,
}

pub struct ReplicaAcks {
    vbuckets: Mutex<Vec<VbAcks>>,
    /// For blocking waits (`wait`).
    moved: Condvar,
}

/// Why a wait for replicas ended without them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitError {
    /// Fewer replicas follow the vbucket than the majority needs.
    TooFewReplicas {
        following: usize,
        needed: usize,
    },
    TimedOut,
}

impl ReplicaAcks {
    pub fn new(num_vbuckets: u16) -> ReplicaAcks {
        ReplicaAcks {
            vbuckets: Mutex::new(vec![VbAcks::default(); num_vbuckets as usize]),
            moved: Condvar::new(),
        }
    }

    /// A replica's stream for `vb` started (the replica's name, from DCP's consumer_name).
    pub fn attach(&self, vb: u16, name: &str) {
        let mut all = self.vbuckets.lock();
        if let Some(v) = all.get_mut(vb as usize) {
            match v.replicas.iter_mut().find(|a| a.name == name) {
                Some(a) => a.streams += 1,
                None => v.replicas.push(ReplicaAck {
                    name: name.to_string(),
                    seqno: 0,
                    persisted: 0,
                    streams: 1,
                }),
            }
        }
    }

    /// The replica's stream ended: it no longer counts, and waiters re-check.
    pub fn detach(&self, vb: u16, name: &str) {
        let mut all = self.vbuckets.lock();
        let Some(v) = all.get_mut(vb as usize) else {
            return;
        };
        if let Some(a) = v.replicas.iter_mut().find(|a| a.name == name) {
            a.streams = a.streams.saturating_sub(1);
        }
        v.replicas.retain(|a| a.name != name || a.streams > 0);
        let waiters = std::mem::take(&mut v.waiters);
        drop(all);
        self.announce(waiters);
    }

    pub fn ack(&self, vb: u16, name: &str, seqno: u64, persisted: Option<u64>) {
        let mut all = self.vbuckets.lock();
        let Some(v) = all.get_mut(vb as usize) else {
            return;
        };
        let Some(a) = v.replicas.iter_mut().find(|a| a.name == name) else {
            return;
        };
        a.seqno = a.seqno.max(seqno);
        if let Some(p) = persisted {
            a.persisted = a.persisted.max(p);
        }
        let waiters = std::mem::take(&mut v.waiters);
        drop(all);
        self.announce(waiters);
    }

    fn announce(&self, waiters: Vec<Waker>) {
        self.moved.notify_all();
        for w in waiters {
            w.wake();
        }
    }

    /// Some(outcome) once a wait for `seqno` of `vb` is over.
    fn outcome(
        list: &[ReplicaAck],
        seqno: u64,
        persisted: bool,
        needed: usize,
    ) -> Option<Result<(), WaitError>> {
        let done = list
            .iter()
            .filter(|a| (if persisted { a.persisted } else { a.seqno }) >= seqno)
            .count();
        if done >= needed {
            return Some(Ok(()));
        }
        if list.len() < needed {
            return Some(Err(WaitError::TooFewReplicas {
                following: list.len(),
                needed,
            }));
        }
        None
    }

    /// Completes once `needed` replicas acknowledged `seqno` of `vb` (on disk if `persisted`),
    /// or fewer than that follow it; the caller bounds the wait in time.
    pub fn acked(
        &self,
        vb: u16,
        seqno: u64,
        persisted: bool,
        needed: usize,
    ) -> impl Future<Output = Result<(), WaitError>> + '_ {
        std::future::poll_fn(move |cx| {
            let mut all = self.vbuckets.lock();
            let Some(v) = all.get_mut(vb as usize) else {
                return Poll::Ready(Self::outcome(&[], seqno, persisted, needed).expect("over"));
            };
            if let Some(done) = Self::outcome(&v.replicas, seqno, persisted, needed) {
                return Poll::Ready(done);
            }
            if !v.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                v.waiters.push(cx.waker().clone());
            }
            Poll::Pending
        })
    }

    pub fn following(&self, vb: u16) -> Vec<ReplicaAck> {
        self.vbuckets
            .lock()
            .get(vb as usize)
            .map(|v| v.replicas.clone())
            .unwrap_or_default()
    }

    /// Refuses a write at once when too few replicas follow `vb` to ever meet the level.
    pub fn check(&self, vb: u16, needed: usize) -> Result<(), WaitError> {
        let following = self
            .vbuckets
            .lock()
            .get(vb as usize)
            .map_or(0, |v| v.replicas.len());
        if following < needed {
            return Err(WaitError::TooFewReplicas { following, needed });
        }
        Ok(())
    }

    /// Waits until `needed` replicas acknowledged `seqno` of `vb` (on disk if `persisted`).
    pub fn wait(
        &self,
        vb: u16,
        seqno: u64,
        persisted: bool,
        needed: usize,
        timeout: Duration,
    ) -> Result<(), WaitError> {
        if needed == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        let mut all = self.vbuckets.lock();
        loop {
            let list = all.get(vb as usize).map_or(&[][..], |v| &v.replicas);
            if let Some(done) = Self::outcome(list, seqno, persisted, needed) {
                return done;
            }
            if self.moved.wait_until(&mut all, deadline).timed_out() {
                return Err(WaitError::TimedOut);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn majorities() {
        assert_eq!(replicas_for_majority(0), 0);
        assert_eq!(replicas_for_majority(1), 1);
        assert_eq!(replicas_for_majority(2), 1);
        assert_eq!(replicas_for_majority(3), 2);
    }

    #[test]
    fn waits_for_acks_and_times_out() {
        let acks = std::sync::Arc::new(ReplicaAcks::new(4));
        assert_eq!(
            acks.check(1, 1),
            Err(WaitError::TooFewReplicas {
                following: 0,
                needed: 1
            })
        );
        acks.attach(1, "r1");
        assert_eq!(acks.check(1, 1), Ok(()));
        assert_eq!(
            acks.wait(1, 5, false, 1, Duration::from_millis(20)),
            Err(WaitError::TimedOut)
        );
        let a = acks.clone();
        let t = std::thread::spawn(move || a.wait(1, 5, true, 1, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        acks.ack(1, "r1", 7, None);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished(), "in memory is not on disk");
        acks.ack(1, "r1", 7, Some(6));
        assert_eq!(t.join().unwrap(), Ok(()));
        // A replica that goes away no longer counts.
        let a = acks.clone();
        let t = std::thread::spawn(move || a.wait(1, 9, false, 1, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        acks.detach(1, "r1");
        assert!(matches!(
            t.join().unwrap(),
            Err(WaitError::TooFewReplicas { .. })
        ));
    }
}
