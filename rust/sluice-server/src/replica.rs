//! A replica's side of replication: per bucket, one DCP connection to the active with a stream
//! per replica vbucket, on a thread of its own (the replicator's); small batches are applied on
//! the connection's thread as they arrive, which spares a wake-up per batch. Batches are applied with the active's seqnos,
//! CAS and rev seqnos and logged to this node's WAL; the resume point is always this node's own
//! state (its failover log and high seqno), so a restart or a cut connection resumes without a
//! full resync. Rollbacks asked for by the active are carried out on the vbucket before its
//! stream goes on. After each batch, the replica acknowledges (SEQNO_ACKNOWLEDGED) the end of
//! the last whole snapshot it holds, and what of it is on disk, for durable writes.
//!
//! When the active gives a vbucket away (a takeover to another node), its stream here ends
//! (STREAM_END, state changed) and is asked for again alone; the active, whose copy is now
//! dead, refuses it (NOT_MY_VBUCKET), and the vbucket goes dead here too and is no longer
//! followed, as a Couchbase replica's does. The other streams go on throughout.
//!
//! A probe connection of its own asks the active for its high seqnos every second, so the lag
//! reported is against where the active is, not against what this node has received.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sluice_core::bucket::Bucket;
use sluice_core::engine::StreamPosition;
use sluice_core::failover::FailoverEntry;
use sluice_core::hlc::now_nanos;
use sluice_core::item::{ChangeOp, ItemMeta};
use sluice_core::vbucket::VbState;
use sluice_core::Engine;

use sluice_proto::dcp::{self, stream_end_reason, vbucket_state};
use sluice_proto::mcbp::status;

use crate::clustermap::ClusterMap;
use crate::dcp::consumer::{
    Batch, Consumer, ConsumerConfig, ConsumerLink, Event, Position, RollbackMode, SeqnoProbe,
    SessionState,
};
use crate::metrics::metric;
use crate::policy::PolicyHost;
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

/// Why following the active, or a takeover, stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    /// The engine refused the changes the stream brought for a vbucket.
    #[error("applying vbucket {vbucket}: {source}")]
    Apply {
        vbucket: u16,
        source: sluice_core::Error,
    },
    /// The engine refused the vbucket's failover log or state.
    #[error("vbucket {vbucket}: {source}")]
    Vbucket {
        vbucket: u16,
        source: sluice_core::Error,
    },
    #[error("rolling back vbuckets {vbuckets:?}: {source}")]
    Rollback {
        vbuckets: Vec<(u16, u64)>,
        source: sluice_core::Error,
    },
    #[error(transparent)]
    Engine(#[from] sluice_core::Error),
    /// The consumer's connection failed, with its reason.
    #[error("{0}")]
    Connection(String),
    #[error("the active ended the stream of vbucket {vbucket} (reason {reason})")]
    StreamEnded { vbucket: u16, reason: u32 },
    #[error("the active refused the stream of vbucket {0}: it does not serve it yet")]
    Refused(u16),
    #[error("the active ended every stream")]
    EveryStreamEnded,
    #[error("vbucket {0} vanished")]
    Vanished(u16),
    #[error("no vbucket {vbucket} in bucket {bucket:?}")]
    NoVbucket { vbucket: u16, bucket: String },
    #[error(
        "vbucket {vbucket} is active here with data (high seqno {high_seqno}); it cannot be \
         taken over onto it"
    )]
    ActiveWithData { vbucket: u16, high_seqno: u64 },
    #[error("the source ended the takeover stream (reason {0}) before handing over")]
    TakeoverEnded(u32),
    #[error("vbucket {vbucket} was not handed over within {timeout:?}")]
    NotHandedOver { vbucket: u16, timeout: Duration },
}

#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// The active node's memcached address.
    pub active: String,
    pub username: Option<String>,
    pub password: Option<String>,
    /// Seconds between NOOPs; a connection silent for twice this long is dead.
    pub noop_interval: u32,
    /// Connect over TLS, verifying the active's certificate.
    pub tls: Option<crate::tls::ClientTls>,
    /// The vbuckets to follow from this active, as a cluster map gives them (None: every
    /// replica vbucket here, as `replica_of` follows). With a map, a stream the active refuses
    /// is asked for again: the active has not caught up with the map yet.
    pub vbuckets: Option<Vec<u16>>,
}

/// How often the replica asks its active for its high seqnos.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// Where one replica vbucket stands against its active, for /metrics and /status.
#[derive(Debug, Clone, Default)]
pub struct VbLag {
    /// The active's high seqno as last learned: from the probe (asked every second) or a
    /// snapshot marker received since, whichever is newer.
    pub active_seqno: u64,
    pub applied_seqno: u64,
    /// Milliseconds from the active's write (its CAS clock) to the apply here, for the newest
    /// change of the last batch.
    pub lag_ms: f64,
    /// The end of the last whole snapshot held, as acknowledged.
    pub acked_seqno: u64,
    pub acked_persisted: u64,
}

#[derive(Default)]
pub struct ReplicaStats {
    pub connected: AtomicBool,
    pub connects: AtomicU64,
    pub items: AtomicU64,
    pub rollbacks: AtomicU64,
    pub last_error: Mutex<Option<String>>,
    pub vbuckets: Mutex<BTreeMap<u16, VbLag>>,
    /// Apply delays (write on the active to apply here), milliseconds, by bucket upper bound.
    pub delay_buckets: [AtomicU64; DELAY_BOUNDS_MS.len() + 1],
    pub delay_sum_us: AtomicU64,
}

pub const DELAY_BOUNDS_MS: [f64; 10] = [0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 500.0, 2000.0];

impl ReplicaStats {
    fn observe_delay(&self, ms: f64) {
        let i = DELAY_BOUNDS_MS
            .iter()
            .position(|&b| ms <= b)
            .unwrap_or(DELAY_BOUNDS_MS.len());
        self.delay_buckets[i].fetch_add(1, Ordering::Relaxed);
        self.delay_sum_us
            .fetch_add((ms * 1000.0) as u64, Ordering::Relaxed);
    }
}

