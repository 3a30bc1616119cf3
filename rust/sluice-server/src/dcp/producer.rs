//! A DCP producer connection: what a connection becomes after DCP_OPEN with the producer flag.
//! It answers the consumer's control traffic (CONTROL, STREAM_REQ, CLOSE_STREAM,
//! GET_FAILOVER_LOG, BUFFER_ACKNOWLEDGEMENT, NOOP replies) and, between requests, fills the
//! socket from its streams in turn, within the consumer's flow-control window. It sleeps on the
//! bucket's change signal when every stream is caught up.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tls::MaybeTls;
use bytes::BytesMut;
use parking_lot::Mutex;
use sluice_core::bucket::Bucket;
use sluice_core::vbucket::VbState;
use sluice_proto::dcp::{
    self, opcode, open_flag, stream_end_reason, stream_flag, BufferAcknowledgement, CloseStream,
    Control, DcpRequest, DcpResponse, FailoverLogEntry, FailoverLogResponse, GetFailoverLog, Noop,
    SeqnoAcknowledged, StreamRequest, StreamRequestResponse,
};
use sluice_proto::mcbp::{self, magic, status, Request};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use super::filter;
use super::sink::DcpSink;
use super::topic_stream::{self, TopicStream};
use crate::kv::{Flow, Handoff, KvSession};
use crate::metrics::metric;
use crate::policy::{Answer, PolicyHost, PolicyKind, Question};
use crate::stats::ConnectionStats;
use crate::stream::{
    turn_order, Encoding, Progress, StartAt, StartRefused, Stream, StreamSink, Takeover,
};
use sluice_core::topic::Topic;
use std::fmt::Write;
use std::sync::atomic::Ordering::Relaxed;

/// Replies and stream messages are written once this much is pending.
const FLUSH_AT: usize = 256 << 10;
/// What one stream may write per turn, so that streams share the connection fairly.
const TURN_BYTES: usize = 64 << 10;
const DEFAULT_NOOP_INTERVAL: Duration = Duration::from_secs(120);
/// The longest consumer_name: the DCP connection names' limit (DCP_OPEN), which Couchbase's
/// documents give no other for.
const MAX_CONSUMER_NAME: usize = 200;
/// The STREAM_REQ flags defined (Couchbase's 0x01 takeover .. 0x100 cache transfer).
const KNOWN_STREAM_FLAGS: u32 = 0x1ff;

/// DCP connection names per bucket: opening a name that is in use replaces (closes) the
/// connection that held it, as Couchbase does.
/// (bucket id, connection name)
type NameKey = (u16, Vec<u8>);

#[derive(Default)]
pub struct Names {
    /// The holder's token and the sender that tells it it was replaced.
    held: Mutex<HashMap<NameKey, (u64, watch::Sender<bool>)>>,
    next: AtomicU64,
}

pub struct NameClaim {
    ctx: Arc<DcpContext>,
    key: NameKey,
    token: u64,
    pub replaced: watch::Receiver<bool>,
}

impl Names {
    fn claim(ctx: &Arc<DcpContext>, bucket: u16, name: &[u8]) -> NameClaim {
        let token = ctx.names.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(false);
        let key = (bucket, name.to_vec());
        if let Some((_, old)) = ctx.names.held.lock().insert(key.clone(), (token, tx)) {
            let _ = old.send(true);
        }
        NameClaim {
            ctx: ctx.clone(),
            key,
            token,
            replaced: rx,
        }
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        let mut held = self.ctx.names.held.lock();
        if held.get(&self.key).is_some_and(|(t, _)| *t == self.token) {
            held.remove(&self.key);
        }
    }
}

/// What the DCP front works with, shared by every producer connection: handed over by the
/// server.
pub struct DcpContext {
    pub engine: Arc<sluice_core::Engine>,
    /// The connections' counters (bytes, protocol errors), shared with the other fronts.
    pub io: Arc<ConnectionStats>,
    pub names: Names,
    pub stats: DcpStats,
    pub policies: Arc<PolicyHost>,
    /// Largest request body accepted (`max_body`).
    pub max_body: usize,
    /// Learns the KV addresses of the replicas and takeover consumers streaming from here.
    pub clustermap: Arc<crate::clustermap::ClusterMap>,
}

/// Counters the admin endpoint exports.
#[derive(Debug, Default)]
pub struct DcpStats {
    pub connections: AtomicU64,
    pub streams: AtomicU64,
    pub items_backfill: AtomicU64,
    pub items_memory: AtomicU64,
    pub streams_too_slow: AtomicU64,
    pub dead_connections: AtomicU64,
    /// Documents a StreamFilter plugin kept off a stream.
    pub filtered: AtomicU64,
}

/// A checked DCP_OPEN for a producer: the connection is handed over with it.
#[derive(Debug, Clone)]
pub struct OpenProducer {
    pub name: Vec<u8>,
    pub flags: u32,
}

/// Answers a DCP_OPEN the KV front let through (`Flow::OpenStream`): success and what the
/// producer opens with, or the error answered.
pub fn open(session: &KvSession, req: &Request<'_>, out: &mut Vec<u8>) -> Option<OpenProducer> {
    match check_open(req) {
        Ok(open) => {
            session.reply_ok(req, out);
            Some(open)
        }
        Err((st, why)) => {
            session.reply_error(req, st, &why, out);
            None
        }
    }
}

