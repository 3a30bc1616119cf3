//! The checkpoint manager of one vbucket (DCP's design): recent changes in a list of
//! checkpoints, the newest open. A key changed again while its older change still sits in the
//! open checkpoint replaces it (dedup). Every reader of recent changes is a cursor; closed
//! checkpoints behind every cursor are freed, and changes every cursor has passed are expelled
//! even from the open checkpoint, so memory follows the slowest reader, not the write rate.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::item::Change;

pub type CursorId = u64;

/// Name of the cursor through which the WAL writer consumes each vbucket.
pub const PERSISTENCE_CURSOR: &str = "persistence";

#[derive(Debug, Clone, Copy)]
pub struct CheckpointConfig {
    pub max_items: usize,
    pub period: Duration,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            max_items: 10_000,
            period: Duration::from_secs(5),
        }
    }
}

struct Entry {
    seqno: u64,
    /// None once deduplicated away by a newer change of the same key.
    change: Option<Change>,
}

/// How far ahead of the change it drops `free` prefetches the next to drop: about the number
/// of misses a core keeps in flight.
const FREE_PREFETCH_AHEAD: usize = 8;

fn entry_cost(c: &Change) -> usize {
    std::mem::size_of::<Entry>()
        + std::mem::size_of::<crate::item::ChangeHeader>()
        + 16
        + c.data_len()
}

struct Checkpoint {
    id: u64,
    open: bool,
    created: Instant,
    /// Seqno range the checkpoint covers: a reader that starts here sees a snapshot of it.
    start: u64,
    end: u64,
    entries: VecDeque<Entry>,
    mem: usize,
}

impl Checkpoint {
    fn new(id: u64, start: u64) -> Checkpoint {
        Checkpoint {
            id,
            open: true,
            created: Instant::now(),
            start,
            end: start.saturating_sub(1),
            entries: VecDeque::new(),
            mem: 0,
        }
    }

    fn position(&self, seqno: u64) -> Result<usize, usize> {
        // Seqnos in a checkpoint are usually contiguous: try the direct slot first.
        if let Some(front) = self.entries.front() {
            let guess = seqno.wrapping_sub(front.seqno) as usize;
            if self.entries.get(guess).is_some_and(|e| e.seqno == seqno) {
                return Ok(guess);
            }
        }
        self.entries.binary_search_by_key(&seqno, |e| e.seqno)
    }
}

/// Where a newly registered cursor starts, and what must come from backfill first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    pub id: CursorId,
    /// Seqnos `[start, end]` that checkpoints no longer hold; the caller backfills them (to
    /// the high seqno at registration, where the cursor then starts).
    pub backfill: Option<(u64, u64)>,
}

/// Changes read through a cursor from one checkpoint: all of the snapshot `[start, end]` (the
/// rest of the checkpoint's range as it stood), consistent at `end`.
#[derive(Debug, Clone)]
pub struct CheckpointBatch {
    pub checkpoint_id: u64,
    pub start: u64,
    pub end: u64,
    pub changes: Vec<Change>,
}

#[derive(Debug)]
pub enum CursorRead {
    Batches(Vec<CheckpointBatch>),
    /// The cursor was dropped to free memory; its owner must re-register (and backfill).
    Dropped,
}

struct Cursor {
    name: String,
    /// Last seqno this cursor has consumed.
    seqno: u64,
    dropped: Arc<AtomicBool>,
}

/// What a cursor-drop policy is told about one cursor.
#[derive(Debug, Clone)]
pub struct CursorInfo {
    pub bucket: u16,
    pub vbucket: u16,
    pub id: CursorId,
    pub name: String,
    pub seqno: u64,
    /// Bytes that dropping this cursor alone would let the manager free.
    pub pinned_bytes: usize,
}

/// Chooses which cursors to drop when checkpoint memory is over its quota. The persistence
/// cursor is never offered. The default is native; a Python policy plugs in here later.
pub trait CursorDropPolicy: Send + Sync {
    fn choose(&self, over_by: usize, candidates: &[CursorInfo]) -> Vec<(u16, u16, CursorId)>;
}

/// Drops the cursors pinning the most memory until the estimate covers the excess.
pub struct DropSlowest;

