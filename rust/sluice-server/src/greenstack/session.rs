//! One Greenstack connection. Each request goes to its lane's queue; a lane starts the
//! requests at the front of its queue while it may (not behind a fence still running, and a
//! fenced one only once nothing of its lane runs). A request answers at once (a read, a bucket
//! chosen) or later (a write settling at its durability level, a login's password hash, on a
//! task of its own); replies go out as they complete, so a read need not wait for a durable
//! write before it. Bad framing closes the connection with a log line.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use sluice_core::bucket::Bucket;
use sluice_core::config::Durability;
use sluice_core::durability::Requirement;
use sluice_core::engine::{MutationResult, StoreMode, StoreRequest, Update};
use sluice_core::vbucket::VbState;
use sluice_core::Error;
use sluice_proto::greenstack::payload::{self, Fields, MapWriter, Mutation, MutationKind};
use sluice_proto::greenstack::{self as gs, flag, flex_key, opcode, status, Check, Frame};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::dcp::{DcpProducer, Refusal};
use super::reply::{failure, hello_reply, reply, status_of, write_notice, write_success, ReplyTo};
use super::GreenstackContext;
use crate::armed;
use crate::auth::{ADMIN, MECHANISMS, READ, STREAM, WRITE};
use crate::driver::{Conn, End, Flow, Frame as DriverFrame, Out};
use crate::scram::{self, Mechanism};

/// The datatype bit of a JSON value (memcached's).
const DATATYPE_JSON: u8 = 0x01;
/// Replies are written once this much is pending.
const FLUSH_AT: usize = 256 << 10;
/// Requests a connection may have started and not finished, or queued behind a fence.
const MAX_IN_FLIGHT: usize = 4096;
/// The same before login: what a peer that has not logged in can make the server hold stays
/// small (its frames are small too).
const MAX_IN_FLIGHT_PRELOGIN: usize = 16;
/// The priority of a request whose flex header gives none (lower starts first).
const DEFAULT_PRIORITY: u8 = 128;
/// Lanes a connection keeps while idle (their buffers reused by the next request).
const MAX_LANES: usize = 1024;
/// The least time between two failed-login notices to one connection.
const FAILED_LOGIN_NOTICE_EVERY: Duration = Duration::from_secs(1);
/// The least time between two back-off notices to one connection.
const BACKOFF_NOTICE_EVERY: Duration = Duration::from_secs(1);

/// What a request that answers later hands back: its reply frame and what a login did.
type Later = Pin<Box<dyn Future<Output = (Vec<u8>, Login)> + Send>>;

/// The selected bucket behind a handle of the session's own: every request clones it, and
/// cloning the engine's shared `Arc<Bucket>` from every connection on every I/O thread would
/// bounce its reference count between the cores (the memcached front's session does the same).
#[allow(clippy::redundant_allocation)]
type BucketHandle = Arc<Arc<Bucket>>;

/// What a request did to the connection's login.
enum Login {
    None,
    /// Logged in as this user.
    User(String),
}

/// What a refused login is told (whatever was wrong: the user or the password).
const PLAIN_REFUSED: &str = "the user is unknown or the password does not match";

enum Run {
    /// Done: its reply (empty when it was written to the output already, or quiet).
    Now(Vec<u8>),
    Later(Later),
}

/// A request finished: its lane, its place in the order requests were taken, whether it was
/// fenced, its reply (empty for a quiet success), and a login's user.
struct Done {
    lane: Vec<u8>,
    seq: u64,
    fenced: bool,
    reply: Vec<u8>,
    login: Login,
}

#[derive(Default)]
struct Lane {
    /// Requests of the lane started and not finished, by the order they were taken.
    /// (Taken in rising order: pushed at the end, kept sorted.)
    running: Vec<u64>,
    /// A fenced request runs: nothing else of the lane starts until it finishes.
    fenced: bool,
    /// Requests waiting to start.
    queue: VecDeque<Queued>,
    /// Listed in `Session::touched`: it may have requests to start.
    touched: bool,
}

/// A request read, waiting for its lane to let it start.
struct Queued {
    /// Its place in the order requests were read.
    seq: u64,
    /// Its flex header's priority (lower starts first), or DEFAULT_PRIORITY.
    priority: u8,
    fenced: bool,
    /// When it was read, for a request with an "ignore unless executed before" budget.
    read_at: Option<Instant>,
    frame: Bytes,
}

struct Session {
    ctx: Arc<GreenstackContext>,
    /// The opaque of the next request this server sends (a notice).
    next_opaque: u32,
    /// When this connection was last told to back off.
    told_backoff: Option<Instant>,
    /// When this (admin's) connection was last told of a failed login.
    told_failed_login: Option<Instant>,
    peer: SocketAddr,
    hello: bool,
    user: Option<String>,
    /// A SCRAM login between its two steps.
    scram: Option<scram::Exchange>,
    bucket: Option<BucketHandle>,
    /// The user's permissions on `bucket` and the users' generation they were read in.
    perms: std::cell::Cell<Option<(u64, u8)>>,
    /// Whether the user administers the node, and the users' generation it was read in.
    admin: std::cell::Cell<Option<(u64, bool)>>,
    /// DCP, once the connection opened it.
    dcp: Option<DcpProducer>,
    /// The root lane (requests that name none), and the others by their ids.
    root: Lane,
    lanes: HashMap<Vec<u8>, Lane, foldhash::fast::RandomState>,
    /// Queued requests with a priority of their own: while there are none, the order read is
    /// the order to start in.
    prioritized: usize,
    /// Lanes that may have requests to start.
    touched: Vec<Vec<u8>>,
    /// The requests `start_queued` starts in one round (kept for its buffer).
    batch: Vec<(Vec<u8>, Queued)>,
    tasks: JoinSet<Done>,
    /// The WAL position of the connection's last write: no reply is sent before the WAL has
    /// written up to it (`send`), so a write at level none is answered as it is applied and
    /// its reply leaves with the round's others once the WAL has it, as on the memcached port.
    owed_lsn: u64,
    taken: u64,
    in_flight: usize,
    /// Counts kept here and added to the shared ones once per round (an atomic add per
    /// request would bounce their cache line between the cores).
    counted: Counted,
}

