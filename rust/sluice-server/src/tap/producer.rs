//! A TAP producer connection: after TAP_CONNECT the server streams the chosen vbuckets' changes
//! as TAP messages (seed 000), each with the next sequence number as its opaque.
//!
//! With SUPPORT_ACK the server asks for an ACK every `ack_interval` messages (and on the last
//! message before it goes idle, and always on TAP_VBUCKET_SET); one ACK covers everything
//! before it; sending pauses while `ack_window` messages are unacknowledged. A TMPFAIL or BUSY
//! answer puts that message back at the head of the queue and suspends the connection for the
//! back-off. A named session outlives its connection for the grace period (see `session`).
//! An AckPolicy, RetransmitPolicy or StreamFilter plugin may take those decisions instead.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tls::MaybeTls;
use bytes::BytesMut;
use parking_lot::Mutex;
use sluice_core::bucket::Bucket;
use sluice_core::hlc;
use sluice_core::vbucket::VbState;
use sluice_core::Engine;
use sluice_proto::dcp::stream_end_reason;
use sluice_proto::mcbp::{self, magic, status};
use sluice_proto::tap::{connect_flag, opaque_code, opcode, TapConnect, TapMessage};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use super::session::{restamp, Claim, Found, Full, Unacked};
use super::staged::{encode, Encoded, Skip, Staged, TapEncoding};
use super::TapContext;
use crate::kv::{Flow, Handoff, KvSession};
use crate::policy::{
    AckStats, Answer, FilterBatch, FilterDecision, Pending, PolicyKind, Question, RetransmitEvent,
};
use crate::stream::{turn_order, Encoding, Progress, Stream, Takeover};

/// What a round encodes before its output is written, and what it stages without a
/// StreamFilter. 256 and 512 KiB measured alike; 1 MiB slower (staging and output no longer
/// stay in cache).
const ROUND_BYTES: usize = 512 << 10;
/// What is staged for one StreamFilter question, sent over several rounds. Each question
/// wakes the plugin's thread, CPU a busy machine takes from the connection; larger batches
/// wait longer for their answer and leave the cache. 512 KiB, 1 and 2 MiB measured alike.
const FILTER_BATCH_BYTES: usize = 1 << 20;
/// What one vbucket stream may stage per turn, so that streams share the connection fairly.
const TURN_BYTES: usize = 64 << 10;
/// How long a new connection waits for the old holder of its name to give the session up.
const TAKE_NAME_WAIT: Duration = Duration::from_secs(2);

/// The `[tap]` settings.
#[derive(Debug, Clone)]
pub struct TapConfig {
    pub ack_interval: u32,
    pub ack_window: u32,
    pub grace_period: Duration,
    pub backoff: Duration,
    /// Hops an item written on this node is sent with.
    pub ttl: u8,
    /// Named sessions (live or parked) at most; TAP_CONNECT with a new name past it gets
    /// ETMPFAIL.
    pub max_sessions: usize,
    /// The ACK window in bytes: sending pauses while a session holds this much unacknowledged.
    pub max_unacked_bytes: usize,
}

impl Default for TapConfig {
    fn default() -> Self {
        TapConfig {
            ack_interval: 1000,
            ack_window: 10_000,
            grace_period: Duration::from_secs(300),
            backoff: Duration::from_secs(1),
            ttl: 1,
            max_sessions: 64,
            max_unacked_bytes: 16 << 20,
        }
    }
}

/// A TAP client's state: what a named session keeps across connections.
pub struct TapSession {
    bucket: Arc<Bucket>,
    name: String,
    connect: TapConnect,
    streams: BTreeMap<u16, Stream>,
    turn: u16,
    enc: TapEncoding,
    open_checkpoints: BTreeMap<u16, u64>,
    next_seq: u32,
    unacked: Unacked,
    /// Messages to send again first (a reconnect, a temporary failure), as sent before.
    resend: VecDeque<Vec<u8>>,
    since_ack: u32,
    ack_interval: u32,
    window: u32,
    window_bytes: usize,
    sent_total: u64,
    acked_total: u64,
    /// TAP_VBUCKET_SET active messages whose ACK completes a takeover: (seq, vbucket).
    takeover_acks: Vec<(u32, u16)>,
    temp_failures_in_a_row: u32,
    close_sent: bool,
    /// The batch being sent, over as many rounds as its size and the ACK window take.
    current: Option<Judged>,
    /// With a StreamFilter, the batch after `current`, staged and put to the plugin: the
    /// plugin judges it while the connection sends `current`.
    ahead: Option<Judged>,
    /// Staging buffers not in use, kept for their capacity.
    spare: Vec<Staged>,
}

