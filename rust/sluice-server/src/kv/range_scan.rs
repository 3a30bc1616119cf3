//! KV range scans (RANGE_SCAN_CREATE, _CONTINUE, _CANCEL), as Couchbase's SDKs drive them with
//! `collection.scan(RangeScan | PrefixScan | SamplingScan)`: a scan of one vbucket's keys in
//! byte order between two bounds (or a random sample of them), with their documents or keys
//! only, handed out in batches under the client's item, byte and time limits.
//!
//! A scan keeps no copy of what it covers: its bounds, and a queue of at most `QUEUED_KEYS`
//! keys that one walk of the vbucket (under its lock) picked past the last key queued before,
//! so a scan's memory is bounded whatever the vbucket holds, and a vbucket of a million keys is
//! walked some 250 times, not once per continue. What a continue reads is the vbucket as it is then (Couchbase reads a disk
//! snapshot taken at create): a key written after the create and past the scan's position is
//! seen. Deleted and expired documents are skipped. A scan ends at its last key, at a cancel,
//! or `LIFETIME` after its create; at most `MAX_SCANS` are open on a node.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::ops::Bound;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sluice_core::bucket::Bucket;
use sluice_core::hlc::now_secs;
use sluice_core::item::is_expired;
use sluice_core::vbucket::VbState;
use sluice_proto::mcbp::{status, Request};

use super::reply::Reply;

/// How long a scan may live from its create (Couchbase's `range_scan_max_lifetime`).
pub const LIFETIME: Duration = Duration::from_secs(180);
/// Scans open on a node at once; one more is refused with EBUSY (the SDK asks again).
pub const MAX_SCANS: usize = 256;
/// Items one response frame carries at most.
const FRAME_ITEMS: usize = 256;
/// Keys one walk of a vbucket queues for the scan at most (up to about 1 MiB of keys).
const QUEUED_KEYS: usize = 4096;
/// The most a key may be (Couchbase's limit on a scan's bounds).
const MAX_KEY: usize = 250;

/// The scans open on this node, by id.
#[derive(Default)]
pub struct RangeScans {
    open: Mutex<HashMap<[u8; 16], Scan>>,
}

#[derive(Clone)]
struct Scan {
    bucket: String,
    vbucket: u16,
    keys_only: bool,
    start: Bound<Vec<u8>>,
    end: Bound<Vec<u8>>,
    /// A sampling scan keeps a key when the hash of (seed, key) falls under this share of
    /// the hash space (u64::MAX: every key).
    keep_under: u64,
    seed: u64,
    /// The last key queued: the next walk starts past it.
    after: Option<Vec<u8>>,
    /// Keys picked by the last walk, in order, not handed out yet.
    queued: VecDeque<Vec<u8>>,
    /// The last walk found every key left (nothing past `after`).
    walked_all: bool,
    created: Instant,
    /// A continue is running on it (a second one is refused, as Couchbase does).
    busy: bool,
}

impl Scan {
    fn in_range(&self, key: &[u8]) -> bool {
        let above_start = match &self.start {
            Bound::Included(s) => key >= s.as_slice(),
            Bound::Excluded(s) => key > s.as_slice(),
            Bound::Unbounded => true,
        };
        let below_end = match &self.end {
            Bound::Included(e) => key <= e.as_slice(),
            Bound::Excluded(e) => key < e.as_slice(),
            Bound::Unbounded => true,
        };
        let past_cursor = self.after.as_deref().is_none_or(|a| key > a);
        above_start && below_end && past_cursor && self.sampled(key)
    }

    fn sampled(&self, key: &[u8]) -> bool {
        if self.keep_under == u64::MAX {
            return true;
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.seed, key).hash(&mut h);
        h.finish() < self.keep_under
    }
}

/// A create's JSON value, as Couchbase's SDKs send it.
#[derive(serde::Deserialize)]
struct CreateRequest {
    #[serde(default)]
    key_only: bool,
    /// The collection id in hex; only the default collection (0) exists.
    collection: Option<String>,
    range: Option<RangeSpec>,
    sampling: Option<SamplingSpec>,
    snapshot_requirements: Option<SnapshotRequirements>,
}

