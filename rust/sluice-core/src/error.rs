//! Errors the engine reports to its callers. Each carries enough to print a clear message.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Key empty or longer than 250 bytes.
    InvalidKey(String),
    /// Value larger than the bucket's `max_item_size`.
    TooBig {
        size: usize,
        max: usize,
    },
    NotFound,
    /// ADD on an existing key, or a CAS mismatch.
    Exists,
    /// APPEND / PREPEND of a missing key (memcached's NOT_STORED).
    NotStored,
    /// INCR / DECR of a value that is not a decimal number.
    NotNumeric,
    /// A write without the CAS of the lock GET_LOCKED put on the key (Couchbase's `locked`).
    Locked,
    /// GET_LOCKED of a key locked already, or UNLOCK_KEY with another CAS than the lock's
    /// (Couchbase's `locked_tmpfail`): retry once the lock is released.
    LockedTmpFail,
    /// UNLOCK_KEY of a key that is not locked.
    NotLocked,
    /// The vbucket is not active on this node (replica, pending or dead).
    NotMyVbucket(u16),
    /// Memory above the high watermark, or the WAL is refusing writes for now; retry later.
    TempFail(String),
    /// The WAL could not write or sync the block holding this change. The change is applied in
    /// memory and the WAL keeps retrying it; its durability is unknown until then.
    WalFailed(String),
    /// A durability level the bucket's configuration cannot provide (e.g. persist with wal.mode=none).
    DurabilityImpossible(String),
    /// The write is applied here but its durability level was not met in time: it may or may
    /// not survive a failover (Couchbase's SyncWriteAmbiguous).
    SyncWriteAmbiguous(String),
    NoSuchBucket(String),
    InvalidConfig {
        key: String,
        reason: String,
    },
    InvalidArgument(String),
    /// Damage found during recovery somewhere other than the torn tail of the last WAL segment.
    Corrupt {
        file: PathBuf,
        offset: u64,
        reason: String,
    },
    Io(String),
    Closed,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidKey(why) => write!(f, "invalid key: {why}"),
            Error::TooBig { size, max } => {
                write!(f, "value too large: {size} bytes, max_item_size is {max}")
            }
            Error::NotFound => write!(f, "key not found"),
            Error::Exists => write!(f, "key exists (or CAS mismatch)"),
            Error::NotStored => write!(f, "not stored: the key does not exist"),
            Error::NotNumeric => write!(f, "the value is not a decimal number"),
            Error::Locked => write!(f, "the key is locked (write with the lock's CAS)"),
            Error::LockedTmpFail => write!(f, "the key is locked by another holder"),
            Error::NotLocked => write!(f, "the key is not locked"),
            Error::NotMyVbucket(vb) => write!(f, "vbucket {vb} is not active on this node"),
            Error::TempFail(why) => write!(f, "temporary failure: {why}"),
            Error::WalFailed(why) => write!(f, "WAL write failed: {why}"),
            Error::DurabilityImpossible(why) => write!(f, "durability impossible: {why}"),
            Error::SyncWriteAmbiguous(why) => write!(f, "sync write ambiguous: {why}"),
            Error::NoSuchBucket(b) => write!(f, "no such bucket: {b}"),
            Error::InvalidConfig { key, reason } => write!(f, "invalid config: {key}: {reason}"),
            Error::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            Error::Corrupt {
                file,
                offset,
                reason,
            } => {
                write!(
                    f,
                    "corrupt file {} at byte offset {offset}: {reason}",
                    file.display()
                )
            }
            Error::Io(why) => write!(f, "I/O error: {why}"),
            Error::Closed => write!(f, "engine is closed"),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    pub fn io(context: impl fmt::Display, e: std::io::Error) -> Error {
        Error::Io(format!("{context}: {e}"))
    }
}

pub type Result<T> = std::result::Result<T, Error>;
