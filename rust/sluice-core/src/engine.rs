//! The engine: buckets, the write and read paths, the WAL, and the background work (expiry
//! pager, tombstone purger, checkpoint quota, periodic snapshots).
//!
//! Lock order: a vbucket's lock, then the WAL queue lock. The WAL writer takes vbucket locks
//! only after releasing its queue lock, and the snapshot writer holds one vbucket lock at a time.

use std::collections::HashMap;
use std::fs::File;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::backfill::Backfill;
use crate::bucket::Bucket;
use crate::checkpoint::{
    CursorDropPolicy, CursorHandle, CursorId, CursorRead, DropSlowest, Registration,
    PERSISTENCE_CURSOR,
};
use crate::config::{BucketConfig, Durability, EngineConfig};
use crate::durability::{replicas_for_majority, Requirement, WaitError};
use crate::error::{Error, Result};
use crate::failover::FailoverEntry;
use crate::hlc::{now_nanos, now_secs};
use crate::item::{absolute_expiry, is_expired, validate_key, ChangeOp, Item, ItemMeta};
use crate::recovery;
use crate::snapshot;
use crate::vbucket::{VBucket, VbState};
use crate::wal::writer::{Failpoint, MetaRecord, WalConfig, WalPayload};
use crate::wal::{WalMode, WalWriter};

/// How long a writer past twice the checkpoint quota waits for the WAL to take its changes.
const WAL_CATCH_UP: Duration = Duration::from_secs(1);

/// How a store treats an existing key (memcached's SET, ADD, REPLACE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreMode {
    Set,
    Add,
    Replace,
}

#[derive(Debug, Clone)]
pub struct StoreRequest<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub flags: u32,
    /// memcached rules: 0 never, up to 30 days relative, else absolute Unix time.
    pub expiry: u32,
    pub datatype: u8,
    /// Non-zero: only if the current CAS matches.
    pub cas: u64,
    pub mode: StoreMode,
    /// None: the bucket's default level.
    pub durability: Option<Requirement>,
}

impl<'a> StoreRequest<'a> {
    pub fn set(key: &'a [u8], value: &'a [u8]) -> StoreRequest<'a> {
        StoreRequest {
            key,
            value,
            flags: 0,
            expiry: 0,
            datatype: 0,
            cas: 0,
            mode: StoreMode::Set,
            durability: None,
        }
    }
}

/// What a read-modify-write stores (see `Engine::update`); `expiry` is absolute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub value: Vec<u8>,
    pub flags: u32,
    pub expiry: u32,
    pub datatype: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MutationResult {
    pub cas: u64,
    pub vbucket: u16,
    pub seqno: u64,
    pub lsn: u64,
}

/// A write applied in memory and queued for the WAL, not yet acknowledged: its reply waits
/// until `Engine::settle` (blocking) or `Engine::settled` (async) says it meets its level. At
/// level `none` that is the WAL having written it (`lsn`); the other levels add a sync and
/// replicas' acknowledgements.
#[must_use = "a write is acknowledged only once it is settled"]
#[derive(Debug)]
pub struct Written<T> {
    pub value: T,
    requirement: Requirement,
    lsn: u64,
    /// The (vbucket, seqno) the replicas must acknowledge: the last write of each vbucket.
    first: (u16, u64),
    more: Vec<(u16, u64)>,
}

impl<T> Written<T> {
    fn new(value: T, requirement: Requirement, lsn: u64, writes: &[(u16, u64)]) -> Written<T> {
        Written {
            value,
            requirement,
            lsn,
            first: writes.first().copied().unwrap_or_default(),
            more: writes.get(1..).map(|m| m.to_vec()).unwrap_or_default(),
        }
    }

    /// The WAL record the reply must wait for.
    pub fn lsn(&self) -> u64 {
        self.lsn
    }

    /// Whether the write waits for more than the WAL writing it (a sync or replicas).
    pub fn needs_settling(&self) -> bool {
        self.requirement.level != Durability::None
    }

    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Written<U> {
        Written {
            value: f(self.value),
            requirement: self.requirement,
            lsn: self.lsn,
            first: self.first,
            more: self.more,
        }
    }

    fn writes(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        std::iter::once(self.first).chain(self.more.iter().copied())
    }
}

/// What a stream request is decided on: one vbucket's state, seqnos and failover log.
#[derive(Debug, Clone)]
pub struct StreamPosition {
    pub state: VbState,
    pub high_seqno: u64,
    pub purge_seqno: u64,
    /// Newest first.
    pub failover: Vec<FailoverEntry>,
}

/// The live buckets, shared with the WAL writer's callback.
#[derive(Default)]
pub struct Catalog {
    buckets: RwLock<Vec<Arc<Bucket>>>,
}

impl Catalog {
    pub fn all(&self) -> Vec<Arc<Bucket>> {
        self.buckets.read().clone()
    }

    pub fn by_id(&self, id: u16) -> Option<Arc<Bucket>> {
        self.buckets.read().iter().find(|b| b.id == id).cloned()
    }

    pub fn by_name(&self, name: &str) -> Option<Arc<Bucket>> {
        self.buckets
            .read()
            .iter()
            .find(|b| b.name() == name)
            .cloned()
    }

    /// The WAL writer reports synced seqnos: advance each vbucket's persistence cursor.
    fn persisted(&self, upto: &[(u16, u16, u64)]) {
        let buckets = self.buckets.read();
        for &(b, v, seqno) in upto {
            let Some(bucket) = buckets.iter().find(|x| x.id == b) else {
                continue;
            };
            let Some(mut vb) = bucket.lock_vbucket(v) else {
                continue;
            };
            vb.persisted_seqno = vb.persisted_seqno.max(seqno);
            if let Some(c) = vb.persistence_cursor {
                vb.checkpoints.advance(c, seqno);
            }
        }
    }
}

struct Background {
    stop: Mutex<bool>,
    wake: Condvar,
    /// Set by writers when checkpoint memory passes its quota.
    quota_pressure: AtomicBool,
}

struct Inner {
    config: EngineConfig,
    catalog: Arc<Catalog>,
    wal: WalWriter,
    instance: String,
    snap_dir: PathBuf,
    wal_dir: PathBuf,
    snapshot_lock: Mutex<()>,
    closed: AtomicBool,
    drop_policy: RwLock<Arc<dyn CursorDropPolicy>>,
    background: Background,
    recovery_report: Mutex<recovery::Report>,
    /// Held (flock) while open; released by close so the directory can be reopened at once.
    lock_file: Mutex<Option<File>>,
}

pub struct Engine {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn lock_data_dir(dir: &Path) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir.display(), e))?;
    let path = dir.join("LOCK");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(path.display(), e))?;
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on an fd we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(Error::Io(format!(
            "data directory {} is in use by another sluice process",
            dir.display()
        )));
    }
    Ok(f)
}

