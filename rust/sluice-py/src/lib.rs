//! PyO3 glue only: the embedded engine handle, its configuration objects, exceptions, and the
//! WAL dump. Every call that can block (disk, durability waits) releases the GIL.
//!
//! May depend on every other crate of the workspace; none depends on it.

mod dcp;
mod policy;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use sluice_core::bucket::Bucket;
use sluice_core::checkpoint::CheckpointConfig;
use sluice_core::item::Item;
use sluice_core::vbucket::VbState;
use sluice_core::wal::writer::Failpoint;
use sluice_core::wal::WalMode;
use sluice_core::{
    BucketConfig, Durability, Engine, EngineConfig, Error, Requirement, StoreMode, StoreRequest,
};

pyo3::create_exception!(
    _native,
    SluiceError,
    PyException,
    "Base class of every sluice error."
);
pyo3::create_exception!(
    _native,
    InvalidKeyError,
    SluiceError,
    "Key empty or longer than 250 bytes."
);
pyo3::create_exception!(
    _native,
    TooBigError,
    SluiceError,
    "Value larger than the bucket's max_item_size."
);
pyo3::create_exception!(
    _native,
    NotFoundError,
    SluiceError,
    "The key does not exist (REPLACE, DELETE, CAS)."
);
pyo3::create_exception!(
    _native,
    ExistsError,
    SluiceError,
    "The key exists (ADD) or its CAS does not match."
);
pyo3::create_exception!(
    _native,
    NotStoredError,
    SluiceError,
    "APPEND/PREPEND of a missing key."
);
pyo3::create_exception!(
    _native,
    NotNumericError,
    SluiceError,
    "INCR/DECR of a value that is not a decimal number."
);
pyo3::create_exception!(
    _native,
    NotMyVbucketError,
    SluiceError,
    "The key's vbucket is not active here."
);
pyo3::create_exception!(
    _native,
    TempFailError,
    SluiceError,
    "Temporary failure (memory, WAL); retry later."
);
pyo3::create_exception!(
    _native,
    WalFailedError,
    SluiceError,
    "The WAL could not write this change; it is retried, durability unknown."
);
pyo3::create_exception!(
    _native,
    DurabilityImpossibleError,
    SluiceError,
    "The durability level cannot be met here."
);
pyo3::create_exception!(
    _native,
    SyncWriteAmbiguousError,
    SluiceError,
    "The write is applied but its durability level was not met in time."
);
pyo3::create_exception!(
    _native,
    NoSuchBucketError,
    SluiceError,
    "No bucket by that name."
);
pyo3::create_exception!(
    _native,
    ConfigError,
    SluiceError,
    "Invalid configuration: names the key and the reason."
);
pyo3::create_exception!(
    _native,
    CorruptionError,
    SluiceError,
    "Damaged data files: names the file and byte offset."
);
pyo3::create_exception!(_native, ClosedError, SluiceError, "The engine is closed.");

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidKey(_) => InvalidKeyError::new_err(msg),
        Error::TooBig { .. } => TooBigError::new_err(msg),
        Error::NotFound => NotFoundError::new_err(msg),
        Error::Exists => ExistsError::new_err(msg),
        Error::NotStored => NotStoredError::new_err(msg),
        Error::NotNumeric => NotNumericError::new_err(msg),
        Error::NotMyVbucket(_) => NotMyVbucketError::new_err(msg),
        Error::TempFail(_) => TempFailError::new_err(msg),
        Error::WalFailed(_) => WalFailedError::new_err(msg),
        Error::DurabilityImpossible(_) => DurabilityImpossibleError::new_err(msg),
        Error::SyncWriteAmbiguous(_) => SyncWriteAmbiguousError::new_err(msg),
        Error::NoSuchBucket(_) => NoSuchBucketError::new_err(msg),
        Error::InvalidConfig { .. } | Error::InvalidArgument(_) => ConfigError::new_err(msg),
        Error::Corrupt { .. } => CorruptionError::new_err(msg),
        Error::Closed => ClosedError::new_err(msg),
        Error::Io(_) => SluiceError::new_err(msg),
    }
}

fn config_err(key: &str, reason: impl std::fmt::Display) -> PyErr {
    ConfigError::new_err(format!("invalid config: {key}: {reason}"))
}

fn parse_durability(key: &str, s: Option<&str>) -> PyResult<Option<Durability>> {
    s.map(|s| {
        Durability::parse(s)
            .ok_or_else(|| config_err(key, format!("unknown durability level {s:?}")))
    })
    .transpose()
}

fn secs(key: &str, v: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| config_err(key, format!("{v} is not a non-negative number of seconds")))
}

/// One bucket's settings.
#[pyclass(module = "sluice._native", frozen, from_py_object)]
#[derive(Clone)]
struct BucketSettings {
    inner: BucketConfig,
}

#[pymethods]
impl BucketSettings {
    #[new]
    #[pyo3(signature = (name, *, num_vbuckets=64, memory_quota=1<<30, high_watermark=0.85, max_item_size=20<<20, checkpoint_memory_ratio=0.3, durability="none", replicas=1, durability_timeout=10.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        num_vbuckets: u16,
        memory_quota: usize,
        high_watermark: f64,
        max_item_size: usize,
        checkpoint_memory_ratio: f64,
        durability: &str,
        replicas: u8,
        durability_timeout: f64,
    ) -> PyResult<Self> {
        let durability =
            parse_durability("durability", Some(durability))?.expect("Some in, Some out");
        Ok(BucketSettings {
            inner: BucketConfig {
                name,
                num_vbuckets,
                memory_quota,
                high_watermark,
                max_item_size,
                checkpoint_memory_ratio,
                durability,
                replicas,
                durability_timeout: secs("durability_timeout", durability_timeout)?,
            },
        })
    }

    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }

    #[getter]
    fn num_vbuckets(&self) -> u16 {
        self.inner.num_vbuckets
    }

    fn __repr__(&self) -> String {
        format!(
            "BucketSettings({:?}, num_vbuckets={})",
            self.inner.name, self.inner.num_vbuckets
        )
    }
}

