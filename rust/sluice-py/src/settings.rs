//! The configuration objects the engine is opened with (`BucketSettings`, `EngineSettings`),
//! and the parsers of values the settings of every object here share (durations, durability
//! levels, socket addresses), each naming the configuration key in its error.

use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use pyo3::prelude::*;

use sluice_core::checkpoint::CheckpointConfig;
use sluice_core::config::Eviction;
use sluice_core::wal::WalMode;
use sluice_core::{BucketConfig, Durability, EngineConfig};

use crate::errors::{config_err, to_py};

/// sluice-core's defaults, the one definition of each: the keyword defaults of the settings
/// objects below and `DEFAULTS`, which config.py reads, both come from here.
pub(crate) static BUCKET_DEFAULTS: LazyLock<BucketConfig> =
    LazyLock::new(|| BucketConfig::named("default"));
pub(crate) static ENGINE_DEFAULTS: LazyLock<EngineConfig> = LazyLock::new(EngineConfig::default);

pub(crate) fn parse_durability(key: &str, s: Option<&str>) -> PyResult<Option<Durability>> {
    s.map(|s| {
        Durability::parse(s)
            .ok_or_else(|| config_err(key, format!("unknown durability level {s:?}")))
    })
    .transpose()
}

pub(crate) fn secs(key: &str, v: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| config_err(key, format!("{v} is not a non-negative number of seconds")))
}

/// One bucket's settings.
#[pyclass(module = "sluice._native", frozen, from_py_object)]
#[derive(Clone)]
pub(crate) struct BucketSettings {
    pub(crate) inner: BucketConfig,
}

#[pymethods]
impl BucketSettings {
    #[new]
    #[pyo3(signature = (name, *, num_vbuckets=BUCKET_DEFAULTS.num_vbuckets, memory_quota=BUCKET_DEFAULTS.memory_quota, high_watermark=BUCKET_DEFAULTS.high_watermark, max_item_size=BUCKET_DEFAULTS.max_item_size, checkpoint_memory_ratio=BUCKET_DEFAULTS.checkpoint_memory_ratio, durability=BUCKET_DEFAULTS.durability.as_str(), replicas=BUCKET_DEFAULTS.replicas, durability_timeout=BUCKET_DEFAULTS.durability_timeout.as_secs_f64(), eviction=BUCKET_DEFAULTS.eviction.as_str()))]
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
        eviction: &str,
    ) -> PyResult<Self> {
        let durability =
            parse_durability("durability", Some(durability))?.expect("Some in, Some out");
        let eviction = Eviction::parse(eviction).ok_or_else(|| {
            config_err(
                "eviction",
                format!("{eviction:?} is not one of {}", Eviction::NAMES.join(", ")),
            )
        })?;
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
                eviction,
                ordered_keys: false,
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
pub(crate) struct EngineSettings {
    pub(crate) inner: EngineConfig,
}

#[pymethods]
impl EngineSettings {
    #[new]
    #[pyo3(signature = (data_dir, *, wal_mode=ENGINE_DEFAULTS.wal_mode.as_str(), wal_segment_size=ENGINE_DEFAULTS.wal_segment_size, snapshot_count=ENGINE_DEFAULTS.snapshot_count, snapshot_interval=ENGINE_DEFAULTS.snapshot_interval.as_secs_f64(), checkpoint_max_items=ENGINE_DEFAULTS.checkpoint.max_items, checkpoint_period=ENGINE_DEFAULTS.checkpoint.period.as_secs_f64(), tombstone_purge_age=ENGINE_DEFAULTS.tombstone_purge_age.as_secs_f64(), expiry_pager_interval=ENGINE_DEFAULTS.expiry_pager_interval.as_secs_f64(), force_recovery=ENGINE_DEFAULTS.force_recovery, replica=ENGINE_DEFAULTS.replica, buckets=None))]
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
            None => ENGINE_DEFAULTS.buckets.clone(),
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

pub(crate) fn socket_addr(key: &str, text: &str) -> PyResult<std::net::SocketAddr> {
    text.parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(text)
                .map_err(|e| e.to_string())
                .and_then(|mut a| a.next().ok_or_else(|| "no address".to_string()))
        })
        .map_err(|e| config_err(key, format!("{text:?} is not HOST:PORT ({e})")))
}