#[derive(Default)]
struct Counted {
    requests: u64,
    out_of_order: u64,
}

/// A connection taken during warm-up, going on as a session: it is told warm-up is done.
pub(super) struct WarmStart {
    /// What it sent that was not yet a whole frame.
    pub inbuf: BytesMut,
    pub hello: bool,
    pub next_opaque: u32,
    pub warmup: Duration,
}

/// The connection's waits besides its requests: the changes its DCP streams wait for, failed
/// logins (told to an admin), map changes, and what they produced for the next send.
struct Waits {
    failed_logins: armed::Armed<
        tokio::sync::broadcast::Receiver<super::FailedLogin>,
        Result<super::FailedLogin, tokio::sync::broadcast::error::RecvError>,
    >,
    map_changes: armed::Armed<watch::Receiver<i64>, Result<i64, ()>>,
    /// The selected bucket's change count read before the DCP streams last filled the output:
    /// a change after it wakes the connection.
    changes: Option<(Arc<Bucket>, u64)>,
    /// The streams filled the output: send it and fill again.
    streamed_more: bool,
    /// Replies and notices produced by a wake, for the next send.
    woken: Vec<u8>,
    /// A request's task failed: the connection closes.
    failed: bool,
}

/// One Greenstack connection: its session and its waits.
pub(super) struct Connection {
    s: Session,
    waits: Waits,
    warm: Option<WarmStart>,
    /// Users were configured when it connected: until it logs in, it may have few requests
    /// in flight.
    login_required: bool,
}

impl crate::driver::Session for Connection {
    const FLUSH_AT: usize = FLUSH_AT;

    fn check(&mut self, buf: &[u8], max_frame: usize) -> crate::driver::Check {
        use crate::driver::{Check as Driver, Fault};
        match gs::check(buf, max_frame) {
            Ok(Check::Complete(n)) => Driver::Frame(n),
            Ok(Check::Incomplete(need)) => Driver::Need(need),
            Err(e) => Driver::Bad(Fault::new(matches!(e, gs::DecodeError::TooLarge { .. }), e)),
        }
    }

    /// A request goes to its lane (read in place; copied only if it has to wait for it).
    async fn handle(&mut self, frame: &mut DriverFrame<'_>, out: &mut Out) -> Flow {
        match self.s.take(frame.bytes(), &mut out.acked.buf) {
            Ok(()) => Flow::Continue,
            Err(e) => {
                self.s.ctx.port.io.protocol_error(
                    "greenstack",
                    format_args!("closing Greenstack connection from {}: {e}", self.s.peer),
                );
                Flow::Close
            }
        }
    }

    fn owed_lsn(&self) -> u64 {
        self.s.owed_lsn
    }

    fn logged_in(&self) -> bool {
        self.s.user.is_some()
    }

    /// A connection taken during warm-up is told warm-up is done.
    fn greet(&mut self, out: &mut Out) {
        if let Some(w) = self.warm.take() {
            self.s.hello = w.hello;
            self.s.next_opaque = w.next_opaque;
            self.s.notice(&mut out.acked.buf, "warmup_done", 1, |m| {
                m.uint("warmup_ms", w.warmup.as_millis() as u64);
            });
        }
    }

    /// While the connection has room for more requests in flight (fewer before login).
    fn reading(&self) -> bool {
        let max = match self.login_required && self.s.user.is_none() {
            true => MAX_IN_FLIGHT_PRELOGIN,
            false => MAX_IN_FLIGHT,
        };
        self.s.in_flight < max
    }

    /// Requests under way or streams open: the client may be silent.
    fn waiting(&self) -> bool {
        !self.s.tasks.is_empty() || self.s.dcp.as_ref().is_some_and(DcpProducer::has_streams)
    }

    async fn wake(&mut self) {
        let Connection { s, waits, .. } = self;
        if waits.streamed_more {
            return;
        }
        let can_stream = s.dcp.as_ref().is_some_and(DcpProducer::can_send);
        let changed = async {
            match &waits.changes {
                Some((b, seen)) if can_stream => b.changes.changed(*seen).await,
                _ => std::future::pending().await,
            }
        };
        let admin = s.is_admin_cached();
        let out = &mut waits.woken;
        tokio::select! {
            _ = changed => {}
            rev = waits.map_changes.next() => match rev {
                Ok(rev) => s.map_changed_notice(rev, out),
                // The map lives as long as the server: not before the stop.
                Err(()) => waits.map_changes.disarm(),
            },
            // Only an admin's connection is told; the others let the channel lag behind.
            told = waits.failed_logins.next(), if admin => {
                // Lagged behind a burst: the next one says how many there were. (The sender
                // lives in the context this session holds: it never closes.)
                if let Ok(f) = told {
                    s.failed_login_notice(&f, out);
                }
            }
            Some(done) = s.tasks.join_next() => {
                if s.finish_task(done, out).is_err() {
                    waits.failed = true;
                }
            }
        }
    }

    /// What was read starts, by priority; requests that finished meanwhile answer in the same
    /// write; the DCP streams send what they have. At the stop, the client is told, and the
    /// requests under way finish (nothing new is read).
    async fn settle(&mut self, out: &mut Out, end: Option<End>) -> Flow {
        let Connection { s, waits, .. } = self;
        let buf = &mut out.acked.buf;
        buf.append(&mut waits.woken);
        s.start_queued(buf);
        while let Some(done) = s.tasks.try_join_next() {
            if s.finish_task(done, buf).is_err() {
                return Flow::Close;
            }
        }
        if end == Some(End::Stop) {
            s.shutdown_notice(buf);
            while let Some(done) = s.tasks.join_next().await {
                if s.finish_task(done, buf).is_err() {
                    break;
                }
            }
        }
        // The bucket's change count read first, so that a change after the fill wakes the wait.
        waits.changes = s.dcp.as_ref().map(|d| {
            let b = d.bucket().clone();
            let seen = b.changes.generation();
            (b, seen)
        });
        waits.streamed_more = s.dcp.as_mut().is_some_and(|d| d.fill(buf, FLUSH_AT));
        let counted = std::mem::take(&mut s.counted);
        s.ctx.stats.requests.fetch_add(counted.requests, Relaxed);
        s.ctx
            .stats
            .out_of_order
            .fetch_add(counted.out_of_order, Relaxed);
        match waits.failed {
            true => Flow::Close,
            false => Flow::Continue,
        }
    }
}