impl CursorDropPolicy for DropSlowest {
    fn choose(&self, over_by: usize, candidates: &[CursorInfo]) -> Vec<(u16, u16, CursorId)> {
        let mut c: Vec<&CursorInfo> = candidates.iter().filter(|c| c.pinned_bytes > 0).collect();
        c.sort_by_key(|info| std::cmp::Reverse(info.pinned_bytes));
        let mut freed = 0;
        let mut out = Vec::new();
        for info in c {
            if freed >= over_by {
                break;
            }
            freed += info.pinned_bytes;
            out.push((info.bucket, info.vbucket, info.id));
        }
        out
    }
}

/// A cursor's handle for its owner: tells whether the manager dropped it.
#[derive(Debug, Clone)]
pub struct CursorHandle {
    pub id: CursorId,
    dropped: Arc<AtomicBool>,
}

impl CursorHandle {
    pub fn is_dropped(&self) -> bool {
        self.dropped.load(Ordering::Acquire)
    }
}

pub struct CheckpointManager {
    config: CheckpointConfig,
    checkpoints: VecDeque<Checkpoint>,
    cursors: HashMap<CursorId, Cursor>,
    next_cursor: CursorId,
    next_checkpoint: u64,
    mem: usize,
    /// Highest seqno queued.
    high: u64,
}

impl CheckpointManager {
    /// A manager whose history starts after `high_seqno`.
    pub fn new(config: CheckpointConfig, high_seqno: u64) -> CheckpointManager {
        let mut m = CheckpointManager {
            config,
            checkpoints: VecDeque::new(),
            cursors: HashMap::new(),
            next_cursor: 1,
            next_checkpoint: 1,
            mem: 0,
            high: high_seqno,
        };
        m.open_checkpoint();
        m
    }

    fn open_checkpoint(&mut self) {
        let id = self.next_checkpoint;
        self.next_checkpoint += 1;
        self.checkpoints
            .push_back(Checkpoint::new(id, self.high + 1));
    }

    fn close_open_checkpoint(&mut self) {
        if let Some(cp) = self.checkpoints.back_mut() {
            cp.open = false;
        }
        self.open_checkpoint();
    }

    fn open_needs_closing(&self) -> bool {
        let cp = self.checkpoints.back().expect("always one open checkpoint");
        let queued = (cp.end + 1).saturating_sub(cp.start) as usize;
        queued >= self.config.max_items
    }

    /// Closes the open checkpoint if it is older than the period. Called from the engine's
    /// maintenance tick rather than per change, which keeps clock reads off the write path.
    pub fn check_period(&mut self) {
        let cp = self.checkpoints.back().expect("always one open checkpoint");
        if cp.end >= cp.start && cp.created.elapsed() >= self.config.period {
            self.close_open_checkpoint();
        }
    }

    /// Queues a change whose seqno is above everything queued before. `replaces` is the seqno
    /// of the key's previous version (the item store knows it): if that version is still in the
    /// open checkpoint it is deduplicated away, without a key index of our own. Returns the
    /// change in memory bytes (after dedup and expelling).
    pub fn queue(&mut self, change: Change, replaces: Option<u64>) -> isize {
        let before = self.mem as isize;
        if self.open_needs_closing() {
            self.close_open_checkpoint();
        }
        let seqno = change.seqno();
        debug_assert!(seqno > self.high);
        self.high = seqno;
        let cost = entry_cost(&change);
        let cp = self
            .checkpoints
            .back_mut()
            .expect("always one open checkpoint");
        if let Some(old) = replaces.filter(|&s| s >= cp.start) {
            if let Ok(i) = cp.position(old) {
                if let Some(c) = cp.entries[i].change.take() {
                    debug_assert_eq!(c.key(), change.key());
                    let freed = entry_cost(&c);
                    cp.mem -= freed;
                    self.mem -= freed;
                }
            }
        }
        cp.entries.push_back(Entry {
            seqno,
            change: Some(change),
        });
        cp.end = seqno;
        cp.mem += cost;
        self.mem += cost;
        self.free();
        self.mem as isize - before
    }

    /// The oldest seqno from which every later change is still held (possibly deduplicated).
    fn available_from(&self) -> u64 {
        let cp = self
            .checkpoints
            .front()
            .expect("always one open checkpoint");
        match cp.entries.front() {
            Some(e) => e.seqno.max(cp.start),
            None => cp.end + 1,
        }
    }

