//! The stream engine in-process, through a sink that records what it is given: what DCP and
//! TAP connections encode, without a socket or a protocol.

use std::sync::Arc;
use std::time::Duration;

use sluice_core::bucket::Bucket;
use sluice_core::wal::WalMode;
use sluice_core::{BucketConfig, Engine, EngineConfig, StoreRequest};

use super::*;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Marker {
        start: u64,
        end: u64,
        flags: u32,
    },
    Document {
        op: ChangeOp,
        key: Vec<u8>,
        seqno: u64,
    },
    BackfillEnd,
    End(u32),
}

#[derive(Default)]
struct Recording(Vec<Event>);

impl StreamSink for Recording {
    fn marker(
        &mut self,
        _: &StreamView,
        start: u64,
        end: u64,
        flags: u32,
        _: Option<u64>,
    ) -> usize {
        self.0.push(Event::Marker { start, end, flags });
        1
    }
    fn document(
        &mut self,
        _: &StreamView,
        op: ChangeOp,
        key: &[u8],
        _: &[u8],
        meta: &ItemMeta,
        _: bool,
    ) -> usize {
        self.0.push(Event::Document {
            op,
            key: key.to_vec(),
            seqno: meta.by_seqno,
        });
        1
    }
    fn backfill_end(&mut self, _: &StreamView) -> usize {
        self.0.push(Event::BackfillEnd);
        1
    }
    fn end(&mut self, _: &StreamView, reason: u32) -> usize {
        self.0.push(Event::End(reason));
        1
    }
    fn vbucket_state(&mut self, _: &StreamView, _: u8) -> usize {
        1
    }
}

/// An engine of one vbucket (every key in vbucket 0), logging nothing.
fn engine(dir: &std::path::Path) -> (Engine, Arc<Bucket>) {
    let mut b = BucketConfig::named("default");
    b.num_vbuckets = 1;
    let engine = Engine::open(EngineConfig {
        data_dir: dir.to_path_buf(),
        wal_mode: WalMode::None,
        snapshot_interval: Duration::ZERO,
        buckets: vec![b],
        ..Default::default()
    })
    .expect("engine");
    let bucket = engine.bucket("default").expect("default bucket");
    (engine, bucket)
}

fn set(engine: &Engine, bucket: &Bucket, key: &str) {
    engine
        .store(bucket, &StoreRequest::set(key.as_bytes(), b"v"))
        .expect("set");
}

fn open(engine: &Engine, bucket: &Arc<Bucket>, start: u64, end: u64) -> Stream {
    Stream::open(
        engine,
        bucket.clone(),
        0,
        7,
        "test",
        start,
        end,
        Encoding::default(),
        false,
        &engine.stream_position(bucket, 0).expect("vbucket 0"),
    )
    .expect("stream")
}

/// Fills until the stream is idle or ended, at most `rounds` times.
fn drain(engine: &Engine, s: &mut Stream, sink: &mut Recording, rounds: usize) -> Progress {
    let mut last = Progress::Idle;
    for _ in 0..rounds {
        last = s.fill(engine, sink, 1 << 20).1;
        if last != Progress::Sent {
            break;
        }
    }
    last
}

fn documents(events: &[Event]) -> Vec<(Vec<u8>, u64)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Document { key, seqno, .. } => Some((key.clone(), *seqno)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_bounded_stream_sends_its_range_in_snapshots_then_ends() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, bucket) = engine(dir.path());
    for k in ["a", "b", "c", "d"] {
        set(&engine, &bucket, k);
    }
    let mut s = open(&engine, &bucket, 0, 4);
    let mut sink = Recording::default();
    assert_eq!(
        drain(&engine, &mut s, &mut sink, 16),
        Progress::Ended(stream_end_reason::OK)
    );
    assert!(
        matches!(sink.0[0], Event::Marker { end: 4, .. }),
        "{:?}",
        sink.0
    );
    let docs = documents(&sink.0);
    let keys: Vec<&[u8]> = docs.iter().map(|(k, _)| k.as_slice()).collect();
    assert_eq!(keys, [b"a", b"b", b"c", b"d"]);
    assert_eq!(docs.iter().map(|d| d.1).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(sink.0.last(), Some(&Event::End(stream_end_reason::OK)));
    assert_eq!(s.last_sent_seqno(), 4);
}

