//! The admin endpoint: `GET /metrics` (Prometheus text format) and `GET /status` (JSON, what
//! `sluice status` prints as a table). A small HTTP/1.1 responder: one GET per connection, the
//! request head bounded to 8 KiB and 5 seconds, then `Connection: close`.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::server::Shared;
use sluice_core::wal::writer::SYNC_BUCKETS_US;

const MAX_HEAD: usize = 8 << 10;

pub async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => {
                    let sh = shared.clone();
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(5), handle(socket, sh)).await;
                    });
                }
                Err(e) => {
                    log::warn!("admin accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

async fn handle(mut socket: TcpStream, shared: Arc<Shared>) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = socket.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_HEAD {
            return respond(&mut socket, 431, "text/plain", b"request head too large\n").await;
        }
    }
    let line = String::from_utf8_lossy(&head[..head.iter().position(|&b| b == b'\r').unwrap_or(0)])
        .into_owned();
    let mut parts = line.split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    if method == "POST" && path == "/promote" {
        let sh = shared.clone();
        let r = tokio::task::spawn_blocking(move || sh.promote()).await;
        return match r {
            Ok(Ok(done)) => {
                let body = serde_json::json!({"promoted": done.iter().map(|(b, v)| serde_json::json!({"bucket": b, "vbuckets": v})).collect::<Vec<_>>()});
                respond(
                    &mut socket,
                    200,
                    "application/json",
                    body.to_string().as_bytes(),
                )
                .await
            }
            Ok(Err(e)) => {
                respond(&mut socket, 500, "text/plain", format!("{e}\n").as_bytes()).await
            }
            Err(e) => respond(&mut socket, 500, "text/plain", format!("{e}\n").as_bytes()).await,
        };
    }
    if method == "POST" && path == "/takeover" {
        let query = query.to_string();
        let sh = shared.clone();
        let r = tokio::task::spawn_blocking(move || takeover(&sh, &query)).await;
        return match r {
            Ok(Ok(body)) => {
                respond(
                    &mut socket,
                    200,
                    "application/json",
                    body.to_string().as_bytes(),
                )
                .await
            }
            Ok(Err(e)) => {
                respond(&mut socket, 409, "text/plain", format!("{e}\n").as_bytes()).await
            }
            Err(e) => respond(&mut socket, 500, "text/plain", format!("{e}\n").as_bytes()).await,
        };
    }
    if method != "GET" {
        return respond(
            &mut socket,
            405,
            "text/plain",
            b"GET /metrics, GET /status, POST /promote, POST /takeover\n",
        )
        .await;
    }
    match path {
        "/metrics" => {
            let body = tokio::task::block_in_place(|| metrics(&shared));
            respond(
                &mut socket,
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                body.as_bytes(),
            )
            .await
        }
        "/status" => {
            let body = tokio::task::block_in_place(|| status(&shared)).to_string();
            respond(&mut socket, 200, "application/json", body.as_bytes()).await
        }
        _ => respond(&mut socket, 404, "text/plain", b"try /metrics or /status\n").await,
    }
}

