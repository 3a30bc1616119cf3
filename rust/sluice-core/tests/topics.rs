//! Topics in the engine: every produced message is kept and numbered, logged to the WAL before
//! the producer is answered, and read back the same after a crash, after a snapshot and a
//! crash, and after force recovery's salvage; retention drops old segments.

mod common;

use sluice_core::engine::TopicRead;
use sluice_core::partition_log::LogConfig;
use sluice_core::wal::WalMode;
use sluice_core::{Engine, Error};
use sluice_proto::tank::bundle::{self, codec, Bundle, NewMessage};
use sluice_proto::tank::response::chunk_bundles;

fn bundle_of(contents: &[String], snappy: bool) -> Vec<u8> {
    let msgs: Vec<NewMessage<'_>> = contents
        .iter()
        .map(|c| NewMessage {
            ts: 1_700_000_000_000,
            key: None,
            content: c.as_bytes(),
        })
        .collect();
    let mut out = Vec::new();
    bundle::write(
        &mut out,
        &msgs,
        if snappy { codec::SNAPPY } else { codec::NONE },
    );
    out
}

/// Every message of a partition from `seq`: (sequence number, content).
fn read_all(engine: &Engine, topic: &str, partition: u16, mut seq: u64) -> Vec<(u64, String)> {
    let t = engine.topic(topic).expect("topic");
    let mut out = Vec::new();
    loop {
        let mut buf: Vec<u8> = Vec::new();
        match engine
            .read_topic(&t, partition, seq, 1 << 16, &mut buf)
            .unwrap()
        {
            TopicRead::Chunk { base_seq, .. } => {
                let mut next = base_seq;
                for b in chunk_bundles(&buf) {
                    let parsed = Bundle::parse(b).unwrap();
                    let set = parsed.messages_bytes(1 << 20).unwrap();
                    for m in parsed.messages(&set, next) {
                        let m = m.unwrap();
                        if m.seq >= seq {
                            out.push((m.seq, String::from_utf8(m.content.to_vec()).unwrap()));
                        }
                        next = m.seq + 1;
                    }
                }
                seq = next;
            }
            TopicRead::Tail { .. } => return out,
            TopicRead::OutOfRange {
                first_available, ..
            } => seq = first_available,
        }
    }
}

fn produce(
    engine: &Engine,
    topic: &str,
    partition: u16,
    contents: &[String],
    snappy: bool,
) -> (u64, u64) {
    let t = engine.topic(topic).expect("topic");
    let w = engine
        .produce(&t, partition, None, bundle_of(contents, snappy).into())
        .unwrap();
    engine.wait_written(w).unwrap()
}

fn messages(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

#[test]
fn produced_messages_survive_a_crash_and_a_snapshot_and_numbering_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 4);
    let engine = Engine::open(cfg.clone()).unwrap();
    engine.create_topic("events", 2, "").unwrap();
    assert_eq!(
        produce(&engine, "events", 0, &messages("a", 3), false),
        (1, 3)
    );
    assert_eq!(
        produce(&engine, "events", 0, &messages("b", 20), true),
        (4, 23)
    );
    assert_eq!(
        produce(&engine, "events", 1, &messages("c", 1), false),
        (1, 1)
    );
    let before: Vec<_> = (0..2).map(|p| read_all(&engine, "events", p, 0)).collect();
    assert_eq!(before[0].len(), 23);
    assert_eq!(before[0][5], (6, "b-2".to_string()));
    engine.crash();
    drop(engine);

    let engine = Engine::open(cfg.clone()).unwrap();
    assert_eq!(
        (0..2)
            .map(|p| read_all(&engine, "events", p, 0))
            .collect::<Vec<_>>(),
        before
    );
    assert_eq!(
        produce(&engine, "events", 0, &messages("d", 2), false),
        (24, 25)
    );
    // A snapshot, then more produced after it: both halves come back.
    engine.snapshot_now().unwrap();
    assert_eq!(
        produce(&engine, "events", 1, &messages("e", 4), true),
        (2, 5)
    );
    let before: Vec<_> = (0..2).map(|p| read_all(&engine, "events", p, 0)).collect();
    engine.crash();
    drop(engine);

    let engine = Engine::open(cfg).unwrap();
    assert_eq!(
        (0..2)
            .map(|p| read_all(&engine, "events", p, 0))
            .collect::<Vec<_>>(),
        before
    );
    assert_eq!(
        read_all(&engine, "events", 0, 24),
        [(24, "d-0".into()), (25, "d-1".into())]
    );
}

#[test]
fn a_topic_is_created_once_and_bad_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap();
    engine
        .create_topic("t", 1, "log.retention.bytes = 100\n")
        .unwrap();
    assert!(matches!(
        engine.create_topic("t", 1, ""),
        Err(Error::Exists)
    ));
    assert!(matches!(
        engine.create_topic("u", 1, "log.retention.fortnights=2"),
        Err(Error::InvalidArgument(e)) if e.contains("not a topic setting")
    ));
    assert!(matches!(
        engine.create_topic("v", 0, ""),
        Err(Error::InvalidArgument(_))
    ));
    let t = engine.topic("t").unwrap();
    assert!(matches!(
        engine.produce(&t, 0, None, vec![0x04, 0x00].into()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        engine.produce(&t, 1, None, bundle_of(&messages("x", 1), false).into()),
        Err(Error::InvalidArgument(e)) if e.contains("no partition 1")
    ));
    assert!(engine.topic("u").is_none());
}

