//! The memcached binary protocol's KV commands over the engine: one request in, its reply (or,
//! for a quiet command that succeeded, nothing) appended to the connection's output.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use sluice_core::bucket::Bucket;
use sluice_core::{
    Durability, Error, MutationResult, Requirement, StoreMode, StoreRequest, Written,
};
use sluice_proto::mcbp::{
    self, feature, magic, opcode as op, status, FrameInfo, HeaderFields, Request,
};

use crate::server::Shared;
use sluice_proto::dcp::opcode as dcp_op;
use sluice_proto::tap::opcode as tap_op;

pub enum Flow {
    Continue,
    /// The reply waits for a durable write to settle: the connection sends it, and every reply
    /// after it, once it is ready, and goes on reading meanwhile.
    Hold(HeldReply),
    Close,
    /// DCP_OPEN succeeded (its reply is written): the connection becomes a DCP producer.
    DcpProducer(crate::dcp::producer::OpenProducer),
    /// A valid TAP_CONNECT (and its opaque): the connection becomes a TAP producer.
    TapProducer(sluice_proto::tap::TapConnect, u32),
}

/// A reply whose bytes are known once its write settles (success or the error it met).
pub struct HeldReply(Pin<Box<dyn Future<Output = Vec<u8>> + Send>>);

impl Future for HeldReply {
    type Output = Vec<u8>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Vec<u8>> {
        self.0.as_mut().poll(cx)
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Features {
    mutation_seqno: bool,
    xerror: bool,
    select_bucket: bool,
    json: bool,
    alt_request: bool,
    duplex: bool,
    tcp_nodelay: bool,
}

/// One connection's protocol state.
pub struct Session {
    shared: Arc<Shared>,
    bucket: Arc<Bucket>,
    features: Features,
    /// The authenticated user, if any.
    user: Option<String>,
    /// The last WAL record a reply given so far acknowledges: the connection sends no reply
    /// before the WAL has written this far.
    owed_lsn: u64,
}

/// The permission a command needs on the selected bucket (0: none, anyone may).
fn required_permission(opcode: u8) -> u8 {
    use crate::auth::{ADMIN, READ, STREAM, WRITE};
    match opcode {
        op::GET
        | op::GETQ
        | op::GETK
        | op::GETKQ
        | op::GET_REPLICA
        | op::STAT
        | op::GET_ALL_VB_SEQNOS => READ,
        op::GAT | op::GATQ => READ | WRITE,
        op::SET
        | op::SETQ
        | op::ADD
        | op::ADDQ
        | op::REPLACE
        | op::REPLACEQ
        | op::DELETE
        | op::DELETEQ => WRITE,
        op::INCREMENT | op::INCREMENTQ | op::DECREMENT | op::DECREMENTQ => WRITE,
        op::APPEND | op::APPENDQ | op::PREPEND | op::PREPENDQ | op::TOUCH => WRITE,
        op::FLUSH | op::FLUSHQ => ADMIN,
        // Takeover (TAP_CONNECT's TAKEOVER_VBUCKETS, a DCP stream's takeover flag) needs the
        // replication role on top: checked where the flag is read.
        sluice_proto::dcp::opcode::OPEN | tap_op::CONNECT => STREAM,
        // A TAP feed's flush empties the bucket and its vbucket state message kills or demotes
        // vbuckets: the same as FLUSH and a vbucket move, so admin.
        tap_op::FLUSH | tap_op::VBUCKET_SET => ADMIN,
        tap_op::MUTATION..=tap_op::CHECKPOINT_END => WRITE,
        _ => 0,
    }
}

/// GET_ALL_VB_SEQNOS's value, for the kv session and DCP connections alike: (u16 vbucket,
/// u64 high seqno) for each vbucket in the state the extras name (4 bytes: 1 active .. 4 dead),
/// the active ones without extras. Err: the EINVAL message.
pub fn all_vb_seqnos(
    engine: &sluice_core::Engine,
    bucket: &Bucket,
    extras: &[u8],
) -> Result<Vec<u8>, &'static str> {
    use sluice_core::vbucket::VbState;
    let wanted = match *extras {
        [] => VbState::Active,
        [a, b, c, d] => VbState::from_code(u32::from_be_bytes([a, b, c, d]))
            .ok_or("no such vbucket state (1 active, 2 replica, 3 pending, 4 dead)")?,
        _ => return Err("GET_ALL_VB_SEQNOS takes no extras or a 4-byte state"),
    };
    let mut value = Vec::new();
    for (vb, high) in engine.high_seqnos(bucket).into_iter().enumerate() {
        if engine.vbucket_state(bucket, vb as u16) == Some(wanted) {
            value.extend_from_slice(&(vb as u16).to_be_bytes());
            value.extend_from_slice(&high.to_be_bytes());
        }
    }
    Ok(value)
}

/// The engine's errors as the protocol's status codes.
pub fn status_of(e: &Error) -> u16 {
    match e {
        Error::NotFound => status::KEY_ENOENT,
        Error::Exists => status::KEY_EEXISTS,
        Error::NotStored => status::NOT_STORED,
        Error::NotNumeric => status::DELTA_BADVAL,
        Error::TooBig { .. } => status::E2BIG,
        Error::InvalidKey(_) | Error::InvalidArgument(_) | Error::InvalidConfig { .. } => {
            status::EINVAL
        }
        Error::NotMyVbucket(_) => status::NOT_MY_VBUCKET,
        Error::TempFail(_) | Error::Closed => status::ETMPFAIL,
        // The change is applied and the WAL keeps retrying it: its durability is unknown.
        Error::WalFailed(_) => status::SYNC_WRITE_AMBIGUOUS,
        Error::DurabilityImpossible(_) => status::DURABILITY_IMPOSSIBLE,
        Error::SyncWriteAmbiguous(_) => status::SYNC_WRITE_AMBIGUOUS,
        Error::NoSuchBucket(_) => status::NO_BUCKET,
        Error::Corrupt { .. } | Error::Io(_) => status::EINTERNAL,
    }
}

/// An error reply built from a raw header alone (its opcode and opaque), for frames that do not
/// parse or are not read at all.
fn reply_to_header(header: &[u8], st: u16, message: &[u8], out: &mut Vec<u8>) {
    if header.len() >= mcbp::HEADER_LEN {
        let opaque = u32::from_be_bytes(header[12..16].try_into().expect("4 bytes"));
        let h = HeaderFields {
            magic: magic::RESPONSE,
            opcode: header[1],
            word: st,
            opaque,
            ..Default::default()
        };
        let _ = mcbp::write_frame(out, &h, &[], &[], &[], message);
    }
}

fn durability_of(level: u8) -> Option<Durability> {
    match level {
        1 => Some(Durability::Majority),
        2 => Some(Durability::MajorityAndPersistActive),
        3 => Some(Durability::PersistToMajority),
        _ => None,
    }
}

struct Reply<'a> {
    out: &'a mut Vec<u8>,
    req: &'a Request<'a>,
}

