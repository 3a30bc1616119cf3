//! Replication's Prometheus lines, as the replica and as the active see it.

use super::*;

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
    metric(o, "sluice_replica_lag_ms", "gauge", "Per replica vbucket: milliseconds from the active's write to its apply here, for the newest change of the last batch, while seqnos are missing (0 once caught up).");
    for r in reps.iter() {
        for (vb, l) in r.stats.vbuckets.lock().iter() {
            let b = &r.bucket;
            let _ = writeln!(
                o,
                "sluice_replica_lag_seqnos{{bucket=\"{b}\",vbucket=\"{vb}\"}} {}",
                l.behind()
            );
            let _ = writeln!(
                o,
                "sluice_replica_lag_ms{{bucket=\"{b}\",vbucket=\"{vb}\"}} {:.3}",
                l.behind_ms()
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