/// One bucket's replication from its active.
pub struct Replicator {
    pub bucket: String,
    pub config: ReplicaConfig,
    pub stats: Arc<ReplicaStats>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    probe: Option<JoinHandle<()>>,
    interrupt_probe: Box<dyn Fn() + Send + Sync>,
}

impl Replicator {
    /// `policies`: an AckPolicy plugin there sizes the connection's flow control.
    /// `kv_address`: this node's KV address, told to the active for its cluster map.
    pub fn start(
        engine: Arc<Engine>,
        bucket: Arc<Bucket>,
        config: ReplicaConfig,
        policies: Arc<PolicyHost>,
        kv_address: Option<String>,
    ) -> Replicator {
        let stats = Arc::new(ReplicaStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let name = bucket.name().to_string();
        let node = engine.instance().to_string();
        let thread = {
            let (stats, stop, config) = (stats.clone(), stop.clone(), config.clone());
            std::thread::Builder::new()
                .name(format!("sluice-replica-{name}"))
                .spawn(move || {
                    follow(
                        engine.clone(),
                        bucket,
                        config,
                        stats,
                        stop,
                        policies,
                        kv_address,
                    )
                })
                .expect("spawn a thread")
        };
        let probe = SeqnoProbe::new(ConsumerConfig {
            address: config.active.clone(),
            bucket: name.clone(),
            username: config.username.clone(),
            password: config.password.clone(),
            name: format!("replication-probe:{node}:{name}"),
            tls: config.tls.clone(),
            setup_timeout: Some(Duration::from_secs(2)),
            noop_interval: 0,
            ..ConsumerConfig::default()
        });
        let interrupt_probe = Box::new(probe.interrupter());
        let probe = {
            let (stats, stop) = (stats.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("sluice-replica-probe-{name}"))
                .spawn(move || probe_active(probe, &stats, &stop))
                .expect("spawn a thread")
        };
        Replicator {
            bucket: name,
            config,
            stats,
            stop,
            thread: Some(thread),
            probe: Some(probe),
            interrupt_probe,
        }
    }

    /// Whether this is the replication `config` asks for, of `bucket`.
    fn runs(&self, bucket: &Bucket, config: &ReplicaConfig) -> bool {
        self.bucket == bucket.name()
            && self.config.active == config.active
            && self.config.vbuckets == config.vbuckets
    }

    /// Stops following; returns once the connection is closed and nothing more is applied.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        (self.interrupt_probe)();
        for t in [self.thread.take(), self.probe.take()]
            .into_iter()
            .flatten()
        {
            let _ = t.join();
        }
    }
}

