//! A topic partition's log, as TANK and Kafka keep one: every message is kept, in the order
//! produced, numbered by an absolute sequence number from 1, until retention drops it. Nothing
//! is deduplicated. Bundles (`sluice_proto::tank::bundle`) are stored exactly as produced,
//! each after its varint length, which is how a consume answer carries them: a read copies
//! whole stored bundles into the answer without decoding or re-encoding them.
//!
//! The log is a list of segments. Each holds its bundles' bytes and a sparse index from
//! sequence number to byte offset, one entry at least every `index_interval` bytes (and for
//! the first bundle), so that a read finds its bundle by a binary search and a short scan of
//! bundle headers. The newest segment takes appends until the next bundle would take it past
//! `segment_bytes`. Retention drops whole segments, oldest first, never the newest: by total
//! bytes and by the age of a segment's newest bundle (when it arrived, as TANK's broker goes by
//! its segments' times; producers' timestamps are theirs to set).
//!
//! A sparse bundle (ProduceWithSeqnum's, as TANK's mirroring writes them) numbers its own
//! messages: it is placed at its first sequence number and takes every number up to its last,
//! though its messages may skip some; its readers number its messages from its header. Offsets
//! within a segment are u32: `segment_bytes` must stay well under 4 GiB.
//!
//! A log with a directory (`in_dir`, every topic's) keeps each segment in a file of its own
//! there, named by its first sequence number (`00000000000000000001.log`), written once as
//! bundles arrive and read through the page cache (`segment_bytes`); retention deletes whole
//! files. A log without one keeps its segments in memory.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use sluice_proto::tank::bundle::Bundle;
use sluice_proto::tank::{varint, DecodeError, Reader};

mod segment_bytes;
use segment_bytes::SegmentBytes;

/// The largest message set a Snappy bundle may expand to.
const MAX_SET: usize = 64 << 20;
/// Index entries written to a segment's index file together: recovery reads at most this many
/// entries' worth of bytes (`index_interval` each) past the last one written.
const INDEX_BATCH: usize = 64;
/// Appends that take a segment into a new step of this many bytes have the next step's pages
/// faulted in ahead of them (`crate::prefault`).
const PREFAULT_STEP: usize = 1 << 20;

thread_local! {
    /// `PartitionLog::check`'s buffer for sparse Snappy message sets.
    static SET: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How a partition's log is cut into segments and how long it keeps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogConfig {
    /// A segment holds at most this many bytes (a bundle larger goes alone into one); its
    /// room is reserved when it starts (address space for a file's, memory otherwise) and
    /// taken as it fills.
    pub segment_bytes: usize,
    /// Bytes between two entries of a segment's sparse index.
    pub index_interval: usize,
    /// Oldest segments are dropped while the log holds more bytes than this.
    pub retention_bytes: Option<u64>,
    /// Segments whose newest bundle arrived longer ago than this (ms) are dropped.
    pub retention_ms: Option<u64>,
    /// In a cluster, the partitions' copies, the leader's among them (Kafka's
    /// `replication.factor`); None: the cluster's `replicas` + 1. A node on its own keeps one.
    pub replication_factor: Option<u8>,
}

impl Default for LogConfig {
    fn default() -> LogConfig {
        LogConfig {
            segment_bytes: 64 << 20,
            index_interval: 4096,
            retention_bytes: None,
            retention_ms: None,
            replication_factor: None,
        }
    }
}

impl LogConfig {
    /// Settings from a topic's configuration text, TANK's and Kafka's `key=value` lines (blank
    /// lines and `#` comments skipped): `log.segment.bytes`, `log.index.interval.bytes`,
    /// `log.retention.bytes`, `log.retention.ms`, `.secs` or `.hours` (the `log.` prefix is
    /// optional), and Kafka's `replication.factor` (1 to 16). Anything else is an error naming
    /// the line.
    pub fn from_text(text: &str) -> Result<LogConfig, String> {
        let mut c = LogConfig::default();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| format!("{line:?} is not key=value"))?;
            let (key, value) = (key.trim(), value.trim());
            let n: u64 = value
                .parse()
                .map_err(|_| format!("{key}: {value:?} is not a whole number"))?;
            match key.strip_prefix("log.").unwrap_or(key) {
                "segment.bytes" if (4096..=1 << 30).contains(&n) => c.segment_bytes = n as usize,
                "segment.bytes" => return Err(format!("{key}: {n} is not in 4096..=1073741824")),
                "index.interval.bytes" if (64..=1 << 20).contains(&n) => {
                    c.index_interval = n as usize
                }
                "index.interval.bytes" => return Err(format!("{key}: {n} is not in 64..=1048576")),
                "retention.bytes" => c.retention_bytes = Some(n),
                "retention.ms" => c.retention_ms = Some(n),
                "retention.secs" => c.retention_ms = Some(n.saturating_mul(1000)),
                "retention.hours" => c.retention_ms = Some(n.saturating_mul(3_600_000)),
                "replication.factor" if (1..=16).contains(&n) => {
                    c.replication_factor = Some(n as u8)
                }
                "replication.factor" => return Err(format!("{key}: {n} is not in 1..=16")),
                _ => return Err(format!("{key}: not a topic setting")),
            }
        }
        Ok(c)
    }
}