/// A staged batch, the StreamFilter's answer about it, and how far it has been sent.
struct Judged {
    /// Shared with the StreamFilter's thread while it may read the keys.
    staged: Arc<Staged>,
    /// The question put to the StreamFilter, until its answer is collected into `decision`.
    verdict: Option<Pending>,
    decision: Option<FilterDecision>,
    /// Events, and documents among them, encoded so far.
    next_event: usize,
    next_doc: usize,
    /// Staging stopped at its budget, so the streams may have more at once.
    full: bool,
}

fn error_reply(out: &mut Vec<u8>, opaque: u32, st: u16, why: &str) {
    mcbp::write_response(out, opcode::CONNECT, opaque, st, 0, why.as_bytes());
}

impl TapSession {
    fn open(
        ctx: &TapContext,
        bucket: Arc<Bucket>,
        connect: TapConnect,
        name: String,
    ) -> Result<TapSession, (u16, String)> {
        let engine = &ctx.engine;
        let flags = connect.flags;
        let cfg = &ctx.config;
        let now_ns = hlc::now_nanos();
        // BACKFILL in the future means new changes only; in the past, items changed since.
        let cutoff_ns = connect
            .backfill_since
            .map(|t| t.saturating_mul(1_000_000_000));
        let backfill = match cutoff_ns {
            Some(ns) => ns <= now_ns,
            None => flags & connect_flag::DUMP != 0,
        };
        let dump = flags & connect_flag::DUMP != 0;
        let takeover = flags & connect_flag::TAKEOVER_VBUCKETS != 0;
        let vbuckets: Vec<u16> = match &connect.vbuckets {
            Some(list) => list.clone(),
            None => (0..bucket.num_vbuckets())
                .filter(|vb| engine.vbucket_state(&bucket, *vb) == Some(VbState::Active))
                .collect(),
        };
        let encoding = Encoding {
            no_value: flags & connect_flag::REQUEST_KEYS_ONLY != 0,
            ..Default::default()
        };
        let cursor_owner = format!("tap:{name}");
        let mut streams = BTreeMap::new();
        let opened = |streams: &mut BTreeMap<u16, Stream>| -> Result<(), (u16, String)> {
            for &vb in &vbuckets {
                let Some(pos) = engine.stream_position(&bucket, vb) else {
                    return Err((status::NOT_MY_VBUCKET, format!("no vbucket {vb}")));
                };
                if pos.state == VbState::Dead || (takeover && pos.state != VbState::Active) {
                    let why = format!("vbucket {vb} is {:?} here", pos.state);
                    return Err((status::NOT_MY_VBUCKET, why));
                }
                let resume = connect
                    .checkpoints
                    .iter()
                    .find(|(v, _)| *v == vb)
                    .map(|(_, id)| engine.closed_checkpoint_end(&bucket, vb, *id).unwrap_or(0));
                let start = match resume {
                    Some(seqno) => seqno,
                    None if backfill => 0,
                    None => pos.high_seqno,
                };
                let end = if dump { pos.high_seqno } else { u64::MAX };
                let mut s = Stream::open(
                    engine,
                    bucket.clone(),
                    vb,
                    0,
                    &cursor_owner,
                    start.min(end),
                    end,
                    encoding,
                    false,
                    &pos,
                )
                .map_err(|e| (crate::kv::status_of(&e), e.to_string()))?;
                if takeover {
                    s.takeover = Takeover::CatchingUp;
                }
                streams.insert(vb, s);
            }
            Ok(())
        };
        if let Err(e) = opened(&mut streams) {
            for (_, mut s) in streams {
                s.close(engine);
            }
            return Err(e);
        }
        Ok(TapSession {
            bucket,
            name,
            enc: TapEncoding {
                keys_only: encoding.no_value,
                checkpoints: flags & connect_flag::CHECKPOINT != 0,
                backfill_cutoff_ns: cutoff_ns.unwrap_or(0),
                ttl: cfg.ttl,
            },
            connect,
            streams,
            turn: 0,
            open_checkpoints: BTreeMap::new(),
            next_seq: 1,
            unacked: Unacked::default(),
            resend: VecDeque::new(),
            since_ack: 0,
            ack_interval: cfg.ack_interval.max(1),
            window: cfg.ack_window.max(1),
            window_bytes: cfg.max_unacked_bytes.max(1),
            sent_total: 0,
            acked_total: 0,
            takeover_acks: Vec::new(),
            temp_failures_in_a_row: 0,
            close_sent: false,
            current: None,
            ahead: None,
            spare: Vec::new(),
        })
    }

