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
    if getrandom::fill(&mut b).is_err() {
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

/// Where a consumer stands when it asks to resume a stream (DCP's stream request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumePoint {
    pub start_seqno: u64,
    pub vbucket_uuid: u64,
    pub snap_start_seqno: u64,
    pub snap_end_seqno: u64,
}

/// The rollback rule of DCP's rollback page, on the producer's failover log (newest first), high
/// seqno and purge seqno. Returns the seqno the consumer must roll back to, or None when it may
/// resume where it is. The caller has checked `snap_start <= start <= snap_end`.
pub fn rollback_point(
    log: &[FailoverEntry],
    high_seqno: u64,
    purge_seqno: u64,
    at: ResumePoint,
    ignore_purged_tombstones: bool,
) -> Option<u64> {
    let ResumePoint {
        start_seqno: start,
        vbucket_uuid: uuid,
        mut snap_start_seqno,
        mut snap_end_seqno,
    } = at;
    // A consumer with the whole snapshot, or with nothing of it, stands at a snapshot boundary.
    if start == snap_end_seqno {
        snap_start_seqno = snap_end_seqno;
    } else if start == snap_start_seqno {
        snap_end_seqno = snap_start_seqno;
    }
    // 1a: no history at all.
    if start == 0 && uuid == 0 {
        return None;
    }
    // 2: tombstones the consumer has not seen are gone: only a full resync is consistent.
    if start != 0 && snap_start_seqno < purge_seqno && !ignore_purged_tombstones {
        return Some(0);
    }
    // 3: no common history.
    let Some(i) = log.iter().position(|e| e.uuid == uuid) else {
        return Some(0);
    };
    // 4: history shared up to the next branch point, or to our high seqno on the newest branch.
    let upper = if i == 0 { high_seqno } else { log[i - 1].seqno };
    if snap_end_seqno <= upper {
        None
    } else if snap_start_seqno > upper {
        Some(upper)
    } else {
        Some(snap_start_seqno)
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

    fn log(entries: &[(u64, u64)]) -> Vec<FailoverEntry> {
        entries
            .iter()
            .map(|&(uuid, seqno)| FailoverEntry { uuid, seqno })
            .collect()
    }

    fn at(start: u64, uuid: u64, snap_start: u64, snap_end: u64) -> ResumePoint {
        ResumePoint {
            start_seqno: start,
            vbucket_uuid: uuid,
            snap_start_seqno: snap_start,
            snap_end_seqno: snap_end,
        }
    }

    // The rollback page's cases, one by one.
    #[test]
    fn rollback_page_base_cases() {
        let l = log(&[(0xaa, 0)]);
        assert_eq!(rollback_point(&l, 100, 0, at(0, 0, 0, 0), false), None);
        // 1b: a history at 0 is still checked: an unknown uuid rolls back to 0.
        assert_eq!(
            rollback_point(&l, 100, 0, at(0, 0xbb, 0, 0), false),
            Some(0)
        );
        assert_eq!(rollback_point(&l, 100, 0, at(0, 0xaa, 0, 0), false), None);
    }

    #[test]
    fn rollback_page_purge_wildcard() {
        let l = log(&[(0xaa, 0)]);
        assert_eq!(
            rollback_point(&l, 100, 50, at(40, 0xaa, 40, 40), false),
            Some(0)
        );
        assert_eq!(
            rollback_point(&l, 100, 50, at(40, 0xaa, 40, 40), true),
            None
        );
        assert_eq!(
            rollback_point(&l, 100, 50, at(60, 0xaa, 60, 60), false),
            None
        );
    }

    #[test]
    fn rollback_page_history_cases() {
        // Failover log (W,0) (X,500) (Y,900), newest first; high seqno 1000.
        let (w, x, y) = (0x57, 0x58, 0x59);
        let l = log(&[(y, 900), (x, 500), (w, 0)]);
        // 3: diverging history.
        assert_eq!(
            rollback_point(&l, 1000, 0, at(700, 0x77, 700, 700), false),
            Some(0)
        );
        // 4a: lagging consumer on branch X (upper = 900).
        assert_eq!(
            rollback_point(&l, 1000, 0, at(800, x, 700, 800), false),
            None
        );
        // 4b: leading consumer on branch W: its snapshot starts past upper = 500.
        assert_eq!(
            rollback_point(&l, 1000, 0, at(650, w, 600, 700), false),
            Some(500)
        );
        // 4c: its snapshot straddles upper: back to the snapshot's start.
        assert_eq!(
            rollback_point(&l, 1000, 0, at(480, w, 450, 550), false),
            Some(450)
        );
        // Snapshot adjustment: a consumer that has all of [450, 500] is not rolled back.
        assert_eq!(
            rollback_point(&l, 1000, 0, at(500, w, 450, 500), false),
            None
        );
        // A consumer with nothing of [500, 550] stands at 500: nothing to roll back.
        assert_eq!(
            rollback_point(&l, 1000, 0, at(500, w, 500, 550), false),
            None
        );
        // On the newest branch, upper is the high seqno.
        assert_eq!(
            rollback_point(&l, 1000, 0, at(1000, y, 990, 1000), false),
            None
        );
        assert_eq!(
            rollback_point(&l, 1000, 0, at(1200, y, 1100, 1200), false),
            Some(1000)
        );
    }

    /// failure-scenarios.md: node B, at (W, 1000), streams from node C, whose log is
    /// (W, 0) then (Y, 900) after it took over: B rolls back to 900, then resumes from (W, 900).
    #[test]
    fn failure_scenarios_example() {
        let (w, y) = (0x57, 0x59);
        let c = log(&[(y, 900), (w, 0)]);
        assert_eq!(
            rollback_point(&c, 950, 0, at(1000, w, 1000, 1000), false),
            Some(900)
        );
        assert_eq!(
            rollback_point(&c, 950, 0, at(900, w, 900, 900), false),
            None
        );
    }
}
