//! The ordered primary index of a bucket with `ordered_keys` and `Engine::select` over it:
//! random writes, deletions, takes and expirations with restarts, every iterator with random
//! full and partial keys, offsets and limits against a model sorted by `compare_keys`; the
//! index through a replica's stream and its rollback, tombstone purges and eviction.

mod common;

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use sluice_core::item::{ChangeOp, ItemMeta, RELATIVE_EXPIRY_LIMIT};
use sluice_core::vbucket::VbState;
use sluice_core::wal::WalMode;
use sluice_core::{Engine, EngineConfig, Error, SelectIterator, StoreRequest};
use sluice_proto::keyorder::{compare_keys, compare_prefix};
use sluice_proto::msgpack::{write_array_len, write_f64, write_int, write_str, write_uint};

const ITERATORS: [SelectIterator; 7] = [
    SelectIterator::Eq,
    SelectIterator::Req,
    SelectIterator::All,
    SelectIterator::Lt,
    SelectIterator::Le,
    SelectIterator::Ge,
    SelectIterator::Gt,
];

fn ordered_config(dir: &std::path::Path, num_vbuckets: u16) -> EngineConfig {
    let mut cfg = common::config(dir, WalMode::Write, num_vbuckets);
    cfg.buckets[0].ordered_keys = true;
    cfg
}

/// One key part of the generated keys.
#[derive(Debug, Clone)]
enum P {
    U(u64),
    I(i64),
    F(f64),
    S(&'static str),
}

fn encode(parts: &[P]) -> Vec<u8> {
    let mut out = Vec::new();
    write_array_len(&mut out, parts.len() as u32);
    for p in parts {
        match p {
            P::U(u) => write_uint(&mut out, *u),
            P::I(i) => write_int(&mut out, *i),
            P::F(f) => write_f64(&mut out, *f),
            P::S(s) => write_str(&mut out, s),
        }
    }
    out
}

fn part() -> impl Strategy<Value = P> {
    prop_oneof![
        4 => (0u64..5).prop_map(P::U),
        1 => (-2i64..0).prop_map(P::I),
        1 => prop_oneof![Just(1.0), Just(1.5), Just(-0.5)].prop_map(P::F),
        2 => prop_oneof![Just("a"), Just("b"), Just("ba")].prop_map(P::S),
    ]
}

/// Stored keys: one or two parts (`exact` keeps them to two canonical integer and string parts,
/// as a space with a two-part key stores them, which lets whole-key EQ take the hash lookup).
fn stored_key(exact: bool) -> BoxedStrategy<Vec<u8>> {
    if exact {
        (0u64..5, prop_oneof![Just("a"), Just("b")])
            .prop_map(|(u, s)| encode(&[P::U(u), P::S(s)]))
            .boxed()
    } else {
        proptest::collection::vec(part(), 1..3)
            .prop_map(|p| encode(&p))
            .boxed()
    }
}

/// Search keys: zero to two parts, sometimes an empty buffer.
fn search_key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => proptest::collection::vec(part(), 0..3).prop_map(|p| encode(&p)),
        1 => Just(Vec::new()),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Set(Vec<u8>, u16),
    Delete(Vec<u8>),
    Take(Vec<u8>),
    SetExpired(Vec<u8>),
    Select(usize, Vec<u8>, u32, u32),
    Snapshot,
    Restart,
}

fn op(exact: bool) -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (stored_key(exact), any::<u16>()).prop_map(|(k, v)| Op::Set(k, v)),
        2 => stored_key(exact).prop_map(Op::Delete),
        2 => stored_key(exact).prop_map(Op::Take),
        1 => stored_key(exact).prop_map(Op::SetExpired),
        6 => (0..ITERATORS.len(), search_key(), prop_oneof![3 => Just(0u32), 1 => 0u32..6],
              prop_oneof![1 => Just(u32::MAX), 2 => 0u32..8])
            .prop_map(|(i, k, o, l)| Op::Select(i, k, o, l)),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Restart),
    ]
}

