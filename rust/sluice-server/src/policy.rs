//! Policy plugins: decisions a Python plugin may take in place of the native default (which
//! ACK interval and window a TAP connection uses, how long a dropped session lives, which
//! cursors to drop, which changes a stream passes on).
//!
//! The network side never runs plugin code. It posts a question to the plugin's queue and
//! waits, asynchronously and at most the configured timeout, for the answer; a Python thread
//! per plugin takes questions off the queue (the GIL released while it waits) and answers them.
//! No answer in time, a full queue or a plugin error all mean the native default. Questions are
//! asked per batch or per round trip, never per item. With no plugin installed nothing is
//! queued at all.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::metrics::metric;
use parking_lot::{Condvar, Mutex, RwLock};
use sluice_core::checkpoint::{CursorDropPolicy, CursorId, CursorInfo, DropSlowest};
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Ack = 0,
    Retransmit = 1,
    SlowConsumer = 2,
    Filter = 3,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Ack,
        PolicyKind::Retransmit,
        PolicyKind::SlowConsumer,
        PolicyKind::Filter,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Ack => "ack",
            PolicyKind::Retransmit => "retransmit",
            PolicyKind::SlowConsumer => "slow_consumer",
            PolicyKind::Filter => "filter",
        }
    }

    pub fn parse(name: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// What a connection tells its AckPolicy after each acknowledgement: a TAP producer after an
/// ACK (counts in messages), or a replica's DCP consumer after a buffer acknowledgement (counts
/// in bytes; `interval` is the bytes between acknowledgements, `window` the connection buffer).
#[derive(Debug, Clone, Default)]
pub struct AckStats {
    /// "tap" or "dcp".
    pub protocol: &'static str,
    pub connection: String,
    /// Round trip of the message just acknowledged, in seconds (TAP); on DCP, the seconds the
    /// acknowledged bytes took to arrive.
    pub rtt: f64,
    pub unacked: u64,
    pub acked_total: u64,
    pub sent_total: u64,
    pub interval: u32,
    pub window: u32,
}

/// What a RetransmitPolicy decides about.
#[derive(Debug, Clone)]
pub enum RetransmitEvent {
    /// A named session lost its connection with this many messages unacknowledged.
    Disconnected { connection: String, unacked: u64 },
    /// The client answered TMPFAIL or BUSY; `attempt` counts the replies in a row.
    TempFail {
        connection: String,
        status: u16,
        attempt: u32,
    },
}

/// The documents of a batch a StreamFilter judges, shared with the plugin's thread. Their
/// keys are read there, and only if the plugin looks at them: a filter that answers with a
/// prefix rule costs the connection nothing per document.
pub trait FilterDocs: Send + Sync {
    /// Appends each document's key, the end of its key, and its vbucket.
    fn read_keys(&self, into: &mut FilterKeys);
}

/// A batch's keys in one buffer with their ends, and their vbuckets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FilterKeys {
    pub keys: Vec<u8>,
    pub ends: Vec<u32>,
    pub vbuckets: Vec<u16>,
}

impl FilterKeys {
    pub fn push(&mut self, key: &[u8], vbucket: u16) {
        self.keys.extend_from_slice(key);
        self.ends.push(self.keys.len() as u32);
        self.vbuckets.push(vbucket);
    }
}

/// One batch a StreamFilter judges.
#[derive(Clone)]
pub struct FilterBatch {
    pub connection: String,
    pub docs: usize,
    pub value_bytes: u64,
    pub source: Arc<dyn FilterDocs>,
}

impl FilterBatch {
    pub fn keys(&self) -> FilterKeys {
        let mut k = FilterKeys::default();
        self.source.read_keys(&mut k);
        k
    }
}

impl std::fmt::Debug for FilterBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FilterBatch")
            .field("connection", &self.connection)
            .field("docs", &self.docs)
            .field("value_bytes", &self.value_bytes)
            .finish()
    }
}

/// Per-item filter actions.
pub mod action {
    pub const KEEP: u8 = 0;
    pub const DROP: u8 = 1;
    pub const STRIP_VALUE: u8 = 2;
}

