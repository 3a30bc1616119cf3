//! Log lines that a peer can trigger (a refused connection, a failed login, a malformed
//! frame): written at most once per interval and kind, each saying how many it stands for, so
//! that a flood of bad connections does not flood the log (the metrics still count every one).

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A log line that an attacker can trigger (a refused connection, a failed login): written at
/// most once per interval, with how many occurrences it stands for.
#[derive(Debug)]
pub struct RateLimitedLog {
    interval: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl Default for RateLimitedLog {
    fn default() -> Self {
        RateLimitedLog::new(Duration::from_secs(10))
    }
}

impl RateLimitedLog {
    pub fn new(interval: Duration) -> RateLimitedLog {
        RateLimitedLog {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one occurrence; returns how many (this one included) the caller's line stands for
    /// when a line is due, None when it is not.
    pub fn due(&self) -> Option<u64> {
        self.due_at(Instant::now())
    }

    /// `due` at a given moment (tests pass their own clock).
    pub fn due_at(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock();
        st.1 += 1;
        match st.0 {
            Some(last) if now.duration_since(last) < self.interval => None,
            _ => {
                st.0 = Some(now);
                Some(std::mem::take(&mut st.1))
            }
        }
    }

    /// Logs `what` at info level when a line is due, naming how many it stands for.
    pub fn info(&self, what: impl FnOnce() -> String) {
        if let Some(n) = self.due() {
            if n > 1 {
                log::info!(
                    "{} (and {} more like it since the last such line)",
                    what(),
                    n - 1
                );
            } else {
                log::info!("{}", what());
            }
        } else {
            log::debug!("{}", what());
        }
    }

    /// The same at warning level.
    pub fn warn(&self, what: impl FnOnce() -> String) {
        if let Some(n) = self.due() {
            if n > 1 {
                log::warn!(
                    "{} (and {} more like it since the last such line)",
                    what(),
                    n - 1
                );
            } else {
                log::warn!("{}", what());
            }
        } else {
            log::debug!("{}", what());
        }
    }
}

/// At most one warning per kind in this long about what peers do wrong (protocol errors,
/// refused admin requests): a flood of bad connections must not flood the log (the metrics
/// still count every one).
pub const WARNING_EVERY: Duration = Duration::from_secs(10);

/// One `RateLimitedLog` per kind of warning.
#[derive(Debug, Default)]
pub struct WarningLimiter {
    kinds: Mutex<std::collections::HashMap<&'static str, RateLimitedLog>>,
}

impl WarningLimiter {
    /// Some(held back since the last one logged) when a warning of `kind` may be logged now.
    pub fn admit(&self, kind: &'static str, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock();
        let log = kinds
            .entry(kind)
            .or_insert_with(|| RateLimitedLog::new(WARNING_EVERY));
        log.due_at(now).map(|n| n - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_limited_line_counts_what_it_skipped() {
        let log = RateLimitedLog::new(Duration::from_secs(3600));
        assert_eq!(log.due(), Some(1));
        assert_eq!(log.due(), None);
        assert_eq!(log.due(), None);
        let log = RateLimitedLog::new(Duration::ZERO);
        assert_eq!(log.due(), Some(1));
        assert_eq!(log.due(), Some(1));
    }

    #[test]
    fn protocol_warnings_are_limited_per_kind_and_count_what_they_held_back() {
        let w = WarningLimiter::default();
        let t0 = Instant::now();
        assert_eq!(w.admit("kv", t0), Some(0));
        assert_eq!(w.admit("dcp", t0), Some(0), "kinds are limited apart");
        for _ in 0..5 {
            assert_eq!(w.admit("kv", t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(w.admit("kv", t0 + WARNING_EVERY), Some(5));
        assert_eq!(w.admit("kv", t0 + WARNING_EVERY), None);
        assert_eq!(w.admit("kv", t0 + 2 * WARNING_EVERY), Some(1));
    }
}
