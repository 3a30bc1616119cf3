//! Engine configuration with its validation. Python validates the TOML first and names the key
//! path; these checks guard the native side with the same key names.

use std::path::PathBuf;
use std::time::Duration;

use crate::checkpoint::CheckpointConfig;
use crate::error::{Error, Result};

pub const MAX_VBUCKETS: u16 = 1024;

/// How the WAL keeps changes (`wal.mode`); see docs/storage.md for what each survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalMode {
    /// Nothing is written: a pure cache.
    None,
    /// write() per batch: survives the process dying, not the machine.
    Write,
    /// write() and fdatasync() per batch.
    Fsync,
}

impl WalMode {
    pub fn parse(s: &str) -> Option<WalMode> {
        match s {
            "none" => Some(WalMode::None),
            "write" => Some(WalMode::Write),
            "fsync" => Some(WalMode::Fsync),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            WalMode::None => "none",
            WalMode::Write => "write",
            WalMode::Fsync => "fsync",
        }
    }
}

/// Largest value sluice accepts at all; `max_item_size` may be set up to this.
pub const MAX_ITEM_SIZE_LIMIT: usize = 64 << 20;

/// Couchbase's durability levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    None,
    /// Written (and synced in fsync mode) to this node's WAL before the reply.
    Persist,
    Majority,
    MajorityAndPersistActive,
    PersistToMajority,
}

impl Durability {
    pub fn parse(s: &str) -> Option<Durability> {
        match s {
            "none" => Some(Durability::None),
            "persist" => Some(Durability::Persist),
            "majority" => Some(Durability::Majority),
            "majority_and_persist_active" => Some(Durability::MajorityAndPersistActive),
            "persist_to_majority" => Some(Durability::PersistToMajority),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::None => "none",
            Durability::Persist => "persist",
            Durability::Majority => "majority",
            Durability::MajorityAndPersistActive => "majority_and_persist_active",
            Durability::PersistToMajority => "persist_to_majority",
        }
    }
}

/// What a bucket does when a write would take it past its high watermark (`eviction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// The write gets a temporary failure: the bucket is a store, nothing is dropped.
    None,
    /// The write first evicts least recently used items (approximately: a clock per vbucket,
    /// see `ItemStore::next_victim`), each a deletion streamed and logged like any other: the
    /// bucket is a cache, as memcached and Couchbase ephemeral buckets with `nruEviction` are.
    Lru,
}

impl Eviction {
    pub const NAMES: [&'static str; 2] = ["none", "lru"];

    pub fn parse(s: &str) -> Option<Eviction> {
        match s {
            "none" => Some(Eviction::None),
            "lru" => Some(Eviction::Lru),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::None => "none",
            Eviction::Lru => "lru",
        }
    }
}

/// Eviction takes memory this far below the high watermark (at most 1% of the quota and
/// 1 MiB), so that one write pays for a batch of evictions rather than every write for one
/// (lock and counter round trips amortised), while the pause of a batch stays short.
const EVICTION_HEADROOM_MAX: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct BucketConfig {
    pub name: String,
    pub num_vbuckets: u16,
    /// Bytes of items and checkpoints the bucket may hold.
    pub memory_quota: usize,
    /// Above this fraction of the quota, writes get a temporary failure.
    pub high_watermark: f64,
    pub max_item_size: usize,
    /// Fraction of the memory quota checkpoints may use before slow cursors are dropped.
    pub checkpoint_memory_ratio: f64,
    pub durability: Durability,
    /// Replicas each vbucket is meant to have: a majority is of `1 + replicas` nodes.
    pub replicas: u8,
    /// How long a durable write waits for its level when the request names no timeout.
    pub durability_timeout: Duration,
    pub eviction: Eviction,
    /// Keep the bucket's keys in key order too (`sluice_proto::keyorder`: keys are MessagePack
    /// arrays of parts), so that `Engine::select` reads ranges: the bucket of an iproto space.
    pub ordered_keys: bool,
}

impl BucketConfig {
    pub fn named(name: &str) -> BucketConfig {
        BucketConfig {
            name: name.to_string(),
            num_vbuckets: 64,
            memory_quota: 1 << 30,
            high_watermark: 0.85,
            max_item_size: 20 << 20,
            checkpoint_memory_ratio: 0.3,
            durability: Durability::None,
            replicas: 1,
            durability_timeout: Duration::from_secs(10),
            eviction: Eviction::None,
            ordered_keys: false,
        }
    }

    pub fn high_watermark_bytes(&self) -> usize {
        (self.memory_quota as f64 * self.high_watermark) as usize
    }