/// What `select` should return, read off the model.
fn model_select(
    model: &BTreeMap<Vec<u8>, Vec<u8>>,
    iterator: SelectIterator,
    key: &[u8],
    offset: u32,
    limit: u32,
) -> Vec<(Vec<u8>, Vec<u8>)> {
    use SelectIterator::*;
    let mut rows: Vec<(Vec<u8>, Vec<u8>)> =
        model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    rows.sort_by(|a, b| compare_keys(&a.0, &b.0).then_with(|| a.0.cmp(&b.0)));
    let empty = key.is_empty() || key == [0x90];
    let keep = |k: &[u8]| -> bool {
        if empty || iterator == All {
            return true;
        }
        let o = compare_prefix(k, key);
        match iterator {
            Eq | Req => o == Ordering::Equal,
            Ge => o != Ordering::Less,
            Gt => o == Ordering::Greater,
            Le => o != Ordering::Greater,
            Lt => o == Ordering::Less,
            All => true,
        }
    };
    rows.retain(|r| keep(&r.0));
    if matches!(iterator, Req | Le | Lt) {
        rows.reverse();
    }
    rows.into_iter()
        .skip(offset as usize)
        .take(limit as usize)
        .collect()
}

fn value(v: u16) -> Vec<u8> {
    format!("v{v}").into_bytes()
}

fn check_select(
    engine: &Engine,
    model: &BTreeMap<Vec<u8>, Vec<u8>>,
    iterator: SelectIterator,
    key: &[u8],
    offset: u32,
    limit: u32,
) -> Result<(), TestCaseError> {
    let bucket = engine.bucket("default").unwrap();
    let got: Vec<(Vec<u8>, Vec<u8>)> = engine
        .select(&bucket, iterator, key, offset, limit)
        .unwrap()
        .into_iter()
        .map(|i| (i.key().to_vec(), i.value().to_vec()))
        .collect();
    let want = model_select(model, iterator, key, offset, limit);
    prop_assert_eq!(
        got,
        want,
        "{:?} {:02x?} offset {} limit {}",
        iterator,
        key,
        offset,
        limit
    );
    let all = model_select(model, iterator, key, 0, u32::MAX).len() as u64;
    let counted = engine.count(&bucket, iterator, key).unwrap();
    prop_assert_eq!(counted, all, "count of {:?} {:02x?}", iterator, key);
    Ok(())
}

fn run(ops: Vec<Op>, num_vbuckets: u16) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ordered_config(dir.path(), num_vbuckets);
    let mut engine = Engine::open(cfg.clone()).unwrap();
    let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for op in ops {
        let bucket = engine.bucket("default").unwrap();
        match op {
            Op::Set(k, v) => {
                engine
                    .store(&bucket, &StoreRequest::set(&k, &value(v)))
                    .unwrap();
                model.insert(k, value(v));
            }
            Op::Delete(k) => {
                let r = engine.delete(&bucket, &k, 0, None);
                match model.remove(&k) {
                    Some(_) => {
                        r.unwrap();
                    }
                    None => prop_assert_eq!(r.unwrap_err(), Error::NotFound),
                }
            }
            Op::Take(k) => {
                let w = engine.write_take(&bucket, &k, None).unwrap();
                let taken = engine.settle(&bucket, w).unwrap();
                let taken = taken.map(|(_, item)| (item.key().to_vec(), item.value().to_vec()));
                prop_assert_eq!(taken, model.remove(&k).map(|v| (k.clone(), v)));
            }
            Op::SetExpired(k) => {
                let mut req = StoreRequest::set(&k, b"gone");
                req.expiry = RELATIVE_EXPIRY_LIMIT + 1;
                engine.store(&bucket, &req).unwrap();
                model.remove(&k);
            }
            Op::Select(i, k, offset, limit) => {
                check_select(&engine, &model, ITERATORS[i], &k, offset, limit)?;
            }
            Op::Snapshot => {
                engine.snapshot_now().unwrap();
            }
            Op::Restart => {
                engine.close();
                drop(bucket);
                drop(engine);
                engine = Engine::open(cfg.clone()).unwrap();
            }
        }
    }
    // Every iterator on every key the model holds, and on its first part alone.
    let keys: Vec<Vec<u8>> = model.keys().cloned().collect();
    for k in &keys {
        let mut first = vec![0x91];
        let mut r = sluice_proto::msgpack::Reader::new(&k[1..]);
        first.extend_from_slice(r.read_raw_value(4).unwrap());
        for it in ITERATORS {
            check_select(&engine, &model, it, k, 0, u32::MAX)?;
            check_select(&engine, &model, it, &first, 1, 3)?;
        }
    }
    engine.close();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn select_matches_a_sorted_model(ops in proptest::collection::vec(op(false), 1..80), vbs in prop_oneof![Just(1u16), Just(4), Just(16)]) {
        run(ops, vbs)?;
    }

    #[test]
    fn select_matches_a_sorted_model_on_whole_keys(ops in proptest::collection::vec(op(true), 1..80)) {
        run(ops, 8)?;
    }
}

