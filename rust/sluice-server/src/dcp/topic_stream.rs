//! A topic partition as a DCP stream: a producer switched to a topic (control `sluice_topic`)
//! streams each partition as the vbucket of its number, each message a mutation whose seqno is
//! its sequence number, its value the content and its CAS the producer's timestamp in
//! nanoseconds (milliseconds × 10⁶, as a Couchbase CAS counts time). DCP documents must have a
//! key: a keyed message carries its key with flags `KEYED`, one without (or with an empty one) its
//! sequence number in decimal with flags 0. A partition's failover log is its history
//! (`Topic::history`): one entry every node starts with, and one more each time a node comes to
//! lead it in a cluster. A stream request is rolled back by DCP's rule over it, so a copy that
//! holds messages its new leader never had is cut back to where the two part. Messages
//! retention dropped are skipped: the stream goes on from the oldest kept.

use std::sync::Arc;

use sluice_core::engine::TopicRead;
use sluice_core::failover::{rollback_point, ResumePoint};
use sluice_core::item::{ChangeOp, ItemMeta};
use sluice_core::topic::Topic;
use sluice_core::vbucket::VbState;
use sluice_core::Engine;
use sluice_proto::dcp::{
    snapshot_flag, stream_end_reason, stream_flag, FailoverLogEntry, StreamRequest,
};
use sluice_proto::tank::bundle::Bundle;
use sluice_proto::tank::response::chunk_bundles;

use crate::stream::{Encoding, Progress, StreamSink, StreamView};
use crate::topic_placement::{Lead, Placements};

/// The flags of a message that has a key of its own.
pub const KEYED: u32 = 1;

/// The largest message set a stored Snappy bundle may expand to.
const MAX_SET: usize = 256 << 20;

/// A partition's failover log as DCP sends it: its history, newest first.
pub fn failover_log(topic: &Topic, partition: u16) -> Vec<FailoverLogEntry> {
    topic
        .history(partition)
        .into_iter()
        .map(|e| FailoverLogEntry {
            vbucket_uuid: e.uuid,
            seqno: e.seqno,
        })
        .collect()
}

/// How a topic's partition shows as a vbucket here: a replica where this node copies it (from
/// its active, or in a cluster from its leader), active where it is produced to here, dead
/// where a cluster places it on other nodes only (readers such as Spark's go to its leader or
/// copies, as they go to a vbucket's active or replicas).
pub fn partition_state(topic: &Topic, partition: u16, placements: &Placements) -> VbState {
    if topic.is_followed() {
        return VbState::Replica;
    }
    let placed = placements.placed(&topic.name, partition);
    match placed.lead {
        Lead::Here => VbState::Active,
        _ if placed.copy_here => VbState::Replica,
        _ => VbState::Dead,
    }
}

/// GET_ALL_VB_SEQNOS of a topic: its partitions in the state asked for (active when none is)
/// with their high-water marks.
pub fn all_seqnos(
    topic: &Topic,
    extras: &[u8],
    placements: &Placements,
) -> Result<Vec<u8>, &'static str> {
    let wanted = crate::kv::wanted_state(extras)?;
    let mut value = Vec::new();
    for p in 0..topic.num_partitions() {
        if partition_state(topic, p, placements) == wanted {
            value.extend_from_slice(&p.to_be_bytes());
            value.extend_from_slice(&topic.high_water_mark(p).to_be_bytes());
        }
    }
    Ok(value)
}

/// Why a stream request for a partition is not opened: the answer's status and message, or a
/// rollback to this sequence number.
pub enum Refused {
    Status(u16, String),
    Rollback(u64),
}