/// Checks a DCP_OPEN request; Err is the status and message to answer with.
fn check_open(req: &Request<'_>) -> Result<OpenProducer, (u16, String)> {
    // The decoder checks the name: present and at most 200 bytes.
    let open = dcp::OpenConnection::decode(req).map_err(|e| (status::EINVAL, e.to_string()))?;
    if open.flags & open_flag::INVALID != 0 {
        return Err((status::EINVAL, "DCP_OPEN flag 0x2 is invalid".into()));
    }
    if open.flags & open_flag::PRODUCER == 0 {
        return Err((
            status::NOT_SUPPORTED,
            "sluice opens producers only: set the producer flag (0x1)".into(),
        ));
    }
    Ok(OpenProducer {
        name: open.name,
        flags: open.flags,
    })
}

fn count_items(d: &DcpStats, s: &mut Stream) {
    d.items_backfill
        .fetch_add(std::mem::take(&mut s.sent_backfill), Ordering::Relaxed);
    d.items_memory
        .fetch_add(std::mem::take(&mut s.sent_memory), Ordering::Relaxed);
}

struct Producer {
    ctx: Arc<DcpContext>,
    bucket: Arc<Bucket>,
    name: String,
    encoding: Encoding,
    /// The consumer's flow-control window (0: no flow control) and the bytes it has not
    /// acknowledged.
    buffer_size: usize,
    unacked: usize,
    noop_enabled: bool,
    noop_interval: Duration,
    /// When the outstanding NOOP was sent.
    noop_outstanding: Option<Instant>,
    noop_opaque: u32,
    last_sent: Instant,
    cursor_dropping: bool,
    end_on_close: bool,
    streams: BTreeMap<u16, Stream>,
    /// Set by the control `sluice_topic` before any stream: the connection streams that
    /// topic's partitions (`topic_stream`) instead of the bucket's vbuckets.
    topic: Option<Arc<Topic>>,
    topic_streams: BTreeMap<u16, TopicStream>,
    /// Set by the controls `consumer_name` and `enable_sync_writes`: the consumer is a replica
    /// whose SEQNO_ACKNOWLEDGED messages count toward durable writes.
    consumer_name: Option<String>,
    sync_writes: bool,
    persisted_acks: bool,
    /// The consumer's own KV address (control `sluice_kv_address`, a sluice node's replica or
    /// takeover), for the cluster map; a wildcard host is the address it connected from.
    kv_address: Option<crate::clustermap::Endpoint>,
    peer: std::net::IpAddr,
    /// The vbucket whose stream goes first in the next fill (round robin).
    turn: u16,
    streamed: bool,
    /// A round's frames while a StreamFilter judges them.
    staged: Vec<u8>,
}

fn respond(out: &mut Vec<u8>, req: &Request<'_>, st: u16, value: &[u8]) {
    mcbp::write_response(out, req.opcode, req.opaque, st, 0, value);
}

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

impl Producer {
    fn window(&self) -> usize {
        if self.buffer_size == 0 {
            usize::MAX
        } else {
            self.buffer_size.saturating_sub(self.unacked)
        }
    }

    fn control(&mut self, req: &Request<'_>, session: &KvSession, out: &mut Vec<u8>) {
        let c = match Control::decode(req) {
            Ok(c) => c,
            Err(e) => return respond(out, req, status::EINVAL, e.to_string().as_bytes()),
        };
        let key = String::from_utf8_lossy(&c.key).into_owned();
        let value = String::from_utf8_lossy(&c.value).into_owned();
        let ok = match key.as_str() {
            "connection_buffer_size" => match value.parse::<u64>() {
                Ok(n) if n <= u32::MAX as u64 + 1 => {
                    if self.streamed && n as usize != self.buffer_size {
                        log::info!(
                            "DCP producer '{}': the consumer resizes its buffer from {} to {n} \
                             bytes",
                            self.name,
                            self.buffer_size
                        );
                    }
                    self.buffer_size = n as usize;
                    true
                }
                _ => false,
            },
            "enable_noop" => parse_bool(&value).map(|b| self.noop_enabled = b).is_some(),
            // The documents give 20..10800 seconds; since Couchbase 5.0 fast failover uses 1.
            "set_noop_interval" => match value.parse::<u64>() {
                Ok(n) if (1..=10800).contains(&n) => {
                    self.noop_interval = Duration::from_secs(n);
                    true
                }
                _ => false,
            },
            "enable_expiry_opcode" => parse_bool(&value)
                .map(|b| self.encoding.expiry_opcode = b)
                .is_some(),
            "supports_cursor_dropping" => parse_bool(&value)
                .map(|b| self.cursor_dropping = b)
                .is_some(),
            "send_stream_end_on_client_close_stream" => {
                parse_bool(&value).map(|b| self.end_on_close = b).is_some()
            }
            "consumer_name" if c.value.len() > MAX_CONSUMER_NAME => {
                let why = format!(
                    "DCP control consumer_name: the value is {} bytes, over the limit of \
                     {MAX_CONSUMER_NAME}",
                    c.value.len()
                );
                return respond(out, req, status::EINVAL, why.as_bytes());
            }
            // A replica's acknowledgements satisfy durable writes (and its streams are never
            // filtered): only the replication role may claim to be one.
            "consumer_name" if !crate::auth::may_replicate(session.permissions()) => {
                let why = session.lacks_replication();
                return respond(out, req, status::EACCESS, why.as_bytes());
            }
            "consumer_name" if !value.is_empty() => {
                self.consumer_name = Some(value.clone());
                self.learn_replica();
                true
            }
            "sluice_kv_address" => {
                match crate::clustermap::Endpoint::parse(&value, Some(self.peer)) {
                    Some(e) => {
                        self.kv_address = Some(e);
                        self.learn_replica();
                        true
                    }
                    None => false,
                }
            }
            "enable_sync_writes" => parse_bool(&value).map(|b| self.sync_writes = b).is_some(),
            "persisted_seqno_acks" => parse_bool(&value)
                .map(|b| self.persisted_acks = b)
                .is_some(),
            "sluice_topic" if self.streamed => {
                let why = "DCP control sluice_topic: set it before the first stream";
                return respond(out, req, status::EINVAL, why.as_bytes());
            }
            // A topic's stream needs `stream` on the topic, or the replication role (a replica
            // copies every topic its active holds).
            "sluice_topic"
                if session.topic_permissions(&value) & crate::auth::STREAM == 0
                    && !crate::auth::may_replicate(session.permissions()) =>
            {
                let why = format!(
                    "DCP control sluice_topic: user {} lacks the stream permission on topic \
                     {value:?} ([users.NAME] topics)",
                    session.user_name().unwrap_or("(none)")
                );
                return respond(out, req, status::EACCESS, why.as_bytes());
            }
            "sluice_topic" => match self.ctx.engine.topic(&value) {
                Some(t) => {
                    log::info!("DCP producer '{}' streams topic {value:?}", self.name);
                    self.topic = Some(t);
                    true
                }
                None => {
                    let why = format!("DCP control sluice_topic: no topic {value:?}");
                    return respond(out, req, status::KEY_ENOENT, why.as_bytes());
                }
            },
            // Accepted for compatibility: one connection's streams already share it in turns.
            "set_priority" => matches!(value.as_str(), "high" | "medium" | "low"),
            _ => {
                let why = format!("unknown DCP control key '{key}'");
                return respond(out, req, status::EINVAL, why.as_bytes());
            }
        };
        if ok {
            respond(out, req, status::SUCCESS, &[]);
        } else {
            let why = format!("bad value '{value}' for DCP control '{key}'");
            respond(out, req, status::EINVAL, why.as_bytes());
        }
    }

