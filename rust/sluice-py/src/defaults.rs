//! `DEFAULTS`: the default of every configuration key that has a Rust counterpart, by the key's
//! dotted name in config.py (bucket keys as `buckets.KEY`), read from the Rust `Default`s the
//! settings objects start from. config.py takes its defaults from here, so `sluice config
//! reference`, the TOML validation and the native objects cannot disagree. Durations are
//! seconds (float), sizes bytes, levels and modes their configuration names.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyDictMethods, PyMappingProxy};

use pyo3::types::PyList;
use sluice_server::server::FRONTS;
use sluice_server::settings::Settings;

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

    let server = Settings::default();
    d.set_item("max_connections", server.max_connections)?;
    d.set_item("idle_timeout", server.idle_timeout)?;
    d.set_item("io_threads", server.io_threads)?;
    d.set_item("max_unauthenticated", server.max_unauthenticated)?;
    d.set_item(
        "max_unauthenticated_per_ip",
        server.max_unauthenticated_per_ip,
    )?;
    d.set_item("login_timeout", server.login_timeout)?;
    d.set_item("tls.admin", server.tls_admin)?;
    d.set_item("require_tls", server.require_tls)?;
    d.set_item(
        "replication.noop_interval",
        server.replication_noop_interval,
    )?;
    d.set_item("replication.tls", server.replication_tls)?;
    d.set_item("tap.ack_interval", server.tap_ack_interval)?;
    d.set_item("tap.ack_window", server.tap_ack_window)?;
    d.set_item("tap.grace_period", server.tap_grace_period)?;
    d.set_item("tap.backoff", server.tap_backoff)?;
    d.set_item("tap.ttl", server.tap_ttl)?;
    d.set_item("tap.max_sessions", server.tap_max_sessions)?;
    d.set_item("tap.max_unacked_bytes", server.tap_max_unacked_bytes)?;
    d.set_item("policy.timeout", server.policy_timeout)?;
    for r in FRONTS {
        let f = &r.declaration;
        d.set_item(f.listen_key, f.default_listen)?;
        d.set_item(f.tls_listen_key, default_tls_listen(f))?;
    }

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

/// A TLS listener key's default: "auto" (the front's TLS address when a certificate is set)
/// where the front declares such an address, else off.
fn default_tls_listen(f: &sluice_server::front::Declaration) -> &'static str {
    if f.default_tls_listen.is_empty() {
        ""
    } else {
        "auto"
    }
}

/// `FRONTS`: what each registered front declares, in the server's order: config.py makes its
/// listener keys and the CLI its `--listen` flags from it.
pub(crate) fn fronts(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let list = PyList::empty(py);
    for r in FRONTS {
        let f = &r.declaration;
        let d = PyDict::new(py);
        d.set_item("name", f.name)?;
        d.set_item("title", f.title)?;
        d.set_item("listen_key", f.listen_key)?;
        d.set_item("default_listen", f.default_listen)?;
        d.set_item("tls_listen_key", f.tls_listen_key)?;
        d.set_item("default_tls_listen", f.default_tls_listen)?;
        d.set_item("doc", f.doc)?;
        d.set_item("login", f.login)?;
        d.set_item("kv_port", f.kv_port)?;
        list.append(d)?;
    }
    Ok(list)
}
