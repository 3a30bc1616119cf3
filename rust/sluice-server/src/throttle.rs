//! Failed logins that resist guessing, on every port: after a failure, the next attempt for the
//! same user name or from the same address waits its turn (100 ms, doubling per failure up to
//! 5 s) before the password is checked; attempts made at once queue one delay apart, so parallel
//! connections do not multiply the rate, and attempts queued past 30 s are refused unchecked.
//! SASL (`login`), iproto's AUTH and Greenstack's login all take their turn here.
//!
//! Unknown user names are treated like known ones (their failures are counted under the name
//! given), so the delay does not tell whether a user exists.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::ratelimit::RateLimitedLog;

/// The wait after one failure; it doubles with each further one.
const FIRST_DELAY: Duration = Duration::from_millis(100);
/// The longest wait between two attempts.
const MAX_DELAY: Duration = Duration::from_secs(5);
/// Attempts queued further ahead than this are refused at once (ETMPFAIL), unchecked.
const MAX_QUEUE: Duration = Duration::from_secs(30);
/// Failures this old are forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(300);
/// Names and addresses remembered at most; past it the oldest are forgotten first.
const MAX_ENTRIES: usize = 16_384;
/// A user name is remembered by its first bytes (a 4 KiB name costs no more than a short one).
const NAME_KEPT: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    User(Vec<u8>),
    Ip(IpAddr),
}

#[derive(Debug)]
struct Backoff {
    failures: u32,
    /// The earliest time the next attempt is checked.
    next: Instant,
    last_failure: Instant,
}

fn delay(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    FIRST_DELAY
        .saturating_mul(1 << (failures - 1).min(16))
        .min(MAX_DELAY)
}

/// Failed SASL attempts per user name and per source address.
pub struct LoginThrottle {
    entries: Mutex<HashMap<Key, Backoff>>,
    /// Failed logins' warnings (SASL's and iproto's), at most one per 10 s.
    pub log: RateLimitedLog,
}

impl Default for LoginThrottle {
    fn default() -> Self {
        LoginThrottle {
            entries: Mutex::new(HashMap::new()),
            log: RateLimitedLog::default(),
        }
    }
}

fn keys(user: &[u8], ip: IpAddr) -> [Key; 2] {
    [
        Key::User(user[..user.len().min(NAME_KEPT)].to_vec()),
        Key::Ip(ip),
    ]
}

impl LoginThrottle {
    /// Reserves the turn of an attempt: how long it waits before its password is checked, or
    /// None when the queue for this name or address is too long (refused unchecked).
    pub fn turn(&self, user: &[u8], ip: IpAddr) -> Option<Duration> {
        let now = Instant::now();
        let mut entries = self.entries.lock();
        let mut at = now;
        for key in keys(user, ip) {
            if let Some(b) = entries.get(&key) {
                if now.duration_since(b.last_failure) > FORGET_AFTER {
                    entries.remove(&key);
                } else if b.failures > 0 {
                    at = at.max(b.next);
                }
            }
        }
        if at.duration_since(now) > MAX_QUEUE {
            return None;
        }
        // The next attempt comes one delay after this one, whatever this one's outcome.
        for key in keys(user, ip) {
            if let Some(b) = entries.get_mut(&key) {
                b.next = b.next.max(at + delay(b.failures));
            }
        }
        Some(at.duration_since(now))
    }

    /// The attempt failed: the next one for this name and from this address waits longer.
    pub fn failed(&self, user: &[u8], ip: IpAddr) {
        let now = Instant::now();
        let mut entries = self.entries.lock();
        if entries.len() + 2 > MAX_ENTRIES {
            entries.retain(|_, b| now.duration_since(b.last_failure) <= FORGET_AFTER);
            while entries.len() + 2 > MAX_ENTRIES {
                let oldest = entries
                    .iter()
                    .min_by_key(|(_, b)| b.last_failure)
                    .map(|(k, _)| k.clone())
                    .expect("not empty");
                entries.remove(&oldest);
            }
        }
        for key in keys(user, ip) {
            let b = entries.entry(key).or_insert(Backoff {
                failures: 0,
                next: now,
                last_failure: now,
            });
            b.failures = b.failures.saturating_add(1);
            b.last_failure = now;
            b.next = b.next.max(now + delay(b.failures));
        }
    }

    /// The user logged in: its name's failures are forgotten (the address's are not, so that
    /// one valid login does not reset a guesser's count).
    pub fn succeeded(&self, user: &[u8]) {
        let [user, _] = keys(user, IpAddr::from([0, 0, 0, 0]));
        self.entries.lock().remove(&user);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_double_the_wait_and_a_login_forgets_the_name() {
        let t = LoginThrottle::default();
        let ip = IpAddr::from([10, 0, 0, 1]);
        let other = IpAddr::from([10, 0, 0, 2]);
        assert_eq!(t.turn(b"ada", ip), Some(Duration::ZERO));
        t.failed(b"ada", ip);
        let w = t.turn(b"ada", other).unwrap();
        assert!(w > Duration::from_millis(50) && w <= FIRST_DELAY, "{w:?}");
        // Attempts made at once queue one delay apart.
        let w2 = t.turn(b"ada", other).unwrap();
        assert!(w2 >= w + Duration::from_millis(90), "{w:?} then {w2:?}");
        t.failed(b"ada", ip);
        t.failed(b"ada", ip);
        assert!(t.turn(b"bob", ip).unwrap() >= Duration::from_millis(300));
        t.succeeded(b"ada");
        let fresh = IpAddr::from([10, 0, 0, 3]);
        assert_eq!(t.turn(b"ada", fresh), Some(Duration::ZERO));
        assert_eq!(delay(40), MAX_DELAY);
    }

    #[test]
    fn a_long_queue_is_refused() {
        let t = LoginThrottle::default();
        let ip = IpAddr::from([10, 0, 0, 1]);
        for _ in 0..10 {
            t.failed(b"ada", ip);
        }
        let mut refused = false;
        for _ in 0..20 {
            refused |= t.turn(b"ada", ip).is_none();
        }
        assert!(refused, "the queue stops at MAX_QUEUE");
    }
}
