//! Failed logins that resist guessing, on every port: after a failure, the next attempt for the
//! same user name or from the same address waits its turn (100 ms, doubling per failure up to
//! 5 s) before the password is checked. Attempts take their turns one at a time and in order of
//! arrival, so parallel connections do not multiply the rate; an attempt whose connection
//! closes leaves the line. An attempt whose turn would come after its connection's login
//! deadline (or more than 30 s on) is not checked: it is answered that it is throttled and
//! when to retry (SASL: ETMPFAIL; iproto: ER_ACCESS_DENIED; Greenstack: TEMPORARY_FAILURE),
//! never that its password is wrong. SASL (`login`), iproto's AUTH and Greenstack's login all
//! take their turn here.
//!
//! Unknown user names are treated like known ones (their failures are counted under the name
//! given), so the delay does not tell whether a user exists.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

// Tokio's clock (the std clock outside tests): the tests pause and advance it.
use tokio::time::Instant;

use parking_lot::Mutex;
use tokio::sync::OwnedMutexGuard;

use crate::ratelimit::RateLimitedLog;

/// The wait after one failure; it doubles with each further one.
const FIRST_DELAY: Duration = Duration::from_millis(100);
/// The longest wait between two attempts.
const MAX_DELAY: Duration = Duration::from_secs(5);
/// An attempt is held at most this long for its turn; past it, it is answered as throttled.
pub const MAX_WAIT: Duration = Duration::from_secs(30);
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
    /// The line of attempts waiting for their turn: held by the one being checked, waited
    /// for in order of arrival by the others (a closed connection's wait is dropped with it).
    line: Arc<tokio::sync::Mutex<()>>,
}

fn delay(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    FIRST_DELAY
        .saturating_mul(1 << (failures - 1).min(16))
        .min(MAX_DELAY)
}

/// Failed logins per user name and per source address.
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

/// An attempt's turn: while it is held, no other attempt for its name or address is checked.
/// Report the outcome (`LoginThrottle::failed`, `succeeded`) before dropping it.
pub struct Turn {
    _held: Vec<OwnedMutexGuard<()>>,
}

/// An attempt that was not checked: its turn would come too late.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled {
    /// When a new attempt would be checked at once, as far as the server knows now.
    pub retry_in: Duration,
}

impl Throttled {
    /// What a client is told: that it is throttled, and when to retry.
    pub fn message(&self, user: &[u8]) -> String {
        format!(
            "login for user {:?} throttled after failed logins for this user or address: not \
             checked, retry in {:.1} s",
            String::from_utf8_lossy(user),
            self.retry_in.as_secs_f64().max(0.1)
        )
    }
}

impl LoginThrottle {
    /// Waits for the turn of an attempt for `user` from `ip`: at once when neither has failed
    /// lately, else behind the attempts already waiting and one delay after the last failure.
    /// Err when the turn would come after `deadline` (the connection's login deadline; at most
    /// `MAX_WAIT` from now): the attempt is not checked. Dropping the future leaves the line.
    pub async fn turn(
        &self,
        user: &[u8],
        ip: IpAddr,
        deadline: Option<Instant>,
    ) -> Result<Turn, Throttled> {
        let now = Instant::now();
        let deadline = deadline.map_or(now + MAX_WAIT, |d| d.min(now + MAX_WAIT));
        let lines: Vec<_> = {
            let mut entries = self.entries.lock();
            keys(user, ip)
                .into_iter()
                .filter_map(|key| {
                    let b = entries.get(&key)?;
                    if now.duration_since(b.last_failure) > FORGET_AFTER {
                        entries.remove(&key);
                        return None;
                    }
                    (b.failures > 0).then(|| b.line.clone())
                })
                .collect()
        };
        if lines.is_empty() {
            return Ok(Turn { _held: Vec::new() });
        }
        let too_late = |this: &LoginThrottle| Throttled {
            retry_in: this
                .next_check(user, ip)
                .saturating_duration_since(Instant::now()),
        };
        if self.next_check(user, ip) > deadline {
            return Err(too_late(self));
        }
        // In a fixed order (the name's line, then the address's): two attempts never hold one
        // each while waiting for the other's.
        let mut held = Vec::with_capacity(lines.len());
        for line in lines {
            match tokio::time::timeout_at(deadline, line.lock_owned()).await {
                Ok(g) => held.push(g),
                Err(_) => return Err(too_late(self)),
            }
        }
        let at = self.next_check(user, ip);
        if at > deadline {
            return Err(too_late(self));
        }
        tokio::time::sleep_until(at).await;
        Ok(Turn { _held: held })
    }

