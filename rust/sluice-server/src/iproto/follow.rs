//! sluice as the replica of a real Tarantool (`[tarantool_upstream]`): the rows the upstream
//! writes to spaces configured here are applied to them, so they reach DCP, TAP and Spark like
//! any other change (Tarantool's applier, the storage side; `upstream` is the network side).
//!
//! Which space is which is learned from the upstream's `_vspace` and `_vindex` at every
//! connection and from the `_space`, `_index` and `_truncate` rows it streams: a followed space
//! has the same name on both sides, and its primary key must be on the same fields.
//!
//! Exactly once: each applied row goes to the WAL together with the upstream's vclock after it
//! (`Engine::write_followed`; a multi-statement transaction as one group,
//! `Engine::write_followed_group`, applied under the locks of every vbucket it touches), so a
//! restart SUBSCRIBEs from the last row kept, even after kill -9, and an UPDATE that adds to a
//! field is never applied twice. Without a kept vclock (first start, a crash while loading, a
//! WAL salvaged by force recovery) or when the upstream no longer holds the rows after it, the
//! followed buckets are emptied and a fresh copy is fetched: FETCH_SNAPSHOT as an anonymous
//! replica, or JOIN, registered in the upstream's `_cluster`. The upstream is told only the
//! vclock of rows the WAL has written (`Acknowledged`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use sluice_core::{Engine, FollowedChange};
use sluice_proto::iproto::client::{self, Vclock};
use sluice_proto::iproto::request::{decode_dml_body, Request};
use sluice_proto::iproto::tuple;
use sluice_proto::iproto::update;
use sluice_proto::iproto::xrow::{Row, RowHeader};
use sluice_proto::msgpack::Reader;
use tokio::sync::watch;

use super::failure::Failure;
use super::schema::{Catalog, Space};
use super::select::canonical_key;
use super::write::{key_of, updated, upserted};
use crate::metrics::{metric, single};
use crate::upstream::{FollowConfig, Next, Upstream, UpstreamError};

/// Tarantool's system spaces the follower reads.
const SPACE: u32 = 280;
const VSPACE: u32 = 281;
const INDEX: u32 = 288;
const VINDEX: u32 = 289;
const TRUNCATE: u32 = 330;

/// How often /status follows the rows while they stream.
const STATUS_EVERY: Duration = Duration::from_millis(50);

/// The longest wait between reconnections.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// How many rows that change nothing here (other spaces, NOPs) may pass before the position
/// is logged anyway, so a restart does not fetch them all again.
const POSITION_EVERY: u64 = 10_000;

/// What `/status` and `/metrics` show of the follower.
#[derive(Default)]
pub struct FollowStatus {
    pub address: String,
    inner: Mutex<StatusInner>,
    rows: AtomicU64,
    skipped: AtomicU64,
    copies: AtomicU64,
    reconnects: AtomicU64,
}

#[derive(Default)]
struct StatusInner {
    state: &'static str,
    reason: String,
    upstream_uuid: String,
    upstream_vclock: Vclock,
    vclock: Vclock,
    /// Seconds between the last row's timestamp upstream and its application here.
    lag: f64,
    /// Followed spaces not followed now, with why.
    stopped: BTreeMap<String, String>,
}

impl FollowStatus {
    pub fn new(address: &str) -> FollowStatus {
        FollowStatus {
            address: address.to_string(),
            ..Default::default()
        }
    }

    /// Our vclock now, and the lag of the row just applied (its timestamp upstream).
    fn show(&self, vclock: &Vclock, row_timestamp: Option<f64>) {
        let mut s = self.inner.lock();
        s.vclock.clone_from(vclock);
        for (id, lsn) in vclock {
            let up = s.upstream_vclock.entry(*id).or_insert(0);
            *up = (*up).max(*lsn);
        }
        if let Some(ts) = row_timestamp {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(ts, |d| d.as_secs_f64());
            s.lag = (now - ts).max(0.0);
        }
    }

    fn set_state(&self, state: &'static str, reason: impl Into<String>) {
        let mut s = self.inner.lock();
        s.state = state;
        s.reason = reason.into();
    }

