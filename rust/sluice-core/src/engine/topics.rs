//! Topics (`crate::topic`): created once and logged, produced to as changes are (the bundle in
//! the WAL before the producer is answered, under the same `wal.mode`), read from their
//! partitions' logs, trimmed by retention.

use std::sync::Arc;

use super::{Engine, Inner, Written};
use crate::config::Durability;
use crate::error::{Error, Result};
use crate::failover::{FailoverEntry, FailoverLog};
use crate::partition_log::{AppendError, ChunkSink, LogConfig, PartitionLog, Read};
use crate::recovery::RecoveredTopic;
use crate::topic::{Partition, Topic};
use crate::wal::writer::{MetaRecord, WalPayload};
use crate::wal::WalMode;

/// What a read from a partition found; a chunk's bundles went to the caller's `ChunkSink`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicRead {
    Chunk {
        base_seq: u64,
        high_water_mark: u64,
        len: usize,
    },
    /// Nothing past `high_water_mark` yet; or appended but not yet in the WAL file, until
    /// it holds `unwritten_lsn` (what a waiting reader can wait for).
    Tail {
        high_water_mark: u64,
        first_available: u64,
        unwritten_lsn: Option<u64>,
    },
    OutOfRange {
        high_water_mark: u64,
        first_available: u64,
    },
}

impl Engine {
    pub fn topics(&self) -> Vec<Arc<Topic>> {
        self.inner.catalog.topics()
    }

    pub fn topic(&self, name: &str) -> Option<Arc<Topic>> {
        self.inner.catalog.topic(name)
    }

    /// `write_topic`, returning once the WAL holds the declaration.
    pub fn create_topic(
        &self,
        name: &str,
        partitions: u16,
        config_text: &str,
    ) -> Result<Arc<Topic>> {
        let w = self.write_topic(name, partitions, config_text)?;
        self.wait_written(w)
    }

    /// Creates a topic of `partitions` partitions with the settings of `config_text`
    /// (`LogConfig::from_text`, kept as given) and queues its declaration; Exists when a topic
    /// has the name. Whoever answers for it waits for the `Written` first.
    pub fn write_topic(
        &self,
        name: &str,
        partitions: u16,
        config_text: &str,
    ) -> Result<Written<Arc<Topic>>> {
        self.check_open()?;
        let config = LogConfig::from_text(config_text)
            .map_err(|e| Error::InvalidArgument(format!("topic {name:?}: {e}")))?;
        if name.is_empty() || name.len() > u8::MAX as usize || partitions == 0 {
            return Err(Error::InvalidArgument(format!(
                "a topic needs a name of 1 to 255 bytes and one partition or more \
                 ({:?}, {partitions})",
                name
            )));
        }
        let (topic, lsn) = self.inner.catalog.with_topics(|topics| {
            if topics.iter().any(|t| t.name == name) {
                return Err(Error::Exists);
            }
            let id = (0..=u16::MAX)
                .find(|i| !topics.iter().any(|t| t.id == *i))
                .ok_or_else(|| Error::InvalidArgument("no topic id left".into()))?;
            let lsn = self.inner.wal.appender()?.push(WalPayload::meta(
                id,
                0,
                MetaRecord::Topic {
                    name: name.to_string(),
                    partitions,
                    config: config_text.to_string(),
                },
            ));
            let topics_dir = self.inner.topics_dir();
            let parts = (0..partitions)
                .map(|p| {
                    let dir = crate::topic::partition_dir(&topics_dir, id, p);
                    Partition::new(PartitionLog::in_dir(config, dir), lsn)
                })
                .collect();
            let t = Arc::new(Topic::new(
                id,
                name.to_string(),
                config_text.to_string(),
                config,
                parts,
            ));
            topics.push(t.clone());
            Ok((t, lsn))
        })?;
        log::info!("topic {name:?} created with {partitions} partition(s)");
        Ok(Written::new(topic, Durability::None.into(), lsn, &[]))
    }