/// The engine's settings: one native object built from the validated TOML.
#[pyclass(module = "sluice._native", frozen)]
#[derive(Clone)]
struct EngineSettings {
    inner: EngineConfig,
}

#[pymethods]
impl EngineSettings {
    #[new]
    #[pyo3(signature = (data_dir, *, wal_mode="write", wal_segment_size=64<<20, snapshot_count=2, snapshot_interval=3600.0, checkpoint_max_items=10_000, checkpoint_period=5.0, tombstone_purge_age=259_200.0, expiry_pager_interval=60.0, force_recovery=false, replica=false, buckets=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        data_dir: PathBuf,
        wal_mode: &str,
        wal_segment_size: u64,
        snapshot_count: usize,
        snapshot_interval: f64,
        checkpoint_max_items: usize,
        checkpoint_period: f64,
        tombstone_purge_age: f64,
        expiry_pager_interval: f64,
        force_recovery: bool,
        replica: bool,
        buckets: Option<Vec<BucketSettings>>,
    ) -> PyResult<Self> {
        let wal_mode = WalMode::parse(wal_mode).ok_or_else(|| {
            config_err(
                "wal.mode",
                format!("{wal_mode:?} is not one of none, write, fsync"),
            )
        })?;
        let buckets = match buckets {
            Some(b) => b.into_iter().map(|b| b.inner).collect(),
            None => vec![BucketConfig::named("default")],
        };
        let inner = EngineConfig {
            data_dir,
            wal_mode,
            wal_segment_size,
            snapshot_count,
            snapshot_interval: secs("snapshot.interval", snapshot_interval)?,
            checkpoint: CheckpointConfig {
                max_items: checkpoint_max_items,
                period: secs("checkpoint.period", checkpoint_period)?,
            },
            tombstone_purge_age: secs("tombstone_purge_age", tombstone_purge_age)?,
            expiry_pager_interval: secs("expiry_pager_interval", expiry_pager_interval)?,
            force_recovery,
            replica,
            buckets,
        };
        inner.validate().map_err(to_py)?;
        Ok(EngineSettings { inner })
    }

    #[getter]
    fn data_dir(&self) -> PathBuf {
        self.inner.data_dir.clone()
    }

    #[getter]
    fn wal_mode(&self) -> &'static str {
        self.inner.wal_mode.as_str()
    }

    #[getter]
    fn bucket_names(&self) -> Vec<String> {
        self.inner.buckets.iter().map(|b| b.name.clone()).collect()
    }
}

/// The result of a mutation (`sluice.Mutation` in Python; named apart from DCP's MUTATION).
#[pyclass(name = "Mutation", module = "sluice._native", frozen, get_all)]
struct MutationInfo {
    cas: u64,
    vbucket: u16,
    seqno: u64,
    lsn: u64,
}

#[pymethods]
impl MutationInfo {
    fn __repr__(&self) -> String {
        format!(
            "Mutation(cas={}, vbucket={}, seqno={}, lsn={})",
            self.cas, self.vbucket, self.seqno, self.lsn
        )
    }
}

/// A stored item as read back.
#[pyclass(module = "sluice._native", frozen, get_all)]
struct ItemView {
    key: Py<PyBytes>,
    value: Py<PyBytes>,
    flags: u32,
    expiry: u32,
    cas: u64,
    rev_seqno: u64,
    seqno: u64,
    datatype: u8,
    deleted: bool,
}

impl ItemView {
    fn from_item(py: Python<'_>, it: &Item) -> ItemView {
        ItemView {
            key: PyBytes::new(py, it.key()).unbind(),
            value: PyBytes::new(py, it.value()).unbind(),
            flags: it.meta.flags,
            expiry: it.meta.expiry,
            cas: it.meta.cas,
            rev_seqno: it.meta.rev_seqno,
            seqno: it.meta.by_seqno,
            datatype: it.meta.datatype & sluice_core::item::DATATYPE_CLIENT_BITS,
            deleted: it.meta.deleted,
        }
    }
}

#[pymethods]
impl ItemView {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ItemView(key={:?}, seqno={}, cas={}, deleted={})",
            self.key.bind(py),
            self.seqno,
            self.cas,
            self.deleted
        )
    }
}

/// An open data directory: the storage engine embedded in this process.
#[pyclass(module = "sluice._native", frozen)]
struct EmbeddedEngine {
    engine: Arc<Engine>,
}

impl EmbeddedEngine {
    fn bucket(&self, name: &str) -> PyResult<Arc<Bucket>> {
        self.engine.bucket(name).map_err(to_py)
    }

    #[allow(clippy::too_many_arguments)]
    fn concat(
        &self,
        py: Python<'_>,
        key: &[u8],
        data: &[u8],
        at_end: bool,
        bucket: &str,
        cas: u64,
        durability: Option<&str>,
    ) -> PyResult<MutationInfo> {
        let b = self.bucket(bucket)?;
        let durability = parse_durability("durability", durability)?.map(Requirement::from);
        py.detach(|| self.engine.concat(&b, key, data, at_end, cas, durability))
            .map(mutation)
            .map_err(to_py)
    }

    #[allow(clippy::too_many_arguments)]
    fn arithmetic(
        &self,
        py: Python<'_>,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        increment: bool,
        bucket: &str,
        cas: u64,
        durability: Option<&str>,
    ) -> PyResult<(MutationInfo, u64)> {
        let b = self.bucket(bucket)?;
        let durability = parse_durability("durability", durability)?.map(Requirement::from);
        let (r, n) = py
            .detach(|| {
                self.engine
                    .arithmetic(&b, key, delta, initial, expiry, increment, cas, durability)
            })
            .map_err(to_py)?;
        Ok((mutation(r), n))
    }
}

fn mutation(r: sluice_core::MutationResult) -> MutationInfo {
    MutationInfo {
        cas: r.cas,
        vbucket: r.vbucket,
        seqno: r.seqno,
        lsn: r.lsn,
    }
}

fn vb_state(s: &str) -> PyResult<VbState> {
    VbState::parse(s).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!("unknown vbucket state {s:?}"))
    })
}