    fn stream_request(&mut self, req: &Request<'_>, session: &KvSession, out: &mut Vec<u8>) {
        let sr = match StreamRequest::decode(req) {
            Ok(s) => s,
            Err(e) => return respond(out, req, status::EINVAL, e.to_string().as_bytes()),
        };
        let unknown = sr.flags & !KNOWN_STREAM_FLAGS;
        if unknown != 0 {
            let why = format!("undefined STREAM_REQ flag bits {unknown:#x}");
            return respond(out, req, status::EINVAL, why.as_bytes());
        }
        let takeover = sr.flags & stream_flag::TAKEOVER != 0;
        // A takeover ends with this node's vbucket dead: the replication role's to ask for.
        if takeover && !crate::auth::may_replicate(session.permissions()) {
            let why = session.lacks_replication();
            return respond(out, req, status::EACCESS, why.as_bytes());
        }
        let vb = sr.vbucket;
        if self.streams.contains_key(&vb) {
            return respond(
                out,
                req,
                status::KEY_EEXISTS,
                b"a stream for this vbucket exists",
            );
        }
        let engine = &self.ctx.engine;
        let Some(pos) = engine.stream_position(&self.bucket, vb) else {
            return respond(out, req, status::NOT_MY_VBUCKET, b"no such vbucket");
        };
        if takeover && pos.state != VbState::Active {
            return respond(
                out,
                req,
                status::NOT_MY_VBUCKET,
                b"only an active vbucket can be taken over",
            );
        }
        if pos.state == VbState::Dead
            || (sr.flags & stream_flag::ACTIVE_VB_ONLY != 0 && pos.state != VbState::Active)
        {
            return respond(
                out,
                req,
                status::NOT_MY_VBUCKET,
                b"vbucket is not streamable here",
            );
        }
        let asked = StartAt {
            start_seqno: sr.start_seqno,
            end_seqno: sr.end_seqno,
            vbucket_uuid: sr.vbucket_uuid,
            snap_start_seqno: sr.snap_start_seqno,
            snap_end_seqno: sr.snap_end_seqno,
            from_latest: sr.flags & stream_flag::FROM_LATEST != 0,
            to_latest: sr.flags & (stream_flag::TO_LATEST | stream_flag::DISK_ONLY) != 0,
            ignore_purged_tombstones: sr.flags & stream_flag::IGNORE_PURGED_TOMBSTONES != 0,
        };
        let (start, end) = match asked.resolve(&pos) {
            Ok(range) => range,
            Err(StartRefused::Rollback(seqno)) => {
                log::info!(
                    "DCP {}: vbucket {vb} asks for {} of uuid {:#x}: rollback to {seqno}",
                    self.name,
                    sr.start_seqno,
                    sr.vbucket_uuid
                );
                let _ = StreamRequestResponse::Rollback(seqno).encode(out, req.opaque);
                return;
            }
            Err(StartRefused::OutOfRange(why)) => {
                return respond(out, req, status::ERANGE, why.as_bytes())
            }
        };
        let mut encoding = self.encoding;
        encoding.no_value |= sr.flags & stream_flag::NO_VALUE != 0;
        let stream = match Stream::open(
            engine,
            self.bucket.clone(),
            vb,
            req.opaque,
            &self.name,
            start,
            end,
            encoding,
            self.cursor_dropping,
            &pos,
        ) {
            Ok(mut s) => {
                if takeover {
                    s.takeover = Takeover::CatchingUp;
                }
                s
            }
            Err(e) => return respond(out, req, crate::kv::status_of(&e), e.to_string().as_bytes()),
        };
        let log: Vec<FailoverLogEntry> = pos
            .failover
            .iter()
            .map(|e| FailoverLogEntry {
                vbucket_uuid: e.uuid,
                seqno: e.seqno,
            })
            .collect();
        let _ = StreamRequestResponse::Ok(log).encode(out, req.opaque);
        let mut stream = stream;
        // A replica's stream carries whole documents: one without values copies nothing.
        if let Some(name) = self.replica_name().filter(|_| !encoding.no_value) {
            self.bucket.acks.attach(vb, name);
            stream.acks_as = Some(name.to_string());
        }
        self.streams.insert(vb, stream);
        self.streamed = true;
        self.ctx.stats.streams.fetch_add(1, Ordering::Relaxed);
    }