/// Runs one connection: `warm`, one taken during warm-up, goes on from what it sent then.
pub(super) async fn run(mut conn: Conn, ctx: Arc<GreenstackContext>, warm: Option<WarmStart>) {
    let s = Session {
        ctx: ctx.clone(),
        next_opaque: 1,
        told_backoff: None,
        told_failed_login: None,
        peer: conn.peer,
        hello: false,
        user: None,
        scram: None,
        bucket: None,
        perms: Default::default(),
        admin: Default::default(),
        dcp: None,
        root: Lane::default(),
        lanes: HashMap::default(),
        prioritized: 0,
        touched: Vec::new(),
        batch: Vec::new(),
        tasks: JoinSet::new(),
        owed_lsn: 0,
        taken: 0,
        in_flight: 0,
        counted: Counted::default(),
    };
    if let Some(w) = &warm {
        conn.inbuf.extend_from_slice(&w.inbuf);
    }
    let waits = Waits {
        failed_logins: armed::broadcasts(ctx.failed_logins.listen()),
        map_changes: {
            let mut rx = ctx.clustermap.subscribe();
            rx.borrow_and_update();
            armed::watch_changes(rx)
        },
        changes: None,
        streamed_more: false,
        woken: Vec::new(),
        failed: false,
    };
    let login_required = conn.before_login();
    let mut c = Connection {
        s,
        waits,
        warm,
        login_required,
    };
    crate::driver::run(&mut conn, &mut c).await;
}

/// The lane a frame's flex header names (the root lane when none).
fn lane_of(f: &Frame<'_>) -> Vec<u8> {
    f.flex_value(flex_key::LANE_ID).unwrap_or_default().to_vec()
}

/// A named lane, made on its first request: its id is copied then only, not per request.
fn lane_entry<'l>(
    lanes: &'l mut HashMap<Vec<u8>, Lane, foldhash::fast::RandomState>,
    lane: &[u8],
) -> &'l mut Lane {
    if !lanes.contains_key(lane) {
        lanes.insert(lane.to_vec(), Lane::default());
    }
    lanes.get_mut(lane).expect("inserted above")
}

/// The lane named `lane` (the root lane for the empty name), if it exists; by its fields, so
/// that a caller may hold the session's other fields at the same time.
fn lane_in<'l>(
    root: &'l mut Lane,
    lanes: &'l mut HashMap<Vec<u8>, Lane, foldhash::fast::RandomState>,
    lane: &[u8],
) -> Option<&'l mut Lane> {
    if lane.is_empty() {
        Some(root)
    } else {
        lanes.get_mut(lane)
    }
}

/// A DCP command's refusal: its status and message, or "rollback" with `rollback_seqno`.
fn refusal(req: &Frame<'_>, refused: Refusal) -> Vec<u8> {
    match refused {
        Refusal::Status(st, why) => failure(req, st, &why),
        Refusal::Rollback(seqno) => {
            let mut p = Vec::new();
            MapWriter::new(&mut p, 2).uint("rollback_seqno", seqno).str(
                "message",
                &format!("roll back to seqno {seqno}, then ask again from there"),
            );
            reply(req, status::ROLLBACK, &p)
        }
    }
}

/// A request's `durability` field as a requirement (None: the bucket's default level), or
/// the failure to answer.
fn durability_of(f: &Frame<'_>, level: Option<&str>) -> Result<Option<Requirement>, Vec<u8>> {
    match level.map(|d| Durability::parse(d).ok_or(d)) {
        None => Ok(None),
        Some(Ok(level)) => Ok(Some(Requirement::from(level))),
        Some(Err(d)) => Err(failure(
            f,
            status::INVALID_ARGUMENTS,
            &format!("field 'durability': no level {d:?}"),
        )),
    }
}

/// Why a request is not run: its flex header's "ignore unless executed before" gave it this
/// many milliseconds from when it was read to start, and it waited longer (behind a fence).
fn waited_too_long(f: &Frame<'_>, read_at: Instant) -> Option<String> {
    let v = f.flex_value(flex_key::IGNORE_UNLESS_EXECUTED_BEFORE)?;
    let budget = u32::from_be_bytes([v[0], v[1], v[2], v[3]]) as u128;
    let waited = read_at.elapsed().as_millis();
    (waited > budget).then(|| {
        format!("not run: it waited {waited} ms to start, and was to start within {budget} ms")
    })
}

impl Session {
    /// A frame read: a request goes to its lane's queue (started by `start_queued`); a
    /// response (to a notice) is dropped. Err closes the connection.
    fn take(&mut self, frame: &[u8], out: &mut Vec<u8>) -> Result<(), gs::DecodeError> {
        let f = Frame::decode(&frame[gs::LENGTH_LEN..])?;
        if f.is_response() {
            return Ok(());
        }
        self.counted.requests += 1;
        let lane = lane_of(&f);
        let priority = f
            .flex_value(flex_key::PRIORITY)
            .map_or(DEFAULT_PRIORITY, |v| v[0]);
        let fenced = f.has(flag::FENCE);
        // Nothing waits that it should wait for, or go after: it starts as it is read.
        if priority == DEFAULT_PRIORITY && self.prioritized == 0 {
            let l = if lane.is_empty() {
                &mut self.root
            } else {
                lane_entry(&mut self.lanes, &lane)
            };
            if l.queue.is_empty() && !l.fenced && (!fenced || l.running.is_empty()) {
                let seq = self.taken;
                l.running.push(seq);
                l.fenced = fenced;
                self.taken += 1;
                self.in_flight += 1;
                self.run(lane, &f, seq, fenced, None, out);
                return Ok(());
            }
        }
        let read_at = f
            .flex_value(flex_key::IGNORE_UNLESS_EXECUTED_BEFORE)
            .map(|_| Instant::now());
        let queued = Queued {
            seq: self.taken,
            priority,
            fenced,
            read_at,
            frame: Bytes::copy_from_slice(frame),
        };
        self.taken += 1;
        self.in_flight += 1;
        if priority != DEFAULT_PRIORITY {
            self.prioritized += 1;
        }
        let l = if lane.is_empty() {
            &mut self.root
        } else {
            lane_entry(&mut self.lanes, &lane)
        };
        l.queue.push_back(queued);
        if !l.touched {
            l.touched = true;
            self.touched.push(lane);
        }
        Ok(())
    }

