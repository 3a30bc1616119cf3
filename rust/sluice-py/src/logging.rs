//! The Rust side's log lines, handed to Python's `logging` by one thread of their own.
//!
//! A log line reaches Python only with the GIL. Written by the thread that logs, a line from
//! a thread holding a lock (a topic partition's, a vbucket's) waits for the GIL, while a
//! Python thread holding the GIL may be waiting, in a call into Rust, for that lock: both
//! stop for good. So a line is queued (formatted, with its level and where it came from) and
//! a forwarding thread, which holds no lock, writes it with the GIL. A line is never waited
//! for; when the queue is full, lines are counted and dropped, and the count is logged.
//! Lines at a level Python's logger for their target leaves out are not queued, once the
//! forwarder has met that target (the logger keeps Python's levels by target).
//!
//! Calls that run a command from Python (a tool, an engine's open and close, a server's start
//! and stop) end with `flush`, so their lines come before what Python prints next; at exit
//! `flush_logs` writes what is left. A process forked after the import has no forwarding
//! thread: its Rust lines fill the queue and are dropped (sluice forks nothing; Spark's Python
//! workers import it after their fork).

use log::{Log, Metadata, Record};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Lines queued at most; past it they are dropped (and counted) rather than waited for.
const QUEUE: usize = 65_536;

/// A log line, owned, as the forwarding thread rebuilds its record.
struct Line {
    level: log::Level,
    target: String,
    message: String,
    module_path: Option<&'static str>,
    file: Option<&'static str>,
    line: Option<u32>,
}

impl Line {
    fn write(&self, logger: &pyo3_log::Logger) {
        logger.log(
            &Record::builder()
                .level(self.level)
                .target(&self.target)
                .args(format_args!("{}", self.message))
                .module_path_static(self.module_path)
                .file_static(self.file)
                .line(self.line)
                .build(),
        );
    }
}

struct Queued {
    /// Shared with the forwarding thread, whose writes fill its cache of Python's levels.
    logger: Arc<pyo3_log::Logger>,
    queue: SyncSender<Line>,
}

/// Lines taken for the queue (counted before they are sent, so that a flush counts a line
/// its caller logged before any line sent after it).
static QUEUED: AtomicU64 = AtomicU64::new(0);
/// Lines the forwarding thread has written (or found left out by Python's levels).
static WRITTEN: AtomicU64 = AtomicU64::new(0);
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Whether the forwarding thread runs, and in which process (a fork has none).
static FORWARDING: AtomicBool = AtomicBool::new(false);
static FORWARDER_PID: AtomicU32 = AtomicU32::new(0);

thread_local! {
    static IS_FORWARDER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Log for Queued {
    fn enabled(&self, metadata: &Metadata) -> bool {
        // The logger's cache of Python's levels: no GIL.
        self.logger.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if !self.logger.enabled(record.metadata()) {
            return;
        }
        let line = Line {
            level: record.level(),
            target: record.target().to_string(),
            message: record.args().to_string(),
            module_path: record.module_path_static(),
            file: record.file_static(),
            line: record.line(),
        };
        QUEUED.fetch_add(1, Ordering::AcqRel);
        if self.queue.try_send(line).is_err() {
            QUEUED.fetch_sub(1, Ordering::AcqRel);
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn flush(&self) {}
}

/// Writes queued lines with the GIL, as many as are waiting under one acquisition.
fn forward(logger: &pyo3_log::Logger, queue: Receiver<Line>) {
    while let Ok(first) = queue.recv() {
        let mut batch = vec![first];
        batch.extend(queue.try_iter());
        // Lines Python's levels leave out (known from the cache) take no GIL.
        let (wanted, left_out): (Vec<Line>, Vec<Line>) = batch.into_iter().partition(|l| {
            logger.enabled(&Metadata::builder().level(l.level).target(&l.target).build())
        });
        // Counted after what came before them in the queue is written: a flush waits for
        // its caller's lines, and a count that runs ahead would let it go early.
        if wanted.is_empty() {
            WRITTEN.fetch_add(left_out.len() as u64, Ordering::AcqRel);
            continue;
        }
        // None once the interpreter shuts down: what is left is not written.
        let attached = Python::try_attach(|_py| {
            for l in &wanted {
                l.write(logger);
            }
            WRITTEN.fetch_add((wanted.len() + left_out.len()) as u64, Ordering::AcqRel);
            let dropped = DROPPED.swap(0, Ordering::Relaxed);
            if dropped > 0 {
                logger.log(
                    &Record::builder()
                        .level(log::Level::Warn)
                        .target("sluice")
                        .args(format_args!(
                            "{dropped} log line(s) dropped: logging fell {QUEUE} lines behind"
                        ))
                        .build(),
                );
            }
        });
        if attached.is_none() {
            break;
        }
    }
    FORWARDING.store(false, Ordering::Release);
}

/// Installs the queued logger (once per process; a second call does nothing).
pub fn install(py: Python<'_>) {
    let Ok(logger) = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels) else {
        return;
    };
    let logger = Arc::new(logger);
    let (queue, lines) = sync_channel(QUEUE);
    let queued = Queued {
        logger: logger.clone(),
        queue,
    };
    if log::set_boxed_logger(Box::new(queued)).is_err() {
        return;
    }
    log::set_max_level(log::LevelFilter::Debug);
    FORWARDER_PID.store(std::process::id(), Ordering::Release);
    FORWARDING.store(true, Ordering::Release);
    let spawned = std::thread::Builder::new()
        .name("sluice-log".into())
        .spawn(move || {
            IS_FORWARDER.with(|f| f.set(true));
            forward(&logger, lines)
        });
    if spawned.is_err() {
        FORWARDING.store(false, Ordering::Release);
    }
}

/// Waits until the lines queued so far are written, for at most `timeout`; returns whether
/// they were. The forwarding thread needs the GIL: call it without (`flush_logs` lets it go).
pub fn flush(timeout: Duration) -> bool {
    // No forwarder to wait for: none runs (shut down, or a forked process), or this is it.
    if !FORWARDING.load(Ordering::Acquire)
        || FORWARDER_PID.load(Ordering::Acquire) != std::process::id()
        || IS_FORWARDER.with(|f| f.get())
    {
        return false;
    }
    let target = QUEUED.load(Ordering::Acquire);
    let deadline = Instant::now() + timeout;
    loop {
        if WRITTEN.load(Ordering::Acquire) >= target {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How long a command's call waits for its lines at its end, at most.
pub const COMMAND_FLUSH: Duration = Duration::from_secs(1);

/// Waits (without the GIL) until the log lines queued so far are written, for at most
/// `timeout` seconds; returns whether they were.
#[pyfunction]
#[pyo3(signature = (timeout = 1.0))]
pub fn flush_logs(py: Python<'_>, timeout: f64) -> bool {
    let timeout = Duration::from_secs_f64(timeout.clamp(0.0, 60.0));
    py.detach(|| flush(timeout))
}

/// `py.detach(f)` for a call that runs a command from Python: once `f` is done, its log lines
/// (and any queued before them) are written before Python goes on.
pub fn detach_command<T: Send>(py: Python<'_>, f: impl FnOnce() -> T + Send) -> T {
    py.detach(|| {
        let out = f();
        flush(COMMAND_FLUSH);
        out
    })
}