    fn close_stream(&mut self, req: &Request<'_>, out: &mut Vec<u8>) {
        let c = match CloseStream::decode(req) {
            Ok(c) => c,
            Err(e) => return respond(out, req, status::EINVAL, e.to_string().as_bytes()),
        };
        match self.streams.remove(&c.vbucket) {
            None => respond(out, req, status::KEY_ENOENT, b"no stream for this vbucket"),
            Some(mut s) => {
                respond(out, req, status::SUCCESS, &[]);
                if self.end_on_close {
                    self.unacked += s.write_end(&mut DcpSink(out), stream_end_reason::CLOSED);
                }
                self.retire(&mut s);
            }
        }
    }

    /// The consumer's answer to SET_VBUCKET_STATE: success to "active" completes a takeover.
    fn set_vbucket_state_answered(&mut self, frame: &[u8]) {
        let Ok(r) = mcbp::parse_response(frame) else {
            return;
        };
        let Some(s) = self.streams.values_mut().find(|s| s.opaque == r.opaque) else {
            return;
        };
        if r.status != status::SUCCESS {
            log::error!(
                "takeover of vbucket {}: the consumer refused SET_VBUCKET_STATE with status {:#x}",
                s.vbucket,
                r.status
            );
            return;
        }
        if let Some(paused) = s.takeover_acknowledged(&self.ctx.engine) {
            if let Some(to) = &self.kv_address {
                self.ctx.clustermap.moved(self.bucket.name(), s.vbucket, to);
            }
            self.ctx.clustermap.refresh(&self.ctx.engine);
            log::info!(
                "vbucket {} handed over to {}; writes to it were refused here for {:.1} ms",
                s.vbucket,
                self.name,
                paused.as_secs_f64() * 1000.0
            );
        }
    }

    /// A replica that told both its name and its KV address appears in the cluster map's
    /// chains of the vbuckets it follows.
    fn learn_replica(&self) {
        if let (Some(name), Some(addr)) = (&self.consumer_name, &self.kv_address) {
            self.ctx.clustermap.learn_replica(name, addr);
        }
    }

    /// The name this consumer's acknowledgements count under, when it does sync replication.
    fn replica_name(&self) -> Option<&str> {
        self.consumer_name.as_deref().filter(|_| self.sync_writes)
    }

    fn seqno_acknowledged(&mut self, req: &Request<'_>, out: &mut Vec<u8>) {
        let a = match SeqnoAcknowledged::decode(req) {
            Ok(a) => a,
            Err(e) => return respond(out, req, status::EINVAL, e.to_string().as_bytes()),
        };
        let Some(name) = self.replica_name() else {
            return respond(
                out,
                req,
                status::EINVAL,
                b"sync replication is not enabled (controls consumer_name and enable_sync_writes)",
            );
        };
        if a.persisted_seqno.is_some() && !self.persisted_acks {
            return respond(
                out,
                req,
                status::EINVAL,
                b"a persisted seqno needs the control persisted_seqno_acks",
            );
        }
        let Some(stream) = self.streams.get(&a.vbucket) else {
            return respond(
                out,
                req,
                status::NOT_MY_VBUCKET,
                b"no stream for this vbucket",
            );
        };
        if stream.acks_as.as_deref() != Some(name) {
            return respond(
                out,
                req,
                status::EINVAL,
                b"this vbucket's stream is not a replica's (it opened before consumer_name and \
                  enable_sync_writes, or without values)",
            );
        }
        // What the consumer cannot have received never counts: an acknowledgement past the
        // last seqno sent on this stream is clamped to it rather than refused, because an
        // honest replica acknowledges a snapshot's end, which may lie past the last document
        // sent when later seqnos of it were superseded.
        let sent = stream.last_sent_seqno();
        let clamp = |seqno: u64| seqno.min(sent);
        // No reply on success: acknowledgements are one-way.
        self.bucket.acks.ack(
            a.vbucket,
            name,
            clamp(a.prepared_seqno),
            a.persisted_seqno.map(clamp),
        );
    }

    fn retire(&self, s: &mut Stream) {
        if let Some(name) = s.acks_as.take() {
            self.bucket.acks.detach(s.vbucket, &name);
        }
        s.close(&self.ctx.engine);
        self.ctx.stats.streams.fetch_sub(1, Ordering::Relaxed);
        count_items(&self.ctx.stats, s);
    }

    fn failover_log(&mut self, req: &Request<'_>, out: &mut Vec<u8>) {
        let g = match GetFailoverLog::decode(req) {
            Ok(g) => g,
            Err(e) => return respond(out, req, status::EINVAL, e.to_string().as_bytes()),
        };
        match self.ctx.engine.failover_log(&self.bucket, g.vbucket) {
            Some(entries) if !entries.is_empty() => {
                let entries = entries
                    .iter()
                    .map(|e| FailoverLogEntry {
                        vbucket_uuid: e.uuid,
                        seqno: e.seqno,
                    })
                    .collect();
                let _ = FailoverLogResponse { entries }.encode(out, req.opaque);
            }
            _ => respond(out, req, status::NOT_MY_VBUCKET, b"no such vbucket"),
        }
    }