    /// The follower as one JSON object, for `/status`.
    pub fn describe(&self) -> serde_json::Value {
        let s = self.inner.lock();
        let vc = |v: &Vclock| -> serde_json::Value {
            v.iter()
                .map(|(id, lsn)| (id.to_string(), serde_json::Value::from(*lsn)))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        serde_json::json!({
            "address": self.address,
            "state": s.state,
            "reason": s.reason,
            "upstream_uuid": s.upstream_uuid,
            "upstream_vclock": vc(&s.upstream_vclock),
            "vclock": vc(&s.vclock),
            "lag_rows": lag_rows(&s.upstream_vclock, &s.vclock),
            "lag_seconds": s.lag,
            "rows_applied": self.rows.load(Relaxed),
            "rows_skipped": self.skipped.load(Relaxed),
            "copies": self.copies.load(Relaxed),
            "reconnects": self.reconnects.load(Relaxed),
            "stopped_spaces": s.stopped,
        })
    }

    /// The follower's Prometheus lines.
    pub fn metrics(&self, o: &mut String) {
        let s = self.inner.lock();
        metric(
            o,
            "sluice_tarantool_upstream_state",
            "gauge",
            "1 for the follower's state (connect, copy, follow, retry).",
        );
        for state in ["connect", "copy", "follow", "retry"] {
            let v = u8::from(s.state == state);
            let _ = writeln!(
                o,
                "sluice_tarantool_upstream_state{{state=\"{state}\"}} {v}"
            );
        }
        single(
            o,
            "sluice_tarantool_upstream_rows_total",
            "counter",
            "Rows of the upstream applied to followed spaces.",
            self.rows.load(Relaxed),
        );
        single(
            o,
            "sluice_tarantool_upstream_skipped_rows_total",
            "counter",
            "Rows of the upstream that change no followed space (other spaces, NOPs).",
            self.skipped.load(Relaxed),
        );
        single(
            o,
            "sluice_tarantool_upstream_copies_total",
            "counter",
            "Fresh copies fetched from the upstream (first start, or its WAL no longer holding \
             the rows after ours).",
            self.copies.load(Relaxed),
        );
        single(
            o,
            "sluice_tarantool_upstream_reconnects_total",
            "counter",
            "Connections to the upstream lost or refused and tried again.",
            self.reconnects.load(Relaxed),
        );
        single(
            o,
            "sluice_tarantool_upstream_lag_rows",
            "gauge",
            "Rows the upstream had, when last heard, beyond those applied here.",
            lag_rows(&s.upstream_vclock, &s.vclock),
        );
        metric(
            o,
            "sluice_tarantool_upstream_lag_seconds",
            "gauge",
            "Seconds from the last row's write upstream to its application here.",
        );
        let _ = writeln!(o, "sluice_tarantool_upstream_lag_seconds {}", s.lag);
        metric(
            o,
            "sluice_tarantool_upstream_stopped_spaces",
            "gauge",
            "Followed spaces not followed now (not on the upstream, another primary key, a \
             tuple that does not fit); /status says why.",
        );
        let _ = writeln!(
            o,
            "sluice_tarantool_upstream_stopped_spaces {}",
            s.stopped.len()
        );
    }
}

fn lag_rows(upstream: &Vclock, ours: &Vclock) -> u64 {
    upstream
        .iter()
        .map(|(id, lsn)| lsn.saturating_sub(ours.get(id).copied().unwrap_or(0)))
        .sum()
}

/// Runs the follower until `stop`: connects, copies when it must, follows; after a failure it
/// reconnects with a back-off.
pub async fn run(
    engine: Arc<Engine>,
    catalog: Arc<Catalog>,
    config: FollowConfig,
    instance_uuid: String,
    status: Arc<FollowStatus>,
    mut stop: watch::Receiver<bool>,
) {
    let mut follower = Follower {
        engine,
        catalog,
        config,
        instance_uuid,
        status,
        by_id: HashMap::new(),
        pending_since_position: 0,
        txn_done: 0,
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        follower.status.set_state("connect", "");
        let outcome = tokio::select! {
            r = follower.follow() => r,
            _ = stop.changed() => return,
        };
        let Err(e) = outcome;
        follower.status.reconnects.fetch_add(1, Relaxed);
        log::warn!(
            "following the Tarantool at {}: {e}; trying again in {backoff:?}",
            follower.config.upstream.address
        );
        follower.status.set_state("retry", e.to_string());
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
        if matches!(e, UpstreamError::Local(_)) {
            backoff = Duration::from_millis(100);
        }
    }
}

struct Follower {
    engine: Arc<Engine>,
    catalog: Arc<Catalog>,
    config: FollowConfig,
    instance_uuid: String,
    status: Arc<FollowStatus>,
    /// Upstream space id -> the space here that follows it.
    by_id: HashMap<u32, Arc<Space>>,
    /// Rows passed since the position was last logged.
    pending_since_position: u64,
    /// Rows of the open transaction applied one by one so far (see `apply_txn`).
    txn_done: usize,
}

/// How a row ended here.
enum Applied {
    Changed,
    Skipped,
    /// Not now: the store is above its watermark or the WAL behind (TMPFAIL); the same row
    /// again shortly.
    Later,
}

impl Follower {
    /// The followed spaces the upstream has now (mapped by `learn_schema` and DDL rows).
    fn mapped(&self) -> Vec<Arc<Space>> {
        let mut out: Vec<Arc<Space>> = Vec::new();
        for s in self.by_id.values() {
            if !out.iter().any(|o| o.id == s.id) {
                out.push(s.clone());
            }
        }
        out
    }

    fn followed(&self) -> Vec<Arc<Space>> {
        self.catalog
            .spaces()
            .map(|(_, s)| s.clone())
            .filter(|s| self.config.spaces.is_empty() || self.config.spaces.contains(&s.name))
            .collect()
    }

