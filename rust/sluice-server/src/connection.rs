//! One client connection: a read buffer checked with `mcbp::frame_len` before anything is
//! parsed, every complete frame handled in order (pipelining: replies in request order, quiet
//! commands silent on success), and one write per round. The connection reads again only after
//! writing, so a peer that sends but never reads stalls itself, not the server's memory.
//!
//! No reply leaves before the WAL has written every change it acknowledges (one wait per round,
//! shared by every write in it: group commit). A durable write's reply is held until its level
//! is met, and the replies after it queue behind it, while the connection goes on reading and
//! applying the requests that follow.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use sluice_proto::dcp::opcode as dcp_op;
use sluice_proto::mcbp::{self, status, FrameError};
use tokio::sync::watch;

use crate::dcp::producer::DcpContext;
use crate::driver::{Check, Conn, End, Ended, Fault, Flow as DriverFlow, Frame, Out};
use crate::front::{Declaration, Front, Registration, Serving, Shared};
use crate::kv::{Flow, Handoff, HeldReply, KvContext, KvSession};
use crate::tap::TapContext;
use crate::throttle::LoginThrottle;

/// The memcached port (binary and text, plain and TLS), as a registered front: the KV front
/// every connection starts in, the change streams (DCP, TAP) a binary connection may be handed
/// to, and the bounds before login.
pub struct Memcached {
    pub kv: Arc<KvContext>,
    pub dcp: Arc<DcpContext>,
    pub tap: Arc<TapContext>,
    /// What the driver holds the memcached port's connections (plain and TLS) to.
    pub port: Arc<crate::driver::Port>,
    /// Failed SASL (and iproto AUTH) attempts, which slow the next ones down.
    pub throttle: Arc<LoginThrottle>,
}

/// The memcached port's registration (`server::FRONTS`).
pub static FRONT: Registration = Registration {
    declaration: Declaration {
        name: "memcached",
        title: "memcached",
        listen_key: "listen",
        default_listen: "127.0.0.1:11210",
        tls_listen_key: "tls_listen",
        default_tls_listen: "127.0.0.1:11207",
        doc: "Address of the memcached listener: the binary protocol (with Couchbase's \
              extensions, DCP and TAP) and the text protocol, told apart by the first byte.",
        login: true,
        kind: "KV",
        noun: "connection",
        kv_port: true,
    },
    max_frame: |max_body| max_body,
    build,
};

fn build(shared: &Shared<'_>, port: Arc<crate::driver::Port>) -> std::io::Result<Arc<dyn Front>> {
    let config = shared.config;
    let kv = Arc::new(KvContext {
        engine: shared.engine.clone(),
        users: shared.users.clone(),
        stats: shared.io.clone(),
        started: Instant::now(),
        tap_applied: Default::default(),
        clustermap: shared.clustermap.clone(),
        spaces: Arc::from(config.spaces.clone()),
        range_scans: Default::default(),
    });
    let dcp = Arc::new(DcpContext {
        engine: shared.engine.clone(),
        io: shared.io.clone(),
        names: Default::default(),
        stats: Default::default(),
        policies: shared.policies.clone(),
        max_body: config.max_body,
        clustermap: shared.clustermap.clone(),
    });
    let tap = Arc::new(TapContext {
        engine: shared.engine.clone(),
        io: shared.io.clone(),
        config: config.tap.clone(),
        sessions: Arc::new(crate::tap::session::Sessions::new(config.tap.max_sessions)),
        stats: Default::default(),
        policies: shared.policies.clone(),
        max_body: config.max_body,
    });
    Ok(Arc::new(Memcached {
        kv,
        dcp,
        tap,
        port,
        throttle: shared.throttle.clone(),
    }))
}

impl Front for Memcached {
    fn serve(self: Arc<Self>, conn: Conn) -> Serving {
        Box::pin(async move {
            let io = self.kv.stats.clone();
            crate::listener::counted(&io.curr_connections, run(conn, self)).await
        })
    }

    fn port(&self) -> Arc<crate::driver::Port> {
        self.port.clone()
    }

