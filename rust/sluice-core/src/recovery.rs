//! Recovery: the newest valid snapshot, then WAL records with a higher LSN. A torn write at the
//! end of the last segment is truncated with a warning (see `XlogReader::anomaly` for what counts
//! as one); damage anywhere else stops start-up with the file and byte offset, unless `force`
//! is set. Forced, recovery keeps every intact record it can: it resumes after a damaged block
//! at the next valid one, and when no valid snapshot is reachable through the WAL it salvages
//! the intact blocks of the damaged snapshots (`Salvage`), then replays the whole WAL on top.
//! Whatever it had to drop is logged and listed in the report (`Report::dropped`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use sluice_proto::msgpack::Reader;

use crate::checkpoint::CheckpointConfig;
use crate::error::{Error, Result};
use crate::failover::FailoverEntry;
use crate::item::ItemMeta;
use crate::partition_log::{LogConfig, PartitionLog};
use crate::topic::Partition;
use crate::vbucket::{VBucket, VbState};
use crate::wal::record::{self, Record, RecordBody};
use crate::wal::xlog::{self, FileKind, Next, XlogReader};

pub struct RecoveredBucket {
    pub id: u16,
    pub name: String,
    pub vbuckets: Vec<VBucket>,
}

/// A topic as its records left it: logs built with default settings, which the engine
/// replaces with the topic's own (`PartitionLog::set_config`).
pub struct RecoveredTopic {
    pub id: u16,
    pub name: String,
    pub config: String,
    pub partitions: Vec<Partition>,
}

/// What recovery did, for the ready line and for tests.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub snapshot: Option<PathBuf>,
    pub snapshot_lsn: u64,
    pub snapshot_records: u64,
    pub wal_segments: usize,
    pub wal_records: u64,
    pub last_lsn: u64,
    pub unclean_shutdown: bool,
    pub truncated: Option<(PathBuf, u64)>,
    /// Damage skipped under force recovery (empty otherwise).
    pub skipped_damage: Vec<String>,
    /// Damaged files renamed to `*.damaged`.
    pub moved_aside: Vec<PathBuf>,
    /// What force recovery could not keep (empty otherwise).
    pub dropped: Vec<Dropped>,
    pub duration: Duration,
}

/// A part of a file that force recovery left out: damaged bytes (skipped to the next valid
/// block, or to the end), or records it could not place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub file: PathBuf,
    pub offset: u64,
    /// Bytes skipped (0 when whole records were left out of an intact block).
    pub bytes: u64,
    /// Records known to be left out (damaged bytes hold an unknown number: 0 here).
    pub records: u64,
    pub reason: String,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} byte offset {}: ", self.file.display(), self.offset)?;
        match (self.bytes, self.records) {
            (0, n) => write!(f, "{n} records left out")?,
            (b, 0) => write!(f, "{b} bytes skipped")?,
            (b, n) => write!(f, "{b} bytes ({n} records) skipped")?,
        }
        write!(f, " ({})", self.reason)
    }
}

impl Report {
    fn drop(&mut self, d: Dropped) {
        log::error!("force recovery dropped {d}");
        self.dropped.push(d);
    }
}

pub struct Recovered {
    pub instance: String,
    pub buckets: Vec<RecoveredBucket>,
    pub topics: Vec<RecoveredTopic>,
    /// The LSN to continue after: the last one replayed, or higher if files on disk hold
    /// higher ones that could not be replayed.
    pub last_lsn: u64,
    pub unclean: bool,
    pub report: Report,
}

/// Why a record cannot be applied to the recovered state: the file holding it is corrupt
/// (the text becomes the corruption's reason in the recovery report and errors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ApplyError {
    #[error("bucket name is not UTF-8")]
    BucketName,
    #[error("bucket id {0} declared twice differently")]
    BucketRedeclared(u16),
    #[error("topic id {0} declared twice differently, or its name is not UTF-8")]
    TopicRedeclared(u16),
    #[error("record for unknown topic {topic} partition {partition}")]
    UnknownPartition { topic: u16, partition: u16 },
    #[error("topic {topic}'s segment files: {0}", topic = .1)]
    TopicFiles(String, u16),
    #[error("topic {topic} partition {partition}: {reason}")]
    BadBundle {
        topic: u16,
        partition: u16,
        reason: String,
    },
    #[error("record for unknown bucket {bucket} vbucket {vbucket}")]
    UnknownVbucket { bucket: u16, vbucket: u16 },
    /// A WAL change at or below what the vbucket already holds.
    #[error("seqno {seqno} of vbucket {vbucket} is not above its high seqno {high_seqno}")]
    NotAbove {
        seqno: u64,
        vbucket: u16,
        high_seqno: u64,
    },
    /// A snapshot's item not in ascending order up to the vbucket's high seqno.
    #[error(
        "seqno {seqno} of vbucket {vbucket} is out of order (after {last}, high seqno {high_seqno})"
    )]
    OutOfOrder {
        seqno: u64,
        vbucket: u16,
        last: u64,
        high_seqno: u64,
    },
}