    /// GET_ALL_VB_SEQNOS on a DCP connection, answered here rather than by the kv session:
    /// the connection's `stream` permission covers it (its streams carry the same seqnos), so
    /// a replica logged in with only that permission can measure how far behind it is.
    fn all_vb_seqnos(&self, req: &Request<'_>, out: &mut Vec<u8>) {
        match crate::kv::all_vb_seqnos(&self.ctx.engine, &self.bucket, req.extras) {
            Ok(value) => respond(out, req, status::SUCCESS, &value),
            Err(why) => respond(out, req, status::EINVAL, why.as_bytes()),
        }
    }

    /// One frame from the consumer. Frames that are not DCP go to the kv session (STAT,
    /// NOOP...).
    fn handle(&mut self, frame: &[u8], session: &mut KvSession, out: &mut Vec<u8>) -> Flow {
        if frame.first() == Some(&magic::RESPONSE) {
            if frame.get(1) == Some(&opcode::NOOP) {
                self.noop_outstanding = None;
            }
            if frame.get(1) == Some(&opcode::SET_VBUCKET_STATE) {
                self.set_vbucket_state_answered(frame);
            }
            // The consumer answers nothing else we wait for.
            return Flow::Continue;
        }
        let Ok(req) = mcbp::parse_request(frame) else {
            return session.handle_streaming(frame, out);
        };
        if req.opcode == mcbp::opcode::STAT && req.key == b"topics" {
            self.topics_stat(&req, out);
            return Flow::Continue;
        }
        if let Some(topic) = self.topic.clone() {
            match req.opcode {
                opcode::STREAM_REQ => return self.topic_stream_request(topic, &req, out),
                opcode::CLOSE_STREAM => return self.close_topic_stream(&req, out),
                opcode::SEQNO_ACKNOWLEDGED => {
                    self.topic_acknowledged(&req, out);
                    return Flow::Continue;
                }
                opcode::GET_FAILOVER_LOG => return topic_failover_log(&topic, &req, out),
                mcbp::opcode::GET_ALL_VB_SEQNOS => {
                    match topic_stream::all_seqnos(&topic, req.extras, &self.ctx.clustermap.topics)
                    {
                        Ok(value) => respond(out, &req, status::SUCCESS, &value),
                        Err(why) => respond(out, &req, status::EINVAL, why.as_bytes()),
                    }
                    return Flow::Continue;
                }
                _ => {}
            }
        }
        match req.opcode {
            opcode::CONTROL => self.control(&req, session, out),
            opcode::STREAM_REQ => self.stream_request(&req, session, out),
            opcode::CLOSE_STREAM => self.close_stream(&req, out),
            opcode::GET_FAILOVER_LOG => self.failover_log(&req, out),
            mcbp::opcode::GET_ALL_VB_SEQNOS => self.all_vb_seqnos(&req, out),
            opcode::SEQNO_ACKNOWLEDGED => self.seqno_acknowledged(&req, out),
            opcode::BUFFER_ACKNOWLEDGEMENT => match BufferAcknowledgement::decode(&req) {
                // No reply: acknowledgements are one-way.
                Ok(a) => self.unacked = self.unacked.saturating_sub(a.bytes as usize),
                Err(e) => respond(out, &req, status::EINVAL, e.to_string().as_bytes()),
            },
            opcode::OPEN => respond(
                out,
                &req,
                status::EINVAL,
                b"this connection is open already",
            ),
            opcode::ADD_STREAM | opcode::SET_VBUCKET_STATE | opcode::SNAPSHOT_MARKER => {
                respond(out, &req, status::NOT_SUPPORTED, b"not sent to a producer")
            }
            _ => return session.handle_streaming(frame, out),
        }
        Flow::Continue
    }

    /// STAT topics: per topic, its name as the key and as the value its partition count, a
    /// newline and its settings (what a replica declares its copy with). Answered here, under
    /// the connection's stream permission, like GET_ALL_VB_SEQNOS.
    fn topics_stat(&self, req: &Request<'_>, out: &mut Vec<u8>) {
        let stat = |out: &mut Vec<u8>, key: &[u8], value: &[u8]| {
            let h = mcbp::HeaderFields {
                magic: magic::RESPONSE,
                opcode: req.opcode,
                opaque: req.opaque,
                ..Default::default()
            };
            let _ = mcbp::write_frame(out, &h, &[], &[], key, value);
        };
        for t in self.ctx.engine.topics() {
            let value = format!("{}\n{}", t.num_partitions(), t.config_text);
            stat(out, t.name.as_bytes(), value.as_bytes());
        }
        stat(out, b"", b"");
    }