#[pymethods]
impl EmbeddedEngine {
    /// Opens the data directory, recovering what it holds.
    #[new]
    fn new(py: Python<'_>, settings: &EngineSettings) -> PyResult<Self> {
        let cfg = settings.inner.clone();
        let engine = py.detach(|| Engine::open(cfg)).map_err(to_py)?;
        Ok(EmbeddedEngine {
            engine: Arc::new(engine),
        })
    }

    #[pyo3(signature = (key, value, *, bucket="default", flags=0, expiry=0, datatype=0, cas=0, mode="set", durability=None))]
    #[allow(clippy::too_many_arguments)]
    fn set(
        &self,
        py: Python<'_>,
        key: &[u8],
        value: &[u8],
        bucket: &str,
        flags: u32,
        expiry: u32,
        datatype: u8,
        cas: u64,
        mode: &str,
        durability: Option<&str>,
    ) -> PyResult<MutationInfo> {
        let b = self.bucket(bucket)?;
        let mode = match mode {
            "set" => StoreMode::Set,
            "add" => StoreMode::Add,
            "replace" => StoreMode::Replace,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "mode {other:?} is not set, add or replace"
                )))
            }
        };
        let durability = parse_durability("durability", durability)?.map(Requirement::from);
        let req = StoreRequest {
            key,
            value,
            flags,
            expiry,
            datatype: datatype & sluice_core::item::DATATYPE_CLIENT_BITS,
            cas,
            mode,
            durability,
        };
        py.detach(|| self.engine.store(&b, &req))
            .map(mutation)
            .map_err(to_py)
    }

    /// Many SETs in one call (grouped by vbucket inside). Returns the last LSN.
    #[pyo3(signature = (items, *, bucket="default", flags=0, expiry=0, durability=None))]
    fn set_many(
        &self,
        py: Python<'_>,
        items: &Bound<'_, PyList>,
        bucket: &str,
        flags: u32,
        expiry: u32,
        durability: Option<&str>,
    ) -> PyResult<u64> {
        let b = self.bucket(bucket)?;
        let durability = parse_durability("durability", durability)?.map(Requirement::from);
        let mut pairs: Vec<(&[u8], &[u8])> = Vec::with_capacity(items.len());
        let owned: Vec<(Bound<'_, PyBytes>, Bound<'_, PyBytes>)> = items
            .iter()
            .map(|t| t.extract::<(Bound<'_, PyBytes>, Bound<'_, PyBytes>)>())
            .collect::<PyResult<_>>()?;
        for (k, v) in &owned {
            pairs.push((k.as_bytes(), v.as_bytes()));
        }
        // The PyBytes stay alive in `owned` for the call; their buffers are immutable.
        py.detach(|| self.engine.set_many(&b, &pairs, flags, expiry, durability))
            .map_err(to_py)
    }

    #[pyo3(signature = (key, *, bucket="default", cas=0, durability=None))]
    fn delete(
        &self,
        py: Python<'_>,
        key: &[u8],
        bucket: &str,
        cas: u64,
        durability: Option<&str>,
    ) -> PyResult<MutationInfo> {
        let b = self.bucket(bucket)?;
        let durability = parse_durability("durability", durability)?.map(Requirement::from);
        py.detach(|| self.engine.delete(&b, key, cas, durability))
            .map(mutation)
            .map_err(to_py)
    }

    /// APPEND: the key must exist (NotStoredError otherwise).
    #[pyo3(signature = (key, data, *, bucket="default", cas=0, durability=None))]
    fn append(
        &self,
        py: Python<'_>,
        key: &[u8],
        data: &[u8],
        bucket: &str,
        cas: u64,
        durability: Option<&str>,
    ) -> PyResult<MutationInfo> {
        self.concat(py, key, data, true, bucket, cas, durability)
    }

    /// PREPEND: the key must exist (NotStoredError otherwise).
    #[pyo3(signature = (key, data, *, bucket="default", cas=0, durability=None))]
    fn prepend(
        &self,
        py: Python<'_>,
        key: &[u8],
        data: &[u8],
        bucket: &str,
        cas: u64,
        durability: Option<&str>,
    ) -> PyResult<MutationInfo> {
        self.concat(py, key, data, false, bucket, cas, durability)
    }

    /// INCR: returns (mutation, new value). A missing key starts at `initial` unless
    /// `expiry` is 0xffffffff (then NotFoundError).
    #[pyo3(signature = (key, delta=1, *, initial=0, expiry=0, bucket="default", cas=0, durability=None))]
    #[allow(clippy::too_many_arguments)]
    fn incr(
        &self,
        py: Python<'_>,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        bucket: &str,
        cas: u64,
        durability: Option<&str>,
    ) -> PyResult<(MutationInfo, u64)> {
        self.arithmetic(
            py, key, delta, initial, expiry, true, bucket, cas, durability,
        )
    }

    /// DECR: like incr, stopping at 0.
    #[pyo3(signature = (key, delta=1, *, initial=0, expiry=0, bucket="default", cas=0, durability=None))]
    #[allow(clippy::too_many_arguments)]
    fn decr(
        &self,
        py: Python<'_>,
        key: &[u8],
        delta: u64,
        initial: u64,
        expiry: u32,
        bucket: &str,
        cas: u64,
        durability: Option<&str>,
    ) -> PyResult<(MutationInfo, u64)> {
        self.arithmetic(
            py, key, delta, initial, expiry, false, bucket, cas, durability,
        )
    }

    /// TOUCH: a new expiry (memcached rules) for a live key.
    #[pyo3(signature = (key, expiry, *, bucket="default"))]
    fn touch(
        &self,
        py: Python<'_>,
        key: &[u8],
        expiry: u32,
        bucket: &str,
    ) -> PyResult<MutationInfo> {
        Ok(self.gat(py, key, expiry, bucket)?.0)
    }

    /// GAT: touch and return the item.
    #[pyo3(signature = (key, expiry, *, bucket="default"))]
    fn gat(
        &self,
        py: Python<'_>,
        key: &[u8],
        expiry: u32,
        bucket: &str,
    ) -> PyResult<(MutationInfo, ItemView)> {
        let b = self.bucket(bucket)?;
        let (r, it) = py
            .detach(|| self.engine.touch(&b, key, expiry, None))
            .map_err(to_py)?;
        Ok((mutation(r), ItemView::from_item(py, &it)))
    }

    /// FLUSH: deletes every item of the bucket; returns how many.
    #[pyo3(signature = (*, bucket="default"))]
    fn flush(&self, py: Python<'_>, bucket: &str) -> PyResult<usize> {
        let b = self.bucket(bucket)?;
        py.detach(|| self.engine.flush(&b)).map_err(to_py)
    }

    /// The live item, or None.
    #[pyo3(signature = (key, *, bucket="default"))]
    fn get(&self, py: Python<'_>, key: &[u8], bucket: &str) -> PyResult<Option<ItemView>> {
        let b = self.bucket(bucket)?;
        let it = py.detach(|| self.engine.get(&b, key)).map_err(to_py)?;
        Ok(it.map(|i| ItemView::from_item(py, &i)))
    }

    /// The current version including tombstones, whatever the vbucket's state.
    #[pyo3(signature = (key, *, bucket="default"))]
    fn get_meta(&self, py: Python<'_>, key: &[u8], bucket: &str) -> PyResult<Option<ItemView>> {
        let b = self.bucket(bucket)?;
        let it = py.detach(|| self.engine.get_meta(&b, key));
        Ok(it.map(|i| ItemView::from_item(py, &i)))
    }

    #[pyo3(signature = (key, *, bucket="default"))]
    fn vbucket_of(&self, key: &[u8], bucket: &str) -> PyResult<u16> {
        Ok(self.bucket(bucket)?.vbucket_of(key))
    }

    #[pyo3(signature = (*, bucket="default"))]
    fn high_seqnos(&self, py: Python<'_>, bucket: &str) -> PyResult<Vec<u64>> {
        let b = self.bucket(bucket)?;
        Ok(py.detach(|| self.engine.high_seqnos(&b)))
    }

    #[pyo3(signature = (*, bucket="default"))]
    fn persisted_seqnos(&self, py: Python<'_>, bucket: &str) -> PyResult<Vec<u64>> {
        let b = self.bucket(bucket)?;
        Ok(py.detach(|| self.engine.persisted_seqnos(&b)))
    }

    /// Newest first: [(uuid, seqno), ...].
    #[pyo3(signature = (vbucket, *, bucket="default"))]
    fn failover_log(
        &self,
        py: Python<'_>,
        vbucket: u16,
        bucket: &str,
    ) -> PyResult<Vec<(u64, u64)>> {
        let b = self.bucket(bucket)?;
        let log = py
            .detach(|| self.engine.failover_log(&b, vbucket))
            .ok_or_else(|| {
                pyo3::exceptions::PyIndexError::new_err(format!("no vbucket {vbucket}"))
            })?;
        Ok(log.iter().map(|e| (e.uuid, e.seqno)).collect())
    }

    #[pyo3(signature = (vbucket, *, bucket="default"))]
    fn vbucket_state(&self, py: Python<'_>, vbucket: u16, bucket: &str) -> PyResult<&'static str> {
        let b = self.bucket(bucket)?;
        py.detach(|| self.engine.vbucket_state(&b, vbucket))
            .map(|s| s.as_str())
            .ok_or_else(|| pyo3::exceptions::PyIndexError::new_err(format!("no vbucket {vbucket}")))
    }

    #[pyo3(signature = (vbucket, state, *, bucket="default"))]
    fn set_vbucket_state(
        &self,
        py: Python<'_>,
        vbucket: u16,
        state: &str,
        bucket: &str,
    ) -> PyResult<()> {
        let b = self.bucket(bucket)?;
        if vbucket >= b.num_vbuckets() {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "no vbucket {vbucket}"
            )));
        }
        let state = vb_state(state)?;
        py.detach(|| self.engine.set_vbucket_state(&b, vbucket, state))
            .map_err(to_py)
    }

    /// Writes a snapshot now; returns its path.
    fn snapshot(&self, py: Python<'_>) -> PyResult<PathBuf> {
        py.detach(|| self.engine.snapshot_now()).map_err(to_py)
    }

    /// Runs the expiry pager and tombstone purger now; returns how many items expired.
    fn run_expiry_pager(&self, py: Python<'_>) -> usize {
        py.detach(|| self.engine.run_expiry_pager())
    }

    /// Makes WAL writes fail as a full disk ("enospc") or a broken device ("eio") would, or not ("off").
    fn set_wal_failpoint(&self, name: &str) -> PyResult<()> {
        let fp = match name {
            "off" => Failpoint::Off,
            "enospc" => Failpoint::NoSpace,
            "eio" => Failpoint::IoError,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown failpoint {other:?}"
                )))
            }
        };
        self.engine.set_wal_failpoint(fp);
        Ok(())
    }

    /// Counters for one bucket.
    #[pyo3(signature = (*, bucket="default"))]
    fn stats<'py>(&self, py: Python<'py>, bucket: &str) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let b = self.bucket(bucket)?;
        let d = PyDict::new(py);
        let s = &b.stats;
        d.set_item("mem_used", b.mem_used())?;
        d.set_item("checkpoint_mem", b.checkpoint_mem())?;
        d.set_item("memory_quota", b.config.memory_quota)?;
        d.set_item("high_watermark", b.config.high_watermark_bytes())?;
        d.set_item("checkpoint_quota", b.config.checkpoint_quota_bytes())?;
        let (items, tombstones) = py.detach(|| {
            let (mut items, mut tombstones) = (0usize, 0usize);
            for v in 0..b.num_vbuckets() {
                let vb = b.lock_vbucket(v).expect("in range");
                items += vb.store.live_items();
                tombstones += vb.store.tombstones();
            }
            (items, tombstones)
        });
        d.set_item("items", items)?;
        d.set_item("tombstones", tombstones)?;
        for (k, v) in [
            ("sets", &s.sets),
            ("deletes", &s.deletes),
            ("gets", &s.gets),
            ("get_misses", &s.get_misses),
            ("tmp_failures", &s.tmp_failures),
            ("expired_on_access", &s.expired_on_access),
            ("expired_by_pager", &s.expired_by_pager),
            ("tombstones_purged", &s.tombstones_purged),
            ("cursors_dropped", &s.cursors_dropped),
        ] {
            d.set_item(k, v.load(Relaxed))?;
        }
        d.set_item("wal_last_lsn", self.engine.wal().last_lsn())?;
        d.set_item("wal_written_lsn", self.engine.wal().written_lsn())?;
        d.set_item("wal_synced_lsn", self.engine.wal().synced_lsn())?;
        d.set_item("wal_failing", self.engine.wal().is_failing())?;
        Ok(d)
    }

    /// What recovery found at open.
    fn recovery_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.engine.recovery_report();
        let d = PyDict::new(py);
        d.set_item("snapshot", r.snapshot.map(|p| p.display().to_string()))?;
        d.set_item("snapshot_lsn", r.snapshot_lsn)?;
        d.set_item("snapshot_records", r.snapshot_records)?;
        d.set_item("wal_segments", r.wal_segments)?;
        d.set_item("wal_records", r.wal_records)?;
        d.set_item("last_lsn", r.last_lsn)?;
        d.set_item("unclean_shutdown", r.unclean_shutdown)?;
        d.set_item(
            "truncated",
            r.truncated.map(|(p, o)| (p.display().to_string(), o)),
        )?;
        d.set_item("skipped_damage", r.skipped_damage)?;
        d.set_item(
            "moved_aside",
            r.moved_aside
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>(),
        )?;
        let dropped = PyList::empty(py);
        for x in &r.dropped {
            let e = PyDict::new(py);
            e.set_item("file", x.file.display().to_string())?;
            e.set_item("offset", x.offset)?;
            e.set_item("bytes", x.bytes)?;
            e.set_item("records", x.records)?;
            e.set_item("reason", &x.reason)?;
            e.set_item("text", x.to_string())?;
            dropped.append(e)?;
        }
        d.set_item("dropped", dropped)?;
        d.set_item("seconds", r.duration.as_secs_f64())?;
        Ok(d)
    }

    #[getter]
    fn instance(&self) -> String {
        self.engine.instance().to_string()
    }

    /// Flushes and closes the WAL cleanly. Further calls fail with ClosedError.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.engine.close())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: Py<PyAny>, _v: Py<PyAny>, _tb: Py<PyAny>) -> bool {
        self.close(py);
        false
    }
}

