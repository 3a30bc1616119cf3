//! The memcached binary protocol's KV commands over the engine: one request in, its reply (or,
//! for a quiet command that succeeded, nothing) appended to the connection's output.
//!
//! One file per command family: `read`, `write`, `stat`; `reply` builds the frames they answer with.

use std::sync::Arc;

use sluice_core::bucket::Bucket;
use sluice_core::{Durability, Requirement};
use sluice_proto::mcbp::{self, feature, magic, opcode as op, status, FrameInfo, Request};

use crate::auth::UserTable;
use crate::clustermap::ClusterMap;
use crate::stats::ConnectionStats;
use sluice_core::Engine;
use sluice_proto::dcp::opcode as dcp_op;
use sluice_proto::errormap;
use sluice_proto::tap::opcode as tap_op;

/// Answers an engine error and ends the command.
macro_rules! fail {
    ($reply:expr, $xerror:expr, $e:expr) => {{
        let e: sluice_core::Error = $e;
        $reply.error($crate::kv::status_for(&e, $xerror), &e.to_string(), $xerror);
        return $crate::kv::Flow::Continue;
    }};
}

/// Answers EINVAL (a malformed request) and ends the command.
macro_rules! einval {
    ($reply:expr, $xerror:expr, $why:expr) => {{
        $reply.error(sluice_proto::mcbp::status::EINVAL, $why, $xerror);
        return $crate::kv::Flow::Continue;
    }};
}

mod meta;
pub mod range_scan;
mod read;
mod reply;
mod sasl;
mod stat;
mod subdoc;
mod tap_in;
pub mod text;
mod write;

pub use read::{all_vb_seqnos, wanted_state};
pub(crate) use reply::reply_to_header;
use reply::Reply;
pub use reply::{status_for, status_of, HeldReply};
pub use stat::general_stats;

/// Whether a vbucket-aware client's vbucket differs from the key's (0 means "route it for me").
fn wrong_vbucket(req: &Request<'_>, bucket: &Bucket) -> bool {
    req.vbucket != 0 && req.vbucket != bucket.vbucket_of(req.key)
}

pub enum Flow {
    Continue,
    /// The reply waits for a durable write to settle: the connection sends it, and every reply
    /// after it, once it is ready, and goes on reading meanwhile.
    Hold(HeldReply),
    Close,
    /// A request that opens a change stream (DCP_OPEN, TAP_CONNECT), allowed to this user
    /// and not answered yet: the connection hands it to the stream's front, which checks it,
    /// answers it and takes the connection over.
    OpenStream,
}

/// A client connection handed from the KV front to a stream front (DCP, TAP) once a request
/// opened a stream: the socket, what was read and not yet handled, the replies not yet sent
/// (the WAL holds what they acknowledge), the session (user, bucket, features), the peer and
/// the server's stop signal.
pub struct Handoff {
    pub socket: crate::tls::MaybeTls,
    pub inbuf: bytes::BytesMut,
    pub out: Vec<u8>,
    pub session: KvSession,
    pub peer: std::net::SocketAddr,
    pub stop: tokio::sync::watch::Receiver<bool>,
}

/// What the KV front works with, shared by every connection: handed over by the server.
pub struct KvContext {
    pub engine: Arc<Engine>,
    pub users: Arc<UserTable>,
    pub stats: Arc<ConnectionStats>,
    pub started: std::time::Instant,
    /// TAP messages applied from a feed (`tap_in`).
    pub tap_applied: std::sync::atomic::AtomicU64,
    /// The cluster map clients bootstrap from (GET_CLUSTER_CONFIG, NOT_MY_VBUCKET bodies).
    pub clustermap: Arc<ClusterMap>,
    /// The configured spaces, which `STAT spaces` describes (their buckets are ordinary ones
    /// here; the iproto front serves them as spaces).
    pub spaces: Arc<[crate::space::SpaceConfig]>,
    /// The KV range scans open on this node.
    pub range_scans: range_scan::RangeScans,
}