#[derive(serde::Deserialize)]
struct RangeSpec {
    start: Option<String>,
    excl_start: Option<String>,
    end: Option<String>,
    excl_end: Option<String>,
}

#[derive(serde::Deserialize)]
struct SamplingSpec {
    samples: u64,
    #[serde(default)]
    seed: u64,
}

#[derive(serde::Deserialize)]
struct SnapshotRequirements {
    /// Decimal, as a string.
    vb_uuid: String,
    seqno: u64,
}

/// A bound's key from its base64 text.
fn bound_key(text: &str, what: &str) -> Result<Vec<u8>, String> {
    let key = sluice_proto::base64::decode(text.as_bytes())
        .ok_or_else(|| format!("range {what} is not base64"))?;
    if key.len() > MAX_KEY {
        return Err(format!("range {what} is longer than {MAX_KEY} bytes"));
    }
    Ok(key)
}

/// One bound from the pair of fields that may give it (exactly one must).
fn bound(
    inclusive: &Option<String>,
    exclusive: &Option<String>,
    what: &str,
) -> Result<Bound<Vec<u8>>, String> {
    match (inclusive, exclusive) {
        (Some(k), None) => Ok(Bound::Included(bound_key(k, what)?)),
        (None, Some(k)) => Ok(Bound::Excluded(bound_key(k, what)?)),
        _ => Err(format!("give exactly one of {what} and excl_{what}")),
    }
}

/// A new random scan id.
fn new_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).expect("the system's random source");
    id
}

/// Answers a RANGE_SCAN_CREATE for `bucket`: the scan's 16-byte id, KEY_ENOENT when the
/// vbucket holds no key it covers (the SDK counts the vbucket done), or the refusal.
pub(super) fn create(
    scans: &RangeScans,
    bucket: &Bucket,
    req: &Request<'_>,
    reply: &mut Reply<'_>,
    xerror: bool,
) {
    let spec: CreateRequest = match serde_json::from_slice(req.value) {
        Ok(s) => s,
        Err(e) => return reply.error(status::EINVAL, &format!("a range scan: {e}"), xerror),
    };
    if let Some(c) = spec.collection.as_deref() {
        if u32::from_str_radix(c, 16) != Ok(0) {
            let body = super::unknown_collection(&format!("unknown collection id {c}"));
            return reply.send(
                status::UNKNOWN_COLLECTION,
                0,
                &[],
                &[],
                body.as_bytes(),
                0x01,
            );
        }
    }
    let (start, end, keep_share, seed) = match (&spec.range, &spec.sampling) {
        (Some(r), None) => {
            let bounds = bound(&r.start, &r.excl_start, "start")
                .and_then(|s| Ok((s, bound(&r.end, &r.excl_end, "end")?)));
            match bounds {
                Ok((s, e)) => (s, e, None, 0),
                Err(why) => return reply.error(status::EINVAL, &why, xerror),
            }
        }
        (None, Some(s)) if s.samples > 0 => {
            (Bound::Unbounded, Bound::Unbounded, Some(s.samples), s.seed)
        }
        (None, Some(_)) => {
            return reply.error(status::EINVAL, "sampling takes samples > 0", xerror)
        }
        _ => {
            return reply.error(
                status::EINVAL,
                "a range scan gives either range or sampling",
                xerror,
            )
        }
    };
    let Some(vb) = bucket.lock_vbucket(req.vbucket) else {
        return reply.error(status::NOT_MY_VBUCKET, "no such vbucket", xerror);
    };
    if vb.state != VbState::Active {
        drop(vb);
        return reply.error(
            status::NOT_MY_VBUCKET,
            "the vbucket is not active here",
            xerror,
        );
    }
    if let Some(req_snap) = &spec.snapshot_requirements {
        let uuid = vb.failover.latest().map_or(0, |f| f.uuid);
        if req_snap.vb_uuid.parse::<u64>() != Ok(uuid) {
            return reply.error(
                status::VBUUID_NOT_EQUAL,
                &format!("the vbucket's uuid is {uuid}, not {}", req_snap.vb_uuid),
                xerror,
            );
        }
        if vb.high_seqno < req_snap.seqno {
            // The SDK asks again until its timeout.
            return reply.error(
                status::ETMPFAIL,
                &format!(
                    "the vbucket is at seqno {}, not yet {}",
                    vb.high_seqno, req_snap.seqno
                ),
                xerror,
            );
        }
    }
    // Each key kept with the chance samples / live items: about `samples` of them.
    let keep_under = match keep_share {
        None => u64::MAX,
        Some(samples) => {
            let live = vb.store.live_items() as u64;
            if live <= samples {
                u64::MAX
            } else {
                ((samples as f64 / live as f64) * u64::MAX as f64) as u64
            }
        }
    };
    let scan = Scan {
        bucket: bucket.name().to_string(),
        vbucket: req.vbucket,
        keys_only: spec.key_only,
        start,
        end,
        keep_under,
        seed,
        after: None,
        queued: VecDeque::new(),
        walked_all: false,
        created: Instant::now(),
        busy: false,
    };
    let now = now_secs();
    let mut any = false;
    vb.store.for_each_current(|it| {
        let m = it.meta();
        any |= !any && !m.deleted && !is_expired(&m, now) && scan.in_range(it.key());
    });
    drop(vb);
    if !any {
        return reply.error(status::KEY_ENOENT, "no key in the range", xerror);
    }
    let mut open = scans.open.lock().unwrap_or_else(|e| e.into_inner());
    open.retain(|_, s| s.created.elapsed() < LIFETIME);
    if open.len() >= MAX_SCANS {
        return reply.error(
            status::EBUSY,
            &format!("{MAX_SCANS} range scans are open"),
            xerror,
        );
    }
    let id = new_id();
    open.insert(id, scan);
    drop(open);
    reply.send(status::SUCCESS, 0, &[], &[], &id, 0);
}

