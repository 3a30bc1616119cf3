//! The WAL writer: one dedicated thread drains everything queued, encodes it into blocks,
//! writes it with one write and (in fsync mode) syncs once per batch: group commit. LSNs are
//! handed out under the queue lock, so the file order is the LSN order.
//!
//! In write mode a reply waiting for a small batch may write it itself unless a write is under
//! way (`WalWriter::written`): the same batch, the same order, under the same lock. Records queued
//! on a thread whose replies wait for the WAL (`replies_wait_here`) do not wake the writer
//! thread: their waiter writes them, and the thread, napping on a timer while writes come,
//! takes what no waiter took within `LEADER_GRACE`. Waking it for every record cost more than
//! the write (a futex wake, and a thread that then raced the waiter for the batch).
//!
//! When a write or sync fails (disk full, I/O error) the batch stays with the writer, which
//! retries it with back-off; meanwhile `is_failing()` tells the engine to refuse new writes,
//! waiters of the failed and later LSNs get `Error::WalFailed`, and nothing written before is
//! touched. Writing resumes by itself when the disk has room again.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::record::{Record, RecordBody};
use super::xlog::{self, FileHeader, FileKind};
use crate::config::WalMode;
use crate::error::{Error, Result};
use crate::failover::FailoverEntry;
use crate::item::Change;
use crate::signal::ChangeSignal;
use crate::vbucket::VbState;

/// Records other than item changes.
#[derive(Debug, Clone)]
pub enum MetaRecord {
    VbucketState {
        state: VbState,
        high_seqno: u64,
    },
    FailoverEntry(FailoverEntry),
    Bucket {
        name: String,
        num_vbuckets: u16,
    },
    PurgeSeqno(u64),
    /// The vbucket was rolled back to this seqno (a snapshot follows that holds the result).
    Rollback(u64),
    /// The vbucket's failover log is replaced: the entries that follow are the whole log.
    FailoverReset,
    /// Where the followed source stood after the change queued just before it (see
    /// `RecordBody::FollowPosition`); never separated from that change by a block boundary.
    FollowPosition(Vec<u8>),
    /// Opens a group that the next `FollowPosition` closes: no block boundary inside it.
    FollowGroup,
    /// A topic is created (see `RecordBody::Topic`).
    Topic {
        name: String,
        partitions: u16,
        config: String,
    },
    /// A bundle appended to a topic partition's segment file (see
    /// `RecordBody::TopicAppended`).
    TopicAppended {
        first_seq: u64,
        count: u64,
        newest_ms: u64,
        segment: u64,
        offset: u32,
        len: u32,
        crc: u32,
    },
}

pub enum WalPayload {
    Change(Change),
    /// Boxed: meta records are rare and would otherwise triple the size of every queue entry.
    Meta(Box<(u16, u16, MetaRecord)>),
}

impl WalPayload {
    pub fn meta(bucket: u16, vbucket: u16, record: MetaRecord) -> WalPayload {
        WalPayload::Meta(Box::new((bucket, vbucket, record)))
    }
}

struct Queued {
    lsn: u64,
    payload: WalPayload,
}

/// What a queued record is counted as against `QUEUE_LIMIT_BYTES`: its key and value, and a
/// fixed part for the entry and its encoding.
const QUEUED_OVERHEAD: usize = 96;

/// The bytes of records queued and not yet written past which new writes are refused
/// (TMPFAIL) until the writer catches up: the WAL never runs further behind than this.
pub const QUEUE_LIMIT_BYTES: usize = 64 << 20;

impl Queued {
    /// Whether this record must share its block with the one before it.
    fn glued(&self) -> bool {
        matches!(&self.payload, WalPayload::Meta(m) if matches!(m.2, MetaRecord::FollowPosition(_)))
    }

    /// Whether this record opens (Some(true)) or closes (Some(false)) a group that no block
    /// boundary may cut.
    fn group_edge(&self) -> Option<bool> {
        match &self.payload {
            WalPayload::Meta(m) => match m.2 {
                MetaRecord::FollowGroup => Some(true),
                MetaRecord::FollowPosition(_) => Some(false),
                _ => None,
            },
            WalPayload::Change(_) => None,
        }
    }

    fn charge(&self) -> usize {
        QUEUED_OVERHEAD
            + match &self.payload {
                WalPayload::Change(c) => c.key().len() + c.value().len(),
                WalPayload::Meta(_) => 0,
            }
    }

    /// Encodes the record into `out` but for its value, which it returns (see
    /// `Record::encode_head`).
    fn encode_head(&self, out: &mut Vec<u8>) -> &[u8] {
        let rec = match &self.payload {
            WalPayload::Change(c) => Record {
                lsn: self.lsn,
                bucket: c.bucket(),
                vbucket: c.vbucket(),
                body: RecordBody::Change {
                    op: c.op(),
                    key: c.key(),
                    value: c.value(),
                    meta: *c.meta(),
                },
            },
            WalPayload::Meta(m) => Record {
                lsn: self.lsn,
                bucket: m.0,
                vbucket: m.1,
                body: match &m.2 {
                    MetaRecord::VbucketState { state, high_seqno } => RecordBody::VbucketState {
                        state: *state,
                        high_seqno: *high_seqno,
                    },
                    MetaRecord::FailoverEntry(e) => RecordBody::FailoverEntry(*e),
                    MetaRecord::Bucket { name, num_vbuckets } => RecordBody::Bucket {
                        name: name.as_bytes(),
                        num_vbuckets: *num_vbuckets,
                    },
                    MetaRecord::PurgeSeqno(s) => RecordBody::PurgeSeqno(*s),
                    MetaRecord::Rollback(s) => RecordBody::Rollback(*s),
                    MetaRecord::FailoverReset => RecordBody::FailoverReset,
                    MetaRecord::FollowPosition(p) => RecordBody::FollowPosition(p),
                    MetaRecord::FollowGroup => RecordBody::FollowGroup,
                    MetaRecord::Topic {
                        name,
                        partitions,
                        config,
                    } => RecordBody::Topic {
                        name: name.as_bytes(),
                        partitions: *partitions,
                        config: config.as_bytes(),
                    },
                    MetaRecord::TopicAppended {
                        first_seq,
                        count,
                        newest_ms,
                        segment,
                        offset,
                        len,
                        crc,
                    } => RecordBody::TopicAppended {
                        first_seq: *first_seq,
                        count: *count,
                        newest_ms: *newest_ms,
                        segment: *segment,
                        offset: *offset,
                        len: *len,
                        crc: *crc,
                    },
                },
            },
        };
        rec.encode_head(out)
    }
}