    fn accepted(&self) {
        self.kv.stats.connections_total.fetch_add(1, Relaxed);
    }

    fn metrics(&self, out: &mut String) {
        self.dcp.stats.metrics(out);
        self.tap.stats.metrics(
            out,
            self.tap.sessions.parked() as u64,
            self.kv.tap_applied.load(Relaxed),
        );
    }

    fn status(&self) -> serde_json::Value {
        serde_json::json!({"connections": self.kv.stats.curr_connections.load(Relaxed)})
    }

    fn stopped(&self) {
        crate::tap::session::close_parked(&self.tap);
    }
}

/// Held replies past which the connection stops reading until the oldest is sent: a client
/// pipelining durable writes cannot make the server hold more than this many.
const MAX_HELD: usize = 1024;

/// Bytes of replies queued behind held ones past which the connection stops reading too: the
/// GETs of large values pipelined behind a durable write wait in the client's socket, not in
/// the server's memory.
const MAX_HELD_BYTES: usize = 8 << 20;

/// The replies of one connection held behind durable writes, in request order: each held one
/// with the replies that came after it. Replies before the first held one go straight into the
/// driver's output. A client that negotiated UnorderedExecution has its held replies wait apart
/// instead, each sent when it is ready.
#[derive(Default)]
struct Replies {
    held: VecDeque<(HeldReply, Vec<u8>)>,
    unordered: tokio::task::JoinSet<Vec<u8>>,
    /// Replies released (with those behind them) and not yet in the output: they go before
    /// the next reply written.
    woken: Vec<u8>,
    /// The cluster map changed and the client asked to be told.
    push_map: bool,
    /// A reply held apart failed (its task panicked): the connection cannot answer that
    /// request and is closed.
    failed: bool,
}

impl Replies {
    /// Where the next reply goes: behind the last held one, if any, else into `ready` (after
    /// what was released).
    fn tail<'a>(&'a mut self, ready: &'a mut Vec<u8>) -> &'a mut Vec<u8> {
        if !self.woken.is_empty() {
            ready.append(&mut self.woken);
        }
        match self.held.back_mut() {
            Some((_, after)) => after,
            None => ready,
        }
    }

    /// The oldest held reply is ready: it and the replies behind it are released.
    fn release_head(&mut self, reply: Vec<u8>) {
        let (_, after) = self.held.pop_front().expect("a held reply");
        self.woken.extend_from_slice(&reply);
        self.woken.extend_from_slice(&after);
    }

    /// Replies held, in order or apart.
    fn held_count(&self) -> usize {
        self.held.len() + self.unordered.len()
    }

    /// Whether the connection must stop reading until a held reply is sent: too many held, or
    /// too many bytes of replies waiting behind them.
    fn full(&self) -> bool {
        self.held_count() >= MAX_HELD
            || (!self.held.is_empty()
                && self
                    .held
                    .iter()
                    .map(|(_, after)| after.len())
                    .sum::<usize>()
                    >= MAX_HELD_BYTES)
    }

    /// A reply the client let come out of order: it waits apart, the next ones do not.
    fn hold_apart(&mut self, held: HeldReply) {
        self.unordered.spawn(held);
    }

    /// A reply held apart is ready, or its task failed.
    fn done_apart(&mut self, done: Result<Vec<u8>, tokio::task::JoinError>) {
        match done {
            Ok(reply) => self.woken.extend_from_slice(&reply),
            Err(e) => {
                log::error!("closing a connection: a held reply failed: {e}");
                self.failed = true;
            }
        }
    }

    /// Releases every held reply that is ready now, without waiting, into `ready`: replies
    /// acknowledged together leave in one send, not one each. Err: a reply apart failed.
    async fn release_ready(&mut self, ready: &mut Vec<u8>) -> Result<(), ()> {
        std::future::poll_fn(|cx| {
            while let Some((head, _)) = self.held.front_mut() {
                match std::pin::Pin::new(head).poll(cx) {
                    std::task::Poll::Ready(reply) => self.release_head(reply),
                    std::task::Poll::Pending => break,
                }
            }
            while let std::task::Poll::Ready(Some(done)) = self.unordered.poll_join_next(cx) {
                self.done_apart(done);
            }
            std::task::Poll::Ready(())
        })
        .await;
        ready.append(&mut self.woken);
        if self.failed {
            Err(())
        } else {
            Ok(())
        }
    }

