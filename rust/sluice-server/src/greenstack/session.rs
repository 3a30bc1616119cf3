//! A Greenstack session's state and its lane scheduler. Each request goes to its lane's queue; a
//! lane starts the requests at the front of its queue while it may (not behind a fence still
//! running, and a fenced one only once nothing of its lane runs). A request answers at once (a
//! read, a bucket chosen) or later (a write settling at its durability level, a login's password
//! hash, on a task of its own); replies go out as they complete, so a read need not wait for a
//! durable write before it. `execute` dispatches a request to the file of its concept: `sasl`
//! (login), `kv` (buckets and documents), `dcp_requests`, `notices` (what the server tells
//! unasked); `connection` runs the session in the driver.

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
use sluice_proto::greenstack::payload::{Fields, MapWriter};
use sluice_proto::greenstack::{self as gs, flag, flex_key, opcode, status, Frame};
use tokio::task::JoinSet;

use super::dcp::{DcpProducer, Refusal};
use super::reply::{failure, hello_reply, reply};
use super::GreenstackContext;
use crate::scram::{self};

/// The datatype bit of a JSON value (memcached's).
pub(super) const DATATYPE_JSON: u8 = 0x01;
/// Replies are written once this much is pending.
pub(super) const FLUSH_AT: usize = 256 << 10;
/// Requests a connection may have started and not finished, or queued behind a fence.
pub(super) const MAX_IN_FLIGHT: usize = 4096;
/// The same before login: what a peer that has not logged in can make the server hold stays
/// small (its frames are small too).
pub(super) const MAX_IN_FLIGHT_PRELOGIN: usize = 16;
/// The priority of a request whose flex header gives none (lower starts first).
pub(super) const DEFAULT_PRIORITY: u8 = 128;
/// Lanes a connection keeps while idle (their buffers reused by the next request).
pub(super) const MAX_LANES: usize = 1024;
/// The least time between two failed-login notices to one connection.
pub(super) const FAILED_LOGIN_NOTICE_EVERY: Duration = Duration::from_secs(1);
/// The least time between two back-off notices to one connection.
pub(super) const BACKOFF_NOTICE_EVERY: Duration = Duration::from_secs(1);

/// What a request that answers later hands back: its reply frame and what a login did.
pub(super) type Later = Pin<Box<dyn Future<Output = (Vec<u8>, Login)> + Send>>;

/// The selected bucket behind a handle of the session's own: every request clones it, and
/// cloning the engine's shared `Arc<Bucket>` from every connection on every I/O thread would
/// bounce its reference count between the cores (the memcached front's session does the same).
#[allow(clippy::redundant_allocation)]
pub(super) type BucketHandle = Arc<Arc<Bucket>>;

/// What a request did to the connection's login.
pub(super) enum Login {
    None,
    /// Logged in as this user.
    User(String),
}

/// What a refused login is told (whatever was wrong: the user or the password).
pub(super) const PLAIN_REFUSED: &str = "the user is unknown or the password does not match";

pub(super) enum Run {
    /// Done: its reply (empty when it was written to the output already, or quiet).
    Now(Vec<u8>),
    Later(Later),
}

/// A request finished: its lane, its place in the order requests were taken, whether it was
/// fenced, its reply (empty for a quiet success), and a login's user.
pub(super) struct Done {
    pub(super) lane: Vec<u8>,
    pub(super) seq: u64,
    pub(super) fenced: bool,
    pub(super) reply: Vec<u8>,
    pub(super) login: Login,
}

#[derive(Default)]
pub(super) struct Lane {
    /// Requests of the lane started and not finished, by the order they were taken.
    /// (Taken in rising order: pushed at the end, kept sorted.)
    pub(super) running: Vec<u64>,
    /// A fenced request runs: nothing else of the lane starts until it finishes.
    pub(super) fenced: bool,
    /// Requests waiting to start.
    pub(super) queue: VecDeque<Queued>,
    /// Listed in `Session::touched`: it may have requests to start.
    pub(super) touched: bool,
}

/// A request read, waiting for its lane to let it start.
pub(super) struct Queued {
    /// Its place in the order requests were read.
    pub(super) seq: u64,
    /// Its flex header's priority (lower starts first), or DEFAULT_PRIORITY.
    pub(super) priority: u8,
    pub(super) fenced: bool,
    /// When it was read, for a request with an "ignore unless executed before" budget.
    pub(super) read_at: Option<Instant>,
    pub(super) frame: Bytes,
}

