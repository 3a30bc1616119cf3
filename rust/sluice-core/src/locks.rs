//! Per-vbucket item locks (Couchbase's GET_LOCKED / UNLOCK_KEY): a key locked with a CAS of
//! its own refuses local writes that do not carry that CAS until it is unlocked, written with
//! that CAS, or its time runs out. In memory only, as in Couchbase: a restart, a failover or a
//! vbucket moving elsewhere drops every lock. Replicated changes never consult it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Couchbase's `getl_default_timeout`: a lock asked for with 0 seconds, or with more than the
/// maximum, lasts this long.
pub const DEFAULT_LOCK_TIME: Duration = Duration::from_secs(15);
/// Couchbase's `getl_max_timeout`.
pub const MAX_LOCK_TIME: Duration = Duration::from_secs(30);

/// Expired entries are swept when the table grows past this many, so a table whose keys are
/// never visited again stays bounded by the locks taken within one lock time.
const SWEEP_ABOVE: usize = 1024;

/// How long a lock asked for with `secs` seconds lasts (Couchbase's rules).
pub fn lock_time(secs: u32) -> Duration {
    let asked = Duration::from_secs(secs as u64);
    if secs == 0 || asked > MAX_LOCK_TIME {
        DEFAULT_LOCK_TIME
    } else {
        asked
    }
}

#[derive(Debug, Clone, Copy)]
struct Lock {
    cas: u64,
    until: Instant,
}

/// The locks of one vbucket's keys, kept under the vbucket's lock.
#[derive(Debug, Default)]
pub struct LockTable {
    locks: HashMap<Box<[u8]>, Lock>,
    /// The table's size when the next sweep is due: twice what the last one left (at least
    /// SWEEP_ABOVE), so that many live locks cost each new one O(1) on average, not a sweep.
    sweep_at: usize,
}

impl LockTable {
    /// The CAS that holds `key`'s lock, if it is locked now (an expired lock is dropped).
    /// `now` is asked only when some key is locked: most reads and writes find no lock at
    /// all and should not pay for the clock.
    pub fn holder(&mut self, key: &[u8], now: impl FnOnce() -> Instant) -> Option<u64> {
        if self.locks.is_empty() {
            return None;
        }
        match self.locks.get(key) {
            Some(l) if l.until > now() => Some(l.cas),
            Some(_) => {
                self.locks.remove(key);
                None
            }
            None => None,
        }
    }

    /// Locks `key` with `cas` until `until`.
    pub fn lock(&mut self, key: &[u8], cas: u64, until: Instant, now: Instant) {
        if self.locks.len() >= self.sweep_at.max(SWEEP_ABOVE) {
            self.locks.retain(|_, l| l.until > now);
            self.sweep_at = self.locks.len().saturating_mul(2);
        }
        self.locks.insert(key.into(), Lock { cas, until });
    }

    pub fn unlock(&mut self, key: &[u8]) {
        if !self.locks.is_empty() {
            self.locks.remove(key);
        }
    }

    pub fn clear(&mut self) {
        self.locks.clear();
    }

    pub fn len(&self) -> usize {
        self.locks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.locks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_times_follow_couchbase() {
        assert_eq!(lock_time(0), DEFAULT_LOCK_TIME);
        assert_eq!(lock_time(5), Duration::from_secs(5));
        assert_eq!(lock_time(30), MAX_LOCK_TIME);
        assert_eq!(lock_time(31), DEFAULT_LOCK_TIME);
    }

    #[test]
    fn a_lock_holds_until_its_time_and_is_then_forgotten() {
        let mut t = LockTable::default();
        let now = Instant::now();
        t.lock(b"k", 7, now + Duration::from_secs(1), now);
        assert_eq!(t.holder(b"k", || now), Some(7));
        assert_eq!(t.holder(b"other", || now), None);
        assert_eq!(t.holder(b"k", || now + Duration::from_secs(2)), None);
        assert!(t.is_empty(), "the expired lock was dropped when visited");
    }

    #[test]
    fn expired_locks_are_swept_as_the_table_grows() {
        let mut t = LockTable::default();
        let now = Instant::now();
        for i in 0..SWEEP_ABOVE {
            t.lock(
                format!("k{i}").as_bytes(),
                1,
                now + Duration::from_millis(1),
                now,
            );
        }
        let later = now + Duration::from_secs(1);
        t.lock(b"fresh", 2, later + Duration::from_secs(1), later);
        assert_eq!(t.len(), 1);
    }
}