fn k2(u: u64, s: &'static str) -> Vec<u8> {
    encode(&[P::U(u), P::S(s)])
}

fn keys_of(items: &[sluice_core::item::Item]) -> Vec<Vec<u8>> {
    items.iter().map(|i| i.key().to_vec()).collect()
}

#[test]
fn a_bucket_without_key_order_refuses_select() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let err = engine
        .select(&bucket, SelectIterator::All, &[0x90], 0, 10)
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("ordered_keys")),
        "{err:?}"
    );
}

#[test]
fn tombstones_purged_and_items_evicted_leave_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ordered_config(dir.path(), 4);
    cfg.tombstone_purge_age = Duration::ZERO;
    cfg.buckets[0].memory_quota = 1 << 20;
    cfg.buckets[0].eviction = sluice_core::config::Eviction::Lru;
    let engine = Engine::open(cfg).unwrap();
    let bucket = engine.bucket("default").unwrap();
    for u in 0..10 {
        engine
            .store(&bucket, &StoreRequest::set(&k2(u, "a"), b"v"))
            .unwrap();
    }
    for u in 0..5 {
        engine.delete(&bucket, &k2(u, "a"), 0, None).unwrap();
    }
    let seven = k2(7, "a");
    let mut expired = StoreRequest::set(&seven, b"gone");
    expired.expiry = RELATIVE_EXPIRY_LIMIT + 1;
    engine.store(&bucket, &expired).unwrap();
    let all = engine
        .select(&bucket, SelectIterator::All, &[], 0, u32::MAX)
        .unwrap();
    let want: Vec<Vec<u8>> = [5, 6, 8, 9].iter().map(|&u| k2(u, "a")).collect();
    assert_eq!(keys_of(&all), want, "no tombstone, nothing expired");
    // The pager turns 7 into a tombstone and purges every tombstone (age 0): their keys leave
    // the index (a key in the index without an item fails a debug assertion in the scan).
    engine.run_expiry_pager();
    let all = engine
        .select(&bucket, SelectIterator::Le, &k2(9, "z"), 0, u32::MAX)
        .unwrap();
    let mut rev = want.clone();
    rev.reverse();
    assert_eq!(keys_of(&all), rev);
    // Far more than the 1 MiB quota: eviction purges most keys; what select returns is what
    // point reads find, in key order.
    let big = vec![b'x'; 2000];
    for u in 0..2000u64 {
        engine
            .store(&bucket, &StoreRequest::set(&k2(100 + u, "b"), &big))
            .unwrap();
    }
    let all = engine
        .select(&bucket, SelectIterator::Ge, &[0x91, 0x64], 0, u32::MAX)
        .unwrap();
    assert!(
        bucket
            .stats
            .evictions
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    assert!(!all.is_empty() && all.len() < 2000, "{}", all.len());
    let live: Vec<Vec<u8>> = (0..2000u64)
        .map(|u| k2(100 + u, "b"))
        .filter(|k| engine.get(&bucket, k).unwrap().is_some())
        .collect();
    assert_eq!(keys_of(&all), live);
}