impl KvContext {
    /// The front alone over a fresh engine in `dir` (bucket `default` of 4 vbuckets, no WAL):
    /// for driving `KvSession::handle` in-process, as its tests and the `kv` fuzz target do.
    pub fn scratch(
        dir: &std::path::Path,
        users: crate::auth::Users,
    ) -> sluice_core::Result<KvContext> {
        let mut b = sluice_core::BucketConfig::named("default");
        b.num_vbuckets = 4;
        let engine = Engine::open(sluice_core::EngineConfig {
            data_dir: dir.to_path_buf(),
            wal_mode: sluice_core::wal::WalMode::None,
            snapshot_interval: std::time::Duration::ZERO,
            buckets: vec![b],
            ..Default::default()
        })?;
        Ok(KvContext {
            engine: Arc::new(engine),
            users: Arc::new(UserTable::new(users)),
            stats: Default::default(),
            started: std::time::Instant::now(),
            tap_applied: Default::default(),
            clustermap: Arc::new(ClusterMap::new(
                std::net::SocketAddr::from(([127, 0, 0, 1], 11210)),
                None,
            )),
            spaces: Arc::from([]),
            range_scans: Default::default(),
        })
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
    clustermap_notifications: bool,
    collections: bool,
    unordered: bool,
    /// Said in HELLO only: the frame info works whether or not the client said it.
    preserve_ttl: bool,
    /// Said in HELLO only, as the three below: extended attributes, virtual ones, and
    /// documents created deleted work on every connection (Couchbase's SDK enables its
    /// transactions' staged inserts only where the server said CreateAsDeleted).
    xattr: bool,
    vattr: bool,
    create_as_deleted: bool,
}

/// One connection's protocol state.
pub struct KvSession {
    ctx: Arc<KvContext>,
    /// The selected bucket behind a handle of the session's own: the hot paths clone it per
    /// request, and cloning the engine's shared `Arc<Bucket>` from every connection on every
    /// core would bounce its reference count between the cores. The extra allocation is the
    /// point, hence the allowance.
    #[allow(clippy::redundant_allocation)]
    bucket: Arc<Arc<Bucket>>,
    /// What a NOT_MY_VBUCKET reply carries (see `map_source`), built when the bucket or the
    /// negotiated features change, for the same reason.
    map: Arc<MapFn>,
    /// The users as of `users_generation`, refreshed when the table's generation moves on, so
    /// that a request reads them without the table's lock.
    users: Arc<crate::auth::Users>,
    users_generation: u64,
    features: Features,
    /// The authenticated user, if any.
    user: Option<String>,
    /// A SCRAM exchange between SASL_AUTH and SASL_STEP (`sasl`).
    scram: Option<crate::scram::Exchange>,
    /// The last WAL record a reply given so far acknowledges: the connection sends no reply
    /// before the WAL has written this far.
    owed_lsn: u64,
    /// Whether the client chose its bucket (SELECT_BUCKET): a client that can and has not gets
    /// the cluster-level map from GET_CLUSTER_CONFIG, as from Couchbase.
    selected: bool,
    /// The newest map rev this client has been sent (pushed or asked for).
    map_rev: i64,
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
        | op::GET_ALL_VB_SEQNOS
        | op::RANGE_SCAN_CREATE
        | op::RANGE_SCAN_CONTINUE
        | op::RANGE_SCAN_CANCEL => READ,
        op::GAT | op::GATQ => READ | WRITE,
        op::GET_META | op::GETQ_META => READ,
        // A lock keeps writers out, and only its holder's writes get in.
        op::GET_LOCKED | op::UNLOCK_KEY => READ | WRITE,
        op::SUBDOC_GET | op::SUBDOC_EXISTS | op::SUBDOC_GET_COUNT | op::SUBDOC_MULTI_LOOKUP => READ,
        // A sub-document mutation reads the document it changes, and answers with parts of it
        // (a counter's value).
        op::SUBDOC_DICT_ADD..=op::SUBDOC_COUNTER
        | op::SUBDOC_MULTI_MUTATION
        | op::SUBDOC_REPLACE_BODY_WITH_XATTR => READ | WRITE,
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

/// A session's source of the cluster map for NOT_MY_VBUCKET replies.
type MapFn = dyn Fn() -> (Arc<str>, u8) + Send + Sync;

fn map_fn(ctx: &Arc<KvContext>, bucket: &Arc<Bucket>, json: bool) -> Arc<MapFn> {
    let (ctx, bucket) = (ctx.clone(), bucket.clone());
    Arc::new(move || {
        let (_, config) = ctx.clustermap.bucket_config(&ctx.engine, &bucket);
        (config, if json { DATATYPE_JSON } else { 0 })
    })
}

fn durability_of(level: u8) -> Option<Durability> {
    match level {
        1 => Some(Durability::Majority),
        2 => Some(Durability::MajorityAndPersistActive),
        3 => Some(Durability::PersistToMajority),
        _ => None,
    }
}

impl KvSession {
    pub fn new(ctx: Arc<KvContext>) -> KvSession {
        let bucket = ctx
            .engine
            .bucket("default")
            .expect("the default bucket always exists");
        let (users, users_generation) = ctx.users.current_with_generation();
        let map = map_fn(&ctx, &bucket, false);
        KvSession {
            ctx,
            bucket: Arc::new(bucket),
            map,
            users,
            users_generation,
            features: Features::default(),
            user: None,
            scram: None,
            owed_lsn: 0,
            selected: false,
            map_rev: 0,
        }
    }

