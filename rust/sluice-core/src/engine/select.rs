//! Range reads of an ordered bucket (iproto SELECT): Tarantool's iterators over the primary key,
//! a k-way merge of the vbuckets' ordered indexes, each vbucket read under its own lock in
//! short batches.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use sluice_proto::keyorder::{compare_keys, compare_prefix, exact_parts, part_count};

use super::Engine;
use crate::bucket::Bucket;
use crate::error::{Error, Result};
use crate::hlc::now_secs;
use crate::item::{is_expired, Item};
use crate::item_store::Seek;
use crate::vbucket::{VbSet, VbState};

/// Tarantool's iterator types, with their iproto codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectIterator {
    /// Keys whose first n parts equal the search key's n parts, ascending.
    Eq = 0,
    /// As `Eq`, descending.
    Req = 1,
    /// Every key ascending; the search key is ignored.
    All = 2,
    /// Keys below the search key, descending.
    Lt = 3,
    /// Keys at or below the search key (on its n parts), descending.
    Le = 4,
    /// Keys at or above the search key, ascending.
    Ge = 5,
    /// Keys above the search key (on its n parts), ascending.
    Gt = 6,
}

impl SelectIterator {
    /// The iterator an iproto SELECT's ITERATOR code names (None for the codes of iterators
    /// a TREE index does not support, such as BITS_ALL_SET, or unknown ones).
    pub fn from_code(code: u32) -> Option<SelectIterator> {
        use SelectIterator::*;
        [Eq, Req, All, Lt, Le, Ge, Gt].get(code as usize).copied()
    }
}

/// Items one vbucket's batch copies out at most: bounds how long a select holds a vbucket's
/// lock, and how much it reads past what it returns.
const BATCH: usize = 64;
/// Index entries (tombstones and expired items included) one batch steps over at most.
const BATCH_STEPS: usize = 4 * BATCH;

/// Which of a bucket's vbuckets a select or count reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The active and replica vbuckets: a node on its own, whose replicas serve reads.
    Held,
    /// The active vbuckets only.
    Active,
    /// These vbuckets only, each active here whenever it is read, else the read fails with
    /// `NotMyVbucket`: a node's part of a read over a whole cluster, as the map of the node
    /// that asks gives it. A node that has not applied the same map yet (a failover, a
    /// vbucket moving) fails it rather than leave its vbuckets out.
    Exactly(VbSet),
}

/// What a select reads: where each vbucket's scan starts, which way, and (EQ, REQ) the
/// prefix the keys must keep.
struct Plan<'k> {
    start: Seek<'k>,
    descending: bool,
    prefix: Option<&'k [u8]>,
    part: Part,
}

impl<'k> Plan<'k> {
    fn new(iterator: SelectIterator, key: &'k [u8]) -> Plan<'k> {
        use SelectIterator::*;
        let descending = matches!(iterator, Req | Lt | Le);
        // An empty key (no parts) selects every key, in the iterator's direction.
        if iterator == All || key.is_empty() || part_count(key) == Some(0) {
            return Plan {
                start: Seek::Ends,
                descending,
                prefix: None,
                part: Part::Held,
            };
        }
        let start = match iterator {
            Eq | Ge | Lt => Seek::BeforePrefix(key),
            Req | Gt | Le => Seek::AfterPrefix(key),
            All => unreachable!("handled above"),
        };
        Plan {
            start,
            descending,
            prefix: matches!(iterator, Eq | Req).then_some(key),
            part: Part::Held,
        }
    }
}

/// One vbucket's part of the merge: items read, not yet merged, and where to read on.
struct Feed {
    vbid: u16,
    items: VecDeque<Item>,
    /// The last key the scan stepped over (None before the first batch).
    resume: Option<Vec<u8>>,
    done: bool,
}

/// The head of one feed in the merge heap (a max-heap: the order is flipped for ascending).
struct Head {
    key: Vec<u8>,
    feed: usize,
    descending: bool,
}

impl Ord for Head {
    fn cmp(&self, other: &Self) -> Ordering {
        let o = compare_keys(&self.key, &other.key)
            .then_with(|| self.key.cmp(&other.key))
            .then(self.feed.cmp(&other.feed));
        if self.descending {
            o
        } else {
            o.reverse()
        }
    }
}

impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Head {}

impl Engine {
    /// Live items of an ordered bucket (`BucketConfig::ordered_keys`) as a Tarantool TREE
    /// index's iterator returns them for `key` (a MessagePack array of key parts, possibly
    /// fewer than the keys have): `offset` skipped, at most `limit` returned. Reads the
    /// vbuckets that are active or replica here; tombstones and expired items are skipped
    /// (expired ones are left for the expiry pager). Each vbucket is read under its own lock,
    /// in batches, and merged, so a bounded read costs its size times the vbuckets, never the
    /// bucket's; an EQ on a whole key is one hash lookup when the bucket's keys allow it (see
    /// `KeyShape`). Not a snapshot across vbuckets: a write going on meanwhile may or may not
    /// be seen, as with any other read.
    pub fn select(
        &self,
        bucket: &Bucket,
        iterator: SelectIterator,
        key: &[u8],
        offset: u32,
        limit: u32,
    ) -> Result<Vec<Item>> {
        self.select_from(bucket, iterator, key, offset, limit, Part::Held)
    }

