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

mod apply;
mod followers;
mod metrics;
mod takeover;

pub use followers::Followers;
pub use metrics::{follower_metrics, metrics};
pub use takeover::{take_over, TakeoverReport};

use apply::{run, take_inline, ReplicaSession};

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
    Batch, Consumer, ConsumerConfig, ConsumerLink, Event, Position, Probe, RollbackMode,
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

impl VbLag {
    /// Seqnos the copy is behind its active.
    pub fn behind(&self) -> u64 {
        self.active_seqno.saturating_sub(self.applied_seqno)
    }

    /// How far behind in time: the last batch's delay while seqnos are missing, none once the
    /// copy holds all the active has (a backfill of old writes leaves a large delay behind it
    /// that no longer says anything).
    pub fn behind_ms(&self) -> f64 {
        if self.behind() == 0 {
            0.0
        } else {
            self.lag_ms
        }
    }
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
        let probe = Probe::new(ConsumerConfig {
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
fn probe_active(mut probe: Probe, stats: &ReplicaStats, stop: &AtomicBool) {
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
            include_xattrs: true,
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