    /// What a NOT_MY_VBUCKET reply of this session carries: its bucket's cluster map.
    fn map_source(&self) -> Arc<MapFn> {
        self.map.clone()
    }

    fn refresh_map(&mut self) {
        self.map = map_fn(&self.ctx, &self.bucket, self.features.json);
    }

    /// The users now, read without the table's lock unless a reload happened since the last
    /// request.
    fn refresh_users(&mut self) {
        let generation = self.ctx.users.generation();
        if generation != self.users_generation {
            (self.users, self.users_generation) = self.ctx.users.current_with_generation();
        }
    }

    /// Whether the client let replies come out of order (HELLO's UnorderedExecution): a
    /// durable write's reply then does not hold back the replies of the requests behind it.
    pub fn unordered(&self) -> bool {
        self.features.unordered
    }

    /// Whether the client asked to be sent the new cluster map when it changes (HELLO's
    /// Duplex and ClustermapChangeNotification).
    /// Only after login on a node with users: the map names every node's address.
    pub fn wants_map_pushes(&self) -> bool {
        self.features.duplex
            && self.features.clustermap_notifications
            && (self.user.is_some() || !self.ctx.users.current().required())
    }

    /// The change notification (server request 0x01) for the session's bucket, if its map is
    /// newer than the last one this client was sent: the bucket's name as key, the map as
    /// value, and the epoch and rev (two signed 64-bit integers) as extras.
    pub fn push_map(&mut self, out: &mut Vec<u8>) {
        let engine = &self.ctx.engine;
        let (rev, config, name) = if self.cluster_level() {
            let (rev, config) = self.ctx.clustermap.cluster_config(engine);
            (rev, config, String::new())
        } else {
            let (rev, config) = self.ctx.clustermap.bucket_config(engine, &self.bucket);
            (rev, config, self.bucket.name().to_string())
        };
        if rev <= self.map_rev {
            return;
        }
        self.map_rev = rev;
        let mut extras = [0u8; 16];
        extras[..8].copy_from_slice(&MAP_EPOCH.to_be_bytes());
        extras[8..].copy_from_slice(&rev.to_be_bytes());
        let h = mcbp::HeaderFields {
            magic: magic::SERVER_REQUEST,
            opcode: mcbp::server_opcode::CLUSTERMAP_CHANGE_NOTIFICATION,
            datatype: DATATYPE_JSON,
            word: 0,
            opaque: 0,
            cas: 0,
        };
        let _ = mcbp::write_frame(out, &h, &[], &extras, name.as_bytes(), config.as_bytes());
    }

    /// Whether GET_CLUSTER_CONFIG answers the cluster-level map: the client can select a
    /// bucket (HELLO) and has not.
    fn cluster_level(&self) -> bool {
        self.features.select_bucket && !self.selected
    }

