use sluice_proto::tank::bundle::{self, codec, NewMessage};

use super::*;
use sluice_proto::tank::put_varint;

/// A plain bundle of `n` messages of `size` bytes, stamped `ts`.
fn bundle_of(n: usize, size: usize, ts: u64) -> Vec<u8> {
    let content = vec![b'x'; size];
    let msgs: Vec<NewMessage<'_>> = (0..n)
        .map(|_| NewMessage {
            ts,
            key: None,
            content: &content,
        })
        .collect();
    let mut out = Vec::new();
    bundle::write(&mut out, &msgs, codec::NONE);
    out
}

fn append(log: &mut PartitionLog, n: usize, size: usize, ts: u64) -> (u64, u64) {
    let b = bundle_of(n, size, ts);
    let c = PartitionLog::check(&b).unwrap();
    assert_eq!((c.first, c.span), (None, n as u64));
    log.append(&b, &c, ts).unwrap()
}

/// A plain sparse bundle of one-byte messages numbered `seqs` (ascending), as TANK's mirroring
/// writes them: each message between the first and last says how many numbers it skips.
fn sparse_of(seqs: &[u64]) -> Vec<u8> {
    let (first, last) = (seqs[0], *seqs.last().unwrap());
    let mut b = vec![0x40 | ((seqs.len() as u8) << 2)];
    b.extend_from_slice(&first.to_le_bytes());
    if seqs.len() > 1 {
        put_varint(&mut b, last - first - 1);
    }
    for (i, &s) in seqs.iter().enumerate() {
        if i > 0 && i + 1 < seqs.len() {
            b.push(0);
            put_varint(&mut b, s - seqs[i - 1] - 1);
        } else {
            b.push(0);
        }
        b.extend_from_slice(&3u64.to_le_bytes());
        b.extend_from_slice(&[1, b'a']);
    }
    b
}

/// The sequence numbers of every message in a chunk read from `base`.
fn seqs(chunk: &[u8], base: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut next = base;
    for b in sluice_proto::tank::response::chunk_bundles(chunk) {
        let parsed = Bundle::parse(b).unwrap();
        let set = parsed.messages_bytes(1 << 20).unwrap();
        for m in parsed.messages(&set, next) {
            out.push(m.unwrap().seq);
        }
        next = *out.last().unwrap() + 1;
    }
    out
}

#[test]
fn sequence_numbers_start_at_one_and_reads_answer_as_tanks_broker_does() {
    let mut log = PartitionLog::new(LogConfig::default());
    let tail = |hwm| Read::Tail {
        high_water_mark: hwm,
        first_available: 1,
    };
    assert_eq!(log.read(0, 100), tail(0));
    assert_eq!(append(&mut log, 1, 5, 10), (1, 1));
    assert_eq!(append(&mut log, 3, 5, 11), (2, 4));
    assert_eq!(append(&mut log, 2, 5, 12), (5, 6));
    assert_eq!((log.first_available(), log.high_water_mark()), (1, 6));
    // From the first available, the whole bundles that fit in the fetch size, the first one
    // whatever its size.
    let Read::Chunk {
        base_seq,
        high_water_mark,
        bundles,
    } = log.read(0, 1)
    else {
        panic!()
    };
    assert_eq!((base_seq, high_water_mark), (1, 6));
    assert_eq!(seqs(&bundles, base_seq), [1]);
    // Stored as TANK sends them: each bundle after its length varint.
    let stored = |n, ts| bundle_of(n, 5, ts).len() + 1;
    let two = (stored(1, 10) + stored(3, 11)) as u32;
    for (fetch_size, want) in [
        (two - 1, &[1][..]),
        (two, &[1, 2, 3, 4]),
        (two + 1, &[1, 2, 3, 4]),
    ] {
        let Read::Chunk { bundles, .. } = log.read(1, fetch_size) else {
            panic!()
        };
        assert_eq!(seqs(&bundles, 1), want, "fetch size {fetch_size}");
        assert!(bundles.len() <= fetch_size as usize || want.len() == 1);
    }
    // A sequence number inside a bundle: from that bundle's first message.
    let Read::Chunk {
        base_seq, bundles, ..
    } = log.read(3, 1 << 20)
    else {
        panic!()
    };
    assert_eq!(base_seq, 2);
    assert_eq!(seqs(&bundles, base_seq), [2, 3, 4, 5, 6]);
    // The next one to be produced, asked for by number or as the tail: nothing yet.
    assert_eq!(log.read(7, 100), tail(6));
    assert_eq!(log.read(u64::MAX, 100), tail(6));
    assert_eq!(
        log.read(9999, 100),
        Read::OutOfRange {
            high_water_mark: 6,
            first_available: 1
        }
    );
}

