//! One vbucket's items: a log of compact slots in by-seqno order plus a hash index from key to
//! log position. The log order is the seqno index that backfill walks; the hash index serves
//! key lookups. An overwritten or purged version's slot turns dead (its bytes are freed at once)
//! and is squeezed out by compaction.
//!
//! While a backfill range read is open, an overwritten version is kept as *stale* instead, with
//! the seqno of the version that replaced it, so that the reader still sees the latest version
//! of each key as of its end seqno while writes go on (Couchbase ephemeral buckets keep stale
//! items in their sequence list for the same reason).
//!
//! A store of a bucket with `ordered_keys` also keeps its current keys (items and tombstones)
//! in key order (`sluice_proto::keyorder`), for iproto's range reads; other stores keep no
//! such index and pay one untaken branch per new key for it.

use std::borrow::Borrow;
use std::collections::{BTreeSet, HashMap};
use std::hash::BuildHasher;
use std::ops::Bound;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};
use std::sync::Arc;

use hashbrown::HashTable;

use sluice_proto::keyorder::{compare_keys, compare_prefix, exact_parts};

use crate::item::{Item, ItemMeta};

/// Slots per chunk. Chunks have a fixed capacity, so growing the log never copies it and
/// never leaves more than one partly used chunk per vbucket.
const CHUNK: usize = 1024;

const LIVE: u8 = 0;
const STALE: u8 = 1;
const DEAD: u8 = 2;

/// Seqnos and revision numbers are kept to 48 bits, as Couchbase does: 2^48 changes of one
/// vbucket is nine years at a million a second. The engine refuses to go past it.
pub const MAX_SEQNO: u64 = (1 << 48) - 1;
const LOW48: u64 = MAX_SEQNO;

/// `rev_word` bit: read since the eviction clock last passed the slot.
const REFERENCED: u64 = 1 << 57;

/// 40 bytes. The key and value live in one allocation prefixed by the value length (4 bytes,
/// little endian), so that the pointer is thin and the lengths cost the slot nothing:
/// `seqno_word` packs by_seqno (48 bits), key length and datatype; `rev_word` packs rev_seqno
/// (48 bits), state, the deleted flag and the referenced bit of the eviction clock.
struct Slot {
    data: NonNull<u8>,
    cas: u64,
    seqno_word: u64,
    rev_word: u64,
    flags: u32,
    expiry: u32,
}

// SAFETY: a Slot uniquely owns the allocation behind `data`.
unsafe impl Send for Slot {}
unsafe impl Sync for Slot {}

const PREFIX: usize = 4;

impl Slot {
    fn new(key: &[u8], value: &[u8], meta: &ItemMeta) -> Slot {
        debug_assert!(meta.by_seqno <= MAX_SEQNO && meta.rev_seqno <= MAX_SEQNO);
        let mut v = Vec::with_capacity(PREFIX + key.len() + value.len());
        v.extend_from_slice(&(value.len() as u32).to_le_bytes());
        v.extend_from_slice(key);
        v.extend_from_slice(value);
        let boxed: Box<[u8]> = v.into_boxed_slice();
        // SAFETY: Box::into_raw never returns null.
        let data = unsafe { NonNull::new_unchecked(Box::into_raw(boxed) as *mut u8) };
        let mut slot = Slot {
            data,
            cas: meta.cas,
            seqno_word: (meta.by_seqno & LOW48)
                | (key.len() as u64) << 48
                | (meta.datatype as u64) << 56,
            rev_word: 0,
            flags: meta.flags,
            expiry: meta.expiry,
        };
        slot.set_rev(meta.rev_seqno);
        slot.set_state(LIVE, meta.deleted);
        slot
    }

    fn by_seqno(&self) -> u64 {
        self.seqno_word & LOW48
    }

    fn key_len(&self) -> usize {
        (self.seqno_word >> 48) as u8 as usize
    }

    fn datatype(&self) -> u8 {
        (self.seqno_word >> 56) as u8
    }

    fn state(&self) -> u8 {
        (self.rev_word >> 48) as u8
    }

    fn deleted(&self) -> bool {
        (self.rev_word >> 56) & 1 == 1
    }

    fn set_state(&mut self, state: u8, deleted: bool) {
        self.rev_word = (self.rev_word & LOW48) | (state as u64) << 48 | (deleted as u64) << 56;
    }

    fn referenced(&self) -> bool {
        self.rev_word & REFERENCED != 0
    }

    fn set_referenced(&mut self, on: bool) {
        if on {
            self.rev_word |= REFERENCED;
        } else {
            self.rev_word &= !REFERENCED;
        }
    }

    fn set_rev(&mut self, rev: u64) {
        self.rev_word = (self.rev_word & !LOW48) | (rev & LOW48);
    }

    fn value_len(&self) -> usize {
        if self.state() == DEAD {
            return 0;
        }
        // SAFETY: a live or stale slot's allocation starts with the 4-byte value length.
        let prefix = unsafe { std::slice::from_raw_parts(self.data.as_ptr(), PREFIX) };
        u32::from_le_bytes(prefix.try_into().expect("4 bytes")) as usize
    }