impl Engine {
    /// Opens (recovering if there is data) the data directory and starts the background work.
    pub fn open(config: EngineConfig) -> Result<Engine> {
        config.validate()?;
        let lock_file = lock_data_dir(&config.data_dir)?;
        let wal_dir = config.data_dir.join("wal");
        let snap_dir = config.data_dir.join("snap");
        for d in [&wal_dir, &snap_dir] {
            std::fs::create_dir_all(d).map_err(|e| Error::io(d.display(), e))?;
        }
        let started = Instant::now();
        let recovered = recovery::recover(&wal_dir, &snap_dir, config.force_recovery)?;
        let catalog = Arc::new(Catalog::default());
        let weak: Weak<Catalog> = Arc::downgrade(&catalog);
        let wal = WalWriter::start(
            WalConfig {
                dir: wal_dir.clone(),
                mode: config.wal_mode,
                instance: recovered.instance.clone(),
                segment_size: config.wal_segment_size,
                block_size: 256 << 10,
            },
            recovered.last_lsn + 1,
            Box::new(move |upto| {
                if let Some(c) = weak.upgrade() {
                    c.persisted(upto)
                }
            }),
        )?;
        let mut report = recovered.report.clone();
        let forced_past_damage =
            !report.skipped_damage.is_empty() || !report.moved_aside.is_empty();
        let inner = Arc::new(Inner {
            catalog,
            wal,
            instance: recovered.instance.clone(),
            snap_dir,
            wal_dir,
            snapshot_lock: Mutex::new(()),
            closed: AtomicBool::new(false),
            drop_policy: RwLock::new(Arc::new(DropSlowest)),
            background: Background {
                stop: Mutex::new(false),
                wake: Condvar::new(),
                quota_pressure: AtomicBool::new(false),
            },
            recovery_report: Mutex::new(recovery::Report::default()),
            lock_file: Mutex::new(Some(lock_file)),
            config,
        });
        Engine::install_buckets(&inner, recovered)?;
        if forced_past_damage {
            // A snapshot now makes what was recovered the new starting point: later starts need
            // neither the damaged files nor --force-recovery.
            let path = inner.write_snapshot()?;
            log::warn!(
                "recovered past damage; wrote snapshot {} as the new starting point",
                path.display()
            );
        }
        report.duration = started.elapsed();
        *inner.recovery_report.lock() = report;
        let engine = Engine {
            inner,
            threads: Mutex::new(Vec::new()),
        };
        engine.start_background()?;
        Ok(engine)
    }

    /// Turns recovered state into live buckets, creates configured buckets that are new, and
    /// records a failover entry for every active vbucket after an unclean shutdown.
    fn install_buckets(inner: &Arc<Inner>, recovered: recovery::Recovered) -> Result<()> {
        let ckpt = inner.config.checkpoint;
        let mut by_name: HashMap<String, (u16, Vec<VBucket>)> = HashMap::new();
        for rb in recovered.buckets {
            by_name.insert(rb.name, (rb.id, rb.vbuckets));
        }
        let mut used: std::collections::HashSet<u16> = by_name.values().map(|b| b.0).collect();
        let mut live = Vec::new();
        let mut configs: Vec<BucketConfig> = inner.config.buckets.clone();
        // Buckets with data but no longer configured stay served with default settings.
        for (name, (_, vbs)) in by_name.iter() {
            if !configs.iter().any(|c| &c.name == name) {
                log::warn!("bucket {name:?} has data but is not in the configuration; serving it with default settings");
                let mut cfg = BucketConfig::named(name);
                cfg.num_vbuckets = vbs.len() as u16;
                configs.push(cfg);
            }
        }
        for cfg in configs {
            let (id, mut vbs, fresh) = match by_name.remove(&cfg.name) {
                Some((id, vbs)) => (id, vbs, false),
                None => {
                    let id = (0..=u16::MAX).find(|i| !used.contains(i)).ok_or_else(|| {
                        Error::InvalidConfig {
                            key: "buckets".into(),
                            reason: "no bucket id left".into(),
                        }
                    })?;
                    used.insert(id);
                    let vbs = (0..cfg.num_vbuckets)
                        .map(|v| VBucket::new(id, v, VbState::Dead, ckpt))
                        .collect();
                    (id, vbs, true)
                }
            };
            if vbs.len() != cfg.num_vbuckets as usize {
                return Err(Error::InvalidConfig {
                    key: format!("buckets.{}.num_vbuckets", cfg.name),
                    reason: format!(
                        "the data directory holds this bucket with {} vbuckets; it cannot change",
                        vbs.len()
                    ),
                });
            }
            {
                let mut a = inner.wal.appender()?;
                if fresh {
                    a.push(WalPayload::meta(
                        id,
                        0,
                        MetaRecord::Bucket {
                            name: cfg.name.clone(),
                            num_vbuckets: cfg.num_vbuckets,
                        },
                    ));
                }
                let role = if inner.config.replica {
                    VbState::Replica
                } else {
                    VbState::Active
                };
                for vb in vbs.iter_mut() {
                    vb.finish_recovery(ckpt);
                    if fresh || (inner.config.replica && vb.state == VbState::Active) {
                        // A node that follows another holds replicas; an old active rejoining
                        // keeps its history so that its new active can roll it back exactly.
                        vb.state = role;
                        vb.last_lsn = a.push(WalPayload::meta(
                            id,
                            vb.id,
                            MetaRecord::VbucketState {
                                state: role,
                                high_seqno: vb.high_seqno,
                            },
                        ));
                    }
                    if vb.state == VbState::Active && (fresh || recovered.unclean) {
                        let e = vb.failover.create_entry(vb.high_seqno);
                        vb.last_lsn =
                            a.push(WalPayload::meta(id, vb.id, MetaRecord::FailoverEntry(e)));
                    }
                    if inner.wal.mode() != WalMode::None {
                        let (reg, _) = vb
                            .checkpoints
                            .register_cursor(PERSISTENCE_CURSOR, vb.high_seqno);
                        vb.persistence_cursor = Some(reg.id);
                    }
                }
            }
            live.push(Arc::new(Bucket::new(id, cfg, vbs)));
        }
        *inner.catalog.buckets.write() = live;
        Ok(())
    }