    /// The cluster map's changes, for a connection that pushes them.
    pub fn map_changes(&self) -> tokio::sync::watch::Receiver<i64> {
        self.ctx.clustermap.subscribe()
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
    /// WAL stopped or fails without writing it (nothing unwritten is acknowledged).
    pub async fn settle(&self, flow: Flow, out: &mut Vec<u8>) -> Flow {
        let flow = match flow {
            Flow::Hold(held) => {
                out.extend_from_slice(&held.await);
                Flow::Continue
            }
            other => other,
        };
        if crate::request::acknowledged(&self.ctx.engine, self.owed_lsn)
            .await
            .is_err()
        {
            out.clear();
            return Flow::Close;
        }
        flow
    }

    /// The permission bits of the logged-in user on the selected bucket; all of them when the
    /// node has no users, none before login when it has.
    pub fn permissions(&self) -> u8 {
        let users = self.ctx.users.current();
        if !users.required() {
            return u8::MAX;
        }
        self.user
            .as_deref()
            .and_then(|n| users.get(n))
            .map_or(0, |u| u.permissions(self.bucket.name()))
    }

    /// The user logged in, if any.
    pub fn user_name(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// The permission bits of the logged-in user on the topic `topic` (`[users.NAME] topics`);
    /// all of them when the node has no users.
    pub fn topic_permissions(&self, topic: &str) -> u8 {
        let users = self.ctx.users.current();
        let who = match self.user.as_deref() {
            Some(name) => crate::request::Principal::User(name),
            None => crate::request::Principal::Nobody,
        };
        crate::request::topic_permissions(&users, who, topic)
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

    /// Answers a request with success and no body.
    pub fn reply_ok(&self, req: &Request<'_>, out: &mut Vec<u8>) {
        let map = self.map_source();
        Reply {
            out,
            req,
            map: &*map,
        }
        .ok();
    }

    /// Answers a request with an error: its message as text, or as Couchbase's JSON error
    /// context when the client asked for XERROR.
    pub fn reply_error(&self, req: &Request<'_>, st: u16, message: &str, out: &mut Vec<u8>) {
        let map = self.map_source();
        Reply {
            out,
            req,
            map: &*map,
        }
        .error(st, message, self.features.xerror);
    }

    /// The engine this session works on.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.ctx.engine
    }

    /// The selected bucket.
    pub fn bucket(&self) -> Arc<Bucket> {
        Arc::clone(&self.bucket)
    }

    /// Whether this frame is a SASL attempt (SASL_AUTH, SASL_STEP): the caller runs it through
    /// `login`, which throttles failures and moves PLAIN's deliberately slow password hash off
    /// the async worker. Durable writes do not block: their replies are held (`Flow::Hold`).
    pub fn is_sasl_attempt(&self, frame: &[u8]) -> bool {
        matches!(frame.get(1), Some(&op::SASL_AUTH | &op::SASL_STEP))
    }

    /// The reply to a frame whose body is over the limit: E2BIG, with the header's opaque.
    pub fn refuse_too_big(&self, header: &[u8], out: &mut Vec<u8>) {
        reply_to_header(header, status::E2BIG, b"request body too large", out);
    }

    /// `handle` on a connection that streams already (a DCP or TAP producer): a second
    /// DCP_OPEN or TAP_CONNECT is refused with EINVAL rather than handed anywhere.
    pub fn handle_streaming(&mut self, frame: &[u8], out: &mut Vec<u8>) -> Flow {
        match self.handle(frame, out) {
            Flow::OpenStream => {
                if let Ok(req) = mcbp::parse_request(frame) {
                    self.reply_error(&req, status::EINVAL, "this connection is open already", out);
                }
                Flow::Continue
            }
            other => other,
        }
    }

    pub fn handle(&mut self, frame: &[u8], out: &mut Vec<u8>) -> Flow {
        let req = match mcbp::parse_request(frame) {
            // A server's request (0x82) goes from server to client: from a client it is never a
            // command (kv_engine takes requests 0x80 and 0x08 only, besides responses).
            // A client's answer to a server request (a map change notification): nothing to do.
            Err(_) if frame.first() == Some(&magic::SERVER_RESPONSE) => return Flow::Continue,
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
        let map = self.map_source();
        let mut framing = Framing::default();
        for info in mcbp::frame_infos(req.framing) {
            let refused = match info {
                Ok(FrameInfo::Durability { .. }) if !mcbp::supports_durability(req.opcode) => {
                    Some((
                        status::EINVAL,
                        "The requested command does not support durability requirements".into(),
                    ))
                }
                Ok(FrameInfo::Durability { level, timeout_ms }) => match durability_of(level) {
                    Some(d) => {
                        framing.durability = Some(Requirement {
                            level: d,
                            timeout: timeout_ms
                                .map(|ms| std::time::Duration::from_millis(ms as u64)),
                        });
                        None
                    }
                    None => Some((
                        status::DURABILITY_INVALID_LEVEL,
                        "unknown durability level".into(),
                    )),
                },
                Ok(FrameInfo::Barrier) => None, // requests already run one after another
                Ok(FrameInfo::PreserveTtl) if !mcbp::supports_preserve_ttl(req.opcode) => Some((
                    status::EINVAL,
                    "The requested command does not support preserve TTL".into(),
                )),
                Ok(FrameInfo::PreserveTtl) => {
                    framing.preserve_ttl = true;
                    None
                }
                Ok(other) => Some((
                    status::UNKNOWN_FRAME_INFO,
                    format!("frame info {other:?} is not supported"),
                )),
                Err(e) => Some((status::EINVAL, e.to_string())),
            };
            if let Some((status, why)) = refused {
                Reply {
                    out,
                    req: &req,
                    map: &*map,
                }
                .error(status, &why, self.features.xerror);
                return Flow::Continue;
            }
        }
        // With Collections, a document key starts with its collection id: checked once here,
        // and the commands (and the vbucket hash) see the key without it.
        let mut req = req;
        if self.features.collections && mcbp::carries_document_key(req.opcode) {
            match mcbp::split_collection_id(req.key) {
                Ok((DEFAULT_COLLECTION, key)) => req.key = key,
                Ok((id, _)) => {
                    let body = unknown_collection(&format!("unknown collection id {id:#x}"));
                    mcbp::write_response(
                        out,
                        req.opcode,
                        req.opaque,
                        status::UNKNOWN_COLLECTION,
                        DATATYPE_JSON,
                        body.as_bytes(),
                    );
                    return Flow::Continue;
                }
                Err(e) => {
                    let mut reply = Reply {
                        out,
                        req: &req,
                        map: &*map,
                    };
                    reply.error(status::EINVAL, &e.to_string(), self.features.xerror);
                    return Flow::Continue;
                }
            }
        }
        drop(map);
        self.dispatch(frame, &req, framing, out)
    }

    fn dispatch(
        &mut self,
        frame: &[u8],
        req: &Request<'_>,
        framing: Framing,
        out: &mut Vec<u8>,
    ) -> Flow {
        let durability = framing.durability;
        let xerror = self.features.xerror;
        let map = self.map_source();
        let mut reply = Reply {
            out,
            req,
            map: &*map,
        };
        self.refresh_users();
        let engine = &self.ctx.engine;
        let users = &self.users;
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
                    // What statuses mean: clients (Couchbase's Java SDK) ask before they log in.
                    | op::GET_ERROR_MAP
            )
        {
            let Some(user) = self.user.as_deref().and_then(|n| users.get(n)) else {
                reply.error(status::AUTH_ERROR, "authenticate first (SASL)", xerror);
                return Flow::Continue;
            };
            // `STAT spaces` lists only the spaces whose buckets the user may read, whatever
            // bucket is selected: a reader learns a space's bucket from it.
            let spaces_stat = req.opcode == op::STAT && req.key == b"spaces";
            let (target, need) = if req.opcode == op::SELECT_BUCKET {
                (String::from_utf8_lossy(req.key).into_owned(), 0)
            } else {
                (
                    self.bucket.name().to_string(),
                    required_permission(req.opcode),
                )
            };
            let have = user.permissions(&target);
            if !spaces_stat && (have == 0 || have & need != need) {
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
            op::SASL_LIST_MECHS | op::SASL_AUTH | op::SASL_STEP => {
                let users = self.users.clone();
                self.sasl(&users, &mut reply)
            }
            op::GET | op::GETQ | op::GETK | op::GETKQ | op::GET_REPLICA => {
                return self.get(req, &mut reply)
            }
            op::SET | op::SETQ | op::ADD | op::ADDQ | op::REPLACE | op::REPLACEQ => {
                return self.store(req, framing, &mut reply)
            }
            op::DELETE | op::DELETEQ => return self.delete(req, durability, &mut reply),
            op::INCREMENT | op::INCREMENTQ | op::DECREMENT | op::DECREMENTQ => {
                return self.arithmetic(req, durability, &mut reply)
            }
            op::APPEND | op::APPENDQ | op::PREPEND | op::PREPENDQ => {
                return self.concat(req, durability, &mut reply)
            }
            op::TOUCH | op::GAT | op::GATQ => return self.touch(req, durability, &mut reply),
            op::FLUSH | op::FLUSHQ => return self.flush(req, &mut reply),
            op::GET_META | op::GETQ_META => return self.get_meta(req, &mut reply),
            op::GET_LOCKED => return self.get_locked(req, &mut reply),
            op::UNLOCK_KEY => return self.unlock(req, &mut reply),
            op::SUBDOC_GET..=op::SUBDOC_REPLACE_BODY_WITH_XATTR => {
                return self.subdoc(req, framing, &mut reply)
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
                    self.bucket = Arc::new(b);
                    self.refresh_map();
                    self.selected = true;
                    self.map_rev = 0;
                    reply.ok();
                }
                Err(e) => fail!(reply, xerror, e),
            },
            op::STAT => self.stat(&mut reply),
            dcp_op::OPEN | tap_op::CONNECT => return Flow::OpenStream,
            tap_op::MUTATION..=tap_op::CHECKPOINT_END => return self.tap_apply(frame, &mut reply),
            dcp_op::ADD_STREAM..=dcp_op::CACHE_TRANSFER_END => reply.error(
                status::EINVAL,
                "open a DCP connection first (DCP_OPEN)",
                xerror,
            ),
            op::GET_ERROR_MAP => match req.value {
                [a, b] => match errormap::json(u16::from_be_bytes([*a, *b])) {
                    Some(map) => reply.send(status::SUCCESS, 0, &[], &[], map.as_bytes(), 0),
                    None => einval!(reply, xerror, "error map version 0 does not exist"),
                },
                _ => einval!(
                    reply,
                    xerror,
                    "GET_ERROR_MAP takes a 2-byte version as value"
                ),
            },
            op::GET_CLUSTER_CONFIG => {
                if !req.key.is_empty() || !req.value.is_empty() {
                    einval!(
                        reply,
                        xerror,
                        "GET_CLUSTER_CONFIG takes no key and no value"
                    );
                }
                let map = &self.ctx.clustermap;
                let (rev, config) = if self.cluster_level() {
                    map.cluster_config(engine)
                } else {
                    map.bucket_config(engine, &self.bucket)
                };
                self.map_rev = self.map_rev.max(rev);
                let datatype = self.datatype(DATATYPE_JSON);
                reply.send(status::SUCCESS, 0, &[], &[], config.as_bytes(), datatype);
            }
            op::GET_COLLECTIONS_MANIFEST => {
                let datatype = self.datatype(DATATYPE_JSON);
                reply.send(status::SUCCESS, 0, &[], &[], MANIFEST.as_bytes(), datatype);
            }
            op::GET_COLLECTION_ID => {
                // The path is the key (Couchbase 7.0) or the value (later clients).
                let path = if req.key.is_empty() {
                    req.value
                } else {
                    req.key
                };
                match collection_id(path) {
                    Ok(id) => {
                        let mut extras = [0u8; 12];
                        extras[8..].copy_from_slice(&id.to_be_bytes());
                        reply.send(status::SUCCESS, 0, &extras, &[], &[], 0);
                    }
                    Err((st, why)) => {
                        let body = unknown_collection(&why);
                        reply.send(st, 0, &[], &[], body.as_bytes(), DATATYPE_JSON);
                    }
                }
            }
            op::RANGE_SCAN_CREATE => {
                range_scan::create(&self.ctx.range_scans, &self.bucket, req, &mut reply, xerror)
            }
            op::RANGE_SCAN_CONTINUE => {
                range_scan::resume(&self.ctx.range_scans, &self.bucket, req, &mut reply, xerror)
            }
            op::RANGE_SCAN_CANCEL => {
                range_scan::cancel(&self.ctx.range_scans, req, &mut reply, xerror)
            }
            op::GET_ALL_VB_SEQNOS => match all_vb_seqnos(engine, &self.bucket, req.extras) {
                Ok(value) => reply.send(status::SUCCESS, 0, &[], &[], &value, 0),
                Err(why) => einval!(reply, xerror, why),
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
                feature::CLUSTERMAP_CHANGE_NOTIFICATION => {
                    !std::mem::replace(&mut f.clustermap_notifications, true)
                }
                feature::COLLECTIONS => !std::mem::replace(&mut f.collections, true),
                feature::UNORDERED_EXECUTION => !std::mem::replace(&mut f.unordered, true),
                feature::PRESERVE_TTL => !std::mem::replace(&mut f.preserve_ttl, true),
                feature::XATTR => !std::mem::replace(&mut f.xattr, true),
                feature::VATTR => !std::mem::replace(&mut f.vattr, true),
                feature::SUBDOC_CREATE_AS_DELETED => {
                    !std::mem::replace(&mut f.create_as_deleted, true)
                }
                _ => false,
            };
            if known {
                enabled.extend_from_slice(&code.to_be_bytes());
            }
        }
        self.features = f;
        self.refresh_map();
        reply.send(status::SUCCESS, 0, &[], &[], &enabled, 0);
    }
}

/// What a request's frame infos ask beyond its body and extras.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Framing {
    /// None: the bucket's default level.
    pub durability: Option<Requirement>,
    /// PreserveTTL: an existing document keeps its expiry.
    pub preserve_ttl: bool,
}

/// The datatype bit of a JSON body.
const DATATYPE_JSON: u8 = 0x01;
/// The epoch of every map: sluice's revs rise with time alone (see `clustermap`).
const MAP_EPOCH: i64 = 1;
/// The one collection: `_default` in scope `_default`.
const DEFAULT_COLLECTION: u32 = 0;
/// The collections manifest: the default scope with the default collection, uid 0.
const MANIFEST: &str = "{\"uid\":\"0\",\"scopes\":[{\"name\":\"_default\",\"uid\":\"0\",                        \"collections\":[{\"name\":\"_default\",\"uid\":\"0\"}]}]}";

/// The collection id of a `scope.collection` path (an empty part is `_default`), or the status
/// and message of the error.
fn collection_id(path: &[u8]) -> Result<u32, (u16, String)> {
    let path = String::from_utf8_lossy(path);
    let Some((scope, collection)) = path.split_once('.') else {
        return Err((
            status::EINVAL,
            format!("collection path {path:?} is not scope.collection"),
        ));
    };
    let default = |s: &str| s.is_empty() || s == "_default";
    if !default(scope) {
        return Err((status::UNKNOWN_SCOPE, format!("unknown scope {scope:?}")));
    }
    if !default(collection) {
        return Err((
            status::UNKNOWN_COLLECTION,
            format!("unknown collection {collection:?} in scope _default"),
        ));
    }
    Ok(DEFAULT_COLLECTION)
}

/// The body of UNKNOWN_COLLECTION and UNKNOWN_SCOPE: an error context and, as Couchbase
/// gives, the manifest uid the server judged by.
fn unknown_collection(why: &str) -> String {
    format!(
        "{{\"manifest_uid\":\"0\",\"error\":{{\"context\":{}}}}}",
        reply::json_string(why)
    )
}

#[cfg(test)]
mod tests;