    /// Bytes of key plus value.
    fn len(&self) -> usize {
        if self.state() == DEAD {
            return 0;
        }
        self.key_len() + self.value_len()
    }

    fn bytes(&self) -> &[u8] {
        if self.state() == DEAD {
            return &[];
        }
        // SAFETY: the allocation holds PREFIX + len() initialised bytes until kill().
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().add(PREFIX), self.len()) }
    }

    fn key(&self) -> &[u8] {
        &self.bytes()[..self.key_len()]
    }

    fn value(&self) -> &[u8] {
        &self.bytes()[self.key_len()..]
    }

    fn meta(&self) -> ItemMeta {
        ItemMeta {
            cas: self.cas,
            rev_seqno: self.rev_word & LOW48,
            by_seqno: self.by_seqno(),
            flags: self.flags,
            expiry: self.expiry,
            datatype: self.datatype(),
            deleted: self.deleted(),
        }
    }

    /// Frees the bytes; the seqno stays so that binary search over the log still works.
    fn kill(&mut self) {
        if self.state() != DEAD {
            let total = PREFIX + self.len();
            // SAFETY: reconstructs exactly the Box<[u8]> leaked in new().
            unsafe {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    self.data.as_ptr(),
                    total,
                )));
            }
            self.data = NonNull::dangling();
            self.seqno_word &= LOW48;
            self.set_state(DEAD, false);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A borrowed view of one stored version.
pub struct ItemRef<'a> {
    slot: &'a Slot,
}

impl<'a> ItemRef<'a> {
    pub fn key(&self) -> &'a [u8] {
        self.slot.key()
    }
    pub fn value(&self) -> &'a [u8] {
        self.slot.value()
    }
    pub fn meta(&self) -> ItemMeta {
        self.slot.meta()
    }
    pub fn to_item(&self) -> Item {
        Item::new(self.key(), self.value(), self.meta())
    }
}

/// A key copied out of the store without allocating (keys are at most 250 bytes).
pub struct KeyBuf {
    len: u8,
    bytes: [u8; crate::item::MAX_KEY_LEN],
}

impl KeyBuf {
    fn new(key: &[u8]) -> KeyBuf {
        let mut bytes = [0u8; crate::item::MAX_KEY_LEN];
        bytes[..key.len()].copy_from_slice(key);
        KeyBuf {
            len: key.len() as u8,
            bytes,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

/// What the eviction clock picked: a live item to evict or a tombstone to purge.
pub struct Victim {
    pub key: KeyBuf,
    pub meta: ItemMeta,
}

/// Approximate bytes a stored item costs beyond its key and value (slot, index, allocator).
pub const ITEM_OVERHEAD: usize = std::mem::size_of::<Slot>() + PREFIX + 16;

/// Where an ordered scan starts (exclusive): keys strictly after it ascending, strictly before
/// it descending.
#[derive(Debug, Clone, Copy)]
pub enum Seek<'a> {
    /// From the first key (ascending) or the last (descending).
    Ends,
    /// Just before the keys `prefix` matches (`keyorder::compare_prefix`).
    BeforePrefix(&'a [u8]),
    /// Just after the keys `prefix` matches.
    AfterPrefix(&'a [u8]),
    /// At this stored key (to continue a scan after it).
    Key(&'a [u8]),
}

/// What the keys of a bucket's ordered stores have looked like so far, shared by its vbuckets:
/// whether every key had the same number of parts, each encoded the one shortest way
/// (`keyorder::exact_parts`). Then a key with that many parts equals, in key order, only the
/// key with its very bytes, and an EQ select of it is one hash lookup. Only ever widens
/// (a key leaving does not narrow it again), so it errs on the side of scanning.
#[derive(Debug, Default)]
pub struct KeyShape {
    /// 0: no key yet; n + 1: every key exact with n parts; u32::MAX: anything else.
    parts: AtomicU32,
}

impl KeyShape {
    const MIXED: u32 = u32::MAX;

    fn note(&self, key: &[u8]) {
        let this = exact_parts(key)
            .filter(|&n| n < Self::MIXED - 1)
            .map_or(Self::MIXED, |n| n + 1);
        let seen = self.parts.load(AtomicOrdering::Relaxed);
        if seen == this || seen == Self::MIXED {
            return;
        }
        let widened = if seen == 0 { this } else { Self::MIXED };
        if let Err(now) = self.parts.compare_exchange(
            seen,
            widened,
            AtomicOrdering::Relaxed,
            AtomicOrdering::Relaxed,
        ) {
            if now != this {
                self.parts.store(Self::MIXED, AtomicOrdering::Relaxed);
            }
        }
    }

    /// Whether every key stored so far (none at all counts) is exact with `n` parts.
    pub fn all_exact_with(&self, n: u32) -> bool {
        let seen = self.parts.load(AtomicOrdering::Relaxed);
        seen == 0 || seen == n.wrapping_add(1)
    }
}

/// A stored key of the ordered index; ordered by `compare_keys`, then by bytes (keys equal in
/// key order with different encodings, such as `[1]` and `[1.0]`, are still two keys).
struct IndexedKey(Box<[u8]>);

/// What the ordered index compares: stored keys and the probes a scan seeks to. A trait object
/// so that `BTreeSet::range` can seek to a probe that no stored key equals (just before or
/// after every key a prefix matches) without storing anything beyond the key.
trait KeyProbe {
    fn bytes(&self) -> &[u8];
    /// -1 just before the keys `bytes` prefixes, 0 this key, 1 just after them.
    fn side(&self) -> i8;
}

impl KeyProbe for IndexedKey {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn side(&self) -> i8 {
        0
    }
}

struct Probe<'a>(&'a [u8], i8);

impl KeyProbe for Probe<'_> {
    fn bytes(&self) -> &[u8] {
        self.0
    }
    fn side(&self) -> i8 {
        self.1
    }
}

fn exact_order(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    compare_keys(a, b).then_with(|| a.cmp(b))
}

/// A stored key against a probe on one side of the keys its bytes prefix.
fn key_vs_probe(key: &[u8], prefix: &[u8], side: i8) -> std::cmp::Ordering {
    match compare_prefix(key, prefix) {
        std::cmp::Ordering::Equal if side < 0 => std::cmp::Ordering::Greater,
        std::cmp::Ordering::Equal => std::cmp::Ordering::Less,
        o => o,
    }
}

impl<'a> Borrow<dyn KeyProbe + 'a> for IndexedKey {
    fn borrow(&self) -> &(dyn KeyProbe + 'a) {
        self
    }
}

impl Ord for dyn KeyProbe + '_ {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        match (self.side(), other.side()) {
            (0, 0) => exact_order(self.bytes(), other.bytes()),
            (0, s) => key_vs_probe(self.bytes(), other.bytes(), s),
            (s, 0) => key_vs_probe(other.bytes(), self.bytes(), s).reverse(),
            // Two probes are never compared by a scan (each has one bound); for totality:
            (a, b) => compare_keys(self.bytes(), other.bytes()).then(a.cmp(&b)),
        }
    }
}