struct Segment {
    /// Its file, if it has one.
    path: Option<PathBuf>,
    /// Its index's file (`<first sequence number>.index`: each entry 8 bytes, the sequence
    /// number relative to the segment's first and the offset, u32 LE each), appended to as
    /// the index grows, so that recovery reads a segment's index and its tail, not its bytes.
    index_file: Option<std::fs::File>,
    /// Entries of `index` in its file; the others are written `INDEX_BATCH` at a time, when
    /// the segment is sealed, and when it is dropped.
    index_written: usize,
    /// The sequence number of its first message, and one past its last.
    base_seq: u64,
    next_seq: u64,
    /// Bundles, each after its varint length.
    data: SegmentBytes,
    /// (sequence number - base_seq, offset of the bundle whose first message it is).
    index: Vec<(u32, u32)>,
    /// When its newest bundle arrived (ms since the epoch), for retention by age.
    newest_ms: u64,
}

impl Drop for Segment {
    /// A log closed (or a segment dropped) leaves its whole index in its file.
    fn drop(&mut self) {
        if self.index_written < self.index.len() {
            self.write_index();
        }
    }
}

impl Segment {
    /// An empty segment whose bytes are reserved up front (`reserve`): appends never move it,
    /// and pages not written to are not resident. In `dir`, a new file there.
    fn new(base_seq: u64, reserve: usize, dir: Option<&Path>) -> Result<Segment, AppendError> {
        let (path, data, index_file) = match dir {
            None => (None, SegmentBytes::with_capacity(reserve), None),
            Some(dir) => {
                let path = dir.join(format!("{base_seq:020}.log"));
                let storage =
                    |e: std::io::Error| AppendError::Storage(format!("{}: {e}", path.display()));
                let data = std::fs::create_dir_all(dir)
                    .and_then(|()| SegmentBytes::in_file(&path, reserve))
                    .map_err(storage)?;
                let index_file = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(true)
                    .open(path.with_extension("index"))
                    .map_err(storage)?;
                (Some(path), data, Some(index_file))
            }
        };
        Ok(Segment {
            path,
            index_file,
            index_written: 0,
            base_seq,
            next_seq: base_seq,
            data,
            index: Vec::new(),
            newest_ms: 0,
        })
    }

    /// Deletes its file (retention dropped it, or it was never used); answers still being sent
    /// from its bytes keep them.
    fn remove_file(&self) {
        if let Some(p) = &self.path {
            for p in [p.clone(), p.with_extension("index")] {
                if let Err(e) = std::fs::remove_file(&p) {
                    log::warn!("cannot delete the topic segment file {}: {e}", p.display());
                }
            }
        }
    }

    /// Adds an index entry; its file gets the entries `INDEX_BATCH` at a time.
    fn index_push(&mut self, rel: u32, at: u32) {
        self.index.push((rel, at));
        if self.index.len() - self.index_written >= INDEX_BATCH {
            self.write_index();
        }
    }

    /// Writes the entries its index file lacks. A file that cannot take them (a full disk) is
    /// left behind: recovery reads past its last entry.
    fn write_index(&mut self) {
        let Some(f) = &self.index_file else {
            return;
        };
        let mut bytes = Vec::with_capacity((self.index.len() - self.index_written) * 8);
        for &(rel, at) in &self.index[self.index_written..] {
            bytes.extend_from_slice(&rel.to_le_bytes());
            bytes.extend_from_slice(&at.to_le_bytes());
        }
        let offset = self.index_written as u64 * 8;
        match std::os::unix::fs::FileExt::write_all_at(f, &bytes, offset) {
            Ok(()) => self.index_written = self.index.len(),
            Err(e) => log::debug!("a topic segment's index entries not written: {e}"),
        }
    }

    /// It takes no more appends: its index is written whole and its files closed (its bytes
    /// stay mapped), so that a partition keeps descriptors open for its newest segment only.
    fn seal(&mut self) {
        self.write_index();
        if self.index_written == self.index.len() {
            self.index_file = None;
        }
        self.data.seal();
    }

    /// Its index back to `len` entries (an append taken back).
    fn index_truncate(&mut self, len: usize) {
        self.index.truncate(len);
        if self.index_written > len {
            self.index_written = len;
            if let Some(f) = &self.index_file {
                let _ = f.set_len(len as u64 * 8);
            }
        }
    }

    /// The offset of the bundle holding `seq` and that bundle's first sequence number.
    fn locate(&self, seq: u64) -> (usize, u64) {
        let rel = (seq - self.base_seq) as u32;
        let i = self.index.partition_point(|&(r, _)| r <= rel);
        let (r, at) = self.index[i - 1];
        let (mut at, mut first) = (at as usize, self.base_seq + r as u64);
        loop {
            let (len, count) = stored_bundle(&self.data.as_slice()[at..]);
            if seq < first + count {
                return (at, first);
            }
            first += count;
            at += len;
        }
    }
}