    /// A lane by its id (the root lane's is empty).
    fn lane_mut(&mut self, lane: &[u8]) -> Option<&mut Lane> {
        lane_in(&mut self.root, &mut self.lanes, lane)
    }

    /// The request at the front of `l`'s queue, taken off it and counted as running, if the
    /// lane lets it start (not behind a fence still running; a fenced one only once nothing
    /// of its lane runs).
    fn next_to_start(l: &mut Lane, prioritized: &mut usize) -> Option<Queued> {
        let front = l.queue.front()?;
        if l.fenced || (front.fenced && !l.running.is_empty()) {
            return None;
        }
        let q = l.queue.pop_front().expect("looked at above");
        // Taken in the order read: `running` stays sorted.
        l.running.push(q.seq);
        l.fenced = q.fenced;
        if q.priority != DEFAULT_PRIORITY {
            *prioritized -= 1;
        }
        Some(q)
    }

    /// Starts every request its lane lets start (not behind a fence still running, and a
    /// fenced one only once nothing of its lane runs), lowest priority value first, then in
    /// the order they were read; those that answer at once finish here, which may let more
    /// start.
    fn start_queued(&mut self, out: &mut Vec<u8>) {
        while !self.touched.is_empty() {
            // One lane and no priorities (the usual case): its queue's order is the order to
            // start in, and requests start straight from it.
            if self.touched.len() == 1 && self.prioritized == 0 {
                let lane = self.touched.pop().expect("one lane");
                if let Some(l) = self.lane_mut(&lane) {
                    l.touched = false;
                }
                while let Some(l) = lane_in(&mut self.root, &mut self.lanes, &lane) {
                    let Some(q) = Session::next_to_start(l, &mut self.prioritized) else {
                        break;
                    };
                    self.start(lane.clone(), q, out);
                }
                continue;
            }
            let mut batch = std::mem::take(&mut self.batch);
            for lane in std::mem::take(&mut self.touched) {
                let Some(l) = lane_in(&mut self.root, &mut self.lanes, &lane) else {
                    continue;
                };
                l.touched = false;
                while let Some(q) = Session::next_to_start(l, &mut self.prioritized) {
                    batch.push((lane.clone(), q));
                }
            }
            batch.sort_unstable_by_key(|(_, q)| (q.priority, q.seq));
            for (lane, q) in batch.drain(..) {
                self.start(lane, q, out);
            }
            self.batch = batch;
        }
        // An idle lane is kept for the next request (its buffers with it); past MAX_LANES the
        // idle ones go.
        if self.lanes.len() > MAX_LANES {
            self.lanes
                .retain(|_, l| !l.running.is_empty() || !l.queue.is_empty());
        }
    }

    /// Runs one request its lane let start: its reply now, after the WAL, or from a task.
    fn start(&mut self, lane: Vec<u8>, q: Queued, out: &mut Vec<u8>) {
        let f = Frame::decode(&q.frame[gs::LENGTH_LEN..]).expect("decoded when taken");
        self.run(lane, &f, q.seq, q.fenced, q.read_at, out);
    }

    /// Runs request `f`, number `seq` of its lane's running ones, read at `read_at` (when it
    /// has a budget to start within).
    fn run(
        &mut self,
        lane: Vec<u8>,
        f: &Frame<'_>,
        seq: u64,
        fenced: bool,
        read_at: Option<Instant>,
        out: &mut Vec<u8>,
    ) {
        let run = match read_at.and_then(|at| waited_too_long(f, at)) {
            Some(why) => {
                self.ctx.stats.not_executed.fetch_add(1, Relaxed);
                Run::Now(failure(f, status::NOT_EXECUTED_IN_TIME, &why))
            }
            None => self.execute(f, out),
        };
        if matches!(f.opcode, opcode::MUTATION | opcode::DELETE | opcode::TOUCH) {
            self.maybe_backoff(out);
        }
        match run {
            Run::Now(reply) => self.finish(
                Done {
                    lane,
                    seq,
                    fenced,
                    reply,
                    login: Login::None,
                },
                out,
            ),
            Run::Later(later) => {
                self.tasks.spawn(async move {
                    let (reply, login) = later.await;
                    Done {
                        lane,
                        seq,
                        fenced,
                        reply,
                        login,
                    }
                });
            }
        }
    }

    /// A request's task ended; Err when it panicked: its lane can never finish it, and the
    /// connection is closed.
    fn finish_task(
        &mut self,
        done: Result<Done, tokio::task::JoinError>,
        out: &mut Vec<u8>,
    ) -> Result<(), ()> {
        match done {
            Ok(d) => {
                self.finish(d, out);
                self.start_queued(out);
                Ok(())
            }
            Err(e) => {
                log::error!(
                    "closing Greenstack connection from {}: a request failed: {e}",
                    self.peer
                );
                Err(())
            }
        }
    }

    /// A request finished: its reply out, its lane told (the fence lifted).
    fn finish(&mut self, d: Done, out: &mut Vec<u8>) {
        let Done {
            lane,
            seq,
            fenced,
            reply,
            login,
        } = d;
        if let Login::User(user) = login {
            self.user = Some(user);
            self.perms.set(None);
            self.admin.set(None);
        }
        out.extend_from_slice(&reply);
        self.in_flight -= 1;
        let l = if lane.is_empty() {
            &mut self.root
        } else {
            match self.lanes.get_mut(&lane) {
                Some(l) => l,
                None => return,
            }
        };
        if let Some(i) = l.running.iter().position(|&s| s == seq) {
            l.running.remove(i);
        }
        if l.running.first().is_some_and(|&s| s < seq) {
            self.counted.out_of_order += 1;
        }
        if fenced {
            l.fenced = false;
        }
        if !l.queue.is_empty() && !l.touched {
            l.touched = true;
            self.touched.push(lane);
        }
    }