#[derive(Debug, Clone)]
pub enum FilterDecision {
    /// One action for the whole batch.
    All(u8),
    /// One action per item, in order.
    Each(Vec<u8>),
    /// Native rules applied to each key.
    Prefixes(PrefixRule),
}

impl FilterDecision {
    /// The action for item `i` with `key`.
    pub fn action(&self, i: usize, key: &[u8]) -> u8 {
        match self {
            FilterDecision::All(a) => *a,
            FilterDecision::Each(v) => v.get(i).copied().unwrap_or(action::KEEP),
            FilterDecision::Prefixes(rule) => rule.action(key),
        }
    }
}

/// Drop keys with any of the `drop` prefixes, strip the values of keys with any of the `strip`
/// prefixes, keep the rest.
#[derive(Debug, Clone)]
pub struct PrefixRule {
    drop: Vec<Vec<u8>>,
    strip: Vec<Vec<u8>>,
    /// A bit per byte some prefix begins with (all, if one is empty): most keys are kept
    /// after one lookup, without comparing prefixes.
    first: [u64; 4],
}

impl PrefixRule {
    pub fn new(drop: Vec<Vec<u8>>, strip: Vec<Vec<u8>>) -> PrefixRule {
        let mut first = [0u64; 4];
        for p in drop.iter().chain(&strip) {
            match p.first() {
                Some(&b) => first[b as usize >> 6] |= 1 << (b & 63),
                None => first = [u64::MAX; 4],
            }
        }
        PrefixRule { drop, strip, first }
    }

    pub fn action(&self, key: &[u8]) -> u8 {
        if key
            .first()
            .is_some_and(|&b| self.first[b as usize >> 6] & (1 << (b & 63)) == 0)
        {
            action::KEEP
        } else if self.drop.iter().any(|p| key.starts_with(p)) {
            action::DROP
        } else if self.strip.iter().any(|p| key.starts_with(p)) {
            action::STRIP_VALUE
        } else {
            action::KEEP
        }
    }
}

#[derive(Debug, Clone)]
pub enum Question {
    Ack(AckStats),
    Retransmit(RetransmitEvent),
    SlowConsumer {
        over_by: usize,
        candidates: Vec<CursorInfo>,
    },
    Filter(FilterBatch),
}

#[derive(Debug, Clone)]
pub enum Answer {
    /// Use the native decision.
    Default,
    Ack {
        interval: u32,
        window: u32,
    },
    /// Grace period in seconds (for a disconnect) or back-off (after a temporary failure);
    /// `resend` whether a reconnect gets the unacknowledged messages again.
    Retransmit {
        seconds: f64,
        resend: bool,
    },
    /// Cursors (by id) to drop.
    Drop(Vec<CursorId>),
    Filter(FilterDecision),
}

/// Where an answer lands: the asker waits on it (blocking or async).
#[derive(Default)]
struct Slot {
    answer: Mutex<Option<Answer>>,
    ready: Condvar,
    notify: tokio::sync::Notify,
}

/// A question posed and not yet collected (see `PolicyHost::pose`).
pub struct Pending {
    kind: PolicyKind,
    /// None: nothing was asked (no plugin, or its queue was full), so the default applies.
    slot: Option<Arc<Slot>>,
    deadline: Instant,
    started: Instant,
}

impl Pending {
    /// The plugin's answer, waiting (without blocking the thread) until the deadline.
    pub async fn answer(self, host: &PolicyHost) -> Answer {
        let Some(slot) = self.slot else {
            return Answer::Default;
        };
        let _ = tokio::time::timeout_at(self.deadline.into(), slot.notify.notified()).await;
        host.settle(self.kind, &slot, self.started)
    }

    /// The answer if it is in or the deadline has passed (then the default); None while the
    /// plugin may still answer. For threads that poll rather than wait.
    pub fn try_answer(&self, host: &PolicyHost) -> Option<Answer> {
        let Some(slot) = &self.slot else {
            return Some(Answer::Default);
        };
        if slot.answer.lock().is_none() && Instant::now() < self.deadline {
            return None;
        }
        Some(host.settle(self.kind, slot, self.started))
    }
}