#[test]
fn every_sequence_number_is_found_through_the_sparse_index_across_segments() {
    let config = LogConfig {
        segment_bytes: 2000,
        index_interval: 100,
        ..LogConfig::default()
    };
    let mut log = PartitionLog::new(config);
    let mut first_of = Vec::new(); // (first seq, count) of each bundle
    for i in 0..300 {
        let n = 1 + i % 7;
        let (first, _) = append(&mut log, n, 3 + i % 11, i as u64);
        first_of.push((first, n as u64));
    }
    assert!(log.segments.len() > 5, "{} segments", log.segments.len());
    for seq in 1..=log.high_water_mark() {
        let Read::Chunk {
            base_seq, bundles, ..
        } = log.read(seq, 1)
        else {
            panic!("{seq}")
        };
        let &(first, count) = first_of
            .iter()
            .find(|(f, c)| seq >= *f && seq < f + c)
            .unwrap();
        assert_eq!(base_seq, first, "seq {seq}");
        let got = seqs(&bundles, base_seq);
        assert_eq!(got.len() as u64, count, "one whole bundle for fetch size 1");
        assert!(got.contains(&seq));
    }
}

#[test]
fn retention_drops_whole_old_segments_and_never_the_newest() {
    let config = LogConfig {
        segment_bytes: 1000,
        retention_bytes: Some(3000),
        retention_ms: Some(1000),
        ..LogConfig::default()
    };
    let mut log = PartitionLog::new(config);
    for i in 0..100u64 {
        append(&mut log, 2, 50, 10_000 + i);
    }
    let before = log.bytes();
    let dropped = log.enforce_retention(10_050);
    assert!(dropped > 0 && log.bytes() <= 3000 && log.bytes() < before);
    let first = log.first_available();
    assert_eq!(first, dropped + 1);
    assert_eq!(
        log.read(1, 10),
        Read::OutOfRange {
            high_water_mark: 200,
            first_available: first
        }
    );
    assert!(matches!(log.read(0, 10), Read::Chunk { base_seq, .. } if base_seq == first));
    // Far later: every segment is too old, but the newest stays.
    log.enforce_retention(1_000_000);
    assert_eq!(log.segments.len(), 1);
    assert!(matches!(log.read(0, 10), Read::Chunk { .. }));
    assert_eq!(log.high_water_mark(), 200);
}

#[test]
fn bundles_placed_by_number_may_skip_ahead_but_not_go_back() {
    let mut log = PartitionLog::starting_at(LogConfig::default(), 50);
    let b = bundle_of(3, 4, 1);
    log.append_at(50, &b, 3, 1).unwrap();
    log.append_at(60, &b, 3, 1).unwrap();
    assert_eq!(
        log.append_at(55, &b, 3, 1),
        Err(AppendError::Behind {
            first_seq: 55,
            next_seq: 63
        })
    );
    assert_eq!(log.first_available(), 50);
    // In the gap: from the next message kept.
    let Read::Chunk { base_seq, .. } = log.read(55, 1) else {
        panic!()
    };
    assert_eq!(base_seq, 60);
}

#[test]
fn a_bundle_larger_than_a_segment_after_a_gap_gets_a_segment_of_its_own_size() {
    let config = LogConfig {
        segment_bytes: 1000,
        ..LogConfig::default()
    };
    let mut log = PartitionLog::starting_at(config, 1);
    let small = bundle_of(1, 10, 1);
    let big = bundle_of(10, 300, 1);
    assert!(big.len() > 2 * config.segment_bytes);
    log.append_at(1, &small, 1, 1).unwrap();
    // Past a gap (a new, empty segment is started for it), then into a segment that a
    // setting made since has too little room for.
    log.append_at(100, &big, 10, 1).unwrap();
    log.set_config(LogConfig {
        segment_bytes: 1 << 20,
        ..config
    });
    log.append_at(200, &big, 10, 1).unwrap();
    log.append(&big, &PartitionLog::check(&big).unwrap(), 1)
        .unwrap();
    assert_eq!(log.high_water_mark(), 219);
    for (from, want) in [(1, 1), (100, 100), (200, 200), (210, 210)] {
        let Read::Chunk { base_seq, .. } = log.read(from, 1) else {
            panic!("nothing read from {from}")
        };
        assert_eq!(base_seq, want);
    }
}