    /// Waits for every held reply, in order, and those held apart, into `ready`.
    async fn settle_all(&mut self, ready: &mut Vec<u8>) -> Result<(), ()> {
        while let Some((head, _)) = self.held.front_mut() {
            let reply = head.await;
            self.release_head(reply);
        }
        while let Some(done) = self.unordered.join_next().await {
            self.done_apart(done);
        }
        ready.append(&mut self.woken);
        if self.failed {
            Err(())
        } else {
            Ok(())
        }
    }
}

/// The stream a request opened, with what its front needs to start.
enum Stream {
    Dcp(crate::dcp::producer::OpenProducer),
    Tap(sluice_proto::tap::TapConnect, u32),
}

/// A memcached binary connection, as the driver runs it: the KV session, its replies held
/// behind durable writes, and the stream a request opened.
struct Binary {
    session: KvSession,
    replies: Replies,
    fronts: Arc<Memcached>,
    peer: SocketAddr,
    stop: watch::Receiver<bool>,
    /// The login deadline while the connection has not logged in (a SASL attempt's throttle
    /// wait ends there).
    login_deadline: Option<Instant>,
    /// Logins are refused on it (`require_tls`, plain text from beyond loopback).
    login_needs_tls: bool,
    /// Map changes, pushed to a client that asked for them (HELLO: Duplex and
    /// ClustermapChangeNotification) as Couchbase does.
    map_changes: watch::Receiver<i64>,
    /// Set by the request that opened a change stream: the connection is handed to it.
    stream: Option<Stream>,
    /// The frame limit the last check applied (E2BIG's reply names it).
    too_big: bool,
}

impl crate::driver::Session for Binary {
    #[inline]
    fn check(&mut self, buf: &[u8], max_frame: usize) -> Check {
        match mcbp::frame_len(buf, max_frame) {
            Ok(Some(n)) => Check::Frame(n),
            Ok(None) => Check::Need(0),
            Err(e) => {
                self.too_big = matches!(e, FrameError::TooBig { .. });
                Check::Bad(Fault::new(self.too_big, e))
            }
        }
    }

    async fn handle(&mut self, frame: &mut Frame<'_>, out: &mut Out) -> DriverFlow {
        let peer = frame.peer();
        let frame = frame.bytes();
        let replies = &mut self.replies;
        let tail = replies.tail(&mut out.acked.buf);
        let flow = if self.login_needs_tls && self.session.is_sasl_attempt(frame) {
            let why = crate::request::TLS_REQUIRED.as_bytes();
            crate::kv::reply_to_header(frame, status::AUTH_ERROR, why, tail);
            Flow::Continue
        } else if self.session.is_sasl_attempt(frame) {
            let f = crate::login::sasl_auth(
                &mut self.session,
                frame,
                self.peer.ip(),
                &self.fronts.port.prelogin,
                &self.fronts.throttle,
                self.login_deadline,
                &mut self.stop,
                peer,
                tail,
            );
            let flow = f.await;
            if self.session.authenticated() {
                self.login_deadline = None;
            }
            flow
        } else {
            self.session.handle(frame, tail)
        };
        match flow {
            Flow::Continue => {}
            // Nothing held in order before it: the client's negotiation applies.
            Flow::Hold(held) if self.session.unordered() && replies.held.is_empty() => {
                replies.hold_apart(held)
            }
            Flow::Hold(held) => replies.held.push_back((held, Vec::new())),
            Flow::Close => return DriverFlow::Close,
            Flow::OpenStream => {
                let req = mcbp::parse_request(frame).expect("the KV front parsed it");
                let tail = replies.tail(&mut out.acked.buf);
                self.stream = if req.opcode == dcp_op::OPEN {
                    crate::dcp::producer::open(&self.session, &req, tail).map(Stream::Dcp)
                } else {
                    crate::tap::producer::open(&self.session, &req, tail)
                        .map(|c| Stream::Tap(c, req.opaque))
                };
                if self.stream.is_some() {
                    return DriverFlow::Handoff;
                }
            }
        }
        DriverFlow::Continue
    }