    /// Appends a bundle (as produced, without its length) to a partition and queues its WAL
    /// record; the producer is answered once `Written` is (`wait_written`). `first_seq`
    /// places it (ProduceWithSeqnum, and a sparse bundle by its own header, which must agree)
    /// at or past the log's end; otherwise it goes at the end. Returns the first and last
    /// sequence numbers it takes.
    pub fn produce(
        &self,
        topic: &Topic,
        partition: u16,
        first_seq: Option<u64>,
        bundle: bytes::Bytes,
    ) -> Result<Written<(u64, u64)>> {
        self.check_open()?;
        if let Some(refused) = self.wal_refusal() {
            return Err(refused);
        }
        let bad =
            |why: String| Error::InvalidArgument(format!("a bundle for {:?}: {why}", topic.name));
        let mut checked = PartitionLog::check(&bundle).map_err(|e| bad(e.to_string()))?;
        match (first_seq, checked.first) {
            (Some(asked), Some(own)) if asked != own => {
                return Err(bad(format!(
                    "placed at {asked}, though it numbers its first message {own}"
                )))
            }
            (Some(0), None) => return Err(bad("placed at sequence number 0".into())),
            (Some(asked), None) => checked.first = Some(asked),
            _ => {}
        }
        let mut part = topic.lock_partition(partition).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "topic {:?} has no partition {partition}",
                topic.name
            ))
        })?;
        let first_seq = checked.first.unwrap_or(part.log.next_seq());
        if first_seq < part.log.next_seq()
            || first_seq
                .checked_add(checked.span)
                .is_none_or(|n| n == u64::MAX)
        {
            return Err(bad(format!(
                "placed at {first_seq}, behind the partition's next sequence number {}",
                part.log.next_seq()
            )));
        }
        // Age retention goes by arrival, as TANK's broker goes by its segments' times.
        let now_ms = crate::hlc::now_nanos() / 1_000_000;
        // The segment file first: one that cannot take it (a full disk) refuses the produce
        // at once, and a WAL that refuses takes the append back.
        checked.first = Some(first_seq);
        let mark = part.log.mark();
        let seqs = part
            .log
            .append(&bundle, &checked, now_ms)
            .map_err(|e| match e {
                AppendError::Storage(_) => Error::TempFail(format!(
                    "topic {:?} partition {partition}: {e}; retry later",
                    topic.name
                )),
                other => bad(other.to_string()),
            })?;
        // Synced with the WAL from here on: a record synced never points at bytes that are not.
        if let Some(f) = part.log.newest_file() {
            self.inner.wal.sync_with(f);
        }
        let (segment, offset) = part.log.last_position(bundle.len());
        let lsn = match self.inner.wal.appender() {
            // The segment file holds the bundle; the record points at it.
            Ok(mut wal) => wal.push(WalPayload::meta(
                topic.id,
                partition,
                MetaRecord::TopicAppended {
                    first_seq,
                    count: checked.span,
                    newest_ms: now_ms,
                    segment,
                    offset,
                    len: bundle.len() as u32,
                    crc: crc32c::crc32c(&bundle),
                },
            )),
            Err(e) => {
                part.log.restore(mark);
                return Err(e);
            }
        };
        part.last_lsn = lsn;
        part.produced_messages += checked.count;
        part.produced_bytes += bundle.len() as u64;
        if self.inner.wal.mode() != WalMode::None {
            part.unwritten.push_back((seqs.0, lsn));
        }
        drop(part);
        topic.changes.notify();
        Ok(Written::new(seqs, Durability::None.into(), lsn, &[]))
    }

    /// Waits until the WAL holds `w`'s record (what a producer is answered after).
    pub fn wait_written<T>(&self, w: Written<T>) -> Result<T> {
        self.inner.wal.wait_written(w.lsn(), None)?;
        Ok(w.value)
    }

    /// Reads a partition from `seq` (`PartitionLog::read`), putting a chunk's stored bundles
    /// in `out` (a copy into a buffer, or shared as they are: `ChunkSink`). Bundles the WAL file does not hold yet are not read: a reader never sees a
    /// message that a crash could take back and number again.
    pub fn read_topic(
        &self,
        topic: &Topic,
        partition: u16,
        seq: u64,
        fetch_size: u32,
        out: &mut impl ChunkSink,
    ) -> Result<TopicRead> {
        let mut part = topic.lock_partition(partition).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "topic {:?} has no partition {partition}",
                topic.name
            ))
        })?;
        let (visible, unwritten_lsn) = part.visible(self.inner.wal.written_lsn());
        let part = &mut *part;
        Ok(match part.log.read_visible(seq, fetch_size, visible) {
            Read::Chunk {
                base_seq,
                high_water_mark,
                bundles,
            } => {
                let len = bundles.len();
                out.put(bundles);
                part.consumed_bytes += len as u64;
                TopicRead::Chunk {
                    base_seq,
                    high_water_mark,
                    len,
                }
            }
            Read::Tail {
                high_water_mark,
                first_available,
            } => TopicRead::Tail {
                high_water_mark,
                first_available,
                unwritten_lsn,
            },
            Read::OutOfRange {
                high_water_mark,
                first_available,
            } => TopicRead::OutOfRange {
                high_water_mark,
                first_available,
            },
        })
    }

    /// Starts a branch of partition `p`'s history at its end: this node leads it from now on
    /// (a new leader's first act, as a promoted vbucket adds a failover entry). A copy that
    /// held more than this under an older branch is cut back to here when it asks to follow.
    pub fn start_topic_branch(&self, topic: &Topic, p: u16) -> Result<FailoverEntry> {
        let base = topic.base_entry();
        let mut part = self.partition(topic, p)?;
        let mut history = part.history.clone();
        if history.entries().is_empty() {
            history.push(base);
        }
        let e = history.create_entry(part.log.high_water_mark());
        part.set_history(history)
            .map_err(|e| history_error(topic, p, e))?;
        // Logged without the partition's lock: a log line may wait for the embedding
        // interpreter, whose threads may wait for this lock.
        drop(part);
        log::info!(
            "topic {:?} partition {p}: led here from sequence number {} (history {:#x})",
            topic.name,
            e.seqno,
            e.uuid
        );
        Ok(e)
    }

    /// Takes `entries` (newest first) as partition `p`'s history: a copy's, from its leader,
    /// so that it knows the leader's branches if it comes to lead or to follow another.
    /// Refused (false) when this partition's newest branch is one `entries` lacks and starts
    /// no earlier than their newest: a branch this node started as leader after that history
    /// was sent (a copy of the old leader still placing its last batch), which it must keep.
    pub fn adopt_topic_history(
        &self,
        topic: &Topic,
        p: u16,
        entries: &[FailoverEntry],
    ) -> Result<bool> {
        let mut part = self.partition(topic, p)?;
        if part.history.entries() == entries {
            return Ok(true);
        }
        if let (Some(own), Some(theirs)) = (part.history.latest(), entries.first()) {
            if !entries.iter().any(|e| e.uuid == own.uuid) && own.seqno >= theirs.seqno {
                return Ok(false);
            }
        }
        let mut history = FailoverLog::default();
        history.replace_all(entries.to_vec());
        part.set_history(history)
            .map_err(|e| history_error(topic, p, e))?;
        Ok(true)
    }

    /// Cuts partition `p` back to `keep` (`PartitionLog::truncate_after`), with the branches of
    /// its history that start past it: a copy whose leader's history parts from its own there
    /// (DCP's rollback). Returns the partition's new high-water mark.
    pub fn truncate_topic(&self, topic: &Topic, p: u16, keep: u64) -> Result<u64> {
        let mut part = self.partition(topic, p)?;
        let before = part.log.high_water_mark();
        let hwm = part.log.truncate_after(keep).map_err(|e| {
            Error::Io(format!(
                "topic {:?} partition {p}: cutting back to {keep}: {e}",
                topic.name
            ))
        })?;
        part.unwritten.retain(|&(first_seq, _)| first_seq <= hwm);
        // Branches that start past the cut go; cut back to nothing, the history starts again
        // (the leader knew none of it: asked again from 0 with no branch, it streams all).
        let mut history = FailoverLog::default();
        if hwm > 0 {
            history.replace_all(
                part.history
                    .entries()
                    .iter()
                    .copied()
                    .filter(|e| e.seqno <= hwm)
                    .collect(),
            );
        }
        part.set_history(history)
            .map_err(|e| history_error(topic, p, e))?;
        drop(part);
        if hwm < before {
            log::warn!(
                "topic {:?} partition {p}: cut back from {before} to {hwm}: messages its leader \
                 does not have (taken by a leader whose copies never got them)",
                topic.name
            );
        }
        topic.changes.notify();
        Ok(hwm)
    }

    fn partition<'t>(
        &self,
        topic: &'t Topic,
        p: u16,
    ) -> Result<parking_lot::MutexGuard<'t, Partition>> {
        topic.lock_partition(p).ok_or_else(|| {
            Error::InvalidArgument(format!("topic {:?} has no partition {p}", topic.name))
        })
    }

    /// Applies every topic's retention at `now_ms` (the maintenance thread does every second);
    /// returns how many messages went.
    pub fn enforce_topic_retention(&self, now_ms: u64) -> u64 {
        self.inner.enforce_topic_retention(now_ms)
    }
}

