//! The failover log: newest-first (vbucket uuid, seqno) pairs, at most 25, as DCP defines it.

pub const MAX_FAILOVER_ENTRIES: usize = 25;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailoverEntry {
    pub uuid: u64,
    pub seqno: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailoverLog {
    entries: Vec<FailoverEntry>,
}

pub fn random_uuid() -> u64 {
    let mut b = [0u8; 8];
    // getrandom only fails if the OS has no entropy source at all; fall back to the clock.
    if getrandom::getrandom(&mut b).is_err() {
        return crate::hlc::now_nanos() | 1;
    }
    u64::from_le_bytes(b).max(1)
}

impl FailoverLog {
    pub fn entries(&self) -> &[FailoverEntry] {
        &self.entries
    }

    pub fn latest(&self) -> Option<FailoverEntry> {
        self.entries.first().copied()
    }

    /// Adds a new branch of history at `seqno` with a fresh uuid and returns it.
    pub fn create_entry(&mut self, seqno: u64) -> FailoverEntry {
        let e = FailoverEntry {
            uuid: random_uuid(),
            seqno,
        };
        self.push(e);
        e
    }

    /// Adds an entry decided elsewhere (WAL replay, an active's log); an entry already present
    /// is not added twice, so replay is idempotent.
    pub fn push(&mut self, e: FailoverEntry) {
        if self.entries.iter().any(|x| x.uuid == e.uuid) {
            return;
        }
        self.entries.insert(0, e);
        self.entries.truncate(MAX_FAILOVER_ENTRIES);
    }

    pub fn replace_all(&mut self, entries: Vec<FailoverEntry>) {
        self.entries = entries;
        self.entries.truncate(MAX_FAILOVER_ENTRIES);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_first_and_bounded() {
        let mut log = FailoverLog::default();
        for s in 0..30 {
            log.create_entry(s);
        }
        assert_eq!(log.entries().len(), MAX_FAILOVER_ENTRIES);
        assert_eq!(log.latest().unwrap().seqno, 29);
        assert_eq!(log.entries().last().unwrap().seqno, 5);
    }

    #[test]
    fn replaying_an_entry_is_idempotent() {
        let mut log = FailoverLog::default();
        let e = log.create_entry(7);
        log.push(e);
        assert_eq!(log.entries().len(), 1);
    }
}