    /// Sends the client a notice (a request of opcode NOTICE, `{kind, ...}` with the `n`
    /// fields `fields` writes); what it answers is dropped.
    fn notice(
        &mut self,
        out: &mut Vec<u8>,
        kind: &str,
        n: u32,
        fields: impl FnOnce(&mut MapWriter<'_>),
    ) {
        write_notice(out, self.next_opaque, kind, n, fields);
        self.next_opaque = self.next_opaque.wrapping_add(1);
        self.ctx.stats.notices.fetch_add(1, Relaxed);
    }

    /// `is_admin`, looked up again only when the users were reloaded or the user changed.
    fn is_admin_cached(&self) -> bool {
        let generation = self.ctx.users.generation();
        match self.admin.get() {
            Some((g, a)) if g == generation => a,
            _ => {
                let a = self.is_admin();
                self.admin.set(Some((generation, a)));
                a
            }
        }
    }

    /// Whether the connection's user administers the node (the admin permission on some
    /// bucket): the failed logins of others are told to such connections.
    fn is_admin(&self) -> bool {
        let users = self.ctx.users.current();
        users.required()
            && self
                .user
                .as_deref()
                .and_then(|n| users.get(n))
                .is_some_and(|u| u.buckets.values().any(|p| p & ADMIN != 0))
    }

    /// Someone's login failed: told to an admin's connection, at most once a second (the
    /// count covers the ones between).
    fn failed_login_notice(&mut self, f: &super::FailedLogin, out: &mut Vec<u8>) {
        if self
            .told_failed_login
            .is_some_and(|t| t.elapsed() < FAILED_LOGIN_NOTICE_EVERY)
        {
            return;
        }
        self.told_failed_login = Some(Instant::now());
        self.notice(out, "failed_logins", 3, |m| {
            m.uint("last_minute", f.last_minute)
                .str("user", &f.user)
                .str("from", &f.from.to_string());
        });
    }

    /// The vbucket map changed (a failover, a vbucket moved): a connection with a bucket
    /// selected is told, with the bucket's new config (the JSON Couchbase's clients read).
    fn map_changed_notice(&mut self, rev: i64, out: &mut Vec<u8>) {
        let Some(b) = self.bucket.clone() else {
            return;
        };
        let (rev, config) = {
            let (r, c) = self.ctx.clustermap.bucket_config(&self.ctx.engine, &b);
            (r.max(rev), c)
        };
        self.notice(out, "map_changed", 3, |m| {
            m.str("bucket", b.name())
                .uint("rev", rev.max(0) as u64)
                .str("config", &config);
        });
    }

    /// The server is stopping: requests under way finish, no more are read.
    fn shutdown_notice(&mut self, out: &mut Vec<u8>) {
        self.notice(out, "shutdown", 1, |m| {
            m.str(
                "reason",
                "the server is stopping: requests under way finish, no more are read",
            );
        });
    }

    /// After a write: when the bucket is above its high watermark, tells the client to back
    /// off (at most once a second), with a delay that grows as memory nears the quota.
    fn maybe_backoff(&mut self, out: &mut Vec<u8>) {
        let Some(b) = &self.bucket else {
            return;
        };
        if !b.above_high_watermark()
            || self
                .told_backoff
                .is_some_and(|t| t.elapsed() < BACKOFF_NOTICE_EVERY)
        {
            return;
        }
        let b = b.clone();
        self.told_backoff = Some(Instant::now());
        let (used, quota) = (b.mem_used() as u64, b.config.memory_quota as u64);
        let delay_ms = if used >= quota { 1000 } else { 100 };
        let high = b.config.high_watermark_bytes() as u64;
        self.notice(out, "backoff", 5, |m| {
            m.str("bucket", b.name())
                .uint("delay_ms", delay_ms)
                .uint("mem_used", used)
                .uint("high_watermark", high)
                .uint("memory_quota", quota);
        });
    }

    /// The user's permissions on the selected bucket `b`, looked up again only when the
    /// users were reloaded (or the user or bucket changed, which forget them).
    fn selected_permissions(&self, b: &Bucket) -> u8 {
        let generation = self.ctx.users.generation();
        match self.perms.get() {
            Some((g, p)) if g == generation => p,
            _ => {
                let p = self.permissions(b.name());
                self.perms.set(Some((generation, p)));
                p
            }
        }
    }

    /// The permissions of the connection's user on `bucket`.
    fn permissions(&self, bucket: &str) -> u8 {
        let who = match &self.user {
            Some(name) => crate::request::Principal::User(name),
            None => crate::request::Principal::Nobody,
        };
        crate::request::permissions(&self.ctx.users.current(), who, bucket)
    }

    /// Runs a request. A reply that is ready at once (GET's) may be appended to `out` here,
    /// its `Run::Now` then empty.
    fn execute(&mut self, f: &Frame<'_>, out: &mut Vec<u8>) -> Run {
        if f.opcode != opcode::HELLO && !self.hello {
            return Run::Now(failure(f, status::INVALID_STATE, "say HELLO first"));
        }
        // The hot paths read their payloads once, taking their fields as they go.
        match f.opcode {
            opcode::GET => {
                self.get(f, out);
                return Run::Now(Vec::new());
            }
            opcode::MUTATION => return self.mutation(f, out),
            _ => {}
        }
        let fields = match Fields::parse(f.payload) {
            Ok(x) => x,
            Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
        };
        match f.opcode {
            opcode::HELLO => {
                self.hello = true;
                Run::Now(hello_reply(f))
            }
            opcode::SASL_AUTH => self.sasl_auth(f, &fields),
            opcode::SELECT_BUCKET => Run::Now(self.select_bucket(f, &fields)),
            opcode::LIST_BUCKETS => {
                let names: Vec<String> = self
                    .ctx
                    .engine
                    .buckets()
                    .iter()
                    .map(|b| b.name().to_string())
                    .filter(|n| self.permissions(n) != 0)
                    .collect();
                let mut p = Vec::new();
                MapWriter::new(&mut p, 1).strs("buckets", names.iter().map(String::as_str));
                Run::Now(reply(f, status::SUCCESS, &p))
            }
            opcode::DELETE | opcode::TOUCH => self.delete_or_touch(f, &fields, out),
            opcode::GET_ALL_VB_SEQNOS => Run::Now(self.all_vb_seqnos(f, &fields)),
            opcode::DCP_OPEN => Run::Now(self.dcp_open(f, &fields)),
            opcode::DCP_STREAM_REQUEST | opcode::DCP_CLOSE_STREAM | opcode::DCP_BUFFER_ACK => {
                Run::Now(self.dcp_command(f, &fields))
            }
            _ => {
                self.ctx.stats.unknown_commands.fetch_add(1, Relaxed);
                Run::Now(failure(
                    f,
                    status::UNKNOWN_COMMAND,
                    &format!("opcode {:#06x} is not one this server serves", f.opcode),
                ))
            }
        }
    }

    /// SASL AUTH: PLAIN in one step; SCRAM in two (the client-first message, answered
    /// "authentication continue" with the server-first one; then the client-final message,
    /// which begins `c=`). A step that checks a secret waits the turn failed logins impose
    /// (shared with the other fronts) and is checked off the connection's task.
    fn sasl_auth(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Run {
        let (mechanism, challenge) = match (
            fields.required("mechanism", Fields::str),
            fields.required("challenge", Fields::bytes),
        ) {
            (Ok(m), Ok(c)) => (m, c),
            (Err(e), _) | (_, Err(e)) => {
                return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string()))
            }
        };
        let users = self.ctx.users.current();
        let scram = match mechanism {
            "PLAIN" => None,
            m => match Mechanism::from_sasl_name(m.as_bytes()) {
                Some(m) => Some(m),
                None => {
                    return Run::Now(failure(
                        f,
                        status::INVALID_ARGUMENTS,
                        &format!("mechanism {mechanism:?}: this server takes {MECHANISMS}"),
                    ))
                }
            },
        };
        let refused = |why: &str| failure(f, status::AUTHENTICATION_ERROR, why);
        // Whoever logs in next, the permissions are read again.
        self.perms.set(None);
        self.admin.set(None);
        let Some(m) = scram else {
            self.user = None;
            self.scram = None;
            let user = crate::auth::plain_user(challenge).to_vec();
            let challenge = challenge.to_vec();
            return self.check_secret(f, user, refused(PLAIN_REFUSED), move |users| {
                if users.required() {
                    users
                        .authenticate_plain(&challenge)
                        .map(|u| (u, Vec::new()))
                } else {
                    Some((
                        String::from_utf8_lossy(crate::auth::plain_user(&challenge)).into_owned(),
                        Vec::new(),
                    ))
                }
            });
        };
        if !challenge.starts_with(b"c=") {
            // A client-first message: a new login forgets the last.
            self.user = None;
            self.scram = None;
            if !users.required() {
                return Run::Now(match scram::parse_client_first(challenge) {
                    Ok(first) => {
                        self.user = Some(first.user);
                        reply(f, status::SUCCESS, &[])
                    }
                    Err(e) => refused(&e.to_string()),
                });
            }
            return Run::Now(match users.scram_start(m, challenge) {
                Ok((exchange, server_first)) => {
                    self.scram = Some(exchange);
                    let mut p = Vec::new();
                    MapWriter::new(&mut p, 1).bin("challenge", server_first.as_bytes());
                    reply(f, status::AUTHENTICATION_CONTINUE, &p)
                }
                Err(e) => refused(&e.to_string()),
            });
        }
        let exchange = match self.scram.take() {
            Some(ex) if ex.mechanism() == m => ex,
            Some(ex) => {
                return Run::Now(refused(&format!(
                    "the SCRAM exchange under way is {}, not {mechanism}",
                    ex.mechanism().sasl_name()
                )))
            }
            None => {
                return Run::Now(refused(
                    "a client-final message with no SCRAM exchange under way: send the client-first one first",
                ))
            }
        };
        let user = exchange.user().as_bytes().to_vec();
        let client_final = challenge.to_vec();
        self.check_secret(f, user, refused(PLAIN_REFUSED), move |users| {
            let name = exchange.user().to_string();
            match exchange.finish(&client_final) {
                // Removed by a reload since the exchange started: no longer a user.
                Ok(server_final) if users.get(&name).is_some() => {
                    let mut p = Vec::new();
                    MapWriter::new(&mut p, 1).bin("challenge", server_final.as_bytes());
                    Some((name, p))
                }
                Ok(_) | Err(_) => None,
            }
        })
    }