#[test]
fn bad_bundles_are_refused_and_snappy_ones_counted() {
    assert!(matches!(
        PartitionLog::check(&[0x04]),
        Err(AppendError::Bundle(_))
    ));
    let content = [b'y'; 100];
    let msgs = vec![
        NewMessage {
            ts: 5,
            key: Some(b"k"),
            content: &content
        };
        50
    ];
    let mut b = Vec::new();
    bundle::write(&mut b, &msgs, codec::SNAPPY);
    // Damage a decompressor would fail on, or a plain set cut inside a message: refused.
    for cut in [b.len() - 1, b.len() / 2] {
        assert!(matches!(
            PartitionLog::check(&b[..cut]),
            Err(AppendError::Bundle(_))
        ));
    }
    let plain = bundle_of(20, 10, 1);
    assert!(PartitionLog::check(&plain).is_ok());
    assert!(matches!(
        PartitionLog::check(&plain[..plain.len() - 3]),
        Err(AppendError::Bundle(_))
    ));
    assert_eq!(
        PartitionLog::check(&b),
        Ok(Checked {
            count: 50,
            first: None,
            span: 50,
        })
    );
}

#[test]
fn a_sparse_bundle_is_placed_at_its_own_numbers_and_read_by_them() {
    let mut log = PartitionLog::new(LogConfig::default());
    append(&mut log, 2, 10, 1);
    let sparse = sparse_of(&[7, 9, 12]);
    let c = PartitionLog::check(&sparse).unwrap();
    assert_eq!((c.first, c.span), (Some(7), 6));
    assert_eq!(log.append(&sparse, &c, 3), Ok((7, 12)));
    assert_eq!(append(&mut log, 1, 10, 1), (13, 13));
    assert_eq!(log.high_water_mark(), 13);
    // From a number the sparse bundle skips, the read starts at that bundle.
    let Read::Chunk {
        base_seq, bundles, ..
    } = log.read(10, 1)
    else {
        panic!("a chunk")
    };
    assert_eq!(base_seq, 7);
    assert_eq!(seqs(&bundles, base_seq), vec![7, 9, 12]);
    // 3 to 6 were never produced here: the sparse bundle began a segment, which a read from
    // the gap starts at.
    let Read::Chunk { bundles, .. } = log.read(1, 1 << 20) else {
        panic!("a chunk")
    };
    assert_eq!(seqs(&bundles, 1), vec![1, 2]);
    let Read::Chunk {
        base_seq, bundles, ..
    } = log.read(3, 1 << 20)
    else {
        panic!("a chunk")
    };
    assert_eq!(seqs(&bundles, base_seq), vec![7, 9, 12, 13]);
    // Behind the end, or numbered out of order: refused.
    let again = sparse_of(&[12, 20]);
    let c = PartitionLog::check(&again).unwrap();
    assert!(matches!(
        log.append(&again, &c, 3),
        Err(AppendError::Behind { first_seq: 12, .. })
    ));
    let mut bad = sparse_of(&[30, 31, 32]);
    bad[9] = 5; // the gap to the last: 30 + 5 + 1 = 36, so the middle may say 31
    assert!(PartitionLog::check(&bad).is_ok());
    let mut bad = sparse_of(&[30, 40, 41]);
    bad[9] = 1; // the last is now 32, before the middle's 40
    assert_eq!(
        PartitionLog::check(&bad),
        Err(AppendError::SparseOrder { seq: 40 })
    );
}

#[test]
fn a_retained_message_costs_little_beyond_its_bundle() {
    let mut log = PartitionLog::new(LogConfig::default());
    let mut produced = 0;
    for _ in 0..1000 {
        append(&mut log, 1000, 100, 1);
        produced += 1000;
    }
    let bundle_bytes = 1000 * bundle_of(1000, 100, 1).len() as u64;
    let beyond = log.bytes() - bundle_bytes + log.overhead() as u64;
    // The target is at most 16 bytes a message; the lengths and index cost well under one.
    assert!(
        beyond / produced < 1,
        "{beyond} bytes beyond the bundles for {produced} messages"
    );
}

