//! One vbucket: its items, recent changes, failover log, clock and seqno counters.

use crate::checkpoint::{CheckpointConfig, CheckpointManager, CursorId};
use crate::failover::FailoverLog;
use crate::hlc::HybridClock;
use crate::item::{Change, ChangeOp, ItemMeta};
use crate::item_store::ItemStore;
use crate::locks::LockTable;

/// The memcached protocol's vbucket state codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum VbState {
    Active = 1,
    Replica = 2,
    Pending = 3,
    Dead = 4,
}

impl VbState {
    pub fn from_code(c: u32) -> Option<VbState> {
        match c {
            1 => Some(VbState::Active),
            2 => Some(VbState::Replica),
            3 => Some(VbState::Pending),
            4 => Some(VbState::Dead),
            _ => None,
        }
    }

    pub fn parse(s: &str) -> Option<VbState> {
        match s {
            "active" => Some(VbState::Active),
            "replica" => Some(VbState::Replica),
            "pending" => Some(VbState::Pending),
            "dead" => Some(VbState::Dead),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            VbState::Active => "active",
            VbState::Replica => "replica",
            VbState::Pending => "pending",
            VbState::Dead => "dead",
        }
    }
}

pub struct VBucket {
    pub bucket: u16,
    pub id: u16,
    pub state: VbState,
    pub store: ItemStore,
    pub checkpoints: CheckpointManager,
    pub failover: FailoverLog,
    pub clock: HybridClock,
    pub high_seqno: u64,
    pub persisted_seqno: u64,
    pub purge_seqno: u64,
    /// Last WAL LSN applied to this vbucket; snapshots record it so replay skips what they hold.
    pub last_lsn: u64,
    pub persistence_cursor: Option<CursorId>,
    /// (total, checkpoint) bytes last reported to the bucket's counters.
    pub accounted: (usize, usize),
    /// Keys locked by GET_LOCKED; consulted by local writes only.
    pub locks: LockTable,
    /// Where the source this vbucket follows stood after its last followed change (see
    /// `Engine::write_followed`); logged with that change and kept by snapshots.
    pub follow_position: Option<Box<[u8]>>,
    /// How many times this vbucket's history was cut here (a rollback, a new history) since
    /// start: a stream opened before a cut serves a history that no longer exists.
    pub history: u64,
}

impl VBucket {
    pub fn new(bucket: u16, id: u16, state: VbState, checkpoint: CheckpointConfig) -> VBucket {
        VBucket {
            bucket,
            id,
            state,
            store: ItemStore::new(),
            checkpoints: CheckpointManager::new(checkpoint, 0),
            failover: FailoverLog::default(),
            clock: HybridClock::default(),
            high_seqno: 0,
            persisted_seqno: 0,
            purge_seqno: 0,
            last_lsn: 0,
            persistence_cursor: None,
            accounted: (0, 0),
            locks: LockTable::default(),
            follow_position: None,
            history: 0,
        }
    }

    /// Applies a new change decided on this node: next seqno, next CAS from the clock read
    /// `now_ns` (one read serves a whole batch). Returns the change, shared with the checkpoint.
    pub fn apply_local(
        &mut self,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        mut meta: ItemMeta,
        now_ns: u64,
    ) -> Change {
        self.high_seqno += 1;
        meta.by_seqno = self.high_seqno;
        meta.cas = self.clock.next_at(now_ns);
        self.apply(op, key, value, meta)
    }

    /// Stores a change with its seqno and CAS already decided (recovery, a replica's stream).
    /// A `rev_seqno` of 0 takes the next revision of the key.
    pub fn apply(&mut self, op: ChangeOp, key: &[u8], value: &[u8], mut meta: ItemMeta) -> Change {
        self.high_seqno = self.high_seqno.max(meta.by_seqno);
        self.clock.observe(meta.cas);
        let replaced = self.store.upsert(key, value, &mut meta);
        let [change, queued] = Change::new(op, self.bucket, self.id, key, value, meta).into_two();
        self.checkpoints.queue(queued, replaced.map(|m| m.by_seqno));
        change
    }