    fn topic_stream_request(
        &mut self,
        topic: Arc<Topic>,
        req: &Request<'_>,
        out: &mut Vec<u8>,
    ) -> Flow {
        let sr = match StreamRequest::decode(req) {
            Ok(s) => s,
            Err(e) => {
                respond(out, req, status::EINVAL, e.to_string().as_bytes());
                return Flow::Continue;
            }
        };
        if self.topic_streams.contains_key(&sr.vbucket) {
            respond(
                out,
                req,
                status::KEY_EEXISTS,
                b"a stream for this partition exists",
            );
            return Flow::Continue;
        }
        // A partition the cluster places on other nodes only, or nowhere yet, is not read here.
        if sr.vbucket < topic.num_partitions()
            && topic_stream::partition_state(&topic, sr.vbucket, &self.ctx.clustermap.topics)
                == sluice_core::vbucket::VbState::Dead
        {
            respond(
                out,
                req,
                status::NOT_MY_VBUCKET,
                b"the cluster map places no copy of this partition here",
            );
            return Flow::Continue;
        }
        let mut encoding = self.encoding;
        encoding.no_value |= sr.flags & stream_flag::NO_VALUE != 0;
        let log = topic_stream::failover_log(&topic, sr.vbucket);
        match TopicStream::open(topic, &sr, req.opaque, encoding) {
            Ok(mut stream) => {
                if let Some(name) = self.replica_name() {
                    stream.count_acks_as(name);
                }
                let _ = StreamRequestResponse::Ok(log).encode(out, req.opaque);
                self.topic_streams.insert(sr.vbucket, stream);
                self.streamed = true;
                self.ctx.stats.streams.fetch_add(1, Ordering::Relaxed);
            }
            Err(topic_stream::Refused::Rollback(seqno)) => {
                let _ = StreamRequestResponse::Rollback(seqno).encode(out, req.opaque);
            }
            Err(topic_stream::Refused::Status(st, why)) => {
                respond(out, req, st, why.as_bytes());
            }
        }
        Flow::Continue
    }

    fn close_topic_stream(&mut self, req: &Request<'_>, out: &mut Vec<u8>) -> Flow {
        match CloseStream::decode(req) {
            Err(e) => respond(out, req, status::EINVAL, e.to_string().as_bytes()),
            Ok(c) => match self.topic_streams.remove(&c.vbucket) {
                None => respond(
                    out,
                    req,
                    status::KEY_ENOENT,
                    b"no stream for this partition",
                ),
                Some(s) => {
                    respond(out, req, status::SUCCESS, &[]);
                    if self.end_on_close {
                        self.unacked += DcpSink(out).end(&s.view(), stream_end_reason::CLOSED);
                    }
                    self.retire_topic_stream(s);
                }
            },
        }
        Flow::Continue
    }

    /// A replica's SEQNO_ACKNOWLEDGED for a partition it copies: counted toward the produces
    /// waiting for acks (`Topic::acks`). One-way, answered only when refused.
    fn topic_acknowledged(&mut self, req: &Request<'_>, out: &mut Vec<u8>) {
        let a = match SeqnoAcknowledged::decode(req) {
            Ok(a) => a,
            Err(e) => return respond(out, req, status::EINVAL, e.to_string().as_bytes()),
        };
        let Some(stream) = self.topic_streams.get(&a.vbucket) else {
            return respond(
                out,
                req,
                status::NOT_MY_VBUCKET,
                b"no stream for this partition",
            );
        };
        if let Err(why) = stream.acknowledged(a.prepared_seqno) {
            respond(out, req, status::EINVAL, why.as_bytes());
        }
    }

    fn retire_topic_stream(&self, s: TopicStream) {
        self.ctx.stats.streams.fetch_sub(1, Ordering::Relaxed);
        self.ctx
            .stats
            .items_memory
            .fetch_add(s.sent, Ordering::Relaxed);
    }

    /// `fill` for a connection streaming a topic's partitions.
    fn fill_topic(&mut self, out: &mut Vec<u8>) -> bool {
        let engine = self.ctx.engine.clone();
        let mut wrote = false;
        let mut idle_round = false;
        while !idle_round && out.len() < FLUSH_AT && self.window() > 0 {
            idle_round = true;
            let partitions: Vec<u16> = self.topic_streams.keys().copied().collect();
            for p in partitions {
                let window = self.window();
                if window == 0 || out.len() >= FLUSH_AT {
                    break;
                }
                let s = self.topic_streams.get_mut(&p).expect("listed above");
                let (n, progress) = s.fill(&engine, &mut DcpSink(out), window.min(TURN_BYTES));
                self.ctx
                    .stats
                    .items_memory
                    .fetch_add(std::mem::take(&mut s.sent), Ordering::Relaxed);
                if self.buffer_size > 0 {
                    self.unacked += n;
                }
                match progress {
                    Progress::Sent => idle_round = false,
                    Progress::Idle => {}
                    Progress::Ended(_) => {
                        let s = self.topic_streams.remove(&p).expect("listed above");
                        self.retire_topic_stream(s);
                    }
                }
                wrote |= n > 0;
            }
        }
        wrote
    }

