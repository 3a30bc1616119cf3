//! One iproto connection: the greeting with a fresh salt, then packets read into a buffer,
//! checked whole (`frame::check`), decoded and answered, SYNC echoed and the schema version in
//! every reply. As Tarantool answers them: reads, pings and errors at once, the replies of
//! writes that succeeded once the WAL holds them (`kv::send_acknowledged`), so a read is not
//! held up by the WAL write of a request before it on the same connection, and the writes'
//! replies keep their order among themselves. A write with a durability level waits for it
//! before its reply.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::{Buf, BytesMut};
use sluice_proto::iproto::request::{Request, Scramble};
use sluice_proto::iproto::{codes, frame, greeting, request, response};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use super::schema::Space;
use super::IprotoContext;
use crate::auth::GUEST;
use crate::tls::MaybeTls;

/// Replies are written once this much is pending, even mid-batch.
const FLUSH_AT: usize = 1 << 20;

/// An error reply: Tarantool's code and message, or ER_ACCESS_DENIED with the FIELDS
/// (access type, object type, object name) connectors show and the user denied.
#[derive(Debug)]
pub(super) struct Failure {
    pub code: u32,
    pub message: String,
    /// Boxed: every handler returns a `Result<_, Failure>`, and the common error is small.
    pub access: Option<Box<[String; 4]>>,
}

impl Failure {
    pub fn new(code: u32, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
            access: None,
        }
    }

    /// `Read access to space 'users' is denied for user 'guest'`, as Tarantool words it.
    pub fn access_denied(
        access: &str,
        object_type: &str,
        object_name: &str,
        user: &str,
    ) -> Failure {
        Failure {
            code: codes::ER_ACCESS_DENIED,
            message: String::new(),
            access: Some(Box::new([
                access.to_string(),
                object_type.to_string(),
                object_name.to_string(),
                user.to_string(),
            ])),
        }
    }
}

impl From<sluice_proto::iproto::tuple::TupleError> for Failure {
    fn from(e: sluice_proto::iproto::tuple::TupleError) -> Failure {
        Failure::new(e.code, e.message)
    }
}

pub(super) type Outcome = Result<(), Failure>;

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
}

impl Session {
    pub fn user_name(&self) -> &str {
        self.user.as_deref().unwrap_or(GUEST)
    }

    /// The permission bits of this session's user on `bucket`: every one on a node with no
    /// users; guest's (`[users.guest]`, none if absent) before AUTH.
    pub fn permissions(&self, bucket: &str) -> u8 {
        let users = &self.users;
        if !users.required() {
            return u8::MAX;
        }
        let user = match &self.user {
            Some(name) => users.get(name),
            None => users.guest(),
        };
        user.map_or(0, |u| u.permissions(bucket))
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
    async fn handle(&mut self, packet: &[u8], out: &mut Vec<u8>, acks: &mut Vec<u8>) {
        let generation = self.ctx.users.generation();
        if generation != self.users_generation {
            (self.users, self.users_generation) = self.ctx.users.current_with_generation();
            self.refresh_permissions();
        }
        let version = self.schema_version();
        let (header, req) = match request::decode(packet) {
            Ok(decoded) => decoded,
            Err(e) => {
                self.ctx.stats.error(e.code);
                self.ctx.io.protocol_error(
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
                self.auth(&user, mechanism.as_deref(), scramble, sync, out)
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
                    if header.code == codes::EXECUTE {
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

/// Runs one connection until the client closes it, the server stops, a length prefix is
/// unusable, or it stays silent past the idle timeout.
pub(super) async fn run(
    mut socket: MaybeTls,
    peer: SocketAddr,
    ctx: Arc<IprotoContext>,
    stop: watch::Receiver<bool>,
) {
    let mut salt = [0u8; 32];
    if getrandom::fill(&mut salt).is_err() {
        log::error!("closing iproto connection from {peer}: no randomness for its salt");
        return;
    }
    let hello = greeting::encode(super::TARANTOOL_VERSION, &ctx.instance_uuid, &salt);
    if crate::tls::send_all(&mut socket, &hello).await.is_err() {
        return;
    }
    ctx.io.bytes_out.fetch_add(hello.len() as u64, Relaxed);
    let idle = ctx.idle_timeout;
    let (users, users_generation) = ctx.users.current_with_generation();
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
        peer,
        owed_lsn: 0,
        stop: stop.clone(),
        requests: Default::default(),
        granted: Default::default(),
    };
    session.refresh_permissions();
    let mut stop_changes = crate::armed::watch_changes(stop.clone());
    let mut inbuf = BytesMut::with_capacity(16 << 10);
    // Replies sent at once, and those that acknowledge writes.
    let mut out = Vec::new();
    let mut acks = Vec::new();
    loop {
        loop {
            match frame::check(&inbuf, ctx.max_packet) {
                Ok(Some(n)) => {
                    // Read in place and stepped over: splitting it off would share the buffer
                    // (a reference count per packet) for nothing kept past the call.
                    session.handle(&inbuf[..n], &mut out, &mut acks).await;
                    inbuf.advance(n);
                    if out.len() + acks.len() >= FLUSH_AT
                        && send(&mut socket, &mut out, &mut acks, &mut session)
                            .await
                            .is_err()
                    {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    // A length prefix that is no unsigned integer, or too large: Tarantool
                    // answers and closes, as here.
                    ctx.io.protocol_error(
                        "iproto",
                        format_args!("closing iproto connection from {peer}: {e}"),
                    );
                    let f =
                        Failure::new(codes::ER_INVALID_MSGPACK, "Invalid MsgPack - packet length");
                    session.fail(&mut out, 0, f);
                    let _ = send(&mut socket, &mut out, &mut acks, &mut session).await;
                    return;
                }
            }
        }
        if send(&mut socket, &mut out, &mut acks, &mut session)
            .await
            .is_err()
        {
            return;
        }
        if *stop.borrow() {
            return;
        }
        let read = async {
            if idle.is_zero() {
                Ok(socket.read_buf(&mut inbuf).await)
            } else {
                tokio::time::timeout(idle, socket.read_buf(&mut inbuf)).await
            }
        };
        tokio::select! {
            r = read => match r {
                Ok(Ok(0)) => return,
                Ok(Ok(n)) => { ctx.io.bytes_in.fetch_add(n as u64, Relaxed); }
                Ok(Err(e)) => {
                    log::debug!("iproto connection from {peer}: {e}");
                    return;
                }
                Err(_) => {
                    log::info!("closing iproto connection from {peer}: idle for {idle:?}");
                    return;
                }
            },
            _ = stop_changes.next() => return,
        }
    }
}

/// Sends the replies that wait for nothing, then those of writes once the WAL holds every
/// change they acknowledge.
async fn send(
    socket: &mut MaybeTls,
    out: &mut Vec<u8>,
    acks: &mut Vec<u8>,
    session: &mut Session,
) -> std::io::Result<()> {
    let ctx = &session.ctx;
    ctx.stats.add_requests(&mut session.requests);
    crate::tls::write_out(socket, out, &ctx.io.bytes_out, FLUSH_AT).await?;
    crate::kv::send_acknowledged(
        socket,
        acks,
        &ctx.engine,
        session.owed_lsn,
        &ctx.io,
        FLUSH_AT,
    )
    .await
}