    /// A login step that checks a secret: after the wait failed logins impose, `check` runs
    /// off the async workers and gives the user and the success reply's payload, or None
    /// (answered `refused`, counted, logged and told to the admins).
    fn check_secret(
        &self,
        f: &Frame<'_>,
        user: Vec<u8>,
        refused: Vec<u8>,
        check: impl FnOnce(&crate::auth::Users) -> Option<(String, Vec<u8>)> + Send + 'static,
    ) -> Run {
        let ip = self.peer.ip();
        let ctx = self.ctx.clone();
        let to = ReplyTo::of(f);
        Run::Later(Box::pin(async move {
            let Some(wait) = ctx.throttle.turn(&user, ip) else {
                ctx.port.prelogin.stats.auth_failures.fetch_add(1, Relaxed);
                return (refused, Login::None);
            };
            tokio::time::sleep(wait).await;
            let users = ctx.users.current();
            let who = tokio::task::spawn_blocking(move || check(&users))
                .await
                .ok()
                .flatten();
            match who {
                Some((name, payload)) => {
                    ctx.throttle.succeeded(&user);
                    (to.reply(status::SUCCESS, &payload), Login::User(name))
                }
                None => {
                    ctx.throttle.failed(&user, ip);
                    ctx.failed_logins
                        .record(&String::from_utf8_lossy(&user), ip);
                    ctx.port.prelogin.stats.auth_failures.fetch_add(1, Relaxed);
                    ctx.throttle.log.warn(|| {
                        format!(
                            "failed Greenstack login for user {:?} from {ip}",
                            String::from_utf8_lossy(&user)
                        )
                    });
                    (refused, Login::None)
                }
            }
        }))
    }

