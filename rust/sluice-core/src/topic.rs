//! A topic: a named set of partitions, each an append-only log (`partition_log`) that keeps
//! every message produced to it, logged to the WAL like any change (`Engine::produce`).
//! Topic ids are their own space, apart from bucket ids; a topic's WAL records carry its id
//! where a change carries its bucket's, and the partition where a change carries its vbucket.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::durability::ReplicaAcks;
use crate::failover::{FailoverEntry, FailoverLog};
use crate::partition_log::{LogConfig, PartitionLog};
use crate::signal::ChangeSignal;

/// Where a partition keeps its segment files: `topics/<topic id>/<partition>` under the data
/// directory (`topics_dir`).
pub fn partition_dir(topics_dir: &Path, topic: u16, partition: u16) -> PathBuf {
    topics_dir
        .join(topic.to_string())
        .join(partition.to_string())
}

/// One partition: its log, the last WAL LSN applied to it (WAL replay skips what a snapshot of
/// it holds), its bundles not yet in the WAL file, which readers do not see, and its traffic
/// since the process started (for metrics).
pub struct Partition {
    pub log: PartitionLog,
    pub last_lsn: u64,
    /// (the bundle's first sequence number, its LSN), oldest first.
    pub unwritten: VecDeque<(u64, u64)>,
    pub produced_messages: u64,
    pub produced_bytes: u64,
    pub consumed_bytes: u64,
    /// Its branches of history, newest first (DCP's failover log): a node that comes to lead
    /// it starts one at its end, a copy takes its leader's. Empty: the one every node starts
    /// with (`Topic::history`). Kept in the partition's directory (`HISTORY_FILE`).
    pub history: FailoverLog,
}

/// The file in a partition's directory that keeps its history: a line per entry, newest
/// first, "uuid seqno" in decimal.
pub const HISTORY_FILE: &str = "history";