/// What an active would stream to a replica: each key to its vbucket, at that vbucket's next
/// seqno.
#[derive(Default)]
struct Stream {
    seqnos: [u64; 4],
    /// (vbucket, seqno, key) of every change sent.
    sent: Vec<(u16, u64, Vec<u8>)>,
}

impl Stream {
    fn send(
        &mut self,
        engine: &Engine,
        bucket: &sluice_core::bucket::Bucket,
        op: ChangeOp,
        key: Vec<u8>,
    ) {
        let vb = bucket.vbucket_of(&key);
        self.seqnos[vb as usize] += 1;
        let seqno = self.seqnos[vb as usize];
        let meta = ItemMeta {
            by_seqno: seqno,
            cas: seqno,
            ..Default::default()
        };
        let value: &[u8] = if op == ChangeOp::Mutation { b"v" } else { b"" };
        engine
            .apply_replicated(bucket, vb, std::iter::once((op, &key[..], value, meta)))
            .unwrap();
        self.sent.push((vb, seqno, key));
    }
}

#[test]
fn a_replica_serves_its_stream_in_key_order_through_restart_and_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ordered_config(dir.path(), 4);
    cfg.replica = true;
    let mut engine = Engine::open(cfg.clone()).unwrap();
    let mut bucket = engine.bucket("default").unwrap();
    assert_eq!(engine.vbucket_state(&bucket, 0), Some(VbState::Replica));
    // Twenty keys as an active streams them, each to its vbucket with that vbucket's seqnos.
    let mut stream = Stream::default();
    for u in 0..20 {
        stream.send(&engine, &bucket, ChangeOp::Mutation, k2(u, "r"));
    }
    stream.send(&engine, &bucket, ChangeOp::Deletion, k2(3, "r"));
    let eq = |engine: &Engine, bucket, key: &[u8]| {
        keys_of(
            &engine
                .select(bucket, SelectIterator::Eq, key, 0, 10)
                .unwrap(),
        )
    };
    assert_eq!(eq(&engine, &bucket, &k2(5, "r")), vec![k2(5, "r")]);
    assert_eq!(eq(&engine, &bucket, &k2(3, "r")), Vec::<Vec<u8>>::new());
    let ge = engine
        .select(&bucket, SelectIterator::Gt, &[0x91, 0x10], 0, 10)
        .unwrap();
    assert_eq!(keys_of(&ge), vec![k2(17, "r"), k2(18, "r"), k2(19, "r")]);
    // Recovery from the WAL.
    reopen(&mut engine, &mut bucket, &cfg);
    let all = engine
        .select(&bucket, SelectIterator::All, &[], 0, u32::MAX)
        .unwrap();
    let want: Vec<Vec<u8>> = (0..20).filter(|&u| u != 3).map(|u| k2(u, "r")).collect();
    assert_eq!(keys_of(&all), want, "after reopening");
    // Roll key 10's vbucket back to just before key 10 arrived: 10 and every later key of
    // that vbucket leave, and the index keeps following the vbucket's new changes.
    let (vb, seqno, _) = stream
        .sent
        .iter()
        .find(|(_, _, k)| *k == k2(10, "r"))
        .cloned()
        .unwrap();
    engine
        .rollback_vbuckets(&bucket, &[(vb, seqno - 1)])
        .unwrap();
    let gone: Vec<Vec<u8>> = stream
        .sent
        .iter()
        .filter(|(v, s, _)| *v == vb && *s >= seqno)
        .map(|(_, _, k)| k.clone())
        .collect();
    assert!(gone.contains(&k2(10, "r")));
    let want: Vec<Vec<u8>> = (0..20)
        .map(|u| k2(u, "r"))
        .filter(|k| *k != k2(3, "r") && !gone.contains(k))
        .collect();
    let all = engine
        .select(&bucket, SelectIterator::All, &[], 0, u32::MAX)
        .unwrap();
    assert_eq!(keys_of(&all), want);
    stream.seqnos[vb as usize] = seqno - 1;
    stream.send(&engine, &bucket, ChangeOp::Mutation, k2(10, "r"));
    let all = engine
        .select(&bucket, SelectIterator::Req, &[0x91, 0x0a], 0, 5)
        .unwrap();
    assert_eq!(keys_of(&all), vec![k2(10, "r")]);
    // Recovery from the snapshot the rollback wrote, and the WAL after it.
    reopen(&mut engine, &mut bucket, &cfg);
    let all = engine
        .select(&bucket, SelectIterator::Ge, &[0x91, 0x0a], 0, 2)
        .unwrap();
    let mut after: Vec<Vec<u8>> = want.into_iter().filter(|k| *k > k2(10, "r")).collect();
    after.insert(0, k2(10, "r"));
    after.truncate(2);
    assert_eq!(keys_of(&all), after);
    engine.close();
}