/// The length of the stored bundle at the front of `data` (with its varint) and how many
/// sequence numbers it takes (`Bundle::span`). Stored bundles were checked when appended.
fn stored_bundle(data: &[u8]) -> (usize, u64) {
    let mut r = Reader::new(data);
    let len = r
        .varint_len("a stored bundle")
        .expect("stored bundles are whole");
    let head = r.position();
    let span = Bundle::parse(&data[head..head + len])
        .expect("stored bundles were parsed when appended")
        .span();
    (head + len, span)
}

/// The length of the stored bundle at the front of `data` (with its varint) and how many
/// sequence numbers it takes, or why it cannot be read (recovery's reading of segment files).
fn checked_bundle(data: &[u8]) -> Result<(usize, u64), String> {
    let mut r = Reader::new(data);
    let len = r.varint_len("a stored bundle").map_err(|e| e.to_string())?;
    let head = r.position();
    if data.len() - head < len {
        return Err(format!("a bundle of {len} bytes cut short"));
    }
    let b = Bundle::parse(&data[head..head + len]).map_err(|e| e.to_string())?;
    if b.span() == 0 {
        return Err("a bundle of no message".into());
    }
    Ok((head + len, b.span()))
}

/// Reads a segment's bundles from its index's last entry (the start without one) to its end:
/// where the readable bundles end, the sequence number after them, and the offset of one that
/// cannot be read and why (a torn or damaged tail).
fn scan(data: &[u8], index: &[(u32, u32)], base: u64) -> (usize, u64, Option<(usize, String)>) {
    let (mut at, mut next) = index
        .last()
        .map_or((0, base), |&(r, o)| (o as usize, base + r as u64));
    while at < data.len() {
        match checked_bundle(&data[at..]) {
            Ok((len, span)) => {
                at += len;
                next += span;
            }
            Err(why) => return (at, next, Some((at, why))),
        }
    }
    (at, next, None)
}

/// The index with the entries a scan from its last one adds, up to `end`: one at least every
/// `interval` bytes (and for the first bundle).
fn scan_index(
    data: &[u8],
    index: &[(u32, u32)],
    base: u64,
    interval: usize,
    end: usize,
) -> Vec<(u32, u32)> {
    let mut out = index.to_vec();
    let (mut at, mut next) = index
        .last()
        .map_or((0, base), |&(r, o)| (o as usize, base + r as u64));
    while at < end {
        let (len, span) = checked_bundle(&data[at..end]).expect("scanned before");
        if out.last().is_none_or(|&(_, o)| at - o as usize >= interval) {
            out.push(((next - base) as u32, at as u32));
        }
        at += len;
        next += span;
    }
    out
}

/// The entries below `end` (what a cut tail leaves).
fn index_upto(mut index: Vec<(u32, u32)>, end: usize) -> Vec<(u32, u32)> {
    index.retain(|&(_, o)| (o as usize) < end);
    index
}

/// A segment's index file's entries that can be trusted: from the first, (0, 0), ascending,
/// within the segment's `len` bytes; the rest is dropped (recovery reads past them).
fn read_index(path: &Path, len: usize) -> Vec<(u32, u32)> {
    let bytes = std::fs::read(path).unwrap_or_default();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for e in bytes.chunks_exact(8) {
        let rel = u32::from_le_bytes(e[..4].try_into().expect("4 bytes"));
        let at = u32::from_le_bytes(e[4..].try_into().expect("4 bytes"));
        let ordered = match out.last() {
            None => (rel, at) == (0, 0),
            Some(&(r, o)) => rel > r && at > o,
        };
        if !ordered || at as usize >= len {
            break;
        }
        out.push((rel, at));
    }
    out
}

/// Writes a segment's index file whole; returns it open for the entries to come.
fn write_index(path: &Path, index: &[(u32, u32)]) -> std::io::Result<std::fs::File> {
    let mut bytes = Vec::with_capacity(index.len() * 8);
    for &(r, o) in index {
        bytes.extend_from_slice(&r.to_le_bytes());
        bytes.extend_from_slice(&o.to_le_bytes());
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(path)?;
    std::os::unix::fs::FileExt::write_all_at(&f, &bytes, 0)?;
    Ok(f)
}

/// Stored bundles a read found: borrowed while the partition is locked (they deref to their
/// bytes), or shared past that (`share`) to be sent as they are.
#[derive(Clone, Copy)]
pub struct Stored<'a> {
    data: &'a SegmentBytes,
    start: usize,
    end: usize,
}

impl Stored<'_> {
    /// The same bytes as a `Bytes` that keeps them alive on its own, without a copy.
    pub fn share(&self) -> Bytes {
        self.data.share(self.start..self.end)
    }

    /// The same bytes shared, with where they lie in their segment's file.
    pub fn share_for_send(&self) -> SharedChunk {
        SharedChunk {
            bytes: self.share(),
            file: self.data.file_for_send().map(|f| (f, self.start as u64)),
        }
    }
}