    /// The last seqno of checkpoint `id` if it is closed and still held: where a reader that
    /// holds all of it resumes.
    pub fn closed_checkpoint_end(&self, id: u64) -> Option<u64> {
        self.checkpoints
            .iter()
            .find(|c| c.id == id && !c.open)
            .map(|c| c.end)
    }

    /// Registers a cursor for a reader that already has everything up to `have_seqno`.
    pub fn register_cursor(&mut self, name: &str, have_seqno: u64) -> (Registration, CursorHandle) {
        let id = self.next_cursor;
        self.next_cursor += 1;
        // Release what the existing cursors have passed first, so a newcomer never pins memory
        // that was already free to go.
        self.free();
        let available = self.available_from();
        // Too old for the checkpoints: the backfill runs to the high seqno, as one snapshot
        // that is consistent at its end, and the cursor takes over from there.
        let (seqno, backfill) = if have_seqno + 1 >= available {
            (have_seqno.min(self.high), None)
        } else {
            (self.high, Some((have_seqno + 1, self.high)))
        };
        let dropped = Arc::new(AtomicBool::new(false));
        self.cursors.insert(
            id,
            Cursor {
                name: name.to_string(),
                seqno,
                dropped: dropped.clone(),
            },
        );
        (Registration { id, backfill }, CursorHandle { id, dropped })
    }

    pub fn remove_cursor(&mut self, id: CursorId) -> isize {
        let before = self.mem as isize;
        self.cursors.remove(&id);
        self.free();
        self.mem as isize - before
    }

    /// Drops a cursor to free memory: its owner sees `is_dropped()` and `CursorRead::Dropped`.
    pub fn drop_cursor(&mut self, id: CursorId) -> isize {
        if let Some(c) = self.cursors.get(&id) {
            c.dropped.store(true, Ordering::Release);
            log::info!(
                "dropping checkpoint cursor '{}' at seqno {} to free memory",
                c.name,
                c.seqno
            );
        }
        self.remove_cursor(id)
    }

    pub fn cursor_seqno(&self, id: CursorId) -> Option<u64> {
        self.cursors.get(&id).map(|c| c.seqno)
    }

    /// Reads the changes after the cursor's position, one batch per checkpoint, and moves the
    /// cursor past them. `limit` is soft: it is checked between checkpoints, never inside one,
    /// so every batch runs to its checkpoint's end and a reader that sends it as one snapshot
    /// is consistent at that end (a key changed twice inside shows up once, at its later seqno;
    /// stopping in the middle could leave out an earlier change whose newer version lies beyond).
    pub fn read(&mut self, id: CursorId, limit: usize) -> (CursorRead, isize) {
        let before = self.mem as isize;
        let Some(cursor) = self.cursors.get(&id) else {
            return (CursorRead::Dropped, 0);
        };
        let mut pos = cursor.seqno;
        let mut batches = Vec::new();
        let mut read = 0;
        for cp in self.checkpoints.iter() {
            if read >= limit {
                break;
            }
            if cp.end <= pos {
                continue;
            }
            let first = match cp.position(pos + 1) {
                Ok(i) | Err(i) => i,
            };
            let changes: Vec<Change> = cp
                .entries
                .iter()
                .skip(first)
                .filter_map(|e| e.change.clone())
                .collect();
            read += changes.len();
            if !changes.is_empty() {
                batches.push(CheckpointBatch {
                    checkpoint_id: cp.id,
                    start: (pos + 1).max(cp.start),
                    end: cp.end,
                    changes,
                });
            }
            pos = cp.end;
        }
        self.cursors.get_mut(&id).expect("checked above").seqno = pos;
        self.free();
        (CursorRead::Batches(batches), self.mem as isize - before)
    }

    /// Moves a cursor to `seqno` without reading (the WAL writer after a synced batch). What
    /// this makes freeable is freed by the next `queue` or `release`, on the writing thread:
    /// freeing where the memory was allocated is cheaper than freeing from the WAL thread.
    pub fn advance(&mut self, id: CursorId, seqno: u64) {
        if let Some(c) = self.cursors.get_mut(&id) {
            c.seqno = c.seqno.max(seqno.min(self.high));
        }
    }

    /// Frees what every cursor has passed; returns the change in memory bytes.
    pub fn release(&mut self) -> isize {
        let before = self.mem as isize;
        self.free();
        self.mem as isize - before
    }