fn reopen(
    engine: &mut Engine,
    bucket: &mut std::sync::Arc<sluice_core::bucket::Bucket>,
    cfg: &EngineConfig,
) {
    engine.close();
    *engine = Engine::open(cfg.clone()).unwrap();
    *bucket = engine.bucket("default").unwrap();
}

#[test]
fn a_part_reads_exactly_its_vbuckets_and_fails_on_one_not_active() {
    use sluice_core::engine::Part;
    use sluice_core::vbucket::VbSet;

    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(ordered_config(dir.path(), 4)).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let keys: Vec<Vec<u8>> = (0..40u64).map(|u| k2(u, "a")).collect();
    for k in &keys {
        engine.store(&bucket, &StoreRequest::set(k, b"v")).unwrap();
    }
    let of = |vbs: &[u16]| {
        let mut s = VbSet::default();
        vbs.iter().for_each(|&vb| s.insert(vb));
        s
    };
    let select = |part| engine.select_from(&bucket, SelectIterator::All, &[], 0, u32::MAX, part);
    let in_vbs = |vbs: &[u16]| -> Vec<Vec<u8>> {
        keys.iter()
            .filter(|k| vbs.contains(&bucket.vbucket_of(k)))
            .cloned()
            .collect()
    };
    assert_eq!(
        keys_of(&select(Part::Exactly(of(&[1, 3]))).unwrap()),
        in_vbs(&[1, 3])
    );
    assert_eq!(
        engine
            .count_from(
                &bucket,
                SelectIterator::All,
                &[],
                Part::Exactly(of(&[0, 2]))
            )
            .unwrap(),
        in_vbs(&[0, 2]).len() as u64
    );
    // A replica here: read by a node on its own, left out of its actives, and a part that
    // names it fails rather than answer without it.
    engine
        .set_vbucket_state(&bucket, 3, VbState::Replica)
        .unwrap();
    assert_eq!(select(Part::Held).unwrap().len(), keys.len());
    assert_eq!(keys_of(&select(Part::Active).unwrap()), in_vbs(&[0, 1, 2]));
    let err = select(Part::Exactly(of(&[1, 3]))).unwrap_err();
    assert!(matches!(err, Error::NotMyVbucket(3)), "{err:?}");
    let err = engine
        .count_from(&bucket, SelectIterator::All, &[], Part::Exactly(of(&[3])))
        .unwrap_err();
    assert!(matches!(err, Error::NotMyVbucket(3)), "{err:?}");
    assert_eq!(
        keys_of(&select(Part::Exactly(of(&[1]))).unwrap()),
        in_vbs(&[1])
    );
}
