//! The write-ahead log, in Tarantool's cut: `record` is the row codec, `xlog` the file format
//! (text header, checksummed blocks, EOF marker), `writer` the group-commit thread.

pub mod record;
pub mod writer;
pub mod xlog;

pub use crate::config::WalMode;
pub use record::{Record, RecordBody};
pub use writer::WalWriter;