pub struct TopicStream {
    pub partition: u16,
    pub opaque: u32,
    topic: Arc<Topic>,
    /// The next sequence number to send.
    next_seq: u64,
    end_seqno: u64,
    encoding: Encoding,
    /// A bundle the last read found appended but not yet in the WAL file: its LSN, which
    /// wakes the stream when written.
    pub unwritten_lsn: Option<u64>,
    /// Messages sent, for the producer's counters.
    pub sent: u64,
    chunk: Vec<u8>,
    set: Vec<u8>,
    /// The replica whose SEQNO_ACKNOWLEDGED count toward produces asking for acks (a cluster
    /// node copying a partition this node leads); its acks stop counting when the stream goes.
    acks_as: Option<String>,
}

impl Drop for TopicStream {
    fn drop(&mut self) {
        if let Some(name) = self.acks_as.take() {
            self.topic.acks.detach(self.partition, &name);
        }
    }
}

impl TopicStream {
    /// Opens a stream of `partition` as a STREAM_REQ asks (start and end seqnos, FROM_LATEST,
    /// TO_LATEST); a start on a branch of history the partition left, or past its end, is
    /// rolled back to where they part (DCP's rollback rule over `Topic::history`).
    pub fn open(
        topic: Arc<Topic>,
        sr: &StreamRequest,
        opaque: u32,
        encoding: Encoding,
    ) -> Result<TopicStream, Refused> {
        let hwm = match topic.lock_partition(sr.vbucket) {
            Some(p) => p.log.high_water_mark(),
            None => {
                return Err(Refused::Status(
                    sluice_proto::mcbp::status::NOT_MY_VBUCKET,
                    format!("topic {:?} has no partition {}", topic.name, sr.vbucket),
                ))
            }
        };
        let mut start = sr.start_seqno;
        let mut end = sr.end_seqno;
        if sr.flags & stream_flag::FROM_LATEST != 0 {
            start = hwm;
        }
        if sr.flags & (stream_flag::TO_LATEST | stream_flag::DISK_ONLY) != 0 {
            end = hwm;
        }
        if start > end {
            return Err(Refused::Status(
                sluice_proto::mcbp::status::ERANGE,
                format!("start seqno {start} is past end seqno {end}"),
            ));
        }
        // A reader that names no branch (uuid 0) reads by sequence number alone, as TANK's and
        // Kafka's consumers do.
        if sr.flags & stream_flag::FROM_LATEST == 0 && sr.vbucket_uuid != 0 {
            let at = ResumePoint {
                start_seqno: start,
                vbucket_uuid: sr.vbucket_uuid,
                snap_start_seqno: sr.snap_start_seqno.min(start),
                snap_end_seqno: sr.snap_end_seqno.max(start),
            };
            // Retention purges no tombstones: there are none in a log.
            if let Some(seqno) = rollback_point(&topic.history(sr.vbucket), hwm, 0, at, true) {
                return Err(Refused::Rollback(seqno));
            }
        }
        if start > hwm {
            return Err(Refused::Rollback(hwm));
        }
        Ok(TopicStream {
            partition: sr.vbucket,
            opaque,
            topic,
            next_seq: start + 1,
            end_seqno: end,
            encoding,
            unwritten_lsn: None,
            sent: 0,
            chunk: Vec::new(),
            set: Vec::new(),
            acks_as: None,
        })
    }

    /// Counts the acknowledgements of replica `name` for this partition from now on.
    pub fn count_acks_as(&mut self, name: &str) {
        self.topic.acks.attach(self.partition, name);
        self.acks_as = Some(name.to_string());
    }