    fn select_bucket(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let name = match fields.required("name", Fields::str) {
            Ok(n) => n,
            Err(e) => return failure(f, status::INVALID_ARGUMENTS, &e.to_string()),
        };
        // A bucket the user may not use answers as one that does not exist.
        match self.ctx.engine.bucket(name) {
            Ok(b) if self.permissions(name) != 0 => {
                self.bucket = Some(Arc::new(b));
                self.perms.set(None);
                self.admin.set(None);
                reply(f, status::SUCCESS, &[])
            }
            Ok(_) | Err(_) => failure(f, status::NOT_FOUND, &format!("no bucket {name:?}")),
        }
    }

    /// The selected bucket if the user has `need` on it; else the failure to answer.
    fn bucket_for(&self, f: &Frame<'_>, need: u8) -> Result<&BucketHandle, Vec<u8>> {
        let Some(b) = &self.bucket else {
            return Err(failure(f, status::INVALID_STATE, "select a bucket first"));
        };
        if self.selected_permissions(b) & need != need {
            return Err(failure(
                f,
                status::NO_ACCESS,
                &format!("the user lacks that permission on bucket {}", b.name()),
            ));
        }
        Ok(b)
    }

    /// GET `{id}`: the reply goes straight into `out` (the read path allocates nothing).
    fn get(&mut self, f: &Frame<'_>, out: &mut Vec<u8>) {
        let id = match payload::get_id(f.payload) {
            Ok(id) => id,
            Err(e) => {
                return out.extend_from_slice(&failure(
                    f,
                    status::INVALID_ARGUMENTS,
                    &e.to_string(),
                ))
            }
        };
        let bucket = match self.bucket_for(f, READ) {
            Ok(b) => b,
            Err(reply) => return out.extend_from_slice(&reply),
        };
        let found = self.ctx.engine.get_with(bucket, id, |value, meta| {
            write_success(f, out, |p| {
                MapWriter::new(p, 4)
                    .bin("value", value)
                    .uint("flags", meta.flags as u64)
                    .uint("cas", meta.cas)
                    .uint("datatype", meta.datatype as u64);
            })
        });
        match found {
            Ok(Some(())) => {}
            Ok(None) => {
                out.extend_from_slice(&failure(f, status::NOT_FOUND, "no document of that id"))
            }
            Err(e) => out.extend_from_slice(&failure(f, status_of(&e), &e.to_string())),
        }
    }

    /// MUTATION: applied now, answered once it meets its durability level.
    fn mutation(&mut self, f: &Frame<'_>, out: &mut Vec<u8>) -> Run {
        let m = match Mutation::parse(f.payload) {
            Ok(m) => m,
            Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
        };
        let bucket = match self.bucket_for(f, WRITE) {
            Ok(b) => b,
            Err(reply) => return Run::Now(reply),
        };
        let durability = match durability_of(f, m.durability) {
            Ok(d) => d,
            Err(reply) => return Run::Now(reply),
        };
        let engine = &self.ctx.engine;
        let written = match m.kind {
            MutationKind::Add | MutationKind::Set | MutationKind::Replace => {
                let mode = match m.kind {
                    MutationKind::Add => StoreMode::Add,
                    MutationKind::Set => StoreMode::Set,
                    _ => StoreMode::Replace,
                };
                engine.write_store(
                    bucket,
                    &StoreRequest {
                        key: m.id,
                        value: m.value,
                        flags: m.flags,
                        expiry: m.expiration,
                        datatype: m.datatype,
                        cas: m.cas,
                        mode,
                        durability,
                    },
                )
            }
            MutationKind::Append | MutationKind::Prepend => engine.write_concat(
                bucket,
                m.id,
                m.value,
                m.kind == MutationKind::Append,
                m.cas,
                durability,
            ),
            MutationKind::Patch => engine
                .write_update(bucket, m.id, m.cas, durability, |cur| {
                    let cur = cur.ok_or(Error::NotFound)?;
                    let value = super::patch::apply(cur.value(), m.value)
                        .map_err(Error::InvalidArgument)?;
                    Ok(Update {
                        value,
                        flags: cur.meta.flags,
                        expiry: cur.meta.expiry,
                        datatype: DATATYPE_JSON,
                    })
                })
                .map(|w| w.map(|(r, _)| r)),
        };
        self.answer_write(f, written, out)
    }

    /// DELETE `{id, cas?, durability?}` and TOUCH `{id, expiration, durability?}`.
    fn delete_or_touch(&mut self, f: &Frame<'_>, fields: &Fields<'_>, out: &mut Vec<u8>) -> Run {
        let bucket = match self.bucket_for(f, WRITE) {
            Ok(b) => b,
            Err(reply) => return Run::Now(reply),
        };
        let parsed = (|| {
            let id = fields.required("id", Fields::bytes)?;
            let durability = fields.str("durability")?;
            Ok::<_, sluice_proto::greenstack::payload::PayloadError>((id, durability))
        })();
        let (id, durability) = match parsed {
            Ok(x) => x,
            Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
        };
        let durability = match durability_of(f, durability) {
            Ok(d) => d,
            Err(reply) => return Run::Now(reply),
        };
        let engine = &self.ctx.engine;
        let written = if f.opcode == opcode::DELETE {
            match fields.uint("cas") {
                Ok(cas) => engine.write_delete(bucket, id, cas.unwrap_or(0), durability),
                Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
            }
        } else {
            match fields.required("expiration", |f, n| f.uint_max(n, u32::MAX as u64)) {
                Ok(exp) => engine
                    .write_touch(bucket, id, exp as u32, durability)
                    .map(|w| w.map(|(r, _)| r)),
                Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
            }
        };
        self.answer_write(f, written, out)
    }