impl Drop for EmbeddedEngine {
    /// An engine garbage-collected without close() still closes, with the GIL released: the
    /// engine's threads log through Python's logging, which needs the GIL.
    fn drop(&mut self) {
        // SAFETY: a read-only query of the interpreter's state.
        if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
            Python::attach(|py| py.detach(|| self.engine.close()));
        } else {
            self.engine.close();
        }
    }
}

/// The network server (memcached binary protocol) over an open engine.
#[pyclass(module = "sluice._native", frozen)]
struct Server {
    inner: parking_lot::Mutex<Option<sluice_server::Server>>,
    address: String,
    admin_address: Option<String>,
    tls_address: Option<String>,
    policies: Arc<sluice_server::policy::PolicyHost>,
}

type UserSpec = (
    String,
    String,
    std::collections::HashMap<String, Vec<String>>,
);

/// (name, password hash, {bucket: [permission, ...]}) from the validated configuration.
fn users_of(specs: Vec<UserSpec>) -> PyResult<sluice_server::auth::Users> {
    let mut users = Vec::with_capacity(specs.len());
    for (name, hash, buckets) in specs {
        let hash = sluice_server::auth::PasswordHash::parse(&hash)
            .map_err(|e| config_err(&format!("users.{name}.password_hash"), e))?;
        let mut perms = std::collections::HashMap::new();
        for (bucket, names) in buckets {
            let mut bits = 0;
            for p in names {
                bits |= sluice_server::auth::permission(&p).ok_or_else(|| {
                    config_err(
                        &format!("users.{name}.buckets.{bucket}"),
                        format!("unknown permission {p:?}"),
                    )
                })?;
            }
            perms.insert(bucket, bits);
        }
        users.push(sluice_server::auth::User {
            name,
            hash,
            buckets: perms,
        });
    }
    Ok(sluice_server::auth::Users::new(users))
}