    /// During recovery only: into the store, bypassing checkpoints.
    pub fn recover_item(&mut self, key: &[u8], value: &[u8], meta: &ItemMeta) {
        self.high_seqno = self.high_seqno.max(meta.by_seqno);
        self.clock.observe(meta.cas);
        self.store.upsert(key, value, &mut meta.clone());
    }

    /// After recovery: checkpoints start at the recovered high seqno, all of it persisted.
    pub fn finish_recovery(&mut self, checkpoint: CheckpointConfig) {
        self.checkpoints = CheckpointManager::new(checkpoint, self.high_seqno);
        self.persisted_seqno = self.high_seqno;
        self.persistence_cursor = None;
    }

    pub fn mem_bytes(&self) -> usize {
        self.store.mem_bytes() + self.checkpoints.mem_bytes()
    }
}

/// A set of a bucket's vbuckets (any of the first `MAX_VBUCKETS`): the vbuckets one node
/// answers for in a read over a whole cluster. On the wire, one bit per vbucket, vbucket `n`
/// in bit `n % 8` of byte `n / 8`.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct VbSet([u64; VbSet::WORDS]);

impl VbSet {
    const WORDS: usize = crate::config::MAX_VBUCKETS as usize / 64;
    /// The longest encoding `from_bytes` takes.
    pub const MAX_BYTES: usize = VbSet::WORDS * 8;

    /// Adds `vb`; a vbucket past `MAX_VBUCKETS` is no bucket's, and is not added.
    pub fn insert(&mut self, vb: u16) {
        if let Some(w) = self.0.get_mut(vb as usize / 64) {
            *w |= 1 << (vb % 64);
        }
    }

    pub fn contains(&self, vb: u16) -> bool {
        self.0
            .get(vb as usize / 64)
            .is_some_and(|w| w & (1 << (vb % 64)) != 0)
    }

    /// The bytes for the first `count` vbuckets.
    pub fn to_bytes(&self, count: u16) -> Vec<u8> {
        (0..(count as usize).div_ceil(8).min(VbSet::MAX_BYTES))
            .map(|i| (self.0[i / 8] >> ((i % 8) * 8)) as u8)
            .collect()
    }

    /// The set `to_bytes` wrote; None when longer than any bucket's vbuckets need.
    pub fn from_bytes(bytes: &[u8]) -> Option<VbSet> {
        if bytes.len() > VbSet::MAX_BYTES {
            return None;
        }
        let mut set = VbSet::default();
        for (i, &b) in bytes.iter().enumerate() {
            set.0[i / 8] |= u64::from(b) << ((i % 8) * 8);
        }
        Some(set)
    }
}

impl std::fmt::Debug for VbSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let all = (0..crate::config::MAX_VBUCKETS).filter(|&vb| self.contains(vb));
        f.debug_set().entries(all).finish()
    }
}

#[cfg(test)]
mod vbset_tests {
    use super::VbSet;

    #[test]
    fn a_set_of_vbuckets_goes_through_its_bytes() {
        let mut s = VbSet::default();
        for vb in [0, 7, 8, 63, 64, 1000, 1023] {
            s.insert(vb);
        }
        s.insert(1024);
        assert!(s.contains(1000) && !s.contains(1) && !s.contains(1024));
        let bytes = s.to_bytes(1024);
        assert_eq!(bytes.len(), 128);
        assert_eq!(bytes[0], 0b1000_0001);
        assert_eq!(VbSet::from_bytes(&bytes), Some(s));
        // A bucket of 10 vbuckets sends 2 bytes: the rest are not its.
        let short = s.to_bytes(10);
        assert_eq!(short, vec![0b1000_0001, 0b1]);
        assert!(VbSet::from_bytes(&short).unwrap().contains(8));
        assert_eq!(VbSet::from_bytes(&[0; 129]), None);
    }
}