    /// One connection: returns only with the error that ended it.
    async fn follow(&mut self) -> Result<std::convert::Infallible, UpstreamError> {
        let mut up = Upstream::connect(&self.config.upstream).await?;
        let ballot = up.ballot().await?;
        {
            let mut s = self.status.inner.lock();
            s.upstream_uuid = up.instance_uuid.clone();
            if let Some(b) = &ballot {
                s.upstream_vclock = b.vclock.clone();
            }
        }
        self.learn_schema(&mut up).await?;
        let mut from = self.kept_position();
        if let (Some(ours), Some(b)) = (&from, &ballot) {
            if let Some((id, lsn)) = b.collected_after(ours) {
                log::warn!(
                    "the Tarantool at {} no longer holds the rows after our position {ours:?} (its \
                     WAL starts after LSN {lsn} of replica {id}): fetching a fresh copy",
                    self.config.upstream.address
                );
                from = None;
            }
        }
        let from = match from {
            Some(v) => v,
            None => self.copy(&mut up).await?,
        };
        log::info!(
            "following the Tarantool at {} (Tarantool {}, instance {}) from vclock {from:?}",
            self.config.upstream.address,
            up.version,
            up.instance_uuid
        );
        self.status.inner.lock().vclock = from.clone();
        self.status.set_state("follow", "");
        let mut vclock = from.clone();
        // The vclock of the rows applied here (every transaction up to its commit row): what
        // the upstream is told, never the rows of a transaction still waiting for its commit.
        let applied = parking_lot::Mutex::new(from.clone());
        let idle = self.config.upstream.timeout.max(Duration::from_secs(5));
        let status = self.status.clone();
        let uuid = self.instance_uuid.clone();
        let mut position = Vec::new();
        // /status is brought up to date at most every STATUS_EVERY while rows stream, and at
        // each heartbeat: a lock and a vclock copy per row would cost more than the row.
        let mut shown = Instant::now();
        let engine = self.engine.clone();
        // What the WAL already holds: where this subscription starts.
        let mut acked = Acknowledged {
            pending: None,
            sent: from.clone(),
        };
        // Rows of a transaction wait for its commit row, then go in as one group.
        let mut txn = PendingTxn::default();
        self.txn_done = 0;
        let ended = up
            .subscribe(
                &uuid,
                self.config.anonymous,
                from,
                idle,
                |row| {
                    let Some(row) = row else {
                        status.show(&vclock, None);
                        shown = Instant::now();
                        return Ok(Next::Continue);
                    };
                    if let (Some(id), Some(lsn)) = (row.header.replica_id, row.header.lsn) {
                        vclock.insert(id, lsn);
                    }
                    if !row.header.is_commit() {
                        txn.push(row)?;
                        return Ok(Next::Continue);
                    }
                    let outcome = if txn.is_empty() {
                        position.clear();
                        client::write_vclock(&mut position, &vclock);
                        self.apply(row, Some(&position))
                    } else {
                        self.apply_txn(&txn.rows, row, &vclock)
                    };
                    if shown.elapsed() >= STATUS_EVERY {
                        status.show(&vclock, row.header.timestamp);
                        shown = Instant::now();
                    }
                    let rows = txn.len() as u64 + 1;
                    match outcome? {
                        Applied::Later => return Ok(Next::Retry),
                        Applied::Changed => {
                            status.rows.fetch_add(rows, Relaxed);
                            self.pending_since_position = 0;
                        }
                        Applied::Skipped => {
                            status.skipped.fetch_add(rows, Relaxed);
                            self.pending_since_position += rows;
                            if self.pending_since_position >= POSITION_EVERY {
                                position.clear();
                                client::write_vclock(&mut position, &vclock);
                                self.log_position(&position)?;
                            }
                        }
                    }
                    txn.clear();
                    self.txn_done = 0;
                    applied.lock().clone_from(&vclock);
                    Ok(Next::Continue)
                },
                |_handed| acked.acknowledge(&engine, &applied.lock()),
            )
            .await;
        match ended {
            Ok(_) => Err(UpstreamError::Protocol("the row stream ended".into())),
            Err(e) => Err(e),
        }
    }

    /// The vclock kept with the followed spaces' data, or None when any of those the upstream
    /// has holds none (never copied, a copy cut short, a row it could not apply): the newest of
    /// the positions their vbuckets hold.
    fn kept_position(&self) -> Option<Vclock> {
        let mut merged = Vclock::new();
        for space in self.mapped() {
            let positions = self.engine.follow_positions(&space.bucket);
            if positions.is_empty() {
                return None;
            }
            for p in positions {
                let mut r = Reader::new(&p);
                let Ok(v) = client::read_vclock(&mut r) else {
                    log::warn!(
                        "space {}: a kept upstream position is not a vclock; fetching a fresh copy",
                        space.name
                    );
                    return None;
                };
                for (id, lsn) in v {
                    let m = merged.entry(id).or_insert(0);
                    *m = (*m).max(lsn);
                }
            }
        }
        Some(merged)
    }

