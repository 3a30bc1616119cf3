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
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use sluice_proto::mcbp::{self, FrameError};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use crate::dcp::producer::DcpContext;
use crate::kv::{Flow, Handoff, HeldReply, KvContext, KvSession};
use crate::limits::{PreLogin, PRELOGIN_MAX_BODY};
use crate::login::LoginThrottle;
use crate::stats::ConnectionStats;
use crate::tap::TapContext;
use crate::tls::MaybeTls;
use sluice_proto::dcp::opcode as dcp_op;

/// What a client connection works with, built once by the server: the KV front every
/// connection starts in, the stream fronts it may be handed to, and the bounds before login.
pub struct Fronts {
    pub kv: Arc<KvContext>,
    pub dcp: Arc<DcpContext>,
    pub tap: Arc<TapContext>,
    pub prelogin: Arc<PreLogin>,
    /// Failed SASL (and iproto AUTH) attempts, which slow the next ones down.
    pub throttle: Arc<LoginThrottle>,
    /// The iproto front, when `iproto_listen` is set (its counters show in /metrics).
    pub iproto: Option<Arc<crate::iproto::IprotoContext>>,
    /// The TANK front, when `tank_listen` is set.
    pub tank: Option<Arc<crate::tank::TankContext>>,
    /// The Greenstack front, when `greenstack_listen` is set.
    pub greenstack: Option<Arc<crate::greenstack::GreenstackContext>>,
    /// Largest request body accepted; larger frames get E2BIG and the connection closes.
    pub max_body: usize,
    /// A connection silent for this long is closed; zero means never.
    pub idle_timeout: Duration,
}

/// Replies are written once this much is pending, even mid-batch.
const FLUSH_AT: usize = 1 << 20;

/// Held replies past which the connection stops reading until the oldest is sent: a client
/// pipelining durable writes cannot make the server hold more than this many.
const MAX_HELD: usize = 1024;

/// Bytes of replies queued behind held ones past which the connection stops reading too: the
/// GETs of large values pipelined behind a durable write wait in the client's socket, not in
/// the server's memory.
const MAX_HELD_BYTES: usize = 8 << 20;

/// The replies of one connection in request order: those ready to send, then held ones, each
/// with the ready replies that came after it. A client that negotiated UnorderedExecution has
/// its held replies wait apart instead, each sent when it is ready.
#[derive(Default)]
struct Replies {
    ready: Vec<u8>,
    held: VecDeque<(HeldReply, Vec<u8>)>,
    unordered: tokio::task::JoinSet<Vec<u8>>,
}

impl Replies {
    /// Where the next reply goes: behind the last held one, if any.
    fn tail(&mut self) -> &mut Vec<u8> {
        match self.held.back_mut() {
            Some((_, after)) => after,
            None => &mut self.ready,
        }
    }

    /// The oldest held reply is ready: it and the replies behind it join the ready ones.
    fn release_head(&mut self, reply: Vec<u8>) {
        let (_, after) = self.held.pop_front().expect("a held reply");
        self.ready.extend_from_slice(&reply);
        self.ready.extend_from_slice(&after);
    }