#[derive(Default)]
struct State {
    buckets: BTreeMap<u16, RecoveredBucket>,
    topics: BTreeMap<u16, RecoveredTopic>,
    /// Where the topics' segment files are; None: topics in memory.
    topics_dir: Option<PathBuf>,
}

impl State {
    /// The partition a topic record is for.
    fn partition(
        &mut self,
        topic: u16,
        partition: u16,
    ) -> std::result::Result<&mut Partition, ApplyError> {
        self.topics
            .get_mut(&topic)
            .and_then(|t| t.partitions.get_mut(partition as usize))
            .ok_or(ApplyError::UnknownPartition { topic, partition })
    }

    /// An empty state whose topics keep their segments in `topics_dir`: a topic declared by
    /// the records opens its partitions' files there (`PartitionLog::open_dir`).
    fn in_dir(topics_dir: Option<&Path>) -> Result<State> {
        if let Some(d) = topics_dir {
            std::fs::create_dir_all(d).map_err(|e| Error::io(d.display(), e))?;
        }
        Ok(State {
            topics_dir: topics_dir.map(Path::to_path_buf),
            ..State::default()
        })
    }

    fn apply(&mut self, rec: &Record<'_>, from_wal: bool) -> std::result::Result<(), ApplyError> {
        match rec.body {
            RecordBody::Topic {
                name,
                partitions,
                config,
            } => return self.declare_topic(rec.bucket, name, partitions, config),
            RecordBody::TopicBundle {
                first_seq,
                count,
                newest_ms,
                bundle,
            } => {
                let (topic, partition) = (rec.bucket, rec.vbucket);
                let p = self.partition(topic, partition)?;
                if from_wal && rec.lsn <= p.last_lsn {
                    return Ok(());
                }
                // A record from before segment files (the WAL and snapshots held the bundles):
                // appended to the files unless they hold it already.
                if first_seq.saturating_add(count) <= p.log.next_seq() {
                    p.last_lsn = p.last_lsn.max(rec.lsn);
                    return Ok(());
                }
                let bad = |reason: String| ApplyError::BadBundle {
                    topic,
                    partition,
                    reason,
                };
                match PartitionLog::check(bundle) {
                    Ok(c) if c.span == count && c.first.is_none_or(|f| f == first_seq) => {}
                    Ok(c) => {
                        return Err(bad(format!(
                            "it takes {} sequence numbers from {:?}, the record says {count} \
                             from {first_seq}",
                            c.span, c.first
                        )))
                    }
                    Err(e) => return Err(bad(e.to_string())),
                }
                p.log
                    .append_at(first_seq, bundle, count, newest_ms)
                    .map_err(|e| bad(e.to_string()))?;
                p.last_lsn = p.last_lsn.max(rec.lsn);
                return Ok(());
            }
            RecordBody::TopicAppended {
                first_seq, count, ..
            } => {
                let (topic, partition) = (rec.bucket, rec.vbucket);
                let p = self.partition(topic, partition)?;
                // The segment file holds it, unless the machine went down before the page
                // cache wrote it (wal.mode = write keeps what a process crash cannot lose, not
                // a machine crash; in fsync mode the file was synced before the record): then
                // the partition goes on from where its files end, and the loss is said.
                let end = first_seq.saturating_add(count);
                if p.log.next_seq() < end {
                    log::warn!(
                        "topic {topic} partition {partition}: the WAL names the bundle of \
                         sequence numbers {first_seq} to {}, which its segment files lack (they \
                         end before {}): written to a page cache the machine lost; the \
                         partition goes on from where its files end",
                        end - 1,
                        p.log.next_seq()
                    );
                }
                p.last_lsn = p.last_lsn.max(rec.lsn);
                return Ok(());
            }
            _ => {}
        }
        if let RecordBody::Bucket { name, num_vbuckets } = rec.body {
            let name = String::from_utf8(name.to_vec()).map_err(|_| ApplyError::BucketName)?;
            match self.buckets.get(&rec.bucket) {
                Some(b) if b.name != name || b.vbuckets.len() != num_vbuckets as usize => {
                    return Err(ApplyError::BucketRedeclared(rec.bucket))
                }
                Some(_) => {}
                None => {
                    let cfg = CheckpointConfig::default();
                    let vbuckets = (0..num_vbuckets)
                        .map(|v| VBucket::new(rec.bucket, v, VbState::Dead, cfg))
                        .collect();
                    self.buckets.insert(
                        rec.bucket,
                        RecoveredBucket {
                            id: rec.bucket,
                            name,
                            vbuckets,
                        },
                    );
                }
            }
            return Ok(());
        }
        let vb = self
            .buckets
            .get_mut(&rec.bucket)
            .and_then(|b| b.vbuckets.get_mut(rec.vbucket as usize))
            .ok_or(ApplyError::UnknownVbucket {
                bucket: rec.bucket,
                vbucket: rec.vbucket,
            })?;
        if from_wal && rec.lsn <= vb.last_lsn {
            return Ok(());
        }
        match &rec.body {
            RecordBody::Change {
                key, value, meta, ..
            } => {
                if meta.by_seqno <= vb.high_seqno && from_wal {
                    return Err(ApplyError::NotAbove {
                        seqno: meta.by_seqno,
                        vbucket: rec.vbucket,
                        high_seqno: vb.high_seqno,
                    });
                }
                // A snapshot lists each vbucket's items in ascending seqnos up to its high seqno.
                if !from_wal
                    && (meta.by_seqno <= vb.store.last_seqno() || meta.by_seqno > vb.high_seqno)
                {
                    return Err(ApplyError::OutOfOrder {
                        seqno: meta.by_seqno,
                        vbucket: rec.vbucket,
                        last: vb.store.last_seqno(),
                        high_seqno: vb.high_seqno,
                    });
                }
                vb.recover_item(key, value, meta);
            }
            RecordBody::VbucketState { state, .. } => vb.state = *state,
            RecordBody::FailoverEntry(e) => vb.failover.push(*e),
            RecordBody::PurgeSeqno(s) => vb.purge_seqno = vb.purge_seqno.max(*s),
            // A rollback is always followed by a snapshot holding its result. Without that
            // snapshot (a crash between them) the vbucket stays as it was before the rollback
            // and its producer asks for the same rollback again.
            RecordBody::Rollback(_) => {}
            RecordBody::FailoverReset => vb.failover.replace_all(Vec::new()),
            RecordBody::FollowPosition(p) => {
                vb.follow_position = (!p.is_empty()).then(|| (*p).into())
            }
            // A group's block is whole or was cut as a torn tail: its changes come as they are.
            RecordBody::FollowGroup => {}
            RecordBody::VbucketSnapshot {
                state,
                high_seqno,
                max_cas,
                purge_seqno,
            } => {
                vb.state = *state;
                vb.high_seqno = *high_seqno;
                vb.clock.observe(*max_cas);
                vb.purge_seqno = *purge_seqno;
            }
            RecordBody::Bucket { .. }
            | RecordBody::Topic { .. }
            | RecordBody::TopicBundle { .. }
            | RecordBody::TopicAppended { .. } => {
                unreachable!("handled above")
            }
        }
        vb.last_lsn = vb.last_lsn.max(rec.lsn);
        Ok(())
    }
}