/// The next keys of `scan` in `bucket` (at most `n`), each with its document unless the scan
/// is keys only, encoded as Couchbase's continue frames carry them; whether the scan is done.
/// Keys come from the scan's queue, refilled by one walk of the vbucket with the next
/// `QUEUED_KEYS` past the last key queued: a continue of 50 items (the SDK's default) walks the
/// vbucket once per 4,096 keys handed out, not once per 50. A queued key written since is read
/// as it is now; one deleted or expired since is left out.
fn next_batch(
    scan: &mut Scan,
    bucket: &Bucket,
    n: usize,
    out: &mut Vec<u8>,
) -> Result<(usize, bool), u16> {
    let vb = bucket
        .lock_vbucket(scan.vbucket)
        .ok_or(status::NOT_MY_VBUCKET)?;
    if vb.state != VbState::Active {
        return Err(status::NOT_MY_VBUCKET);
    }
    let now = now_secs();
    if scan.queued.is_empty() && !scan.walked_all {
        // The smallest keys past the cursor: a max-heap of QUEUED_KEYS, one walk.
        let mut picked: BinaryHeap<Vec<u8>> = BinaryHeap::with_capacity(QUEUED_KEYS + 1);
        let mut more = false;
        vb.store.for_each_current(|it| {
            let m = it.meta();
            let key = it.key();
            if m.deleted || is_expired(&m, now) || !scan.in_range(key) {
                return;
            }
            if picked.len() == QUEUED_KEYS {
                if picked.peek().is_some_and(|top| key < top.as_slice()) {
                    picked.pop();
                    picked.push(key.to_vec());
                }
                more = true;
                return;
            }
            picked.push(key.to_vec());
        });
        scan.queued = picked.into_sorted_vec().into();
        scan.walked_all = !more;
        if let Some(last) = scan.queued.back() {
            scan.after = Some(last.clone());
        }
    }
    let mut sent = 0;
    while sent < n {
        let Some(key) = scan.queued.pop_front() else {
            break;
        };
        let Some(it) = vb.store.get(&key) else {
            continue;
        };
        let m = it.meta();
        if m.deleted || is_expired(&m, now) {
            continue;
        }
        sent += 1;
        if scan.keys_only {
            put_leb128(out, key.len());
            out.extend_from_slice(&key);
            continue;
        }
        out.extend_from_slice(&m.flags.to_be_bytes());
        out.extend_from_slice(&m.expiry.to_be_bytes());
        out.extend_from_slice(&m.by_seqno.to_be_bytes());
        out.extend_from_slice(&m.cas.to_be_bytes());
        // A scan's documents are their bodies, as GET's are.
        out.push(
            m.datatype
                & sluice_core::item::DATATYPE_CLIENT_BITS
                & !sluice_proto::xattr::DATATYPE_XATTR,
        );
        put_leb128(out, key.len());
        out.extend_from_slice(&key);
        let body = sluice_proto::xattr::body(it.value(), m.datatype);
        put_leb128(out, body.len());
        out.extend_from_slice(body);
    }
    Ok((sent, scan.queued.is_empty() && scan.walked_all))
}

