//! Followed changes (sluice as the replica of a Tarantool): the source's position is logged in
//! the same WAL block as the change before it, and recovery, snapshots and a fresh copy keep
//! positions and data together.

mod common;

use sluice_core::item::{ChangeOp, ItemMeta};
use sluice_core::wal::record::{decode, RecordBody};
use sluice_core::wal::writer::{MetaRecord, WalConfig, WalPayload};
use sluice_core::wal::xlog::{self, Next, XlogReader};
use sluice_core::wal::{WalMode, WalWriter};
use sluice_core::{Engine, FollowedChange};
use sluice_proto::msgpack::Reader;

fn position(n: u64) -> Vec<u8> {
    n.to_be_bytes().to_vec()
}

/// The newest position the bucket's vbuckets hold, as the counter `position` encoded.
fn newest(engine: &Engine) -> Option<u64> {
    let bucket = engine.bucket("default").unwrap();
    engine
        .follow_positions(&bucket)
        .iter()
        .map(|p| u64::from_be_bytes(p[..8].try_into().unwrap()))
        .max()
}

#[test]
fn a_position_never_starts_a_block_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    // Blocks of one record each, but for the glued positions.
    let wal = WalWriter::start(
        WalConfig {
            dir: dir.path().to_path_buf(),
            mode: WalMode::Write,
            instance: "test".into(),
            segment_size: 64 << 20,
            block_size: 1,
        },
        1,
        Box::new(|_| {}),
    )
    .unwrap();
    for i in 0..50u64 {
        let mut a = wal.appender().unwrap();
        let meta = ItemMeta {
            by_seqno: i + 1,
            rev_seqno: 1,
            ..Default::default()
        };
        let key = format!("k{i}");
        let c =
            sluice_core::item::Change::new(ChangeOp::Mutation, 0, 0, key.as_bytes(), b"v", meta);
        a.push(WalPayload::Change(c));
        a.push(WalPayload::meta(
            0,
            0,
            MetaRecord::FollowPosition(position(i)),
        ));
    }
    wal.shutdown();
    let files = xlog::list_files(dir.path(), "xlog").unwrap();
    let mut reader = XlogReader::open(&files[0].1).unwrap();
    let mut blocks = 0;
    loop {
        match reader.next_block().unwrap() {
            Next::Block { payload, .. } => {
                let mut r = Reader::new(payload);
                let mut bodies = Vec::new();
                while !r.is_empty() {
                    bodies.push(decode(&mut r).unwrap().body);
                }
                // Every block holds one change and its position, in that order.
                assert_eq!(bodies.len(), 2, "{bodies:?}");
                assert!(matches!(bodies[0], RecordBody::Change { .. }));
                assert_eq!(bodies[1], RecordBody::FollowPosition(&position(blocks)));
                blocks += 1;
            }
            Next::Eof { .. } => break,
            other => panic!("unexpected {:?}", std::mem::discriminant(&other)),
        }
    }
    assert_eq!(blocks, 50);
}

#[test]
fn a_group_shares_one_block_and_sees_its_own_writes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 8);
    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("key{i}").into_bytes()).collect();
    // 40 keys over 8 vbuckets, then the first key again: the last write sees the first.
    let mut writes: Vec<(&sluice_core::bucket::Bucket, &[u8])> =
        keys.iter().map(|k| (&*bucket, k.as_slice())).collect();
    writes.push((&*bucket, keys[0].as_slice()));
    let (lsn, refused) = engine
        .write_followed_group(&writes, Some(&position(7)), |i, cur| {
            if i == 40 {
                let mut v = cur.unwrap().to_vec();
                v.extend_from_slice(b"+again");
                FollowedChange::Store(v)
            } else {
                FollowedChange::Store(format!("v{i}").into_bytes())
            }
        })
        .unwrap();
    assert!(refused.is_empty());
    while engine.wal().written_lsn() < lsn {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    engine.crash();
    drop((bucket, engine));

    // One block holds the group: its marker, 41 changes and the position.
    let files = xlog::list_files(&dir.path().join("wal"), "xlog").unwrap();
    let mut grouped = 0;
    for (_, path, _) in files {
        let mut reader = XlogReader::open(&path).unwrap();
        while let Next::Block { payload, .. } = reader.next_block().unwrap() {
            let mut r = Reader::new(payload);
            let mut bodies = Vec::new();
            while !r.is_empty() {
                bodies.push(decode(&mut r).unwrap().body);
            }
            if bodies.contains(&RecordBody::FollowGroup) {
                let at = bodies
                    .iter()
                    .position(|b| *b == RecordBody::FollowGroup)
                    .unwrap();
                let changes = bodies[at..]
                    .iter()
                    .filter(|b| matches!(b, RecordBody::Change { .. }));
                assert_eq!(changes.count(), 41);
                assert_eq!(
                    bodies.last(),
                    Some(&RecordBody::FollowPosition(&position(7)))
                );
                grouped += 1;
            }
        }
    }
    assert_eq!(grouped, 1);

    let engine = Engine::open(cfg).unwrap();
    let bucket = engine.bucket("default").unwrap();
    assert_eq!(newest(&engine), Some(7));
    let live = common::live(&engine, &bucket);
    assert_eq!(live.len(), 40);
    assert_eq!(live[&keys[0]], b"v0+again");
    assert_eq!(live[&keys[39]], b"v39");
}