    fn supports_ack(&self) -> bool {
        self.connect.flags & connect_flag::SUPPORT_ACK != 0
    }

    /// Dump and takeover connections end when their streams have; others run until closed.
    fn finite(&self) -> bool {
        self.connect.flags & (connect_flag::DUMP | connect_flag::TAKEOVER_VBUCKETS) != 0
    }

    fn window_open(&self) -> bool {
        !self.supports_ack()
            || (self.unacked.len() < self.window as usize
                && self.unacked.held_bytes() < self.window_bytes)
    }

    /// Releases every cursor (the session is over).
    pub fn close(&mut self, engine: &Engine) {
        for (_, mut s) in std::mem::take(&mut self.streams) {
            s.close(engine);
        }
        self.unacked = Unacked::default();
        self.resend.clear();
    }

    /// Gives the messages appended to `out` since `from` their sequence numbers and ACK flags,
    /// and keeps what needs an ACK. `force_ack` makes the (last) message ask for one; a
    /// TAP_VBUCKET_SET always does.
    /// Returns where the last one lies in `out`.
    fn stamp(
        &mut self,
        out: &mut [u8],
        from: usize,
        force_ack: bool,
        sent_at: Instant,
        ctx: &TapContext,
    ) -> (usize, usize) {
        let mut at = from;
        let mut last = (from, from);
        while let Ok(Some(n)) = mcbp::frame_len(&out[at..], usize::MAX) {
            let end = at + n;
            let seq = self.next_seq;
            self.next_seq = self.next_seq.wrapping_add(1).max(1);
            let vbucket_set = out[at + 1] == opcode::VBUCKET_SET;
            let ack = force_ack
                || vbucket_set
                || (self.supports_ack() && self.since_ack + 1 >= self.ack_interval);
            restamp(&mut out[at..end], seq, ack);
            if ack {
                self.since_ack = 0;
            } else {
                self.since_ack += 1;
            }
            if self.supports_ack() || ack {
                self.unacked.push(seq, &out[at..end], sent_at);
            }
            if vbucket_set {
                self.takeover_acks
                    .push((seq, u16::from_be_bytes([out[at + 6], out[at + 7]])));
            }
            self.sent_total += 1;
            ctx.stats.messages.fetch_add(1, Ordering::Relaxed);
            last = (at, end);
            at = end;
        }
        last
    }

    /// Sends queued messages again under new sequence numbers, as far as the window allows.
    fn send_again(&mut self, out: &mut Vec<u8>, sent_at: Instant, ctx: &TapContext) -> bool {
        let mut wrote = false;
        while self.window_open() {
            let Some(m) = self.resend.pop_front() else {
                break;
            };
            let from = out.len();
            out.extend_from_slice(&m);
            // The last one, or the one that fills the window, asks, so the client confirms
            // the re-sent run (and the window opens again whatever the ACK interval).
            let last = self.resend.is_empty()
                || self.unacked.len() + 1 >= self.window as usize
                || self.unacked.held_bytes() + m.len() >= self.window_bytes;
            self.stamp(out, from, last, sent_at, ctx);
            ctx.stats.resent.fetch_add(1, Ordering::Relaxed);
            wrote = true;
        }
        wrote
    }