/// A question in flight, as the plugin thread receives it.
pub struct Call {
    pub question: Question,
    pub reply: Reply,
}

/// Where a call's answer goes. Kept apart from the question, so that a plugin's thread can let
/// go of the question (and the batch it shares with the connection) before it answers.
pub struct Reply {
    pub kind: PolicyKind,
    pub posted: Instant,
    slot: Arc<Slot>,
}

impl Reply {
    pub fn answer(&self, a: Answer) {
        *self.slot.answer.lock() = Some(a);
        self.slot.ready.notify_all();
        self.slot.notify.notify_one();
    }
}

#[derive(Debug, Default)]
pub struct PolicyStats {
    pub calls: AtomicU64,
    pub timeouts: AtomicU64,
    pub errors: AtomicU64,
    /// Questions not asked because the plugin's queue was full (it is far behind).
    pub skipped: AtomicU64,
    /// Total seconds from question to answer, in microseconds.
    pub answer_micros: AtomicU64,
}

struct Queue {
    installed: AtomicBool,
    tx: SyncSender<Call>,
    rx: Mutex<Receiver<Call>>,
    stats: PolicyStats,
}

/// Questions waiting per plugin; more are answered with the default at once.
const QUEUE_DEPTH: usize = 64;

pub struct PolicyHost {
    queues: [Queue; 4],
    timeout: RwLock<Duration>,
}

impl std::fmt::Debug for PolicyHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let installed: Vec<&str> = PolicyKind::ALL
            .into_iter()
            .filter(|k| self.installed(*k))
            .map(PolicyKind::name)
            .collect();
        f.debug_struct("PolicyHost")
            .field("installed", &installed)
            .finish()
    }
}

impl Default for PolicyHost {
    fn default() -> Self {
        let queue = || {
            let (tx, rx) = sync_channel(QUEUE_DEPTH);
            Queue {
                installed: AtomicBool::new(false),
                tx,
                rx: Mutex::new(rx),
                stats: PolicyStats::default(),
            }
        };
        PolicyHost {
            queues: [queue(), queue(), queue(), queue()],
            timeout: RwLock::new(Duration::from_millis(50)),
        }
    }
}

impl PolicyHost {
    pub fn installed(&self, kind: PolicyKind) -> bool {
        self.queues[kind as usize].installed.load(Ordering::Acquire)
    }

    /// Installs or removes a plugin (the Python side's loader and SIGHUP reload).
    pub fn set_installed(&self, kind: PolicyKind, on: bool) {
        self.queues[kind as usize]
            .installed
            .store(on, Ordering::Release);
        if !on {
            // Questions left behind are answered with the default by their askers' timeouts.
            let rx = self.queues[kind as usize].rx.lock();
            while rx.try_recv().is_ok() {}
        }
    }

    pub fn set_timeout(&self, t: Duration) {
        *self.timeout.write() = t;
    }

    pub fn timeout(&self) -> Duration {
        *self.timeout.read()
    }

    pub fn stats(&self, kind: PolicyKind) -> &PolicyStats {
        &self.queues[kind as usize].stats
    }

