//! `EmbeddedEngine`: an open data directory, the storage engine running in this process. Every
//! call that can block (disk, durability waits) releases the GIL.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use sluice_core::bucket::Bucket;
use sluice_core::vbucket::VbState;
use sluice_core::wal::writer::Failpoint;
use sluice_core::{Engine, Requirement, StoreMode, StoreRequest};

use crate::errors::to_py;
use crate::items::{mutation, ItemView, MutationInfo};
use crate::settings::{parse_durability, EngineSettings};

/// An open data directory: the storage engine embedded in this process.
#[pyclass(module = "sluice._native", frozen)]
pub(crate) struct EmbeddedEngine {
    pub(crate) engine: Arc<Engine>,
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
        let engine = crate::logging::detach_command(py, || Engine::open(cfg)).map_err(to_py)?;
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
            preserve_expiry: false,
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

    /// Makes WAL writes fail as a full disk ("enospc") or a broken device ("eio") would, the
    /// next sync of write mode fail ("sync_eio"), or nothing fail ("off").
    fn set_wal_failpoint(&self, name: &str) -> PyResult<()> {
        let fp = match name {
            "off" => Failpoint::Off,
            "enospc" => Failpoint::NoSpace,
            "eio" => Failpoint::IoError,
            "sync_eio" => Failpoint::SyncError,
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
            ("evictions", &s.evictions),
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
    /// Creates a topic of `partitions` partitions with TANK's or Kafka's `settings` lines;
    /// ExistsError when one has the name, ValueError (InvalidArgument) for bad settings.
    fn create_topic(
        &self,
        py: Python<'_>,
        name: &str,
        partitions: u16,
        settings: &str,
    ) -> PyResult<()> {
        py.detach(|| self.engine.create_topic(name, partitions, settings))
            .map(|_| ())
            .map_err(to_py)
    }

    /// The topics: (name, partitions, settings text), in the order they were created.
    fn topics(&self) -> Vec<(String, u16, String)> {
        self.engine
            .topics()
            .iter()
            .map(|t| (t.name.clone(), t.num_partitions(), t.config_text.clone()))
            .collect()
    }

    /// Each partition's high-water mark (its last sequence number, 0 while it holds none);
    /// NotFoundError for an unknown topic.
    fn topic_high_water_marks(&self, py: Python<'_>, name: &str) -> PyResult<Vec<u64>> {
        let t = self
            .engine
            .topic(name)
            .ok_or_else(|| to_py(sluice_core::Error::NotFound))?;
        // Partition locks are waited for without the GIL (their holders may log).
        Ok(py.detach(|| {
            (0..t.num_partitions())
                .map(|p| t.high_water_mark(p))
                .collect()
        }))
    }

    /// Each partition's branch of history: the uuid of its newest entry (a copy takes its
    /// leader's when it follows it, after being cut back to where they part); NotFoundError
    /// for an unknown topic.
    fn topic_branches(&self, py: Python<'_>, name: &str) -> PyResult<Vec<u64>> {
        let t = self
            .engine
            .topic(name)
            .ok_or_else(|| to_py(sluice_core::Error::NotFound))?;
        Ok(py.detach(|| {
            (0..t.num_partitions())
                .map(|p| t.history(p)[0].uuid)
                .collect()
        }))
    }

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
        crate::logging::detach_command(py, || self.engine.close())
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
    /// close waits for the engine's threads, and none of them should wait on the thread that
    /// holds the GIL.
    fn drop(&mut self) {
        // SAFETY: a read-only query of the interpreter's state.
        if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
            Python::attach(|py| py.detach(|| self.engine.close()));
        } else {
            self.engine.close();
        }
    }
}