#[test]
fn positions_survive_a_crash_a_snapshot_and_a_restart_and_a_copy_clears_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 4);
    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    assert_eq!(newest(&engine), None);
    let store = |v: &'static [u8]| move |_: Option<&[u8]>| FollowedChange::Store(v.to_vec());
    engine
        .write_followed(&bucket, b"a", Some(&position(1)), store(b"1"))
        .unwrap();
    engine
        .write_followed(&bucket, b"b", Some(&position(2)), store(b"2"))
        .unwrap();
    // An update that reads the stored value, as a followed UPDATE does.
    engine
        .write_followed(&bucket, b"a", Some(&position(3)), |cur| {
            let mut v = cur.unwrap().to_vec();
            v.push(b'+');
            FollowedChange::Store(v)
        })
        .unwrap();
    let last = engine
        .write_followed(&bucket, b"b", Some(&position(4)), |_| {
            FollowedChange::Delete
        })
        .unwrap();
    // A row that changes nothing moves the position only.
    let last = last.max(
        engine
            .write_followed(&bucket, b"zz", Some(&position(5)), |_| FollowedChange::Keep)
            .unwrap(),
    );
    while engine.wal().written_lsn() < last {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    engine.crash();
    drop((bucket, engine));

    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    assert_eq!(newest(&engine), Some(5));
    let live = common::live(&engine, &bucket);
    assert_eq!(live.get(&b"a"[..]).map(Vec::as_slice), Some(&b"1+"[..]));
    assert!(!live.contains_key(&b"b"[..]));

    engine.snapshot_now().unwrap();
    engine
        .write_followed(&bucket, b"c", Some(&position(6)), store(b"3"))
        .unwrap();
    engine.close();
    drop((bucket, engine));

    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    assert_eq!(newest(&engine), Some(6));
    // A copy starts: positions are cleared in the WAL too, so a crash while loading the copy
    // finds none and copies again.
    engine.clear_follow_positions(&bucket).unwrap();
    engine
        .write_followed(&bucket, b"d", None, store(b"4"))
        .unwrap();
    assert_eq!(newest(&engine), None);
    engine.close();
    drop((bucket, engine));

    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    assert_eq!(newest(&engine), None);
    engine.write_follow_position(&bucket, &position(9)).unwrap();
    engine.close();
    drop((bucket, engine));
    let engine = Engine::open(cfg).unwrap();
    assert_eq!(newest(&engine), Some(9));
}

#[test]
fn a_new_history_empties_the_bucket_and_sends_old_consumers_back_to_zero() {
    use sluice_core::failover::{rollback_point, ResumePoint};
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 4);
    let engine = Engine::open(cfg.clone()).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let store = |v: &'static [u8]| move |_: Option<&[u8]>| FollowedChange::Store(v.to_vec());
    for i in 0..20u64 {
        let key = format!("old{i}");
        engine
            .write_followed(&bucket, key.as_bytes(), Some(&position(i)), store(b"v"))
            .unwrap();
    }
    let before: Vec<_> = (0..4)
        .map(|v| engine.stream_position(&bucket, v).unwrap())
        .collect();
    let restarted = engine.restart_history(&bucket).unwrap();
    assert_eq!(
        restarted.len(),
        before.iter().filter(|p| p.high_seqno > 0).count()
    );
    assert!(common::live(&engine, &bucket).is_empty());
    assert!(engine.follow_positions(&bucket).is_empty());
    let last = engine
        .write_followed(&bucket, b"new", Some(&position(100)), store(b"n"))
        .unwrap();
    let check = |engine: &Engine, entries: usize| {
        let bucket = engine.bucket("default").unwrap();
        for (v, old) in before.iter().enumerate() {
            let now = engine.stream_position(&bucket, v as u16).unwrap();
            if old.high_seqno == 0 {
                continue;
            }
            // A history of its own from the old high seqno (seqnos go on rising); an unclean
            // restart adds its own entry on top.
            assert_eq!(now.failover.len(), entries, "vbucket {v}");
            assert_eq!(now.failover.last().unwrap().seqno, old.high_seqno);
            assert!(now.failover.iter().all(|e| e.uuid != old.failover[0].uuid));
            assert!(now.high_seqno >= old.high_seqno);
            // A consumer of the old history, wherever it stands, goes back to 0.
            for start in [1, old.high_seqno] {
                let at = ResumePoint {
                    start_seqno: start,
                    vbucket_uuid: old.failover[0].uuid,
                    snap_start_seqno: start,
                    snap_end_seqno: start,
                };
                let p = rollback_point(&now.failover, now.high_seqno, now.purge_seqno, at, false);
                assert_eq!(p, Some(0), "vbucket {v} from {start}");
            }
        }
        let live = common::live(engine, &bucket);
        assert_eq!(live.keys().collect::<Vec<_>>(), [b"new"]);
    };
    check(&engine, 1);
    while engine.wal().written_lsn() < last {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    engine.crash();
    drop((bucket, engine));
    // After kill -9: the snapshot holds the new history, the WAL the write after it.
    let engine = Engine::open(cfg).unwrap();
    check(&engine, 2);
    assert_eq!(newest(&engine), Some(100));
}