pub(super) struct Session {
    pub(super) ctx: Arc<GreenstackContext>,
    /// The opaque of the next request this server sends (a notice).
    pub(super) next_opaque: u32,
    /// When this connection was last told to back off.
    pub(super) told_backoff: Option<Instant>,
    /// When this (admin's) connection was last told of a failed login.
    pub(super) told_failed_login: Option<Instant>,
    pub(super) peer: SocketAddr,
    /// When the driver closes it if it has not logged in by then (None: never): a login held
    /// by the throttle is answered before.
    pub(super) login_deadline: Option<Instant>,
    /// Logins are refused on it (`require_tls`, plain text from beyond loopback).
    pub(super) login_needs_tls: bool,
    pub(super) hello: bool,
    pub(super) user: Option<String>,
    /// A SCRAM login between its two steps.
    pub(super) scram: Option<scram::Exchange>,
    pub(super) bucket: Option<BucketHandle>,
    /// The user's permissions on `bucket` and the users' generation they were read in.
    pub(super) perms: std::cell::Cell<Option<(u64, u8)>>,
    /// Whether the user administers the node, and the users' generation it was read in.
    pub(super) admin: std::cell::Cell<Option<(u64, bool)>>,
    /// DCP, once the connection opened it.
    pub(super) dcp: Option<DcpProducer>,
    /// The root lane (requests that name none), and the others by their ids.
    pub(super) root: Lane,
    pub(super) lanes: HashMap<Vec<u8>, Lane, foldhash::fast::RandomState>,
    /// Queued requests with a priority of their own: while there are none, the order read is
    /// the order to start in.
    pub(super) prioritized: usize,
    /// Lanes that may have requests to start.
    pub(super) touched: Vec<Vec<u8>>,
    /// The requests `start_queued` starts in one round (kept for its buffer).
    pub(super) batch: Vec<(Vec<u8>, Queued)>,
    pub(super) tasks: JoinSet<Done>,
    /// The WAL position of the connection's last write: no reply is sent before the WAL has
    /// written up to it (`send`), so a write at level none is answered as it is applied and
    /// its reply leaves with the round's others once the WAL has it, as on the memcached port.
    pub(super) owed_lsn: u64,
    pub(super) taken: u64,
    pub(super) in_flight: usize,
    /// Counts kept here and added to the shared ones once per round (an atomic add per
    /// request would bounce their cache line between the cores).
    pub(super) counted: Counted,
}

#[derive(Default)]
pub(super) struct Counted {
    pub(super) requests: u64,
    pub(super) out_of_order: u64,
}

/// A connection taken during warm-up, going on as a session: it is told warm-up is done.
pub(super) struct WarmStart {
    /// What it sent that was not yet a whole frame.
    pub inbuf: BytesMut,
    pub hello: bool,
    pub next_opaque: u32,
    pub warmup: Duration,
}

/// The lane a frame's flex header names (the root lane when none).
pub(super) fn lane_of(f: &Frame<'_>) -> Vec<u8> {
    f.flex_value(flex_key::LANE_ID).unwrap_or_default().to_vec()
}

/// A named lane, made on its first request: its id is copied then only, not per request.
pub(super) fn lane_entry<'l>(
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
pub(super) fn lane_in<'l>(
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
pub(super) fn refusal(req: &Frame<'_>, refused: Refusal) -> Vec<u8> {
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
pub(super) fn durability_of(
    f: &Frame<'_>,
    level: Option<&str>,
) -> Result<Option<Requirement>, Vec<u8>> {
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
pub(super) fn waited_too_long(f: &Frame<'_>, read_at: Instant) -> Option<String> {
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
    pub(super) fn take(&mut self, frame: &[u8], out: &mut Vec<u8>) -> Result<(), gs::DecodeError> {
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
    pub(super) fn lane_mut(&mut self, lane: &[u8]) -> Option<&mut Lane> {
        lane_in(&mut self.root, &mut self.lanes, lane)
    }

    /// The request at the front of `l`'s queue, taken off it and counted as running, if the
    /// lane lets it start (not behind a fence still running; a fenced one only once nothing
    /// of its lane runs).
    pub(super) fn next_to_start(l: &mut Lane, prioritized: &mut usize) -> Option<Queued> {
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
    pub(super) fn start_queued(&mut self, out: &mut Vec<u8>) {
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
    pub(super) fn start(&mut self, lane: Vec<u8>, q: Queued, out: &mut Vec<u8>) {
        let f = Frame::decode(&q.frame[gs::LENGTH_LEN..]).expect("decoded when taken");
        self.run(lane, &f, q.seq, q.fenced, q.read_at, out);
    }

    /// Runs request `f`, number `seq` of its lane's running ones, read at `read_at` (when it
    /// has a budget to start within).
    pub(super) fn run(
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
    pub(super) fn finish_task(
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
    pub(super) fn finish(&mut self, d: Done, out: &mut Vec<u8>) {
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

    /// The user's permissions on the selected bucket `b`, looked up again only when the
    /// users were reloaded (or the user or bucket changed, which forget them).
    pub(super) fn selected_permissions(&self, b: &Bucket) -> u8 {
        let generation = self.ctx.port.users.generation();
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
    pub(super) fn permissions(&self, bucket: &str) -> u8 {
        let who = match &self.user {
            Some(name) => crate::request::Principal::User(name),
            None => crate::request::Principal::Nobody,
        };
        crate::request::permissions(&self.ctx.port.users.current(), who, bucket)
    }

    /// Runs a request. A reply that is ready at once (GET's) may be appended to `out` here,
    /// its `Run::Now` then empty.
    pub(super) fn execute(&mut self, f: &Frame<'_>, out: &mut Vec<u8>) -> Run {
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
                    .port
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
}