#[test]
fn retention_drops_old_segments_and_a_reopened_topic_keeps_its_settings() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 4);
    let engine = Engine::open(cfg.clone()).unwrap();
    let settings = "log.segment.bytes=4096\nlog.retention.bytes=8192";
    engine.create_topic("logs", 1, settings).unwrap();
    for i in 0..100 {
        produce(&engine, "logs", 0, &[format!("{i:0>200}")], false);
    }
    assert!(engine.enforce_topic_retention(0) > 0);
    let kept = read_all(&engine, "logs", 0, 0);
    assert!(
        kept.len() < 100 && kept.last().unwrap().0 == 100,
        "{}",
        kept.len()
    );
    engine.snapshot_now().unwrap();
    engine.crash();
    drop(engine);

    let engine = Engine::open(cfg).unwrap();
    assert_eq!(read_all(&engine, "logs", 0, 0), kept);
    let t = engine.topic("logs").unwrap();
    assert_eq!(t.config_text, settings);
    assert_eq!(t.config, LogConfig::from_text(settings).unwrap());
}

#[test]
fn a_shared_read_is_the_copied_one_and_outlives_retention_dropping_its_segment() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap();
    engine
        .create_topic(
            "logs",
            1,
            "log.segment.bytes=4096\nlog.retention.bytes=4096",
        )
        .unwrap();
    for i in 0..10 {
        produce(&engine, "logs", 0, &[format!("{i:0>200}")], false);
    }
    let t = engine.topic("logs").unwrap();
    let (mut copied, mut shared) = (Vec::<u8>::new(), Vec::<bytes::Bytes>::new());
    let a = engine.read_topic(&t, 0, 1, 1 << 16, &mut copied).unwrap();
    let b = engine.read_topic(&t, 0, 1, 1 << 16, &mut shared).unwrap();
    assert_eq!(a, b);
    assert_eq!(shared.len(), 1);
    assert_eq!(&shared[0][..], &copied[..]);
    // The segment read from goes; what was shared from it stays as it was.
    for i in 10..100 {
        produce(&engine, "logs", 0, &[format!("{i:0>200}")], false);
    }
    assert!(engine.enforce_topic_retention(0) > 0);
    assert!(read_all(&engine, "logs", 0, 0)[0].0 > 10);
    assert_eq!(&shared[0][..], &copied[..]);
}

