//! The hybrid logical clock behind CAS values: nanoseconds since the epoch with the low 16 bits
//! free for a counter, unique and strictly increasing per vbucket even if the wall clock steps back.

use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Default, Clone)]
pub struct HybridClock {
    last: u64,
}

/// The wall clock in nanoseconds, moved by the `clock_offset_secs` injection point.
pub fn now_nanos() -> u64 {
    let offset = crate::errinj::CLOCK_OFFSET_SECS.get();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    now.saturating_add_signed(offset.saturating_mul(1_000_000_000))
}

/// The wall clock in seconds, moved by the `clock_offset_secs` injection point.
pub fn now_secs() -> u32 {
    let offset = crate::errinj::CLOCK_OFFSET_SECS.get();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    now.saturating_add_signed(offset) as u32
}

impl HybridClock {
    pub fn tick(&mut self) -> u64 {
        self.next_at(now_nanos())
    }

    /// The next CAS given a wall-clock reading taken by the caller.
    pub fn next_at(&mut self, now_ns: u64) -> u64 {
        self.last = (now_ns & !0xffff).max(self.last + 1);
        self.last
    }

    /// The CAS `next_at(now_ns)` would give, without taking it.
    pub fn peek_at(&self, now_ns: u64) -> u64 {
        (now_ns & !0xffff).max(self.last + 1)
    }

    /// Folds in a CAS decided elsewhere (a replica applying its active's items, or recovery).
    pub fn observe(&mut self, cas: u64) {
        self.last = self.last.max(cas);
    }

    pub fn last(&self) -> u64 {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strictly_increasing_even_after_observing_the_future() {
        let mut c = HybridClock::default();
        let a = c.tick();
        c.observe(a + (1 << 40));
        let b = c.tick();
        assert_eq!(b, a + (1 << 40) + 1);
        assert!(c.tick() > b);
    }
}