async fn respond(
    socket: &mut TcpStream,
    code: u16,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        500 => "Internal Server Error",
        _ => "Request Header Fields Too Large",
    };
    let head = format!("HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body).await?;
    socket.shutdown().await
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A counter or gauge with one value.
fn single(o: &mut String, name: &str, kind: &str, help: &str, v: u64) {
    metric(o, name, kind, help);
    let _ = writeln!(o, "{name} {v}");
}

fn tap_and_policy_metrics(shared: &Shared, o: &mut String) {
    let t = &shared.tap;
    single(
        o,
        "sluice_tap_connections",
        "gauge",
        "TAP producer connections open now.",
        t.connections.load(Relaxed),
    );
    single(
        o,
        "sluice_tap_sessions_parked",
        "gauge",
        "Named TAP sessions kept for a reconnect.",
        shared.tap_sessions.parked() as u64,
    );
    for (name, help, v) in [
        (
            "sluice_tap_messages_total",
            "TAP messages sent (re-sent ones included).",
            &t.messages,
        ),
        ("sluice_tap_acks_total", "TAP ACKs received.", &t.acks),
        (
            "sluice_tap_resent_total",
            "TAP messages sent again (reconnect or temporary failure).",
            &t.resent,
        ),
        (
            "sluice_tap_temp_failures_total",
            "TMPFAIL or BUSY answers from TAP clients.",
            &t.temp_failures,
        ),
        (
            "sluice_tap_sessions_parked_total",
            "Named TAP sessions kept after their connection dropped.",
            &t.parked_sessions,
        ),
        (
            "sluice_tap_sessions_resumed_total",
            "TAP reconnects that resumed their session.",
            &t.resumed_sessions,
        ),
        (
            "sluice_tap_sessions_expired_total",
            "Parked TAP sessions whose grace period ran out.",
            &t.expired_sessions,
        ),
        (
            "sluice_tap_filtered_total",
            "Changes a StreamFilter kept off TAP streams.",
            &t.filtered,
        ),
        (
            "sluice_tap_out_of_hops_total",
            "Changes not sent on because their TAP hops ran out.",
            &t.loop_stopped,
        ),
        (
            "sluice_tap_applied_total",
            "TAP messages this node applied from a feed.",
            &t.applied,
        ),
    ] {
        single(o, name, "counter", help, v.load(Relaxed));
    }
    let p = &shared.policies;
    let kinds = crate::policy::PolicyKind::ALL;
    metric(
        o,
        "sluice_policy_installed",
        "gauge",
        "1 when a Python plugin decides this policy.",
    );
    for k in kinds {
        let _ = writeln!(
            o,
            "sluice_policy_installed{{policy=\"{}\"}} {}",
            k.name(),
            p.installed(k) as u8
        );
    }
    type Pick = fn(&crate::policy::PolicyStats) -> &std::sync::atomic::AtomicU64;
    let series: [(&str, &str, Pick); 4] = [
        (
            "sluice_policy_calls_total",
            "Questions put to a policy plugin.",
            |s| &s.calls,
        ),
        (
            "sluice_policy_timeouts_total",
            "Plugin answers that did not come in time (the default was used).",
            |s| &s.timeouts,
        ),
        (
            "sluice_policy_errors_total",
            "Plugin calls that raised or answered something unusable.",
            |s| &s.errors,
        ),
        (
            "sluice_policy_skipped_total",
            "Questions not asked because the plugin's queue was full.",
            |s| &s.skipped,
        ),
    ];
    for (name, help, pick) in series {
        metric(o, name, "counter", help);
        for k in kinds {
            let _ = writeln!(
                o,
                "{name}{{policy=\"{}\"}} {}",
                k.name(),
                pick(p.stats(k)).load(Relaxed)
            );
        }
    }
    metric(
        o,
        "sluice_policy_answer_seconds_total",
        "counter",
        "Time from question to answer, summed.",
    );
    for k in kinds {
        let micros = p.stats(k).answer_micros.load(Relaxed);
        let _ = writeln!(
            o,
            "sluice_policy_answer_seconds_total{{policy=\"{}\"}} {:.6}",
            k.name(),
            micros as f64 / 1e6
        );
    }
}

/// Prometheus text exposition of the node.
pub fn metrics(shared: &Shared) -> String {
    let mut o = String::with_capacity(16 << 10);
    let e = &shared.engine;
    let s = &shared.stats;
    metric(
        &mut o,
        "sluice_connections",
        "gauge",
        "Client connections open now.",
    );
    let _ = writeln!(o, "sluice_connections {}", s.curr_connections.load(Relaxed));
    metric(
        &mut o,
        "sluice_connections_total",
        "counter",
        "Client connections accepted, and refused over max_connections.",
    );
    let _ = writeln!(
        o,
        "sluice_connections_total{{result=\"accepted\"}} {}",
        s.connections_total.load(Relaxed)
    );
    let _ = writeln!(
        o,
        "sluice_connections_total{{result=\"refused\"}} {}",
        s.connections_rejected.load(Relaxed)
    );
    metric(
        &mut o,
        "sluice_network_bytes_total",
        "counter",
        "Bytes read from and written to clients.",
    );
    let _ = writeln!(
        o,
        "sluice_network_bytes_total{{direction=\"in\"}} {}",
        s.bytes_in.load(Relaxed)
    );
    let _ = writeln!(
        o,
        "sluice_network_bytes_total{{direction=\"out\"}} {}",
        s.bytes_out.load(Relaxed)
    );
    metric(
        &mut o,
        "sluice_protocol_errors_total",
        "counter",
        "Connections closed for malformed input.",
    );
    let _ = writeln!(
        o,
        "sluice_protocol_errors_total {}",
        s.protocol_errors.load(Relaxed)
    );
    let d = &shared.dcp;
    metric(
        &mut o,
        "sluice_dcp_connections",
        "gauge",
        "Open DCP producer connections.",
    );
    let _ = writeln!(o, "sluice_dcp_connections {}", d.connections.load(Relaxed));
    metric(&mut o, "sluice_dcp_streams", "gauge", "Open DCP streams.");
    let _ = writeln!(o, "sluice_dcp_streams {}", d.streams.load(Relaxed));
    metric(
        &mut o,
        "sluice_dcp_items_total",
        "counter",
        "Documents sent by DCP streams, by source.",
    );
    for (src, v) in [("backfill", &d.items_backfill), ("memory", &d.items_memory)] {
        let _ = writeln!(
            o,
            "sluice_dcp_items_total{{source=\"{src}\"}} {}",
            v.load(Relaxed)
        );
    }
    metric(
        &mut o,
        "sluice_dcp_streams_too_slow_total",
        "counter",
        "DCP streams ended because their cursor was dropped (the consumer declared cursor dropping).",
    );
    let _ = writeln!(
        o,
        "sluice_dcp_streams_too_slow_total {}",
        d.streams_too_slow.load(Relaxed)
    );
    metric(
        &mut o,
        "sluice_dcp_filtered_total",
        "counter",
        "Documents a StreamFilter plugin kept off DCP streams.",
    );
    let _ = writeln!(o, "sluice_dcp_filtered_total {}", d.filtered.load(Relaxed));
    metric(
        &mut o,
        "sluice_dcp_dead_connections_total",
        "counter",
        "DCP connections closed because a NOOP went unanswered.",
    );
    let _ = writeln!(
        o,
        "sluice_dcp_dead_connections_total {}",
        d.dead_connections.load(Relaxed)
    );
    tap_and_policy_metrics(shared, &mut o);
    let buckets = e.buckets();
    metric(
        &mut o,
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
        &mut o,
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
        &mut o,
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
        &mut o,
        "sluice_wal_failing",
        "gauge",
        "1 while the WAL cannot write and writes are refused.",
    );
    let _ = writeln!(o, "sluice_wal_failing {}", wal.is_failing() as u8);
    metric(
        &mut o,
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
        &mut o,
        "sluice_items",
        "gauge",
        "Live items and tombstones per bucket.",
    );
    metric(
        &mut o,
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
    replication_metrics(shared, &mut o);
    o
}

/// Replication as the replica sees it (lag per vbucket, its connection) and as the active
/// sees it (how far each replica acknowledged).
fn replication_metrics(shared: &Shared, o: &mut String) {
    use crate::replica::DELAY_BOUNDS_MS;
    let reps = shared.replicators.lock();
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
    metric(o, "sluice_replica_lag_ms", "gauge", "Per replica vbucket: milliseconds from the active's write to its apply here, for the newest change of the last batch.");
    for r in reps.iter() {
        for (vb, l) in r.stats.vbuckets.lock().iter() {
            let b = &r.bucket;
            let _ = writeln!(
                o,
                "sluice_replica_lag_seqnos{{bucket=\"{b}\",vbucket=\"{vb}\"}} {}",
                l.active_seqno.saturating_sub(l.applied_seqno)
            );
            let _ = writeln!(
                o,
                "sluice_replica_lag_ms{{bucket=\"{b}\",vbucket=\"{vb}\"}} {:.3}",
                l.lag_ms
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
    drop(reps);
    metric(o, "sluice_follower_ack_lag_seqnos", "gauge", "On the active, per vbucket and replica: high seqno minus the seqno the replica acknowledged (SEQNO_ACKNOWLEDGED).");
    for b in shared.engine.buckets() {
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

/// The node as JSON: what `sluice status` shows.
pub fn status(shared: &Shared) -> serde_json::Value {
    use serde_json::json;
    let e = &shared.engine;
    let buckets: Vec<_> = e
        .buckets()
        .iter()
        .map(|b| {
            let vbuckets: Vec<_> = (0..b.num_vbuckets())
                .map(|v| {
                    let vb = b.lock_vbucket(v).expect("in range");
                    json!({
                        "vbucket": v,
                        "state": vb.state.as_str(),
                        "high_seqno": vb.high_seqno,
                        "persisted_seqno": vb.persisted_seqno,
                        "items": vb.store.live_items(),
                        "failover_uuid": vb.failover.latest().map(|f| f.uuid),
                        "followers": b.acks.following(v).iter().map(|f| json!({"replica": f.name, "acked_seqno": f.seqno, "persisted_seqno": f.persisted})).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({"name": b.name(), "mem_used": b.mem_used(), "memory_quota": b.config.memory_quota, "vbuckets": vbuckets})
        })
        .collect();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "instance": e.instance(),
        "uptime_s": shared.started.elapsed().as_secs(),
        "listen": shared.config.listen.to_string(),
        "connections": shared.stats.curr_connections.load(Relaxed),
        "wal": {"mode": e.config().wal_mode.as_str(), "last_lsn": e.wal().last_lsn(), "written_lsn": e.wal().written_lsn(), "synced_lsn": e.wal().synced_lsn(), "failing": e.wal().is_failing()},
        "buckets": buckets,
        "replication": replication_status(shared),
    })
}

/// Who this node follows and how far behind each replica vbucket is (null on an active node).
fn replication_status(shared: &Shared) -> serde_json::Value {
    use serde_json::json;
    let reps = shared.replicators.lock();
    if reps.is_empty() {
        return serde_json::Value::Null;
    }
    let buckets: Vec<_> = reps
        .iter()
        .map(|r| {
            let vbs: Vec<_> = r
                .stats
                .vbuckets
                .lock()
                .iter()
                .map(|(vb, l)| json!({"vbucket": vb, "active_seqno": l.active_seqno, "applied_seqno": l.applied_seqno, "lag_seqnos": l.active_seqno.saturating_sub(l.applied_seqno), "lag_ms": l.lag_ms, "acked_seqno": l.acked_seqno}))
                .collect();
            json!({
                "bucket": r.bucket,
                "connected": r.stats.connected.load(Relaxed),
                "connects": r.stats.connects.load(Relaxed),
                "items": r.stats.items.load(Relaxed),
                "rollbacks": r.stats.rollbacks.load(Relaxed),
                "last_error": r.stats.last_error.lock().clone(),
                "vbuckets": vbs,
            })
        })
        .collect();
    json!({"replica_of": reps[0].config.active, "buckets": buckets})
}

/// POST /takeover?bucket=B&vbucket=N&source=HOST:PORT: moves the vbucket from the source node
/// to this one (see `replica::take_over`); answers when it is active here.
fn takeover(shared: &Shared, query: &str) -> Result<serde_json::Value, String> {
    let arg = |name: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    };
    let vb: u16 = arg("vbucket")
        .and_then(|v| v.parse().ok())
        .ok_or("vbucket=N is required")?;
    let source = arg("source").ok_or("source=HOST:PORT is required")?;
    let bucket_name = arg("bucket").unwrap_or_else(|| "default".into());
    let bucket = shared
        .engine
        .bucket(&bucket_name)
        .map_err(|e| e.to_string())?;
    if let Some(r) = shared.replicators.lock().first() {
        return Err(format!(
            "this node follows {} and replicates every vbucket; a vbucket moves only to a node \
             that does not (promote it first)",
            r.config.active
        ));
    }
    let (username, password) = shared.config.replication_login.clone();
    let config = crate::replica::ReplicaConfig {
        active: source,
        username,
        password,
        noop_interval: 1,
    };
    let r = crate::replica::take_over(
        &shared.engine,
        &bucket,
        vb,
        &config,
        std::time::Duration::from_secs(600),
    )?;
    Ok(serde_json::json!({
        "bucket": bucket_name,
        "vbucket": r.vbucket,
        "items": r.items,
        "seconds": r.seconds,
        "writes_paused_ms": r.writes_paused_ms,
        "high_seqno": r.high_seqno,
    }))
}