    fn post(&self, kind: PolicyKind, question: Question) -> Option<Arc<Slot>> {
        let q = &self.queues[kind as usize];
        if !q.installed.load(Ordering::Acquire) {
            return None;
        }
        let slot = Arc::new(Slot::default());
        let call = Call {
            question,
            reply: Reply {
                kind,
                posted: Instant::now(),
                slot: slot.clone(),
            },
        };
        q.stats.calls.fetch_add(1, Ordering::Relaxed);
        match q.tx.try_send(call) {
            Ok(()) => Some(slot),
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                q.stats.skipped.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    fn settle(&self, kind: PolicyKind, slot: &Slot, started: Instant) -> Answer {
        let q = &self.queues[kind as usize];
        match slot.answer.lock().take() {
            Some(a) => {
                q.stats
                    .answer_micros
                    .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                a
            }
            None => {
                q.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                Answer::Default
            }
        }
    }

    /// Asks the plugin and waits (without blocking the thread) up to the timeout.
    pub async fn ask(&self, kind: PolicyKind, question: Question) -> Answer {
        self.pose(kind, question).answer(self).await
    }

    /// Asks the plugin without waiting: the caller goes on with other work (the next batch)
    /// and collects the answer later; the timeout counts from now.
    pub fn pose(&self, kind: PolicyKind, question: Question) -> Pending {
        let started = Instant::now();
        let slot = self.post(kind, question);
        Pending {
            kind,
            slot,
            deadline: started + self.timeout(),
            started,
        }
    }

    /// Asks the plugin and blocks this (non-I/O) thread up to the timeout.
    pub fn ask_blocking(&self, kind: PolicyKind, question: Question) -> Answer {
        let started = Instant::now();
        let Some(slot) = self.post(kind, question) else {
            return Answer::Default;
        };
        let deadline = started + self.timeout();
        let mut answer = slot.answer.lock();
        while answer.is_none() {
            if slot.ready.wait_until(&mut answer, deadline).timed_out() {
                break;
            }
        }
        drop(answer);
        self.settle(kind, &slot, started)
    }

    /// The plugin thread's side: the next question, waiting up to `wait`.
    pub fn next_call(&self, kind: PolicyKind, wait: Duration) -> Option<Call> {
        let rx = self.queues[kind as usize].rx.lock();
        match rx.recv_timeout(wait) {
            Ok(c) => Some(c),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// The plugin raised (or answered with something unusable): counted; the asker gets the
    /// default.
    pub fn count_error(&self, kind: PolicyKind) {
        self.queues[kind as usize]
            .stats
            .errors
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// The engine's cursor-drop policy: a SlowConsumerPolicy plugin when one is installed, else
/// the native choice (the cursors pinning the most memory).
pub struct PluginDropPolicy(pub Arc<PolicyHost>);

impl CursorDropPolicy for PluginDropPolicy {
    fn choose(&self, over_by: usize, candidates: &[CursorInfo]) -> Vec<(u16, u16, CursorId)> {
        if self.0.installed(PolicyKind::SlowConsumer) {
            let q = Question::SlowConsumer {
                over_by,
                candidates: candidates.to_vec(),
            };
            if let Answer::Drop(ids) = self.0.ask_blocking(PolicyKind::SlowConsumer, q) {
                return candidates
                    .iter()
                    .filter(|c| ids.contains(&c.id))
                    .map(|c| (c.bucket, c.vbucket, c.id))
                    .collect();
            }
        }
        DropSlowest.choose(over_by, candidates)
    }
}

impl PolicyHost {
    /// The Prometheus lines of the plugins: which are installed, their calls and answers.
    pub fn metrics(&self, o: &mut String) {
        let p = self;
        let kinds = crate::policy::PolicyKind::ALL;
        metric(
            o,
            "sluice_policy_installed",
            "gauge",
            "1 when a Python plugin decides this policy.",
        );
        for k in kinds {
            let _ = writeln!(
                o,
                "sluice_policy_installed{{policy=\"{}\"}} {}",
                k.name(),
                p.installed(k) as u8
            );
        }
        type Pick = fn(&crate::policy::PolicyStats) -> &std::sync::atomic::AtomicU64;
        let series: [(&str, &str, Pick); 4] = [
            (
                "sluice_policy_calls_total",
                "Questions put to a policy plugin.",
                |s| &s.calls,
            ),
            (
                "sluice_policy_timeouts_total",
                "Plugin answers that did not come in time (the default was used).",
                |s| &s.timeouts,
            ),
            (
                "sluice_policy_errors_total",
                "Plugin calls that raised or answered something unusable.",
                |s| &s.errors,
            ),
            (
                "sluice_policy_skipped_total",
                "Questions not asked because the plugin's queue was full.",
                |s| &s.skipped,
            ),
        ];
        for (name, help, pick) in series {
            metric(o, name, "counter", help);
            for k in kinds {
                let _ = writeln!(
                    o,
                    "{name}{{policy=\"{}\"}} {}",
                    k.name(),
                    pick(p.stats(k)).load(Relaxed)
                );
            }
        }
        metric(
            o,
            "sluice_policy_answer_seconds_total",
            "counter",
            "Time from question to answer, summed.",
        );
        for k in kinds {
            let micros = p.stats(k).answer_micros.load(Relaxed);
            let _ = writeln!(
                o,
                "sluice_policy_answer_seconds_total{{policy=\"{}\"}} {:.6}",
                k.name(),
                micros as f64 / 1e6
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_queued_without_a_plugin() {
        let host = PolicyHost::default();
        let a = host.ask_blocking(PolicyKind::Ack, Question::Ack(AckStats::default()));
        assert!(matches!(a, Answer::Default));
        assert_eq!(host.stats(PolicyKind::Ack).calls.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_answer_in_time_is_used_and_a_late_one_is_a_timeout() {
        let host = Arc::new(PolicyHost::default());
        host.set_installed(PolicyKind::Ack, true);
        host.set_timeout(Duration::from_millis(200));
        let h = host.clone();
        let plugin = std::thread::spawn(move || {
            let c = h
                .next_call(PolicyKind::Ack, Duration::from_secs(5))
                .unwrap();
            c.reply.answer(Answer::Ack {
                interval: 7,
                window: 9,
            });
            let c = h
                .next_call(PolicyKind::Ack, Duration::from_secs(5))
                .unwrap();
            std::thread::sleep(Duration::from_millis(400));
            c.reply.answer(Answer::Ack {
                interval: 1,
                window: 1,
            });
        });
        let a = host.ask_blocking(PolicyKind::Ack, Question::Ack(AckStats::default()));
        assert!(matches!(
            a,
            Answer::Ack {
                interval: 7,
                window: 9
            }
        ));
        let a = host.ask_blocking(PolicyKind::Ack, Question::Ack(AckStats::default()));
        assert!(matches!(a, Answer::Default));
        plugin.join().unwrap();
        let s = host.stats(PolicyKind::Ack);
        assert_eq!(s.calls.load(Ordering::Relaxed), 2);
        assert_eq!(s.timeouts.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_slow_consumer_plugin_chooses_the_cursors_to_drop() {
        let host = Arc::new(PolicyHost::default());
        let info = |id, pinned| CursorInfo {
            bucket: 0,
            vbucket: 1,
            id,
            name: format!("dcp:c{id}:1"),
            seqno: 0,
            pinned_bytes: pinned,
        };
        let candidates = [info(1, 900), info(2, 10)];
        let policy = PluginDropPolicy(host.clone());
        // Native: the cursor pinning the most memory.
        assert_eq!(policy.choose(100, &candidates), vec![(0, 1, 1)]);
        host.set_installed(PolicyKind::SlowConsumer, true);
        host.set_timeout(Duration::from_secs(5));
        let h = host.clone();
        let plugin = std::thread::spawn(move || {
            let c = h
                .next_call(PolicyKind::SlowConsumer, Duration::from_secs(5))
                .unwrap();
            assert!(matches!(
                c.question,
                Question::SlowConsumer { over_by: 100, .. }
            ));
            c.reply.answer(Answer::Drop(vec![2, 99]));
        });
        // The plugin's choice, limited to real candidates.
        assert_eq!(policy.choose(100, &candidates), vec![(0, 1, 2)]);
        plugin.join().unwrap();
    }

    #[test]
    fn prefix_rules() {
        let d = FilterDecision::Prefixes(PrefixRule::new(
            vec![b"tmp:".to_vec()],
            vec![b"big:".to_vec(), b"tx".to_vec()],
        ));
        assert_eq!(d.action(0, b"tmp:1"), action::DROP);
        assert_eq!(d.action(0, b"big:1"), action::STRIP_VALUE);
        assert_eq!(d.action(0, b"txn"), action::STRIP_VALUE);
        // Same first byte as a prefix, but no prefix: compared, and kept.
        assert_eq!(d.action(0, b"tmq"), action::KEEP);
        assert_eq!(d.action(0, b"user:1"), action::KEEP);
        assert_eq!(d.action(0, b""), action::KEEP);
        // An empty prefix matches every key.
        let all = PrefixRule::new(vec![], vec![Vec::new()]);
        assert_eq!(all.action(b"user:1"), action::STRIP_VALUE);
        assert_eq!(all.action(b""), action::STRIP_VALUE);
    }
}