    /// Stages the streams' next changes in turns until the budget is used up. The ACK window
    /// limits what is sent, not what is staged.
    fn stage(&mut self, engine: &Engine, staged: &mut Staged, budget: usize) {
        let mut idle_round = false;
        while !idle_round && staged.data.len() < budget && !self.streams.is_empty() {
            idle_round = true;
            let order = turn_order(&self.streams, self.turn);
            for vb in order {
                if staged.data.len() >= budget {
                    self.turn = vb;
                    return;
                }
                let s = self.streams.get_mut(&vb).expect("listed above");
                let (_, progress) = s.fill(engine, staged, TURN_BYTES);
                match progress {
                    Progress::Sent => idle_round = false,
                    Progress::Idle => {}
                    Progress::Ended(reason) => {
                        let mut s = self.streams.remove(&vb).expect("listed above");
                        if reason != stream_end_reason::OK {
                            log::info!(
                                "TAP '{}': vbucket {vb} stops streaming (reason {reason})",
                                self.name
                            );
                        }
                        s.close(engine);
                        idle_round = false;
                    }
                }
                self.turn = vb.wrapping_add(1);
            }
        }
    }

    /// Stages a batch into a spare buffer and, with a StreamFilter installed, puts its
    /// documents to the plugin without waiting for the answer.
    fn stage_judged(&mut self, ctx: &TapContext) -> Judged {
        let policies = &ctx.policies;
        let filtered = policies.installed(PolicyKind::Filter);
        let budget = if filtered {
            FILTER_BATCH_BYTES
        } else {
            ROUND_BYTES
        };
        let mut staged = self.spare.pop().unwrap_or_default();
        staged.clear();
        self.stage(&ctx.engine, &mut staged, budget);
        let staged = Arc::new(staged);
        let verdict = (filtered && staged.docs > 0).then(|| {
            let batch = FilterBatch {
                connection: self.name.clone(),
                docs: staged.docs,
                value_bytes: staged.value_bytes,
                source: staged.clone(),
            };
            policies.pose(PolicyKind::Filter, Question::Filter(batch))
        });
        Judged {
            full: staged.data.len() >= budget,
            staged,
            verdict,
            decision: None,
            next_event: 0,
            next_doc: 0,
        }
    }

    /// Keeps a sent batch's buffers for the next, unless a plugin that gave up on it (a
    /// timeout) still holds it.
    fn keep_spare(&mut self, staged: Arc<Staged>) {
        if let Ok(s) = Arc::try_unwrap(staged) {
            self.spare.push(s);
        }
    }

    /// The batch to send from: the one under way, else the next (staged ahead, or now). With
    /// a filter, the batch after it is staged and put to the plugin before this one's answer
    /// is awaited, so the plugin thinks while the connection works.
    async fn batch(&mut self, ctx: &TapContext) -> Judged {
        if let Some(b) = self.current.take() {
            return b;
        }
        let mut b = match self.ahead.take() {
            Some(b) => b,
            None => self.stage_judged(ctx),
        };
        if b.verdict.is_some() {
            let next = self.stage_judged(ctx);
            if next.staged.events.is_empty() {
                self.keep_spare(next.staged);
            } else {
                self.ahead = Some(next);
            }
        }
        if let Some(v) = b.verdict.take() {
            if let Answer::Filter(d) = v.answer(&ctx.policies).await {
                b.decision = Some(d);
            }
        }
        b
    }