fn socket_addr(key: &str, text: &str) -> PyResult<std::net::SocketAddr> {
    text.parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(text)
                .map_err(|e| e.to_string())
                .and_then(|mut a| a.next().ok_or_else(|| "no address".to_string()))
        })
        .map_err(|e| config_err(key, format!("{text:?} is not HOST:PORT ({e})")))
}

#[pymethods]
impl Server {
    /// Binds `listen` ("HOST:PORT", port 0 for any) and starts serving; binding errors raise here.
    #[new]
    #[pyo3(signature = (engine, listen, *, admin_listen=None, users=Vec::new(), max_connections=10_000, idle_timeout=0.0, io_threads=2, replica_of=None, replication_user=None, replication_password=None, replication_noop_interval=1, tap_ack_interval=1000, tap_ack_window=10_000, tap_grace_period=300.0, tap_backoff=1.0, tap_ttl=1, tap_max_sessions=64, tap_max_unacked_bytes=16_777_216, max_unauthenticated=256, max_unauthenticated_per_ip=64, login_timeout=10.0, policy_timeout=0.05, tls_listen=None, tls_certificate=None, tls_key=None, tls_client_ca=None, tls_admin=true, replication_tls=false, replication_ca=None, replication_certificate=None, replication_key=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: &EmbeddedEngine,
        listen: &str,
        admin_listen: Option<&str>,
        users: Vec<UserSpec>,
        max_connections: usize,
        idle_timeout: f64,
        io_threads: usize,
        replica_of: Option<&str>,
        replication_user: Option<String>,
        replication_password: Option<String>,
        replication_noop_interval: u32,
        tap_ack_interval: u32,
        tap_ack_window: u32,
        tap_grace_period: f64,
        tap_backoff: f64,
        tap_ttl: u8,
        tap_max_sessions: usize,
        tap_max_unacked_bytes: usize,
        max_unauthenticated: usize,
        max_unauthenticated_per_ip: usize,
        login_timeout: f64,
        policy_timeout: f64,
        tls_listen: Option<&str>,
        tls_certificate: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_client_ca: Option<PathBuf>,
        tls_admin: bool,
        replication_tls: bool,
        replication_ca: Option<PathBuf>,
        replication_certificate: Option<PathBuf>,
        replication_key: Option<PathBuf>,
    ) -> PyResult<Self> {
        let tls = match (tls_certificate, tls_key) {
            (Some(certificate), Some(key)) => Some(sluice_server::tls::TlsSettings {
                certificate,
                key,
                client_ca: tls_client_ca,
                admin: tls_admin,
            }),
            (None, None) => {
                if tls_client_ca.is_some() {
                    return Err(config_err(
                        "tls.client_ca",
                        "needs tls.certificate and tls.key (the TLS listener's own certificate)",
                    ));
                }
                None
            }
            (Some(_), None) => return Err(config_err("tls.key", "required with tls.certificate")),
            (None, Some(_)) => return Err(config_err("tls.certificate", "required with tls.key")),
        };
        let tls_listen = tls_listen
            .filter(|a| !a.is_empty())
            .map(|a| socket_addr("tls_listen", a))
            .transpose()?;
        if tls_listen.is_some() && tls.is_none() {
            return Err(config_err(
                "tls_listen",
                "set, but no certificate is configured (tls.certificate, tls.key)",
            ));
        }
        let replication_tls = if replication_tls {
            let ca = replication_ca.ok_or_else(|| {
                config_err(
                    "replication.ca",
                    "required with replication.tls: the CA the active's certificate must chain to",
                )
            })?;
            let identity = match (&replication_certificate, &replication_key) {
                (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
                (None, None) => None,
                (Some(_), None) => {
                    return Err(config_err(
                        "replication.key",
                        "required with replication.certificate",
                    ))
                }
                (None, Some(_)) => {
                    return Err(config_err(
                        "replication.certificate",
                        "required with replication.key",
                    ))
                }
            };
            Some(
                sluice_server::tls::ClientTls::load("replication", &ca, identity)
                    .map_err(|e| ConfigError::new_err(format!("invalid config: {e}")))?,
            )
        } else {
            for (key, v) in [
                ("replication.ca", &replication_ca),
                ("replication.certificate", &replication_certificate),
                ("replication.key", &replication_key),
            ] {
                if v.is_some() {
                    return Err(config_err(key, "set, but replication.tls is false"));
                }
            }
            None
        };
        if tap_ack_interval == 0 {
            return Err(config_err("tap.ack_interval", "must be at least 1"));
        }
        if tap_ack_window == 0 {
            return Err(config_err("tap.ack_window", "must be at least 1"));
        }
        if !(1..=sluice_core::item::MAX_TAP_HOPS).contains(&tap_ttl) {
            return Err(config_err("tap.ttl", "must be 1 to 31 hops"));
        }
        let tap = sluice_server::tap::producer::TapConfig {
            ack_interval: tap_ack_interval,
            ack_window: tap_ack_window,
            grace_period: secs("tap.grace_period", tap_grace_period)?,
            backoff: secs("tap.backoff", tap_backoff)?,
            ttl: tap_ttl,
            max_sessions: tap_max_sessions,
            max_unacked_bytes: tap_max_unacked_bytes,
        };
        if tap_max_sessions == 0 {
            return Err(config_err("tap.max_sessions", "must be at least 1"));
        }
        if tap_max_unacked_bytes < 64 << 10 {
            return Err(config_err(
                "tap.max_unacked_bytes",
                "must be at least 64 KiB",
            ));
        }
        if max_unauthenticated == 0 {
            return Err(config_err("max_unauthenticated", "must be at least 1"));
        }
        if max_unauthenticated_per_ip == 0 {
            return Err(config_err(
                "max_unauthenticated_per_ip",
                "must be at least 1",
            ));
        }
        let login = sluice_server::limits::LoginLimits {
            max_unauthenticated,
            max_unauthenticated_per_ip,
            login_timeout: secs("login_timeout", login_timeout)?,
        };
        if login.login_timeout.is_zero() {
            return Err(config_err("login_timeout", "must be more than 0"));
        }
        let policies = Arc::new(sluice_server::policy::PolicyHost::default());
        policies.set_timeout(secs("policy.timeout", policy_timeout)?);
        if !(1..=10800).contains(&replication_noop_interval) {
            return Err(config_err(
                "replication.noop_interval",
                "must be 1 to 10800 seconds",
            ));
        }
        let replica_of = match replica_of.filter(|a| !a.is_empty()) {
            None => None,
            Some(a) => {
                socket_addr("replication.replica_of", a)?;
                if !engine.engine.config().replica {
                    return Err(config_err(
                        "replication.replica_of",
                        "the engine was not opened as a replica (EngineSettings replica=True)",
                    ));
                }
                Some(sluice_server::replica::ReplicaConfig {
                    active: a.to_string(),
                    username: replication_user.clone(),
                    password: replication_password.clone(),
                    noop_interval: replication_noop_interval,
                    tls: replication_tls.clone(),
                })
            }
        };
        let addr = socket_addr("listen", listen)?;
        let admin_listen = admin_listen
            .filter(|a| !a.is_empty())
            .map(|a| socket_addr("admin_listen", a))
            .transpose()?;
        if max_connections == 0 {
            return Err(config_err("max_connections", "must be at least 1"));
        }
        let max_item = engine
            .engine
            .buckets()
            .iter()
            .map(|b| b.config.max_item_size)
            .max()
            .unwrap_or(20 << 20);
        let config = sluice_server::ServerConfig {
            listen: addr,
            admin_listen,
            max_connections,
            // The largest value plus room for key, extras and framing extras.
            max_body: max_item + 1024,
            idle_timeout: secs("idle_timeout", idle_timeout)?,
            worker_threads: io_threads.max(1),
            users: users_of(users)?,
            replica_of,
            replication_login: (replication_user, replication_password),
            replication_noop_interval,
            replication_tls,
            tap,
            login,
            tls_listen,
            tls,
        };
        let e = engine.engine.clone();
        let host = policies.clone();
        let server = py
            .detach(|| sluice_server::Server::start_with(e, config, host))
            .map_err(|err| {
                if err.kind() == std::io::ErrorKind::InvalidInput {
                    ConfigError::new_err(format!("invalid config: {err}"))
                } else {
                    SluiceError::new_err(format!("cannot listen on {listen}: {err}"))
                }
            })?;
        let address = server.local_addr().to_string();
        let admin_address = server.admin_addr().map(|a| a.to_string());
        let tls_address = server.tls_addr().map(|a| a.to_string());
        Ok(Server {
            inner: parking_lot::Mutex::new(Some(server)),
            address,
            admin_address,
            tls_address,
            policies,
        })
    }

    /// Installs (True) or removes (False) the plugin for a policy kind ("ack", "retransmit",
    /// "slow_consumer", "filter"). Without one the native default decides, with no Python call.
    fn policy_install(&self, kind: &str, installed: bool) -> PyResult<()> {
        self.policies
            .set_installed(policy::kind_of(kind)?, installed);
        Ok(())
    }

    /// How long the server waits for a plugin's answer before using the default.
    fn policy_set_timeout(&self, seconds: f64) -> PyResult<()> {
        self.policies.set_timeout(secs("policy.timeout", seconds)?);
        Ok(())
    }

    /// The next question for a plugin, waiting up to `wait` seconds (GIL released); None if
    /// none came.
    #[pyo3(signature = (kind, wait=0.5))]
    fn policy_next(
        &self,
        py: Python<'_>,
        kind: &str,
        wait: f64,
    ) -> PyResult<Option<policy::PolicyCall>> {
        Ok(policy::next_call(
            py,
            &self.policies,
            policy::kind_of(kind)?,
            wait,
        ))
    }

    /// "HOST:PORT" actually bound.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// Replaces the users and permissions (SIGHUP); connections see them on their next request.
    fn set_users(&self, users: Vec<UserSpec>) -> PyResult<()> {
        let users = users_of(users)?;
        if let Some(s) = self.inner.lock().as_ref() {
            s.set_users(users);
        }
        Ok(())
    }

    /// "HOST:PORT" of the TLS KV listener, if it runs.
    #[getter]
    fn tls_address(&self) -> Option<&str> {
        self.tls_address.as_deref()
    }

    /// Reads the TLS certificate and key again (SIGHUP): connections accepted afterwards get
    /// them. Returns False when no TLS is configured; raises ConfigError (the old certificate
    /// stays in use) when the files cannot be used.
    fn reload_tls(&self, py: Python<'_>) -> PyResult<bool> {
        let guard = self.inner.lock();
        let Some(s) = guard.as_ref() else {
            return Err(ClosedError::new_err("the server is stopped"));
        };
        py.detach(|| s.reload_tls())
            .map_err(|e| ConfigError::new_err(format!("invalid config: {e}")))
    }

    /// "HOST:PORT" of the admin endpoint (/metrics, /status), if it runs.
    #[getter]
    fn admin_address(&self) -> Option<&str> {
        self.admin_address.as_deref()
    }

    /// Failover: stops following the active and makes every replica vbucket active. Returns
    /// {bucket: [vbuckets promoted]}.
    fn promote(&self, py: Python<'_>) -> PyResult<std::collections::BTreeMap<String, Vec<u16>>> {
        let followers = match self.inner.lock().as_ref() {
            Some(s) => s.followers(),
            None => return Err(ClosedError::new_err("the server is stopped")),
        };
        let done = py.detach(|| followers.promote()).map_err(to_py)?;
        Ok(done.into_iter().collect())
    }

    /// Stops accepting, lets connections finish what they hold (up to `grace` seconds), stops.
    #[pyo3(signature = (grace=5.0))]
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = secs("grace", grace)?;
        let server = self.inner.lock().take();
        if let Some(mut s) = server {
            py.detach(move || s.shutdown(grace));
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut s) = self.inner.lock().take() {
            // SAFETY: a read-only query of the interpreter's state.
            if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
                Python::attach(|py| {
                    py.detach(move || s.shutdown(std::time::Duration::from_secs(5)))
                });
            } else {
                s.shutdown(std::time::Duration::from_secs(5));
            }
        }
    }
}

