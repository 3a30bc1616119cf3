//! sluice-core: the storage engine. Items in vbuckets, seqnos and failover logs, the WAL,
//! snapshots and recovery, the checkpoint manager with cursors, dedup and backfill; the logs of
//! topic partitions (`partition_log`), which keep every message.
//! No sockets and no Python here.
//!
//! May depend on sluice-proto only; no two of its modules import each other, directly or
//! around a loop (tests/test_layering.py).

#[cfg(feature = "mimalloc")]
pub mod alloc;
pub mod backfill;
pub mod bucket;
pub mod catalog;
pub mod checkpoint;
pub mod config;
pub mod dump;
pub mod durability;
pub mod engine;
pub mod errinj;
pub mod error;
pub mod failover;
pub mod hash;
pub mod history;
pub mod hlc;
pub mod item;
pub mod item_store;
pub mod locks;
pub mod partition_log;
mod prefault;
pub mod recovery;
pub mod signal;
pub mod snapshot;
pub mod topic;
pub mod vbucket;
pub mod wal;

pub use config::{BucketConfig, Durability, EngineConfig};
pub use durability::Requirement;
pub use engine::{
    DocumentUpdate, Engine, FollowedChange, Landing, MutationResult, SelectIterator, StoreMode,
    StoreRequest, Update, Written,
};
pub use error::{Error, Result};
