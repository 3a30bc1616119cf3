//! Prometheus text exposition: the helpers every component writes its metrics with, and the
//! engine's metrics (the engine itself knows nothing of Prometheus). Each component of the
//! server writes its own (`ServerStats`, `DcpStats`, `TapStats`, `PolicyHost`, `PreLogin`,
//! `replica::metrics`); `admin` only puts them together.

use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

use sluice_core::wal::writer::SYNC_BUCKETS_US;
use sluice_core::Engine;

/// A metric family's HELP and TYPE lines.
pub fn metric(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A label's value as the exposition format quotes it: backslash, double quote and newline
/// escaped (topic names are the client's to choose).
pub fn label_value(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return v.into();
    }
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
        .into()
}

/// A counter or gauge with one value.
pub fn single(o: &mut String, name: &str, kind: &str, help: &str, v: u64) {
    metric(o, name, kind, help);
    let _ = writeln!(o, "{name} {v}");
}

/// The Prometheus lines of the engine: operations, memory, items and seqnos per bucket and
/// vbucket, the WAL.
pub fn engine(e: &Engine, o: &mut String) {
    let buckets = e.buckets();
    metric(
        o,
        "sluice_ops_total",
        "counter",
        "Operations by bucket and type.",
    );
    for b in &buckets {
        let st = &b.stats;
        for (op, v) in [
            ("set", &st.sets),
            ("get", &st.gets),
            ("get_miss", &st.get_misses),
            ("delete", &st.deletes),
            ("tmp_failure", &st.tmp_failures),
            ("expired_on_access", &st.expired_on_access),
            ("expired_by_pager", &st.expired_by_pager),
            ("tombstone_purged", &st.tombstones_purged),
            ("cursor_dropped", &st.cursors_dropped),
        ] {
            let _ = writeln!(
                o,
                "sluice_ops_total{{bucket=\"{}\",op=\"{op}\"}} {}",
                b.name(),
                v.load(Relaxed)
            );
        }
    }
    metric(
        o,
        "sluice_evictions_total",
        "counter",
        "Items evicted to make room in buckets with eviction = \"lru\".",
    );
    for b in &buckets {
        let _ = writeln!(
            o,
            "sluice_evictions_total{{bucket=\"{}\"}} {}",
            b.name(),
            b.stats.evictions.load(Relaxed)
        );
    }
    metric(
        o,
        "sluice_durable_writes_waiting",
        "gauge",
        "Durable writes waiting now for their level (the WAL's sync, replicas' acks).",
    );
    for b in &buckets {
        let _ = writeln!(
            o,
            "sluice_durable_writes_waiting{{bucket=\"{}\"}} {}",
            b.name(),
            b.stats.durable_waiting.load(Relaxed)
        );
    }
    metric(
        o,
        "sluice_memory_bytes",
        "gauge",
        "Bytes held by items and checkpoints, and the quota.",
    );
    for b in &buckets {
        let n = b.name();
        let _ = writeln!(
            o,
            "sluice_memory_bytes{{bucket=\"{n}\",kind=\"used\"}} {}",
            b.mem_used()
        );
        let _ = writeln!(
            o,
            "sluice_memory_bytes{{bucket=\"{n}\",kind=\"checkpoints\"}} {}",
            b.checkpoint_mem()
        );
        let _ = writeln!(
            o,
            "sluice_memory_bytes{{bucket=\"{n}\",kind=\"quota\"}} {}",
            b.config.memory_quota
        );
    }
    let wal = e.wal();
    metric(
        o,
        "sluice_wal_lsn",
        "gauge",
        "WAL positions: last handed out, written, synced.",
    );
    let _ = writeln!(o, "sluice_wal_lsn{{kind=\"last\"}} {}", wal.last_lsn());
    let _ = writeln!(
        o,
        "sluice_wal_lsn{{kind=\"written\"}} {}",
        wal.written_lsn()
    );
    let _ = writeln!(o, "sluice_wal_lsn{{kind=\"synced\"}} {}", wal.synced_lsn());
    metric(
        o,
        "sluice_wal_failing",
        "gauge",
        "1 while the WAL cannot write and writes are refused.",
    );
    let _ = writeln!(o, "sluice_wal_failing {}", wal.is_failing() as u8);
    metric(
        o,
        "sluice_wal_sync_seconds",
        "histogram",
        "Time of each WAL fdatasync.",
    );
    let (counts, sum_us) = wal.sync_latency().snapshot();
    for (i, c) in counts.iter().enumerate() {
        let le = SYNC_BUCKETS_US
            .get(i)
            .map(|us| format!("{}", *us as f64 / 1e6))
            .unwrap_or_else(|| "+Inf".into());
        let _ = writeln!(o, "sluice_wal_sync_seconds_bucket{{le=\"{le}\"}} {c}");
    }
    let _ = writeln!(o, "sluice_wal_sync_seconds_sum {}", sum_us as f64 / 1e6);
    let _ = writeln!(
        o,
        "sluice_wal_sync_seconds_count {}",
        counts.last().copied().unwrap_or(0)
    );
    metric(
        o,
        "sluice_items",
        "gauge",
        "Live items and tombstones per bucket.",
    );
    metric(
        o,
        "sluice_vbucket_seqno",
        "gauge",
        "Per vbucket: high seqno and persisted seqno.",
    );
    for b in &buckets {
        let (mut items, mut tombstones) = (0, 0);
        let mut rows = String::new();
        for v in 0..b.num_vbuckets() {
            let vb = b.lock_vbucket(v).expect("in range");
            items += vb.store.live_items();
            tombstones += vb.store.tombstones();
            let (n, high, persisted) = (b.name(), vb.high_seqno, vb.persisted_seqno);
            let _ = writeln!(
                rows,
                "sluice_vbucket_seqno{{bucket=\"{n}\",vbucket=\"{v}\",kind=\"high\"}} {high}"
            );
            let _ = writeln!(rows, "sluice_vbucket_seqno{{bucket=\"{n}\",vbucket=\"{v}\",kind=\"persisted\"}} {persisted}");
        }
        let _ = writeln!(
            o,
            "sluice_items{{bucket=\"{}\",kind=\"live\"}} {items}",
            b.name()
        );
        let _ = writeln!(
            o,
            "sluice_items{{bucket=\"{}\",kind=\"tombstone\"}} {tombstones}",
            b.name()
        );
        o.push_str(&rows);
    }
}