/// Stored bundles shared past the partition's lock, and where they lie in their segment's file:
/// a plain connection sends them from the file (`sendfile`, no copy through the process), a
/// TLS one encrypts them from the mapping. A file's bytes below what was read never change.
#[derive(Clone)]
pub struct SharedChunk {
    pub bytes: Bytes,
    /// The segment's file and the offset of `bytes` in it.
    pub file: Option<(std::sync::Arc<std::fs::File>, u64)>,
}

impl std::ops::Deref for Stored<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.data.as_slice()[self.start..self.end]
    }
}

impl PartialEq for Stored<'_> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Stored<'_> {}

impl std::fmt::Debug for Stored<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stored({} bytes)", self.len())
    }
}

/// Where a read puts the bundles it found: a copy into a buffer, or a shared handle on them.
pub trait ChunkSink {
    fn put(&mut self, bundles: Stored<'_>);
}

impl ChunkSink for Vec<u8> {
    fn put(&mut self, bundles: Stored<'_>) {
        self.extend_from_slice(&bundles);
    }
}

impl ChunkSink for Vec<Bytes> {
    fn put(&mut self, bundles: Stored<'_>) {
        self.push(bundles.share());
    }
}

impl ChunkSink for Vec<SharedChunk> {
    fn put(&mut self, bundles: Stored<'_>) {
        self.push(bundles.share_for_send());
    }
}

/// What a read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read<'a> {
    /// Whole stored bundles (each after its varint length) from the one holding the sequence
    /// number asked for; `base_seq` is that bundle's first message.
    Chunk {
        base_seq: u64,
        high_water_mark: u64,
        bundles: Stored<'a>,
    },
    /// The sequence number asked for is the next one to be produced: nothing yet.
    Tail {
        high_water_mark: u64,
        first_available: u64,
    },
    /// Before the first message kept or past the next one to be produced.
    OutOfRange {
        high_water_mark: u64,
        first_available: u64,
    },
}

/// Why an append was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AppendError {
    Bundle(DecodeError),
    /// A sparse bundle whose messages are not numbered in order within its first and last.
    SparseOrder {
        seq: u64,
    },
    /// Recovery or a feed placed a bundle before the log's end.
    Behind {
        first_seq: u64,
        next_seq: u64,
    },
    /// Its segment file could not be made or written (a full disk): the file and why.
    Storage(String),
}

impl std::fmt::Display for AppendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AppendError::Bundle(e) => write!(f, "a bad bundle: {e}"),
            AppendError::SparseOrder { seq } => write!(
                f,
                "a sparse bundle numbers a message {seq}, out of order or past its last"
            ),
            AppendError::Behind {
                first_seq,
                next_seq,
            } => write!(
                f,
                "a bundle from sequence number {first_seq} is behind the log's next, {next_seq}"
            ),
            AppendError::Storage(why) => write!(f, "cannot write the segment file {why}"),
        }
    }
}

impl std::error::Error for AppendError {}

/// What `check` found in a bundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    pub count: u64,
    /// A sparse bundle's own first sequence number.
    pub first: Option<u64>,
    /// How many sequence numbers it takes (`Bundle::span`).
    pub span: u64,
}

/// The directory, inside a partition's, where a segment cut back is written before it
/// replaces the segment (`PartitionLog::truncate_after`); not a segment file, so opening the
/// partition passes it by.
const CUT_DIR: &str = "cut";

pub struct PartitionLog {
    config: LogConfig,
    /// Where its segment files are; None: in memory.
    dir: Option<PathBuf>,
    segments: VecDeque<Segment>,
    next_seq: u64,
    bytes: u64,
}

/// Where a log stood before an append, to take the append back (`PartitionLog::restore`).
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    segments: usize,
    len: usize,
    index: usize,
    seg_next_seq: u64,
    newest_ms: u64,
    next_seq: u64,
    bytes: u64,
}

impl PartitionLog {
    /// An empty log in memory whose first message will be sequence number 1.
    pub fn new(config: LogConfig) -> PartitionLog {
        PartitionLog::starting_at(config, 1)
    }

    /// An empty log whose segments are files in `dir` (made when the first is), first message
    /// sequence number 1.
    pub fn in_dir(config: LogConfig, dir: PathBuf) -> PartitionLog {
        PartitionLog {
            dir: Some(dir),
            ..PartitionLog::new(config)
        }
    }

    /// An empty log whose next message is `next_seq` (recovery of a log retention had cut).
    pub fn starting_at(config: LogConfig, next_seq: u64) -> PartitionLog {
        PartitionLog {
            config,
            dir: None,
            segments: VecDeque::new(),
            next_seq: next_seq.max(1),
            bytes: 0,
        }
    }