    /// A write's answer: `{cas, seqno, vbucket_uuid}`, written to `out` now when its level is
    /// none (sent once the WAL has it, `send`), else once it meets its durability level (on a
    /// task of its own); or its failure now.
    fn answer_write(
        &mut self,
        f: &Frame<'_>,
        written: sluice_core::Result<sluice_core::engine::Written<MutationResult>>,
        out: &mut Vec<u8>,
    ) -> Run {
        let w = match written {
            Ok(w) => w,
            Err(e) => return Run::Now(failure(f, status_of(&e), &e.to_string())),
        };
        let (cas, seqno, uuid) = (w.value.cas, w.value.seqno, w.value.vbucket_uuid);
        let stored = move |p: &mut Vec<u8>| {
            MapWriter::new(p, 3)
                .uint("cas", cas)
                .uint("seqno", seqno)
                .uint("vbucket_uuid", uuid);
        };
        if !w.needs_settling() {
            self.owed_lsn = self.owed_lsn.max(w.lsn());
            write_success(f, out, stored);
            return Run::Now(Vec::new());
        }
        let to = ReplyTo::of(f);
        let engine = self.ctx.engine.clone();
        // The bucket the write was made in: the selected one (cloned only for a write that waits).
        let Some(bucket) = self.bucket.clone() else {
            return Run::Now(failure(f, status::INVALID_STATE, "select a bucket first"));
        };
        Run::Later(Box::pin(async move {
            let timer = tokio::time::sleep(engine.settle_timeout(&bucket, &w));
            match engine.settled(&bucket, w, timer).await {
                Ok(_) => (to.reply_with(status::SUCCESS, 0, stored), Login::None),
                Err(e) => (to.failure(status_of(&e), &e.to_string()), Login::None),
            }
        }))
    }

    /// DCP OPEN `{name, buffer_size?}`: needs the `stream` permission on the selected bucket.
    fn dcp_open(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let bucket = match self.bucket_for(f, STREAM) {
            Ok(b) => b,
            Err(reply) => return reply,
        };
        if self.dcp.is_some() {
            return failure(
                f,
                status::INVALID_STATE,
                "this connection has opened DCP already",
            );
        }
        match DcpProducer::open(self.ctx.clone(), Arc::clone(bucket), fields) {
            Ok(d) => {
                self.dcp = Some(d);
                reply(f, status::SUCCESS, &[])
            }
            Err(refused) => refusal(f, refused),
        }
    }

    /// DCP STREAM REQUEST, CLOSE STREAM and BUFFER ACK, once DCP is open.
    fn dcp_command(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let Some(dcp) = self.dcp.as_ref() else {
            return failure(f, status::INVALID_STATE, "open DCP first (DCP OPEN)");
        };
        // Checked again per stream, not only at OPEN: a users reload that took the permission
        // away refuses the connection's next streams, as the memcached port does.
        let bucket = dcp.bucket().name();
        if f.opcode == opcode::DCP_STREAM_REQUEST && self.permissions(bucket) & STREAM != STREAM {
            return failure(
                f,
                status::NO_ACCESS,
                &format!("the user lacks the stream permission on bucket {bucket}"),
            );
        }
        let dcp = self.dcp.as_mut().expect("checked above");
        let to = ReplyTo::of(f);
        let done = match f.opcode {
            opcode::DCP_STREAM_REQUEST => match dcp.stream_request(f.opaque, fields) {
                Ok(failover_log) => {
                    let mut p = Vec::new();
                    sluice_proto::msgpack::write_map_len(&mut p, 1);
                    sluice_proto::msgpack::write_str(&mut p, "failover_log");
                    sluice_proto::msgpack::write_array_len(&mut p, failover_log.len() as u32);
                    for (uuid, seqno) in failover_log {
                        sluice_proto::msgpack::write_array_len(&mut p, 2);
                        sluice_proto::msgpack::write_uint(&mut p, uuid);
                        sluice_proto::msgpack::write_uint(&mut p, seqno);
                    }
                    // The stream's messages follow; its STREAM END is the last frame.
                    return to.reply_flagged(status::SUCCESS, flag::MORE, &p);
                }
                Err(refused) => Err(refused),
            },
            opcode::DCP_CLOSE_STREAM => {
                let mut end = Vec::new();
                match dcp.close_stream(fields, &mut end) {
                    Ok(()) => {
                        end.extend_from_slice(&to.reply(status::SUCCESS, &[]));
                        return end;
                    }
                    Err(refused) => Err(refused),
                }
            }
            _ => dcp.buffer_ack(fields),
        };
        match done {
            Ok(()) => to.reply(status::SUCCESS, &[]),
            Err(refused) => refusal(f, refused),
        }
    }

    /// GET_ALL_VB_SEQNOS `{state?}` ("active" by default): `{vbuckets: [[vbucket, seqno]...]}`.
    fn all_vb_seqnos(&self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let bucket = match self.bucket_for(f, READ) {
            Ok(b) => b,
            Err(reply) => return reply,
        };
        let state = match fields.str("state") {
            Ok(None) => VbState::Active,
            Ok(Some(s)) => match VbState::parse(s) {
                Some(st) => st,
                None => {
                    return failure(
                        f,
                        status::INVALID_ARGUMENTS,
                        &format!("field 'state': no vbucket state {s:?}"),
                    )
                }
            },
            Err(e) => return failure(f, status::INVALID_ARGUMENTS, &e.to_string()),
        };
        let engine = &self.ctx.engine;
        let seqnos: Vec<(u16, u64)> = engine
            .high_seqnos(bucket)
            .into_iter()
            .enumerate()
            .map(|(vb, high)| (vb as u16, high))
            .filter(|&(vb, _)| engine.vbucket_state(bucket, vb) == Some(state))
            .collect();
        let mut p = Vec::new();
        sluice_proto::msgpack::write_map_len(&mut p, 1);
        sluice_proto::msgpack::write_str(&mut p, "vbuckets");
        sluice_proto::msgpack::write_array_len(&mut p, seqnos.len() as u32);
        for (vb, high) in seqnos {
            sluice_proto::msgpack::write_array_len(&mut p, 2);
            sluice_proto::msgpack::write_uint(&mut p, vb as u64);
            sluice_proto::msgpack::write_uint(&mut p, high);
        }
        reply(f, status::SUCCESS, &p)
    }
}
