//! Damage to a WAL segment, at a random byte: a truncation of a segment being written (as a
//! crash leaves it), or a flipped bit in a cleanly closed one. Recovery must either succeed with
//! exactly a prefix of the acknowledged writes that includes every write in a block before the
//! damage, or (for damage that is not a torn write) refuse with the file and the byte offset of
//! the damaged block. Nothing that was never written may appear.

mod common;

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use sluice_core::wal::WalMode;
use sluice_core::{Durability, Engine, Error, StoreRequest};

const WRITES: usize = 24;

struct Fixture {
    _dir: tempfile::TempDir,
    data: PathBuf,
    writes: Vec<(Vec<u8>, Vec<u8>)>,
    /// The block each write sits in, found by its key's bytes in the file.
    block_of: Vec<usize>,
}

fn segment(dir: &Path) -> PathBuf {
    let mut segs: Vec<_> = std::fs::read_dir(dir.join("wal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segs.sort();
    assert_eq!(segs.len(), 1, "one segment expected: {segs:?}");
    segs.pop().unwrap()
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let engine = Engine::open(common::config(&data, WalMode::Write, 4)).unwrap();
    let bucket = engine.bucket("default").unwrap();
    let mut writes = Vec::new();
    for i in 0..WRITES {
        let k = format!("k{i:03}").into_bytes();
        let v = vec![b'a' + (i % 26) as u8; 1 + (i * 397) % 3000];
        let mut req = StoreRequest::set(&k, &v);
        req.durability = Some(Durability::Persist.into());
        engine.store(&bucket, &req).unwrap();
        writes.push((k, v));
    }
    engine.close();
    let bytes = std::fs::read(segment(&data)).unwrap();
    let (_, blocks, _) = layout(&bytes);
    let block_of = writes
        .iter()
        .map(|(k, _)| {
            let at = bytes
                .windows(k.len())
                .position(|w| w == &k[..])
                .expect("key in the WAL");
            blocks.iter().rposition(|&b| b <= at).unwrap()
        })
        .collect();
    Fixture {
        _dir: dir,
        data,
        writes,
        block_of,
    }
}

/// (header length, block start offsets, offset of the EOF marker).
fn layout(bytes: &[u8]) -> (usize, Vec<usize>, usize) {
    let header = bytes.windows(2).position(|w| w == b"\n\n").unwrap() + 2;
    let mut blocks = Vec::new();
    let mut at = header;
    while u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) == 0xd5ba_0bab {
        blocks.push(at);
        at += 12 + u32::from_be_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
    }
    (header, blocks, at)
}

fn copy_dir(from: &Path, to: &Path) {
    for sub in ["wal", "snap"] {
        std::fs::create_dir_all(to.join(sub)).unwrap();
        for e in std::fs::read_dir(from.join(sub)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(sub).join(e.file_name())).unwrap();
        }
    }
}

#[derive(Debug, Clone)]
enum Damage {
    Truncate(f64),
    Flip(f64, u8),
    /// A bit in the 12-byte header of a block chosen by the fraction.
    FlipBlockHeader(f64, u8, u8),
}

