//! A topic: a named set of partitions, each an append-only log (`partition_log`) that keeps
//! every message produced to it, logged to the WAL like any change (`Engine::produce`).
//! Topic ids are their own space, apart from bucket ids; a topic's WAL records carry its id
//! where a change carries its bucket's, and the partition where a change carries its vbucket.

use parking_lot::{Mutex, MutexGuard};

use crate::partition_log::{LogConfig, PartitionLog};
use crate::signal::ChangeSignal;

/// One partition: its log and the last WAL LSN applied to it (WAL replay skips what a snapshot
/// of it holds).
pub struct Partition {
    pub log: PartitionLog,
    pub last_lsn: u64,
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
}

impl Topic {
    pub fn new(
        id: u16,
        name: String,
        config_text: String,
        config: LogConfig,
        partitions: Vec<Partition>,
    ) -> Topic {
        Topic {
            id,
            name,
            config_text,
            config,
            partitions: partitions.into_iter().map(Mutex::new).collect(),
            changes: ChangeSignal::default(),
        }
    }

    pub fn num_partitions(&self) -> u16 {
        self.partitions.len() as u16
    }

    pub fn lock_partition(&self, p: u16) -> Option<MutexGuard<'_, Partition>> {
        self.partitions.get(p as usize).map(|m| m.lock())
    }
}
