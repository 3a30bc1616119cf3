//! A topic: a named set of partitions, each an append-only log (`partition_log`) that keeps
//! every message produced to it, logged to the WAL like any change (`Engine::produce`).
//! Topic ids are their own space, apart from bucket ids; a topic's WAL records carry its id
//! where a change carries its bucket's, and the partition where a change carries its vbucket.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::durability::ReplicaAcks;
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
}

impl Partition {
    pub fn new(log: PartitionLog, last_lsn: u64) -> Partition {
        Partition {
            log,
            last_lsn,
            unwritten: VecDeque::new(),
            produced_messages: 0,
            produced_bytes: 0,
            consumed_bytes: 0,
        }
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

    /// Partition `p`'s last sequence number (0 before the first message and for a partition
    /// the topic lacks).
    pub fn high_water_mark(&self, p: u16) -> u64 {
        self.lock_partition(p)
            .map_or(0, |part| part.log.high_water_mark())
    }
}