    /// `select` of the vbuckets `part` names (a node's part of a SELECT over a cluster, whose
    /// vbuckets' replicas live on the other nodes, reads its actives only).
    pub fn select_from(
        &self,
        bucket: &Bucket,
        iterator: SelectIterator,
        key: &[u8],
        offset: u32,
        limit: u32,
        part: Part,
    ) -> Result<Vec<Item>> {
        self.check_open()?;
        if !bucket.config.ordered_keys {
            return Err(Error::InvalidArgument(format!(
                "bucket {:?} keeps no key order (ordered_keys is off): it serves no range reads",
                bucket.name()
            )));
        }
        let mut plan = Plan::new(iterator, key);
        plan.part = part;
        let wanted = offset as usize + limit as usize;
        if limit == 0 {
            return Ok(Vec::new());
        }
        if let Some(prefix) = plan.prefix.filter(|_| part == Part::Held) {
            if let Some(found) = self.select_one(bucket, prefix, |i| i.to_item()) {
                return Ok(found.into_iter().skip(offset as usize).collect());
            }
        }
        let now = now_secs();
        let mut feeds: Vec<Feed> = (0..bucket.num_vbuckets())
            .map(|vbid| Feed {
                vbid,
                items: VecDeque::new(),
                resume: None,
                done: false,
            })
            .collect();
        let mut heap = BinaryHeap::with_capacity(feeds.len());
        for (i, feed) in feeds.iter_mut().enumerate() {
            refill(bucket, feed, &plan, wanted, now)?;
            if let Some(head) = feed.items.front() {
                heap.push(Head {
                    key: head.key().to_vec(),
                    feed: i,
                    descending: plan.descending,
                });
            }
        }
        let mut out = Vec::with_capacity((limit as usize).min(BATCH));
        let mut skipped = 0usize;
        while let Some(Head { feed: i, .. }) = heap.pop() {
            let feed = &mut feeds[i];
            let item = feed.items.pop_front().expect("a head has its item");
            if skipped < offset as usize {
                skipped += 1;
            } else {
                out.push(item);
                if out.len() == limit as usize {
                    break;
                }
            }
            if feed.items.is_empty() {
                refill(bucket, feed, &plan, wanted - skipped - out.len(), now)?;
            }
            if let Some(head) = feed.items.front() {
                heap.push(Head {
                    key: head.key().to_vec(),
                    feed: i,
                    descending: plan.descending,
                });
            }
        }
        Ok(out)
    }

    /// `select`, handing each item's value to `each` in order. An EQ or REQ on a whole key
    /// found by hash lookup (see `select`) is handed over under its vbucket's lock, without
    /// copying the item: the common point read of a tuple costs no allocation.
    pub fn select_values(
        &self,
        bucket: &Bucket,
        iterator: SelectIterator,
        key: &[u8],
        offset: u32,
        limit: u32,
        mut each: impl FnMut(&[u8]),
    ) -> Result<()> {
        let point = matches!(iterator, SelectIterator::Eq | SelectIterator::Req)
            && offset == 0
            && limit > 0
            && bucket.config.ordered_keys;
        if point {
            self.check_open()?;
            if self.select_one(bucket, key, |i| each(i.value())).is_some() {
                return Ok(());
            }
        }
        for item in self.select(bucket, iterator, key, offset, limit)? {
            each(item.value());
        }
        Ok(())
    }

    /// How many live items `select` with this iterator and key would return with no limit,
    /// counted in each vbucket's index without copying an item (Tarantool's `index:count`).
    pub fn count(&self, bucket: &Bucket, iterator: SelectIterator, key: &[u8]) -> Result<u64> {
        self.count_from(bucket, iterator, key, Part::Held)
    }

    /// `count` of the vbuckets `part` names (see `select_from`).
    pub fn count_from(
        &self,
        bucket: &Bucket,
        iterator: SelectIterator,
        key: &[u8],
        part: Part,
    ) -> Result<u64> {
        self.check_open()?;
        if !bucket.config.ordered_keys {
            return Err(Error::InvalidArgument(format!(
                "bucket {:?} keeps no key order (ordered_keys is off): it serves no range reads",
                bucket.name()
            )));
        }
        let mut plan = Plan::new(iterator, key);
        plan.part = part;
        let now = now_secs();
        let mut total = 0u64;
        for vbid in 0..bucket.num_vbuckets() {
            let mut resume = None;
            loop {
                let (done, next) = scan_batch(bucket, vbid, &plan, resume, |item| {
                    let meta = item.meta();
                    total += u64::from(!meta.deleted && !is_expired(&meta, now));
                    true
                })?;
                if done || next.is_none() {
                    break;
                }
                resume = next;
            }
        }
        Ok(total)
    }