    /// One round: messages to send again, then the streams' changes (judged by the
    /// StreamFilter, if one is installed), encoded into `out` up to a round's bytes or the
    /// ACK window. Returns whether it wrote or has staged changes waiting.
    async fn round(&mut self, ctx: &TapContext, out: &mut Vec<u8>) -> bool {
        // A round's output goes out in one write: one send time serves for all its messages'
        // round trips (the clock is not read per message).
        let sent_at = Instant::now();
        let mut wrote = self.send_again(out, sent_at, ctx);
        if !self.resend.is_empty() || !self.window_open() {
            return wrote;
        }
        let mut batch = self.batch(ctx).await;
        // After waiting for the filter, so that its time is not counted as the client's.
        let sent_at = Instant::now();
        let mut last_message = None;
        while batch.next_event < batch.staged.events.len()
            && out.len() < ROUND_BYTES
            && self.window_open()
        {
            let event = &batch.staged.events[batch.next_event];
            let from = out.len();
            let r = encode(
                &batch.staged,
                event,
                batch.next_doc,
                batch.decision.as_ref(),
                &self.enc,
                &mut self.open_checkpoints,
                out,
            );
            batch.next_doc += matches!(event, super::staged::Event::Doc { .. }) as usize;
            batch.next_event += 1;
            match r {
                Encoded::Message => {
                    last_message = Some(self.stamp(out, from, false, sent_at, ctx));
                }
                Encoded::Skipped(Skip::Filtered) => {
                    ctx.stats.filtered.fetch_add(1, Ordering::Relaxed);
                }
                Encoded::Skipped(Skip::OutOfHops) => {
                    ctx.stats.loop_stopped.fetch_add(1, Ordering::Relaxed);
                }
                Encoded::Skipped(Skip::BeforeBackfillTime) | Encoded::Nothing => {}
            }
            wrote |= out.len() > from;
        }
        // Caught up: nothing staged is left and the streams had no more at once.
        let caught_up =
            batch.next_event == batch.staged.events.len() && !batch.full && self.ahead.is_none();
        if batch.next_event == batch.staged.events.len() {
            self.keep_spare(batch.staged);
        } else {
            self.current = Some(batch);
        }
        if self.streams.is_empty()
            && self.current.is_none()
            && self.ahead.is_none()
            && self.finite()
            && !self.close_sent
        {
            // Everything asked for was sent: say so, and ask for the final ACK.
            let code = opaque_code::CLOSE_TAP_STREAM.to_be_bytes();
            let from = out.len();
            TapMessage {
                opcode: opcode::OPAQUE,
                engine_specific: &code,
                ttl: self.enc.ttl,
                ..Default::default()
            }
            .encode(out);
            let ack = self.supports_ack();
            self.stamp(out, from, ack, sent_at, ctx);
            self.close_sent = true;
            return true;
        }
        // Caught up, or stopped by the window, with messages not yet covered by an ACK
        // request: the last one asks.
        let waits = caught_up || !self.window_open();
        if let (true, true, Some((at, end))) = (self.supports_ack(), waits, last_message) {
            if self.since_ack > 0 {
                let seq = u32::from_be_bytes(out[at + 12..at + 16].try_into().expect("4"));
                restamp(&mut out[at..end], seq, true);
                self.since_ack = 0;
            }
        }
        // Staged changes waiting are more to do now, even if the filter dropped all of this
        // round's.
        wrote || self.current.is_some() || self.ahead.is_some()
    }
}