    /// Empties the followed buckets, loads the upstream's snapshot into them and logs its
    /// vclock as their position; returns it.
    async fn copy(&mut self, up: &mut Upstream) -> Result<Vclock, UpstreamError> {
        self.status.set_state("copy", "");
        self.status.copies.fetch_add(1, Relaxed);
        log::info!(
            "fetching a copy of the Tarantool at {} into {} followed space(s)",
            self.config.upstream.address,
            self.mapped().len()
        );
        for space in self.mapped() {
            self.engine
                .clear_follow_positions(&space.bucket)
                .map_err(local)?;
            // Consumers holding what the bucket had are told to roll back, not shown
            // deletions: the copy replaces the bucket's history, it does not continue it.
            // It writes a snapshot: off the runtime's workers.
            let (engine, bucket) = (self.engine.clone(), space.bucket.clone());
            tokio::task::spawn_blocking(move || engine.restart_history(&bucket))
                .await
                .map_err(|e| UpstreamError::Local(format!("a new history: {e}")))?
                .map_err(local)?;
        }
        let mut loaded = 0u64;
        let (anonymous, uuid) = (self.config.anonymous, self.instance_uuid.clone());
        let mut each = |row: &Row<'_>| {
            Ok(match self.apply(row, None)? {
                Applied::Changed => {
                    loaded += 1;
                    Next::Continue
                }
                Applied::Skipped => Next::Continue,
                Applied::Later => Next::Retry,
            })
        };
        let vclock = if anonymous {
            up.fetch_snapshot(&mut each).await?
        } else {
            up.join(&uuid, &mut each).await?
        };
        let mut position = Vec::new();
        client::write_vclock(&mut position, &vclock);
        self.log_position(&position)?;
        log::info!("copied {loaded} tuple(s) from the Tarantool, as of vclock {vclock:?}");
        Ok(vclock)
    }

    fn log_position(&mut self, position: &[u8]) -> Result<(), UpstreamError> {
        for space in self.mapped() {
            self.engine
                .write_follow_position(&space.bucket, position)
                .map_err(local)?;
        }
        self.pending_since_position = 0;
        Ok(())
    }

    /// Maps upstream space ids to the followed spaces by name, checking primary keys.
    async fn learn_schema(&mut self, up: &mut Upstream) -> Result<(), UpstreamError> {
        let spaces = up.select_all(VSPACE).await?;
        let indexes = up.select_all(VINDEX).await?;
        self.by_id.clear();
        let mut stopped = BTreeMap::new();
        for space in self.followed() {
            let id = spaces
                .iter()
                .find(|t| field_str(t, 2).as_deref() == Some(space.name.as_str()))
                .and_then(|t| field_uint(t, 0));
            let Some(id) = id else {
                stopped.insert(space.name.clone(), "no space of this name upstream".into());
                continue;
            };
            let primary = indexes
                .iter()
                .find(|t| field_uint(t, 0) == Some(id) && field_uint(t, 1) == Some(0));
            match primary.map(|t| check_primary_key(&space, t)) {
                Some(Ok(())) => {
                    self.by_id.insert(id as u32, space);
                }
                Some(Err(why)) => {
                    stopped.insert(space.name.clone(), why);
                }
                None => {
                    stopped.insert(space.name.clone(), "no primary index upstream".into());
                }
            }
        }
        for (name, why) in &stopped {
            log::warn!("space {name} is not followed: {why}");
        }
        self.status.inner.lock().stopped = stopped;
        Ok(())
    }