    /// When the next attempt for `user` from `ip` may be checked, as the failures so far say.
    fn next_check(&self, user: &[u8], ip: IpAddr) -> Instant {
        let entries = self.entries.lock();
        keys(user, ip)
            .iter()
            .filter_map(|k| entries.get(k).filter(|b| b.failures > 0))
            .map(|b| b.next)
            .fold(Instant::now(), Instant::max)
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
            let b = entries.entry(key).or_insert_with(|| Backoff {
                failures: 0,
                next: now,
                last_failure: now,
                line: Default::default(),
            });
            b.failures = b.failures.saturating_add(1);
            b.last_failure = now;
            b.next = now + delay(b.failures);
        }
    }

    /// The user logged in: its name's failures are forgotten (the address's are not, so that
    /// one valid login does not reset a guesser's count).
    pub fn succeeded(&self, user: &[u8]) {
        let [user, _] = keys(user, IpAddr::from([0, 0, 0, 0]));
        let mut entries = self.entries.lock();
        // Attempts waiting in its line keep theirs; they are checked at once.
        if let Some(b) = entries.get_mut(&user) {
            b.failures = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_once() -> Option<Instant> {
        Some(Instant::now() + Duration::from_secs(10))
    }

    #[tokio::test(start_paused = true)]
    async fn failures_double_the_wait_and_a_login_forgets_the_name() {
        let t = LoginThrottle::default();
        let ip = IpAddr::from([10, 0, 0, 1]);
        let other = IpAddr::from([10, 0, 0, 2]);
        let start = Instant::now();
        drop(t.turn(b"ada", ip, at_once()).await.unwrap());
        assert_eq!(start.elapsed(), Duration::ZERO);
        t.failed(b"ada", ip);
        drop(t.turn(b"ada", other, at_once()).await.unwrap());
        assert_eq!(start.elapsed(), FIRST_DELAY);
        t.failed(b"ada", ip);
        t.failed(b"ada", ip);
        // The address's failures hold another name's attempt too.
        let before = Instant::now();
        drop(t.turn(b"bob", ip, at_once()).await.unwrap());
        assert_eq!(before.elapsed(), delay(3));
        t.succeeded(b"ada");
        let before = Instant::now();
        drop(
            t.turn(b"ada", IpAddr::from([10, 0, 0, 3]), at_once())
                .await
                .unwrap(),
        );
        assert_eq!(before.elapsed(), Duration::ZERO);
        assert_eq!(delay(40), MAX_DELAY);
    }

    #[tokio::test(start_paused = true)]
    async fn attempts_take_their_turns_one_at_a_time_and_closed_ones_leave_the_line() {
        let t = Arc::new(LoginThrottle::default());
        let ip = IpAddr::from([10, 0, 0, 1]);
        for _ in 0..6 {
            t.failed(b"ada", ip);
        }
        // Twenty attempts whose connections then close: they leave no trace in the line.
        for _ in 0..20 {
            let _ = tokio::time::timeout(Duration::from_millis(10), t.turn(b"ada", ip, at_once()))
                .await;
        }
        let first = t.turn(b"ada", ip, at_once()).await.unwrap();
        let waited = Instant::now();
        // The next attempt waits for the first to be judged, then one delay more.
        let t2 = t.clone();
        let second = tokio::spawn(async move { t2.turn(b"ada", ip, at_once()).await.map(drop) });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!second.is_finished(), "one check at a time");
        t.failed(b"ada", ip);
        drop(first);
        second.await.unwrap().unwrap();
        assert_eq!(waited.elapsed(), Duration::from_secs(1) + delay(7));
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_past_the_deadline_is_throttled_with_the_time_to_retry() {
        let t = LoginThrottle::default();
        let ip = IpAddr::from([10, 0, 0, 1]);
        for _ in 0..10 {
            t.failed(b"ada", ip);
        }
        let soon = Some(Instant::now() + Duration::from_secs(1));
        let refused = t.turn(b"ada", ip, soon).await.err().expect("throttled");
        assert_eq!(refused.retry_in, MAX_DELAY);
        assert!(
            refused.message(b"ada").contains("retry in 5.0 s"),
            "{}",
            refused.message(b"ada")
        );
        // Without a deadline it waits (up to MAX_WAIT) and is checked.
        assert!(t.turn(b"ada", ip, None).await.is_ok());
    }
}