    /// Where its segment files are, if it keeps them in files.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The log whose segment files are in `dir` (none there: an empty log). Each segment's
    /// index is read from its file and only the bytes after its last entry are read, to find
    /// where the segment ends. A bundle cut short or unreadable at the end of the newest
    /// segment (a torn write) is cut off, with a warning; one in an older segment is damage,
    /// refused with the file and offset. An index that does not agree with its segment is
    /// rebuilt from the segment, with a warning. A segment's arrival time (for retention by
    /// age) is its file's modification time.
    pub fn open_dir(config: LogConfig, dir: PathBuf) -> Result<PartitionLog, String> {
        let mut log = PartitionLog::in_dir(config, dir.clone());
        let mut files = Vec::new();
        match std::fs::read_dir(&dir) {
            Ok(entries) => {
                for e in entries {
                    let e = e.map_err(|e| format!("{}: {e}", dir.display()))?;
                    let name = e.file_name();
                    let Some(base) = name
                        .to_str()
                        .and_then(|n| n.strip_suffix(".log"))
                        .and_then(|n| n.parse::<u64>().ok())
                    else {
                        continue;
                    };
                    files.push((base, e.path()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(log),
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        }
        files.sort();
        let newest = files.len().saturating_sub(1);
        for (i, (base, path)) in files.into_iter().enumerate() {
            let err = |e: std::io::Error| format!("{}: {e}", path.display());
            let meta = std::fs::metadata(&path).map_err(err)?;
            let file_len = meta.len() as usize;
            let newest_ms = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_millis() as u64);
            if !log.segments.is_empty() && base < log.next_seq {
                return Err(format!(
                    "{}: starts at sequence number {base}, behind the end of the segment \
                     before it ({})",
                    path.display(),
                    log.next_seq
                ));
            }
            if file_len == 0 {
                // An empty segment (started, nothing written) is not kept.
                let empty = Segment {
                    path: Some(path.clone()),
                    index_file: None,
                    index_written: 0,
                    base_seq: base,
                    next_seq: base,
                    data: SegmentBytes::with_capacity(1),
                    index: Vec::new(),
                    newest_ms,
                };
                empty.remove_file();
                continue;
            }
            let data =
                SegmentBytes::open_file(&path, config.segment_bytes, file_len).map_err(err)?;
            let index_path = path.with_extension("index");
            let mut index = read_index(&index_path, file_len);
            let bytes = data.as_slice();
            let (mut at, mut next, mut bad) = scan(bytes, &index, base);
            let at_last_entry = |(b, _): &(usize, String)| {
                index
                    .last()
                    .is_some_and(|&(_, o)| *b == o as usize && o > 0)
            };
            if bad.as_ref().is_some_and(at_last_entry) {
                log::warn!(
                    "the index of {} does not agree with the segment: rebuilt from it",
                    path.display()
                );
                index.clear();
                (at, next, bad) = scan(bytes, &index, base);
            }
            // The entries `scan` added (past the last one read) are in `index` too.
            let index = index_upto(
                scan_index(bytes, &index, base, config.index_interval, at),
                at,
            );
            if let Some((offset, why)) = bad {
                if i != newest {
                    return Err(format!(
                        "{}: damaged at offset {offset}: {why}",
                        path.display()
                    ));
                }
                log::warn!(
                    "cutting a torn bundle off the end of {} at offset {offset} ({why})",
                    path.display()
                );
            }
            let mut data = data;
            if at < file_len {
                data.truncate(at).map_err(err)?;
            }
            let index_file = write_index(&index_path, &index)
                .map_err(|e| format!("{}: {e}", index_path.display()))?;
            log.bytes += at as u64;
            log.next_seq = next;
            if let Some(older) = log.segments.back_mut() {
                older.seal();
            }
            let index_written = index.len();
            log.segments.push_back(Segment {
                path: Some(path),
                index_file: Some(index_file),
                index_written,
                base_seq: base,
                next_seq: next,
                data,
                index,
                newest_ms,
            });
        }
        Ok(log)
    }

    /// Where the last bundle appended is stored: its segment (by first sequence number) and the
    /// offset of its length's varint there, for a bundle of `len` bytes.
    pub fn last_position(&self, len: usize) -> (u64, u32) {
        let seg = self.segments.back().expect("a bundle was appended");
        let mut head = [0u8; 10];
        let stored = varint(&mut head, len as u64).len() + len;
        (seg.base_seq, (seg.data.len() - stored) as u32)
    }

    /// The newest segment's file, which the next append writes to (to be synced with the WAL).
    pub fn newest_file(&self) -> Option<&std::sync::Arc<std::fs::File>> {
        self.segments.back().and_then(|s| s.data.file())
    }

    /// Where the log stands, to take back what is appended next (`restore`).
    pub fn mark(&self) -> Mark {
        let last = self.segments.back();
        Mark {
            segments: self.segments.len(),
            len: last.map_or(0, |s| s.data.len()),
            index: last.map_or(0, |s| s.index.len()),
            seg_next_seq: last.map_or(0, |s| s.next_seq),
            newest_ms: last.map_or(0, |s| s.newest_ms),
            next_seq: self.next_seq,
            bytes: self.bytes,
        }
    }

    /// Takes back what was appended since `mark` (its WAL record could not be queued): the
    /// segments it started go, with their files, and the one it was in ends where it did.
    pub fn restore(&mut self, mark: Mark) {
        while self.segments.len() > mark.segments {
            let s = self.segments.pop_back().expect("more than the mark's");
            s.remove_file();
        }
        if let Some(s) = self.segments.back_mut() {
            if let Err(e) = s.data.truncate(mark.len) {
                log::warn!("a topic segment file not cut back after a refused append: {e}");
            }
            s.index_truncate(mark.index);
            s.next_seq = mark.seg_next_seq;
            s.newest_ms = mark.newest_ms;
        }
        self.next_seq = mark.next_seq;
        self.bytes = mark.bytes;
    }

    /// The sequence number the next message gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The last message's sequence number (0 before the first).
    pub fn high_water_mark(&self) -> u64 {
        self.next_seq - 1
    }

    /// The oldest message kept (the next one to be produced when none is).
    pub fn first_available(&self) -> u64 {
        self.segments.front().map_or(self.next_seq, |s| s.base_seq)
    }

    /// Bytes of stored bundles.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes held beyond the bundles and their lengths: the sparse indexes.
    pub fn overhead(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.index.capacity() * 8 + std::mem::size_of::<Segment>())
            .sum()
    }

    /// Checks a bundle as produced (without its length): its header, and its message set as
    /// `Bundle::check_set` does (a plain set message by message, a Snappy one as Snappy,
    /// without decompressing it); a sparse bundle's messages are read, to check they are
    /// numbered in order within its first and last.
    pub fn check(bundle: &[u8]) -> Result<Checked, AppendError> {
        let b = Bundle::parse(bundle).map_err(AppendError::Bundle)?;
        let checked = Checked {
            count: b.count,
            first: b.sparse.map(|(first, _)| first),
            span: b.span(),
        };
        let Some((first, last)) = b.sparse else {
            b.check_set(MAX_SET).map_err(AppendError::Bundle)?;
            return Ok(checked);
        };
        if last >= u64::MAX - 1 {
            // u64::MAX is a consumer's "the tail": no message may be numbered up there.
            return Err(AppendError::SparseOrder { seq: last });
        }
        let walk = |set: &[u8]| {
            let mut next = first;
            for m in b.messages(set, 0) {
                let m = m.map_err(AppendError::Bundle)?;
                if m.seq < next || m.seq > last {
                    return Err(AppendError::SparseOrder { seq: m.seq });
                }
                next = m.seq.saturating_add(1);
            }
            Ok(checked)
        };
        if b.codec == sluice_proto::tank::bundle::codec::NONE {
            return walk(b.message_set);
        }
        // A Snappy set is decompressed into this thread's buffer, kept between bundles.
        SET.with_borrow_mut(|set| {
            b.decompress_into(set, MAX_SET)
                .map_err(AppendError::Bundle)?;
            let r = walk(set);
            if set.capacity() > 4 << 20 {
                *set = Vec::new();
            }
            r
        })
    }

    /// Appends a bundle that `check` accepted at the log's end (a sparse one at its own first
    /// sequence number, which must not be behind the end), arrived at `now_ms` (what age
    /// retention goes by, as TANK's broker goes by its segments' times). Returns the first and
    /// last sequence numbers it takes.
    pub fn append(
        &mut self,
        bundle: &[u8],
        c: &Checked,
        now_ms: u64,
    ) -> Result<(u64, u64), AppendError> {
        let first = c.first.unwrap_or(self.next_seq);
        self.append_at(first, bundle, c.span, now_ms)?;
        Ok((first, first + c.span - 1))
    }

    /// Appends a bundle whose first message is `first_seq` and which takes `span` sequence
    /// numbers, at or past the log's end (the log's own records replayed, ProduceWithSeqnum).
    pub fn append_at(
        &mut self,
        first_seq: u64,
        bundle: &[u8],
        span: u64,
        newest_ms: u64,
    ) -> Result<(), AppendError> {
        if first_seq < self.next_seq {
            return Err(AppendError::Behind {
                first_seq,
                next_seq: self.next_seq,
            });
        }
        if first_seq > self.next_seq {
            // Sequence numbers between were dropped where they came from: a new segment
            // starts where these are (in place of the newest one, if it is still empty).
            let segment = Segment::new(first_seq, self.config.segment_bytes, self.dir.as_deref())?;
            if self.segments.back().is_some_and(|s| s.data.is_empty()) {
                let empty = self.segments.pop_back().expect("checked");
                empty.remove_file();
            }
            if let Some(before) = self.segments.back_mut() {
                before.seal();
            }
            self.segments.push_back(segment);
            self.next_seq = first_seq;
        }
        self.place(first_seq, bundle, span, newest_ms)
    }

    fn place(
        &mut self,
        first: u64,
        bundle: &[u8],
        span: u64,
        newest_ms: u64,
    ) -> Result<(), AppendError> {
        // A bundle goes to a new segment when it would take the newest past `segment_bytes`
        // (a larger one alone), or past the sequence numbers a segment indexes in a u32.
        // A segment never grows past the room it reserved: an empty one without room enough
        // (started for a gap, or reserved before a larger setting) gives way to one with it.
        let entry = bundle.len() + 10;
        let fits = |s: &Segment| s.data.len() + entry <= s.data.capacity();
        if self
            .segments
            .back()
            .is_some_and(|s| s.data.is_empty() && !fits(s))
        {
            let empty = self.segments.pop_back().expect("checked");
            empty.remove_file();
        }
        // A sealed segment (one an append that was taken back had rolled past) takes none.
        let roll = self.segments.back().is_none_or(|s| {
            (!s.data.is_empty() && s.data.len() + entry > self.config.segment_bytes)
                || !fits(s)
                || !s.data.takes_appends()
                || first - s.base_seq > u32::MAX as u64
        });
        if roll {
            let reserve = self.config.segment_bytes.max(entry);
            let segment = Segment::new(first, reserve, self.dir.as_deref())?;
            // The segment before is sealed: its whole index goes to its file, and neither
            // file stays open.
            if let Some(sealed) = self.segments.back_mut() {
                sealed.seal();
            }
            self.segments.push_back(segment);
        }
        let interval = self.config.index_interval;
        let seg = self.segments.back_mut().expect("one pushed above");
        let at = seg.data.len();
        let before = seg.data.len();
        let mut head = [0u8; 10];
        let written = seg
            .data
            .extend_from_slices(&[varint(&mut head, bundle.len() as u64), bundle]);
        if let Err(e) = written {
            let _ = seg.data.truncate(before);
            let file = seg.path.as_deref().unwrap_or(Path::new("?"));
            return Err(AppendError::Storage(format!("{}: {e}", file.display())));
        }
        let last_indexed = seg.index.last().map(|&(_, o)| o as usize);
        if last_indexed.is_none_or(|o| at - o >= interval) {
            seg.index_push((first - seg.base_seq) as u32, at as u32);
        }
        // Once a segment in memory holds a step, each step it enters has the next one's pages
        // faulted in ahead of it, off this thread (a segment that holds little keeps little
        // resident). A file's pages are the page cache's to manage.
        let step = seg.data.len() / PREFAULT_STEP;
        if !seg.data.is_file() && step > before / PREFAULT_STEP && step >= 1 {
            let from = (step + 1) * PREFAULT_STEP;
            let to = (from + PREFAULT_STEP).min(seg.data.capacity());
            if from < to {
                crate::prefault::ahead(seg.data.as_ptr().wrapping_add(from), to - from);
            }
        }
        seg.next_seq = first + span;
        seg.newest_ms = seg.newest_ms.max(newest_ms);
        self.bytes += (seg.data.len() - before) as u64;
        self.next_seq = first + span;
        Ok(())
    }

    /// Reads from `seq` (0: the first available; u64::MAX: the next to be produced) the whole
    /// bundles that fit in `fetch_size` bytes, within one segment: the first one whatever its
    /// size, then each next one while the chunk stays within `fetch_size`. That is what TANK's
    /// broker sends (measured against it: bundles of 102,014 stored bytes and a fetch size of
    /// 204,027 get one, 204,028 two), so an answer is never larger than its client sized it.
    pub fn read(&self, seq: u64, fetch_size: u32) -> Read<'_> {
        self.read_visible(seq, fetch_size, self.next_seq)
    }

    /// `read` of the messages before `visible` only (a bundle boundary at or below the log's
    /// end): those after it are appended but not yet in the WAL, so a reader must not see
    /// them. To such a reader the log ends at `visible`.
    pub fn read_visible(&self, seq: u64, fetch_size: u32, visible: u64) -> Read<'_> {
        let visible = visible.clamp(self.first_available(), self.next_seq);
        let high_water_mark = visible - 1;
        let seq = match seq {
            0 => self.first_available(),
            u64::MAX => visible,
            s => s,
        };
        if seq >= visible && seq <= self.next_seq {
            return Read::Tail {
                high_water_mark,
                first_available: self.first_available(),
            };
        }
        if seq > self.next_seq || seq < self.first_available() {
            return Read::OutOfRange {
                high_water_mark,
                first_available: self.first_available(),
            };
        }
        let i = self.segments.partition_point(|s| s.base_seq <= seq) - 1;
        let seg = &self.segments[i];
        if seq >= seg.next_seq {
            // In a gap between segments (an append_at past the end): from the next one.
            return self.read_visible(self.segments[i + 1].base_seq, fetch_size, visible);
        }
        let (start, base_seq) = seg.locate(seq);
        let (mut end, mut next) = (start, base_seq);
        while end < seg.data.len() && next < visible {
            let (len, count) = stored_bundle(&seg.data.as_slice()[end..]);
            if end > start && end + len - start > fetch_size as usize {
                break;
            }
            end += len;
            next += count;
        }
        Read::Chunk {
            base_seq,
            high_water_mark,
            bundles: Stored {
                data: &seg.data,
                start,
                end,
            },
        }
    }

