//! The engine: buckets of vbuckets over one WAL. This file opens and closes it; the rest of the
//! engine is split by concept: `write` (the write path and durability), `read` (lookups and
//! vbucket positions), `select` (range reads of an ordered bucket), `state` (vbucket states,
//! failover, rollback, replicated changes), `cursors` (checkpoint cursors and backfill for
//! streams), `evict` (making room in a cache bucket), `background` (expiry pager, tombstone
//! purger, checkpoint quota, periodic snapshots).
//!
//! Lock order: a vbucket's lock, then the WAL queue lock. The WAL writer takes vbucket locks
//! only after releasing its queue lock, and the snapshot writer holds one vbucket lock at a time.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::bucket::Bucket;
use crate::checkpoint::{CursorDropPolicy, DropSlowest, PERSISTENCE_CURSOR};
use crate::config::{BucketConfig, EngineConfig};
use crate::error::{Error, Result};
use crate::partition_log::LogConfig;
use crate::recovery;
use crate::vbucket::{VBucket, VbState};
use crate::wal::writer::{Failpoint, MetaRecord, WalConfig, WalPayload};
use crate::wal::{WalMode, WalWriter};

mod background;
mod cursors;
mod evict;
mod follow;
mod read;
mod select;
mod state;
mod topics;
mod write;

use crate::catalog::Catalog;
pub use follow::{FollowedChange, MAX_GROUP};
pub use read::StreamPosition;
pub use select::{Part, SelectIterator};
pub use topics::TopicRead;
pub use write::{
    counter_value, DocumentUpdate, Landing, MutationResult, StoreMode, StoreRequest, Update,
    Written,
};

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
        let topics_dir = config.data_dir.join("topics");
        let mut recovered = recovery::recover(
            &wal_dir,
            &snap_dir,
            Some(&topics_dir),
            config.force_recovery,
        )?;
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
        let topics = std::mem::take(&mut recovered.topics);
        Engine::install_buckets(&inner, recovered)?;
        inner.install_topics(topics, |text| {
            LogConfig::from_text(text).unwrap_or_else(|e| {
                log::warn!("a topic's settings {text:?} do not read ({e}); using the defaults");
                LogConfig::default()
            })
        });
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
        inner.catalog.install(live);
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

    pub fn set_wal_failpoint(&self, fp: Failpoint) {
        self.inner.wal.set_failpoint(fp);
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