/// Prints the records of a WAL segment or snapshot as JSON lines to the file descriptor `fd`.
/// Returns how many records were printed.
#[pyfunction]
fn wal_dump(py: Python<'_>, path: PathBuf, fd: i32) -> PyResult<u64> {
    use std::os::fd::FromRawFd;
    py.detach(|| {
        // SAFETY: dup gives us our own descriptor to own and close.
        let own = unsafe { libc::dup(fd) };
        if own < 0 {
            return Err(Error::Io(format!("bad file descriptor {fd}")));
        }
        let file = unsafe { std::fs::File::from_raw_fd(own) };
        let mut out = std::io::BufWriter::new(file);
        let n = sluice_core::dump::dump(&path, &mut out)?;
        match std::io::Write::flush(&mut out) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                Err(Error::io("writing output", e))
            }
            _ => Ok(n),
        }
    })
    .map_err(to_py)
}

/// Reads a TAP stream natively (acknowledging what asks) until `count` changes arrived (0: until
/// the server closes it) or `timeout` passes; for benchmarks. Returns counts and seconds.
#[pyfunction]
#[pyo3(signature = (target, *, name=None, flags=0, backfill_since=None, vbuckets=None, count=0, timeout=60.0))]
#[allow(clippy::too_many_arguments)]
fn tap_drain<'py>(
    py: Python<'py>,
    target: &str,
    name: Option<Vec<u8>>,
    flags: u32,
    backfill_since: Option<u64>,
    vbuckets: Option<Vec<u16>>,
    count: u64,
    timeout: f64,
) -> PyResult<Bound<'py, PyDict>> {
    use sluice_proto::tap::{connect_flag, TapConnect};
    let mut flags = flags;
    if backfill_since.is_some() {
        flags |= connect_flag::BACKFILL;
    }
    if vbuckets.is_some() {
        flags |= connect_flag::LIST_VBUCKETS;
    }
    let connect = TapConnect {
        name: name.unwrap_or_default(),
        flags,
        backfill_since,
        vbuckets,
        checkpoints: Vec::new(),
    };
    let addr = socket_addr("target", target)?;
    let timeout = secs("timeout", timeout)?;
    let r = py
        .detach(|| sluice_tools::tap_reader::drain(addr, &connect, count, timeout))
        .map_err(|e| SluiceError::new_err(format!("TAP stream from {target}: {e}")))?;
    let d = PyDict::new(py);
    d.set_item("messages", r.messages)?;
    d.set_item("mutations", r.mutations)?;
    d.set_item("deletions", r.deletions)?;
    d.set_item("acks_sent", r.acks_sent)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("closed", r.closed)?;
    Ok(d)
}