    fn owed_lsn(&self) -> u64 {
        self.session.owed_lsn()
    }

    fn logged_in(&self) -> bool {
        self.session.authenticated()
    }

    fn refuse(&mut self, _fault: &Fault, buf: &[u8], out: &mut Out) {
        if self.too_big {
            self.session.refuse_too_big(buf, &mut out.acked.buf);
        }
    }

    fn reading(&self) -> bool {
        !self.replies.full()
    }

    /// Held replies: the connection goes on reading meanwhile, with no idle timeout.
    fn waiting(&self) -> bool {
        self.replies.held_count() > 0
    }

    fn wakes(&self) -> bool {
        self.replies.held_count() > 0 || self.session.wants_map_pushes()
    }

    async fn wake(&mut self) {
        let pushes = self.session.wants_map_pushes();
        let replies = &mut self.replies;
        let apart = !replies.unordered.is_empty();
        let head = async {
            match replies.held.front_mut() {
                Some((head, _)) => head.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            reply = head => replies.release_head(reply),
            Some(done) = replies.unordered.join_next(), if apart => replies.done_apart(done),
            Ok(()) = self.map_changes.changed(), if pushes => replies.push_map = true,
        }
    }

    async fn settle(&mut self, out: &mut Out, end: Option<End>) -> DriverFlow {
        let buf = &mut out.acked.buf;
        buf.append(&mut self.replies.woken);
        if std::mem::take(&mut self.replies.push_map) {
            self.session.push_map(buf);
        }
        if self.replies.failed {
            return DriverFlow::Close;
        }
        let settled = match end {
            // Shutting down, closing, handing over: every held reply is answered.
            Some(End::Stop | End::Eof | End::Close | End::Handoff) => {
                self.replies.settle_all(buf).await
            }
            None if self.replies.held_count() > 0 => self.replies.release_ready(buf).await,
            None => Ok(()),
        };
        match settled {
            Ok(()) => DriverFlow::Continue,
            Err(()) => DriverFlow::Close,
        }
    }
}

/// Runs one connection of the memcached port: the text protocol or the binary one, by its
/// first byte as memcached sniffs it; a binary connection may be handed to a change stream.
pub async fn run(mut conn: Conn, fronts: Arc<Memcached>) {
    if !conn.first_bytes().await {
        return;
    }
    // A binary request starts with a magic (0x80, or 0x08 with frame infos; the other high
    // bytes get the binary front's error), anything else is the text protocol.
    let first = conn.inbuf[0];
    if first < 0x80 && first != mcbp::magic::ALT_REQUEST {
        return crate::kv::text::run(conn, fronts.kv.clone()).await;
    }
    let session = KvSession::new(fronts.kv.clone());
    let mut b = Binary {
        map_changes: session.map_changes(),
        session,
        replies: Replies::default(),
        fronts: fronts.clone(),
        peer: conn.peer,
        stop: conn.stop.clone(),
        login_deadline: conn.login_deadline(),
        login_needs_tls: conn.login_needs_tls(),
        stream: None,
        too_big: false,
    };
    let Ended::Handoff(out) = crate::driver::run(&mut conn, &mut b).await else {
        return;
    };
    let Conn {
        socket,
        inbuf,
        peer,
        stop,
        ..
    } = conn;
    let handoff = Handoff {
        out,
        socket,
        inbuf,
        session: b.session,
        peer,
        stop,
    };
    match b.stream.expect("a handoff opened a stream") {
        Stream::Dcp(open) => {
            let dcp = fronts.dcp.clone();
            Box::pin(crate::dcp::producer::run(handoff, open, dcp)).await
        }
        Stream::Tap(connect, opaque) => {
            let tap = fronts.tap.clone();
            Box::pin(crate::tap::producer::run(handoff, connect, opaque, tap)).await
        }
    }
}