    /// Before a producer takes over the connection and its output: every held reply is ready
    /// and the WAL holds what the replies acknowledge. False if it never will (the WAL stopped).
    async fn hand_over(&mut self, session: &KvSession) -> bool {
        self.settle_all().await;
        match session.engine().wal().written(session.owed_lsn()).await {
            Ok(()) => true,
            Err(e) => {
                log::warn!("closing a connection with unsent replies: {e}");
                false
            }
        }
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

    /// A reply held apart is ready. Err when its task failed (it panicked): the connection
    /// cannot answer that request and is closed.
    fn release_apart(&mut self, done: Result<Vec<u8>, tokio::task::JoinError>) -> Result<(), ()> {
        match done {
            Ok(reply) => {
                self.ready.extend_from_slice(&reply);
                Ok(())
            }
            Err(e) => {
                log::error!("closing a connection: a held reply failed: {e}");
                Err(())
            }
        }
    }

    /// Releases every held reply that is ready now, without waiting: replies acknowledged
    /// together leave in one send, not one each. Err as `release_apart`.
    async fn release_ready(&mut self) -> Result<(), ()> {
        std::future::poll_fn(|cx| {
            while let Some((head, _)) = self.held.front_mut() {
                match std::pin::Pin::new(head).poll(cx) {
                    std::task::Poll::Ready(reply) => self.release_head(reply),
                    std::task::Poll::Pending => break,
                }
            }
            while let std::task::Poll::Ready(Some(done)) = self.unordered.poll_join_next(cx) {
                if self.release_apart(done).is_err() {
                    return std::task::Poll::Ready(Err(()));
                }
            }
            std::task::Poll::Ready(Ok(()))
        })
        .await
    }

    /// Waits for every held reply, in order, and those held apart.
    async fn settle_all(&mut self) {
        while let Some((head, _)) = self.held.front_mut() {
            let reply = head.await;
            self.release_head(reply);
        }
        while let Some(done) = self.unordered.join_next().await {
            if self.release_apart(done).is_err() {
                break;
            }
        }
    }
}

/// The stream a request opened, with what its front needs to start.
enum Stream {
    Dcp(crate::dcp::producer::OpenProducer),
    Tap(sluice_proto::tap::TapConnect, u32),
}

pub async fn run(
    mut socket: MaybeTls,
    peer: SocketAddr,
    fronts: Arc<Fronts>,
    mut stop: watch::Receiver<bool>,
) {
    // Until it logs in (when users are configured), a connection holds a pre-login slot and
    // gets the small frame limit and the login deadline (see `limits`).
    let mut prelogin = match crate::limits::admit(&fronts.prelogin, &fronts.kv.users, peer) {
        Ok(slot) => slot,
        Err(_) => return,
    };
    let login_deadline = Instant::now() + fronts.prelogin.limits.login_timeout;
    // Before login, sending is bounded by the deadline too: a client that never reads its
    // replies must not keep its pre-login slot.
    let login = |slot: &Option<_>| {
        slot.as_ref()
            .map(|_| (login_deadline, &*fronts.prelogin, peer))
    };
    let mut session = KvSession::new(fronts.kv.clone());
    let mut inbuf = BytesMut::with_capacity(16 << 10);
    let mut replies = Replies::default();
    // The ready replies, sent (`send`); and the last ones before the connection closes, held
    // ones settled first.
    macro_rules! send_ready {
        () => {
            send(
                &mut socket,
                &mut replies.ready,
                &session,
                &fronts.kv.stats,
                login(&prelogin),
            )
        };
    }
    macro_rules! send_last {
        () => {{
            replies.settle_all().await;
            let _ = send_ready!().await;
        }};
    }
    let idle = fronts.idle_timeout;
    let mut sniffed = false;
    // Map changes, pushed to a client that asked for them (HELLO: Duplex and
    // ClustermapChangeNotification) as Couchbase does.
    let mut map_changes = session.map_changes();
    let mut stop_changes = crate::armed::watch_changes(stop.clone());
    loop {
        if !sniffed && !inbuf.is_empty() {
            // memcached's sniff: a binary request starts with a magic (0x80, or 0x08 with
            // frame infos; the other high bytes get the binary front's error), anything else
            // is the text protocol.
            sniffed = true;
            if inbuf[0] < 0x80 && inbuf[0] != mcbp::magic::ALT_REQUEST {
                let kv = fronts.kv.clone();
                let (max_body, idle) = (fronts.max_body, fronts.idle_timeout);
                drop(prelogin);
                return crate::text::run(socket, peer, kv, inbuf, max_body, idle, stop).await;
            }
        }
        while !replies.full() {
            let max_body = match prelogin {
                Some(_) => fronts.max_body.min(PRELOGIN_MAX_BODY),
                None => fronts.max_body,
            };
            match mcbp::frame_len(&inbuf, max_body) {
                Ok(Some(n)) => {
                    let frame = inbuf.split_to(n);
                    let flow = if session.is_sasl_attempt(&frame) {
                        let deadline = prelogin.as_ref().map(|_| login_deadline);
                        let out = replies.tail();
                        let ip = peer.ip();
                        let f = crate::login::sasl_auth(
                            &mut session,
                            &frame,
                            ip,
                            &fronts.prelogin,
                            &fronts.throttle,
                            deadline,
                            &mut stop,
                            out,
                        );
                        let flow = f.await;
                        if session.authenticated() {
                            prelogin = None;
                        }
                        flow
                    } else {
                        session.handle(&frame, replies.tail())
                    };
                    match flow {
                        Flow::Continue => {}
                        // Nothing held in order before it: the client's negotiation applies.
                        Flow::Hold(held) if session.unordered() && replies.held.is_empty() => {
                            replies.hold_apart(held)
                        }
                        Flow::Hold(held) => replies.held.push_back((held, Vec::new())),
                        Flow::Close => {
                            send_last!();
                            return;
                        }
                        Flow::OpenStream => {
                            let req = mcbp::parse_request(&frame).expect("the KV front parsed it");
                            let out = replies.tail();
                            let stream = if req.opcode == dcp_op::OPEN {
                                crate::dcp::producer::open(&session, &req, out).map(Stream::Dcp)
                            } else {
                                crate::tap::producer::open(&session, &req, out)
                                    .map(|c| Stream::Tap(c, req.opaque))
                            };
                            if let Some(stream) = stream {
                                if !replies.hand_over(&session).await {
                                    return;
                                }
                                let conn = Handoff {
                                    out: std::mem::take(&mut replies.ready),
                                    socket,
                                    inbuf,
                                    session,
                                    peer,
                                    stop,
                                };
                                return match stream {
                                    Stream::Dcp(open) => {
                                        let dcp = fronts.dcp.clone();
                                        Box::pin(crate::dcp::producer::run(conn, open, dcp)).await
                                    }
                                    Stream::Tap(connect, opaque) => {
                                        let tap = fronts.tap.clone();
                                        let p =
                                            crate::tap::producer::run(conn, connect, opaque, tap);
                                        Box::pin(p).await
                                    }
                                };
                            }
                        }
                    }
                    if replies.ready.len() >= FLUSH_AT && send_ready!().await.is_err() {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    if prelogin.is_some() {
                        fronts
                            .kv
                            .stats
                            .protocol_errors
                            .fetch_add(1, Ordering::Relaxed);
                        crate::limits::closing_before_login(&fronts.prelogin, peer, &e);
                    } else {
                        fronts.kv.stats.protocol_error(
                            "KV",
                            format_args!("closing connection from {peer}: {e}"),
                        );
                    }
                    replies.settle_all().await;
                    if let FrameError::TooBig { .. } = e {
                        session.refuse_too_big(&inbuf, &mut replies.ready);
                    }
                    let _ = send_ready!().await;
                    return;
                }
            }
        }
        if replies.held_count() > 0 && replies.release_ready().await.is_err() {
            return;
        }
        if send_ready!().await.is_err() {
            return;
        }
        if *stop.borrow() {
            // Shutting down: requests already read are answered, held ones too.
            send_last!();
            return;
        }
        let reading = !replies.full();
        let waiting = replies.held_count() > 0;
        let deadline = prelogin.as_ref().map(|_| login_deadline);
        let read = async {
            if !reading {
                std::future::pending().await
            } else if let Some(deadline) = deadline {
                // From accept, so that a trickle of bytes does not move it.
                tokio::time::timeout_at(deadline.into(), socket.read_buf(&mut inbuf)).await
            } else if idle.is_zero() || waiting {
                Ok(socket.read_buf(&mut inbuf).await)
            } else {
                tokio::time::timeout(idle, socket.read_buf(&mut inbuf)).await
            }
        };
        let head = async {
            match replies.held.front_mut() {
                Some((head, _)) => head.await,
                None => std::future::pending().await,
            }
        };
        let pushes = session.wants_map_pushes();
        let apart = !replies.unordered.is_empty();
        tokio::select! {
            reply = head => replies.release_head(reply),
            Some(done) = replies.unordered.join_next(), if apart => {
                if replies.release_apart(done).is_err() {
                    return;
                }
            }
            Ok(()) = map_changes.changed(), if pushes => session.push_map(&mut replies.ready),
            r = read => match r {
                Ok(Ok(0)) => {
                    // The client closed its side: what it sent is still answered.
                    send_last!();
                    return;
                }
                Ok(Ok(n)) => { fronts.kv.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed); }
                Ok(Err(e)) => {
                    log::debug!("connection from {peer}: {e}");
                    return;
                }
                Err(_) if deadline.is_some() => {
                    crate::limits::login_timed_out(&fronts.prelogin, peer);
                    return;
                }
                Err(_) => {
                    log::info!("closing connection from {peer}: idle for {:?}", idle);
                    return;
                }
            },
            _ = stop_changes.next() => {
                send_last!();
                return;
            }
        }
    }
}

/// Sends the ready replies once the WAL holds every change they acknowledge; before login
/// (`login`: the deadline), only until the login deadline.
async fn send(
    socket: &mut MaybeTls,
    out: &mut Vec<u8>,
    session: &KvSession,
    stats: &ConnectionStats,
    login: Option<(Instant, &PreLogin, SocketAddr)>,
) -> std::io::Result<()> {
    let (engine, lsn) = (session.engine(), session.owed_lsn());
    let sending = crate::kv::send_acknowledged(socket, out, engine, lsn, stats, FLUSH_AT);
    crate::limits::by_login_deadline(login, sending).await
}