fn put_leb128(out: &mut Vec<u8>, n: usize) {
    sluice_proto::mcbp::write_leb128(out, n as u64);
}

/// The limits of a continue (extras: the scan id, then items, milliseconds and bytes, u32 BE
/// each, 0 for none).
struct Limits {
    items: usize,
    time: Option<Duration>,
    bytes: usize,
}

/// Answers a RANGE_SCAN_CONTINUE: frames of status SUCCESS while it goes on, then RangeScanMore
/// when a limit stopped it or RangeScanComplete at the scan's end (the scan is then gone);
/// every one with 4 bytes of extras saying whether documents (1) or keys (0) follow.
pub(super) fn resume(
    scans: &RangeScans,
    bucket: &Bucket,
    req: &Request<'_>,
    reply: &mut Reply<'_>,
    xerror: bool,
) {
    let Some((id, limits)) = continue_extras(req.extras) else {
        return reply.error(
            status::EINVAL,
            "RANGE_SCAN_CONTINUE takes 28 bytes of extras",
            xerror,
        );
    };
    let mut scan = {
        let mut open = scans.open.lock().unwrap_or_else(|e| e.into_inner());
        match open.get_mut(&id) {
            None => return reply.error(status::KEY_ENOENT, "no such range scan", xerror),
            Some(s) if s.created.elapsed() >= LIFETIME => {
                open.remove(&id);
                return reply.error(
                    status::KEY_ENOENT,
                    "the range scan outlived its lifetime",
                    xerror,
                );
            }
            Some(s) if s.busy => {
                return reply.error(status::EBUSY, "the range scan is continuing", xerror)
            }
            Some(s) if s.bucket != bucket.name() || s.vbucket != req.vbucket => {
                return reply.error(
                    status::KEY_ENOENT,
                    "no such range scan in this vbucket",
                    xerror,
                )
            }
            Some(s) => {
                s.busy = true;
                // Worked on outside the lock; put back (or dropped) by `release`.
                s.clone()
            }
        }
    };
    let flags: [u8; 4] = (!scan.keys_only as u32).to_be_bytes();
    let started = Instant::now();
    let (mut items, mut bytes) = (0usize, 0usize);
    let mut body = Vec::new();
    let finished = loop {
        body.clear();
        let want = FRAME_ITEMS.min(limits.items.saturating_sub(items)).max(1);
        match next_batch(&mut scan, bucket, want, &mut body) {
            Err(st) => {
                release(scans, &id, None);
                return reply.error(st, "the vbucket is not active here", xerror);
            }
            Ok((n, done)) => {
                items += n;
                bytes += body.len();
                if done {
                    reply.send(status::RANGE_SCAN_COMPLETE, 0, &flags, &[], &body, 0);
                    break true;
                }
                let over = items >= limits.items
                    || bytes >= limits.bytes
                    || limits.time.is_some_and(|t| started.elapsed() >= t);
                if over {
                    reply.send(status::RANGE_SCAN_MORE, 0, &flags, &[], &body, 0);
                    break false;
                }
                reply.send(status::SUCCESS, 0, &flags, &[], &body, 0);
            }
        }
    };
    release(scans, &id, (!finished).then_some(scan));
}