impl State {
    fn declare_topic(
        &mut self,
        id: u16,
        name: &[u8],
        partitions: u16,
        config: &[u8],
    ) -> std::result::Result<(), ApplyError> {
        let (Ok(name), Ok(config)) = (std::str::from_utf8(name), std::str::from_utf8(config))
        else {
            return Err(ApplyError::TopicRedeclared(id));
        };
        match self.topics.get(&id) {
            Some(t) if t.name != name || t.partitions.len() != partitions as usize => {
                Err(ApplyError::TopicRedeclared(id))
            }
            Some(_) => Ok(()),
            None => {
                let log = |p| match &self.topics_dir {
                    Some(d) => PartitionLog::open_dir(
                        LogConfig::default(),
                        crate::topic::partition_dir(d, id, p),
                    )
                    .map_err(|e| ApplyError::TopicFiles(e, id)),
                    None => Ok(PartitionLog::new(LogConfig::default())),
                };
                let partitions = (0..partitions)
                    .map(|p| log(p).map(|l| Partition::new(l, 0)))
                    .collect::<std::result::Result<_, _>>()?;
                self.topics.insert(
                    id,
                    RecoveredTopic {
                        id,
                        name: name.to_string(),
                        config: config.to_string(),
                        partitions,
                    },
                );
                Ok(())
            }
        }
    }
}

/// Force recovery's merge of everything intact, when no valid snapshot is reachable through the
/// WAL: the newest valid snapshot (if any), the intact blocks of the damaged ones after it, then
/// every WAL record. Sources overlap and arrive out of order, so each key keeps the version with
/// the highest seqno, and vbucket metadata the one with the highest LSN. (What this cannot see:
/// a tombstone purged between two snapshots lets the older snapshot's version come back.)
#[derive(Default)]
struct Salvage {
    buckets: BTreeMap<u16, (String, u16)>,
    vbuckets: BTreeMap<(u16, u16), SalvagedVb>,
    /// Records for a bucket whose declaration was in no intact block.
    unplaced: u64,
    /// Topics declared: name, partitions, configuration text.
    topics: BTreeMap<u16, (String, u16, String)>,
    /// Per (topic, partition), bundles by first sequence number: count, newest timestamp,
    /// bytes, and the highest LSN that carried them.
    bundles: BTreeMap<(u16, u16), BTreeMap<u64, SalvagedBundle>>,
}

struct SalvagedBundle {
    count: u64,
    newest_ms: u64,
    bytes: Vec<u8>,
    lsn: u64,
}

#[derive(Default)]
struct SalvagedVb {
    items: HashMap<Vec<u8>, (Vec<u8>, ItemMeta)>,
    /// The state, with the LSN that set it.
    state: Option<(u64, VbState)>,
    high_seqno: u64,
    max_cas: u64,
    purge_seqno: u64,
    /// Newest first, as `FailoverLog` keeps them.
    failover: Vec<FailoverEntry>,
    /// The highest LSN a snapshot of this vbucket covered: WAL metadata at or below it is older.
    snapshot_lsn: u64,
    last_lsn: u64,
}

