//! One iproto connection: the greeting with a fresh salt, then packets read into a buffer,
//! checked whole (`frame::check`), decoded and answered, SYNC echoed and the schema version in
//! every reply. As Tarantool answers them: reads, pings and errors at once, the replies of
//! writes that succeeded once the WAL holds them (the driver's `Out::acked`), so a read is not
//! held up by the WAL write of a request before it on the same connection, and the writes'
//! replies keep their order among themselves. A write with a durability level waits for it
//! before its reply.

use std::net::SocketAddr;
use std::sync::Arc;

use sluice_core::vbucket::VbSet;
use sluice_proto::iproto::request::{Request, Scramble};
use sluice_proto::iproto::{codes, frame, greeting, request, response};
use tokio::sync::watch;

use super::failure::{Failure, Outcome};
use super::schema::Space;
use super::IprotoContext;
use crate::auth::GUEST;
use crate::driver::{Check, Conn, End, Fault, Flow, Frame, Out};

/// How long a connection that ends waits for the answers of requests it forwarded.
const FORWARDED_AT_END: std::time::Duration = std::time::Duration::from_secs(2);

/// A declared space behind a handle of the session's own: requests clone it, and cloning the
/// catalog's shared `Arc<Space>` from every connection on every core would bounce its
/// reference count between the cores (the memcached front's session does the same).
#[allow(clippy::redundant_allocation)]
pub(super) type SpaceHandle = Arc<Arc<Space>>;

/// One connection's state.
pub(super) struct Session {
    pub ctx: Arc<IprotoContext>,
    /// The catalog's spaces by id, as this session's handles.
    pub spaces: std::collections::BTreeMap<u32, SpaceHandle>,
    /// The users as of `users_generation`, refreshed when a reload moves the generation on,
    /// so that a request reads them without the table's lock.
    pub users: Arc<crate::auth::Users>,
    pub users_generation: u64,
    /// The user AUTH logged in as; None: guest.
    pub user: Option<String>,
    /// This connection's greeting salt (chap-sha1 scrambles against its first 20 bytes).
    pub salt: [u8; 32],
    pub peer: SocketAddr,
    /// The last WAL record a reply given so far acknowledges: sent once the WAL holds it.
    pub owed_lsn: u64,
    pub stop: watch::Receiver<bool>,
    /// Requests by type since the last batch was sent (`IprotoStats::add_requests`).
    pub requests: super::RequestCounts,
    /// The user's permission bits per declared space, as of `users_generation` and the
    /// current login (`refresh_permissions`), so a request looks up no user or bucket name.
    pub granted: std::collections::BTreeMap<u32, u8>,
    /// When the driver closes it if it has not logged in by then (None: never).
    pub login_deadline: Option<std::time::Instant>,
    /// Logins are refused on it (`require_tls`, plain text from beyond loopback).
    pub login_needs_tls: bool,
    /// The request being answered is another node's part of a read it fans out: the vbuckets
    /// it names are read, each active here (as that node's map says) or the read fails.
    pub part: Option<VbSet>,
    /// Requests sent on to the node their key is active on, their answers to come.
    pub forwarded: super::forwarded::Forwarded,
}

impl Session {
    pub fn user_name(&self) -> &str {
        self.user.as_deref().unwrap_or(GUEST)
    }

    /// The permission bits of this session's user on `bucket`: every one on a node with no
    /// users; guest's (`[users.guest]`, none if absent) before AUTH.
    pub fn permissions(&self, bucket: &str) -> u8 {
        let who = match &self.user {
            Some(name) => crate::request::Principal::User(name),
            None => crate::request::Principal::Guest,
        };
        crate::request::permissions(&self.users, who, bucket)
    }

    /// Recomputes `granted`: after a login, and when a reload replaced the users.
    pub fn refresh_permissions(&mut self) {
        let granted = self
            .spaces
            .iter()
            .map(|(&id, s)| (id, self.permissions(s.bucket.name())))
            .collect();
        self.granted = granted;
    }