/// Puts a continued scan back (idle), or removes it (finished or failed).
fn release(scans: &RangeScans, id: &[u8; 16], scan: Option<Scan>) {
    let mut open = scans.open.lock().unwrap_or_else(|e| e.into_inner());
    match scan {
        // A cancel that came meanwhile has removed it: it stays gone.
        Some(mut s) => {
            if let Some(entry) = open.get_mut(id) {
                s.busy = false;
                *entry = s;
            }
        }
        None => {
            open.remove(id);
        }
    }
}

fn continue_extras(extras: &[u8]) -> Option<([u8; 16], Limits)> {
    if extras.len() != 28 {
        return None;
    }
    let id: [u8; 16] = extras[..16].try_into().ok()?;
    let u32_at = |at: usize| u32::from_be_bytes(extras[at..at + 4].try_into().expect("4 bytes"));
    let unlimited = |n: u32| if n == 0 { usize::MAX } else { n as usize };
    Some((
        id,
        Limits {
            items: unlimited(u32_at(16)),
            time: match u32_at(20) {
                0 => None,
                ms => Some(Duration::from_millis(ms as u64)),
            },
            bytes: unlimited(u32_at(24)),
        },
    ))
}

/// Answers a RANGE_SCAN_CANCEL: the scan is gone (KEY_ENOENT when there was none).
pub(super) fn cancel(scans: &RangeScans, req: &Request<'_>, reply: &mut Reply<'_>, xerror: bool) {
    let Ok(id) = <[u8; 16]>::try_from(req.extras) else {
        return reply.error(
            status::EINVAL,
            "RANGE_SCAN_CANCEL takes the 16-byte scan id as extras",
            xerror,
        );
    };
    let removed = scans
        .open
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id);
    match removed {
        Some(_) => reply.ok(),
        None => reply.error(status::KEY_ENOENT, "no such range scan", xerror),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scan_past_its_key_queue_hands_out_every_key_once_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = crate::kv::KvContext::scratch(dir.path(), Default::default()).unwrap();
        let bucket = ctx.engine.bucket("default").unwrap();
        let keys: Vec<Vec<u8>> = (0..20_000)
            .map(|i| format!("key{i:05}").into_bytes())
            .collect();
        for k in &keys {
            let w = ctx
                .engine
                .write_store(&bucket, &sluice_core::StoreRequest::set(k, b"v"))
                .unwrap();
            drop(w);
        }
        let vb = bucket.vbucket_of(&keys[0]);
        let mut want: Vec<Vec<u8>> = keys
            .iter()
            .filter(|k| bucket.vbucket_of(k) == vb)
            .cloned()
            .collect();
        want.sort();
        assert!(
            want.len() > QUEUED_KEYS,
            "the test needs more than one walk"
        );
        let mut scan = Scan {
            bucket: "default".into(),
            vbucket: vb,
            keys_only: true,
            start: Bound::Unbounded,
            end: Bound::Unbounded,
            keep_under: u64::MAX,
            seed: 0,
            after: None,
            queued: VecDeque::new(),
            walked_all: false,
            created: Instant::now(),
            busy: false,
        };
        let mut got = Vec::new();
        loop {
            let mut out = Vec::new();
            let (n, done) = next_batch(&mut scan, &bucket, 50, &mut out).unwrap();
            let mut at = 0;
            for _ in 0..n {
                let len = out[at] as usize;
                got.push(out[at + 1..at + 1 + len].to_vec());
                at += 1 + len;
            }
            if done {
                break;
            }
        }
        assert!(
            got == want,
            "{} keys handed out, {} wanted",
            got.len(),
            want.len()
        );
    }

    #[test]
    fn leb128_lengths_are_couchbases() {
        let mut out = Vec::new();
        put_leb128(&mut out, 5);
        put_leb128(&mut out, 128);
        put_leb128(&mut out, 300);
        assert_eq!(out, [5, 0x80, 0x01, 0xac, 0x02]);
    }
}