impl Salvage {
    fn apply(&mut self, rec: &Record<'_>, from_wal: bool) {
        match rec.body {
            RecordBody::Topic {
                name,
                partitions,
                config,
            } => {
                self.topics.entry(rec.bucket).or_insert((
                    String::from_utf8_lossy(name).into_owned(),
                    partitions,
                    String::from_utf8_lossy(config).into_owned(),
                ));
                return;
            }
            RecordBody::TopicBundle {
                first_seq,
                count,
                newest_ms,
                bundle,
            } => {
                // The same bundle may come from a snapshot and the WAL: one copy is kept.
                self.bundles
                    .entry((rec.bucket, rec.vbucket))
                    .or_default()
                    .entry(first_seq)
                    .or_insert(SalvagedBundle {
                        count,
                        newest_ms,
                        bytes: bundle.to_vec(),
                        lsn: 0,
                    })
                    .lsn = rec.lsn;
                return;
            }
            _ => {}
        }
        if let RecordBody::Bucket { name, num_vbuckets } = rec.body {
            let name = String::from_utf8_lossy(name).into_owned();
            self.buckets
                .entry(rec.bucket)
                .or_insert((name, num_vbuckets));
            return;
        }
        match self.buckets.get(&rec.bucket) {
            Some((_, n)) if rec.vbucket < *n => {}
            _ => {
                self.unplaced += 1;
                return;
            }
        }
        let vb = self.vbuckets.entry((rec.bucket, rec.vbucket)).or_default();
        vb.last_lsn = vb.last_lsn.max(rec.lsn);
        let newer_meta = !from_wal || rec.lsn > vb.snapshot_lsn;
        match &rec.body {
            RecordBody::Change {
                key, value, meta, ..
            } => {
                vb.high_seqno = vb.high_seqno.max(meta.by_seqno);
                vb.max_cas = vb.max_cas.max(meta.cas);
                let newer = vb
                    .items
                    .get(*key)
                    .is_none_or(|(_, old)| old.by_seqno < meta.by_seqno);
                if newer {
                    vb.items.insert(key.to_vec(), (value.to_vec(), *meta));
                }
            }
            RecordBody::VbucketSnapshot {
                state,
                high_seqno,
                max_cas,
                purge_seqno,
            } => {
                if vb.state.is_none_or(|(lsn, _)| lsn <= rec.lsn) {
                    vb.state = Some((rec.lsn, *state));
                }
                vb.high_seqno = vb.high_seqno.max(*high_seqno);
                vb.max_cas = vb.max_cas.max(*max_cas);
                vb.purge_seqno = vb.purge_seqno.max(*purge_seqno);
                vb.snapshot_lsn = vb.snapshot_lsn.max(rec.lsn);
            }
            RecordBody::VbucketState { state, .. }
                if vb.state.is_none_or(|(lsn, _)| lsn <= rec.lsn) =>
            {
                vb.state = Some((rec.lsn, *state));
            }
            RecordBody::FailoverEntry(e)
                if newer_meta && !vb.failover.iter().any(|x| x.uuid == e.uuid) =>
            {
                vb.failover.insert(0, *e);
            }
            RecordBody::FailoverReset if from_wal && newer_meta => vb.failover.clear(),
            RecordBody::PurgeSeqno(s) => vb.purge_seqno = vb.purge_seqno.max(*s),
            // Follow positions are dropped: a salvaged copy may miss changes from before its
            // position, so a follower starts over from a fresh copy of its source.
            _ => {}
        }
    }

    /// The merged vbuckets, each item inserted in seqno order as the item store wants them;
    /// the topics' bundles in sequence order. Returns the state and how many bundles were
    /// left out: overlapping those before them, not readable as bundles, or of a topic
    /// declared only in damaged blocks.
    fn into_state(mut self, topics_dir: Option<&Path>) -> Result<(State, u64)> {
        let mut state = State::in_dir(topics_dir)?;
        let mut left_out = 0;
        for (id, (name, partitions, config)) in std::mem::take(&mut self.topics) {
            let name_bytes = name.clone();
            state
                .declare_topic(id, name_bytes.as_bytes(), partitions, config.as_bytes())
                .expect("a new id");
            let topic = state.topics.get_mut(&id).expect("declared above");
            for (p, part) in topic.partitions.iter_mut().enumerate() {
                for (first, b) in self.bundles.remove(&(id, p as u16)).unwrap_or_default() {
                    let fits = PartitionLog::check(&b.bytes)
                        .is_ok_and(|c| c.span == b.count && c.first.is_none_or(|f| f == first));
                    if fits
                        && part
                            .log
                            .append_at(first, &b.bytes, b.count, b.newest_ms)
                            .is_ok()
                    {
                        part.last_lsn = part.last_lsn.max(b.lsn);
                    } else {
                        left_out += 1;
                    }
                }
            }
        }
        left_out += self.bundles.values().map(|b| b.len() as u64).sum::<u64>();
        let mut vbuckets = self.vbuckets;
        for (id, (name, n)) in self.buckets {
            let vbs = (0..n)
                .map(|v| {
                    let cfg = CheckpointConfig::default();
                    let mut vb = VBucket::new(id, v, VbState::Dead, cfg);
                    let Some(s) = vbuckets.remove(&(id, v)) else {
                        return vb;
                    };
                    match s.state {
                        Some((_, st)) => vb.state = st,
                        None => log::error!(
                            "force recovery: the state of bucket {name:?} vbucket {v} was in no \
                             intact block; it stays dead"
                        ),
                    }
                    let mut items: Vec<_> = s.items.into_iter().collect();
                    items.sort_by_key(|(_, (_, m))| m.by_seqno);
                    for (key, (value, meta)) in &items {
                        vb.recover_item(key, value, meta);
                    }
                    vb.high_seqno = vb.high_seqno.max(s.high_seqno);
                    vb.clock.observe(s.max_cas);
                    vb.purge_seqno = s.purge_seqno;
                    vb.failover.replace_all(s.failover);
                    vb.last_lsn = s.last_lsn;
                    vb
                })
                .collect();
            state.buckets.insert(
                id,
                RecoveredBucket {
                    id,
                    name,
                    vbuckets: vbs,
                },
            );
        }
        Ok((state, left_out))
    }
}