/// Called by the writer after each batch reaches the disk with, per (bucket, vbucket), the
/// highest seqno it carried.
pub type PersistedCallback = Box<dyn Fn(&[(u16, u16, u64)]) + Send>;

/// Failpoints for tests: make the next writes fail as a full disk or a broken device would,
/// or (`SyncError`) the next sync of write mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failpoint {
    Off = 0,
    NoSpace = 1,
    IoError = 2,
    SyncError = 3,
}

struct QueueState {
    next_lsn: u64,
    pending: Vec<Queued>,
    shutdown: bool,
    /// With shutdown: stop after writing, without closing the segment (as `kill -9` would).
    crash: bool,
    rotate: bool,
    /// When the oldest of `pending` was queued without waking the thread (write mode): the
    /// thread writes it once LEADER_GRACE has passed and no waiter has.
    queued_at: Option<Instant>,
    /// Something in `pending` needs the thread now: queued where no waiter writes it, or by a
    /// waiter that could not write it itself.
    wanted: bool,
    /// The thread sleeps without a timer: the next record queued must wake it.
    writer_idle: bool,
    /// A waiter's write took the segment a WRITEBACK_STEP past its last writeback.
    writeback: bool,
}

struct DurableState {
    /// Highest LSN written to the file (in the page cache at least).
    written: u64,
    /// Highest LSN synced to the device: what `persist` waits for.
    synced: u64,
    error: Option<String>,
    stopped: bool,
    /// A sync failed: pages written before it may be lost to a power failure although a later
    /// sync succeeds (the kernel may have dropped them), so nothing is announced synced, and
    /// no write taken, until a restart recovers from what the files hold.
    sync_lost: bool,
}

struct Shared {
    mode: WalMode,
    queue: Mutex<QueueState>,
    queue_cv: Condvar,
    durable: Mutex<DurableState>,
    durable_cv: Condvar,
    failing: AtomicBool,
    failpoint: AtomicU8,
    /// In write mode, the highest LSN a `persist` waiter needs synced.
    sync_wanted: AtomicU64,
    sync_latency: SyncLatency,
    /// Bytes of records queued or being written (see `QUEUE_LIMIT_BYTES`).
    queued_bytes: AtomicUsize,
    /// Moves whenever `durable` changes (written, synced, an error, the stop), for async waits.
    progress: ChangeSignal,
    /// The writer thread's, lent to a waiter that finds it idle; None in mode `none` and once
    /// the thread stopped.
    writer: Mutex<Option<Writer>>,
    /// Files written besides the WAL whose records it holds (topic segments), in fsync mode:
    /// each sync of the WAL syncs them first, so that a record synced never points at bytes
    /// that are not.
    also_sync: Mutex<Vec<Arc<File>>>,
}

