//! Named fault injection points, as Tarantool's errinj: values a test sets while a node runs,
//! read where the fault would happen. Each is off (0) unless set, and reading one is a relaxed
//! atomic load, so they stay in release builds. A process has one table: an embedded engine
//! (`sluice._native.errinj_set`), a server started with `SLUICE_ERRINJ` set (`sluice serve`
//! reads `NAME=VALUE,...` from it at start, and the admin endpoint's `POST /errinj` changes
//! them afterwards), or a Rust test. The WAL's failures (ENOSPC, EIO, a failed sync) are the
//! engine's own failpoint (`Engine::set_wal_failpoint`), one per engine.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::Relaxed};

/// Whether this process takes injections from outside (a server started with `SLUICE_ERRINJ`):
/// the admin endpoint refuses `POST /errinj` otherwise.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Lets the admin endpoint change the points (set at start, never undone).
pub fn enable() {
    ENABLED.store(true, Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Relaxed)
}

/// One injection point: its name, what it does, and its value now.
pub struct Injection {
    pub name: &'static str,
    pub doc: &'static str,
    value: AtomicI64,
}

impl Injection {
    const fn new(name: &'static str, doc: &'static str) -> Injection {
        Injection {
            name,
            doc,
            value: AtomicI64::new(0),
        }
    }

    pub fn get(&self) -> i64 {
        self.value.load(Relaxed)
    }

    pub fn set(&self, value: i64) {
        self.value.store(value, Relaxed);
    }

    /// Counts one event down: true for the event that takes the value from 1 to 0 (the one
    /// the point was set to fall on), false while it is off or still counting.
    pub fn count_down(&self) -> bool {
        let mut v = self.value.load(Relaxed);
        while v > 0 {
            match self.value.compare_exchange_weak(v, v - 1, Relaxed, Relaxed) {
                Ok(_) => return v == 1,
                Err(now) => v = now,
            }
        }
        false
    }

    /// The value as a duration in milliseconds, None when off (0 or below).
    pub fn millis(&self) -> Option<std::time::Duration> {
        u64::try_from(self.get())
            .ok()
            .filter(|&ms| ms > 0)
            .map(std::time::Duration::from_millis)
    }
}

/// Seconds added to the wall clock every time reading of the engine takes (`hlc`): expiry,
/// TTLs, lock times, CAS. A test moves time on instead of sleeping through it.
pub static CLOCK_OFFSET_SECS: Injection = Injection::new(
    "clock_offset_secs",
    "seconds added to the wall clock the engine reads (expiry, CAS, lock times)",
);

/// The WAL writer waits this long before it writes each batch: replies that acknowledge writes
/// wait with it, reads do not.
pub static WAL_WRITE_DELAY_MS: Injection = Injection::new(
    "wal_write_delay_ms",
    "milliseconds the WAL writer waits before writing each batch",
);

/// A snapshot waits this long after each block it writes: writes go on meanwhile.
pub static SNAPSHOT_BLOCK_DELAY_MS: Injection = Injection::new(
    "snapshot_block_delay_ms",
    "milliseconds a snapshot waits after each block it writes",
);

/// Topic streams send nothing while set: a partition's copies fall behind its leader (as
/// behind a stalled network), and produces asking for their acks time out.
pub static TOPIC_STREAMS_HELD: Injection = Injection::new(
    "topic_streams_held",
    "while not 0, DCP streams of topic partitions send nothing (their copies fall behind)",
);

/// Set to N, the process kills itself with SIGKILL (`kill -9`) as it is about to apply the
/// Nth local write from then: a test stops a node at one exact write of a sequence a client
/// drives (a transaction's commit record, then its documents), which a kill from outside can
/// only race, since what is applied streams to replicas at once.
pub static KILL_AT_WRITE: Injection = Injection::new(
    "kill_at_write",
    "N: the process kills itself (SIGKILL) before applying its Nth local write from now",
);

/// Every injection point, by name.
pub static ALL: &[&Injection] = &[
    &CLOCK_OFFSET_SECS,
    &WAL_WRITE_DELAY_MS,
    &SNAPSHOT_BLOCK_DELAY_MS,
    &TOPIC_STREAMS_HELD,
    &KILL_AT_WRITE,
];

/// Sets the point named `name`; Err names the points there are.
pub fn set(name: &str, value: i64) -> Result<(), String> {
    match ALL.iter().find(|i| i.name == name) {
        Some(i) => {
            i.set(value);
            Ok(())
        }
        None => Err(format!(
            "no injection point {name:?} (there are: {})",
            ALL.iter().map(|i| i.name).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Sets points from `NAME=VALUE,NAME=VALUE` (the `SLUICE_ERRINJ` variable's form).
pub fn set_all(spec: &str) -> Result<(), String> {
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not NAME=VALUE"))?;
        let value = value
            .trim()
            .parse()
            .map_err(|_| format!("{part:?}: the value is not an integer"))?;
        set(name.trim(), value)?;
    }
    Ok(())
}

/// Every point with its value now.
pub fn values() -> Vec<(&'static str, i64)> {
    ALL.iter().map(|i| (i.name, i.get())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_down_falls_on_the_event_it_was_set_to() {
        let point = Injection::new("test_point", "a point of this test alone");
        assert!(!point.count_down(), "off: nothing counts");
        point.set(3);
        assert_eq!(
            [(); 5].map(|_| point.count_down()),
            [false, false, true, false, false]
        );
        assert_eq!(point.get(), 0);
    }
}