    /// An EQ or REQ on a whole key by hash lookup: Some(what `read` made of the item, or
    /// nothing) when the bucket's keys all have as many parts as `key` and, like it, exact
    /// encodings (so no other key can match it); None when a scan must decide. `read` runs
    /// under the vbucket's lock.
    fn select_one<R>(
        &self,
        bucket: &Bucket,
        key: &[u8],
        read: impl FnOnce(crate::item_store::ItemRef<'_>) -> R,
    ) -> Option<Option<R>> {
        let parts = exact_parts(key)?;
        if !bucket.key_shape.all_exact_with(parts) {
            return None;
        }
        let vb = bucket.lock_vbucket(bucket.vbucket_of(key))?;
        if !matches!(vb.state, VbState::Active | VbState::Replica) {
            return Some(None);
        }
        // The clock is read only for an item that can expire (a tuple written over iproto
        // never does).
        Some(
            vb.store
                .get(key)
                .filter(|i| {
                    let meta = i.meta();
                    !meta.deleted && (meta.expiry == 0 || !is_expired(&meta, now_secs()))
                })
                .map(read),
        )
    }
}

/// Reads batches of one vbucket until it has an item or has no more (a batch may step over
/// nothing but tombstones).
fn refill(
    bucket: &Bucket,
    feed: &mut Feed,
    plan: &Plan<'_>,
    wanted: usize,
    now: u32,
) -> Result<()> {
    while feed.items.is_empty() && !feed.done {
        fill(bucket, feed, plan, wanted, now)?;
    }
    Ok(())
}

/// Reads one vbucket's next batch: up to `wanted` (at most BATCH) live items after where the
/// feed stands, under the vbucket's lock only. A vbucket the plan's part does not read here
/// contributes nothing.
fn fill(bucket: &Bucket, feed: &mut Feed, plan: &Plan<'_>, wanted: usize, now: u32) -> Result<()> {
    let batch = wanted.clamp(1, BATCH);
    let items = &mut feed.items;
    let (done, resume) = scan_batch(bucket, feed.vbid, plan, feed.resume.take(), |item| {
        if items.len() == batch {
            return false;
        }
        let meta = item.meta();
        if !meta.deleted && !is_expired(&meta, now) {
            items.push_back(item.to_item());
        }
        true
    })?;
    feed.done = done;
    feed.resume = resume;
    Ok(())
}

/// One batch of a vbucket's ordered index from `resume` (or the plan's start): `visit` sees
/// each entry (tombstones and expired items too) until it returns false, the batch has
/// stepped BATCH_STEPS entries, or the plan's prefix or the index ends. Returns whether the
/// vbucket has no more for the plan, and where the next batch resumes; `NotMyVbucket` when the
/// plan's part must read it and it is not active here.
fn scan_batch(
    bucket: &Bucket,
    vbid: u16,
    plan: &Plan<'_>,
    resume: Option<Vec<u8>>,
    mut visit: impl FnMut(crate::item_store::ItemRef<'_>) -> bool,
) -> Result<(bool, Option<Vec<u8>>)> {
    let vb = bucket.lock_vbucket(vbid).expect("in range");
    let readable = match (plan.part, vb.state) {
        (Part::Exactly(set), _) if !set.contains(vbid) => false,
        (Part::Exactly(_), VbState::Active) => true,
        (Part::Exactly(_), _) => return Err(Error::NotMyVbucket(vbid)),
        (_, VbState::Active) => true,
        (Part::Held, VbState::Replica) => true,
        _ => false,
    };
    if !readable {
        return Ok((true, resume));
    }
    let from = resume.as_deref().map_or(plan.start, Seek::Key);
    let mut steps = 0;
    let mut last = Vec::new();
    let mut past_prefix = false;
    let reached_end = vb.store.scan_ordered(from, plan.descending, |item| {
        let key = item.key();
        if let Some(prefix) = plan.prefix {
            if compare_prefix(key, prefix) != Ordering::Equal {
                past_prefix = true;
                return false;
            }
        }
        if steps == BATCH_STEPS || !visit(item) {
            return false;
        }
        steps += 1;
        last.clear();
        last.extend_from_slice(key);
        true
    });
    let resume = if steps > 0 { Some(last) } else { resume };
    Ok((reached_end || past_prefix, resume))
}