    fn min_cursor(&self) -> u64 {
        self.cursors
            .values()
            .map(|c| c.seqno)
            .min()
            .unwrap_or(self.high)
    }

    /// Frees closed checkpoints behind every cursor and expels entries every cursor has passed.
    fn free(&mut self) {
        let min = self.min_cursor();
        while self.checkpoints.len() > 1 {
            let cp = self.checkpoints.front().expect("len > 1");
            if cp.open || cp.end > min {
                break;
            }
            let cp = self.checkpoints.pop_front().expect("len > 1");
            self.mem -= cp.mem;
        }
        for cp in self.checkpoints.iter_mut() {
            if cp.start > min {
                break;
            }
            while let Some(e) = cp.entries.front() {
                if e.seqno > min {
                    break;
                }
                if let Some(Entry {
                    change: Some(ahead),
                    ..
                }) = cp.entries.get(FREE_PREFETCH_AHEAD)
                {
                    ahead.prefetch();
                }
                if let Some(c) = &e.change {
                    let freed = entry_cost(c);
                    cp.mem -= freed;
                    self.mem -= freed;
                }
                cp.entries.pop_front();
            }
        }
    }

    /// Cursors other than the persistence cursor, with the bytes each alone pins.
    pub fn cursor_infos(&self, bucket: u16, vbucket: u16) -> Vec<CursorInfo> {
        let mut seqnos: Vec<u64> = self.cursors.values().map(|c| c.seqno).collect();
        seqnos.sort_unstable();
        self.cursors
            .iter()
            .filter(|(_, c)| c.name != PERSISTENCE_CURSOR)
            .map(|(id, c)| {
                // Only the unique slowest cursor frees anything when dropped alone: the
                // entries between it and the next cursor (or the high seqno).
                let pinned = if seqnos.first() == Some(&c.seqno) && seqnos.get(1) != Some(&c.seqno)
                {
                    let next = seqnos.get(1).copied().unwrap_or(self.high);
                    self.bytes_between(c.seqno, next)
                } else {
                    0
                };
                CursorInfo {
                    bucket,
                    vbucket,
                    id: *id,
                    name: c.name.clone(),
                    seqno: c.seqno,
                    pinned_bytes: pinned,
                }
            })
            .collect()
    }

    fn bytes_between(&self, after: u64, upto: u64) -> usize {
        self.checkpoints
            .iter()
            .flat_map(|cp| cp.entries.iter())
            .filter(|e| e.seqno > after && e.seqno <= upto)
            .filter_map(|e| e.change.as_ref().map(entry_cost))
            .sum()
    }

    pub fn mem_bytes(&self) -> usize {
        self.mem
    }

    pub fn num_checkpoints(&self) -> usize {
        self.checkpoints.len()
    }

    pub fn num_cursors(&self) -> usize {
        self.cursors.len()
    }

    /// Changes held (not counting deduplicated ones).
    pub fn num_items(&self) -> usize {
        self.checkpoints
            .iter()
            .flat_map(|c| c.entries.iter())
            .filter(|e| e.change.is_some())
            .count()
    }

    pub fn high_seqno(&self) -> u64 {
        self.high
    }