fn check(fx: &Fixture, damage: Damage, force: bool) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fx.data, dir.path());
    let mut seg = segment(dir.path());
    if let Damage::Truncate(_) = damage {
        // A write cut short happens only in a segment still being written: as a crash leaves it.
        let open = seg.with_extension("xlog.inprogress");
        std::fs::rename(&seg, &open).unwrap();
        seg = open;
    }
    let mut bytes = std::fs::read(&seg).unwrap();
    let (header, blocks, eof_at) = layout(&bytes);
    let pos = match damage {
        Damage::Truncate(f) => {
            let pos = ((bytes.len() as f64) * f) as usize;
            bytes.truncate(pos);
            pos
        }
        Damage::Flip(f, bit) => {
            let pos = (((bytes.len() - 1) as f64) * f) as usize;
            bytes[pos] ^= 1 << (bit % 8);
            pos
        }
        Damage::FlipBlockHeader(f, byte, bit) => {
            let pos =
                blocks[((blocks.len() as f64) * f) as usize % blocks.len()] + (byte % 12) as usize;
            bytes[pos] ^= 1 << (bit % 8);
            pos
        }
    };
    std::fs::write(&seg, &bytes).unwrap();
    // The block holding the damage (None: header or EOF marker).
    let damaged_block = blocks
        .iter()
        .rposition(|&b| b <= pos)
        .filter(|_| pos >= header && pos < eof_at);
    let block_of = &fx.block_of;
    // Writes wholly in blocks before the damage must survive any verdict but an error.
    let must_survive = match damaged_block {
        Some(b) => block_of.iter().filter(|&&wb| wb < b).count(),
        None if pos < header => 0,
        None => WRITES,
    };
    let mut cfg = common::config(dir.path(), WalMode::Write, 4);
    cfg.force_recovery = force;
    match Engine::open(cfg) {
        Ok(engine) => {
            let bucket = engine.bucket("default").unwrap();
            let live = common::live(&engine, &bucket);
            for (key, val) in &live {
                let w = fx.writes.iter().find(|w| &w.0 == key);
                prop_assert!(
                    w.is_some_and(|w| &w.1 == val),
                    "an unwritten key or value appeared"
                );
            }
            let present: Vec<bool> = fx.writes.iter().map(|w| live.contains_key(&w.0)).collect();
            let flipped = !matches!(damage, Damage::Truncate(_));
            if force && flipped && pos >= header && damaged_block.is_some_and(|b| b > 0) {
                // Salvage: everything outside the damaged block is back. (Block 0 declares the
                // bucket; without it nothing after can be placed, so it is not held to this.)
                for (i, p) in present.iter().enumerate() {
                    prop_assert!(
                        *p || Some(block_of[i]) == damaged_block,
                        "{damage:?}: write {i} outside the damaged block lost"
                    );
                }
            } else if !(force && pos < header) {
                // A torn tail: a prefix of the writes, at least those before the damage.
                let k = present.iter().take_while(|p| **p).count();
                prop_assert!(
                    present[k..].iter().all(|p| !p),
                    "{damage:?}: not a prefix: {present:?}"
                );
                prop_assert!(
                    k >= must_survive,
                    "{damage:?} at {pos}: {k} writes recovered, {must_survive} must survive"
                );
            }
            // Only a segment being written can have a torn tail: a flip in a closed one, even in
            // its EOF marker, is damage.
            let is_tail = !flipped;
            prop_assert!(
                force || is_tail,
                "damage at {pos} in block {damaged_block:?} of {} was recovered from silently",
                blocks.len()
            );
            engine.close();
        }
        Err(Error::Corrupt {
            file,
            offset,
            reason,
        }) => {
            prop_assert!(!force, "force recovery must not fail: {reason}");
            prop_assert_eq!(file.file_name(), seg.file_name());
            let expected = match damaged_block {
                Some(b) => blocks[b] as u64,
                None if pos < header => 0,
                None => eof_at as u64,
            };
            prop_assert_eq!(
                offset,
                expected,
                "{:?} at {}: reported at {} ({})",
                damage,
                pos,
                offset,
                reason
            );
        }
        Err(e) => prop_assert!(false, "unexpected error {e}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    #[test]
    fn damage_is_truncated_or_reported(f in 0.0f64..1.0, bit in any::<u8>(), byte in any::<u8>(), kind in 0..3, force in proptest::bool::weighted(0.15)) {
        thread_local!(static FX: Fixture = fixture());
        let damage = match kind {
            0 => Damage::Truncate(f),
            1 => Damage::Flip(f, bit),
            _ => Damage::FlipBlockHeader(f, byte, bit),
        };
        FX.with(|fx| check(fx, damage, force))?;
    }
}

#[test]
fn every_bit_of_a_middle_block_header_is_reported() {
    let fx = fixture();
    let bytes = std::fs::read(segment(&fx.data)).unwrap();
    let (_, blocks, _) = layout(&bytes);
    let middle = blocks.len() / 2;
    for byte in 0..12u8 {
        for bit in 0..8u8 {
            let f = (middle as f64 + 0.5) / blocks.len() as f64;
            check(&fx, Damage::FlipBlockHeader(f, byte, bit), false).unwrap();
        }
    }
}

#[test]
fn every_truncation_point_of_the_last_blocks_recovers_a_prefix() {
    let fx = fixture();
    let bytes = std::fs::read(segment(&fx.data)).unwrap();
    let (_, blocks, _) = layout(&bytes);
    let from = blocks[blocks.len() - 3];
    for cut in from..bytes.len() {
        check(
            &fx,
            Damage::Truncate(cut as f64 / bytes.len() as f64 + 1e-12),
            false,
        )
        .unwrap();
    }
}

/// A kill between starting the next segment and closing the current one leaves the current one
/// without its EOF marker, followed by a segment holding only its header (or part of it).
#[test]
fn a_crash_during_segment_rotation_recovers_everything() {
    use sluice_core::wal::xlog::{FileHeader, FileKind};
    for cut in [None, Some(10usize)] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = common::config(dir.path(), WalMode::Write, 4);
        let engine = Engine::open(cfg.clone()).unwrap();
        let bucket = engine.bucket("default").unwrap();
        for i in 0..100 {
            engine
                .store(
                    &bucket,
                    &StoreRequest::set(format!("k{i}").as_bytes(), b"v"),
                )
                .unwrap();
        }
        let next = engine.wal().last_lsn() + 1;
        let instance = engine.instance().to_string();
        engine.crash();
        drop(engine);
        let mut head = Vec::new();
        FileHeader {
            kind: FileKind::Xlog,
            instance,
            lsn: next,
        }
        .encode(&mut head);
        if let Some(n) = cut {
            head.truncate(n);
        }
        std::fs::write(
            dir.path()
                .join("wal")
                .join(format!("{next:020}.xlog.inprogress")),
            &head,
        )
        .unwrap();
        let engine = Engine::open(cfg).unwrap();
        let bucket = engine.bucket("default").unwrap();
        assert_eq!(common::live(&engine, &bucket).len(), 100, "cut {cut:?}");
        assert!(engine.recovery_report().unclean_shutdown);
        engine.close();
    }
}