/// The uuid of the history every copy of a topic's partitions starts with: the same on every
/// node for a topic of that name (FNV-1a, stable across builds, unlike std's hasher).
pub fn base_uuid(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.as_bytes() {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// A partition's history as its directory keeps it; none there (or a file that does not
/// read, said in the log) is the empty one. Forgetting branches is safe: a copy asking from
/// a branch its leader does not know is cut back further, never kept ahead.
fn read_history(dir: &Path) -> FailoverLog {
    let path = dir.join(HISTORY_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return FailoverLog::default(),
        Err(e) => {
            log::warn!(
                "{}: {e}; the partition's history starts again",
                path.display()
            );
            return FailoverLog::default();
        }
    };
    let mut entries = Vec::new();
    for line in text.lines() {
        let mut f = line.split(' ').map(str::parse::<u64>);
        match (f.next(), f.next(), f.next()) {
            (Some(Ok(uuid)), Some(Ok(seqno)), None) => entries.push(FailoverEntry { uuid, seqno }),
            _ => {
                log::warn!(
                    "{}: the line {line:?} is not \"uuid seqno\"; the partition's history \
                     starts again",
                    path.display()
                );
                return FailoverLog::default();
            }
        }
    }
    let mut log = FailoverLog::default();
    log.replace_all(entries);
    log
}

/// Writes a partition's history to its directory: a new file synced, then renamed over the
/// old one, so a crash leaves one or the other whole.
fn write_history(dir: &Path, log: &FailoverLog) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let mut text = String::new();
    for e in log.entries() {
        text.push_str(&format!("{} {}\n", e.uuid, e.seqno));
    }
    let tmp = dir.join(format!("{HISTORY_FILE}.new"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_data()?;
    std::fs::rename(&tmp, dir.join(HISTORY_FILE))?;
    std::fs::File::open(dir)?.sync_all()
}

impl Partition {
    /// A partition over `log`, with the history its directory keeps.
    pub fn new(log: PartitionLog, last_lsn: u64) -> Partition {
        Partition {
            history: log.dir().map(read_history).unwrap_or_default(),
            log,
            last_lsn,
            unwritten: VecDeque::new(),
            produced_messages: 0,
            produced_bytes: 0,
            consumed_bytes: 0,
        }
    }

    /// Keeps `history` as the partition's, in its directory if it has one.
    pub fn set_history(&mut self, history: FailoverLog) -> std::io::Result<()> {
        if let Some(dir) = self.log.dir() {
            write_history(dir, &history)?;
        }
        self.history = history;
        Ok(())
    }

    /// Where the log ends for readers, now that the WAL file holds every LSN up to
    /// `written_lsn`: before the oldest bundle it does not hold yet. With it, the LSN to wait
    /// for to see that bundle. A log written to no WAL (`wal.mode = none`) keeps nothing here.
    pub fn visible(&mut self, written_lsn: u64) -> (u64, Option<u64>) {
        while self
            .unwritten
            .front()
            .is_some_and(|&(_, lsn)| lsn <= written_lsn)
        {
            self.unwritten.pop_front();
        }
        match self.unwritten.front() {
            Some(&(first_seq, lsn)) => (first_seq, Some(lsn)),
            None => (self.log.next_seq(), None),
        }
    }
}

pub struct Topic {
    pub id: u16,
    pub name: String,
    /// The configuration text it was created with (TANK's `key=value` lines), kept as given.
    pub config_text: String,
    pub config: LogConfig,
    partitions: Vec<Mutex<Partition>>,
    /// Wakes consumers waiting at a partition's tail when any partition grows.
    pub changes: ChangeSignal,
    /// Consumes waiting at one of its partitions' tails now (TANK's long-polls).
    pub long_polls: AtomicU64,
    /// A replica copies it from its active: producers are refused here.
    followed: AtomicBool,
    /// Per partition, the copies streaming it from here (in a cluster, the nodes that replicate
    /// a partition this node leads) and how far each holds it: a produce asking for acks waits
    /// on them.
    pub acks: ReplicaAcks,
}

impl Topic {
    pub fn new(
        id: u16,
        name: String,
        config_text: String,
        config: LogConfig,
        partitions: Vec<Partition>,
    ) -> Topic {
        let count = u16::try_from(partitions.len()).unwrap_or(u16::MAX);
        Topic {
            id,
            name,
            config_text,
            config,
            acks: ReplicaAcks::new(count),
            partitions: partitions.into_iter().map(Mutex::new).collect(),
            changes: ChangeSignal::default(),
            long_polls: AtomicU64::new(0),
            followed: AtomicBool::new(false),
        }
    }

    pub fn is_followed(&self) -> bool {
        self.followed.load(Ordering::Acquire)
    }

    pub fn set_followed(&self, followed: bool) {
        self.followed.store(followed, Ordering::Release);
    }

    pub fn num_partitions(&self) -> u16 {
        self.partitions.len() as u16
    }

    pub fn lock_partition(&self, p: u16) -> Option<MutexGuard<'_, Partition>> {
        self.partitions.get(p as usize).map(|m| m.lock())
    }

    /// Partition `p`'s branches of history, newest first: the one every node starts with,
    /// (`base_uuid`, 0), until a leader started another.
    pub fn history(&self, p: u16) -> Vec<FailoverEntry> {
        match self.lock_partition(p) {
            Some(part) if !part.history.entries().is_empty() => part.history.entries().to_vec(),
            _ => vec![self.base_entry()],
        }
    }

    /// The entry every partition's history starts with.
    pub fn base_entry(&self) -> FailoverEntry {
        FailoverEntry {
            uuid: base_uuid(&self.name),
            seqno: 0,
        }
    }

    /// Partition `p`'s last sequence number (0 before the first message and for a partition
    /// the topic lacks).
    pub fn high_water_mark(&self, p: u16) -> u64 {
        self.lock_partition(p)
            .map_or(0, |part| part.log.high_water_mark())
    }
}