    /// What a row comes to here, the tuple not yet seen.
    fn step<'r>(&mut self, kind: u32, body: Option<&'r [u8]>) -> Result<Step<'r>, UpstreamError> {
        let Some(body) = body else {
            return Ok(Step::Skip);
        };
        let Some(request) = decode_dml_body(kind, body) else {
            return Ok(Step::Skip);
        };
        let request = request.map_err(|e| UpstreamError::Protocol(e.message))?;
        let Some(space_id) = space_of(&request) else {
            return Ok(Step::Skip);
        };
        if matches!(space_id, SPACE | INDEX | TRUNCATE) {
            return Ok(Step::Ddl(space_id, request));
        }
        let Some(space) = self.by_id.get(&space_id).cloned() else {
            return Ok(Step::Skip);
        };
        match decide(&space, &request) {
            Ok((key, change)) => Ok(Step::Write(space, key, change)),
            Err(f) => {
                self.stop_space(&space, format!("a row it cannot apply: {}", f.message));
                self.forget_position(&space);
                Ok(Step::Skip)
            }
        }
    }

    /// Applies one row (or steps over it); `position` is the vclock after it (None while a
    /// copy loads). An error of this node (its store failing) ends the connection; a full
    /// store asks for the row again (`Applied::Later`).
    fn apply(&mut self, row: &Row<'_>, position: Option<&[u8]>) -> Result<Applied, UpstreamError> {
        match self.step(row.header.kind, row.body)? {
            Step::Skip => Ok(Applied::Skipped),
            // A copy's `_truncate` rows are truncations of the past: the copy holds their
            // result.
            Step::Ddl(TRUNCATE, _) if position.is_none() => Ok(Applied::Skipped),
            Step::Ddl(system, request) => self.apply_ddl(system, &request, position),
            Step::Write(space, key, change) => {
                let upstream = &self.config.upstream.address;
                let written = self
                    .engine
                    .write_followed(&space.bucket, &key, position, |cur| {
                        change.resolve(&space, &key, cur, upstream)
                    });
                self.written(written.map(|lsn| (lsn, Vec::new())), &[&space])
            }
        }
    }

    /// The rows of one transaction of the upstream (`rows`, then its commit row), applied as
    /// one group (`Engine::write_followed_group`): a reader sees all of its changes or none,
    /// and a crash keeps all or none. A transaction that changes the schema, or one too large
    /// for a group, is applied row by row, each with the vclock after it; `self.txn_done`
    /// counts the rows applied so far, so a row asked for again is not applied twice.
    fn apply_txn(
        &mut self,
        rows: &[PendingRow],
        commit: &Row<'_>,
        vclock_after: &Vclock,
    ) -> Result<Applied, UpstreamError> {
        let all: Vec<RowRef<'_>> = rows
            .iter()
            .map(|r| RowRef {
                kind: r.kind,
                body: r.body.as_deref(),
                lsn: r.lsn,
            })
            .chain([RowRef {
                kind: commit.header.kind,
                body: commit.body,
                lsn: commit.header.lsn,
            }])
            .collect();
        let ddl = all.iter().any(|r| {
            r.body
                .and_then(|b| decode_dml_body(r.kind, b))
                .and_then(Result::ok)
                .is_some_and(|r| matches!(space_of(&r), Some(SPACE | INDEX | TRUNCATE)))
        });
        let mut position = Vec::new();
        if ddl || all.len() > sluice_core::engine::MAX_GROUP {
            let replica = commit.header.replica_id;
            for (k, r) in all.iter().enumerate().skip(self.txn_done) {
                let mut vclock = vclock_after.clone();
                if let (Some(id), Some(lsn)) = (replica, r.lsn) {
                    vclock.insert(id, lsn);
                }
                position.clear();
                client::write_vclock(&mut position, &vclock);
                let row = Row {
                    header: RowHeader {
                        kind: r.kind,
                        ..Default::default()
                    },
                    body: r.body,
                };
                if matches!(self.apply(&row, Some(&position))?, Applied::Later) {
                    return Ok(Applied::Later);
                }
                self.txn_done = k + 1;
            }
            return Ok(Applied::Changed);
        }
        let mut steps = Vec::with_capacity(all.len());
        for r in &all {
            if let Step::Write(space, key, change) = self.step(r.kind, r.body)? {
                steps.push((space, key, change));
            }
        }
        if steps.is_empty() {
            return Ok(Applied::Skipped);
        }
        client::write_vclock(&mut position, vclock_after);
        let writes: Vec<(&sluice_core::bucket::Bucket, &[u8])> = steps
            .iter()
            .map(|(space, key, _)| (&*space.bucket, key.as_slice()))
            .collect();
        let upstream = &self.config.upstream.address;
        let written = self
            .engine
            .write_followed_group(&writes, Some(&position), |i, cur| {
                let (space, key, change) = &steps[i];
                change.resolve(space, key, cur, upstream)
            });
        let spaces: Vec<&Space> = steps.iter().map(|(s, ..)| &**s).collect();
        self.written(written, &spaces)
    }

    /// How a followed write ended: `refused` (index, size) are writes too large for their
    /// bucket, whose spaces stop being followed.
    fn written(
        &mut self,
        written: sluice_core::Result<(u64, Vec<(usize, usize)>)>,
        spaces: &[&Space],
    ) -> Result<Applied, UpstreamError> {
        match written {
            Ok((_, refused)) => {
                for (i, size) in refused {
                    let space = spaces[i];
                    let max = space.bucket.config.max_item_size;
                    self.stop_space(
                        space,
                        format!("a tuple of {size} bytes, over the bucket's max_item_size {max}"),
                    );
                    self.forget_position(space);
                }
                Ok(Applied::Changed)
            }
            Err(e @ sluice_core::Error::TooBig { .. }) => {
                self.stop_space(spaces[0], format!("a tuple it cannot store: {e}"));
                self.forget_position(spaces[0]);
                Ok(Applied::Skipped)
            }
            Err(sluice_core::Error::TempFail(_)) => Ok(Applied::Later),
            Err(e) => Err(local(e)),
        }
    }

    fn stop_space(&mut self, space: &Space, why: String) {
        log::warn!("space {} is no longer followed: {why}", space.name);
        self.by_id.retain(|_, s| s.name != space.name);
        self.status
            .inner
            .lock()
            .stopped
            .insert(space.name.clone(), why);
    }

    /// A space that missed a row keeps no position: the next connection that finds it
    /// upstream loads a fresh copy rather than resuming with the row missing.
    fn forget_position(&self, space: &Space) {
        if let Err(e) = self.engine.clear_follow_positions(&space.bucket) {
            log::warn!("space {}: its position cannot be cleared: {e}", space.name);
        }
    }

    /// A row of `_space`, `_index` or `_truncate`: a followed space created, dropped, given
    /// another primary key or truncated upstream. `position`: the vclock after the row (None
    /// while a copy loads, which holds the result of past DDL).
    fn apply_ddl(
        &mut self,
        system: u32,
        request: &Request<'_>,
        position: Option<&[u8]>,
    ) -> Result<Applied, UpstreamError> {
        // `space:truncate()` logs an UPSERT of `{space_id, 1}` into `_truncate`.
        let tuple = match request {
            Request::Insert { tuple, .. }
            | Request::Replace { tuple, .. }
            | Request::Upsert { tuple, .. } => Some(*tuple),
            _ => None,
        };
        match (system, tuple) {
            (SPACE, Some(t)) => {
                let (Some(id), Some(name)) = (field_uint(t, 0), field_str(t, 2)) else {
                    return Ok(Applied::Skipped);
                };
                let found = self.followed().into_iter().find(|s| s.name == name);
                let known = self.by_id.get(&(id as u32)).is_some_and(|s| s.name == name);
                if let Some(space) = found.filter(|_| !known) {
                    log::info!("space {name} (id {id}) appeared upstream; following it");
                    self.status.inner.lock().stopped.remove(&name);
                    if let Some(p) = position {
                        // Created now: empty, as it is upstream, and resumable from here.
                        let _emptied = self.engine.write_flush(&space.bucket).map_err(local)?;
                        self.engine
                            .write_follow_position(&space.bucket, p)
                            .map_err(local)?;
                    }
                    self.by_id.insert(id as u32, space);
                }
            }
            (SPACE, None) => {
                if let Request::Delete { key, .. } = request {
                    let id = first_uint(key);
                    if let Some(space) = id.and_then(|id| self.by_id.get(&(id as u32)).cloned()) {
                        // Its tuples go with it, as upstream.
                        let _emptied = self.engine.write_flush(&space.bucket).map_err(local)?;
                        self.stop_space(&space, "dropped upstream".into());
                        return Ok(Applied::Changed);
                    }
                }
            }
            (INDEX, Some(t)) => {
                let (Some(id), Some(0)) = (field_uint(t, 0), field_uint(t, 1)) else {
                    return Ok(Applied::Skipped);
                };
                if let Some(space) = self.by_id.get(&(id as u32)).cloned() {
                    if let Err(why) = check_primary_key(&space, t) {
                        self.stop_space(&space, why);
                        self.forget_position(&space);
                    }
                }
            }
            (TRUNCATE, Some(t)) => {
                let id = field_uint(t, 0);
                if let Some(space) = id.and_then(|id| self.by_id.get(&(id as u32)).cloned()) {
                    log::info!("space {} truncated upstream; emptying it", space.name);
                    let _emptied = self.engine.write_flush(&space.bucket).map_err(local)?;
                    if let Some(p) = position {
                        self.engine
                            .write_follow_position(&space.bucket, p)
                            .map_err(local)?;
                    }
                    return Ok(Applied::Changed);
                }
            }
            _ => {}
        }
        Ok(Applied::Skipped)
    }
}