#[test]
fn an_open_ended_stream_goes_idle_then_follows_new_writes_in_a_new_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, bucket) = engine(dir.path());
    set(&engine, &bucket, "a");
    set(&engine, &bucket, "b");
    let mut s = open(&engine, &bucket, 0, u64::MAX);
    let mut sink = Recording::default();
    assert_eq!(drain(&engine, &mut s, &mut sink, 16), Progress::Idle);
    assert_eq!(documents(&sink.0).len(), 2);
    let first_markers = sink
        .0
        .iter()
        .filter(|e| matches!(e, Event::Marker { .. }))
        .count();
    set(&engine, &bucket, "c");
    set(&engine, &bucket, "a");
    assert_eq!(drain(&engine, &mut s, &mut sink, 16), Progress::Idle);
    let docs = documents(&sink.0);
    // No gap, no duplicate: seqnos rise by one from the first change to the last.
    assert_eq!(docs.iter().map(|d| d.1).collect::<Vec<_>>(), [1, 2, 3, 4]);
    let markers: Vec<&Event> = sink
        .0
        .iter()
        .filter(|e| matches!(e, Event::Marker { .. }))
        .collect();
    assert!(
        markers.len() > first_markers,
        "the new writes come in a snapshot of their own"
    );
    assert!(
        matches!(markers.last(), Some(Event::Marker { end: 4, flags, .. }) if flags & snapshot_flag::MEMORY != 0)
    );
}

#[test]
fn a_stream_ends_with_state_changed_when_its_vbucket_stops_being_active() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, bucket) = engine(dir.path());
    set(&engine, &bucket, "a");
    let mut s = open(&engine, &bucket, 0, u64::MAX);
    let mut sink = Recording::default();
    assert_eq!(drain(&engine, &mut s, &mut sink, 16), Progress::Idle);
    engine
        .set_vbucket_state(&bucket, 0, VbState::Replica)
        .expect("state");
    assert_eq!(
        drain(&engine, &mut s, &mut sink, 16),
        Progress::Ended(stream_end_reason::STATE_CHANGED)
    );
    assert_eq!(
        sink.0.last(),
        Some(&Event::End(stream_end_reason::STATE_CHANGED))
    );
}

#[test]
fn a_stream_ends_with_rollback_when_its_vbucket_starts_a_new_history() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, bucket) = engine(dir.path());
    set(&engine, &bucket, "a");
    set(&engine, &bucket, "b");
    let mut s = open(&engine, &bucket, 0, u64::MAX);
    let mut sink = Recording::default();
    assert_eq!(drain(&engine, &mut s, &mut sink, 16), Progress::Idle);
    assert_eq!(engine.restart_history(&bucket).expect("restart"), [0]);
    set(&engine, &bucket, "c");
    assert_eq!(
        drain(&engine, &mut s, &mut sink, 16),
        Progress::Ended(stream_end_reason::ROLLBACK)
    );
    // Nothing of the new history reached the old stream, and no deletion of the old one.
    assert_eq!(documents(&sink.0).len(), 2);
    assert_eq!(
        sink.0.last(),
        Some(&Event::End(stream_end_reason::ROLLBACK))
    );
    // A stream opened on the new history sends it: the new write only, at a higher seqno.
    let mut fresh = open(&engine, &bucket, 0, u64::MAX);
    let mut sink = Recording::default();
    assert_eq!(drain(&engine, &mut fresh, &mut sink, 16), Progress::Idle);
    assert_eq!(documents(&sink.0), [(b"c".to_vec(), 3)]);
}