    /// ER_ACCESS_DENIED unless this session may `need` (READ or WRITE) on the space's bucket.
    pub fn require(&self, space: &Space, need: u8) -> Outcome {
        let have = match self.granted.get(&space.id) {
            Some(&bits) => bits,
            None => self.permissions(space.bucket.name()),
        };
        if have & need == need {
            return Ok(());
        }
        let access = if need & crate::auth::WRITE != 0 {
            "Write"
        } else {
            "Read"
        };
        Err(Failure::access_denied(
            access,
            "space",
            &space.name,
            self.user_name(),
        ))
    }

    fn schema_version(&self) -> u32 {
        self.ctx.catalog.schema_version
    }

    /// Answers one whole packet: into `acks` when the answer acknowledges a write (it waits
    /// for the WAL), else into `out` (sent at once).
    async fn handle(
        &mut self,
        packet: &[u8],
        peer: crate::driver::PeerWatch<'_>,
        out: &mut Vec<u8>,
        acks: &mut Vec<u8>,
    ) {
        let generation = self.ctx.port.users.generation();
        if generation != self.users_generation {
            (self.users, self.users_generation) = self.ctx.port.users.current_with_generation();
            self.refresh_permissions();
        }
        let version = self.schema_version();
        let (header, req) = match request::decode(packet) {
            Ok(decoded) => decoded,
            Err(e) => {
                self.ctx.stats.error(e.code);
                self.ctx.port.io.protocol_error(
                    "iproto",
                    format_args!("iproto request from {}: {}", self.peer, e.message),
                );
                response::write_error(out, e.sync.unwrap_or(0), version, e.code, &e.message);
                return;
            }
        };
        self.requests[super::IprotoStats::request_slot(header.code)] += 1;
        let sync = header.sync;
        // Absent or 0: the client does not check (net.box never sends it). Tarantool words
        // the message with its arguments swapped; so do we, for connectors that parse it.
        if let Some(theirs) = header.schema_version.filter(|v| *v != 0) {
            if theirs != u64::from(version) {
                let f = Failure::new(
                    codes::ER_WRONG_SCHEMA_VERSION,
                    format!("Wrong schema version, current: {theirs}, in request: {version}"),
                );
                self.fail(out, sync, f);
                return;
            }
        }
        if self.route(packet, &header, &req, out).await {
            return;
        }
        // Another node's part of a read it fans out.
        self.part = match header.part(packet).map(VbSet::from_bytes) {
            None => None,
            Some(Some(set)) => Some(set),
            Some(None) => {
                let f = Failure::new(
                    codes::ER_INVALID_MSGPACK,
                    "Invalid MsgPack - packet header (a part of more vbuckets than any bucket has)",
                );
                self.fail(out, sync, f);
                return;
            }
        };
        // Another node's request, run as the user it names: only from the nodes' replication
        // login, and for this request only.
        let forwarded = header.forwarded_for(packet);
        let own_user = match forwarded {
            Some(name) => match self.run_as(name, &req) {
                Ok(own) => Some(own),
                Err(f) => {
                    self.part = None;
                    self.fail(out, sync, f);
                    return;
                }
            },
            None => None,
        };
        self.dispatch(req, sync, header.code, peer, out, acks).await;
        self.part = None;
        if let Some(own) = own_user {
            self.user = own;
            self.refresh_permissions();
        }
    }

    /// Runs the rest of this request as `name` (a forwarded request's user): allowed to a
    /// login with the `replication` permission on the request's space (on some space, for a
    /// request that names none, such as a count's CALL). Returns the session's own user, to
    /// restore.
    fn run_as(&mut self, name: &[u8], req: &Request<'_>) -> Result<Option<String>, Failure> {
        let bucket = match *req {
            Request::Select { space_id, .. }
            | Request::Insert { space_id, .. }
            | Request::Replace { space_id, .. }
            | Request::Update { space_id, .. }
            | Request::Upsert { space_id, .. }
            | Request::Delete { space_id, .. } => self
                .spaces
                .get(&space_id)
                .map(|s| s.bucket.name().to_string()),
            _ => None,
        };
        // Only the nodes' own login may name another user: the configured replication user,
        // with the permission on the space's bucket (a node with no users lets anyone, as
        // everything is allowed there anyway).
        let may = |b: &str| crate::auth::may_replicate(self.permissions(b));
        let nodes_login = !self.users.required()
            || (self.user.is_some() && self.user == self.ctx.clustermap.router.login_user());
        let allowed = nodes_login
            && match bucket {
                Some(b) => may(&b),
                None => self.spaces.values().any(|s| may(s.bucket.name())),
            };
        if !allowed {
            return Err(Failure::access_denied(
                "Forward",
                "space",
                "",
                self.user_name(),
            ));
        }
        let name = String::from_utf8_lossy(name).into_owned();
        let runs_as = (name != GUEST).then_some(name);
        let own = std::mem::replace(&mut self.user, runs_as);
        self.refresh_permissions();
        Ok(own)
    }

