//! `DEFAULTS`: the default of every configuration key that has a Rust counterpart, by the key's
//! dotted name in config.py (bucket keys as `buckets.KEY`), read from the Rust `Default`s the
//! settings objects start from. config.py takes its defaults from here, so `sluice config
//! reference`, the TOML validation and the native objects cannot disagree. Durations are
//! seconds (float), sizes bytes, levels and modes their configuration names.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyDictMethods, PyMappingProxy};

use crate::server::{
    IDLE_TIMEOUT, IO_THREADS, LOGIN_DEFAULTS, MAX_CONNECTIONS, POLICY_TIMEOUT,
    REPLICATION_NOOP_INTERVAL, REPLICATION_TLS, TAP_DEFAULTS, TLS_ADMIN,
};
use crate::settings::{BUCKET_DEFAULTS, ENGINE_DEFAULTS};

/// A read-only mapping {key: default}.
pub(crate) fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyMappingProxy>> {
    let d = PyDict::new(py);
    let engine = &*ENGINE_DEFAULTS;
    let data_dir = engine
        .data_dir
        .to_str()
        .expect("the default data_dir is UTF-8");
    d.set_item("data_dir", data_dir)?;
    d.set_item("force_recovery", engine.force_recovery)?;
    d.set_item(
        "expiry_pager_interval",
        engine.expiry_pager_interval.as_secs_f64(),
    )?;
    d.set_item(
        "tombstone_purge_age",
        engine.tombstone_purge_age.as_secs_f64(),
    )?;
    d.set_item("wal.mode", engine.wal_mode.as_str())?;
    d.set_item("wal.segment_size", engine.wal_segment_size)?;
    d.set_item("snapshot.count", engine.snapshot_count)?;
    d.set_item("snapshot.interval", engine.snapshot_interval.as_secs_f64())?;
    d.set_item("checkpoint.max_items", engine.checkpoint.max_items)?;
    d.set_item("checkpoint.period", engine.checkpoint.period.as_secs_f64())?;

    d.set_item("max_connections", MAX_CONNECTIONS)?;
    d.set_item("idle_timeout", IDLE_TIMEOUT.as_secs_f64())?;
    d.set_item("io_threads", IO_THREADS)?;
    let login = &*LOGIN_DEFAULTS;
    d.set_item("max_unauthenticated", login.max_unauthenticated)?;
    d.set_item(
        "max_unauthenticated_per_ip",
        login.max_unauthenticated_per_ip,
    )?;
    d.set_item("login_timeout", login.login_timeout.as_secs_f64())?;
    d.set_item("tls.admin", TLS_ADMIN)?;
    d.set_item("replication.noop_interval", REPLICATION_NOOP_INTERVAL)?;
    d.set_item("replication.tls", REPLICATION_TLS)?;
    let tap = &*TAP_DEFAULTS;
    d.set_item("tap.ack_interval", tap.ack_interval)?;
    d.set_item("tap.ack_window", tap.ack_window)?;
    d.set_item("tap.grace_period", tap.grace_period.as_secs_f64())?;
    d.set_item("tap.backoff", tap.backoff.as_secs_f64())?;
    d.set_item("tap.ttl", tap.ttl)?;
    d.set_item("tap.max_sessions", tap.max_sessions)?;
    d.set_item("tap.max_unacked_bytes", tap.max_unacked_bytes)?;
    d.set_item("policy.timeout", POLICY_TIMEOUT.as_secs_f64())?;

    let bucket = &*BUCKET_DEFAULTS;
    d.set_item("buckets.num_vbuckets", bucket.num_vbuckets)?;
    d.set_item("buckets.memory_quota", bucket.memory_quota)?;
    d.set_item("buckets.high_watermark", bucket.high_watermark)?;
    d.set_item("buckets.max_item_size", bucket.max_item_size)?;
    d.set_item(
        "buckets.checkpoint_memory_ratio",
        bucket.checkpoint_memory_ratio,
    )?;
    d.set_item("buckets.durability", bucket.durability.as_str())?;
    d.set_item("buckets.replicas", bucket.replicas)?;
    d.set_item(
        "buckets.durability_timeout",
        bucket.durability_timeout.as_secs_f64(),
    )?;
    d.set_item("buckets.eviction", bucket.eviction.as_str())?;
    Ok(PyMappingProxy::new(py, d.as_mapping()))
}