impl Inner {
    pub(super) fn enforce_topic_retention(&self, now_ms: u64) -> u64 {
        let mut dropped = 0;
        for t in self.catalog.topics() {
            for p in 0..t.num_partitions() {
                dropped += t
                    .lock_partition(p)
                    .expect("in range")
                    .log
                    .enforce_retention(now_ms);
            }
        }
        dropped
    }

    /// Where the topics' partitions keep their segment files.
    pub(crate) fn topics_dir(&self) -> std::path::PathBuf {
        self.config.data_dir.join("topics")
    }

    /// Installs recovered topics with their settings, as `settings` gives them from each
    /// topic's configuration text.
    pub(super) fn install_topics(
        &self,
        recovered: Vec<RecoveredTopic>,
        settings: impl Fn(&str) -> LogConfig,
    ) {
        let live = recovered
            .into_iter()
            .map(|t| {
                let config = settings(&t.config);
                let mut parts = t.partitions;
                for p in &mut parts {
                    p.log.set_config(config);
                }
                Arc::new(Topic::new(t.id, t.name, t.config, config, parts))
            })
            .collect();
        self.catalog.install_topics(live);
    }
}

/// A partition's history that could not be written.
fn history_error(topic: &Topic, p: u16, e: std::io::Error) -> Error {
    Error::Io(format!(
        "topic {:?} partition {p}'s history: {e}",
        topic.name
    ))
}