/// The vclock told to the upstream: only rows whose changes the WAL has written, so that a
/// registered upstream never collects rows a crash here would still need. Rows handed over
/// since the last acknowledgement wait until the WAL has written every LSN given out before
/// that acknowledgement, one period (250 ms) later at most when it is behind.
struct Acknowledged {
    /// The WAL's last LSN given out, and the vclock handed over, at the last acknowledgement.
    pending: Option<(u64, Vclock)>,
    sent: Vclock,
}

impl Acknowledged {
    fn acknowledge(&mut self, engine: &Engine, handed: &Vclock) -> Vclock {
        if engine.config().wal_mode == sluice_core::wal::WalMode::None {
            // Nothing is kept: there is nothing to wait for.
            return handed.clone();
        }
        let wal = engine.wal();
        let (last, written) = (wal.last_lsn(), wal.written_lsn());
        if written >= last {
            self.sent.clone_from(handed);
            self.pending = None;
            return self.sent.clone();
        }
        self.pending = match self.pending.take() {
            Some((lsn, vclock)) if written >= lsn => {
                self.sent = vclock;
                Some((last, handed.clone()))
            }
            Some(waiting) => Some(waiting),
            None => Some((last, handed.clone())),
        };
        self.sent.clone()
    }
}

/// What a row comes to here (`Follower::step`).
enum Step<'r> {
    Skip,
    /// A row of `_space`, `_index` or `_truncate`.
    Ddl(u32, Request<'r>),
    Write(Arc<Space>, Vec<u8>, Change<'r>),
}

/// The most bytes of row bodies a transaction may hold before its commit row: past it the
/// follower stops taking the transaction (its memory would have no bound otherwise).
const MAX_TXN_BYTES: usize = 256 << 20;

/// The rows of a transaction whose commit row has not come yet.
#[derive(Default)]
struct PendingTxn {
    rows: Vec<PendingRow>,
    bytes: usize,
}

impl PendingTxn {
    fn push(&mut self, row: &Row<'_>) -> Result<(), UpstreamError> {
        self.push_bounded(row, MAX_TXN_BYTES)
    }

    fn push_bounded(&mut self, row: &Row<'_>, max: usize) -> Result<(), UpstreamError> {
        // A row costs what it holds in memory, body or not: rows without one count too.
        let len = std::mem::size_of::<PendingRow>() + row.body.map_or(0, <[u8]>::len);
        if self.bytes + len > max {
            return Err(UpstreamError::Local(format!(
                "a transaction of the upstream holds more than {} MiB of rows before its \
                 commit row ({} rows so far): the follower does not take it; split it upstream",
                max >> 20,
                self.rows.len()
            )));
        }
        self.bytes += len;
        self.rows.push(PendingRow::of(row));
        Ok(())
    }

    fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn len(&self) -> usize {
        self.rows.len()
    }

    fn clear(&mut self) {
        self.rows.clear();
        self.bytes = 0;
    }
}

/// A row of a transaction whose commit row has not come yet, kept until it does.
struct PendingRow {
    kind: u32,
    body: Option<Vec<u8>>,
    lsn: Option<u64>,
}

impl PendingRow {
    fn of(row: &Row<'_>) -> PendingRow {
        PendingRow {
            kind: row.header.kind,
            body: row.body.map(<[u8]>::to_vec),
            lsn: row.header.lsn,
        }
    }
}

/// A row of a transaction as `apply_txn` goes through them.
struct RowRef<'a> {
    kind: u32,
    body: Option<&'a [u8]>,
    lsn: Option<u64>,
}