    fn start_background(&self) -> Result<()> {
        let mut threads = self.threads.lock();
        let inner = self.inner.clone();
        threads.push(
            std::thread::Builder::new()
                .name("sluice-pager".into())
                .spawn(move || maintenance_loop(inner))
                .map_err(|e| Error::io("spawning the pager", e))?,
        );
        if !self.inner.config.snapshot_interval.is_zero() {
            let inner = self.inner.clone();
            threads.push(
                std::thread::Builder::new()
                    .name("sluice-snapshot".into())
                    .spawn(move || snapshot_loop(inner))
                    .map_err(|e| Error::io("spawning the snapshotter", e))?,
            );
        }
        Ok(())
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    pub fn instance(&self) -> &str {
        &self.inner.instance
    }

    pub fn recovery_report(&self) -> recovery::Report {
        self.inner.recovery_report.lock().clone()
    }

    pub fn bucket(&self, name: &str) -> Result<Arc<Bucket>> {
        self.inner
            .catalog
            .by_name(name)
            .ok_or_else(|| Error::NoSuchBucket(name.to_string()))
    }

    pub fn buckets(&self) -> Vec<Arc<Bucket>> {
        self.inner.catalog.all()
    }

    pub fn wal(&self) -> &WalWriter {
        &self.inner.wal
    }

    fn check_open(&self) -> Result<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Refuses a write early: closed engine, failing WAL, memory over the high watermark (unless
    /// the write is a deletion, which frees memory: a full bucket can always be emptied), or a
    /// durability level this node cannot provide.
    fn admit_write(&self, bucket: &Bucket, durability: Durability, op: ChangeOp) -> Result<()> {
        self.check_open()?;
        // The atomic flag first (no lock on the hot path), then the reason with it.
        if let Some(why) = self
            .inner
            .wal
            .is_failing()
            .then(|| self.inner.wal.failure())
            .flatten()
        {
            bucket.stats.tmp_failures.fetch_add(1, Ordering::Relaxed);
            return Err(Error::TempFail(format!(
                "the WAL cannot write ({why}); retry later"
            )));
        }
        if self.inner.wal.is_backlogged() {
            bucket.stats.tmp_failures.fetch_add(1, Ordering::Relaxed);
            return Err(Error::TempFail(format!(
                "the WAL is {} bytes behind (limit {}); retry later",
                self.inner.wal.queued_bytes(),
                crate::wal::writer::QUEUE_LIMIT_BYTES
            )));
        }
        if op == ChangeOp::Mutation && bucket.above_high_watermark() {
            bucket.stats.tmp_failures.fetch_add(1, Ordering::Relaxed);
            return Err(Error::TempFail(format!(
                "bucket {:?} memory {} bytes is above its high watermark {}",
                bucket.name(),
                bucket.mem_used(),
                bucket.config.high_watermark_bytes()
            )));
        }
        if durability.persist_active() && self.inner.wal.mode() == WalMode::None {
            return Err(Error::DurabilityImpossible(format!(
                "level {} persists on the active and wal.mode is none",
                durability.as_str()
            )));
        }
        Ok(())
    }

    /// Refuses a write at once when too few replicas follow its vbucket for the level.
    fn check_replicas(&self, bucket: &Bucket, vbid: u16, durability: Durability) -> Result<()> {
        if !durability.needs_replicas() {
            return Ok(());
        }
        let needed = replicas_for_majority(bucket.config.replicas);
        bucket.acks.check(vbid, needed).map_err(|e| match e {
            WaitError::TooFewReplicas { following, needed } => {
                Error::DurabilityImpossible(format!(
                "level {} needs {needed} replica(s) of vbucket {vbid} and {following} follow it",
                durability.as_str()
            ))
            }
            WaitError::TimedOut => unreachable!("check does not wait"),
        })
    }

    /// After a write whose last WAL record is `lsn`.
    fn note_checkpoint_pressure(&self, bucket: &Bucket, lsn: u64) {
        if !bucket.over_checkpoint_quota() {
            return;
        }
        if !self
            .inner
            .background
            .quota_pressure
            .swap(true, Ordering::AcqRel)
        {
            self.inner.background.wake.notify_all();
        }
        // Writers outrunning the maintenance thread (a busy machine) enforce the quota
        // themselves past twice it, so the overshoot stays bounded whatever the scheduling.
        let hard = 2 * bucket.config.checkpoint_quota_bytes();
        if bucket.checkpoint_mem() > hard {
            enforce_checkpoint_quota(&self.inner);
        }
        // What is left over it is pinned by the persistence cursor: the WAL writer is behind
        // (starved of CPU or a slow disk). The writer waits for it, as memcached's writers get
        // a temporary failure past the quota; the wait is bounded so a stuck disk, which the
        // WAL reports by itself, does not hang writers here.
        if bucket.checkpoint_mem() > hard
            && self.inner.wal.wait_written(lsn, Some(WAL_CATCH_UP)).is_ok()
        {
            release_checkpoints(bucket);
        }
    }

    fn written(
        &self,
        bucket: &Bucket,
        durability: Requirement,
        r: MutationResult,
    ) -> Written<MutationResult> {
        self.note_checkpoint_pressure(bucket, r.lsn);
        Written::new(r, durability, r.lsn, &[(r.vbucket, r.seqno)])
    }

    /// Blocks until a write meets its level: written to the WAL (every level, so that nothing
    /// acknowledged is lost to a process crash), synced for the `persist` levels, acknowledged
    /// by replicas for the majority levels; SyncWriteAmbiguous when its time runs out.
    pub fn settle<T>(&self, bucket: &Bucket, w: Written<T>) -> Result<T> {
        let level = w.requirement.level;
        let started = Instant::now();
        let timeout = self.settle_timeout(bucket, &w);
        if !level.persist_active() {
            self.inner.wal.wait_written(w.lsn, None)?;
        }
        if level == Durability::None {
            return Ok(w.value);
        }
        if level.persist_active() {
            self.inner
                .wal
                .wait_durable(w.lsn, Some(timeout))
                .map_err(|e| match e {
                    Error::TempFail(_) => {
                        Error::SyncWriteAmbiguous(format!("not on disk within {timeout:?}"))
                    }
                    other => other,
                })?;
        }
        if !level.needs_replicas() {
            return Ok(w.value);
        }
        let needed = replicas_for_majority(bucket.config.replicas);
        let on_disk = level == Durability::PersistToMajority;
        for (vb, seqno) in w.writes() {
            let left = timeout.saturating_sub(started.elapsed());
            bucket
                .acks
                .wait(vb, seqno, on_disk, needed, left)
                .map_err(|e| {
                    let why = match e {
                        WaitError::TimedOut => format!("not acknowledged in {timeout:?}"),
                        WaitError::TooFewReplicas { following, needed } => {
                            format!("{following} replica(s) follow and {needed} are needed")
                        }
                    };
                    Error::SyncWriteAmbiguous(format!(
                        "vbucket {vb} seqno {seqno} at level {}: {why}",
                        level.as_str()
                    ))
                })?;
        }
        Ok(w.value)
    }

    /// How long a write may wait to meet its level: its request's timeout or the bucket's.
    pub fn settle_timeout<T>(&self, bucket: &Bucket, w: &Written<T>) -> Duration {
        w.requirement
            .timeout
            .unwrap_or(bucket.config.durability_timeout)
    }

    /// `settle` for async callers: completes when the write meets its level, or when `timer`
    /// (a sleep of `settle_timeout`, from the caller's runtime) completes first, which makes
    /// the outcome SyncWriteAmbiguous. Waits on no thread: a connection keeps serving the
    /// requests behind it meanwhile.
    pub async fn settled<T>(
        &self,
        bucket: &Bucket,
        w: Written<T>,
        timer: impl Future<Output = ()>,
    ) -> Result<T> {
        let level = w.requirement.level;
        let timeout = self.settle_timeout(bucket, &w);
        let wait = async {
            if level.persist_active() {
                self.inner.wal.synced(w.lsn).await?;
            } else {
                self.inner.wal.written(w.lsn).await?;
            }
            if !level.needs_replicas() {
                return Ok(());
            }
            let needed = replicas_for_majority(bucket.config.replicas);
            let on_disk = level == Durability::PersistToMajority;
            for (vb, seqno) in w.writes() {
                bucket
                    .acks
                    .acked(vb, seqno, on_disk, needed)
                    .await
                    .map_err(|e| {
                        Error::SyncWriteAmbiguous(format!(
                            "vbucket {vb} seqno {seqno} at level {}: {e:?}",
                            level.as_str()
                        ))
                    })?;
            }
            Ok(())
        };
        {
            let mut wait = std::pin::pin!(wait);
            let mut timer = std::pin::pin!(timer);
            std::future::poll_fn(|cx| {
                if let std::task::Poll::Ready(r) = wait.as_mut().poll(cx) {
                    return std::task::Poll::Ready(r);
                }
                timer.as_mut().poll(cx).map(|()| {
                    Err(Error::SyncWriteAmbiguous(format!(
                        "not durable at level {} within {timeout:?}",
                        level.as_str()
                    )))
                })
            })
            .await?;
        }
        Ok(w.value)
    }

    /// SET / ADD / REPLACE, with CAS and a durability level; returns once settled.
    pub fn store(&self, bucket: &Bucket, req: &StoreRequest<'_>) -> Result<MutationResult> {
        self.write_store(bucket, req)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `store` applied and queued, to be settled by the caller.
    pub fn write_store(
        &self,
        bucket: &Bucket,
        req: &StoreRequest<'_>,
    ) -> Result<Written<MutationResult>> {
        validate_key(req.key)?;
        if req.value.len() > bucket.config.max_item_size {
            return Err(Error::TooBig {
                size: req.value.len(),
                max: bucket.config.max_item_size,
            });
        }
        let durability = req
            .durability
            .unwrap_or_else(|| bucket.config.durability.into());
        self.admit_write(bucket, durability.level, ChangeOp::Mutation)?;
        let vbid = bucket.vbucket_of(req.key);
        self.check_replicas(bucket, vbid, durability.level)?;
        let mut vb = bucket.lock_vbucket(vbid).expect("vbucket_of is in range");
        check_writable(&vb, 1)?;
        let now = now_secs();
        let existing = vb.store.get(req.key).map(|i| i.meta());
        let live = existing.filter(|m| !m.deleted && !is_expired(m, now));
        match (req.mode, live) {
            (StoreMode::Add, Some(_)) => return Err(Error::Exists),
            (StoreMode::Replace, None) => return Err(Error::NotFound),
            _ => {}
        }
        if req.cas != 0 {
            match live {
                None => return Err(Error::NotFound),
                Some(m) if m.cas != req.cas => return Err(Error::Exists),
                _ => {}
            }
        }
        let meta = ItemMeta {
            flags: req.flags,
            expiry: absolute_expiry(req.expiry, now),
            datatype: req.datatype,
            rev_seqno: existing.map(|m| m.rev_seqno + 1).unwrap_or(1),
            ..Default::default()
        };
        let r = self.inner.apply_locked(
            bucket,
            &mut vb,
            ChangeOp::Mutation,
            req.key,
            req.value,
            meta,
        )?;
        drop(vb);
        bucket.stats.sets.fetch_add(1, Ordering::Relaxed);
        Ok(self.written(bucket, durability, r))
    }

    /// Many SETs in one call: grouped by vbucket, one lock and one WAL queue lock per group.
    /// Returns the last LSN written; with `persist`, returns once all of them are durable.
    pub fn set_many(
        &self,
        bucket: &Bucket,
        items: &[(&[u8], &[u8])],
        flags: u32,
        expiry: u32,
        durability: Option<Requirement>,
    ) -> Result<u64> {
        let durability = durability.unwrap_or_else(|| bucket.config.durability.into());
        for (k, v) in items {
            validate_key(k)?;
            if v.len() > bucket.config.max_item_size {
                return Err(Error::TooBig {
                    size: v.len(),
                    max: bucket.config.max_item_size,
                });
            }
        }
        self.admit_write(bucket, durability.level, ChangeOp::Mutation)?;
        // Counting sort of item indices by vbucket: one pass, two allocations per call.
        let n = bucket.num_vbuckets() as usize;
        let vbs: Vec<u16> = items.iter().map(|(k, _)| bucket.vbucket_of(k)).collect();
        let mut starts = vec![0u32; n + 1];
        for &v in &vbs {
            starts[v as usize + 1] += 1;
        }
        for i in 0..n {
            starts[i + 1] += starts[i];
        }
        let mut order = vec![0u32; items.len()];
        let mut fill = starts.clone();
        for (i, &v) in vbs.iter().enumerate() {
            order[fill[v as usize] as usize] = i as u32;
            fill[v as usize] += 1;
        }
        // All or nothing: the vbuckets touched are locked together (in ascending order, so two
        // batches cannot deadlock) and all must accept the writes before any is applied.
        let mut locked = Vec::new();
        for vbid in 0..n {
            let count = starts[vbid + 1] - starts[vbid];
            if count > 0 {
                self.check_replicas(bucket, vbid as u16, durability.level)?;
                let vb = bucket.lock_vbucket(vbid as u16).expect("in range");
                check_writable(&vb, count as u64)?;
                locked.push((vbid, vb));
            }
        }
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let now = now_secs();
        let now_ns = now_nanos();
        let mut last_lsn = 0;
        let mut written = Vec::with_capacity(locked.len());
        let mut changes = Vec::new();
        for (vbid, vb) in locked.iter_mut() {
            changes.clear();
            for &i in &order[starts[*vbid] as usize..starts[*vbid + 1] as usize] {
                let (k, v) = items[i as usize];
                // rev_seqno 0: the store assigns the key's next revision during the same lookup.
                let meta = ItemMeta {
                    flags,
                    expiry: absolute_expiry(expiry, now),
                    ..Default::default()
                };
                changes.push(vb.apply_local(ChangeOp::Mutation, k, v, meta, now_ns));
            }
            {
                let mut a = self.inner.wal.appender()?;
                for c in changes.drain(..) {
                    last_lsn = a.push(WalPayload::Change(c));
                }
            }
            vb.last_lsn = last_lsn;
            written.push((*vbid as u16, vb.high_seqno));
            bucket.account(vb);
        }
        drop(locked);
        bucket.changes.notify();
        bucket
            .stats
            .sets
            .fetch_add(items.len() as u64, Ordering::Relaxed);
        self.note_checkpoint_pressure(bucket, last_lsn);
        self.settle(
            bucket,
            Written::new(last_lsn, durability, last_lsn, &written),
        )
    }

    pub fn delete(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<MutationResult> {
        self.write_delete(bucket, key, cas, durability)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `delete` applied and queued, to be settled by the caller.
    pub fn write_delete(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<Written<MutationResult>> {
        validate_key(key)?;
        let durability = durability.unwrap_or_else(|| bucket.config.durability.into());
        self.admit_write(bucket, durability.level, ChangeOp::Deletion)?;
        let vbid = bucket.vbucket_of(key);
        self.check_replicas(bucket, vbid, durability.level)?;
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        check_writable(&vb, 1)?;
        let now = now_secs();
        let existing = vb.store.get(key).map(|i| i.meta());
        let Some(old) = existing.filter(|m| !m.deleted && !is_expired(m, now)) else {
            return Err(Error::NotFound);
        };
        if cas != 0 && old.cas != cas {
            return Err(Error::Exists);
        }
        let meta = ItemMeta {
            expiry: now,
            rev_seqno: old.rev_seqno + 1,
            deleted: true,
            ..Default::default()
        };
        let r = self
            .inner
            .apply_locked(bucket, &mut vb, ChangeOp::Deletion, key, b"", meta)?;
        drop(vb);
        bucket.stats.deletes.fetch_add(1, Ordering::Relaxed);
        Ok(self.written(bucket, durability, r))
    }

    /// A read-modify-write of one live key under its vbucket's lock: `f` sees the current item
    /// (None when missing, deleted or expired) and returns the new value, flags and absolute
    /// expiry, or an error that leaves the item alone. `cas` non-zero must match. This is the
    /// one path for APPEND, PREPEND, INCR, DECR and TOUCH. Applied and queued, to be settled by
    /// the caller.
    pub fn write_update(
        &self,
        bucket: &Bucket,
        key: &[u8],
        cas: u64,
        durability: Option<Requirement>,
        f: impl FnOnce(Option<&Item>) -> Result<Update>,
    ) -> Result<Written<(MutationResult, Item)>> {
        validate_key(key)?;
        let durability = durability.unwrap_or_else(|| bucket.config.durability.into());
        self.admit_write(bucket, durability.level, ChangeOp::Mutation)?;
        let vbid = bucket.vbucket_of(key);
        self.check_replicas(bucket, vbid, durability.level)?;
        let mut vb = bucket.lock_vbucket(vbid).expect("vbucket_of is in range");
        check_writable(&vb, 1)?;
        let now = now_secs();
        let existing = vb.store.get(key).map(|i| i.to_item());
        let rev = existing.as_ref().map(|i| i.meta.rev_seqno + 1).unwrap_or(1);
        let live = existing.filter(|i| !i.meta.deleted && !is_expired(&i.meta, now));
        if cas != 0 {
            match &live {
                None => return Err(Error::NotFound),
                Some(i) if i.meta.cas != cas => return Err(Error::Exists),
                _ => {}
            }
        }
        let u = f(live.as_ref())?;
        if u.value.len() > bucket.config.max_item_size {
            return Err(Error::TooBig {
                size: u.value.len(),
                max: bucket.config.max_item_size,
            });
        }
        let meta = ItemMeta {
            flags: u.flags,
            expiry: u.expiry,
            datatype: u.datatype,
            rev_seqno: rev,
            ..Default::default()
        };
        let r =
            self.inner
                .apply_locked(bucket, &mut vb, ChangeOp::Mutation, key, &u.value, meta)?;
        let item = vb.store.get(key).expect("just stored").to_item();
        drop(vb);
        bucket.stats.sets.fetch_add(1, Ordering::Relaxed);
        Ok(self.written(bucket, durability, r).map(|r| (r, item)))
    }

    /// APPEND (`at_end`) or PREPEND: the key must exist (memcached's NOT_STORED otherwise).
    pub fn concat(
        &self,
        bucket: &Bucket,
        key: &[u8],
        data: &[u8],
        at_end: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<MutationResult> {
        self.write_concat(bucket, key, data, at_end, cas, durability)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `concat` applied and queued, to be settled by the caller.
    pub fn write_concat(
        &self,
        bucket: &Bucket,
        key: &[u8],
        data: &[u8],
        at_end: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<Written<MutationResult>> {
        self.write_update(bucket, key, cas, durability, |cur| {
            let cur = cur.ok_or(Error::NotStored)?;
            let mut value = Vec::with_capacity(cur.value().len() + data.len());
            if at_end {
                value.extend_from_slice(cur.value());
                value.extend_from_slice(data);
            } else {
                value.extend_from_slice(data);
                value.extend_from_slice(cur.value());
            }
            Ok(Update {
                value,
                flags: cur.meta.flags,
                expiry: cur.meta.expiry,
                // A local change: whatever TAP hops the old value arrived with do not carry over.
                datatype: cur.meta.datatype & crate::item::DATATYPE_CLIENT_BITS,
            })
        })
        .map(|w| w.map(|(r, _)| r))
    }

    /// INCR / DECR with memcached's rules: a missing key is created with `initial` unless
    /// `expiry` is 0xffffffff; the value must be a decimal u64; INCR wraps at 2^64, DECR stops
    /// at 0. Returns the new value.
    #[allow(clippy::too_many_arguments)]
    pub fn arithmetic(
        &self,
        bucket: &Bucket,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        increment: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<(MutationResult, u64)> {
        self.write_arithmetic(
            bucket, key, delta, initial, expiry, increment, cas, durability,
        )
        .and_then(|w| self.settle(bucket, w))
    }

    /// `arithmetic` applied and queued, to be settled by the caller.
    #[allow(clippy::too_many_arguments)]
    pub fn write_arithmetic(
        &self,
        bucket: &Bucket,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        increment: bool,
        cas: u64,
        durability: Option<Requirement>,
    ) -> Result<Written<(MutationResult, u64)>> {
        let now = now_secs();
        let w = self.write_update(bucket, key, cas, durability, |cur| {
            let (n, flags, exp) = match cur {
                None if expiry == u32::MAX => return Err(Error::NotFound),
                None => (initial, 0, absolute_expiry(expiry, now)),
                Some(i) => {
                    let text = std::str::from_utf8(i.value()).map_err(|_| Error::NotNumeric)?;
                    let n: u64 = text.trim().parse().map_err(|_| Error::NotNumeric)?;
                    let n = if increment {
                        n.wrapping_add(delta)
                    } else {
                        n.saturating_sub(delta)
                    };
                    (n, i.meta.flags, i.meta.expiry)
                }
            };
            Ok(Update {
                value: n.to_string().into_bytes(),
                flags,
                expiry: exp,
                datatype: 0,
            })
        })?;
        Ok(w.map(|(r, item)| {
            let n = std::str::from_utf8(item.value())
                .ok()
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            (r, n)
        }))
    }

    /// TOUCH: a new expiry for a live key (a mutation with its own seqno, as Couchbase does).
    /// Returns the item as touched, for GAT.
    pub fn touch(
        &self,
        bucket: &Bucket,
        key: &[u8],
        expiry: u32,
        durability: Option<Requirement>,
    ) -> Result<(MutationResult, Item)> {
        self.write_touch(bucket, key, expiry, durability)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `touch` applied and queued, to be settled by the caller.
    pub fn write_touch(
        &self,
        bucket: &Bucket,
        key: &[u8],
        expiry: u32,
        durability: Option<Requirement>,
    ) -> Result<Written<(MutationResult, Item)>> {
        let now = now_secs();
        self.write_update(bucket, key, 0, durability, |cur| {
            let cur = cur.ok_or(Error::NotFound)?;
            Ok(Update {
                value: cur.value().to_vec(),
                flags: cur.meta.flags,
                expiry: absolute_expiry(expiry, now),
                datatype: cur.meta.datatype,
            })
        })
    }

    /// FLUSH: deletes every live item of the bucket (each a DELETION with its own seqno, so
    /// streams and replicas see it). Returns how many.
    pub fn flush(&self, bucket: &Bucket) -> Result<usize> {
        self.write_flush(bucket)
            .and_then(|w| self.settle(bucket, w))
    }

    /// `flush` applied and queued, to be settled by the caller (at level `none`: written).
    pub fn write_flush(&self, bucket: &Bucket) -> Result<Written<usize>> {
        self.check_open()?;
        let now = now_secs();
        let mut n = 0;
        let mut lsn = 0;
        for v in 0..bucket.num_vbuckets() {
            let mut vb = bucket.lock_vbucket(v).expect("in range");
            if vb.state != VbState::Active {
                continue;
            }
            for key in vb.store.keys_where(|m| !m.deleted) {
                let old = vb.store.get(&key).expect("listed above").meta();
                let meta = ItemMeta {
                    expiry: now,
                    rev_seqno: old.rev_seqno + 1,
                    deleted: true,
                    ..Default::default()
                };
                lsn = self
                    .inner
                    .apply_locked(bucket, &mut vb, ChangeOp::Deletion, &key, b"", meta)?
                    .lsn;
                n += 1;
            }
        }
        bucket.stats.deletes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(Written::new(n, Durability::None.into(), lsn, &[]))
    }

    /// The live item, or None. An expired item found here turns into an EXPIRATION change
    /// (on an active vbucket) and reads as missing.
    pub fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<Item>> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let mut vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Active {
            return Err(Error::NotMyVbucket(vbid));
        }
        bucket.stats.gets.fetch_add(1, Ordering::Relaxed);
        let now = now_secs();
        let found = match vb.store.get(key) {
            Some(i) if i.meta().deleted => None,
            Some(i) if is_expired(&i.meta(), now) => {
                let meta = i.meta();
                self.inner.expire_locked(bucket, &mut vb, key, &meta, now)?;
                bucket
                    .stats
                    .expired_on_access
                    .fetch_add(1, Ordering::Relaxed);
                None
            }
            Some(i) => Some(i.to_item()),
            None => None,
        };
        if found.is_none() {
            bucket.stats.get_misses.fetch_add(1, Ordering::Relaxed);
        }
        Ok(found)
    }

    /// GET_REPLICA: the key as this node's replica of its vbucket holds it (NOT_MY_VBUCKET
    /// when the vbucket is not a replica here). Expired items read as missing; a replica never
    /// expires anything itself, its active does.
    pub fn get_replica(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<Item>> {
        validate_key(key)?;
        self.check_open()?;
        let vbid = bucket.vbucket_of(key);
        let vb = bucket.lock_vbucket(vbid).expect("in range");
        if vb.state != VbState::Replica {
            return Err(Error::NotMyVbucket(vbid));
        }
        bucket.stats.gets.fetch_add(1, Ordering::Relaxed);
        Ok(vb
            .store
            .get(key)
            .filter(|i| !i.meta().deleted && !is_expired(&i.meta(), now_secs()))
            .map(|i| i.to_item()))
    }

    /// The current version of a key including tombstones, regardless of vbucket state.
    pub fn get_meta(&self, bucket: &Bucket, key: &[u8]) -> Option<Item> {
        let vb = bucket.lock_vbucket(bucket.vbucket_of(key))?;
        vb.store.get(key).map(|i| i.to_item())
    }

    /// Changes a vbucket's state; becoming active adds a failover entry.
    pub fn set_vbucket_state(&self, bucket: &Bucket, vbid: u16, state: VbState) -> Result<()> {
        self.check_open()?;
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        if vb.state == state {
            return Ok(());
        }
        let high = vb.high_seqno;
        vb.state = state;
        let mut a = self.inner.wal.appender()?;
        vb.last_lsn = a.push(WalPayload::meta(
            bucket.id,
            vbid,
            MetaRecord::VbucketState {
                state,
                high_seqno: high,
            },
        ));
        if state == VbState::Active {
            let e = vb.failover.create_entry(high);
            vb.last_lsn = a.push(WalPayload::meta(
                bucket.id,
                vbid,
                MetaRecord::FailoverEntry(e),
            ));
        }
        // Streams of the vbucket look at its state when woken.
        bucket.changes.notify();
        Ok(())
    }

    /// Promotion after a failover: every replica or pending vbucket of the bucket becomes
    /// active, each with a new failover entry. Returns the vbuckets promoted.
    pub fn promote(&self, bucket: &Bucket) -> Result<Vec<u16>> {
        let mut promoted = Vec::new();
        for v in 0..bucket.num_vbuckets() {
            let state = self.vbucket_state(bucket, v);
            if matches!(state, Some(VbState::Replica | VbState::Pending)) {
                self.set_vbucket_state(bucket, v, VbState::Active)?;
                promoted.push(v);
            }
        }
        Ok(promoted)
    }

    /// A replica's stream: stores changes decided by the active, with its seqnos, CAS and rev
    /// seqnos, under one lock of the vbucket, and logs them to this node's WAL. The vbucket
    /// must not be active here, and seqnos must rise. Returns the last LSN written.
    pub fn apply_replicated<'a>(
        &self,
        bucket: &Bucket,
        vbid: u16,
        changes: impl Iterator<Item = (ChangeOp, &'a [u8], &'a [u8], ItemMeta)>,
    ) -> Result<u64> {
        self.check_open()?;
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        if vb.state == VbState::Active || vb.state == VbState::Dead {
            return Err(Error::InvalidArgument(format!(
                "vbucket {vbid} is {} here and takes no replicated changes",
                vb.state.as_str()
            )));
        }
        let mut a = self.inner.wal.appender()?;
        let mut last = vb.last_lsn;
        for (op, key, value, mut meta) in changes {
            if meta.by_seqno <= vb.high_seqno {
                return Err(Error::InvalidArgument(format!(
                    "vbucket {vbid}: replicated seqno {} is not above {}",
                    meta.by_seqno, vb.high_seqno
                )));
            }
            meta.deleted = op != ChangeOp::Mutation;
            let c = vb.apply(op, key, value, meta);
            last = a.push(WalPayload::Change(c));
        }
        drop(a);
        vb.last_lsn = last;
        bucket.account(&mut vb);
        drop(vb);
        bucket.changes.notify();
        self.note_checkpoint_pressure(bucket, last);
        Ok(last)
    }

    /// A replica takes its active's failover log (newest first) as its own, so that it can
    /// resume from it and a promotion continues the same history.
    pub fn adopt_failover_log(
        &self,
        bucket: &Bucket,
        vbid: u16,
        entries: &[FailoverEntry],
    ) -> Result<()> {
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        if vb.failover.entries() == entries {
            return Ok(());
        }
        vb.failover.replace_all(entries.to_vec());
        self.log_failover_log(bucket, &mut vb)
    }

    fn log_failover_log(&self, bucket: &Bucket, vb: &mut VBucket) -> Result<()> {
        let mut a = self.inner.wal.appender()?;
        vb.last_lsn = a.push(WalPayload::meta(
            bucket.id,
            vb.id,
            MetaRecord::FailoverReset,
        ));
        for e in vb.failover.entries().iter().rev() {
            vb.last_lsn = a.push(WalPayload::meta(
                bucket.id,
                vb.id,
                MetaRecord::FailoverEntry(*e),
            ));
        }
        Ok(())
    }

    /// Rolls non-active vbuckets back, each to its seqno: what lies beyond goes. The items as
    /// they stood come from this node's snapshot and WAL files when they can say; when they
    /// cannot, the vbucket is emptied for a full re-stream. One snapshot then makes the results
    /// the starting point of recovery (WAL records after a rollback belong to a new branch, and
    /// recovery replays no rollback), so the vbuckets must take no change until this returns.
    /// Returns the seqno each vbucket now stands at.
    pub fn rollback_vbuckets(&self, bucket: &Arc<Bucket>, to: &[(u16, u64)]) -> Result<Vec<u64>> {
        let mut done = Vec::with_capacity(to.len());
        for &(vb, seqno) in to {
            done.push(self.rollback_vbucket(bucket, vb, seqno)?);
        }
        self.inner.write_snapshot()?;
        Ok(done)
    }

    fn rollback_vbucket(&self, bucket: &Arc<Bucket>, vbid: u16, seqno: u64) -> Result<u64> {
        self.check_open()?;
        let last_lsn = {
            let vb = bucket
                .lock_vbucket(vbid)
                .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
            if vb.state == VbState::Active {
                return Err(Error::InvalidArgument(format!(
                    "vbucket {vbid} is active; only a replica rolls back"
                )));
            }
            vb.last_lsn
        };
        let with_history = seqno > 0 && self.inner.wal.mode() != WalMode::None;
        let past = if with_history {
            self.inner.wal.wait_durable(last_lsn, None)?;
            let _files = self.inner.snapshot_lock.lock();
            match crate::history::vbucket_at(
                &self.inner.snap_dir,
                &self.inner.wal_dir,
                bucket.id,
                vbid,
                seqno,
            ) {
                Ok(p) => p,
                Err(e) => {
                    log::warn!(
                        "vbucket {vbid}: cannot read its history ({e}); re-streaming it whole"
                    );
                    None
                }
            }
        } else {
            None
        };
        let mut vb = bucket.lock_vbucket(vbid).expect("checked above");
        let (store, high, purge) = match past {
            Some(p) => {
                vb.clock.observe(p.clock.last());
                (p.store, p.high_seqno, p.purge_seqno)
            }
            None => (Default::default(), 0, 0),
        };
        vb.store.replace_keeping_readers(store);
        vb.high_seqno = high;
        vb.purge_seqno = purge;
        vb.persisted_seqno = high;
        // Readers of the vbucket (a chained replica's streams) lose their cursors and find
        // the vbucket behind them.
        vb.checkpoints.reset(high);
        vb.persistence_cursor = None;
        if self.inner.wal.mode() != WalMode::None {
            let (reg, _) = vb.checkpoints.register_cursor(PERSISTENCE_CURSOR, high);
            vb.persistence_cursor = Some(reg.id);
        }
        let kept: Vec<FailoverEntry> = if high == 0 {
            Vec::new()
        } else {
            vb.failover
                .entries()
                .iter()
                .filter(|e| e.seqno <= high)
                .copied()
                .collect()
        };
        vb.failover.replace_all(kept);
        vb.last_lsn = self.inner.wal.appender()?.push(WalPayload::meta(
            bucket.id,
            vbid,
            MetaRecord::Rollback(high),
        ));
        self.log_failover_log(bucket, &mut vb)?;
        bucket.account(&mut vb);
        drop(vb);
        bucket.changes.notify();
        log::info!(
            "vbucket {vbid} of bucket {:?} rolled back to seqno {high} (asked {seqno}){}",
            bucket.name(),
            if high == 0 && seqno > 0 {
                "; its history was not on disk, so it is re-streamed whole"
            } else {
                ""
            }
        );
        Ok(high)
    }

    pub fn vbucket_state(&self, bucket: &Bucket, vbid: u16) -> Option<VbState> {
        bucket.lock_vbucket(vbid).map(|vb| vb.state)
    }

    pub fn high_seqnos(&self, bucket: &Bucket) -> Vec<u64> {
        (0..bucket.num_vbuckets())
            .map(|v| bucket.lock_vbucket(v).expect("in range").high_seqno)
            .collect()
    }

    pub fn persisted_seqnos(&self, bucket: &Bucket) -> Vec<u64> {
        (0..bucket.num_vbuckets())
            .map(|v| bucket.lock_vbucket(v).expect("in range").persisted_seqno)
            .collect()
    }

    pub fn failover_log(&self, bucket: &Bucket, vbid: u16) -> Option<Vec<FailoverEntry>> {
        bucket
            .lock_vbucket(vbid)
            .map(|vb| vb.failover.entries().to_vec())
    }

    /// A vbucket's state, seqnos and failover log read together, for a stream request.
    pub fn stream_position(&self, bucket: &Bucket, vbid: u16) -> Option<StreamPosition> {
        bucket.lock_vbucket(vbid).map(|vb| StreamPosition {
            state: vb.state,
            high_seqno: vb.high_seqno,
            purge_seqno: vb.purge_seqno,
            failover: vb.failover.entries().to_vec(),
        })
    }

    pub fn purge_seqno(&self, bucket: &Bucket, vbid: u16) -> Option<u64> {
        bucket.lock_vbucket(vbid).map(|vb| vb.purge_seqno)
    }

    /// Registers a cursor for a reader holding everything up to `have_seqno`; when the
    /// checkpoints no longer hold what comes next, also starts the backfill that covers the
    /// gap, atomically with the registration so that nothing falls between them.
    pub fn open_cursor(
        &self,
        bucket: &Arc<Bucket>,
        vbid: u16,
        name: &str,
        have_seqno: u64,
    ) -> Result<(Registration, CursorHandle, Option<Backfill>)> {
        self.check_open()?;
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        let have = have_seqno.min(vb.high_seqno);
        let (reg, handle) = vb.checkpoints.register_cursor(name, have);
        let backfill = reg
            .backfill
            .map(|(start, end)| Backfill::begin_locked(bucket.clone(), &mut vb, start, end));
        bucket.account(&mut vb);
        Ok((reg, handle, backfill))
    }

    /// Where a reader holding all of checkpoint `id` of a vbucket resumes, if memory still
    /// holds that checkpoint closed.
    pub fn closed_checkpoint_end(&self, bucket: &Bucket, vbid: u16, id: u64) -> Option<u64> {
        bucket
            .lock_vbucket(vbid)?
            .checkpoints
            .closed_checkpoint_end(id)
    }

    pub fn read_cursor(
        &self,
        bucket: &Bucket,
        vbid: u16,
        id: CursorId,
        limit: usize,
    ) -> CursorRead {
        let Some(mut vb) = bucket.lock_vbucket(vbid) else {
            return CursorRead::Dropped;
        };
        let (read, _) = vb.checkpoints.read(id, limit);
        bucket.account(&mut vb);
        read
    }

    pub fn remove_cursor(&self, bucket: &Bucket, vbid: u16, id: CursorId) {
        if let Some(mut vb) = bucket.lock_vbucket(vbid) {
            vb.checkpoints.remove_cursor(id);
            bucket.account(&mut vb);
        }
    }

    /// A backfill of `[start, end]` (end capped at the high seqno now) for a reader with no cursor.
    pub fn backfill(
        &self,
        bucket: &Arc<Bucket>,
        vbid: u16,
        start: u64,
        end: u64,
    ) -> Result<Backfill> {
        let mut vb = bucket
            .lock_vbucket(vbid)
            .ok_or_else(|| Error::InvalidArgument(format!("no vbucket {vbid}")))?;
        Ok(Backfill::begin_locked(bucket.clone(), &mut vb, start, end))
    }

    pub fn set_cursor_drop_policy(&self, policy: Arc<dyn CursorDropPolicy>) {
        *self.inner.drop_policy.write() = policy;
    }

    /// Drops cursors chosen by the policy while a bucket's checkpoints are over quota.
    pub fn enforce_checkpoint_quota(&self) -> usize {
        enforce_checkpoint_quota(&self.inner)
    }

    /// Expires items past their time and purges old tombstones now.
    pub fn run_expiry_pager(&self) -> usize {
        run_pager(&self.inner)
    }

    /// Writes a snapshot now and removes what retention no longer needs.
    pub fn snapshot_now(&self) -> Result<PathBuf> {
        self.check_open()?;
        self.inner.write_snapshot()
    }

    pub fn set_wal_failpoint(&self, fp: Failpoint) {
        self.inner.wal.set_failpoint(fp);
    }

    fn stop_background(&self) {
        *self.inner.background.stop.lock() = true;
        self.inner.background.wake.notify_all();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
    }

    /// Flushes the WAL, closes its segment cleanly and stops the background threads.
    pub fn close(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.stop_background();
        self.inner.wal.shutdown();
        self.inner.lock_file.lock().take();
    }

    /// For recovery tests: stops as `kill -9` right after the last WAL write would.
    pub fn crash(&self) {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.stop_background();
        self.inner.wal.crash();
        self.inner.lock_file.lock().take();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

/// An active vbucket with room for `n` more seqnos.
fn check_writable(vb: &VBucket, n: u64) -> Result<()> {
    if vb.state == VbState::Pending {
        // Being handed over: it is active here or on its new node within moments.
        return Err(Error::TempFail(format!(
            "vbucket {} is being handed over; retry",
            vb.id
        )));
    }
    if vb.state != VbState::Active {
        return Err(Error::NotMyVbucket(vb.id));
    }
    if vb.high_seqno + n > crate::item_store::MAX_SEQNO {
        return Err(Error::TempFail(format!(
            "vbucket {} has used its 2^48 seqnos",
            vb.id
        )));
    }
    Ok(())
}

fn enforce_checkpoint_quota(inner: &Inner) -> usize {
    let mut dropped = 0;
    for bucket in inner.catalog.all() {
        // One reading of the counter: writers move it concurrently.
        let over_by = bucket
            .checkpoint_mem()
            .saturating_sub(bucket.config.checkpoint_quota_bytes());
        if over_by == 0 {
            continue;
        }
        let mut infos = Vec::new();
        for v in 0..bucket.num_vbuckets() {
            let vb = bucket.lock_vbucket(v).expect("in range");
            infos.extend(vb.checkpoints.cursor_infos(bucket.id, v));
        }
        let policy = inner.drop_policy.read().clone();
        for (_, v, id) in policy.choose(over_by, &infos) {
            if let Some(mut vb) = bucket.lock_vbucket(v) {
                if Some(id) != vb.persistence_cursor {
                    vb.checkpoints.drop_cursor(id);
                    bucket.account(&mut vb);
                    bucket.stats.cursors_dropped.fetch_add(1, Ordering::Relaxed);
                    dropped += 1;
                }
            }
        }
    }
    dropped
}

/// Closes checkpoints past their period and frees what every cursor has passed.
fn release_checkpoints(bucket: &Bucket) {
    for v in 0..bucket.num_vbuckets() {
        let mut vb = bucket.lock_vbucket(v).expect("in range");
        vb.checkpoints.check_period();
        vb.checkpoints.release();
        bucket.account(&mut vb);
    }
}

fn run_pager(inner: &Inner) -> usize {
    let now = now_secs();
    let purge_age = inner
        .config
        .tombstone_purge_age
        .as_secs()
        .min(u32::MAX as u64) as u32;
    let mut n = 0;
    for bucket in inner.catalog.all() {
        for v in 0..bucket.num_vbuckets() {
            let mut vb = bucket.lock_vbucket(v).expect("in range");
            vb.checkpoints.check_period();
            vb.checkpoints.release();
            if vb.state == VbState::Active && !inner.wal.is_failing() {
                for key in vb.store.keys_where(|m| is_expired(m, now)) {
                    let meta = vb.store.get(&key).expect("listed above").meta();
                    if inner
                        .expire_locked(&bucket, &mut vb, &key, &meta, now)
                        .is_err()
                    {
                        break; // closing
                    }
                    bucket
                        .stats
                        .expired_by_pager
                        .fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
            }
            if !vb.store.has_range_reads() {
                let old = vb
                    .store
                    .keys_where(|m| m.deleted && m.expiry.saturating_add(purge_age) <= now);
                let mut purged_upto = vb.purge_seqno;
                for key in &old {
                    if let Some(m) = vb.store.purge(key) {
                        purged_upto = purged_upto.max(m.by_seqno);
                    }
                }
                if purged_upto > vb.purge_seqno {
                    vb.purge_seqno = purged_upto;
                    if let Ok(mut a) = inner.wal.appender() {
                        vb.last_lsn = a.push(WalPayload::meta(
                            bucket.id,
                            v,
                            MetaRecord::PurgeSeqno(purged_upto),
                        ));
                    }
                    bucket
                        .stats
                        .tombstones_purged
                        .fetch_add(old.len() as u64, Ordering::Relaxed);
                }
            }
            bucket.account(&mut vb);
        }
    }
    n
}

impl Inner {
    fn write_snapshot(&self) -> Result<PathBuf> {
        snapshot::write(
            &self.catalog,
            &self.wal,
            &self.snap_dir,
            &self.wal_dir,
            &self.instance,
            self.config.snapshot_count,
            &self.snapshot_lock,
        )
    }

    /// Applies a local change to a locked vbucket and queues it for the WAL. Refused (Closed)
    /// once the engine is closing: no change is acknowledged that the WAL will not write.
    fn apply_locked(
        &self,
        bucket: &Bucket,
        vb: &mut VBucket,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: ItemMeta,
    ) -> Result<MutationResult> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let change = vb.apply_local(op, key, value, meta, now_nanos());
        let (cas, seqno) = (change.meta().cas, change.seqno());
        let lsn = self.wal.appender()?.push(WalPayload::Change(change));
        vb.last_lsn = lsn;
        bucket.account(vb);
        bucket.changes.notify();
        Ok(MutationResult {
            cas,
            vbucket: vb.id,
            seqno,
            lsn,
        })
    }

    /// Turns an expired item into an EXPIRATION change with its own seqno.
    fn expire_locked(
        &self,
        bucket: &Bucket,
        vb: &mut VBucket,
        key: &[u8],
        old: &ItemMeta,
        now: u32,
    ) -> Result<MutationResult> {
        let meta = ItemMeta {
            flags: old.flags,
            expiry: now,
            rev_seqno: old.rev_seqno + 1,
            deleted: true,
            ..Default::default()
        };
        self.apply_locked(bucket, vb, ChangeOp::Expiration, key, b"", meta)
    }
}

fn maintenance_loop(inner: Arc<Inner>) {
    let tick = Duration::from_millis(200);
    let mut last_pager = Instant::now();
    let mut last_release = Instant::now();
    loop {
        {
            let mut stop = inner.background.stop.lock();
            if *stop {
                return;
            }
            // Under quota pressure the wait is short but never zero, so a pressure that cannot
            // be relieved (the WAL itself lagging) does not spin against the writers.
            let wait = if inner.background.quota_pressure.load(Ordering::Acquire) {
                Duration::from_millis(20)
            } else {
                tick
            };
            inner.background.wake.wait_for(&mut stop, wait);
            if *stop {
                return;
            }
        }
        if inner
            .background
            .quota_pressure
            .swap(false, Ordering::AcqRel)
        {
            enforce_checkpoint_quota(&inner);
        }
        #[cfg(feature = "mimalloc")]
        if last_release.elapsed() >= Duration::from_secs(2) {
            crate::alloc::release_free_memory();
            last_release = Instant::now();
        }
        #[cfg(not(feature = "mimalloc"))]
        let _ = &mut last_release;
        if last_pager.elapsed() >= inner.config.expiry_pager_interval {
            run_pager(&inner);
            last_pager = Instant::now();
        } else {
            for bucket in inner.catalog.all() {
                release_checkpoints(&bucket);
            }
        }
    }
}

fn snapshot_loop(inner: Arc<Inner>) {
    let interval = inner.config.snapshot_interval;
    loop {
        {
            let deadline = Instant::now() + interval;
            let mut stop = inner.background.stop.lock();
            while !*stop
                && !inner
                    .background
                    .wake
                    .wait_until(&mut stop, deadline)
                    .timed_out()
            {}
            if *stop {
                return;
            }
        }
        if let Err(e) = inner.write_snapshot() {
            log::error!("periodic snapshot failed: {e}");
        }
    }
}