    async fn dispatch(
        &mut self,
        req: Request<'_>,
        sync: u64,
        code: u32,
        peer: crate::driver::PeerWatch<'_>,
        out: &mut Vec<u8>,
        acks: &mut Vec<u8>,
    ) {
        let version = self.schema_version();
        // A write's answer goes into `acks`, even one that changed nothing (DELETE of a
        // missing key): Tarantool answers it after the writes before it, as it commits like
        // any other. Failures are answered at once.
        let outcome = match req {
            Request::Ping | Request::Nop => {
                response::write_ok(out, sync, version);
                Ok(())
            }
            Request::Id { .. } => {
                // Protocol version 3 (Tarantool 2.10's); no optional feature (streams,
                // transactions, error extension, watchers) is served.
                response::write_id(out, sync, version, 3, &[]);
                Ok(())
            }
            Request::Auth {
                user,
                mechanism,
                scramble,
            } => {
                let user = user.to_vec();
                let mechanism = mechanism.map(<[u8]>::to_vec);
                let scramble = match scramble {
                    Scramble::Empty => Ok(None),
                    Scramble::Chap(s) => Ok(Some(*s)),
                    Scramble::Invalid(why) => Err(why),
                };
                self.auth(&user, mechanism.as_deref(), scramble, sync, peer, out)
                    .await
            }
            Request::Select {
                space_id,
                index_id,
                limit,
                offset,
                iterator,
                key,
            } => self.select(space_id, index_id, limit, offset, iterator, key, sync, out),
            Request::Insert { space_id, tuple } => {
                self.store(space_id, tuple, true, sync, acks).await
            }
            Request::Replace { space_id, tuple } => {
                self.store(space_id, tuple, false, sync, acks).await
            }
            Request::Update {
                space_id,
                index_id,
                key,
                ops,
                index_base,
            } => {
                self.update(space_id, index_id, key, ops, index_base, sync, acks)
                    .await
            }
            Request::Upsert {
                space_id,
                tuple,
                ops,
                index_base,
            } => {
                self.upsert(space_id, tuple, ops, index_base, sync, acks)
                    .await
            }
            Request::Delete {
                space_id,
                index_id,
                key,
            } => self.delete(space_id, index_id, key, sync, acks).await,
            Request::Call { name, args, .. } => self.call(name, args, sync, out),
            Request::Eval { expr, args } => self.eval(expr, args, sync, out),
            Request::Execute | Request::Prepare => Err(Failure::new(
                codes::ER_UNSUPPORTED,
                format!(
                    "sluice does not support SQL ({})",
                    if code == codes::EXECUTE {
                        "EXECUTE"
                    } else {
                        "PREPARE"
                    }
                ),
            )),
            Request::Unknown(t) => Err(Failure::new(
                codes::ER_UNKNOWN_REQUEST_TYPE,
                format!("Unknown request type {t}"),
            )),
        };
        if let Err(f) = outcome {
            self.fail(out, sync, f);
        }
    }

    /// Writes an error reply and counts it.
    pub fn fail(&self, out: &mut Vec<u8>, sync: u64, f: Failure) {
        self.ctx.stats.error(f.code);
        let version = self.schema_version();
        match f.access.as_deref() {
            Some([access_type, object_type, object_name, user]) => {
                let denied = response::AccessDenied {
                    access_type,
                    object_type,
                    object_name,
                };
                response::write_access_denied(out, sync, version, denied, user)
            }
            None => response::write_error(out, sync, version, f.code, &f.message),
        }
    }
}