impl Drop for Replicator {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Asks the active for its high seqnos every `PROBE_INTERVAL` until stopped, into the lag of
/// the vbuckets followed. Failures are left to the stream connection to report (they share
/// the path); the last known seqnos stand meanwhile.
fn probe_active(mut probe: SeqnoProbe, stats: &ReplicaStats, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let asked = Instant::now();
        match probe.high_seqnos() {
            Ok(highs) => {
                let mut lags = stats.vbuckets.lock();
                for (vb, l) in lags.iter_mut() {
                    if let Some(&high) = highs.get(vb) {
                        l.active_seqno = high;
                    }
                }
            }
            Err(e) => log::debug!("asking the active for its high seqnos: {e}"),
        }
        while asked.elapsed() < PROBE_INTERVAL && !stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Where a vbucket's stream resumes: this node's failover log and high seqno, as a whole
/// snapshot (what was applied of a partial one is superseded by the rest of it).
fn resume_point(p: &StreamPosition) -> Position {
    Position {
        failover: p.failover.iter().map(|e| (e.uuid, e.seqno)).collect(),
        seqno: p.high_seqno,
        snap_start: p.high_seqno,
        snap_end: p.high_seqno,
        disk: false,
    }
}

/// The vbuckets this node follows (those of `only`, if given, that are replicas here), and
/// where each stands, from the engine's own state.
fn own_state(engine: &Engine, bucket: &Bucket, only: Option<&[u16]>) -> (Vec<u16>, SessionState) {
    let mut vbs = Vec::new();
    let mut state = SessionState::default();
    for v in 0..bucket.num_vbuckets() {
        if only.is_some_and(|o| !o.contains(&v)) {
            continue;
        }
        let Some(p) = engine.stream_position(bucket, v) else {
            continue;
        };
        if !matches!(p.state, VbState::Replica | VbState::Pending) {
            continue;
        }
        vbs.push(v);
        state.vbuckets.insert(v, resume_point(&p));
    }
    (vbs, state)
}

fn follow(
    engine: Arc<Engine>,
    bucket: Arc<Bucket>,
    config: ReplicaConfig,
    stats: Arc<ReplicaStats>,
    stop: Arc<AtomicBool>,
    policies: Arc<PolicyHost>,
    kv_address: Option<String>,
) {
    let mut backoff = Duration::from_millis(50);
    let node = engine.instance().to_string();
    while !stop.load(Ordering::Acquire) {
        let (vbuckets, state) = own_state(&engine, &bucket, config.vbuckets.as_deref());
        {
            // The lag of every vbucket followed is reported from the start (the probe fills
            // in the active's side); vbuckets no longer followed leave the report.
            let mut lags = stats.vbuckets.lock();
            lags.retain(|vb, _| state.vbuckets.contains_key(vb));
            for (vb, p) in &state.vbuckets {
                lags.entry(*vb).or_insert_with(|| VbLag {
                    active_seqno: p.seqno,
                    applied_seqno: p.seqno,
                    ..VbLag::default()
                });
            }
        }
        if vbuckets.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let handed = Arc::new(AtomicUsize::new(0));
        let mut shared = None;
        let consumer_config = ConsumerConfig {
            address: config.active.clone(),
            bucket: bucket.name().to_string(),
            username: config.username.clone(),
            password: config.password.clone(),
            name: format!("replication:{node}:{}", bucket.name()),
            tls: config.tls.clone(),
            vbuckets: Some(vbuckets),
            state,
            rollback: RollbackMode::Ask,
            batch_size: 4096,
            buffer_size: 32 << 20,
            noop_interval: config.noop_interval,
            replica_name: Some(node.clone()),
            kv_address: kv_address.clone(),
            flow_control: Some(policies.clone()),
            end_refused_streams: true,
            ..ConsumerConfig::default()
        };
        let consumer = Consumer::start_inline(consumer_config, |link| {
            let session = Arc::new(Mutex::new(ReplicaSession {
                engine: engine.clone(),
                bucket: bucket.clone(),
                link,
                stats: stats.clone(),
                snapshots: BTreeMap::new(),
                due: BTreeSet::new(),
                by_map: config.vbuckets.is_some(),
                failed: None,
                last_lsn: 0,
                sync_asked: None,
                ended: false,
            }));
            shared = Some(session.clone());
            let handed = handed.clone();
            let mut marked = false;
            Some(Box::new(move |b| {
                if !marked {
                    // The WAL records of what this thread applies are written by it too
                    // (`take_inline`), not by a wake-up of the writer thread.
                    sluice_core::wal::writer::replies_wait_here();
                    marked = true;
                }
                take_inline(&session, &handed, b)
            }))
        });
        let session = shared.expect("start_inline makes the reader");
        stats.connects.fetch_add(1, Ordering::Relaxed);
        let why = run(&session, &handed, &consumer, &stop);
        stats.connected.store(false, Ordering::Release);
        drop(consumer);
        let Some(why) = why else {
            break;
        };
        if stop.load(Ordering::Acquire) {
            break;
        }
        log::warn!(
            "replication of bucket {:?} from {}: {why}; reconnecting in {backoff:?}",
            bucket.name(),
            config.active
        );
        *stats.last_error.lock() = Some(why.to_string());
        let until = Instant::now() + backoff;
        while Instant::now() < until && !stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(20));
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Batches of at most this many changes are applied on the stream connection's thread when
/// nothing handed to the replicator's thread is waiting. Synchronous writes come in batches of
/// one to a few hundred (16 connections x 32 pipelined majority SETs: 64 here gave 192-206k/s
/// and a p99 of 4.7-5.5 ms, 512 gave 204-238k/s and 4.5-5.2 ms in four alternating pairs).
/// Catch-up and bursts come in thousands and go to the replicator's thread, where applying
/// overlaps with reading the next.
const INLINE_MAX_CHANGES: usize = 512;

/// One connection's replication state, shared by the stream connection's thread (small
/// batches, applied as they come) and the replicator's thread (big batches, rollbacks, and
/// the acknowledgements of persistence as the disk catches up).
struct ReplicaSession {
    engine: Arc<Engine>,
    bucket: Arc<Bucket>,
    link: ConsumerLink,
    stats: Arc<ReplicaStats>,
    /// Per vbucket: the snapshot being received and the acknowledgements sent.
    snapshots: BTreeMap<u16, Snap>,
    /// Vbuckets whose acknowledgement may move: changes arrived, or some held are not on
    /// disk yet. Only these are looked at after each event.
    due: BTreeSet<u16>,
    /// The vbuckets followed are a cluster map's: a refused stream is asked for again (the
    /// map says the active has it), not given up as moved away.
    by_map: bool,
    /// Why a batch applied on the stream connection's thread failed: the replicator's thread
    /// ends the connection with it.
    failed: Option<ReplicationError>,
    /// The WAL record of the last change applied.
    last_lsn: u64,
    /// When this session last asked the WAL for a sync (see `acknowledge`).
    sync_asked: Option<Instant>,
    /// Set by the replicator's thread when it stops following this connection.
    ended: bool,
}

/// The stream connection's thread offers each batch here first. It is applied at once when
/// it is small, everything handed over before it is applied, and the replicator's thread is
/// not busy with the session; else it is handed over (counted in `handed` until applied).
/// Only while some vbucket's acknowledgement is due does the replicator's thread wait in
/// short polls (`run`): a batch that makes one due from none is handed over, which wakes it.
fn take_inline(
    session: &Mutex<ReplicaSession>,
    handed: &AtomicUsize,
    b: Box<Batch>,
) -> Option<Box<Batch>> {
    if b.len() <= INLINE_MAX_CHANGES && handed.load(Ordering::Acquire) == 0 {
        if let Some(mut s) = session.try_lock() {
            if s.ended || s.failed.is_some() {
                // Nothing more is applied on this connection: after a failed batch, another
                // would leave a gap. The next connection resumes from what is held.
                return None;
            }
            if !s.due.is_empty() {
                match s.follow_batch(&b) {
                    Ok(()) => {
                        s.acknowledge();
                        // After the acknowledgement, which majority writes wait for; the
                        // persistence acknowledgements follow the disk as before.
                        s.engine.wal().lead(s.last_lsn);
                    }
                    Err(e) => s.failed = Some(e),
                }
                return None;
            }
        }
    }
    handed.fetch_add(1, Ordering::AcqRel);
    Some(b)
}

/// The replicator's thread: follows until stopped (None) or the connection fails
/// (Some(reason)). On the way out it marks the session ended under its lock, so that nothing
/// is applied on the reader's thread afterwards either.
fn run(
    session: &Mutex<ReplicaSession>,
    handed: &AtomicUsize,
    consumer: &Consumer,
    stop: &AtomicBool,
) -> Option<ReplicationError> {
    while !stop.load(Ordering::Acquire) {
        let wait = {
            let mut s = session.lock();
            if let Some(e) = s.failed.take() {
                s.ended = true;
                return Some(e);
            }
            // Short waits while acknowledgements of persistence are still due.
            if s.due.is_empty() {
                Duration::from_millis(100)
            } else {
                Duration::from_millis(2)
            }
        };
        let event = consumer.next_event(wait);
        let mut s = session.lock();
        let why = match event {
            None => None,
            Some(Event::Batch(b)) => {
                let r = s.follow_batch(&b);
                handed.fetch_sub(1, Ordering::AcqRel);
                r.err()
            }
            Some(Event::VbucketState { opaque, .. }) => {
                // Only takeover streams hand vbuckets over; this connection asked for none.
                s.link
                    .respond(dcp::opcode::SET_VBUCKET_STATE, opaque, status::EINVAL);
                None
            }
            Some(Event::Rollback { vbucket, seqno, .. }) => {
                s.stats.connected.store(true, Ordering::Release);
                s.rollback(consumer, Some(handed), vbucket, seqno).err()
            }
            Some(Event::Finished) => Some(ReplicationError::EveryStreamEnded),
            Some(Event::Failed(e)) => Some(ReplicationError::Connection(e)),
        };
        if let Some(why) = why {
            s.ended = true;
            return Some(why);
        }
        s.acknowledge();
    }
    session.lock().ended = true;
    None
}

#[derive(Default)]
struct Snap {
    seqno: u64,
    start: u64,
    end: u64,
    acked: u64,
    acked_persisted: u64,
    /// (seqno, WAL LSN) marks of what was applied and is not yet synced, oldest first: the
    /// seqno is on disk once the WAL is synced through the LSN. At most `UNSYNCED_MARKS`; a
    /// newer mark replaces the newest when full, which only acknowledges later what it covers.
    unsynced: VecDeque<(u64, u64)>,
}

/// Marks kept per vbucket while its WAL records wait for a sync.
const UNSYNCED_MARKS: usize = 4;

/// How often a replica asks its WAL for a sync while it owes acknowledgements of persistence
/// (write mode; in fsync mode every batch is synced anyway).
const SYNC_EVERY: Duration = Duration::from_millis(10);

impl Snap {
    /// Notes that everything up to `seqno` is held in WAL records up to `lsn`.
    fn applied(&mut self, seqno: u64, lsn: u64) {
        if self.unsynced.len() >= UNSYNCED_MARKS {
            self.unsynced.pop_back();
        }
        self.unsynced.push_back((seqno, lsn));
    }

    /// The highest seqno whose records the WAL has synced (through `synced_lsn`), dropping
    /// the marks that covers.
    fn on_disk(&mut self, synced_lsn: u64) -> u64 {
        let mut on_disk = 0;
        while let Some(&(seqno, lsn)) = self.unsynced.front() {
            if lsn > synced_lsn {
                break;
            }
            on_disk = seqno;
            self.unsynced.pop_front();
        }
        on_disk
    }

    /// Everything up to here is held consistently: the end of the current snapshot when it
    /// is whole, else the end of the one before it.
    fn consistent(&self) -> u64 {
        if self.seqno >= self.end {
            self.end.max(self.seqno)
        } else {
            self.start.saturating_sub(1)
        }
    }
}

impl ReplicaSession {
    /// Applies a batch of the replication stream and follows the streams it ended or that
    /// were refused; Err when the connection must start over.
    fn follow_batch(&mut self, b: &Batch) -> Result<(), ReplicationError> {
        self.stats.connected.store(true, Ordering::Release);
        self.apply(b)?;
        for &vb in &b.refused {
            if self.by_map {
                return Err(ReplicationError::Refused(vb));
            }
            self.given_away(vb)?;
        }
        for &(vb, reason) in &b.ended {
            if reason != stream_end_reason::STATE_CHANGED {
                return Err(ReplicationError::StreamEnded {
                    vbucket: vb,
                    reason,
                });
            }
            // The active's vbucket went pending (a takeover under way: the new stream follows
            // it through) or dead (given away: the new request is refused, see `given_away`).
            log::info!(
                "replication of bucket {:?}: the active's vbucket {vb} changed state; \
                 asking for its stream again",
                self.bucket.name()
            );
            self.link.resume(vb);
        }
        Ok(())
    }

    fn apply(&mut self, b: &Batch) -> Result<(), ReplicationError> {
        let now = now_nanos();
        let mut i = 0;
        while i < b.len() {
            let vb = b.vbucket[i];
            let mut j = i;
            while j < b.len() && b.vbucket[j] == vb {
                j += 1;
            }
            let rows = (i..j).map(|r| {
                let key = &b.keys[b.key_offsets[r] as usize..b.key_offsets[r + 1] as usize];
                let value = &b.values[b.value_offsets[r] as usize..b.value_offsets[r + 1] as usize];
                let op = match b.op[r] {
                    0 => ChangeOp::Mutation,
                    1 => ChangeOp::Deletion,
                    _ => ChangeOp::Expiration,
                };
                let meta = ItemMeta {
                    cas: b.cas[r],
                    rev_seqno: b.rev_seqno[r],
                    by_seqno: b.seqno[r],
                    flags: b.flags[r],
                    expiry: b.expiry[r],
                    datatype: b.datatype[r],
                    deleted: false, // the engine sets it from the op
                };
                (op, key, value, meta)
            });
            self.last_lsn = self
                .engine
                .apply_replicated(&self.bucket, vb, rows)
                .map_err(|source| ReplicationError::Apply {
                    vbucket: vb,
                    source,
                })?;
            let newest_cas = b.cas[i..j].iter().copied().max().unwrap_or(0);
            let delay_ms = now.saturating_sub(newest_cas) as f64 / 1e6;
            self.stats.observe_delay(delay_ms);
            self.stats.vbuckets.lock().entry(vb).or_default().lag_ms = delay_ms;
            i = j;
        }
        self.stats
            .items
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        for (vb, pos) in &b.positions {
            let log: Vec<FailoverEntry> = pos
                .failover
                .iter()
                .map(|&(uuid, seqno)| FailoverEntry { uuid, seqno })
                .collect();
            if !log.is_empty() {
                self.engine
                    .adopt_failover_log(&self.bucket, *vb, &log)
                    .map_err(|source| ReplicationError::Vbucket {
                        vbucket: *vb,
                        source,
                    })?;
            }
            let s = self.snapshots.entry(*vb).or_default();
            self.due.insert(*vb);
            s.seqno = pos.seqno;
            s.start = pos.snap_start;
            s.end = pos.snap_end;
            // The batch's last record is at or past every record of this vbucket in it.
            s.applied(pos.seqno, self.last_lsn);
            let mut lags = self.stats.vbuckets.lock();
            let l = lags.entry(*vb).or_default();
            l.active_seqno = l.active_seqno.max(pos.snap_end);
            l.applied_seqno = pos.seqno;
        }
        Ok(())
    }

    /// The active refused the stream of `vb` (NOT_MY_VBUCKET): it gave the vbucket away or
    /// never had it. The copy here goes dead (kept on disk, as the active's is, and refused to
    /// readers and writers) and is no longer followed, here or after a restart.
    fn given_away(&mut self, vb: u16) -> Result<(), ReplicationError> {
        self.engine
            .set_vbucket_state(&self.bucket, vb, VbState::Dead)
            .map_err(|source| ReplicationError::Vbucket {
                vbucket: vb,
                source,
            })?;
        self.snapshots.remove(&vb);
        self.due.remove(&vb);
        self.stats.vbuckets.lock().remove(&vb);
        log::warn!(
            "replication of bucket {:?}: the active no longer serves vbucket {vb} \
             (moved away); it is dead here and no longer followed",
            self.bucket.name()
        );
        Ok(())
    }

    /// Rolls back `vb` and the others asked for with it: the answers to a session's stream
    /// requests come together, and the rollbacks share one snapshot. Batches of other
    /// vbuckets arriving meanwhile are applied.
    fn rollback(
        &mut self,
        consumer: &Consumer,
        handed: Option<&AtomicUsize>,
        vb: u16,
        seqno: u64,
    ) -> Result<(), ReplicationError> {
        let mut asked = vec![(vb, seqno)];
        let until = Instant::now() + Duration::from_millis(100);
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match consumer.next_event(left) {
                None => break,
                Some(Event::Rollback { vbucket, seqno, .. }) => asked.push((vbucket, seqno)),
                Some(Event::Batch(b)) => {
                    let r = self.follow_batch(&b);
                    if let Some(h) = handed {
                        h.fetch_sub(1, Ordering::AcqRel);
                    }
                    r?
                }
                Some(Event::VbucketState { opaque, .. }) => {
                    self.link
                        .respond(dcp::opcode::SET_VBUCKET_STATE, opaque, status::EINVAL);
                }
                Some(Event::Finished) => return Err(ReplicationError::EveryStreamEnded),
                Some(Event::Failed(e)) => return Err(ReplicationError::Connection(e)),
            }
        }
        let at = self
            .engine
            .rollback_vbuckets(&self.bucket, &asked)
            .map_err(|source| ReplicationError::Rollback {
                vbuckets: asked.clone(),
                source,
            })?;
        self.stats
            .rollbacks
            .fetch_add(asked.len() as u64, Ordering::Relaxed);
        for (&(vb, _), at) in asked.iter().zip(at) {
            let p = self
                .engine
                .stream_position(&self.bucket, vb)
                .ok_or(ReplicationError::Vanished(vb))?;
            let mut snap = Snap {
                seqno: at,
                start: at,
                end: at,
                ..Default::default()
            };
            // What it was rolled back to is on disk once the WAL is synced as it stands.
            snap.applied(at, self.engine.wal().last_lsn());
            self.snapshots.insert(vb, snap);
            self.due.insert(vb);
            self.link.resume_at(vb, resume_point(&p));
        }
        Ok(())
    }

    /// Tells the active how far each vbucket is held, and on disk, when that moved. On disk
    /// means synced (what `persist_to_majority` promises survives a power loss here too):
    /// while some of what is held is not, the WAL is asked for a sync through the newest
    /// record applied, one sync serving every vbucket and batch that asked meanwhile.
    fn acknowledge(&mut self) {
        if self.due.is_empty() {
            return;
        }
        let wal = self.engine.wal();
        let synced_lsn = wal.synced_lsn();
        let mut lags = self.stats.vbuckets.lock();
        let mut acks = Vec::new();
        let mut sync_through = 0;
        self.due.retain(|vb| {
            let Some(s) = self.snapshots.get_mut(vb) else {
                return false;
            };
            let held = s.consistent();
            let on_disk = held.min(s.acked_persisted.max(s.on_disk(synced_lsn)));
            if let Some(&(_, lsn)) = s.unsynced.back() {
                sync_through = sync_through.max(lsn);
            }
            if held > s.acked || on_disk > s.acked_persisted {
                s.acked = s.acked.max(held);
                s.acked_persisted = s.acked_persisted.max(on_disk);
                acks.push((*vb, s.acked, s.acked_persisted));
                let l = lags.entry(*vb).or_default();
                l.acked_seqno = s.acked;
                l.acked_persisted = s.acked_persisted;
            }
            // Kept while what it holds is not all on disk (nor acknowledged as such).
            s.acked_persisted < held
        });
        drop(lags);
        self.link.acknowledge(&acks);
        // At most one sync per SYNC_EVERY: a write-mode replica under a steady stream would
        // otherwise sync after every batch (500 times a second, a third of its WAL thread's
        // time, measured), for acknowledgements only persist_to_majority writes wait for.
        if sync_through > synced_lsn && self.sync_asked.is_none_or(|t| t.elapsed() >= SYNC_EVERY) {
            wal.ask_sync(sync_through);
            self.sync_asked = Some(Instant::now());
        }
    }
}

/// The replicators of a node that follows an active, one per bucket. A promotion stops them
/// for good.
pub struct Followers {
    engine: Arc<Engine>,
    replicators: Mutex<Vec<Replicator>>,
    /// The copy of the active's topics.
    topics: Mutex<Option<crate::topic_replica::TopicFollower>>,
    /// Names the active while this node follows it, and shows the promotion.
    clustermap: Arc<ClusterMap>,
    policies: Arc<PolicyHost>,
    /// (bucket, vbucket) a takeover onto this node streams: no replicator may follow them
    /// meanwhile, whatever the map or a concurrent takeover's restart asks.
    withheld: Mutex<BTreeSet<(String, u16)>>,
    /// Held while the replicators are changed as a whole (stopped, then started), so that two
    /// changes do not interleave: one would restart what the other just stopped.
    changing: Mutex<()>,
}

impl Followers {
    /// Starts following `active` for every bucket (None: this node is active; nothing runs).
    pub fn start(
        engine: Arc<Engine>,
        active: Option<&ReplicaConfig>,
        policies: &Arc<PolicyHost>,
        clustermap: Arc<ClusterMap>,
    ) -> Followers {
        clustermap.set_active(active.map(|rc| rc.active.as_str()));
        let replicators = match active {
            Some(rc) => engine
                .buckets()
                .into_iter()
                .map(|b| {
                    let address = Some(clustermap.kv_address());
                    Replicator::start(engine.clone(), b, rc.clone(), policies.clone(), address)
                })
                .collect(),
            None => Vec::new(),
        };
        // The topics here are copies from the start (none is produced to before the follower
        // reaches the active); their DCP logins select a bucket both nodes have, for the
        // stream permission.
        if active.is_some() {
            for t in engine.topics() {
                t.set_followed(true);
            }
        }
        let topics = active
            .zip(engine.buckets().first().cloned())
            .map(|(rc, b)| {
                crate::topic_replica::TopicFollower::start(
                    engine.clone(),
                    crate::topic_replica::Upstream {
                        active: rc.active.clone(),
                        bucket: b.name().to_string(),
                        username: rc.username.clone(),
                        password: rc.password.clone(),
                        tls: rc.tls.clone(),
                        noop_interval: rc.noop_interval,
                    },
                )
            });
        Followers {
            engine,
            replicators: Mutex::new(replicators),
            topics: Mutex::new(topics),
            clustermap,
            policies: policies.clone(),
            withheld: Mutex::new(BTreeSet::new()),
            changing: Mutex::new(()),
        }
    }

    /// `wanted` without the withheld vbuckets (a replicator left with none is not wanted).
    fn without_withheld(
        &self,
        wanted: &[(Arc<Bucket>, ReplicaConfig)],
    ) -> Vec<(Arc<Bucket>, ReplicaConfig)> {
        let withheld = self.withheld.lock();
        wanted
            .iter()
            .filter_map(|(b, c)| {
                let mut c = c.clone();
                if let Some(v) = &mut c.vbuckets {
                    v.retain(|vb| !withheld.contains(&(b.name().to_string(), *vb)));
                    if v.is_empty() {
                        return None;
                    }
                }
                Some((b.clone(), c))
            })
            .collect()
    }

    /// Held by a cluster map's convergence from its `stop_unwanted` to its `start_wanted`.
    pub fn changing(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.changing.lock()
    }

    /// A cluster map's replication: stops the replicators `wanted` has no place for (another
    /// active, other vbuckets), so that no stream applies to vbuckets whose state is about to
    /// change. `start_wanted` starts the rest once the states are set.
    pub fn stop_unwanted(&self, wanted: &[(Arc<Bucket>, ReplicaConfig)]) {
        let wanted = self.without_withheld(wanted);
        let stopped: Vec<Replicator> = {
            let mut running = self.replicators.lock();
            let (keep, stop) = std::mem::take(&mut *running)
                .into_iter()
                .partition(|r| wanted.iter().any(|(b, c)| r.runs(b, c)));
            *running = keep;
            stop
        };
        for mut r in stopped {
            r.stop();
        }
    }

    /// Starts the replicators of `wanted` not running yet.
    pub fn start_wanted(&self, wanted: Vec<(Arc<Bucket>, ReplicaConfig)>) {
        let wanted = self.without_withheld(&wanted);
        let mut running = self.replicators.lock();
        for (b, c) in wanted {
            if !running.iter().any(|r| r.runs(&b, &c)) {
                let address = Some(self.clustermap.kv_address());
                running.push(Replicator::start(
                    self.engine.clone(),
                    b,
                    c,
                    self.policies.clone(),
                    address,
                ));
            }
        }
    }

    /// Whether a replicator follows every replica vbucket (`replica_of`), not a map's share.
    pub fn follows_everything(&self) -> Option<String> {
        self.replicators
            .lock()
            .iter()
            .find(|r| r.config.vbuckets.is_none())
            .map(|r| r.config.active.clone())
    }

    /// Stops following vbucket `vb` of `bucket` until `restore` (a takeover onto this node is
    /// about to stream it); the replicator that followed it goes on with the others.
    pub fn release(&self, bucket: &str, vb: u16) {
        let _changing = self.changing.lock();
        self.withheld.lock().insert((bucket.to_string(), vb));
        let wanted: Vec<(Arc<Bucket>, ReplicaConfig)> = {
            let running = self.replicators.lock();
            running
                .iter()
                .filter_map(|r| Some((self.engine.bucket(&r.bucket).ok()?, r.config.clone())))
                .collect()
        };
        self.stop_unwanted(&wanted);
        self.start_wanted(wanted);
    }

    /// The takeover of `vb` is over: the map may have it followed again.
    pub fn restore(&self, bucket: &str, vb: u16) {
        self.withheld.lock().remove(&(bucket.to_string(), vb));
    }

    /// The replicators running now (none on an active node or after a promotion).
    pub fn running(&self) -> parking_lot::MutexGuard<'_, Vec<Replicator>> {
        self.replicators.lock()
    }

    /// Stops every replicator (the server is stopping, or the node is promoted).
    pub fn stop(&self) {
        for mut r in std::mem::take(&mut *self.replicators.lock()) {
            r.stop();
        }
        if let Some(mut t) = self.topics.lock().take() {
            t.stop();
        }
    }

    /// Failover: stops following the active, then makes every replica vbucket active (each
    /// with a new failover entry). Returns (bucket, vbuckets promoted) per bucket.
    pub fn promote(&self) -> sluice_core::Result<Vec<(String, Vec<u16>)>> {
        self.stop();
        for t in self.engine.topics() {
            t.set_followed(false);
        }
        let mut out = Vec::new();
        for b in self.engine.buckets() {
            let promoted = self.engine.promote(&b)?;
            if !promoted.is_empty() {
                log::warn!(
                    "promoted {} vbucket(s) of bucket {:?} to active",
                    promoted.len(),
                    b.name()
                );
            }
            out.push((b.name().to_string(), promoted));
        }
        self.clustermap.set_active(None);
        self.clustermap.refresh(&self.engine);
        Ok(out)
    }
}

/// What a vbucket move reports.
#[derive(Debug, Clone)]
pub struct TakeoverReport {
    pub vbucket: u16,
    pub items: u64,
    pub seconds: f64,
    /// From the source's SET_VBUCKET_STATE pending to this node's vbucket going active: the
    /// time writes to the vbucket were refused (temporary failure) on both nodes.
    pub writes_paused_ms: f64,
    pub high_seqno: u64,
}

/// Moves vbucket `vb` of `bucket` from the node at `source` to this one with a takeover
/// stream: this node's copy (dead, replica, or active and never written) catches up as a
/// replica, goes pending when the source does, and active when the source hands over; the
/// source then goes dead.
pub fn take_over(
    engine: &Arc<Engine>,
    bucket: &Arc<Bucket>,
    vb: u16,
    source: &ReplicaConfig,
    timeout: Duration,
    clustermap: &ClusterMap,
) -> Result<TakeoverReport, ReplicationError> {
    let pos = engine
        .stream_position(bucket, vb)
        .ok_or_else(|| ReplicationError::NoVbucket {
            vbucket: vb,
            bucket: bucket.name().to_string(),
        })?;
    if pos.state == VbState::Active && pos.high_seqno > 0 {
        return Err(ReplicationError::ActiveWithData {
            vbucket: vb,
            high_seqno: pos.high_seqno,
        });
    }
    clustermap.arriving(bucket.name(), vb);
    let result = match pos.state {
        VbState::Active | VbState::Dead => engine
            .set_vbucket_state(bucket, vb, VbState::Replica)
            .map_err(ReplicationError::from),
        VbState::Replica | VbState::Pending => Ok(()),
    }
    .and_then(|()| take_over_stream(engine, bucket, vb, source, timeout, clustermap));
    if result.is_err() {
        clustermap.not_arriving(bucket.name(), vb);
        clustermap.refresh(engine);
    }
    result
}

/// The takeover stream of `take_over`, once this node's copy is a replica.
fn take_over_stream(
    engine: &Arc<Engine>,
    bucket: &Arc<Bucket>,
    vb: u16,
    source: &ReplicaConfig,
    timeout: Duration,
    clustermap: &ClusterMap,
) -> Result<TakeoverReport, ReplicationError> {
    let (_, state) = own_state(engine, bucket, Some(&[vb]));
    let started = Instant::now();
    let consumer = Consumer::start(ConsumerConfig {
        address: source.active.clone(),
        bucket: bucket.name().to_string(),
        username: source.username.clone(),
        password: source.password.clone(),
        name: format!("takeover:{}:{}:{vb}", engine.instance(), bucket.name()),
        tls: source.tls.clone(),
        vbuckets: Some(vec![vb]),
        state,
        rollback: RollbackMode::Ask,
        batch_size: 4096,
        noop_interval: source.noop_interval,
        takeover: true,
        kv_address: Some(clustermap.kv_address()),
        ..ConsumerConfig::default()
    });
    let mut session = ReplicaSession {
        engine: engine.clone(),
        bucket: bucket.clone(),
        link: consumer.link().clone(),
        stats: Arc::new(ReplicaStats::default()),
        snapshots: BTreeMap::new(),
        due: BTreeSet::new(),
        by_map: false,
        failed: None,
        last_lsn: 0,
        sync_asked: None,
        ended: false,
    };

    let mut paused_at = None;
    let mut active_after = None;
    let deadline = started + timeout;
    while Instant::now() < deadline {
        match consumer.next_event(Duration::from_millis(100)) {
            None => {}
            Some(Event::Batch(b)) => {
                session.apply(&b)?;
                if let Some((_, reason)) = b.ended.first() {
                    if active_after.is_some() {
                        break;
                    }
                    return Err(ReplicationError::TakeoverEnded(*reason));
                }
            }
            Some(Event::Rollback { vbucket, seqno, .. }) => {
                session.rollback(&consumer, None, vbucket, seqno)?
            }
            Some(Event::VbucketState {
                state: st, opaque, ..
            }) => {
                let (to, answer) = match st {
                    vbucket_state::PENDING => (VbState::Pending, status::SUCCESS),
                    vbucket_state::ACTIVE => (VbState::Active, status::SUCCESS),
                    _ => (VbState::Replica, status::EINVAL),
                };
                if answer == status::SUCCESS {
                    engine.set_vbucket_state(bucket, vb, to)?;
                    if to == VbState::Pending {
                        paused_at = Some(Instant::now());
                    } else {
                        active_after = Some(
                            paused_at.map_or(0.0, |p: Instant| p.elapsed().as_secs_f64() * 1000.0),
                        );
                    }
                }
                consumer
                    .link()
                    .respond(dcp::opcode::SET_VBUCKET_STATE, opaque, answer);
            }
            Some(Event::Finished) => break,
            Some(Event::Failed(e)) if active_after.is_none() => {
                return Err(ReplicationError::Connection(e))
            }
            Some(Event::Failed(_)) => break,
        }
    }
    let Some(writes_paused_ms) = active_after else {
        return Err(ReplicationError::NotHandedOver {
            vbucket: vb,
            timeout,
        });
    };
    let high_seqno = engine
        .stream_position(bucket, vb)
        .map_or(0, |p| p.high_seqno);
    clustermap.arrived(bucket.name(), vb);
    clustermap.refresh(engine);
    log::info!(
        "vbucket {vb} of bucket {:?} taken over from {}: {} changes in {:.2} s, writes paused {writes_paused_ms:.1} ms",
        bucket.name(),
        source.active,
        session.stats.items.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
    Ok(TakeoverReport {
        vbucket: vb,
        items: session.stats.items.load(Ordering::Relaxed),
        seconds: started.elapsed().as_secs_f64(),
        writes_paused_ms,
        high_seqno,
    })
}

/// Replication as the replica sees it: lag per vbucket, its connection.
pub fn metrics(replicators: &[Replicator], o: &mut String) {
    use crate::replica::DELAY_BOUNDS_MS;
    let reps = replicators;
    metric(
        o,
        "sluice_replica_connected",
        "gauge",
        "1 while the replica's DCP connection to its active streams.",
    );
    for r in reps.iter() {
        let _ = writeln!(
            o,
            "sluice_replica_connected{{bucket=\"{}\",active=\"{}\"}} {}",
            r.bucket,
            r.config.active,
            r.stats.connected.load(Relaxed) as u8
        );
    }
    metric(
        o,
        "sluice_replica_connects_total",
        "counter",
        "Connections the replica opened to its active (reconnects after a failure count too).",
    );
    metric(
        o,
        "sluice_replica_items_total",
        "counter",
        "Changes the replica applied from its active.",
    );
    metric(
        o,
        "sluice_replica_rollbacks_total",
        "counter",
        "Rollbacks the active asked the replica for.",
    );
    for r in reps.iter() {
        let b = &r.bucket;
        let _ = writeln!(
            o,
            "sluice_replica_connects_total{{bucket=\"{b}\"}} {}",
            r.stats.connects.load(Relaxed)
        );
        let _ = writeln!(
            o,
            "sluice_replica_items_total{{bucket=\"{b}\"}} {}",
            r.stats.items.load(Relaxed)
        );
        let _ = writeln!(
            o,
            "sluice_replica_rollbacks_total{{bucket=\"{b}\"}} {}",
            r.stats.rollbacks.load(Relaxed)
        );
    }
    metric(
        o,
        "sluice_replica_lag_seqnos",
        "gauge",
        "Per replica vbucket followed: the active's high seqno (asked every second) minus the seqno applied here.",
    );
    metric(o, "sluice_replica_lag_ms", "gauge", "Per replica vbucket: milliseconds from the active's write to its apply here, for the newest change of the last batch.");
    for r in reps.iter() {
        for (vb, l) in r.stats.vbuckets.lock().iter() {
            let b = &r.bucket;
            let _ = writeln!(
                o,
                "sluice_replica_lag_seqnos{{bucket=\"{b}\",vbucket=\"{vb}\"}} {}",
                l.active_seqno.saturating_sub(l.applied_seqno)
            );
            let _ = writeln!(
                o,
                "sluice_replica_lag_ms{{bucket=\"{b}\",vbucket=\"{vb}\"}} {:.3}",
                l.lag_ms
            );
        }
    }
    metric(o, "sluice_replica_apply_delay_ms", "histogram", "Per batch applied: milliseconds from the active's write of its newest change to the apply here.");
    for r in reps.iter() {
        let b = &r.bucket;
        let mut cum = 0;
        for (i, bound) in DELAY_BOUNDS_MS.iter().enumerate() {
            cum += r.stats.delay_buckets[i].load(Relaxed);
            let _ = writeln!(
                o,
                "sluice_replica_apply_delay_ms_bucket{{bucket=\"{b}\",le=\"{bound}\"}} {cum}"
            );
        }
        cum += r.stats.delay_buckets[DELAY_BOUNDS_MS.len()].load(Relaxed);
        let _ = writeln!(
            o,
            "sluice_replica_apply_delay_ms_bucket{{bucket=\"{b}\",le=\"+Inf\"}} {cum}"
        );
        let _ = writeln!(
            o,
            "sluice_replica_apply_delay_ms_sum{{bucket=\"{b}\"}} {:.3}",
            r.stats.delay_sum_us.load(Relaxed) as f64 / 1000.0
        );
        let _ = writeln!(
            o,
            "sluice_replica_apply_delay_ms_count{{bucket=\"{b}\"}} {cum}"
        );
    }
}

/// Replication as the active sees it: how far each replica acknowledged.
pub fn follower_metrics(engine: &Engine, o: &mut String) {
    metric(o, "sluice_follower_ack_lag_seqnos", "gauge", "On the active, per vbucket and replica: high seqno minus the seqno the replica acknowledged (SEQNO_ACKNOWLEDGED).");
    for b in engine.buckets() {
        for v in 0..b.num_vbuckets() {
            let followers = b.acks.following(v);
            if followers.is_empty() {
                continue;
            }
            let high = b.lock_vbucket(v).map_or(0, |vb| vb.high_seqno);
            for f in followers {
                let _ = writeln!(o, "sluice_follower_ack_lag_seqnos{{bucket=\"{}\",vbucket=\"{v}\",replica=\"{}\"}} {}", b.name(), f.name, high.saturating_sub(f.seqno));
            }
        }
    }
}