/// Drives a memcached binary protocol server (sluice or memcached) and reports throughput,
/// outcome counts and latency percentiles.
#[pyfunction]
#[pyo3(name = "bench", signature = (target, *, connections=16, pipeline=32, duration=10.0, count=0, keys=100_000, key_size=16, value_size=100, get_ratio=0.9, prefill=true, threads=2, user=None, password=None, cacert=None))]
#[allow(clippy::too_many_arguments)]
fn run_bench<'py>(
    py: Python<'py>,
    target: &str,
    connections: usize,
    pipeline: usize,
    duration: f64,
    count: u64,
    keys: u64,
    key_size: usize,
    value_size: usize,
    get_ratio: f64,
    prefill: bool,
    threads: usize,
    user: Option<String>,
    password: Option<String>,
    cacert: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let tls = cacert
        .map(|ca| sluice_server::tls::ClientTls::trusting("--cacert", &ca))
        .transpose()
        .map_err(pyo3::exceptions::PyValueError::new_err)?;
    // Values up to sluice's own item size limit, so every request can be framed.
    if connections == 0
        || pipeline == 0
        || keys == 0
        || !(1..=250).contains(&key_size)
        || value_size > 64 << 20
        || !(0.0..=1.0).contains(&get_ratio)
    {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "connections, pipeline and keys must be positive, key_size in 1..=250, value_size at most 64 MiB, \
             get_ratio in 0..=1",
        ));
    }
    let cfg = sluice_tools::bench::BenchConfig {
        target: socket_addr("target", target)?,
        connections,
        pipeline,
        duration: secs("duration", duration)?,
        count,
        keys,
        key_size,
        value_size,
        get_ratio,
        prefill,
        threads,
        user: user.zip(password),
        tls,
    };
    let r = py
        .detach(|| sluice_tools::bench::run(cfg))
        .map_err(|e| SluiceError::new_err(format!("bench against {target}: {e}")))?;
    let d = PyDict::new(py);
    d.set_item("ops", r.ops)?;
    d.set_item("gets", r.gets)?;
    d.set_item("sets", r.sets)?;
    d.set_item("misses", r.misses)?;
    d.set_item("errors", r.errors)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("ops_per_s", r.ops_per_s)?;
    let lat = PyDict::new(py);
    for (p, us) in r.latency_us {
        lat.set_item(
            if p >= 100.0 {
                "max".to_string()
            } else {
                format!("p{p}")
            },
            us,
        )?;
    }
    d.set_item("latency_us", lat)?;
    Ok(d)
}