    /// Forgets all history (rollback or a full resync) and starts after `high_seqno`; every
    /// cursor is dropped so its owner starts over.
    pub fn reset(&mut self, high_seqno: u64) {
        for c in self.cursors.values() {
            c.dropped.store(true, Ordering::Release);
        }
        self.cursors.clear();
        self.checkpoints.clear();
        self.mem = 0;
        self.high = high_seqno;
        self.open_checkpoint();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::item::{ChangeOp, ItemMeta};

    fn change(key: &str, seqno: u64) -> Change {
        let meta = ItemMeta {
            by_seqno: seqno,
            rev_seqno: 1,
            cas: seqno,
            ..Default::default()
        };
        Change::new(ChangeOp::Mutation, 0, 0, key.as_bytes(), b"value", meta)
    }

    fn cfg(max_items: usize) -> CheckpointConfig {
        CheckpointConfig {
            max_items,
            period: Duration::from_secs(3600),
        }
    }

    fn read_seqnos(m: &mut CheckpointManager, id: CursorId) -> Vec<u64> {
        match m.read(id, usize::MAX).0 {
            CursorRead::Batches(b) => b
                .iter()
                .flat_map(|b| b.changes.iter().map(|c| c.seqno()))
                .collect(),
            CursorRead::Dropped => panic!("dropped"),
        }
    }

    #[test]
    fn dedup_in_the_open_checkpoint_only() {
        let mut m = CheckpointManager::new(cfg(3), 0);
        let (r, _) = m.register_cursor("reader", 0);
        m.queue(change("a", 1), None);
        m.queue(change("b", 2), None);
        m.queue(change("a", 3), Some(1)); // dedups seqno 1 in the open checkpoint
        m.queue(change("a", 4), Some(3)); // new checkpoint (3 queued): no dedup across checkpoints
        assert_eq!(m.num_checkpoints(), 2);
        assert_eq!(read_seqnos(&mut m, r.id), vec![2, 3, 4]);
    }

    #[test]
    fn batches_follow_checkpoints_and_cover_their_range() {
        let mut m = CheckpointManager::new(cfg(2), 10);
        let (r, _) = m.register_cursor("reader", 10);
        let (r2, _) = m.register_cursor("r2", 10);
        for s in 11..=15 {
            m.queue(change(&format!("k{s}"), s), None);
        }
        let CursorRead::Batches(b) = m.read(r.id, usize::MAX).0 else {
            panic!()
        };
        let ranges: Vec<(u64, u64)> = b.iter().map(|b| (b.start, b.end)).collect();
        assert_eq!(ranges, vec![(11, 12), (13, 14), (15, 15)]);
        // limited reads stop between checkpoints, never inside one, and resume where they stopped
        let mut reads = Vec::new();
        loop {
            let CursorRead::Batches(b) = m.read(r2.id, 1).0 else {
                panic!()
            };
            let got: Vec<u64> = b
                .iter()
                .flat_map(|b| b.changes.iter().map(|c| c.seqno()))
                .collect();
            if got.is_empty() {
                break;
            }
            reads.push(got);
        }
        assert_eq!(reads, vec![vec![11, 12], vec![13, 14], vec![15]]);
        // everything read by every cursor is expelled: a newcomer must backfill
        assert_eq!(m.num_items(), 0);
        let (late, _) = m.register_cursor("late", 10);
        assert_eq!(late.backfill, Some((11, 15)));
    }

    #[test]
    fn memory_is_freed_behind_the_slowest_cursor() {
        let mut m = CheckpointManager::new(cfg(10), 0);
        let (fast, _) = m.register_cursor("fast", 0);
        let (slow, _) = m.register_cursor("slow", 0);
        for s in 1..=100 {
            m.queue(change(&format!("k{s}"), s), None);
        }
        read_seqnos(&mut m, fast.id);
        assert_eq!(m.num_items(), 100, "slow cursor pins everything");
        let pinned = m.mem_bytes();
        m.advance(slow.id, 95);
        m.release();
        assert_eq!(m.num_items(), 5);
        assert!(m.mem_bytes() < pinned / 10);
        m.remove_cursor(slow.id);
        assert_eq!(m.num_items(), 0);
        // a new cursor from an expelled seqno must backfill
        let (r, _) = m.register_cursor("late", 50);
        assert_eq!(r.backfill, Some((51, 100)));
    }

    #[test]
    fn dropping_picks_the_slowest_and_tells_its_owner() {
        let mut m = CheckpointManager::new(cfg(10), 0);
        let (p, _) = m.register_cursor(PERSISTENCE_CURSOR, 0);
        let (slow, handle) = m.register_cursor("slow", 0);
        for s in 1..=50 {
            m.queue(change(&format!("k{s}"), s), None);
        }
        m.advance(p.id, 50);
        m.release();
        let infos = m.cursor_infos(0, 0);
        assert_eq!(infos.len(), 1, "persistence cursor is never a candidate");
        assert!(infos[0].pinned_bytes > 0);
        let chosen = DropSlowest.choose(1, &infos);
        assert_eq!(chosen, vec![(0, 0, slow.id)]);
        m.drop_cursor(slow.id);
        assert!(handle.is_dropped());
        assert!(matches!(m.read(slow.id, 10).0, CursorRead::Dropped));
        assert_eq!(m.mem_bytes(), 0);
    }
}