#[test]
fn a_log_in_a_directory_keeps_a_file_per_segment_and_retention_deletes_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = LogConfig {
        segment_bytes: 1000,
        retention_bytes: Some(3000),
        ..LogConfig::default()
    };
    let mut log = PartitionLog::in_dir(config, dir.path().join("0"));
    let mut in_memory = PartitionLog::new(config);
    for i in 0..100u64 {
        append(&mut log, 2, 50, 10_000 + i);
        append(&mut in_memory, 2, 50, 10_000 + i);
    }
    let files = || {
        let mut names: Vec<_> = std::fs::read_dir(dir.path().join("0"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".log"))
            .collect();
        names.sort();
        names
    };
    assert_eq!(files().len(), log.segments.len());
    assert_eq!(files()[0], "00000000000000000001.log");
    // Sealed segments keep no descriptor open: the newest one's data and index files only.
    let open_here = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .filter(|p| p.starts_with(dir.path()))
        .count();
    assert!(log.segments.len() > 3 && open_here <= 2, "{open_here} open");
    // A read of a sealed segment to be sent opens its file again, shared by the answers using
    // it and closed after the last; its bytes there are the read's.
    let open_now = || {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
            .filter(|p| p.starts_with(dir.path()))
            .count()
    };
    let Read::Chunk { bundles, .. } = log.read(3, 500) else {
        panic!("a chunk")
    };
    let (a, b) = (bundles.share_for_send(), bundles.share_for_send());
    let (fa, at) = a.file.clone().expect("a file to send from");
    assert!(std::sync::Arc::ptr_eq(&fa, &b.file.clone().unwrap().0));
    let mut from_file = vec![0; a.bytes.len()];
    std::os::unix::fs::FileExt::read_exact_at(&*fa, &mut from_file, at).unwrap();
    assert_eq!(from_file, &a.bytes[..]);
    assert_eq!(open_now(), open_here + 1);
    drop((a, b, fa));
    assert_eq!(open_now(), open_here);
    // The files hold what was appended, and read back alike.
    let on_disk: u64 = files()
        .iter()
        .map(|f| {
            std::fs::metadata(dir.path().join("0").join(f))
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(on_disk, log.bytes());
    for seq in [1, 77, 200] {
        assert_eq!(log.read(seq, 500), in_memory.read(seq, 500));
    }
    // A shared chunk outlives its segment's deletion.
    let Read::Chunk { bundles, .. } = log.read(1, 500) else {
        panic!("a chunk")
    };
    let first = bundles.share();
    let dropped = log.enforce_retention(0);
    assert!(dropped > 0);
    assert_eq!(files().len(), log.segments.len());
    assert!(!files().contains(&"00000000000000000001.log".to_string()));
    assert_eq!(seqs(&first, 1)[0], 1);
    // An append taken back leaves the log and its files as they were.
    let mark = log.mark();
    let (before, names) = (log.next_seq(), files());
    for _ in 0..30 {
        append(&mut log, 2, 50, 20_000);
    }
    log.restore(mark);
    assert_eq!((log.next_seq(), files()), (before, names));
    assert_eq!(log.high_water_mark(), 200);
}

/// The settings of the logs `filled` makes: small segments, many index entries.
fn on_disk() -> LogConfig {
    LogConfig {
        segment_bytes: 1000,
        index_interval: 200,
        ..LogConfig::default()
    }
}

/// A log in `dir` of 100 bundles of 2 messages over segments of 1000 bytes; its reads of
/// every sequence number, to compare with after reopening.
fn filled(dir: &std::path::Path) -> (PartitionLog, Vec<Vec<u8>>) {
    let config = on_disk();
    let mut log = PartitionLog::in_dir(config, dir.to_path_buf());
    for i in 0..100u64 {
        append(&mut log, 2, 50, 10_000 + i);
    }
    let reads = (1..=200).map(|seq| chunk(&log, seq)).collect();
    (log, reads)
}

fn chunk(log: &PartitionLog, seq: u64) -> Vec<u8> {
    match log.read(seq, 300) {
        Read::Chunk { bundles, .. } => bundles.to_vec(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_log_reopened_from_its_files_reads_alike_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (log, reads) = filled(dir.path());
    let config = on_disk();
    let segments = log.segments.len();
    drop(log);
    let mut again = PartitionLog::open_dir(config, dir.path().to_path_buf()).unwrap();
    assert_eq!(again.segments.len(), segments);
    assert_eq!((again.first_available(), again.high_water_mark()), (1, 200));
    for seq in 1..=200 {
        assert_eq!(chunk(&again, seq), reads[seq as usize - 1], "{seq}");
    }
    assert_eq!(append(&mut again, 2, 50, 1), (201, 202));
    // A missing directory is an empty log.
    let none = PartitionLog::open_dir(config, dir.path().join("nothing")).unwrap();
    assert_eq!(none.next_seq(), 1);
}

#[test]
fn a_torn_tail_is_cut_and_damage_before_it_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (log, reads) = filled(dir.path());
    let config = on_disk();
    let newest = log.segments.back().unwrap().path.clone().unwrap();
    let oldest = log.segments.front().unwrap().path.clone().unwrap();
    let last_base = log.segments.back().unwrap().base_seq;
    drop(log);
    // Half a bundle written at the end: cut off, the rest kept.
    let len = std::fs::metadata(&newest).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&newest)
        .unwrap();
    std::io::Write::write_all(&mut &f, &[0x80, 0x01, 0x02]).unwrap();
    let again = PartitionLog::open_dir(config, dir.path().to_path_buf()).unwrap();
    assert_eq!(again.high_water_mark(), 200);
    assert_eq!(std::fs::metadata(&newest).unwrap().len(), len);
    assert_eq!(chunk(&again, last_base), reads[last_base as usize - 1]);
    drop(again);
    // An index whose entries do not fall on bundles is rebuilt from its segment.
    let index = newest.with_extension("index");
    let mut entries = std::fs::read(&index).unwrap();
    assert!(entries.len() >= 16, "at least two entries");
    let n = entries.len();
    entries[n - 4..].copy_from_slice(&7u32.to_le_bytes());
    std::fs::write(&index, &entries).unwrap();
    let again = PartitionLog::open_dir(config, dir.path().to_path_buf()).unwrap();
    assert_eq!(again.high_water_mark(), 200);
    for seq in last_base..=200 {
        assert_eq!(chunk(&again, seq), reads[seq as usize - 1]);
    }
    drop(again);
    // Damage in an older segment is refused, naming the file and offset.
    let mut bytes = std::fs::read(&oldest).unwrap();
    let cut = bytes.len() - 20;
    bytes.truncate(cut);
    std::fs::write(&oldest, &bytes).unwrap();
    std::fs::remove_file(oldest.with_extension("index")).unwrap();
    let e = PartitionLog::open_dir(config, dir.path().to_path_buf())
        .err()
        .expect("refused");
    assert!(
        e.contains(&oldest.display().to_string()) && e.contains("damaged at offset"),
        "{e}"
    );
}

#[test]
fn a_log_cut_back_keeps_whole_bundles_up_to_the_point_and_goes_on_from_there() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, reads) = filled(dir.path());
    // A reader holds a chunk from the part that goes: its bytes stay readable.
    let held = match log.read(151, 300) {
        Read::Chunk { bundles, .. } => bundles.share(),
        other => panic!("{other:?}"),
    };
    // 2 messages a bundle: keeping up to 120 keeps 1..=120; up to 131 cuts inside a bundle
    // (131, 132) and keeps 1..=130.
    assert_eq!(log.truncate_after(131).unwrap(), 130);
    assert_eq!(log.next_seq(), 131);
    assert_eq!(&held[..], &reads[150][..held.len()]);
    // What is kept reads as before (a chunk may have ended with a bundle now cut).
    for seq in 1..=130 {
        assert!(
            reads[seq as usize - 1].starts_with(&chunk(&log, seq)),
            "{seq}"
        );
    }
    assert!(matches!(log.read(131, 300), Read::Tail { .. }));
    // A message numbered again after the cut is placed where the cut one was.
    assert_eq!(append(&mut log, 2, 70, 1), (131, 132));
    let after = chunk(&log, 131);
    drop(log);
    let again = PartitionLog::open_dir(on_disk(), dir.path().to_path_buf()).unwrap();
    assert_eq!(again.high_water_mark(), 132);
    assert_eq!(chunk(&again, 131), after);
    assert!(reads[0].starts_with(&chunk(&again, 1)));
    // Cutting at or past the end changes nothing; cutting to 0 empties it.
    let mut again = again;
    assert_eq!(again.truncate_after(500).unwrap(), 132);
    assert_eq!(again.truncate_after(0).unwrap(), 0);
    assert_eq!(append(&mut again, 1, 10, 1), (1, 1));
}