#[test]
fn a_bundle_is_read_only_once_the_wal_file_holds_it() {
    use sluice_core::wal::writer::Failpoint;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap();
    engine.create_topic("t", 1, "").unwrap();
    produce(&engine, "t", 0, &messages("a", 2), false);
    // The disk refuses writes: the bundle is in the log, not in the WAL file.
    engine.set_wal_failpoint(Failpoint::NoSpace);
    let t = engine.topic("t").unwrap();
    let w = engine
        .produce(&t, 0, None, bundle_of(&messages("b", 3), false).into())
        .unwrap();
    let mut buf: Vec<u8> = Vec::new();
    match engine.read_topic(&t, 0, 3, 1 << 16, &mut buf).unwrap() {
        TopicRead::Tail {
            high_water_mark,
            unwritten_lsn,
            ..
        } => {
            assert_eq!(high_water_mark, 2);
            assert_eq!(unwritten_lsn, Some(w.lsn()));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(read_all(&engine, "t", 0, 0).len(), 2);
    // Once the writer's retry gets it into the file, it is read.
    engine.set_wal_failpoint(Failpoint::Off);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while read_all(&engine, "t", 0, 0).len() < 5 {
        assert!(std::time::Instant::now() < deadline, "never written");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(engine.wal().written_lsn() >= w.lsn());
}

#[test]
fn bundles_placed_at_their_own_numbers_survive_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 4);
    let engine = Engine::open(cfg.clone()).unwrap();
    engine.create_topic("mirror", 1, "").unwrap();
    let t = engine.topic("mirror").unwrap();
    produce(&engine, "mirror", 0, &messages("a", 2), false);
    // ProduceWithSeqnum of a plain bundle: numbered from the sequence number given.
    let w = engine
        .produce(&t, 0, Some(100), bundle_of(&messages("b", 3), true).into())
        .unwrap();
    assert_eq!(engine.wait_written(w).unwrap(), (100, 102));
    // A sparse bundle (TANK's mirroring) numbers its own: 110, then 115 (the last).
    let mut sparse = vec![0x40 | (2 << 2)];
    sparse.extend_from_slice(&110u64.to_le_bytes());
    sparse.push(4); // last = 110 + 4 + 1
    for c in [&b"s-0"[..], b"s-1"] {
        sparse.push(0);
        sparse.extend_from_slice(&9u64.to_le_bytes());
        sparse.push(c.len() as u8);
        sparse.extend_from_slice(c);
    }
    assert!(matches!(
        engine.produce(&t, 0, Some(111), sparse.clone().into()),
        Err(Error::InvalidArgument(e)) if e.contains("numbers its first message 110")
    ));
    assert!(matches!(
        engine.produce(&t, 0, Some(50), bundle_of(&messages("c", 1), false).into()),
        Err(Error::InvalidArgument(e)) if e.contains("behind")
    ));
    let w = engine.produce(&t, 0, Some(110), sparse.into()).unwrap();
    assert_eq!(engine.wait_written(w).unwrap(), (110, 115));
    assert_eq!(
        produce(&engine, "mirror", 0, &messages("d", 1), false),
        (116, 116)
    );
    let before = read_all(&engine, "mirror", 0, 0);
    let numbers: Vec<u64> = before.iter().map(|m| m.0).collect();
    assert_eq!(numbers, vec![1, 2, 100, 101, 102, 110, 115, 116]);
    engine.crash();
    drop(engine);

    let engine = Engine::open(cfg.clone()).unwrap();
    assert_eq!(read_all(&engine, "mirror", 0, 0), before);
    engine.snapshot_now().unwrap();
    engine.crash();
    drop(engine);
    let engine = Engine::open(cfg).unwrap();
    assert_eq!(read_all(&engine, "mirror", 0, 0), before);
    assert_eq!(
        produce(&engine, "mirror", 0, &messages("e", 1), false),
        (117, 117)
    );
}

#[test]
fn large_bundles_and_values_written_in_place_come_back_after_a_crash() {
    use sluice_core::engine::StoreRequest;
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 4);
    let engine = Engine::open(cfg.clone()).unwrap();
    engine.create_topic("big", 1, "").unwrap();
    let t = engine.topic("big").unwrap();
    let b = engine.bucket("default").unwrap();
    // Produced without waiting, so that batches mix bundles and values above and below the
    // size the WAL writes from where they are queued, and run past its 4 MiB write chunk.
    let mut last = None;
    let mut expected = Vec::new();
    let mut values = Vec::new();
    for i in 0..80 {
        let n = if i % 3 == 0 { 2 } else { 1200 };
        let contents: Vec<String> = (0..n)
            .map(|j| format!("{i:03}-{j:05}-{}", "x".repeat(80)))
            .collect();
        let w = engine
            .produce(&t, 0, None, bundle_of(&contents, i % 5 == 4).into())
            .unwrap();
        expected.extend(contents);
        last = Some(w.lsn());
        let key = format!("v{i}");
        let value = vec![b'a' + (i % 26) as u8; if i % 2 == 0 { 40_000 } else { 300 }];
        engine
            .store(&b, &StoreRequest::set(key.as_bytes(), &value))
            .unwrap();
        values.push((key.into_bytes(), value));
    }
    let lsn = engine.wal().last_lsn();
    assert!(last.unwrap() <= lsn);
    engine.wal().wait_written(lsn, None).unwrap();
    engine.crash();
    drop(engine);

    let engine = Engine::open(cfg).unwrap();
    let got: Vec<String> = read_all(&engine, "big", 0, 0)
        .into_iter()
        .map(|(_, c)| c)
        .collect();
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "every message back, in order");
    let live = common::live(&engine, &engine.bucket("default").unwrap());
    for (k, v) in values {
        assert_eq!(live.get(&k), Some(&v), "{}", String::from_utf8_lossy(&k));
    }
}

/// The one `.log` segment file of a topic's partition under `dir`.
fn segment_file(dir: &std::path::Path) -> std::path::PathBuf {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "log") && p.starts_with(dir.join("topics"))
            {
                found.push(p);
            }
        }
    }
    assert_eq!(found.len(), 1, "{found:?}");
    found.pop().unwrap()
}

#[test]
fn a_bundle_the_wal_names_but_the_segment_file_lost_is_skipped_and_numbering_goes_on() {
    // A machine that went down before its page cache reached the disk (wal.mode = write) can
    // come back with a WAL record whose bundle the segment file lacks: the start goes on from
    // where the file ends instead of refusing to start.
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::config(dir.path(), WalMode::Write, 4);
    let engine = Engine::open(cfg.clone()).unwrap();
    engine.create_topic("events", 1, "").unwrap();
    assert_eq!(
        produce(&engine, "events", 0, &messages("a", 3), false),
        (1, 3)
    );
    let file = segment_file(dir.path());
    let kept = std::fs::metadata(&file).unwrap().len();
    assert_eq!(
        produce(&engine, "events", 0, &messages("b", 2), false),
        (4, 5)
    );
    assert!(std::fs::metadata(&file).unwrap().len() > kept);
    engine.crash();
    drop(engine);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(kept)
        .unwrap();

    let engine = Engine::open(cfg).unwrap();
    let want: Vec<(u64, String)> = (1..=3).zip(messages("a", 3)).collect();
    assert_eq!(read_all(&engine, "events", 0, 0), want);
    assert_eq!(
        produce(&engine, "events", 0, &messages("c", 1), false),
        (4, 4)
    );
    assert_eq!(read_all(&engine, "events", 0, 4), [(4, "c-0".to_string())]);
}