/// The vbucket of a key for a bucket of `num_vbuckets` (Couchbase's mapping).
#[pyfunction]
fn vbucket_of(key: &[u8], num_vbuckets: u16) -> PyResult<u16> {
    if num_vbuckets == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "num_vbuckets must be positive",
        ));
    }
    Ok(sluice_core::hash::vbucket_of(key, num_vbuckets))
}

#[global_allocator]
static GLOBAL: sluice_core::alloc::Allocator = sluice_core::alloc::ALLOCATOR;

// Declares that the module relies on the GIL, as every PyO3 module did before 0.28 made
// free-threaded use the default: a free-threaded interpreter keeps its GIL on to import it.
#[pymodule(gil_used = true)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    sluice_core::alloc::tune();
    let _ = pyo3_log::try_init();
    let py = m.py();
    m.add_class::<EngineSettings>()?;
    m.add_class::<BucketSettings>()?;
    m.add_class::<EmbeddedEngine>()?;
    m.add_class::<Server>()?;
    m.add_class::<MutationInfo>()?;
    m.add_class::<ItemView>()?;
    m.add_class::<dcp::DcpConsumer>()?;
    m.add_class::<dcp::RawBatch>()?;
    m.add_class::<policy::PolicyCall>()?;
    m.add_function(wrap_pyfunction!(dcp::vbucket_positions, m)?)?;
    m.add_function(wrap_pyfunction!(wal_dump, m)?)?;
    m.add_function(wrap_pyfunction!(run_bench, m)?)?;
    m.add_function(wrap_pyfunction!(tap_drain, m)?)?;
    m.add_function(wrap_pyfunction!(vbucket_of, m)?)?;
    for (name, ty) in [
        ("SluiceError", py.get_type::<SluiceError>()),
        ("InvalidKeyError", py.get_type::<InvalidKeyError>()),
        ("TooBigError", py.get_type::<TooBigError>()),
        ("NotFoundError", py.get_type::<NotFoundError>()),
        ("ExistsError", py.get_type::<ExistsError>()),
        ("NotStoredError", py.get_type::<NotStoredError>()),
        ("NotNumericError", py.get_type::<NotNumericError>()),
        ("NotMyVbucketError", py.get_type::<NotMyVbucketError>()),
        ("TempFailError", py.get_type::<TempFailError>()),
        ("WalFailedError", py.get_type::<WalFailedError>()),
        (
            "DurabilityImpossibleError",
            py.get_type::<DurabilityImpossibleError>(),
        ),
        (
            "SyncWriteAmbiguousError",
            py.get_type::<SyncWriteAmbiguousError>(),
        ),
        ("NoSuchBucketError", py.get_type::<NoSuchBucketError>()),
        ("ConfigError", py.get_type::<ConfigError>()),
        ("CorruptionError", py.get_type::<CorruptionError>()),
        ("ClosedError", py.get_type::<ClosedError>()),
    ] {
        m.add(name, ty)?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