fn space_of(request: &Request<'_>) -> Option<u32> {
    match request {
        Request::Insert { space_id, .. }
        | Request::Replace { space_id, .. }
        | Request::Update { space_id, .. }
        | Request::Upsert { space_id, .. }
        | Request::Delete { space_id, .. } => Some(*space_id),
        _ => None,
    }
}

/// What a DML row asks for, before the stored tuple is seen.
enum Change<'a> {
    Store(&'a [u8]),
    Delete,
    Update(Vec<update::UpdateOp<'a>>),
    Upsert(&'a [u8], Vec<update::UpdateOp<'a>>),
}

impl Change<'_> {
    /// The row applied to the stored tuple `cur`, by the iproto front's rules (an UPDATE of a
    /// missing key changes nothing; an UPSERT's operations that cannot apply are skipped).
    fn resolve(
        &self,
        space: &Space,
        key: &[u8],
        cur: Option<&[u8]>,
        upstream: &str,
    ) -> FollowedChange {
        match (self, cur) {
            (Change::Store(t), _) => FollowedChange::Store(t.to_vec()),
            (Change::Delete, _) => FollowedChange::Delete,
            (Change::Update(_), None) => FollowedChange::Keep,
            (Change::Update(ops), Some(cur)) => match updated(space, cur, ops, key) {
                Ok(new) => FollowedChange::Store(new),
                Err(f) => {
                    log::warn!(
                        "space {}: an UPDATE from the upstream does not apply here: {}",
                        space.name,
                        f.message
                    );
                    FollowedChange::Keep
                }
            },
            (Change::Upsert(t, _), None) => FollowedChange::Store(t.to_vec()),
            (Change::Upsert(_, ops), Some(cur)) => {
                match upserted(
                    space,
                    cur,
                    ops,
                    key,
                    &format_args!("the upstream {upstream}"),
                ) {
                    Ok(new) => FollowedChange::Store(new),
                    Err(_) => FollowedChange::Keep,
                }
            }
        }
    }
}

/// The key a DML row writes and what it does; an error when the row does not fit the space
/// as configured here.
fn decide<'a>(space: &Space, request: &Request<'a>) -> Result<(Vec<u8>, Change<'a>), Failure> {
    match request {
        Request::Insert { tuple, .. } | Request::Replace { tuple, .. } => {
            Ok((key_of(space, tuple)?, Change::Store(tuple)))
        }
        Request::Delete { key, .. } => Ok((point_key(space, key)?, Change::Delete)),
        Request::Update {
            key,
            ops,
            index_base,
            ..
        } => {
            let ops = update::parse_ops(ops, *index_base)?;
            Ok((point_key(space, key)?, Change::Update(ops)))
        }
        Request::Upsert {
            tuple,
            ops,
            index_base,
            ..
        } => {
            let ops = update::parse_ops(ops, *index_base)?;
            Ok((key_of(space, tuple)?, Change::Upsert(tuple, ops)))
        }
        _ => Err(Failure::new(0, "not a write")),
    }
}