impl Shared {
    /// Syncs the files registered since the last sync (`WalWriter::sync_with`).
    /// A failure keeps them registered: the retry of the batch syncs them again.
    fn sync_others(&self) -> io::Result<()> {
        let files = std::mem::take(&mut *self.also_sync.lock());
        for (i, f) in files.iter().enumerate() {
            if let Err(e) = f.sync_data() {
                let mut kept = self.also_sync.lock();
                for f in &files[i..] {
                    if !kept.iter().any(|k| Arc::ptr_eq(k, f)) {
                        kept.push(f.clone());
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Shared {
    /// Publishes a change of `durable` to blocking and async waiters alike.
    fn announce(&self) {
        self.durable_cv.notify_all();
        self.progress.notify();
    }
}

/// Upper bounds (microseconds) of the WAL sync latency histogram's buckets.
pub const SYNC_BUCKETS_US: [u64; 12] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
];

/// A Prometheus-style histogram of how long each fdatasync took.
#[derive(Default)]
pub struct SyncLatency {
    counts: [AtomicU64; SYNC_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

impl SyncLatency {
    fn record(&self, took: Duration) {
        let us = took.as_micros() as u64;
        let i = SYNC_BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(SYNC_BUCKETS_US.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Cumulative counts per bucket (the last is +Inf), and the sum in microseconds.
    pub fn snapshot(&self) -> (Vec<u64>, u64) {
        let mut acc = 0;
        let counts = self.counts.iter().map(|c| {
            acc += c.load(Ordering::Relaxed);
            acc
        });
        (counts.collect(), self.sum_us.load(Ordering::Relaxed))
    }
}

/// fdatasync with its latency recorded.
fn timed_sync(file: &File, latency: &SyncLatency) -> io::Result<()> {
    let t = Instant::now();
    let r = file.sync_data();
    latency.record(t.elapsed());
    r
}

pub struct WalConfig {
    pub dir: PathBuf,
    pub mode: WalMode,
    pub instance: String,
    pub segment_size: u64,
    /// Largest payload per block; a batch larger than this spans several blocks.
    pub block_size: usize,
}

pub struct WalWriter {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Holds the queue lock: every `push` gets the next LSN, in order.
pub struct Appender<'a> {
    guard: parking_lot::MutexGuard<'a, QueueState>,
    shared: &'a Shared,
    was_empty: bool,
    /// Bytes pushed, added to `queued_bytes` once on drop: that counter's line is shared
    /// with the writer thread, and a locked add per record of a replicated batch cost as much
    /// as queueing the record.
    charged: usize,
}

impl Appender<'_> {
    pub fn push(&mut self, payload: WalPayload) -> u64 {
        let lsn = self.guard.next_lsn;
        self.guard.next_lsn += 1;
        if self.shared.mode != WalMode::None {
            let q = Queued { lsn, payload };
            self.charged += q.charge();
            self.guard.pending.push(q);
        }
        lsn
    }

    /// The last LSN handed out.
    pub fn last_lsn(&self) -> u64 {
        self.guard.next_lsn - 1
    }
}

thread_local! {
    /// Set on threads whose replies wait for the WAL (`replies_wait_here`).
    static REPLIES_WAIT_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Declares that on this thread records queued are waited for (`WalWriter::written`) before
/// anything depending on them is answered, as a server's connection threads do: records queued
/// here then leave the writing to that waiter instead of waking the writer thread. One nobody
/// waits for (a quiet write with nothing to answer) is written by the thread within about two
/// LEADER_GRACE.
pub fn replies_wait_here() {
    REPLIES_WAIT_HERE.with(|w| w.set(true));
}

impl Drop for Appender<'_> {
    fn drop(&mut self) {
        // Under the queue lock still: the writer takes it before it drains and subtracts.
        if self.charged > 0 {
            self.shared
                .queued_bytes
                .fetch_add(self.charged, Ordering::Relaxed);
        }
        if self.guard.pending.is_empty() {
            return;
        }
        let q = &mut *self.guard;
        if self.shared.mode == WalMode::Write && REPLIES_WAIT_HERE.with(|w| w.get()) {
            if self.was_empty {
                q.queued_at = Some(Instant::now());
            }
            // A thread napping finds the record by its timer; one asleep must be woken.
            if q.writer_idle {
                q.writer_idle = false;
                self.shared.queue_cv.notify_one();
            }
        } else if !q.wanted {
            q.wanted = true;
            q.writer_idle = false;
            self.shared.queue_cv.notify_one();
        }
    }
}

/// How long the writer thread leaves a record queued for its waiter to write (write mode).
const LEADER_GRACE: Duration = Duration::from_micros(500);
/// Naps of LEADER_GRACE the writer thread takes after a batch before it sleeps until woken.
const NAPS_BEFORE_SLEEP: u32 = 4;

/// Encoded bytes written per write() call while draining a batch.
const WRITE_CHUNK: usize = 4 << 20;
/// Values at least this long go to the file from where they are queued, not through the
/// writer's buffer: below it a copy costs less than another piece of a `pwritev`.
const WRITTEN_IN_PLACE: usize = 16 << 10;
/// Queue entries a drained vector keeps room for between batches.
const MAX_KEPT_ENTRIES: usize = 64 * 1024;

/// In `write` mode, the kernel is asked to start writing a segment's pages back every this
/// many bytes (sync_file_range, which does not wait for the disk). Left to itself, it lets tens
/// of megabytes of dirty pages build up and then flushes them at once, and writes stall behind
/// that flush: replication lag's p99 at half the maximum SET rate was tens of milliseconds,
/// in bursts. RocksDB's `wal_bytes_per_sync` does the same.
const WRITEBACK_STEP: u64 = 1 << 20;

/// A range of a segment whose writeback is to start. The writer thread starts it after
/// releasing the writer lock: sync_file_range can wait for the device's queue, and a reply
/// that finds the lock taken waits for the thread instead of writing its own batch (a 100 KB
/// TANK produce every tenth bundle, measured as a p90 produce latency near twice the p50).
/// Only that thread closes segments, so the descriptor is open until it is done.
struct Writeback {
    fd: std::os::fd::RawFd,
    offset: u64,
    len: u64,
}

impl Writeback {
    /// A hint: a failure changes nothing that was promised.
    fn start(self) {
        // SAFETY: a plain syscall on a descriptor the writer thread keeps open (see above).
        unsafe {
            libc::sync_file_range(
                self.fd,
                self.offset as libc::off64_t,
                self.len as libc::off64_t,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
    }
}

struct Segment {
    file: File,
    path: PathBuf,
    first_lsn: u64,
    size: u64,
    records: u64,
    /// Where the last writeback started (`WRITEBACK_STEP`).
    written_back: u64,
}

impl Segment {
    fn create(cfg: &WalConfig, first_lsn: u64) -> io::Result<Segment> {
        let path = cfg
            .dir
            .join(format!("{}.inprogress", xlog::file_name(first_lsn, "xlog")));
        let file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)?;
        let mut head = Vec::new();
        FileHeader {
            kind: FileKind::Xlog,
            instance: cfg.instance.clone(),
            lsn: first_lsn,
        }
        .encode(&mut head);
        file.write_all_at(&head, 0)?;
        if cfg.mode == WalMode::Fsync {
            file.sync_data()?;
            xlog::sync_dir(&cfg.dir)?;
        }
        Ok(Segment {
            file,
            path,
            first_lsn,
            size: head.len() as u64,
            records: 0,
            written_back: 0,
        })
    }

    /// Encodes a batch into blocks and writes it at the end of the segment in chunks of about
    /// WRITE_CHUNK bytes (so the buffer stays small whatever the backlog), then syncs once in
    /// fsync mode. On failure everything written for this batch is cut back off, so a retry
    /// starts clean.
    fn append_batch(
        &mut self,
        batch: &[Queued],
        buf: &mut Vec<u8>,
        cfg: &WalConfig,
        failpoint: Failpoint,
        shared: &Shared,
    ) -> io::Result<()> {
        let start = self.size;
        let result = match failpoint {
            Failpoint::NoSpace => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
            Failpoint::IoError => Err(io::Error::from_raw_os_error(libc::EIO)),
            Failpoint::Off | Failpoint::SyncError => {
                self.write_blocks(batch, buf, cfg.block_size).and_then(|_| {
                    if cfg.mode == WalMode::Fsync {
                        shared
                            .sync_others()
                            .and_then(|()| timed_sync(&self.file, &shared.sync_latency))
                    } else {
                        // Writeback is started by the thread (`writeback_due`): it may wait for
                        // the device, and a waiter writing its own batch serves connections.
                        Ok(())
                    }
                })
            }
        };
        if result.is_err() {
            self.size = start;
            let _ = self.file.set_len(start);
        }
        result
    }

    fn write_blocks(
        &mut self,
        batch: &[Queued],
        buf: &mut Vec<u8>,
        block_size: usize,
    ) -> io::Result<()> {
        buf.clear();
        // Values of WRITTEN_IN_PLACE bytes or more are written from where they are queued
        // rather than copied into `buf` (a produced bundle of 100 KB was copied once more here
        // than anywhere else): where in `buf` each goes, and the value.
        let mut spliced: Vec<(usize, &[u8])> = Vec::new();
        let (mut spliced_bytes, mut block_first, mut block_spliced) = (0, 0, 0);
        let mut at = xlog::begin_block(buf);
        // Inside a group (a followed transaction, pushed under one queue lock, so whole in
        // this batch) no block starts, nor before a record glued to the one before it.
        let mut grouped = false;
        for q in batch {
            let may_split = !grouped && !q.glued();
            if may_split && buf.len() + block_spliced - at - xlog::BLOCK_HEADER_LEN >= block_size {
                xlog::finish_spliced_block(buf, at, &spliced[block_first..]);
                if buf.len() + spliced_bytes >= WRITE_CHUNK {
                    self.write_out(buf, &spliced, spliced_bytes)?;
                    buf.clear();
                    spliced.clear();
                    spliced_bytes = 0;
                }
                (block_first, block_spliced) = (spliced.len(), 0);
                at = xlog::begin_block(buf);
            }
            if let Some(opens) = q.group_edge() {
                grouped = opens;
            }
            let value = q.encode_head(buf);
            if value.len() >= WRITTEN_IN_PLACE {
                spliced.push((buf.len(), value));
                spliced_bytes += value.len();
                block_spliced += value.len();
            } else {
                buf.extend_from_slice(value);
            }
        }
        xlog::finish_spliced_block(buf, at, &spliced[block_first..]);
        self.write_out(buf, &spliced, spliced_bytes)
    }

    fn write_out(
        &mut self,
        buf: &[u8],
        spliced: &[(usize, &[u8])],
        spliced_bytes: usize,
    ) -> io::Result<()> {
        if spliced.is_empty() {
            self.file.write_all_at(buf, self.size)?;
        } else {
            xlog::write_spliced_at(&self.file, buf, spliced, self.size)?;
        }
        self.size += (buf.len() + spliced_bytes) as u64;
        Ok(())
    }

    /// Whether a step's worth has been written since the last writeback started.
    fn writeback_due(&self) -> bool {
        self.size - self.written_back >= WRITEBACK_STEP
    }

    /// What was written since the last writeback started, once a step's worth has gathered,
    /// for the thread to hand to the kernel with the writer lock released
    /// (`Writeback::start`).
    fn writeback(&mut self) -> Option<Writeback> {
        if !self.writeback_due() {
            return None;
        }
        use std::os::fd::AsRawFd;
        let range = Writeback {
            fd: self.file.as_raw_fd(),
            offset: self.written_back,
            len: self.size - self.written_back,
        };
        self.written_back = self.size;
        Some(range)
    }

    /// Writes the EOF marker, syncs, and renames `.inprogress` away. An empty segment is removed.
    fn close(self, dir: &Path) -> io::Result<()> {
        if self.records == 0 {
            drop(self.file);
            std::fs::remove_file(&self.path)?;
            return xlog::sync_dir(dir);
        }
        self.file
            .write_all_at(&xlog::EOF_MARKER.to_be_bytes(), self.size)?;
        self.file.sync_all()?;
        let done = dir.join(xlog::file_name(self.first_lsn, "xlog"));
        std::fs::rename(&self.path, &done)?;
        xlog::sync_dir(dir)
    }
}

impl WalWriter {
    /// Starts the writer. `next_lsn` is the first LSN to hand out (last recovered + 1).
    pub fn start(
        cfg: WalConfig,
        next_lsn: u64,
        on_persisted: PersistedCallback,
    ) -> Result<WalWriter> {
        let shared = Arc::new(Shared {
            mode: cfg.mode,
            queue: Mutex::new(QueueState {
                next_lsn,
                pending: Vec::new(),
                shutdown: false,
                crash: false,
                rotate: false,
                queued_at: None,
                wanted: false,
                writer_idle: false,
                writeback: false,
            }),
            queue_cv: Condvar::new(),
            durable: Mutex::new(DurableState {
                written: next_lsn - 1,
                synced: next_lsn - 1,
                error: None,
                stopped: false,
                sync_lost: false,
            }),
            durable_cv: Condvar::new(),
            failing: AtomicBool::new(false),
            failpoint: AtomicU8::new(Failpoint::Off as u8),
            sync_wanted: AtomicU64::new(0),
            sync_latency: SyncLatency::default(),
            queued_bytes: AtomicUsize::new(0),
            progress: ChangeSignal::default(),
            writer: Mutex::new(None),
            also_sync: Mutex::new(Vec::new()),
        });
        let thread = if cfg.mode == WalMode::None {
            None
        } else {
            std::fs::create_dir_all(&cfg.dir).map_err(|e| Error::io(cfg.dir.display(), e))?;
            let segment =
                Segment::create(&cfg, next_lsn).map_err(|e| Error::io(cfg.dir.display(), e))?;
            *shared.writer.lock() = Some(Writer {
                cfg,
                segment,
                buf: Vec::with_capacity(4 << 20),
                batch: Vec::new(),
                per_vb: HashMap::default(),
                persisted: Vec::new(),
                on_persisted,
                written: next_lsn - 1,
                synced: next_lsn - 1,
            });
            let sh = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("sluice-wal".into())
                    .spawn(move || writer_loop(sh))
                    .map_err(|e| Error::io("spawning the WAL writer", e))?,
            )
        };
        Ok(WalWriter {
            shared,
            thread: Mutex::new(thread),
        })
    }

    pub fn mode(&self) -> WalMode {
        self.shared.mode
    }

    /// The queue, locked for pushing; refused once the writer is shutting down, so that no
    /// change can be acknowledged that the writer will never write.
    pub fn appender(&self) -> Result<Appender<'_>> {
        let guard = self.shared.queue.lock();
        if guard.shutdown {
            return Err(Error::Closed);
        }
        let was_empty = guard.pending.is_empty();
        Ok(Appender {
            guard,
            shared: &self.shared,
            was_empty,
            charged: 0,
        })
    }

    /// The last LSN handed out.
    pub fn last_lsn(&self) -> u64 {
        self.shared.queue.lock().next_lsn - 1
    }

    pub fn sync_latency(&self) -> &SyncLatency {
        &self.shared.sync_latency
    }

    /// Highest LSN written to the WAL (what a process crash cannot lose).
    pub fn written_lsn(&self) -> u64 {
        self.shared.durable.lock().written
    }

    /// Highest LSN synced to the device (what a power loss cannot lose).
    pub fn synced_lsn(&self) -> u64 {
        self.shared.durable.lock().synced
    }

    /// True while the writer cannot write; new changes should be refused.
    pub fn is_failing(&self) -> bool {
        self.shared.failing.load(Ordering::Acquire)
    }

    /// True while the records queued and not yet written are over `QUEUE_LIMIT_BYTES`: new
    /// writes should wait or be refused until the writer catches up.
    pub fn is_backlogged(&self) -> bool {
        self.shared.queued_bytes.load(Ordering::Relaxed) > QUEUE_LIMIT_BYTES
    }

    /// Bytes of records queued and not yet written.
    pub fn queued_bytes(&self) -> usize {
        self.shared.queued_bytes.load(Ordering::Relaxed)
    }

    /// Completes once `lsn` is written (what a process crash cannot lose), waiting through
    /// write failures, which the writer retries; `Error::Closed` if the writer stopped without
    /// writing it. This is the wait of every reply to a write: nothing is acknowledged that
    /// the WAL file does not hold.
    pub async fn written(&self, lsn: u64) -> Result<()> {
        self.wait_for_write(lsn, false).await
    }

    /// As `written`, but a writer failing before `lsn` is written ends the wait at once with
    /// `Error::WalFailed` naming why: what a reply acknowledging a change in the failed block
    /// is told, within the writer's first failed attempt, rather than waiting for the disk to
    /// have room again. The change stays queued; the writer retries it.
    pub async fn written_unless_failing(&self, lsn: u64) -> Result<()> {
        self.wait_for_write(lsn, true).await
    }

    async fn wait_for_write(&self, lsn: u64, unless_failing: bool) -> Result<()> {
        if self.shared.mode == WalMode::None {
            return Ok(());
        }
        self.lead(lsn);
        if self.shared.durable.lock().written < lsn {
            // Not written by this waiter (another is writing, or the batch is too large for
            // a waiter, or the writer is failing): the thread's, at once.
            let mut q = self.shared.queue.lock();
            if !q.pending.is_empty() && !q.wanted {
                q.wanted = true;
                q.writer_idle = false;
                self.shared.queue_cv.notify_one();
            }
        }
        loop {
            let seen = self.shared.progress.generation();
            {
                let d = self.shared.durable.lock();
                if d.written >= lsn {
                    return Ok(());
                }
                if unless_failing {
                    if let Some(failed) = self.outcome(&d, lsn, |d| d.written) {
                        return failed;
                    }
                }
                if d.stopped {
                    return Err(Error::Closed);
                }
            }
            self.shared.progress.changed(seen).await;
        }
    }

    /// In write mode, writes what is queued from the caller's thread when the writer is idle and
    /// the batch small: the reply then waits for one write(2), not for the writer thread to be
    /// scheduled (on a busy machine that wake-up is most of a small write's latency). Waiters
    /// that find it busy wait for it as before; failures, syncs, rotation and fsync mode stay
    /// with the thread (a failed batch goes back to the head of the queue for it to retry).
    /// A thread that queues records and does not wait for them (a replica applying) calls it
    /// after `replies_wait_here` to save the writer thread's wake-up per batch.
    pub fn lead(&self, lsn: u64) {
        let shared = &*self.shared;
        if shared.mode != WalMode::Write
            || shared.failing.load(Ordering::Acquire)
            || shared.queued_bytes.load(Ordering::Relaxed) > LEAD_MAX_BYTES
            || shared.durable.lock().written >= lsn
        {
            return;
        }
        let Some(mut guard) = shared.writer.try_lock() else {
            return;
        };
        let Some(w) = guard.as_mut() else {
            return;
        };
        if !w.batch.is_empty() {
            return; // a failed batch the thread is retrying
        }
        w.take_queued(shared);
        if w.batch.is_empty() {
            return;
        }
        if let Err(e) = w.write_batch(shared) {
            // Failing from here on, as the thread would say (new writes refused, waiters
            // told, no other leader tries), and the batch back at the head of the queue for
            // the thread to retry with back-off.
            report_failure(shared, format!("writing {}: {e}", w.segment.path.display()));
            let mut q = shared.queue.lock();
            let newer = std::mem::take(&mut q.pending);
            q.pending = std::mem::take(&mut w.batch);
            q.pending.extend(newer);
            shared.queue_cv.notify_one();
            return;
        }
        // The thread decides what to do from `written` and `synced` when woken: a persist
        // waiter that asked for a sync while this batch was being written must not find it
        // asleep, and a full segment is its to rotate.
        let rotate = w.segment.size >= w.cfg.segment_size;
        let writeback = w.segment.writeback_due();
        if rotate || writeback || sync_due(shared, w.synced) {
            let mut q = shared.queue.lock();
            q.rotate |= rotate;
            q.writeback |= writeback;
            q.writer_idle = false;
            shared.queue_cv.notify_one();
        }
    }

    /// Completes once `lsn` is synced to the device (the `persist` level), or fails as soon as
    /// the writer reports a failure, as `wait_durable` does.
    pub async fn synced(&self, lsn: u64) -> Result<()> {
        if self.shared.mode == WalMode::None {
            return Err(Error::DurabilityImpossible("wal.mode is none".into()));
        }
        self.ask_sync(lsn);
        loop {
            let seen = self.shared.progress.generation();
            if let Some(done) = self.outcome(&self.shared.durable.lock(), lsn, |d| d.synced) {
                return done;
            }
            self.shared.progress.changed(seen).await;
        }
    }

    /// In write mode, where batches are not synced by themselves, asks the writer to sync
    /// through `lsn` without waiting for it; waiters arriving together share one sync.
    pub fn ask_sync(&self, lsn: u64) {
        if self.shared.mode == WalMode::Write
            && self.shared.sync_wanted.fetch_max(lsn, Ordering::AcqRel) < lsn
        {
            let _q = self.shared.queue.lock();
            self.shared.queue_cv.notify_one();
        }
    }

    /// Some(outcome) once a wait for `lsn` is over: reached, the writer failing, or stopped.
    fn outcome(
        &self,
        d: &DurableState,
        lsn: u64,
        reached: impl Fn(&DurableState) -> u64,
    ) -> Option<Result<()>> {
        if reached(d) >= lsn {
            return Some(Ok(()));
        }
        if self.shared.failing.load(Ordering::Acquire) {
            let why = d.error.clone().unwrap_or_else(|| "unknown error".into());
            return Some(Err(Error::WalFailed(format!(
                "{why}; the change is kept in memory and retried"
            ))));
        }
        if d.stopped {
            return Some(Err(Error::Closed));
        }
        None
    }

    /// Why the writer is failing, if it is: the flag and the reason are set and cleared
    /// together under one lock, so a failing writer always has its reason.
    pub fn failure(&self) -> Option<String> {
        let d = self.shared.durable.lock();
        self.shared
            .failing
            .load(Ordering::Acquire)
            .then(|| d.error.clone().unwrap_or_else(|| "unknown error".into()))
    }

    /// Registers a file written besides the WAL (a topic segment) whose bytes a record about
    /// to be queued points at: in fsync mode, where every batch is synced, the sync of the
    /// batch holding the record syncs the file first. Call it before queuing the record. In
    /// the other modes nothing is synced for such records (a produce waits for no sync), and
    /// nothing is kept.
    pub fn sync_with(&self, file: &Arc<File>) {
        if self.shared.mode != WalMode::Fsync {
            return;
        }
        let mut files = self.shared.also_sync.lock();
        if !files.iter().any(|f| Arc::ptr_eq(f, file)) {
            files.push(file.clone());
        }
    }

    pub fn set_failpoint(&self, fp: Failpoint) {
        self.shared.failpoint.store(fp as u8, Ordering::Release);
    }

    /// Blocks until `lsn` is synced to the device (the `persist` durability level), the writer
    /// fails, or `timeout` passes. In write mode, where batches are not synced by themselves,
    /// this asks the writer for a sync; waiters arriving together share one.
    pub fn wait_durable(&self, lsn: u64, timeout: Option<Duration>) -> Result<()> {
        if self.shared.mode == WalMode::None {
            return Err(Error::DurabilityImpossible("wal.mode is none".into()));
        }
        self.ask_sync(lsn);
        self.wait_until(lsn, timeout, |d| d.synced)
    }

    /// Blocks until `lsn` is written (out of the process: what a crash cannot lose), the writer
    /// fails, or `timeout` (None: no limit) passes.
    pub fn wait_written(&self, lsn: u64, timeout: Option<Duration>) -> Result<()> {
        if self.shared.mode == WalMode::None {
            return Ok(());
        }
        self.wait_until(lsn, timeout, |d| d.written)
    }

    fn wait_until(
        &self,
        lsn: u64,
        timeout: Option<Duration>,
        reached: impl Fn(&DurableState) -> u64,
    ) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut d = self.shared.durable.lock();
        loop {
            if let Some(done) = self.outcome(&d, lsn, &reached) {
                return done;
            }
            match deadline {
                Some(dl) => {
                    if self.shared.durable_cv.wait_until(&mut d, dl).timed_out()
                        && reached(&d) < lsn
                    {
                        return Err(Error::TempFail("timed out waiting for the WAL".into()));
                    }
                }
                None => self.shared.durable_cv.wait(&mut d),
            }
        }
    }

    /// Asks the writer to start a new segment (before a snapshot, so old ones can be removed).
    pub fn request_rotate(&self) {
        let mut q = self.shared.queue.lock();
        q.rotate = true;
        self.shared.queue_cv.notify_one();
    }

    /// Writes everything queued, closes the segment cleanly and stops the thread.
    pub fn shutdown(&self) {
        {
            let mut q = self.shared.queue.lock();
            q.shutdown = true;
            self.shared.queue_cv.notify_one();
        }
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        let mut d = self.shared.durable.lock();
        d.stopped = true;
        self.shared.announce();
    }

    /// For tests of recovery: writes what is queued, then stops without the EOF marker or the
    /// rename, leaving the files as `kill -9` right after the last write would.
    pub fn crash(&self) {
        self.shared.queue.lock().crash = true;
        self.shutdown();
    }
}

impl Drop for WalWriter {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A write-mode `persist` waiter wants LSNs synced that are not yet.
fn sync_due(shared: &Shared, synced: u64) -> bool {
    shared.sync_wanted.load(Ordering::Acquire) > synced
}

/// The one that writes batches to the current segment: the writer thread's, lent to a waiter
/// that finds it idle (see `WalWriter::written`). Taken by the thread when it stops.
struct Writer {
    cfg: WalConfig,
    segment: Segment,
    buf: Vec<u8>,
    /// Double buffering: the writer hands its drained batch vector back to the queue, so
    /// neither side regrows a vector per batch.
    batch: Vec<Queued>,
    per_vb: HashMap<(u16, u16), u64, foldhash::fast::FixedState>,
    persisted: Vec<(u16, u16, u64)>,
    on_persisted: PersistedCallback,
    written: u64,
    synced: u64,
}

impl Writer {
    /// Takes what is queued as the batch to write (unless a failed batch is still here).
    fn take_queued(&mut self, shared: &Shared) {
        if self.batch.is_empty() {
            let mut q = shared.queue.lock();
            std::mem::swap(&mut q.pending, &mut self.batch);
            q.queued_at = None;
            q.wanted = false;
        }
    }

    /// Writes the batch (once; the caller decides about retries), then publishes it.
    fn write_batch(&mut self, shared: &Shared) -> io::Result<()> {
        if let Some(delay) = crate::errinj::WAL_WRITE_DELAY_MS.millis() {
            std::thread::sleep(delay);
        }
        let fp = match shared.failpoint.load(Ordering::Acquire) {
            1 => Failpoint::NoSpace,
            2 => Failpoint::IoError,
            _ => Failpoint::Off,
        };
        self.segment
            .append_batch(&self.batch, &mut self.buf, &self.cfg, fp, shared)?;
        self.publish(shared);
        Ok(())
    }

    /// The batch is in the file: the vbuckets' persisted seqnos move, then `written` (and in
    /// fsync mode `synced`), and waiters are woken.
    fn publish(&mut self, shared: &Shared) {
        let last = self.batch.last().expect("non-empty").lsn;
        self.segment.records += self.batch.len() as u64;
        // Persisted seqnos first, then durability: whoever a durable LSN wakes must already
        // see the vbuckets' persisted seqnos cover it.
        // Seqnos rise with LSNs within a vbucket, and changes of one vbucket come in runs:
        // note each run's last seqno.
        self.per_vb.clear();
        let mut run: Option<((u16, u16), u64)> = None;
        for q in &self.batch {
            if let WalPayload::Change(c) = &q.payload {
                let vb = (c.bucket(), c.vbucket());
                match &mut run {
                    Some((k, s)) if *k == vb => *s = c.seqno(),
                    _ => {
                        if let Some((k, s)) = run.replace((vb, c.seqno())) {
                            self.per_vb.insert(k, s);
                        }
                    }
                }
            }
        }
        if let Some((k, s)) = run {
            self.per_vb.insert(k, s);
        }
        self.persisted.clear();
        self.persisted
            .extend(self.per_vb.iter().map(|(&(b, v), &s)| (b, v, s)));
        let charged: usize = self.batch.iter().map(Queued::charge).sum();
        shared.queued_bytes.fetch_sub(charged, Ordering::Relaxed);
        self.batch.clear();
        // After a surge, give back what a normal batch does not need.
        self.batch.shrink_to(MAX_KEPT_ENTRIES);
        self.buf.shrink_to(WRITE_CHUNK + self.cfg.block_size);
        (self.on_persisted)(&self.persisted);
        self.written = last;
        if self.cfg.mode == WalMode::Fsync {
            self.synced = last;
        }
        let recovered = {
            let mut d = shared.durable.lock();
            d.written = self.written;
            // After a lost sync, writing again is no recovery: see `report_sync_lost`.
            let was = !d.sync_lost && {
                d.synced = self.synced;
                d.error = None;
                shared.failing.swap(false, Ordering::AcqRel)
            };
            shared.announce();
            was
        };
        if recovered {
            log::warn!("WAL writes succeed again; accepting writes");
        }
    }

    /// Writes the batch, retrying with back-off while it fails (the engine refuses new writes
    /// meanwhile). False when the server stops with the batch still unwritten.
    fn write_until_done(&mut self, shared: &Shared) -> bool {
        let mut backoff = Duration::from_millis(20);
        let failing_since = Instant::now();
        loop {
            let Err(e) = self.write_batch(shared) else {
                return true;
            };
            report_failure(
                shared,
                format!("writing {}: {e}", self.segment.path.display()),
            );
            if shared.queue.lock().shutdown && failing_since.elapsed() > Duration::from_secs(3) {
                log::error!(
                    "WAL writer stopping with LSNs {}..={} unwritten",
                    self.batch[0].lsn,
                    self.batch.last().expect("non-empty").lsn
                );
                return false;
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

/// A write failed: new writes are refused and waiters told why until one succeeds. The reason
/// first, then the flag, under the lock `failure` reads them with: whoever sees the writer
/// failing sees why. Logged once per failing spell.
fn report_failure(shared: &Shared, msg: String) {
    let began_failing = {
        let mut d = shared.durable.lock();
        d.error = Some(msg.clone());
        let was = shared.failing.swap(true, Ordering::AcqRel);
        shared.announce();
        !was
    };
    if began_failing {
        log::error!("WAL write failed, refusing new writes until it succeeds: {msg}");
    }
}

/// A sync failed. Linux may have dropped the dirty pages it could not write, so a later sync
/// that succeeds says nothing of them: what was written since the last good sync may be lost
/// to a power failure. Nothing is announced synced from here on, and new writes are refused
/// (waiters told why), until a restart recovers from what the files hold. A process crash
/// loses nothing written: the page cache still holds it for recovery to read.
fn report_sync_lost(shared: &Shared, msg: String) {
    let msg = format!(
        "{msg}; what was written since the last sync may not be on the device: no write is \
         taken or acknowledged as synced until sluice restarts"
    );
    {
        let mut d = shared.durable.lock();
        d.sync_lost = true;
        d.error = Some(msg.clone());
        shared.failing.store(true, Ordering::Release);
        shared.announce();
    }
    log::error!("WAL sync failed: {msg}");
}

/// Past this many bytes queued, a waiter leaves the writing to the writer thread: a reply
/// task writes a small batch itself rather than wait for the thread to wake, never a backlog.
const LEAD_MAX_BYTES: usize = 256 << 10;

fn writer_loop(shared: Arc<Shared>) {
    loop {
        let (shutdown, rotate) = {
            let mut q = shared.queue.lock();
            let mut naps = 0;
            loop {
                let (written, synced) = {
                    let d = shared.durable.lock();
                    (d.written, d.synced)
                };
                // Records a waiter is expected to write are the thread's once LEADER_GRACE
                // has passed (see `Appender::drop`).
                let due = q.wanted
                    || shared.mode != WalMode::Write
                    || q.queued_at.is_none_or(|t| t.elapsed() >= LEADER_GRACE);
                let has_work = (!q.pending.is_empty() && due)
                    || q.shutdown
                    || q.rotate
                    || q.writeback
                    || (sync_due(&shared, synced) && written > synced);
                if has_work {
                    break;
                }
                if shared.mode != WalMode::Write {
                    shared.queue_cv.wait(&mut q);
                } else if let Some(t) = q.queued_at.filter(|_| !q.pending.is_empty()) {
                    shared.queue_cv.wait_until(&mut q, t + LEADER_GRACE);
                } else if naps < NAPS_BEFORE_SLEEP {
                    naps += 1;
                    shared.queue_cv.wait_for(&mut q, LEADER_GRACE);
                } else {
                    q.writer_idle = true;
                    shared.queue_cv.wait(&mut q);
                    q.writer_idle = false;
                    naps = 0;
                }
            }
            q.writeback = false;
            (q.shutdown, std::mem::take(&mut q.rotate))
        };
        // A waiter may be writing (see `WalWriter::written`): this waits for it.
        let mut guard = shared.writer.lock();
        let w = guard
            .as_mut()
            .expect("the thread alone takes the writer away");
        w.take_queued(&shared);
        if !w.batch.is_empty() && !w.write_until_done(&shared) {
            return;
        }
        let writeback = if w.cfg.mode == WalMode::Write {
            w.segment.writeback()
        } else {
            None
        };
        if sync_due(&shared, w.synced) && w.written > w.synced && !shared.durable.lock().sync_lost {
            // One sync serves every persist waiter of write mode that asked so far.
            let synced = if shared.failpoint.load(Ordering::Acquire) == Failpoint::SyncError as u8 {
                Err(io::Error::from_raw_os_error(libc::EIO))
            } else {
                shared
                    .sync_others()
                    .and_then(|()| timed_sync(&w.segment.file, &shared.sync_latency))
            };
            match synced {
                Ok(()) => {
                    w.synced = w.written;
                    let mut d = shared.durable.lock();
                    d.synced = w.synced;
                    shared.announce();
                }
                Err(e) => report_sync_lost(
                    &shared,
                    format!("syncing {}: {e}", w.segment.path.display()),
                ),
            }
        }
        let next_lsn = w.written + 1;
        let mut closing = None;
        if (rotate && w.segment.records > 0) || w.segment.size >= w.cfg.segment_size {
            match Segment::create(&w.cfg, next_lsn) {
                Ok(new) => {
                    let old = std::mem::replace(&mut w.segment, new);
                    closing = Some((old, w.written, w.cfg.dir.clone()));
                }
                Err(e) => log::error!(
                    "cannot start a new WAL segment, continuing in the current one: {e}"
                ),
            }
        }
        if shutdown && shared.queue.lock().pending.is_empty() {
            let w = guard.take().expect("present");
            if shared.queue.lock().crash {
                return;
            }
            for segment in closing.map(|(old, ..)| old).into_iter().chain([w.segment]) {
                if let Err(e) = segment.close(&w.cfg.dir) {
                    log::error!("closing WAL segment at shutdown: {e}");
                }
            }
            return;
        }
        // The full segment is closed with the writer lock released: closing syncs it, which
        // takes as long as its dirty pages do (a 64 MiB segment, a good part of a second on a
        // slow disk), and meanwhile replies leading their own batches write the new segment.
        // Nothing counts as synced past the old segment until it is closed, and only this
        // thread syncs, so no sync of the new segment can be announced before it.
        drop(guard);
        if let Some(range) = writeback {
            range.start();
        }
        if let Some((old, upto, dir)) = closing {
            match old.close(&dir) {
                // Closing syncs the old segment: all it holds is synced now (unless a sync
                // failed before: then a sync that succeeds proves nothing).
                Ok(()) if !shared.durable.lock().sync_lost => {
                    if let Some(w) = shared.writer.lock().as_mut() {
                        w.synced = w.synced.max(upto);
                    }
                    let mut d = shared.durable.lock();
                    d.synced = d.synced.max(upto);
                    shared.announce();
                }
                Ok(()) => {}
                // Closing syncs it: what it holds past the last sync may be lost.
                Err(e) => report_sync_lost(&shared, format!("closing a WAL segment: {e}")),
            }
        }
    }
}