    /// Writes stream messages in turns until the window closes, the output is large enough, or
    /// every stream is caught up. Returns whether anything was written.
    fn fill(&mut self, out: &mut Vec<u8>) -> bool {
        if self.topic.is_some() {
            return self.fill_topic(out);
        }
        let engine = self.ctx.engine.clone();
        let mut wrote = false;
        let mut idle_round = false;
        while !idle_round && out.len() < FLUSH_AT && self.window() > 0 && !self.streams.is_empty() {
            idle_round = true;
            let order = turn_order(&self.streams, self.turn);
            for vb in order {
                let window = self.window();
                if window == 0 || out.len() >= FLUSH_AT {
                    self.turn = vb;
                    break;
                }
                let s = self.streams.get_mut(&vb).expect("listed above");
                let (n, progress) = s.fill(&engine, &mut DcpSink(out), window.min(TURN_BYTES));
                count_items(&self.ctx.stats, s);
                if self.buffer_size > 0 {
                    self.unacked += n;
                }
                match progress {
                    Progress::Sent => idle_round = false,
                    Progress::Idle => {}
                    Progress::Ended(reason) => {
                        if reason == stream_end_reason::TOO_SLOW {
                            self.ctx
                                .stats
                                .streams_too_slow
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        let mut s = self.streams.remove(&vb).expect("listed above");
                        self.retire(&mut s);
                        idle_round = false;
                    }
                }
                wrote |= n > 0;
                self.turn = vb.wrapping_add(1);
            }
        }
        wrote
    }

    /// Whether a StreamFilter applies: not to replication (a replica, which declared its
    /// consumer name, or a takeover), whose copy must be whole.
    fn filterable(&self) -> bool {
        self.topic.is_none()
            && self.consumer_name.is_none()
            && self.streams.values().all(|s| s.takeover == Takeover::Off)
    }

    /// `fill` through the StreamFilter plugin: the round is staged, judged by key, and copied
    /// to `out` without what the plugin dropped. Bytes not sent leave the flow-control window.
    async fn fill_filtered(&mut self, out: &mut Vec<u8>) -> bool {
        let mut staged = std::mem::take(&mut self.staged);
        staged.clear();
        let wrote = self.fill(&mut staged);
        let round = Arc::new(filter::Round(staged));
        let batch = round.batch(&self.name);
        let answer = if batch.docs == 0 {
            Answer::Default
        } else {
            let policies = &self.ctx.policies;
            policies
                .ask(PolicyKind::Filter, Question::Filter(batch))
                .await
        };
        match answer {
            Answer::Filter(d) => {
                let r = filter::apply(&round.0, &d, out);
                if self.buffer_size > 0 {
                    self.unacked = self.unacked.saturating_sub(r.bytes_removed);
                }
                self.ctx
                    .stats
                    .filtered
                    .fetch_add(r.dropped, Ordering::Relaxed);
            }
            _ => out.extend_from_slice(&round.0),
        }
        // The buffer comes back for the next round unless a plugin that gave up on it (a
        // timeout) still holds it.
        if let Ok(filter::Round(mut staged)) = Arc::try_unwrap(round) {
            if staged.capacity() > 4 * FLUSH_AT {
                staged.shrink_to(FLUSH_AT);
            }
            self.staged = staged;
        }
        wrote
    }

    /// The NOOP to send now, if one is due; Err when the consumer failed to answer the last.
    fn noop_due(&mut self, now: Instant, out: &mut Vec<u8>) -> Result<(), ()> {
        if !self.noop_enabled || !self.streamed {
            return Ok(());
        }
        if let Some(sent) = self.noop_outstanding {
            if now.duration_since(sent) >= self.noop_interval {
                return Err(());
            }
            return Ok(());
        }
        if now.duration_since(self.last_sent) >= self.noop_interval {
            self.noop_opaque = self.noop_opaque.wrapping_add(1);
            let _ = Noop.encode(out, self.noop_opaque);
            self.noop_outstanding = Some(now);
        }
        Ok(())
    }

    fn next_noop_deadline(&self) -> Option<Instant> {
        if !self.noop_enabled || !self.streamed {
            return None;
        }
        Some(match self.noop_outstanding {
            Some(sent) => sent + self.noop_interval,
            None => self.last_sent + self.noop_interval,
        })
    }

    fn shutdown(&mut self) {
        for (_, mut s) in std::mem::take(&mut self.streams) {
            self.retire(&mut s);
        }
        for (_, s) in std::mem::take(&mut self.topic_streams) {
            self.retire_topic_stream(s);
        }
    }
}

/// Serves a connection that DCP_OPEN turned into a producer, until the consumer goes away,
/// fails its NOOPs, the name is reopened elsewhere, or the server stops.
#[allow(clippy::too_many_arguments)]
pub async fn run(conn: Handoff, open: OpenProducer, ctx: Arc<DcpContext>) {
    let Handoff {
        mut socket,
        mut inbuf,
        mut out,
        mut session,
        peer,
        mut stop,
    } = conn;
    let bucket = session.bucket();
    let mut claim = Names::claim(&ctx, bucket.id, &open.name);
    let name = String::from_utf8_lossy(&open.name).into_owned();
    log::info!(
        "DCP producer '{name}' for {peer} on bucket {}",
        bucket.name()
    );
    ctx.stats.connections.fetch_add(1, Ordering::Relaxed);
    let mut p = Producer {
        ctx: ctx.clone(),
        bucket: bucket.clone(),
        name,
        encoding: Encoding {
            no_value: open.flags & open_flag::NO_VALUE != 0,
            keep_datatype: open.flags & open_flag::NO_VALUE_WITH_UNDERLYING_DATATYPE != 0,
            delete_times: open.flags & open_flag::INCLUDE_DELETE_TIMES != 0,
            expiry_opcode: false,
            xattrs: open.flags & open_flag::INCLUDE_XATTRS != 0,
            deleted_user_xattrs: open.flags & open_flag::INCLUDE_DELETED_USER_XATTRS != 0,
        },
        buffer_size: 0,
        unacked: 0,
        noop_enabled: false,
        noop_interval: DEFAULT_NOOP_INTERVAL,
        noop_outstanding: None,
        noop_opaque: 0,
        last_sent: Instant::now(),
        cursor_dropping: false,
        end_on_close: false,
        streams: BTreeMap::new(),
        topic: None,
        topic_streams: BTreeMap::new(),
        consumer_name: None,
        sync_writes: false,
        persisted_acks: false,
        kv_address: None,
        peer: peer.ip(),
        turn: 0,
        streamed: false,
        staged: Vec::new(),
    };
    let why = serve(
        &mut socket,
        &mut inbuf,
        &mut out,
        &mut session,
        &mut p,
        &ctx,
        &mut stop,
        &mut claim,
    )
    .await;
    log::info!("DCP producer '{}' for {peer} closed: {why}", p.name);
    p.shutdown();
    ctx.stats.connections.fetch_sub(1, Ordering::Relaxed);
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    socket: &mut MaybeTls,
    inbuf: &mut BytesMut,
    out: &mut Vec<u8>,
    session: &mut KvSession,
    p: &mut Producer,
    ctx: &DcpContext,
    stop: &mut watch::Receiver<bool>,
    claim: &mut NameClaim,
) -> &'static str {
    let max_body = ctx.max_body;
    let bucket = p.bucket.clone();
    loop {
        loop {
            match mcbp::frame_len(inbuf, max_body) {
                Ok(Some(n)) => {
                    let frame = inbuf.split_to(n);
                    let flow = p.handle(&frame, session, out);
                    if matches!(session.settle(flow, out).await, Flow::Close) {
                        let _ =
                            crate::tls::write_out(socket, out, &ctx.io.bytes_out, FLUSH_AT).await;
                        return "the consumer quit";
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    ctx.io
                        .protocol_error("DCP", format_args!("DCP producer '{}': {e}", p.name));
                    return "malformed input";
                }
            }
        }
        // A topic's connection sleeps on the topic's signal, and on the WAL writing a bundle
        // its streams found appended but not yet written.
        let topic = p.topic.clone();
        let signal = topic.as_ref().map_or(&bucket.changes, |t| &t.changes);
        let generation = signal.generation();
        let wrote = if p.filterable() && ctx.policies.installed(PolicyKind::Filter) {
            p.fill_filtered(out).await
        } else {
            p.fill(out)
        };
        let now = Instant::now();
        if p.noop_due(now, out).is_err() {
            ctx.stats.dead_connections.fetch_add(1, Ordering::Relaxed);
            return "no NOOP reply within the noop interval (dead connection)";
        }
        if !out.is_empty() {
            if crate::tls::write_out(socket, out, &ctx.io.bytes_out, FLUSH_AT)
                .await
                .is_err()
            {
                return "write failed";
            }
            p.last_sent = Instant::now();
        }
        if *stop.borrow() {
            return "the server is stopping";
        }
        if *claim.replaced.borrow() {
            return "its name was opened by another connection";
        }
        if wrote {
            // More may be ready: pick up acknowledgements without waiting, then fill again.
            match socket.try_read_buf(inbuf) {
                Ok(0) => return "the consumer closed the connection",
                Ok(n) => {
                    ctx.io.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return "read failed",
            }
            continue;
        }
        let can_send = !(p.streams.is_empty() && p.topic_streams.is_empty()) && p.window() > 0;
        let unwritten = p
            .topic_streams
            .values()
            .filter_map(|s| s.unwritten_lsn)
            .min();
        let engine = ctx.engine.clone();
        let written = async {
            match unwritten {
                Some(lsn) if can_send && engine.wal().written(lsn).await.is_ok() => {}
                _ => std::future::pending().await,
            }
        };
        let noop_at = p.next_noop_deadline();
        let noop_sleep = async {
            match noop_at {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        let changes = async {
            if can_send {
                signal.changed(generation).await
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            r = socket.read_buf(inbuf) => match r {
                Ok(0) => return "the consumer closed the connection",
                Ok(n) => { ctx.io.bytes_in.fetch_add(n as u64, Ordering::Relaxed); }
                Err(_) => return "read failed",
            },
            _ = changes => {}
            _ = written => {}
            _ = noop_sleep => {}
            _ = stop.changed() => return "the server is stopping",
            _ = claim.replaced.changed() => return "its name was opened by another connection",
        }
    }
}

/// GET_FAILOVER_LOG of a topic's partition: its history.
fn topic_failover_log(topic: &Topic, req: &Request<'_>, out: &mut Vec<u8>) -> Flow {
    match GetFailoverLog::decode(req) {
        Err(e) => respond(out, req, status::EINVAL, e.to_string().as_bytes()),
        Ok(g) if g.vbucket >= topic.num_partitions() => {
            respond(out, req, status::NOT_MY_VBUCKET, b"no such partition")
        }
        Ok(g) => {
            let entries = topic_stream::failover_log(topic, g.vbucket);
            let _ = FailoverLogResponse { entries }.encode(out, req.opaque);
        }
    }
    Flow::Continue
}

impl DcpStats {
    /// The Prometheus lines of the DCP producers' counters.
    pub fn metrics(&self, o: &mut String) {
        let d = self;
        metric(
            o,
            "sluice_dcp_connections",
            "gauge",
            "Open DCP producer connections.",
        );
        let _ = writeln!(o, "sluice_dcp_connections {}", d.connections.load(Relaxed));
        metric(o, "sluice_dcp_streams", "gauge", "Open DCP streams.");
        let _ = writeln!(o, "sluice_dcp_streams {}", d.streams.load(Relaxed));
        metric(
            o,
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
            o,
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
            o,
            "sluice_dcp_filtered_total",
            "counter",
            "Documents a StreamFilter plugin kept off DCP streams.",
        );
        let _ = writeln!(o, "sluice_dcp_filtered_total {}", d.filtered.load(Relaxed));
        metric(
            o,
            "sluice_dcp_dead_connections_total",
            "counter",
            "DCP connections closed because a NOOP went unanswered.",
        );
        let _ = writeln!(
            o,
            "sluice_dcp_dead_connections_total {}",
            d.dead_connections.load(Relaxed)
        );
    }
}