/// Whether the session ended because the work asked for is done.
enum Ended {
    Done(&'static str),
    Disconnected(&'static str),
    Stopping,
}

/// Serves a connection that TAP_CONNECT turned into a producer.
#[allow(clippy::too_many_arguments)]
pub async fn run(conn: Handoff, connect: TapConnect, opaque: u32, ctx: Arc<TapContext>) {
    let Handoff {
        mut socket,
        mut inbuf,
        mut out,
        session: mut kv,
        peer,
        mut stop,
    } = conn;
    let bucket = kv.bucket();
    let name = String::from_utf8_lossy(&connect.name).into_owned();
    let named = !connect.name.is_empty();
    let claim = if named {
        let key = (bucket.id, connect.name.clone());
        match ctx.sessions.claim(key, TAKE_NAME_WAIT).await {
            Ok(claimed) => Some(claimed),
            Err(Full(n)) => {
                ctx.stats.refused_sessions.fetch_add(1, Ordering::Relaxed);
                let why = format!(
                    "too many named TAP sessions ({n}, tap.max_sessions); retry once one \
                     expires, or connect without a name"
                );
                log::warn!("TAP '{name}' from {peer} refused: {why}");
                error_reply(&mut out, opaque, status::ETMPFAIL, &why);
                let _ = crate::tls::send_all(&mut socket, &out).await;
                return;
            }
        }
    } else {
        None
    };
    let (claim, found) = match claim {
        Some((c, f)) => (Some(c), f),
        None => (None, Found::Nothing),
    };
    let mut session = match found {
        Found::Parked(mut s) if s.connect == connect => {
            // The same client within its grace: everything unacknowledged goes again first.
            let mut again: VecDeque<Vec<u8>> = s.unacked.drain_all().into();
            again.append(&mut s.resend);
            s.resend = again;
            s.since_ack = 0;
            s.temp_failures_in_a_row = 0;
            s.takeover_acks.clear();
            ctx.stats.resumed_sessions.fetch_add(1, Ordering::Relaxed);
            log::info!(
                "TAP '{name}' for {peer} resumes its session: {} message(s) to send again",
                s.resend.len()
            );
            s
        }
        found => {
            if let Found::Parked(mut old) = found {
                log::info!("TAP '{name}' reconnects with other flags: its old session is closed");
                old.close(&ctx.engine);
            }
            match TapSession::open(&ctx, bucket.clone(), connect, name.clone()) {
                Ok(s) => Box::new(s),
                Err((st, why)) => {
                    log::warn!("TAP '{name}' from {peer} refused: {why}");
                    error_reply(&mut out, opaque, st, &why);
                    let _ = crate::tls::send_all(&mut socket, &out).await;
                    if let Some(c) = &claim {
                        ctx.sessions.release(c);
                    }
                    return;
                }
            }
        }
    };
    log::info!(
        "TAP producer '{name}' for {peer} on bucket {}: flags {:#x}, {} vbucket(s)",
        bucket.name(),
        session.connect.flags,
        session.streams.len()
    );
    ctx.stats.connections.fetch_add(1, Ordering::Relaxed);
    let mut replaced = claim.as_ref().map(|c| c.replaced.clone());
    let ended = serve(
        &mut socket,
        &mut inbuf,
        &mut out,
        &mut kv,
        &mut session,
        &ctx,
        &mut stop,
        replaced.as_mut(),
    )
    .await;
    ctx.stats.connections.fetch_sub(1, Ordering::Relaxed);
    finish(&ctx, session, claim.as_ref(), ended, peer).await;
}

/// Parks a named session that lost its connection (for the RetransmitPolicy's grace period),
/// or closes it.
async fn finish(
    ctx: &Arc<TapContext>,
    mut session: Box<TapSession>,
    claim: Option<&Claim>,
    ended: Ended,
    peer: SocketAddr,
) {
    let name = session.name.clone();
    let why = match &ended {
        Ended::Done(w) | Ended::Disconnected(w) => *w,
        Ended::Stopping => "the server is stopping",
    };
    log::info!("TAP producer '{name}' for {peer} closed: {why}");
    let (Some(claim), Ended::Disconnected(_)) = (claim, &ended) else {
        session.close(&ctx.engine);
        if let Some(c) = claim {
            ctx.sessions.release(c);
        }
        return;
    };
    if !session.supports_ack() {
        session.close(&ctx.engine);
        ctx.sessions.release(claim);
        return;
    }
    let registered = session.connect.flags & connect_flag::REGISTERED_CLIENT != 0;
    let mut grace = ctx.config.grace_period;
    let event = RetransmitEvent::Disconnected {
        connection: name.clone(),
        unacked: session.unacked.len() as u64,
    };
    let answer = ctx
        .policies
        .ask(PolicyKind::Retransmit, Question::Retransmit(event))
        .await;
    if let Answer::Retransmit { seconds, resend } = answer {
        grace = Duration::from_secs_f64(seconds.clamp(0.0, 86400.0 * 365.0));
        if !resend {
            session.unacked = Unacked::default();
            session.resend.clear();
        }
    }
    let sh = ctx.clone();
    let unacked = session.unacked.len() + session.resend.len();
    let back = ctx
        .sessions
        .park(claim, session, grace, move |mut s: Box<TapSession>| {
            log::info!(
                "TAP session '{}' expired after its grace period; its cursors are released",
                s.name
            );
            s.close(&sh.engine);
            sh.stats.expired_sessions.fetch_add(1, Ordering::Relaxed);
        });
    match back {
        Some(mut s) => s.close(&ctx.engine),
        None => {
            ctx.stats.parked_sessions.fetch_add(1, Ordering::Relaxed);
            log::info!(
                "TAP session '{name}'{} kept for {grace:?} with {unacked} unacknowledged \
                 message(s)",
                if registered {
                    " (registered client)"
                } else {
                    ""
                }
            );
        }
    }
}

/// The AckPolicy's latest answer, filled by a task so the connection never waits for it.
#[derive(Default)]
struct AckAdvice {
    asking: AtomicBool,
    answer: Mutex<Option<(u32, u32)>>,
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    socket: &mut MaybeTls,
    inbuf: &mut BytesMut,
    out: &mut Vec<u8>,
    kv: &mut KvSession,
    s: &mut TapSession,
    ctx: &Arc<TapContext>,
    stop: &mut watch::Receiver<bool>,
    mut replaced: Option<&mut watch::Receiver<bool>>,
) -> Ended {
    let max_body = ctx.max_body;
    let bucket = s.bucket.clone();
    let mut suspended_until: Option<Instant> = None;
    let advice = Arc::new(AckAdvice::default());
    loop {
        // Everything the client sent: ACKs and NACKs to TAP messages, or plain commands.
        loop {
            match mcbp::frame_len(inbuf, max_body) {
                Ok(Some(n)) => {
                    let frame = inbuf.split_to(n);
                    if frame[0] == magic::RESPONSE {
                        match answered(s, &frame, ctx, &advice).await {
                            Ok(Some(backoff)) => suspended_until = Some(Instant::now() + backoff),
                            Ok(None) => {}
                            Err(why) => return Ended::Disconnected(why),
                        }
                    } else {
                        let flow = kv.handle_streaming(&frame, out);
                        if matches!(kv.settle(flow, out).await, Flow::Close) {
                            let _ = crate::tls::send_all(socket, out).await;
                            return Ended::Done("the client quit");
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    ctx.io
                        .protocol_error("TAP", format_args!("TAP producer '{}': {e}", s.name));
                    return Ended::Disconnected("malformed input");
                }
            }
        }
        if let Some((interval, window)) = advice.answer.lock().take() {
            s.ack_interval = interval.max(1);
            s.window = window.max(1);
        }
        if suspended_until.is_some_and(|t| Instant::now() >= t) {
            suspended_until = None;
        }
        let generation = bucket.changes.generation();
        let wrote = if suspended_until.is_none() {
            s.round(ctx, out).await
        } else {
            false
        };
        if !out.is_empty() {
            let r = crate::tls::send_all(socket, out).await;
            ctx.io
                .bytes_out
                .fetch_add(out.len() as u64, Ordering::Relaxed);
            out.clear();
            if r.is_err() {
                return Ended::Disconnected("write failed");
            }
        }
        if *stop.borrow() {
            return Ended::Stopping;
        }
        if replaced.as_ref().is_some_and(|r| *r.borrow()) {
            return Ended::Disconnected("its name was taken by a new connection");
        }
        if s.close_sent && (!s.supports_ack() || s.unacked.is_empty()) {
            return Ended::Done("everything asked for was sent");
        }
        if wrote {
            match socket.try_read_buf(inbuf) {
                Ok(0) => return Ended::Disconnected("the client closed the connection"),
                Ok(n) => {
                    ctx.io.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return Ended::Disconnected("read failed"),
            }
            continue;
        }
        // Idle: a burst's buffers go back to their resting size.
        if out.capacity() > 4 * ROUND_BYTES {
            out.shrink_to(ROUND_BYTES);
        }
        s.spare.truncate(1);
        for b in &mut s.spare {
            b.shrink_to(ROUND_BYTES);
        }
        let can_send = !s.streams.is_empty() && s.window_open() && suspended_until.is_none();
        let changes = async {
            if can_send {
                bucket.changes.changed(generation).await
            } else {
                std::future::pending().await
            }
        };
        let resume = async {
            match suspended_until {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        let name_taken = async {
            match replaced.as_deref_mut() {
                Some(r) => {
                    let _ = r.changed().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = socket.read_buf(inbuf) => match r {
                Ok(0) => return Ended::Disconnected("the client closed the connection"),
                Ok(n) => { ctx.io.bytes_in.fetch_add(n as u64, Ordering::Relaxed); }
                Err(_) => return Ended::Disconnected("read failed"),
            },
            _ = changes => {}
            _ = resume => {}
            _ = name_taken => {}
            _ = stop.changed() => return Ended::Stopping,
        }
    }
}

/// The client's answer to a message that asked for an ACK. Ok(Some(d)): suspend sending for d
/// (a temporary failure); Err: close the connection.
async fn answered(
    s: &mut TapSession,
    frame: &[u8],
    ctx: &Arc<TapContext>,
    advice: &Arc<AckAdvice>,
) -> Result<Option<Duration>, &'static str> {
    let Ok(r) = mcbp::parse_response(frame) else {
        return Err("malformed response");
    };
    if !opcode::is_tap_message(r.opcode) {
        // Not ours to judge (a reply to nothing we sent): ignored, as memcached does.
        return Ok(None);
    }
    match r.status {
        status::SUCCESS => {
            let Some(rtt) = s.unacked.ack(r.opaque) else {
                return Ok(None);
            };
            s.acked_total += 1;
            s.temp_failures_in_a_row = 0;
            ctx.stats.acks.fetch_add(1, Ordering::Relaxed);
            let engine = &ctx.engine;
            let done: Vec<u16> = s
                .takeover_acks
                .iter()
                .filter(|(seq, _)| seq_covered(*seq, r.opaque))
                .map(|(_, vb)| *vb)
                .collect();
            s.takeover_acks
                .retain(|(seq, _)| !seq_covered(*seq, r.opaque));
            for vb in done {
                if let Some(st) = s.streams.get_mut(&vb) {
                    if st.takeover != Takeover::Off {
                        if let Some(paused) = st.takeover_acknowledged(engine) {
                            log::info!(
                                "vbucket {vb} handed over to TAP client '{}'; writes to it were \
                                 refused here for {:.1} ms",
                                s.name,
                                paused.as_secs_f64() * 1000.0
                            );
                        }
                    }
                }
            }
            if ctx.policies.installed(PolicyKind::Ack)
                && !advice.asking.swap(true, Ordering::AcqRel)
            {
                let stats = AckStats {
                    protocol: "tap",
                    connection: s.name.clone(),
                    rtt: rtt.as_secs_f64(),
                    unacked: s.unacked.len() as u64,
                    acked_total: s.acked_total,
                    sent_total: s.sent_total,
                    interval: s.ack_interval,
                    window: s.window,
                };
                let (sh, advice) = (ctx.clone(), advice.clone());
                tokio::spawn(async move {
                    if let Answer::Ack { interval, window } =
                        sh.policies.ask(PolicyKind::Ack, Question::Ack(stats)).await
                    {
                        *advice.answer.lock() = Some((interval, window));
                    }
                    advice.asking.store(false, Ordering::Release);
                });
            }
            Ok(None)
        }
        status::ETMPFAIL | status::EBUSY => {
            ctx.stats.temp_failures.fetch_add(1, Ordering::Relaxed);
            s.temp_failures_in_a_row += 1;
            if let Some(m) = s.unacked.take(r.opaque) {
                s.resend.push_front(m);
            }
            let event = RetransmitEvent::TempFail {
                connection: s.name.clone(),
                status: r.status,
                attempt: s.temp_failures_in_a_row,
            };
            let backoff = match ctx
                .policies
                .ask(PolicyKind::Retransmit, Question::Retransmit(event))
                .await
            {
                Answer::Retransmit { seconds, .. } => {
                    Duration::from_secs_f64(seconds.clamp(0.0, 3600.0))
                }
                _ => ctx.config.backoff,
            };
            Ok(Some(backoff))
        }
        st => {
            log::warn!(
                "TAP '{}': the client answered message {} with status {st:#x}",
                s.name,
                r.opaque
            );
            Err("the client answered with an error status")
        }
    }
}

/// Whether an ACK of `acked` covers message `seq` (sequence numbers wrap, skipping 0).
fn seq_covered(seq: u32, acked: u32) -> bool {
    acked.wrapping_sub(seq) < (1 << 31)
}

/// Checks a TAP_CONNECT the KV front let through (`Flow::OpenStream`): what the producer opens
/// with, or None with the error answered. Success is answered by the stream itself.
pub fn open(session: &KvSession, req: &mcbp::Request<'_>, out: &mut Vec<u8>) -> Option<TapConnect> {
    match TapConnect::decode(req) {
        Ok(c)
            if c.flags & connect_flag::TAKEOVER_VBUCKETS != 0
                && !crate::auth::may_replicate(session.permissions()) =>
        {
            session.reply_error(req, status::EACCESS, &session.lacks_replication(), out);
            None
        }
        Ok(c) => Some(c),
        Err(e) => {
            session.reply_error(req, status::EINVAL, &e.to_string(), out);
            None
        }
    }
}