impl crate::driver::Session for Session {
    fn check(&mut self, buf: &[u8], max_frame: usize) -> Check {
        match frame::check(buf, max_frame) {
            Ok(Some(n)) => Check::Frame(n),
            Ok(None) => Check::Need(0),
            Err(e) => Check::Bad(Fault::new(matches!(e, frame::FrameError::TooBig { .. }), e)),
        }
    }

    /// Reads, pings and errors go out at once; a write's answer once the WAL holds it.
    async fn handle(&mut self, frame: &mut Frame<'_>, out: &mut Out) -> Flow {
        let (now, acked) = (&mut out.now, &mut out.acked.buf);
        Session::handle(self, frame.bytes(), frame.peer(), now, acked).await;
        Flow::Continue
    }

    fn owed_lsn(&self) -> u64 {
        self.owed_lsn
    }

    /// After an AUTH, or at once where anonymous clients are served as guest.
    fn logged_in(&self) -> bool {
        self.user.is_some() || crate::request::guest_served(&self.users)
    }

    fn greet(&mut self, out: &mut Out) {
        let hello = greeting::encode(
            super::TARANTOOL_VERSION,
            &self.ctx.instance_uuid,
            &self.salt,
        );
        out.now.extend_from_slice(&hello);
    }

    /// A length prefix that is no unsigned integer, or too large: Tarantool answers and
    /// closes, as here.
    fn refuse(&mut self, _fault: &Fault, _buf: &[u8], out: &mut Out) {
        let f = Failure::new(codes::ER_INVALID_MSGPACK, "Invalid MsgPack - packet length");
        self.fail(&mut out.now, 0, f);
    }

    /// Moves the answers of forwarded requests that came into `out`; as the connection ends
    /// (the client half-closed, the server stops), waits a little for the others, so that a
    /// write another node applied is answered.
    async fn settle(&mut self, out: &mut Out, end: Option<End>) -> Flow {
        self.ctx.stats.add_requests(&mut self.requests);
        if end.is_some() && !self.forwarded.is_empty() {
            let _ = tokio::time::timeout(FORWARDED_AT_END, async {
                while !self.forwarded.is_empty() {
                    self.forwarded.wait().await;
                    self.answer_forwarded(&mut out.now, &mut out.acked.buf);
                }
            })
            .await;
        }
        if !self.forwarded.is_empty() {
            self.answer_forwarded(&mut out.now, &mut out.acked.buf);
        }
        Flow::Continue
    }

    /// Answers of forwarded requests are awaited.
    fn waiting(&self) -> bool {
        !self.forwarded.is_empty()
    }

    fn wakes(&self) -> bool {
        !self.forwarded.is_empty()
    }

    fn wake(&mut self) -> impl std::future::Future<Output = ()> + Send {
        self.forwarded.wait()
    }
}

/// Runs one connection until the client closes it, the server stops, a length prefix is
/// unusable, or it stays silent past the idle timeout.
pub(super) async fn run(mut conn: Conn, ctx: Arc<IprotoContext>) {
    let mut salt = [0u8; 32];
    if getrandom::fill(&mut salt).is_err() {
        log::error!(
            "closing iproto connection from {}: no randomness for its salt",
            conn.peer
        );
        return;
    }
    let (users, users_generation) = ctx.port.users.current_with_generation();
    let spaces = ctx
        .catalog
        .spaces()
        .map(|(id, s)| (id, Arc::new(s.clone())))
        .collect();
    let mut session = Session {
        ctx: ctx.clone(),
        spaces,
        users,
        users_generation,
        user: None,
        salt,
        peer: conn.peer,
        owed_lsn: 0,
        stop: conn.stop.clone(),
        requests: Default::default(),
        granted: Default::default(),
        login_deadline: conn.login_deadline(),
        login_needs_tls: conn.login_needs_tls(),
        part: None,
        forwarded: Default::default(),
    };
    session.refresh_permissions();
    crate::driver::run(&mut conn, &mut session).await;
}