    /// Where eviction stops: a little below the high watermark (see EVICTION_HEADROOM_MAX).
    pub fn eviction_low_mark_bytes(&self) -> usize {
        let headroom = (self.memory_quota / 100).min(EVICTION_HEADROOM_MAX);
        self.high_watermark_bytes().saturating_sub(headroom)
    }

    pub fn checkpoint_quota_bytes(&self) -> usize {
        (self.memory_quota as f64 * self.checkpoint_memory_ratio) as usize
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub data_dir: PathBuf,
    pub wal_mode: WalMode,
    pub wal_segment_size: u64,
    pub snapshot_count: usize,
    /// Zero turns periodic snapshots off.
    pub snapshot_interval: Duration,
    pub checkpoint: CheckpointConfig,
    pub tombstone_purge_age: Duration,
    pub expiry_pager_interval: Duration,
    pub force_recovery: bool,
    /// This node follows another (`replication.replica_of`): its vbuckets come up as replicas,
    /// new ones empty and without history, active ones turned replica.
    pub replica: bool,
    pub buckets: Vec<BucketConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            data_dir: PathBuf::from("sluice-data"),
            wal_mode: WalMode::Write,
            wal_segment_size: 64 << 20,
            snapshot_count: 2,
            snapshot_interval: Duration::from_secs(3600),
            checkpoint: CheckpointConfig::default(),
            tombstone_purge_age: Duration::from_secs(3 * 24 * 3600),
            expiry_pager_interval: Duration::from_secs(60),
            force_recovery: false,
            replica: false,
            buckets: vec![BucketConfig::named("default")],
        }
    }
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        key: key.into(),
        reason: reason.into(),
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<()> {
        if self.data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if self.wal_segment_size < 4096 {
            return Err(invalid("wal.segment_size", "must be at least 4096 bytes"));
        }
        if self.snapshot_count < 1 {
            return Err(invalid("snapshot.count", "must be at least 1"));
        }
        if self.checkpoint.max_items < 1 {
            return Err(invalid("checkpoint.max_items", "must be at least 1"));
        }
        if self.checkpoint.period.is_zero() {
            return Err(invalid("checkpoint.period", "must be positive"));
        }
        if self.expiry_pager_interval.is_zero() {
            return Err(invalid("expiry_pager_interval", "must be positive"));
        }
        let mut names = std::collections::HashSet::new();
        for b in self.buckets.iter() {
            let key = |k: &str| format!("buckets.{}.{k}", b.name);
            let name_ok = !b.name.is_empty()
                && b.name.len() <= 100
                && b.name
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || b"-_.%".contains(&c));
            if !name_ok {
                return Err(invalid(
                    key("name"),
                    format!("{:?}: 1 to 100 of A-Z a-z 0-9 - _ . %", b.name),
                ));
            }
            if !names.insert(b.name.as_str()) {
                return Err(invalid(
                    key("name"),
                    format!("bucket {:?} is defined twice", b.name),
                ));
            }
            if b.num_vbuckets == 0 || b.num_vbuckets > MAX_VBUCKETS {
                return Err(invalid(
                    key("num_vbuckets"),
                    format!("{} is not in 1..={MAX_VBUCKETS}", b.num_vbuckets),
                ));
            }
            if b.memory_quota < 1 << 20 {
                return Err(invalid(key("memory_quota"), "must be at least 1 MiB"));
            }
            if !(b.high_watermark > 0.0 && b.high_watermark <= 1.0) {
                return Err(invalid(key("high_watermark"), "must be in (0, 1]"));
            }
            if !(b.checkpoint_memory_ratio > 0.0 && b.checkpoint_memory_ratio <= 1.0) {
                return Err(invalid(key("checkpoint_memory_ratio"), "must be in (0, 1]"));
            }
            if b.replicas > 3 {
                return Err(invalid(
                    key("replicas"),
                    format!("{} is not in 0..=3", b.replicas),
                ));
            }
            if b.durability_timeout.is_zero() {
                return Err(invalid(key("durability_timeout"), "must be positive"));
            }
            if b.max_item_size == 0 || b.max_item_size > MAX_ITEM_SIZE_LIMIT {
                return Err(invalid(
                    key("max_item_size"),
                    format!("must be in 1..={MAX_ITEM_SIZE_LIMIT}"),
                ));
            }
        }
        if !self.buckets.iter().any(|b| b.name == "default") {
            return Err(invalid("buckets", "the bucket \"default\" must exist"));
        }
        Ok(())
    }
}