impl PartialOrd for dyn KeyProbe + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for dyn KeyProbe + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for dyn KeyProbe + '_ {}

impl Ord for IndexedKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        exact_order(&self.0, &other.0)
    }
}

impl PartialOrd for IndexedKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for IndexedKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for IndexedKey {}

/// Approximate bytes an ordered index entry costs beyond its key (the box, B-tree node room).
const ORDERED_OVERHEAD: usize = 32;

struct OrderedIndex {
    keys: BTreeSet<IndexedKey>,
    bytes: usize,
    shape: Arc<KeyShape>,
}

impl OrderedIndex {
    fn insert(&mut self, key: &[u8]) {
        self.shape.note(key);
        if self.keys.insert(IndexedKey(key.into())) {
            self.bytes += key.len() + ORDERED_OVERHEAD;
        }
    }

    fn remove(&mut self, key: &[u8]) {
        if self.keys.remove(&Probe(key, 0) as &dyn KeyProbe) {
            self.bytes -= key.len() + ORDERED_OVERHEAD;
        }
    }
}

#[derive(Default)]
pub struct ItemStore {
    chunks: Vec<Vec<Slot>>,
    len: usize,
    index: HashTable<u32>,
    /// Seeded at random per store: keys come from the network, so a fixed seed would let a
    /// client compute colliding keys offline.
    hasher: foldhash::fast::RandomState,
    /// Versions in the index (live items and tombstones).
    current: usize,
    /// Current versions that are tombstones.
    tombstones: usize,
    dead: usize,
    data_bytes: usize,
    range_reads: u32,
    /// seqno of a stale version -> seqno of the version that replaced it.
    stale_successor: HashMap<u64, u64>,
    /// The eviction clock's hand: the seqno it looks at next (a seqno rather than a position,
    /// so that compaction moving slots does not move it).
    clock_hand: u64,
    /// Current keys in key order, for a bucket with `ordered_keys` only.
    ordered: Option<Box<OrderedIndex>>,
}

impl ItemStore {
    pub fn new() -> ItemStore {
        ItemStore::default()
    }

    fn slot(&self, pos: usize) -> &Slot {
        &self.chunks[pos / CHUNK][pos % CHUNK]
    }

    fn slot_mut(&mut self, pos: usize) -> &mut Slot {
        &mut self.chunks[pos / CHUNK][pos % CHUNK]
    }

    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn find_pos(&self, key: &[u8]) -> Option<usize> {
        let h = self.hash(key);
        let chunks = &self.chunks;
        self.index
            .find(h, |&p| {
                chunks[p as usize / CHUNK][p as usize % CHUNK].key() == key
            })
            .map(|&p| p as usize)
    }