    /// Every stored bundle, oldest first: its first sequence number, its span, the
    /// arrival time of its segment's newest bundle, and the bundle as produced (what a snapshot keeps).
    pub fn for_each_bundle(&self, mut each: impl FnMut(u64, u64, u64, &[u8])) {
        for seg in &self.segments {
            let (mut at, mut first) = (0, seg.base_seq);
            let data = seg.data.as_slice();
            while at < data.len() {
                let (len, count) = stored_bundle(&data[at..]);
                let mut r = Reader::new(&data[at..at + len]);
                let n = r
                    .varint_len("a stored bundle")
                    .expect("stored bundles are whole");
                each(
                    first,
                    count,
                    seg.newest_ms,
                    r.bytes(n, "a stored bundle").expect("whole"),
                );
                first += count;
                at += len;
            }
        }
    }

    /// Drops every bundle that holds a message past `keep` (a copy cutting back to where its
    /// history and its new leader's part: the messages after are ones no other copy has).
    /// Cuts at a bundle's start, so the log may end before `keep`; returns its new high-water
    /// mark. Bytes readers were handed stay valid: a segment cut inside is written anew (its
    /// file replaced, not shrunk under a mapping), and one dropped whole is only unlinked. The
    /// rewritten file is synced before this returns.
    pub fn truncate_after(&mut self, keep: u64) -> Result<u64, AppendError> {
        if keep >= self.high_water_mark() {
            return Ok(self.high_water_mark());
        }
        while self.segments.back().is_some_and(|s| s.base_seq > keep) {
            let s = self.segments.pop_back().expect("checked");
            self.bytes -= s.data.len() as u64;
            self.next_seq = s.base_seq;
            s.remove_file();
        }
        let Some(cut) = self.segments.back() else {
            // Nothing kept (retention had dropped what comes before): the log starts afresh.
            self.next_seq = self.next_seq.min(keep + 1).max(1);
            return Ok(self.high_water_mark());
        };
        self.next_seq = cut.next_seq;
        let data = cut.data.as_slice();
        let (mut at, mut next) = (0, cut.base_seq);
        while at < data.len() {
            let (len, count) = stored_bundle(&data[at..]);
            if next + count - 1 > keep {
                break;
            }
            at += len;
            next += count;
        }
        if at == data.len() {
            return Ok(self.high_water_mark());
        }
        let kept = if at == 0 {
            None
        } else {
            Some(self.rewritten(cut, at, next)?)
        };
        let cut = self.segments.pop_back().expect("checked");
        self.bytes -= (cut.data.len() - at) as u64;
        self.next_seq = next;
        match kept {
            None => cut.remove_file(),
            Some(kept) => {
                if let Some(before) = self.segments.back_mut() {
                    before.seal();
                }
                self.segments.push_back(kept);
            }
        }
        Ok(self.high_water_mark())
    }