impl Reply<'_> {
    fn send(&mut self, st: u16, cas: u64, extras: &[u8], key: &[u8], value: &[u8], datatype: u8) {
        let h = HeaderFields {
            magic: magic::RESPONSE,
            opcode: self.req.opcode,
            datatype,
            word: st,
            opaque: self.req.opaque,
            cas,
        };
        // Sections are bounded by what the engine holds (keys 250 bytes, values max_item_size).
        let _ = mcbp::write_frame(self.out, &h, &[], extras, key, value);
    }

    fn ok(&mut self) {
        self.send(status::SUCCESS, 0, &[], &[], &[], 0);
    }

    fn error(&mut self, st: u16, message: &str, xerror: bool) {
        error_frame(
            self.out,
            self.req.opcode,
            self.req.opaque,
            st,
            message,
            xerror,
        );
    }
}

/// An error reply: the message as text, or as Couchbase's JSON error context with XERROR.
fn error_frame(out: &mut Vec<u8>, opcode: u8, opaque: u32, st: u16, message: &str, xerror: bool) {
    let h = HeaderFields {
        magic: magic::RESPONSE,
        opcode,
        datatype: if xerror { 0x01 } else { 0 },
        word: st,
        opaque,
        cas: 0,
    };
    let _ = if xerror {
        let body = format!("{{\"error\":{{\"context\":{}}}}}", json_string(message));
        mcbp::write_frame(out, &h, &[], &[], &[], body.as_bytes())
    } else {
        mcbp::write_frame(out, &h, &[], &[], &[], message.as_bytes())
    };
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Session {
    pub fn new(shared: Arc<Shared>) -> Session {
        let bucket = shared
            .engine
            .bucket("default")
            .expect("the default bucket always exists");
        Session {
            shared,
            bucket,
            features: Features::default(),
            user: None,
            owed_lsn: 0,
        }
    }

    /// Whether a user has logged in (SASL) on this connection.
    pub fn authenticated(&self) -> bool {
        self.user.is_some()
    }

    /// The last WAL record the replies given so far acknowledge (see `owed_lsn`).
    pub fn owed_lsn(&self) -> u64 {
        self.owed_lsn
    }

    /// For connections that do not pipeline held replies (DCP and TAP producers): waits for a
    /// held reply, and for the WAL to hold what the replies in `out` acknowledge. Close if the
    /// WAL stopped without writing it (nothing unwritten is acknowledged).
    pub async fn settle(&self, flow: Flow, out: &mut Vec<u8>) -> Flow {
        let flow = match flow {
            Flow::Hold(held) => {
                out.extend_from_slice(&held.await);
                Flow::Continue
            }
            other => other,
        };
        if let Err(e) = self.shared.engine.wal().written(self.owed_lsn).await {
            log::warn!("closing a connection with unsent replies: {e}");
            out.clear();
            return Flow::Close;
        }
        flow
    }

    /// Answers a write: at once when the WAL writing it is all its level asks (the connection
    /// waits for that before it sends), held until it settles otherwise. `ok` writes the
    /// success reply; a quiet command's success has none.
    fn answer_write<T: Send + Sync + 'static>(
        &mut self,
        bucket: &Arc<Bucket>,
        w: Written<T>,
        reply: &mut Reply<'_>,
        quiet: bool,
        ok: impl FnOnce(&Self, &mut Reply<'_>, &T),
    ) -> Flow {
        self.owed_lsn = self.owed_lsn.max(w.lsn());
        if !w.needs_settling() {
            if !quiet {
                ok(self, reply, &w.value);
            }
            return Flow::Continue;
        }
        let mut done = Vec::new();
        if !quiet {
            ok(
                self,
                &mut Reply {
                    out: &mut done,
                    req: reply.req,
                },
                &w.value,
            );
        }
        let (opcode, opaque, xerror) = (reply.req.opcode, reply.req.opaque, self.features.xerror);
        let shared = self.shared.clone();
        let bucket = bucket.clone();
        Flow::Hold(HeldReply(Box::pin(async move {
            let timeout = shared.engine.settle_timeout(&bucket, &w);
            let timer = tokio::time::sleep(timeout);
            match shared.engine.settled(&bucket, w, timer).await {
                Ok(_) => done,
                Err(e) => {
                    let mut out = Vec::new();
                    error_frame(
                        &mut out,
                        opcode,
                        opaque,
                        status_of(&e),
                        &e.to_string(),
                        xerror,
                    );
                    out
                }
            }
        })))
    }

    /// The permission bits of the logged-in user on the selected bucket; all of them when the
    /// node has no users, none before login when it has.
    pub fn permissions(&self) -> u8 {
        let users = self.shared.users.read();
        if !users.required() {
            return u8::MAX;
        }
        self.user
            .as_deref()
            .and_then(|n| users.get(n))
            .map_or(0, |u| u.permissions(self.bucket.name()))
    }

    /// The EACCESS message for what only the replication role may do.
    pub fn lacks_replication(&self) -> String {
        format!(
            "user {} lacks the replication (or admin) permission on bucket {}: takeover and \
             registering as a replica need it",
            self.user.as_deref().unwrap_or("(none)"),
            self.bucket.name()
        )
    }

    /// The selected bucket.
    pub fn bucket(&self) -> Arc<Bucket> {
        self.bucket.clone()
    }

    /// Whether handling this frame takes long on a CPU (the deliberately slow password hash of
    /// SASL_AUTH), so the caller can move it off the async worker. Durable writes do not
    /// block: their replies are held (`Flow::Hold`).
    pub fn may_block(&self, frame: &[u8]) -> bool {
        frame.get(1) == Some(&op::SASL_AUTH)
    }

    /// The reply to a frame whose body is over the limit: E2BIG, with the header's opaque.
    pub fn refuse_too_big(&self, header: &[u8], out: &mut Vec<u8>) {
        reply_to_header(header, status::E2BIG, b"request body too large", out);
    }

    pub fn handle(&mut self, frame: &[u8], out: &mut Vec<u8>) -> Flow {
        let req = match mcbp::parse_request(frame) {
            // A server's request (0x82) goes from server to client: from a client it is never a
            // command (kv_engine takes requests 0x80 and 0x08 only, besides responses).
            Ok(r) if r.magic == magic::SERVER_REQUEST => {
                let why = "magic 0x82 is a server's request; a client sends 0x80 or 0x08";
                reply_to_header(frame, status::EINVAL, why.as_bytes(), out);
                return Flow::Continue;
            }
            Ok(r) => r,
            Err(e) => {
                // A frame whose sections do not add up: EINVAL, and the stream is still in sync
                // because frame_len framed it by its body length.
                reply_to_header(frame, status::EINVAL, e.to_string().as_bytes(), out);
                return Flow::Continue;
            }
        };
        let mut durability = None;
        for info in mcbp::frame_infos(req.framing) {
            match info {
                Ok(FrameInfo::Durability { level, timeout_ms }) => match durability_of(level) {
                    Some(d) => {
                        durability = Some(Requirement {
                            level: d,
                            timeout: timeout_ms
                                .map(|ms| std::time::Duration::from_millis(ms as u64)),
                        })
                    }
                    None => {
                        Reply { out, req: &req }.error(
                            status::DURABILITY_INVALID_LEVEL,
                            "unknown durability level",
                            self.features.xerror,
                        );
                        return Flow::Continue;
                    }
                },
                Ok(FrameInfo::Barrier) => {} // requests already run one after another
                Ok(other) => {
                    let why = format!("frame info {other:?} is not supported");
                    Reply { out, req: &req }.error(
                        status::UNKNOWN_FRAME_INFO,
                        &why,
                        self.features.xerror,
                    );
                    return Flow::Continue;
                }
                Err(e) => {
                    Reply { out, req: &req }.error(
                        status::EINVAL,
                        &e.to_string(),
                        self.features.xerror,
                    );
                    return Flow::Continue;
                }
            }
        }
        self.dispatch(frame, &req, durability, out)
    }

    fn dispatch(
        &mut self,
        frame: &[u8],
        req: &Request<'_>,
        durability: Option<Requirement>,
        out: &mut Vec<u8>,
    ) -> Flow {
        let quiet = op::is_quiet(req.opcode);
        let xerror = self.features.xerror;
        let mut reply = Reply { out, req };
        // Checks a vbucket-aware client's vbucket against the key's; 0 means "route it for me".
        let wrong_vbucket =
            |bucket: &Bucket| req.vbucket != 0 && req.vbucket != bucket.vbucket_of(req.key);
        macro_rules! fail {
            ($e:expr) => {{
                let e: Error = $e;
                reply.error(status_of(&e), &e.to_string(), xerror);
                return Flow::Continue;
            }};
        }
        macro_rules! einval {
            ($why:expr) => {{
                reply.error(status::EINVAL, $why, xerror);
                return Flow::Continue;
            }};
        }
        let engine = &self.shared.engine;
        let bucket = self.bucket.clone();
        let users = self.shared.users.read().clone();
        if users.required()
            && !matches!(
                req.opcode,
                op::HELLO
                    | op::NOOP
                    | op::VERSION
                    | op::QUIT
                    | op::QUITQ
                    | op::SASL_LIST_MECHS
                    | op::SASL_AUTH
                    | op::SASL_STEP
            )
        {
            let Some(user) = self.user.as_deref().and_then(|n| users.get(n)) else {
                reply.error(
                    status::AUTH_ERROR,
                    "authenticate first (SASL PLAIN)",
                    xerror,
                );
                return Flow::Continue;
            };
            let (target, need) = if req.opcode == op::SELECT_BUCKET {
                (String::from_utf8_lossy(req.key).into_owned(), 0)
            } else {
                (bucket.name().to_string(), required_permission(req.opcode))
            };
            let have = user.permissions(&target);
            if have == 0 || have & need != need {
                reply.error(
                    status::EACCESS,
                    &format!(
                        "user {} lacks that permission on bucket {target}",
                        user.name
                    ),
                    xerror,
                );
                return Flow::Continue;
            }
        }
        match req.opcode {
            op::SASL_LIST_MECHS => reply.send(status::SUCCESS, 0, &[], &[], b"PLAIN", 0),
            op::SASL_AUTH if req.key == b"PLAIN" => match users.authenticate_plain(req.value) {
                Some(name) => {
                    self.user = Some(name);
                    reply.send(status::SUCCESS, 0, &[], &[], b"Authenticated", 0);
                }
                None => {
                    self.user = None;
                    reply.error(status::AUTH_ERROR, "Auth failure", xerror);
                }
            },
            op::SASL_AUTH | op::SASL_STEP => {
                reply.error(status::AUTH_ERROR, "only SASL PLAIN is offered", xerror)
            }
            op::GET | op::GETQ | op::GETK | op::GETKQ | op::GET_REPLICA => {
                if !req.extras.is_empty() || !req.value.is_empty() {
                    einval!("GET takes a key only");
                }
                if wrong_vbucket(&bucket) {
                    fail!(Error::NotMyVbucket(req.vbucket));
                }
                let found = if req.opcode == op::GET_REPLICA {
                    engine.get_replica(&bucket, req.key)
                } else {
                    engine.get(&bucket, req.key)
                };
                match found {
                    Ok(Some(it)) => {
                        let key = if matches!(req.opcode, op::GETK | op::GETKQ | op::GET_REPLICA) {
                            req.key
                        } else {
                            &[]
                        };
                        reply.send(
                            status::SUCCESS,
                            it.meta.cas,
                            &it.meta.flags.to_be_bytes(),
                            key,
                            it.value(),
                            self.datatype(it.meta.datatype),
                        );
                    }
                    Ok(None) if quiet => {}
                    Ok(None) => {
                        let key = if req.opcode == op::GETK { req.key } else { &[] };
                        reply.send(status::KEY_ENOENT, 0, &[], key, b"Not found", 0);
                    }
                    Err(e) => fail!(e),
                }
            }
            op::SET | op::SETQ | op::ADD | op::ADDQ | op::REPLACE | op::REPLACEQ => {
                let Some((flags, expiry)) = mcbp::store_extras(req.extras) else {
                    einval!("SET, ADD and REPLACE take 8 bytes of extras")
                };
                if wrong_vbucket(&bucket) {
                    fail!(Error::NotMyVbucket(req.vbucket));
                }
                let mode = match req.opcode {
                    op::SET | op::SETQ => StoreMode::Set,
                    op::ADD | op::ADDQ => StoreMode::Add,
                    _ => StoreMode::Replace,
                };
                if mode == StoreMode::Add && req.cas != 0 {
                    einval!("ADD takes no CAS");
                }
                let r = StoreRequest {
                    key: req.key,
                    value: req.value,
                    flags,
                    expiry,
                    datatype: req.datatype & sluice_core::item::DATATYPE_CLIENT_BITS,
                    cas: req.cas,
                    mode,
                    durability,
                };
                match engine.write_store(&bucket, &r) {
                    Ok(w) => {
                        return self.answer_write(&bucket, w, &mut reply, quiet, |s, r, m| {
                            s.mutation_reply(r, &bucket, m)
                        })
                    }
                    // memcached: ADD on an existing key and REPLACE of a missing one are NOT_STORED
                    // only in the text protocol; the binary protocol says EEXISTS / ENOENT.
                    Err(e) => fail!(e),
                }
            }
            op::DELETE | op::DELETEQ => {
                if !req.extras.is_empty() || !req.value.is_empty() {
                    einval!("DELETE takes a key only");
                }
                if wrong_vbucket(&bucket) {
                    fail!(Error::NotMyVbucket(req.vbucket));
                }
                match engine.write_delete(&bucket, req.key, req.cas, durability) {
                    Ok(w) => {
                        return self.answer_write(&bucket, w, &mut reply, quiet, |s, r, m| {
                            // memcached answers a DELETE with CAS 0 (its conformance checker
                            // insists); Couchbase-aware clients (MUTATION_SEQNO) get the
                            // tombstone's CAS.
                            if s.features.mutation_seqno {
                                s.mutation_reply(r, &bucket, m)
                            } else {
                                r.ok()
                            }
                        });
                    }
                    Err(e) => fail!(e),
                }
            }
            op::INCREMENT | op::INCREMENTQ | op::DECREMENT | op::DECREMENTQ => {
                let Some((delta, initial, expiry)) = mcbp::arithmetic_extras(req.extras) else {
                    einval!("INCR and DECR take 20 bytes of extras")
                };
                if !req.value.is_empty() {
                    einval!("INCR and DECR take no value");
                }
                if wrong_vbucket(&bucket) {
                    fail!(Error::NotMyVbucket(req.vbucket));
                }
                let inc = matches!(req.opcode, op::INCREMENT | op::INCREMENTQ);
                match engine.write_arithmetic(
                    &bucket, req.key, delta, initial, expiry, inc, req.cas, durability,
                ) {
                    Ok(w) => {
                        return self.answer_write(&bucket, w, &mut reply, quiet, |s, r, (m, n)| {
                            let extras = s.seqno_extras(&bucket, m);
                            r.send(status::SUCCESS, m.cas, &extras, &[], &n.to_be_bytes(), 0);
                        })
                    }
                    Err(e) => fail!(e),
                }
            }
            op::APPEND | op::APPENDQ | op::PREPEND | op::PREPENDQ => {
                if !req.extras.is_empty() {
                    einval!("APPEND and PREPEND take no extras");
                }
                if wrong_vbucket(&bucket) {
                    fail!(Error::NotMyVbucket(req.vbucket));
                }
                let at_end = matches!(req.opcode, op::APPEND | op::APPENDQ);
                match engine.write_concat(&bucket, req.key, req.value, at_end, req.cas, durability)
                {
                    Ok(w) => {
                        return self.answer_write(&bucket, w, &mut reply, quiet, |s, r, m| {
                            s.mutation_reply(r, &bucket, m)
                        })
                    }
                    Err(e) => fail!(e),
                }
            }
            op::TOUCH | op::GAT | op::GATQ => {
                let Some(expiry) = mcbp::expiry_extras(req.extras) else {
                    einval!("TOUCH and GAT take 4 bytes of extras")
                };
                if wrong_vbucket(&bucket) {
                    fail!(Error::NotMyVbucket(req.vbucket));
                }
                match engine.write_touch(&bucket, req.key, expiry, durability) {
                    Ok(w) => {
                        return self.answer_write(&bucket, w, &mut reply, false, |s, r, (m, it)| {
                            if r.req.opcode == op::TOUCH {
                                r.send(status::SUCCESS, m.cas, &[], &[], &[], 0)
                            } else {
                                r.send(
                                    status::SUCCESS,
                                    m.cas,
                                    &it.meta.flags.to_be_bytes(),
                                    &[],
                                    it.value(),
                                    s.datatype(it.meta.datatype),
                                )
                            }
                        })
                    }
                    Err(Error::NotFound) if req.opcode == op::GATQ => {}
                    Err(e) => fail!(e),
                }
            }
            op::FLUSH | op::FLUSHQ => {
                match req.extras.len() {
                    0 => {}
                    4 if mcbp::expiry_extras(req.extras) == Some(0) => {}
                    4 => {
                        reply.error(
                            status::NOT_SUPPORTED,
                            "delayed flush is not supported",
                            xerror,
                        );
                        return Flow::Continue;
                    }
                    _ => einval!("FLUSH takes no extras or 4 bytes"),
                }
                match engine.write_flush(&bucket) {
                    Ok(w) => {
                        return self.answer_write(&bucket, w, &mut reply, quiet, |_, r, _| r.ok())
                    }
                    Err(e) => fail!(e),
                }
            }
            op::NOOP => reply.ok(),
            op::VERSION => reply.send(
                status::SUCCESS,
                0,
                &[],
                &[],
                env!("CARGO_PKG_VERSION").as_bytes(),
                0,
            ),
            op::QUIT => {
                reply.ok();
                return Flow::Close;
            }
            op::QUITQ => return Flow::Close,
            op::HELLO => self.hello(&mut reply),
            op::SELECT_BUCKET => match engine.bucket(&String::from_utf8_lossy(req.key)) {
                Ok(b) => {
                    self.bucket = b;
                    reply.ok();
                }
                Err(e) => fail!(e),
            },
            op::STAT => self.stat(&mut reply),
            dcp_op::OPEN => match crate::dcp::producer::check_open(req) {
                Ok(open) => {
                    reply.ok();
                    return Flow::DcpProducer(open);
                }
                Err((st, why)) => reply.error(st, &why, xerror),
            },
            tap_op::CONNECT => match crate::tap::producer::check_connect(req) {
                Ok(c)
                    if c.flags & sluice_proto::tap::connect_flag::TAKEOVER_VBUCKETS != 0
                        && !crate::auth::may_replicate(self.permissions()) =>
                {
                    reply.error(status::EACCESS, &self.lacks_replication(), xerror)
                }
                Ok(c) => return Flow::TapProducer(c, req.opaque),
                Err((st, why)) => reply.error(st, &why, xerror),
            },
            tap_op::MUTATION..=tap_op::CHECKPOINT_END => {
                match crate::tap::apply::apply(&self.shared, &bucket, frame) {
                    // A TAP message is answered when it asks for an ACK, or failed.
                    Ok(applied) => match applied.written {
                        Some(w) => {
                            let quiet = !applied.ack;
                            return self
                                .answer_write(&bucket, w, &mut reply, quiet, |_, r, _| r.ok());
                        }
                        None if applied.ack => reply.ok(),
                        None => {}
                    },
                    Err(e) => fail!(e),
                }
            }
            dcp_op::ADD_STREAM..=dcp_op::CACHE_TRANSFER_END => reply.error(
                status::EINVAL,
                "open a DCP connection first (DCP_OPEN)",
                xerror,
            ),
            op::GET_ALL_VB_SEQNOS => match all_vb_seqnos(engine, &bucket, req.extras) {
                Ok(value) => reply.send(status::SUCCESS, 0, &[], &[], &value, 0),
                Err(why) => einval!(why),
            },
            _ => {
                reply.error(
                    status::UNKNOWN_COMMAND,
                    &format!("unknown command 0x{:02x}", req.opcode),
                    xerror,
                );
            }
        }
        Flow::Continue
    }

    /// Datatype bits the client may see: JSON only if it said it understands it.
    fn datatype(&self, stored: u8) -> u8 {
        if self.features.json {
            stored & 0x01
        } else {
            0
        }
    }

    fn seqno_extras(&self, bucket: &Bucket, m: &MutationResult) -> Vec<u8> {
        if !self.features.mutation_seqno {
            return Vec::new();
        }
        let uuid = self
            .shared
            .engine
            .failover_log(bucket, m.vbucket)
            .and_then(|l| l.first().map(|e| e.uuid))
            .unwrap_or(0);
        let mut x = Vec::with_capacity(16);
        x.extend_from_slice(&uuid.to_be_bytes());
        x.extend_from_slice(&m.seqno.to_be_bytes());
        x
    }

    fn mutation_reply(&self, reply: &mut Reply<'_>, bucket: &Bucket, m: &MutationResult) {
        let extras = self.seqno_extras(bucket, m);
        reply.send(status::SUCCESS, m.cas, &extras, &[], &[], 0);
    }

    fn hello(&mut self, reply: &mut Reply<'_>) {
        let mut enabled = Vec::new();
        let mut f = Features::default();
        for code in reply.req.value.chunks_exact(2) {
            let code = u16::from_be_bytes([code[0], code[1]]);
            let known = match code {
                feature::TCP_NODELAY => !std::mem::replace(&mut f.tcp_nodelay, true),
                feature::MUTATION_SEQNO => !std::mem::replace(&mut f.mutation_seqno, true),
                feature::XERROR => !std::mem::replace(&mut f.xerror, true),
                feature::SELECT_BUCKET => !std::mem::replace(&mut f.select_bucket, true),
                feature::JSON => !std::mem::replace(&mut f.json, true),
                feature::DUPLEX => !std::mem::replace(&mut f.duplex, true),
                feature::ALT_REQUEST_SUPPORT => !std::mem::replace(&mut f.alt_request, true),
                _ => false,
            };
            if known {
                enabled.extend_from_slice(&code.to_be_bytes());
            }
        }
        self.features = f;
        reply.send(status::SUCCESS, 0, &[], &[], &enabled, 0);
    }

    /// STAT vbucket-seqno (Couchbase's names): per vbucket its uuid, high seqno and purge seqno.
    fn stat_vbucket_seqno(&self, reply: &mut Reply<'_>) {
        let b = &self.bucket;
        for v in 0..b.num_vbuckets() {
            let Some(vb) = b.lock_vbucket(v) else {
                continue;
            };
            let uuid = vb.failover.latest().map(|e| e.uuid).unwrap_or(0);
            let rows = [
                (format!("vb_{v}:uuid"), uuid.to_string()),
                (format!("vb_{v}:high_seqno"), vb.high_seqno.to_string()),
                (format!("vb_{v}:abs_high_seqno"), vb.high_seqno.to_string()),
                (format!("vb_{v}:purge_seqno"), vb.purge_seqno.to_string()),
                (
                    format!("vb_{v}:persisted_seqno"),
                    vb.persisted_seqno.to_string(),
                ),
            ];
            drop(vb);
            for (k, val) in rows {
                reply.send(status::SUCCESS, 0, &[], k.as_bytes(), val.as_bytes(), 0);
            }
        }
        reply.send(status::SUCCESS, 0, &[], &[], &[], 0);
    }

    /// The default STAT group: one reply per statistic, then an empty one that ends the list.
    fn stat(&self, reply: &mut Reply<'_>) {
        use std::sync::atomic::Ordering::Relaxed;
        match reply.req.key {
            b"" => {}
            b"vbucket-seqno" => return self.stat_vbucket_seqno(reply),
            _ => {
                reply.error(
                    status::KEY_ENOENT,
                    "STAT groups: the default one and vbucket-seqno",
                    self.features.xerror,
                );
                return;
            }
        }
        let e = &self.shared.engine;
        let s = &self.shared.stats;
        let b = &self.bucket;
        let items: usize = (0..b.num_vbuckets())
            .map(|v| {
                b.lock_vbucket(v)
                    .map(|vb| vb.store.live_items())
                    .unwrap_or(0)
            })
            .sum();
        let pairs: Vec<(&str, String)> = vec![
            ("pid", std::process::id().to_string()),
            (
                "uptime",
                self.shared.started.elapsed().as_secs().to_string(),
            ),
            ("time", sluice_core::hlc::now_secs().to_string()),
            ("version", env!("CARGO_PKG_VERSION").to_string()),
            (
                "curr_connections",
                s.curr_connections.load(Relaxed).to_string(),
            ),
            (
                "total_connections",
                s.connections_total.load(Relaxed).to_string(),
            ),
            (
                "rejected_connections",
                s.connections_rejected.load(Relaxed).to_string(),
            ),
            ("bytes_read", s.bytes_in.load(Relaxed).to_string()),
            ("bytes_written", s.bytes_out.load(Relaxed).to_string()),
            ("curr_items", items.to_string()),
            ("bytes", b.mem_used().to_string()),
            ("limit_maxbytes", b.config.memory_quota.to_string()),
            ("cmd_get", b.stats.gets.load(Relaxed).to_string()),
            ("get_misses", b.stats.get_misses.load(Relaxed).to_string()),
            (
                "get_hits",
                (b.stats.gets.load(Relaxed)
                    - b.stats
                        .get_misses
                        .load(Relaxed)
                        .min(b.stats.gets.load(Relaxed)))
                .to_string(),
            ),
            ("cmd_set", b.stats.sets.load(Relaxed).to_string()),
            ("delete_hits", b.stats.deletes.load(Relaxed).to_string()),
            (
                "expired_unfetched",
                b.stats.expired_by_pager.load(Relaxed).to_string(),
            ),
            (
                "ep_tmp_failures",
                b.stats.tmp_failures.load(Relaxed).to_string(),
            ),
            ("ep_wal_synced_lsn", e.wal().synced_lsn().to_string()),
            ("ep_num_vbuckets", b.num_vbuckets().to_string()),
        ];
        for (k, v) in pairs {
            reply.send(status::SUCCESS, 0, &[], k.as_bytes(), v.as_bytes(), 0);
        }
        reply.send(status::SUCCESS, 0, &[], &[], &[], 0);
    }
}