/// Where WAL records go: the state on top of a valid snapshot, or force recovery's salvage.
enum Target {
    Replay(State),
    Salvage(Salvage),
}

impl Target {
    fn apply(&mut self, rec: &Record<'_>) -> std::result::Result<(), ApplyError> {
        match self {
            Target::Replay(s) => s.apply(rec, true),
            Target::Salvage(s) => {
                s.apply(rec, true);
                Ok(())
            }
        }
    }
}

/// Feeds every intact block of a (damaged) snapshot to the salvage, skipping damaged blocks to
/// the next valid one; what is skipped goes into the report.
fn salvage_snapshot(
    path: &Path,
    salvage: &mut Salvage,
    instance: &mut Option<String>,
    report: &mut Report,
) -> Result<()> {
    let mut r = match XlogReader::open(path) {
        Ok(r) => r,
        Err(Error::Corrupt { offset, reason, .. }) => {
            let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            report.drop(Dropped {
                file: path.to_path_buf(),
                offset,
                bytes,
                records: 0,
                reason: format!("unreadable header: {reason}"),
            });
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    check_instance(path, &r.header().instance.clone(), instance)?;
    let io = |e| Error::io(path.display(), e);
    let mut records = 0u64;
    loop {
        let (offset, reason) = match r.next_block()? {
            Next::Block { offset, payload } => {
                let mut rd = Reader::new(payload);
                while !rd.is_empty() {
                    match record::decode(&mut rd) {
                        Ok(rec) => {
                            salvage.apply(&rec, false);
                            records += 1;
                        }
                        // Cannot happen in a block whose checksum held, short of a bug.
                        Err(e) => {
                            report.drop(Dropped {
                                file: path.to_path_buf(),
                                offset,
                                bytes: (payload.len() - rd.position()) as u64,
                                records: 0,
                                reason: e.to_string(),
                            });
                            break;
                        }
                    }
                }
                continue;
            }
            Next::Eof { .. } => break,
            Next::End { offset } => (offset, "ends without its EOF marker".to_string()),
            Next::Torn { offset, reason } | Next::Corrupt { offset, reason } => (offset, reason),
        };
        let resumed = r.resync_after(offset).map_err(io)?;
        let to = if resumed { r.offset() } else { r.file_len() };
        report.drop(Dropped {
            file: path.to_path_buf(),
            offset,
            bytes: to - offset,
            records: 0,
            reason,
        });
        if !resumed {
            break;
        }
    }
    report.snapshot_records += records;
    log::warn!(
        "force recovery: salvaged {records} records from damaged snapshot {}",
        path.display()
    );
    Ok(())
}

fn corrupt(path: &Path, offset: u64, reason: impl Into<String>) -> Error {
    Error::Corrupt {
        file: path.to_path_buf(),
        offset,
        reason: reason.into(),
    }
}

/// Loads one snapshot whole; any damage makes it unusable.
fn load_snapshot(
    path: &Path,
    instance: &mut Option<String>,
    topics_dir: Option<&Path>,
) -> Result<(State, u64, u64)> {
    let mut r = XlogReader::open(path)?;
    if r.header().kind != FileKind::Snap {
        return Err(corrupt(path, 0, "not a snapshot file"));
    }
    check_instance(path, &r.header().instance, instance)?;
    let lsn = r.header().lsn;
    let mut state = State::in_dir(topics_dir)?;
    let mut n = 0;
    loop {
        match r.next_block()? {
            Next::Block { offset, payload } => {
                let mut rd = Reader::new(payload);
                while !rd.is_empty() {
                    let rec = record::decode(&mut rd)
                        .map_err(|e| corrupt(path, offset, e.to_string()))?;
                    state
                        .apply(&rec, false)
                        .map_err(|e| corrupt(path, offset, e.to_string()))?;
                    n += 1;
                }
            }
            Next::Eof { .. } => return Ok((state, lsn, n)),
            Next::End { offset } => {
                return Err(corrupt(
                    path,
                    offset,
                    "snapshot ends without its EOF marker",
                ))
            }
            Next::Torn { offset, reason } | Next::Corrupt { offset, reason } => {
                return Err(corrupt(path, offset, reason))
            }
        }
    }
}

fn check_instance(path: &Path, found: &str, instance: &mut Option<String>) -> Result<()> {
    match instance {
        Some(i) if i != found => Err(corrupt(
            path,
            0,
            format!("belongs to instance {found}, the data directory to {i}"),
        )),
        Some(_) => Ok(()),
        None => {
            *instance = Some(found.to_string());
            Ok(())
        }
    }
}

fn new_instance() -> String {
    format!(
        "{:016x}{:016x}",
        crate::failover::random_uuid(),
        crate::failover::random_uuid()
    )
}

/// Removes segments at the end of the WAL that hold no record: a header cut short, or a header
/// alone. The writer starts a new segment before it closes the old one, so a crash in between
/// leaves such a file after a segment without its EOF marker; that one is then the last.
fn drop_empty_tail(segments: &mut Vec<(u64, PathBuf, bool)>, report: &mut Report) -> Result<()> {
    while let Some((_, path, _)) = segments.last() {
        let empty = match XlogReader::open(path) {
            // No block, or only a torn first one: nothing in it was ever durable.
            Ok(mut r) => matches!(
                r.next_block()?,
                Next::End { .. } | Next::Eof { .. } | Next::Torn { .. }
            ),
            Err(Error::Corrupt { reason, .. }) => reason == xlog::HEADER_TRUNCATED,
            Err(e) => return Err(e),
        };
        if !empty {
            return Ok(());
        }
        log::warn!(
            "WAL {}: holds no record (a crash while it was being started); removing it",
            path.display()
        );
        std::fs::remove_file(path).map_err(|e| Error::io(path.display(), e))?;
        report.truncated = Some((path.clone(), 0));
        report.unclean_shutdown = true;
        segments.pop();
    }
    Ok(())
}

/// Moves a damaged file out of the way (`NAME.damaged`), so that it is neither read, counted by
/// retention, nor overwritten by a new file of the same name. Nothing damaged is ever deleted.
fn move_aside(path: &Path, report: &mut Report) -> Result<()> {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".damaged");
    let dest = path.with_file_name(name);
    std::fs::rename(path, &dest).map_err(|e| Error::io(path.display(), e))?;
    log::warn!(
        "moved damaged {} aside to {}",
        path.display(),
        dest.display()
    );
    report.moved_aside.push(dest);
    Ok(())
}

/// `topics_dir`: where the topics' segment files are made (None: topics in memory).
pub fn recover(
    wal_dir: &Path,
    snap_dir: &Path,
    topics_dir: Option<&Path>,
    force: bool,
) -> Result<Recovered> {
    let mut report = Report::default();
    for (_, path, inprogress) in xlog::list_files(snap_dir, "snap")? {
        if inprogress {
            log::warn!("removing unfinished snapshot {}", path.display());
            std::fs::remove_file(&path).map_err(|e| Error::io(path.display(), e))?;
        }
    }
    let snaps = xlog::list_files(snap_dir, "snap")?;
    let mut segments = xlog::list_files(wal_dir, "xlog")?;
    drop_empty_tail(&mut segments, &mut report)?;
    // The highest LSN any file on disk may hold: new LSNs start above it, whatever was lost,
    // so that no LSN is ever handed out twice.
    // A snapshot's name is an LSN it holds; a segment's name is the first LSN it may hold, so
    // only the one before it is known to be used (records read below raise this further).
    let mut max_seen = snaps.iter().map(|s| s.0).max().unwrap_or(0);
    max_seen = max_seen.max(
        segments
            .iter()
            .map(|s| s.0.saturating_sub(1))
            .max()
            .unwrap_or(0),
    );
    let mut instance: Option<String> = None;

    // The newest valid snapshot; an older one serves if the WAL still reaches back to it.
    let mut state = State::in_dir(topics_dir)?;
    let mut snap_lsn = 0;
    let mut base_snapshot = None;
    let mut damaged_snaps = Vec::new();
    for (lsn, path, _) in snaps.iter().rev() {
        let mut inst = instance.clone();
        match load_snapshot(path, &mut inst, topics_dir) {
            Ok((s, l, n)) => {
                state = s;
                snap_lsn = l;
                instance = inst;
                base_snapshot = Some(path.clone());
                report.snapshot = Some(path.clone());
                report.snapshot_records = n;
                break;
            }
            Err(e) => {
                log::error!("snapshot {} (LSN {lsn}) is unusable: {e}", path.display());
                damaged_snaps.push((path.clone(), e));
            }
        }
    }
    // Without a valid snapshot the WAL reaches back to, what the damaged snapshots alone held
    // is lost unless forced; forced, their intact blocks are salvaged.
    let mut salvaging = false;
    if let Some((_, first_error)) = damaged_snaps.first() {
        let reaches = segments
            .first()
            .map(|s| s.0 <= snap_lsn + 1)
            .unwrap_or(false);
        if !reaches {
            if !force {
                return Err(first_error.clone());
            }
            report.skipped_damage.push(first_error.to_string());
            salvaging = true;
        }
    }
    let mut target = if salvaging {
        let mut salvage = Salvage::default();
        if let Some(base) = &base_snapshot {
            // Valid: it reads whole, this time into the salvage.
            salvage_snapshot(base, &mut salvage, &mut instance, &mut report)?;
        }
        // Oldest first (the newest valid one, if any, is older than all of them).
        for (path, _) in damaged_snaps.iter().rev() {
            salvage_snapshot(path, &mut salvage, &mut instance, &mut report)?;
        }
        Target::Salvage(salvage)
    } else {
        Target::Replay(state)
    };
    for (path, _) in &damaged_snaps {
        move_aside(path, &mut report)?;
    }
    report.snapshot_lsn = snap_lsn;

    // Salvaging, every record of the WAL is merged in (the merge keeps the newest version);
    // LSNs before the first segment are the snapshots' to hold, not a gap.
    let mut expected = match (&target, segments.first()) {
        (Target::Salvage(_), Some(first)) => first.0,
        _ => snap_lsn + 1,
    };
    let mut last_lsn = snap_lsn;
    let mut unclean = false;
    // Segments wholly at or below the snapshot's LSN are not needed.
    let needed: Vec<_> = segments
        .iter()
        .enumerate()
        .filter(|(i, _)| segments.get(i + 1).map(|n| n.0 > expected).unwrap_or(true))
        .map(|(_, s)| s.clone())
        .collect();
    // Damage is fatal unless forced; forced, it is logged, reported, and skipped.
    let note = |e: Error, report: &mut Report| -> Result<()> {
        if !force {
            return Err(e);
        }
        log::error!("{e}; skipping it because of --force-recovery");
        report.skipped_damage.push(e.to_string());
        Ok(())
    };
    for (idx, (first, path, _)) in needed.iter().enumerate() {
        let is_last = idx + 1 == needed.len();
        let mut r = match XlogReader::open(path) {
            Ok(r) => r,
            Err(e @ Error::Corrupt { .. }) => {
                let (offset, reason) = match &e {
                    Error::Corrupt { offset, reason, .. } => (*offset, reason.clone()),
                    _ => unreachable!(),
                };
                note(e, &mut report)?;
                let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
                report.drop(Dropped {
                    file: path.clone(),
                    offset,
                    bytes,
                    records: 0,
                    reason: format!("unreadable header: {reason}"),
                });
                move_aside(path, &mut report)?;
                unclean |= is_last;
                continue;
            }
            Err(e) => return Err(e),
        };
        if r.header().kind != FileKind::Xlog {
            note(corrupt(path, 0, "not a WAL segment"), &mut report)?;
            move_aside(path, &mut report)?;
            continue;
        }
        check_instance(path, &r.header().instance.clone(), &mut instance)?;
        if *first > expected {
            let missing = *first - expected;
            note(
                corrupt(
                    path,
                    0,
                    format!(
                        "WAL segment starts at LSN {first}, LSNs {expected}..{first} are missing"
                    ),
                ),
                &mut report,
            )?;
            report.drop(Dropped {
                file: path.clone(),
                offset: 0,
                bytes: 0,
                records: missing,
                reason: format!("LSNs {expected}..{first} are in no segment"),
            });
            expected = *first;
        }
        report.wal_segments += 1;
        let mut records_in_file = 0u64;
        let mut damaged = false;
        let clean = loop {
            let damage = match r.next_block()? {
                Next::Block { offset, payload } => {
                    let mut rd = Reader::new(payload);
                    let mut bad = None;
                    while !rd.is_empty() {
                        let rec = match record::decode(&mut rd) {
                            Ok(rec) => rec,
                            Err(e) => {
                                bad = Some(corrupt(path, offset, e.to_string()));
                                break;
                            }
                        };
                        records_in_file += 1;
                        max_seen = max_seen.max(rec.lsn);
                        if rec.lsn < expected {
                            continue;
                        }
                        if rec.lsn > expected {
                            // Records in between were in a damaged block (already reported).
                            note(
                                corrupt(
                                    path,
                                    offset,
                                    format!("LSN {} where {expected} was expected", rec.lsn),
                                ),
                                &mut report,
                            )?;
                            expected = rec.lsn;
                        }
                        if let Err(e) = target.apply(&rec) {
                            bad = Some(corrupt(path, offset, e.to_string()));
                            break;
                        }
                        expected += 1;
                        last_lsn = rec.lsn;
                        report.wal_records += 1;
                    }
                    match bad {
                        Some(e) => (e, offset),
                        None => continue,
                    }
                }
                Next::Eof { .. } => break true,
                Next::End { offset } => {
                    // Without its EOF marker, a segment is still whole when the next one starts
                    // exactly where it ends (a crash or error while it was being closed).
                    if is_last || needed.get(idx + 1).map(|n| n.0) == Some(expected) {
                        break false;
                    }
                    (corrupt(path, offset, "segment ends without its EOF marker and the next one does not continue it"), offset)
                }
                Next::Torn { offset, reason } => {
                    if is_last {
                        log::warn!(
                            "WAL {}: torn write at byte offset {offset} ({reason}); truncating",
                            path.display()
                        );
                        let f = std::fs::OpenOptions::new()
                            .write(true)
                            .open(path)
                            .map_err(|e| Error::io(path.display(), e))?;
                        f.set_len(offset)
                            .map_err(|e| Error::io(path.display(), e))?;
                        f.sync_all().map_err(|e| Error::io(path.display(), e))?;
                        report.truncated = Some((path.clone(), offset));
                        break false;
                    }
                    (corrupt(path, offset, reason), offset)
                }
                Next::Corrupt { offset, reason } => (corrupt(path, offset, reason), offset),
            };
            // Forced past damage: carry on from the next valid block, if any.
            let (err, offset) = damage;
            let reason = match &err {
                Error::Corrupt { reason, .. } => reason.clone(),
                other => other.to_string(),
            };
            note(err, &mut report)?;
            damaged = true;
            let resumed = r
                .resync_after(offset)
                .map_err(|e| Error::io(path.display(), e))?;
            let to = if resumed { r.offset() } else { r.file_len() };
            report.drop(Dropped {
                file: path.clone(),
                offset,
                bytes: to - offset,
                records: 0,
                reason,
            });
            if !resumed {
                break false;
            }
        };
        let inprogress = path.extension().is_some_and(|e| e == "inprogress");
        if damaged {
            // Its intact records are replayed; the file goes aside so that no later start
            // trips over it (the snapshot written after a forced recovery holds them).
            move_aside(path, &mut report)?;
            unclean |= is_last;
        } else if is_last {
            unclean = !clean || inprogress;
            seal_segment(path, clean, records_in_file)?;
        } else if !clean || inprogress {
            log::warn!("WAL {}: was not closed cleanly; sealing it", path.display());
            seal_segment(path, clean, records_in_file)?;
        }
    }
    let state = match target {
        Target::Replay(state) => state,
        Target::Salvage(salvage) => {
            if salvage.unplaced > 0 {
                report.drop(Dropped {
                    file: snap_dir.to_path_buf(),
                    offset: 0,
                    bytes: 0,
                    records: salvage.unplaced,
                    reason: "their bucket was declared only in damaged blocks".into(),
                });
            }
            let (state, left_out) = salvage.into_state(topics_dir)?;
            if left_out > 0 {
                report.drop(Dropped {
                    file: snap_dir.to_path_buf(),
                    offset: 0,
                    bytes: 0,
                    records: left_out,
                    reason: "topic bundles overlapping others, unreadable, or of a topic \
                             declared only in damaged blocks"
                        .into(),
                });
            }
            last_lsn = last_lsn.max(
                state
                    .buckets
                    .values()
                    .flat_map(|b| b.vbuckets.iter().map(|v| v.last_lsn))
                    .max()
                    .unwrap_or(0),
            );
            state
        }
    };
    report.last_lsn = last_lsn;
    report.unclean_shutdown |= unclean;
    let unclean = report.unclean_shutdown;
    if unclean {
        log::warn!("the last shutdown was not clean; active vbuckets get a new failover entry");
    }
    let instance = instance.unwrap_or_else(new_instance);
    let buckets = state.buckets.into_values().collect();
    let topics = state.topics.into_values().collect();
    Ok(Recovered {
        instance,
        buckets,
        topics,
        last_lsn: last_lsn.max(max_seen),
        unclean,
        report,
    })
}

/// Closes the recovered last segment for good: EOF marker appended (if missing) and the
/// `.inprogress` suffix dropped. A segment without records is removed.
fn seal_segment(path: &Path, has_eof: bool, records: u64) -> Result<()> {
    let io = |e| Error::io(path.display(), e);
    if records == 0 {
        std::fs::remove_file(path).map_err(io)?;
        return Ok(());
    }
    if !has_eof {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(io)?;
        f.write_all(&xlog::EOF_MARKER.to_be_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    if let Some(name) = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".inprogress"))
    {
        let dest = path.with_file_name(name);
        std::fs::rename(path, &dest).map_err(io)?;
        if let Some(dir) = path.parent() {
            xlog::sync_dir(dir).map_err(io)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(lsn: u64, name: &[u8], num_vbuckets: u16) -> Record<'_> {
        Record {
            lsn,
            bucket: 2,
            vbucket: 0,
            body: RecordBody::Bucket { name, num_vbuckets },
        }
    }

    #[test]
    fn records_that_do_not_fit_the_state_are_named() {
        let mut state = State::default();
        state.apply(&bucket(1, b"default", 4), true).unwrap();
        // The same declaration again (a snapshot and the WAL both hold it) is fine.
        state.apply(&bucket(2, b"default", 4), true).unwrap();
        let err = |state: &mut State, rec: &Record<'_>| state.apply(rec, true).unwrap_err();
        assert_eq!(
            err(&mut state, &bucket(3, b"default", 8)).to_string(),
            "bucket id 2 declared twice differently"
        );
        assert_eq!(
            err(&mut state, &bucket(3, b"\xff", 4)),
            ApplyError::BucketName
        );
        let purge = |vbucket| Record {
            lsn: 4,
            bucket: 2,
            vbucket,
            body: RecordBody::PurgeSeqno(1),
        };
        state.apply(&purge(3), true).unwrap();
        assert_eq!(
            err(&mut state, &purge(4)).to_string(),
            "record for unknown bucket 2 vbucket 4"
        );
    }
}
