//! Random sequences of set / delete / expire / snapshot / restart / crash against a model:
//! after every step the engine holds exactly the model's items, seqnos never go backwards,
//! and a crash adds a failover entry to every vbucket while a clean restart does not.

mod common;

use std::collections::BTreeMap;

use proptest::prelude::*;
use sluice_core::item::RELATIVE_EXPIRY_LIMIT;
use sluice_core::wal::WalMode;
use sluice_core::{Durability, Engine, Error, StoreRequest};

#[derive(Debug, Clone)]
enum Op {
    Set(u8, u16),
    SetPersist(u8, u16),
    Delete(u8),
    /// SET with an absolute expiry in 1970: expired at once.
    SetExpired(u8),
    Get(u8),
    Snapshot,
    Restart,
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..24, any::<u16>()).prop_map(|(k, v)| Op::Set(k, v)),
        3 => (0u8..24, any::<u16>()).prop_map(|(k, v)| Op::SetPersist(k, v)),
        3 => (0u8..24).prop_map(Op::Delete),
        2 => (0u8..24).prop_map(Op::SetExpired),
        3 => (0u8..24).prop_map(Op::Get),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Restart),
        1 => Just(Op::Crash),
    ]
}

fn key(k: u8) -> Vec<u8> {
    format!("key-{k}").into_bytes()
}

fn value(k: u8, v: u16) -> Vec<u8> {
    // Sizes vary so that blocks and slots differ in shape.
    format!("{k}:{v}:")
        .repeat(1 + (v as usize % 7))
        .into_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_model(ops in proptest::collection::vec(op(), 1..60), fsync in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let mode = if fsync { WalMode::Fsync } else { WalMode::Write };
        let cfg = common::config(dir.path(), mode, 8);
        let mut engine = Engine::open(cfg.clone()).unwrap();
        let mut model: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let mut highs = engine.high_seqnos(&engine.bucket("default").unwrap());
        for op in ops {
            let bucket = engine.bucket("default").unwrap();
            match op {
                Op::Set(k, v) | Op::SetPersist(k, v) => {
                    let val = value(k, v);
                    let kb = key(k);
                    let mut req = StoreRequest::set(&kb, &val);
                    if matches!(op, Op::SetPersist(..)) {
                        req.durability = Some(Durability::Persist.into());
                    }
                    engine.store(&bucket, &req).unwrap();
                    model.insert(key(k), val);
                }
                Op::Delete(k) => {
                    let r = engine.delete(&bucket, &key(k), 0, None);
                    match model.remove(&key(k)) {
                        Some(_) => { r.unwrap(); }
                        None => prop_assert_eq!(r.unwrap_err(), Error::NotFound),
                    }
                }
                Op::SetExpired(k) => {
                    let kb = key(k);
                    let mut req = StoreRequest::set(&kb, b"gone");
                    req.expiry = RELATIVE_EXPIRY_LIMIT + 1;
                    engine.store(&bucket, &req).unwrap();
                    prop_assert!(engine.get(&bucket, &key(k)).unwrap().is_none());
                    model.remove(&key(k));
                    let meta = engine.get_meta(&bucket, &key(k)).unwrap();
                    prop_assert!(meta.meta.deleted, "an expired read leaves an expiration tombstone");
                }
                Op::Get(k) => {
                    let got = engine.get(&bucket, &key(k)).unwrap().map(|i| i.value().to_vec());
                    prop_assert_eq!(got, model.get(&key(k)).cloned());
                }
                Op::Snapshot => { engine.snapshot_now().unwrap(); }
                Op::Restart | Op::Crash => {
                    let logs_before: Vec<usize> = (0..8).map(|v| engine.failover_log(&bucket, v).unwrap().len()).collect();
                    if matches!(op, Op::Crash) { engine.crash() } else { engine.close() }
                    drop(bucket);
                    drop(engine);
                    engine = Engine::open(cfg.clone()).unwrap();
                    let b = engine.bucket("default").unwrap();
                    let report = engine.recovery_report();
                    prop_assert_eq!(report.unclean_shutdown, matches!(op, Op::Crash));
                    for v in 0..8u16 {
                        let grew = engine.failover_log(&b, v).unwrap().len() > logs_before[v as usize];
                        prop_assert_eq!(grew, matches!(op, Op::Crash) && logs_before[v as usize] < 25);
                    }
                }
            }
            let bucket = engine.bucket("default").unwrap();
            prop_assert_eq!(&common::live(&engine, &bucket), &model);
            let now = engine.high_seqnos(&bucket);
            prop_assert!(now.iter().zip(&highs).all(|(a, b)| a >= b), "seqnos went backwards: {:?} -> {:?}", highs, now);
            highs = now;
        }
        engine.close();
    }
}