/// A row's whole primary key in the engine's encoding.
fn point_key(space: &Space, key: &[u8]) -> Result<Vec<u8>, Failure> {
    tuple::check_key(key, &space.parts, true)?;
    Ok(canonical_key(key)?.0)
}

/// Whether an `_index` tuple's parts are the space's primary key fields.
fn check_primary_key(space: &Space, index: &[u8]) -> Result<(), String> {
    let theirs = tuple::fields(index)
        .ok()
        .and_then(|f| f.get(5).copied())
        .and_then(part_fields)
        .ok_or_else(|| "its primary index upstream has parts this node cannot read".to_string())?;
    let ours: Vec<u64> = space.parts.iter().map(|p| p.field_no as u64).collect();
    if theirs == ours {
        return Ok(());
    }
    let show = |v: &[u64]| v.iter().map(|n| (n + 1).to_string()).collect::<Vec<_>>();
    Err(format!(
        "its primary key is on fields {:?} upstream and {:?} here",
        show(&theirs),
        show(&ours)
    ))
}

/// The 0-based field numbers of an index's parts: `[[field, type], ...]` or `[{field = n,
/// type = ...}, ...]`, as `_index` holds them.
fn part_fields(parts: &[u8]) -> Option<Vec<u64>> {
    let mut r = Reader::new(parts);
    let n = r.read_array_len().ok()?;
    // Each part takes at least a byte: a count the bytes cannot hold reserves nothing more.
    let mut out = Vec::with_capacity((n as usize).min(parts.len()));
    for _ in 0..n {
        let part = r.read_raw_value(sluice_proto::iproto::MAX_DEPTH).ok()?;
        let mut p = Reader::new(part);
        if let Ok(len) = p.read_array_len() {
            if len == 0 {
                return None;
            }
            out.push(p.read_uint().ok()?);
            continue;
        }
        let mut p = Reader::new(part);
        let mut field = None;
        for _ in 0..p.read_map_len().ok()? {
            let k = p.read_str().ok()?;
            if k == b"field" {
                field = Some(p.read_uint().ok()?);
            } else {
                p.skip_value(sluice_proto::iproto::MAX_DEPTH).ok()?;
            }
        }
        out.push(field?);
    }
    Some(out)
}

fn field_uint(tuple: &[u8], no: usize) -> Option<u64> {
    let fields = tuple::fields(tuple).ok()?;
    Reader::new(fields.get(no)?).read_uint().ok()
}

fn field_str(tuple: &[u8], no: usize) -> Option<String> {
    let fields = tuple::fields(tuple).ok()?;
    let s = Reader::new(fields.get(no)?).read_str().ok()?;
    String::from_utf8(s.to_vec()).ok()
}

fn first_uint(key: &[u8]) -> Option<u64> {
    field_uint(key, 0)
}

fn local(e: sluice_core::Error) -> UpstreamError {
    UpstreamError::Local(format!("this node cannot take the row: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::iproto::xrow::RowHeader;

    #[test]
    fn a_transaction_past_its_bound_is_refused_with_why() {
        let body = vec![0x80u8; 1000];
        let row = Row {
            header: RowHeader::default(),
            body: Some(&body),
        };
        let mut txn = PendingTxn::default();
        for _ in 0..3 {
            txn.push_bounded(&row, 3 << 20).unwrap();
        }
        let row_cost = std::mem::size_of::<PendingRow>() + 1000;
        assert_eq!((txn.len(), txn.bytes), (3, 3 * row_cost));
        let mut big = PendingTxn::default();
        let e = (0..10_000)
            .map(|_| big.push_bounded(&row, 2 << 20))
            .find_map(Result::err)
            .expect("refused past 2 MiB");
        assert!(e.to_string().contains("more than 2 MiB"), "{e}");
        assert_eq!(big.bytes, (2 << 20) / row_cost * row_cost);
        big.clear();
        assert!(big.is_empty() && big.bytes == 0);
        // Rows without a body are bounded as well.
        let empty = Row {
            header: RowHeader::default(),
            body: None,
        };
        let mut bodiless = PendingTxn::default();
        let refused = (0..1_000_000).find(|_| bodiless.push_bounded(&empty, 1 << 20).is_err());
        assert!(refused.is_some_and(|n| n < 1 << 20), "{refused:?}");
    }

    #[test]
    fn index_parts_with_a_count_past_their_bytes_are_not_understood() {
        // An array of 2^32-1 parts in five bytes: nothing is reserved for them.
        assert_eq!(part_fields(&[0xdd, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(
            part_fields(&[0x91, 0x92, 0x00, 0xa3, b'u', b'n', b's']),
            Some(vec![0])
        );
    }
}