    /// The current version of `key` (possibly a tombstone).
    pub fn get(&self, key: &[u8]) -> Option<ItemRef<'_>> {
        self.find_pos(key).map(|p| ItemRef { slot: self.slot(p) })
    }

    /// `get` for a client's read: also marks the item referenced, which spares it from the
    /// eviction clock's next pass. A bit set under the vbucket lock the read holds anyway.
    pub fn get_referenced(&mut self, key: &[u8]) -> Option<ItemRef<'_>> {
        let pos = self.find_pos(key)?;
        // Written only when it changes: a hot item's slot is then only read.
        if !self.slot(pos).referenced() {
            self.slot_mut(pos).set_referenced(true);
        }
        Some(ItemRef {
            slot: self.slot(pos),
        })
    }

    /// Advances the eviction clock to its next victim.
    ///
    /// The log is in seqno order, that is in order of last write: the hand sweeps it from old
    /// to new and wraps around. A live item read since the hand last passed it (its referenced
    /// bit set) gets a second chance: the bit is cleared and the hand moves on. Any other live
    /// item is the victim. This is CLOCK (second chance), an approximation of LRU: writes count
    /// as use by moving the item to the log's end, reads by the bit, and an item survives as
    /// long as it is read once per revolution of the hand. Tombstones are skipped unless
    /// `tombstones` asks for them (to purge when they take too much memory). At most two
    /// revolutions (one clearing bits, one finding a victim), so None means there is no live
    /// item at all; amortised, each step clears a bit a read set or passes a slot eviction or
    /// compaction will soon remove.
    pub fn next_victim(&mut self, tombstones: bool) -> Option<Victim> {
        let mut pos = self.lower_bound(self.clock_hand);
        let mut found = None;
        // Each wrap costs a step too: at most three of them in two revolutions.
        for _ in 0..2 * self.len + 3 {
            if pos >= self.len {
                if self.len == 0 {
                    break;
                }
                pos = 0;
                continue;
            }
            let slot = self.slot_mut(pos);
            pos += 1;
            if slot.state() != LIVE || (slot.deleted() && !tombstones) {
                continue;
            }
            if slot.referenced() {
                slot.set_referenced(false);
                continue;
            }
            found = Some(Victim {
                key: KeyBuf::new(slot.key()),
                meta: slot.meta(),
            });
            break;
        }
        self.clock_hand = if pos < self.len {
            self.slot(pos).by_seqno()
        } else {
            u64::MAX
        };
        found
    }

    fn push_slot(&mut self, slot: Slot) -> usize {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        let pos = self.len;
        self.chunks
            .last_mut()
            .expect("chunk pushed above")
            .push(slot);
        self.len += 1;
        pos
    }

    /// Retires an older version: stale while a range read may still need it, else dead.
    fn retire(&mut self, pos: usize, successor_seqno: u64) {
        let range_reads = self.range_reads;
        let slot = self.slot_mut(pos);
        let bytes = slot.len();
        let seqno = slot.by_seqno();
        if range_reads > 0 {
            let deleted = slot.deleted();
            slot.set_state(STALE, deleted);
            self.stale_successor.insert(seqno, successor_seqno);
        } else {
            slot.kill();
            self.dead += 1;
            self.data_bytes -= bytes;
        }
    }

    /// Stores a new version of a key. Its by_seqno must be above every seqno already stored.
    /// A `rev_seqno` of 0 asks for the next one (the old version's plus one, or 1), written back
    /// into `meta`. Returns the metadata of the version it replaced.
    pub fn upsert(&mut self, key: &[u8], value: &[u8], meta: &mut ItemMeta) -> Option<ItemMeta> {
        debug_assert!(self.len == 0 || self.slot(self.len - 1).by_seqno() < meta.by_seqno);
        let h = self.hash(key);
        self.reserve_index();
        let new_pos = self.push_slot(Slot::new(key, value, meta));
        self.data_bytes += key.len() + value.len();
        if meta.deleted {
            self.tombstones += 1;
        }
        let chunks = &self.chunks;
        let hasher = &self.hasher;
        let entry = self.index.entry(
            h,
            |&p| chunks[p as usize / CHUNK][p as usize % CHUNK].key() == key,
            |&p| hasher.hash_one(chunks[p as usize / CHUNK][p as usize % CHUNK].key()),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(mut o) => {
                let old_pos = *o.get() as usize;
                *o.get_mut() = new_pos as u32;
                let old = self.slot(old_pos).meta();
                if meta.rev_seqno == 0 {
                    meta.rev_seqno = (old.rev_seqno + 1).min(MAX_SEQNO);
                    self.slot_mut(new_pos).set_rev(meta.rev_seqno);
                }
                if old.deleted {
                    self.tombstones -= 1;
                }
                self.retire(old_pos, meta.by_seqno);
                self.maybe_compact();
                Some(old)
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(new_pos as u32);
                if let Some(ordered) = &mut self.ordered {
                    ordered.insert(key);
                }
                if meta.rev_seqno == 0 {
                    meta.rev_seqno = 1;
                    self.slot_mut(new_pos).set_rev(1);
                }
                self.current += 1;
                None
            }
        }
    }

    /// Makes room in the index for one more key. hashbrown's own growth rehashes the entries
    /// in table order, each a random slot and key allocation; rebuilt from the log instead,
    /// slots and keys are read about in the order they were allocated (the misses of the
    /// other way were a fifth of a replica's catch-up). Called before the new slot is pushed:
    /// the live slots are then exactly the keys indexed.
    fn reserve_index(&mut self) {
        if self.index.len() < self.index.capacity() {
            return;
        }
        let chunks = &self.chunks;
        let hasher = &self.hasher;
        let rehash =
            |&p: &u32| hasher.hash_one(chunks[p as usize / CHUNK][p as usize % CHUNK].key());
        let mut index = HashTable::with_capacity((self.index.capacity() * 2).max(16));
        for (pos, slot) in chunks.iter().flatten().enumerate() {
            if slot.state() == LIVE {
                index.insert_unique(hasher.hash_one(slot.key()), pos as u32, rehash);
            }
        }
        debug_assert_eq!(index.len(), self.index.len());
        self.index = index;
    }

    /// Drops the current version of a key altogether (tombstone purge, rollback).
    pub fn purge(&mut self, key: &[u8]) -> Option<ItemMeta> {
        let h = self.hash(key);
        let chunks = &self.chunks;
        let found = self
            .index
            .find_entry(h, |&p| {
                chunks[p as usize / CHUNK][p as usize % CHUNK].key() == key
            })
            .ok()?;
        let (pos, _) = found.remove();
        let pos = pos as usize;
        if let Some(ordered) = &mut self.ordered {
            ordered.remove(key);
        }
        let meta = self.slot(pos).meta();
        if meta.deleted {
            self.tombstones -= 1;
        }
        self.current -= 1;
        self.retire(pos, u64::MAX);
        self.maybe_compact();
        Some(meta)
    }

    fn maybe_compact(&mut self) {
        if self.range_reads == 0 && self.dead >= CHUNK && self.dead >= self.current {
            self.compact();
        }
    }

    /// Compacts when dead slots hold a quarter of the log or more: eviction calls it, since
    /// dead slots keep their 40 bytes until compaction and a full bucket wants them back
    /// sooner than `maybe_compact`'s half.
    pub fn compact_under_pressure(&mut self) -> bool {
        if self.range_reads == 0 && self.dead >= CHUNK && self.dead * 4 >= self.len {
            self.compact();
            return true;
        }
        false
    }

    /// Squeezes dead slots out of the log and re-points the index. Never runs during a range
    /// read, so positions only move when nobody holds one.
    ///
    /// The index is re-pointed through a table of where each slot moved, without hashing or
    /// reading a key: rebuilding it cost a cache miss or two per item, and a load that had
    /// overwritten every key once brought every vbucket here at about the same time (a stall
    /// of tens of milliseconds, once per pass over the keys, in replication lag's p99).
    pub fn compact(&mut self) {
        debug_assert_eq!(self.range_reads, 0);
        let old = std::mem::take(&mut self.chunks);
        let mut moved_to = Vec::with_capacity(self.len);
        self.len = 0;
        self.dead = 0;
        for slot in old.into_iter().flatten() {
            if slot.state() == DEAD {
                moved_to.push(u32::MAX);
            } else {
                moved_to.push(self.push_slot(slot) as u32);
            }
        }
        for pos in self.index.iter_mut() {
            *pos = moved_to[*pos as usize];
            debug_assert_ne!(*pos, u32::MAX, "the index points at a dead slot");
        }
        let chunks = &self.chunks;
        let hasher = &self.hasher;
        // Reclaims the index's room only when keys went away (a no-op otherwise).
        self.index.shrink_to_fit(|&p| {
            hasher.hash_one(chunks[p as usize / CHUNK][p as usize % CHUNK].key())
        });
    }

    /// First log position whose seqno is >= `seqno`.
    fn lower_bound(&self, seqno: u64) -> usize {
        let (mut lo, mut hi) = (0usize, self.len);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.slot(mid).by_seqno() < seqno {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Takes `other`'s contents (a rollback) while range reads opened on this store stay
    /// counted, so their ends still balance.
    /// Keeps the ordered index too when this store has one.
    pub fn replace_keeping_readers(&mut self, other: ItemStore) {
        let readers = self.range_reads;
        let shape = self.ordered.as_ref().map(|o| o.shape.clone());
        *self = other;
        self.range_reads = readers;
        self.set_ordered(shape);
    }

    /// Keeps current keys in key order (Some, the bucket's shape) or not (None). Turning it on
    /// indexes the keys held already (after recovery, a snapshot load or a rollback).
    pub fn set_ordered(&mut self, shape: Option<Arc<KeyShape>>) {
        let Some(shape) = shape else {
            self.ordered = None;
            return;
        };
        if let Some(o) = &mut self.ordered {
            if Arc::ptr_eq(&o.shape, &shape) {
                return;
            }
        }
        let mut index = OrderedIndex {
            keys: BTreeSet::new(),
            bytes: 0,
            shape,
        };
        for slot in self.chunks.iter().flatten() {
            if slot.state() == LIVE {
                index.insert(slot.key());
            }
        }
        self.ordered = Some(Box::new(index));
    }

    pub fn is_ordered(&self) -> bool {
        self.ordered.is_some()
    }

    /// Current versions (tombstones included) in key order from `from` (exclusive), ascending
    /// or descending, until `visit` returns false. Returns true when the scan reached the end
    /// of the keys (false when `visit` stopped it), and also when the store keeps no order.
    pub fn scan_ordered(
        &self,
        from: Seek<'_>,
        descending: bool,
        mut visit: impl FnMut(ItemRef<'_>) -> bool,
    ) -> bool {
        let Some(ordered) = &self.ordered else {
            return true;
        };
        let probe = match from {
            Seek::Ends => None,
            Seek::BeforePrefix(p) => Some(Probe(p, -1)),
            Seek::AfterPrefix(p) => Some(Probe(p, 1)),
            Seek::Key(k) => Some(Probe(k, 0)),
        };
        let probe = probe.as_ref().map(|p| p as &dyn KeyProbe);
        let bound = probe.map_or(Bound::Unbounded, Bound::Excluded);
        let mut each = |k: &IndexedKey| match self.get(&k.0) {
            Some(item) => visit(item),
            None => {
                debug_assert!(false, "ordered index holds a key the hash index does not");
                true
            }
        };
        if descending {
            let range = ordered
                .keys
                .range::<dyn KeyProbe, _>((Bound::Unbounded, bound));
            range.rev().all(&mut each)
        } else {
            let range = ordered
                .keys
                .range::<dyn KeyProbe, _>((bound, Bound::Unbounded));
            range.into_iter().all(&mut each)
        }
    }

    /// Opens a range read: until the matching `end_range_read`, replaced versions stay readable.
    pub fn begin_range_read(&mut self) {
        self.range_reads += 1;
    }

    pub fn end_range_read(&mut self) {
        debug_assert!(self.range_reads > 0);
        self.range_reads = self.range_reads.saturating_sub(1);
        if self.range_reads == 0 && !self.stale_successor.is_empty() {
            let stale: Vec<u64> = self.stale_successor.drain().map(|(s, _)| s).collect();
            for seqno in stale {
                let pos = self.lower_bound(seqno);
                if pos < self.len
                    && self.slot(pos).by_seqno() == seqno
                    && self.slot(pos).state() == STALE
                {
                    let bytes = self.slot(pos).len();
                    self.slot_mut(pos).kill();
                    self.dead += 1;
                    self.data_bytes -= bytes;
                }
            }
            self.maybe_compact();
        }
    }

    /// Within an open range read: the latest version of each key as of `end`, for seqnos in
    /// `[from, end]`, at most `limit` of them, in seqno order; `emit` returns false to stop
    /// before the item it was shown. Returns the seqno to continue from (None when the range is
    /// done).
    pub fn read_range(
        &self,
        from: u64,
        end: u64,
        limit: usize,
        mut emit: impl FnMut(ItemRef<'_>) -> bool,
    ) -> Option<u64> {
        let mut pos = self.lower_bound(from);
        let mut emitted = 0;
        while pos < self.len {
            let slot = self.slot(pos);
            if slot.by_seqno() > end {
                return None;
            }
            if emitted == limit {
                return Some(slot.by_seqno());
            }
            let visible = match slot.state() {
                LIVE => true,
                STALE => self
                    .stale_successor
                    .get(&slot.by_seqno())
                    .is_some_and(|&s| s > end),
                _ => false,
            };
            if visible {
                if !emit(ItemRef { slot }) {
                    return Some(slot.by_seqno());
                }
                emitted += 1;
            }
            pos += 1;
        }
        None
    }

    /// Every current version (items and tombstones) in seqno order.
    pub fn for_each_current(&self, mut f: impl FnMut(ItemRef<'_>)) {
        for slot in self.chunks.iter().flatten() {
            if slot.state() == LIVE {
                f(ItemRef { slot });
            }
        }
    }

    /// Keys of current versions matching a predicate on their metadata (expiry pager, purger).
    pub fn keys_where(&self, mut pred: impl FnMut(&ItemMeta) -> bool) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for slot in self.chunks.iter().flatten() {
            if slot.state() == LIVE && pred(&slot.meta()) {
                out.push(slot.key().to_vec());
            }
        }
        out
    }

    /// The highest seqno in the log (0 when empty): new versions must come above it.
    pub fn last_seqno(&self) -> u64 {
        if self.len == 0 {
            0
        } else {
            self.slot(self.len - 1).by_seqno()
        }
    }

    /// Current versions, tombstones included.
    #[allow(clippy::misnamed_getters)]
    pub fn len(&self) -> usize {
        self.current
    }

    pub fn is_empty(&self) -> bool {
        self.current == 0
    }

    /// Current versions that are not tombstones.
    pub fn live_items(&self) -> usize {
        self.current - self.tombstones
    }

    pub fn tombstones(&self) -> usize {
        self.tombstones
    }

    pub fn has_range_reads(&self) -> bool {
        self.range_reads > 0
    }

    /// Bytes held: keys and values plus slot and index overhead.
    pub fn mem_bytes(&self) -> usize {
        self.data_bytes
            + self.chunks.len() * CHUNK * std::mem::size_of::<Slot>()
            + self.index.capacity() * (std::mem::size_of::<u32>() + 1)
            + self.ordered.as_ref().map_or(0, |o| o.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(seqno: u64, deleted: bool) -> ItemMeta {
        ItemMeta {
            by_seqno: seqno,
            rev_seqno: 1,
            cas: seqno,
            deleted,
            ..Default::default()
        }
    }

    #[test]
    fn slot_is_40_bytes_and_packs_losslessly() {
        assert_eq!(std::mem::size_of::<Slot>(), 40);
        let meta = ItemMeta {
            cas: u64::MAX,
            rev_seqno: MAX_SEQNO,
            by_seqno: MAX_SEQNO,
            flags: u32::MAX,
            expiry: 7,
            datatype: 0xff,
            deleted: true,
        };
        let key = [b'k'; 250];
        let s = Slot::new(&key, b"value", &meta);
        assert_eq!(s.meta(), meta);
        assert_eq!(s.key(), &key[..]);
        assert_eq!(s.value(), b"value");
    }

    #[test]
    fn the_index_grows_from_the_log_with_overwrites_and_a_range_read_open() {
        let mut s = ItemStore::new();
        let mut seq = 0;
        // Keys added while others are overwritten and deleted, and, from the middle on, with a
        // range read open so that replaced versions stay in the log as stale slots.
        for k in 0..5000u32 {
            if k == 2500 {
                s.begin_range_read();
            }
            seq += 1;
            s.upsert(&k.to_be_bytes(), b"first", &mut meta(seq, false));
            if k % 3 == 0 {
                seq += 1;
                s.upsert(&(k / 2).to_be_bytes(), b"again", &mut meta(seq, k % 2 == 0));
            }
        }
        s.end_range_read();
        assert_eq!(s.len(), 5000);
        for k in 0..5000u32 {
            let it = s.get(&k.to_be_bytes()).expect("every key is found");
            let rewritten = (0..5000u32).rev().find(|j| j % 3 == 0 && j / 2 == k);
            match rewritten.filter(|&j| j >= k) {
                Some(j) => assert_eq!((it.value(), it.meta().deleted), (&b"again"[..], j % 2 == 0)),
                None => assert_eq!(it.value(), b"first"),
            }
        }
    }

    #[test]
    fn upsert_get_and_compaction() {
        let mut s = ItemStore::new();
        let mut seq = 0;
        for round in 0..5 {
            for k in 0..2000u32 {
                seq += 1;
                let v = format!("v{round}-{k}");
                s.upsert(&k.to_be_bytes(), v.as_bytes(), &mut meta(seq, false));
            }
        }
        assert_eq!(s.len(), 2000);
        assert!(
            s.len <= 2000 + 2 * 2000 + CHUNK,
            "compaction keeps the log bounded: {}",
            s.len
        );
        for k in 0..2000u32 {
            let it = s.get(&k.to_be_bytes()).unwrap();
            assert_eq!(it.value(), format!("v4-{k}").as_bytes());
        }
        let mut seqnos = Vec::new();
        s.for_each_current(|i| seqnos.push(i.meta().by_seqno));
        assert!(seqnos.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(seqnos.len(), 2000);
    }

    #[test]
    fn range_read_sees_the_snapshot_while_writes_go_on() {
        let mut s = ItemStore::new();
        for k in 1..=10u64 {
            s.upsert(&k.to_be_bytes(), b"old", &mut meta(k, false));
        }
        s.begin_range_read();
        // key 3 replaced twice past the end, key 4 replaced inside the range, key 5 purged.
        s.upsert(&3u64.to_be_bytes(), b"new", &mut meta(11, false));
        s.upsert(&3u64.to_be_bytes(), b"newer", &mut meta(12, false));
        s.upsert(&4u64.to_be_bytes(), b"x", &mut meta(13, true));
        s.purge(&5u64.to_be_bytes());
        let mut got = Vec::new();
        let mut from = 1;
        while let Some(next) = s.read_range(from, 10, 3, |i| {
            got.push((i.meta().by_seqno, i.value().to_vec()));
            true
        }) {
            from = next;
        }
        let seqnos: Vec<u64> = got.iter().map(|g| g.0).collect();
        assert_eq!(seqnos, (1..=10).collect::<Vec<_>>());
        assert!(got.iter().all(|g| g.1 == b"old"));
        s.end_range_read();
        assert_eq!(s.get(&3u64.to_be_bytes()).unwrap().value(), b"newer");
        assert!(s.get(&5u64.to_be_bytes()).is_none());
        assert!(s.stale_successor.is_empty());
        let mut got = Vec::new();
        s.read_range(0, 13, usize::MAX, |i| {
            got.push(i.meta().by_seqno);
            true
        });
        assert_eq!(got, vec![1, 2, 6, 7, 8, 9, 10, 12, 13]);
    }

    #[test]
    fn the_clock_evicts_oldest_first_and_spares_what_was_read() {
        let mut s = ItemStore::new();
        for k in 1..=6u64 {
            s.upsert(&k.to_be_bytes(), b"v", &mut meta(k, false));
        }
        s.upsert(&7u64.to_be_bytes(), b"", &mut meta(7, true));
        assert!(s.get_referenced(&2u64.to_be_bytes()).is_some());
        let victim = |s: &mut ItemStore, tombstones| {
            s.next_victim(tombstones)
                .map(|v| u64::from_be_bytes(v.key.as_slice().try_into().unwrap()))
        };
        assert_eq!(victim(&mut s, false), Some(1));
        // 2 was read: passed over once, its bit cleared.
        assert_eq!(victim(&mut s, false), Some(3));
        // Rewriting 4 moves it to the log's end; the hand's seqno survives the compaction.
        s.upsert(&4u64.to_be_bytes(), b"w", &mut meta(8, false));
        s.compact();
        assert_eq!(victim(&mut s, false), Some(5));
        assert_eq!(victim(&mut s, false), Some(6));
        // The tombstone (7) is skipped unless asked for; the hand wraps to 1, 2 (bit now clear).
        assert_eq!(victim(&mut s, false), Some(4));
        assert_eq!(victim(&mut s, true), Some(1));
        assert_eq!(victim(&mut s, true), Some(2));
        assert_eq!(victim(&mut s, true), Some(3));
        // Every item read since the last pass: two revolutions find one anyway.
        for k in [1u64, 2, 3, 5, 6] {
            s.purge(&k.to_be_bytes());
        }
        s.purge(&7u64.to_be_bytes());
        s.get_referenced(&4u64.to_be_bytes());
        assert_eq!(victim(&mut s, false), Some(4));
        s.purge(&4u64.to_be_bytes());
        assert!(s.next_victim(true).is_none());
    }

    /// Keys in the ordered index, ascending, and the keys of the hash index in the same order.
    fn both_indexes(s: &ItemStore) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let mut ordered = Vec::new();
        assert!(s.scan_ordered(Seek::Ends, false, |i| {
            ordered.push(i.key().to_vec());
            true
        }));
        let mut hashed = Vec::new();
        s.for_each_current(|i| hashed.push(i.key().to_vec()));
        hashed.sort_by(|a, b| exact_order(a, b));
        (ordered, hashed)
    }

    fn k(u: u32) -> Vec<u8> {
        let mut out = vec![0x91];
        sluice_proto::msgpack::write_uint(&mut out, u as u64);
        out
    }

    #[test]
    fn the_ordered_index_follows_the_hash_index() {
        let mut s = ItemStore::new();
        let mut seq = 0;
        let mut put = |s: &mut ItemStore, key: &[u8], deleted| {
            seq += 1;
            s.upsert(key, b"v", &mut meta(seq, deleted));
        };
        put(&mut s, &k(1), false);
        // Turned on with keys held already (recovery): they are indexed.
        s.set_ordered(Some(Arc::new(KeyShape::default())));
        for round in 0..3 {
            for u in (0..3000).rev() {
                put(&mut s, &k(u), round == 1 && u % 3 == 0);
            }
        }
        for u in (0..3000).step_by(2) {
            s.purge(&k(u));
        }
        s.compact();
        let (ordered, hashed) = both_indexes(&s);
        assert_eq!(ordered.len(), 1500);
        assert_eq!(ordered, hashed);
        // Descending from just before [1001]: 999, 997, ...
        let mut down = Vec::new();
        s.scan_ordered(Seek::BeforePrefix(&k(1001)), true, |i| {
            down.push(i.key().to_vec());
            down.len() < 2
        });
        assert_eq!(down, vec![k(999), k(997)]);
        // A rollback's store is indexed as it comes in; a store without order has none.
        let mut past = ItemStore::new();
        past.upsert(&k(7), b"v", &mut meta(1, false));
        s.replace_keeping_readers(past);
        assert_eq!(both_indexes(&s).0, vec![k(7)]);
        s.set_ordered(None);
        assert!(!s.is_ordered() && s.scan_ordered(Seek::Ends, false, |_| panic!("no order")));
    }

    #[test]
    fn the_key_shape_widens_to_mixed_and_never_back() {
        let shape = KeyShape::default();
        assert!(shape.all_exact_with(1) && shape.all_exact_with(2));
        shape.note(&k(5));
        assert!(shape.all_exact_with(1) && !shape.all_exact_with(2));
        shape.note(&[0x91, 0xcc, 0x05]);
        assert!(!shape.all_exact_with(1));
        shape.note(&k(5));
        assert!(!shape.all_exact_with(1));
    }
}
