//! The Rust side's log lines, handed to Python's `logging` by one thread of their own.
//!
//! A log line reaches Python only with the GIL. Written by the thread that logs, a line from
//! a thread holding a lock (a topic partition's, a vbucket's) waits for the GIL, while a
//! Python thread holding the GIL may be waiting, in a call into Rust, for that lock: both
//! stop for good. So a line is queued (formatted, with its level and where it came from) and
//! a forwarding thread, which holds no lock, writes it with the GIL. A line is never waited
//! for; when the queue is full, lines are counted and dropped, and the count is logged.
//! `flush_logs` waits for what is queued (at exit, and before a test reads what was logged).
//! A process forked after the import has no forwarding thread: its Rust lines fill the queue
//! and are dropped (sluice forks nothing; Spark's Python workers import it after their fork).

use log::{Log, Metadata, Record};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
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

struct Queued {
    inner: pyo3_log::Logger,
    queue: SyncSender<Line>,
}

static QUEUED: AtomicU64 = AtomicU64::new(0);
static WRITTEN: AtomicU64 = AtomicU64::new(0);
static DROPPED: AtomicU64 = AtomicU64::new(0);

impl Log for Queued {
    fn enabled(&self, metadata: &Metadata) -> bool {
        // The logger's cache of Python's levels: no GIL.
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if !self.inner.enabled(record.metadata()) {
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
        match self.queue.try_send(line) {
            Ok(()) => {
                QUEUED.fetch_add(1, Ordering::AcqRel);
            }
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn flush(&self) {}
}

/// Writes queued lines with the GIL, as many as are waiting under one acquisition.
fn forward(inner: &pyo3_log::Logger, queue: Receiver<Line>) {
    while let Ok(first) = queue.recv() {
        // None once the interpreter shuts down: what is left is not written.
        let attached = Python::try_attach(|_py| {
            let mut next = Some(first);
            while let Some(l) = next {
                inner.log(
                    &Record::builder()
                        .level(l.level)
                        .target(&l.target)
                        .args(format_args!("{}", l.message))
                        .module_path_static(l.module_path)
                        .file_static(l.file)
                        .line(l.line)
                        .build(),
                );
                WRITTEN.fetch_add(1, Ordering::AcqRel);
                next = queue.try_recv().ok();
            }
            let dropped = DROPPED.swap(0, Ordering::Relaxed);
            if dropped > 0 {
                inner.log(
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
            return;
        }
    }
}

/// Installs the queued logger (once per process; a second call does nothing).
pub fn install(py: Python<'_>) {
    let Ok(inner) = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels) else {
        return;
    };
    let (queue, lines) = sync_channel(QUEUE);
    let logger = Queued { inner, queue };
    // The forwarding thread's own logger writes what the queue gives it.
    let Ok(forwarder) = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels) else {
        return;
    };
    if log::set_boxed_logger(Box::new(logger)).is_err() {
        return;
    }
    log::set_max_level(log::LevelFilter::Debug);
    let _ = std::thread::Builder::new()
        .name("sluice-log".into())
        .spawn(move || forward(&forwarder, lines));
}

/// Waits (without the GIL) until the log lines queued so far are written, for at most
/// `timeout` seconds; returns whether they were.
#[pyfunction]
#[pyo3(signature = (timeout = 1.0))]
pub fn flush_logs(py: Python<'_>, timeout: f64) -> bool {
    let target = QUEUED.load(Ordering::Acquire);
    let deadline = Instant::now() + Duration::from_secs_f64(timeout.clamp(0.0, 60.0));
    py.detach(|| loop {
        if WRITTEN.load(Ordering::Acquire) >= target {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    })
}