    /// `cut`'s first `at` bytes (its bundles up to sequence number `next`, exclusive) as a
    /// segment of their own. In a directory, written to a file of its own, synced, then renamed
    /// over `cut`'s: a crash leaves one whole file or the other, and readers mapping the old
    /// one keep it until they let go.
    fn rewritten(&self, cut: &Segment, at: usize, next: u64) -> Result<Segment, AppendError> {
        let reserve = self.config.segment_bytes.max(at + 10);
        let staging = self.dir.as_ref().map(|d| d.join(CUT_DIR));
        let mut kept = Segment::new(cut.base_seq, reserve, staging.as_deref())?;
        let file = kept
            .path
            .as_deref()
            .unwrap_or(Path::new("?"))
            .display()
            .to_string();
        let storage = |e: std::io::Error| AppendError::Storage(format!("{file}: {e}"));
        kept.data
            .extend_from_slices(&[&cut.data.as_slice()[..at]])
            .map_err(storage)?;
        for &(rel, offset) in &index_upto(cut.index.clone(), at) {
            kept.index_push(rel, offset);
        }
        kept.write_index();
        if let Some(f) = kept.data.file() {
            f.sync_data().map_err(storage)?;
        }
        if let (Some(dir), Some(from), Some(to)) = (&self.dir, kept.path.clone(), cut.path.clone())
        {
            std::fs::rename(from.with_extension("index"), to.with_extension("index"))
                .and_then(|()| std::fs::rename(&from, &to))
                .and_then(|()| std::fs::File::open(dir)?.sync_all())
                .map_err(storage)?;
            kept.path = Some(to);
        }
        kept.next_seq = next;
        kept.newest_ms = cut.newest_ms;
        Ok(kept)
    }

    /// Takes a topic's settings (recovery builds logs before it reads them).
    pub fn set_config(&mut self, config: LogConfig) {
        self.config = config;
    }

    /// Drops whole segments, oldest first and never the newest, while the log is over its
    /// byte retention or their newest bundle arrived longer ago than its age retention at `now_ms`.
    /// Returns how many messages went.
    pub fn enforce_retention(&mut self, now_ms: u64) -> u64 {
        let mut dropped = 0;
        while self.segments.len() > 1 {
            let oldest = &self.segments[0];
            let over_bytes = self
                .config
                .retention_bytes
                .is_some_and(|max| self.bytes > max);
            let too_old = self
                .config
                .retention_ms
                .is_some_and(|age| oldest.newest_ms + age < now_ms);
            if !(over_bytes || too_old) {
                break;
            }
            let seg = self.segments.pop_front().expect("checked above");
            self.bytes -= seg.data.len() as u64;
            dropped += seg.next_seq - seg.base_seq;
            seg.remove_file();
        }
        dropped
    }
}

#[cfg(test)]
mod tests;