    /// A replica's acknowledgement of everything up to `seq`: never past what was sent.
    pub fn acknowledged(&self, seq: u64) -> Result<(), &'static str> {
        let Some(name) = &self.acks_as else {
            return Err(
                "this partition's stream is not a replica's (it opened before the \
                        controls consumer_name and enable_sync_writes)",
            );
        };
        let sent = self.next_seq.saturating_sub(1);
        self.topic
            .acks
            .ack(self.partition, name, seq.min(sent), None);
        Ok(())
    }

    pub fn view(&self) -> StreamView {
        StreamView {
            vbucket: self.partition,
            opaque: self.opaque,
            encoding: self.encoding,
        }
    }

    pub fn topic(&self) -> &Arc<Topic> {
        &self.topic
    }

    /// Writes the next chunk of the partition (about `budget` bytes of bundles, one bundle at
    /// least) as a snapshot: a marker, then its messages.
    pub fn fill(
        &mut self,
        engine: &Engine,
        out: &mut impl StreamSink,
        budget: usize,
    ) -> (usize, Progress) {
        let view = self.view();
        if self.next_seq > self.end_seqno {
            let n = out.end(&view, stream_end_reason::OK);
            return (n, Progress::Ended(stream_end_reason::OK));
        }
        self.unwritten_lsn = None;
        if sluice_core::errinj::TOPIC_STREAMS_HELD.get() != 0 {
            // Woken again by the partition's next produce.
            return (0, Progress::Idle);
        }
        self.chunk.clear();
        let fetch = budget.clamp(1, u32::MAX as usize) as u32;
        let read = engine.read_topic(
            &self.topic,
            self.partition,
            self.next_seq,
            fetch,
            &mut self.chunk,
        );
        let base_seq = match read {
            Ok(TopicRead::Chunk { base_seq, .. }) => base_seq,
            Ok(TopicRead::Tail { unwritten_lsn, .. }) => {
                self.unwritten_lsn = unwritten_lsn;
                return (0, Progress::Idle);
            }
            Ok(TopicRead::OutOfRange {
                first_available, ..
            }) if first_available > self.next_seq => {
                // Retention dropped them: from the oldest kept.
                self.next_seq = first_available;
                return (0, Progress::Sent);
            }
            Ok(TopicRead::OutOfRange { .. }) | Err(_) => return (0, Progress::Idle),
        };
        let bundles = chunk_bundles(&self.chunk);
        // The snapshot's end from the bundles' headers, before any is decompressed.
        let mut last = base_seq;
        let mut next = base_seq;
        for b in &bundles {
            let parsed = Bundle::parse(b).expect("stored bundles were checked");
            let first = parsed.sparse.map_or(next, |(first, _)| first);
            last = first + parsed.span() - 1;
            next = last + 1;
        }
        let (from, to) = (self.next_seq, last.min(self.end_seqno));
        let mut n = out.marker(&view, from, to, snapshot_flag::MEMORY, None);
        let mut next = base_seq;
        'bundles: for b in &bundles {
            let parsed = Bundle::parse(b).expect("stored bundles were checked");
            if parsed.decompress_into(&mut self.set, MAX_SET).is_err() {
                log::error!(
                    "topic {:?} partition {}: a stored bundle does not decompress",
                    self.topic.name,
                    self.partition
                );
                break;
            }
            for m in parsed.messages(&self.set, next) {
                let Ok(m) = m else { break 'bundles };
                next = m.seq + 1;
                if m.seq < from {
                    continue;
                }
                if m.seq > to {
                    break 'bundles;
                }
                let meta = ItemMeta {
                    cas: m.ts.saturating_mul(1_000_000),
                    rev_seqno: 1,
                    by_seqno: m.seq,
                    flags: if m.key.is_some_and(|k| !k.is_empty()) {
                        KEYED
                    } else {
                        0
                    },
                    ..ItemMeta::default()
                };
                let mut digits = [0u8; 20];
                let key = match m.key {
                    Some(k) if !k.is_empty() => k,
                    _ => decimal(m.seq, &mut digits),
                };
                n += out.document(&view, ChangeOp::Mutation, key, m.content, &meta, false);
                self.sent += 1;
            }
        }
        self.next_seq = to + 1;
        if self.next_seq > self.end_seqno {
            n += out.end(&view, stream_end_reason::OK);
            return (n, Progress::Ended(stream_end_reason::OK));
        }
        (n, Progress::Sent)
    }
}

/// `n` in decimal, written into `buf`.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}
