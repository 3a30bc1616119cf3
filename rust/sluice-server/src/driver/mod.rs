//! The connection driver: one loop for the connections of every front. It owns what every port
//! must do alike, so that each holds on every port by construction:
//!
//! - reading into the connection's buffer, and the front's cheap `check` of the buffer's head
//!   before anything is parsed (a length over the frame limit closes the connection);
//! - the bounds before login (`limits`): a pre-login slot taken at accept, the small frame
//!   limit and the login deadline (on reads and sends alike) until the session logs in;
//! - the idle timeout, the server's stop (requests already read are answered), backpressure
//!   (no read while the session holds too much);
//! - the rule that a reply acknowledging a write leaves only once the WAL holds it: a front
//!   writes replies into `Out`, and the driver sends `Out::acked` only after the WAL has written
//!   up to the LSN the session says it owes (`Session::owed_lsn`).
//!
//! A front implements `Session`: check a frame, handle it, say what it owes; optionally what
//! else wakes it (held replies, long-polls, notices) and what it settles before a send.

pub mod outbox;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use sluice_core::Engine;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use crate::auth::UserTable;
use crate::limits::{PreLogin, PreLoginSlot, PRELOGIN_MAX_BODY};
use crate::stats::ConnectionStats;
use crate::tls::MaybeTls;
pub use outbox::Outbox;

/// Replies are written once this much is pending, even mid-batch.
pub const FLUSH_AT: usize = 1 << 20;

/// What the driver holds every connection of one port to: built once per listener from the
/// front's declaration and the `[server]` settings.
pub struct Port {
    /// The front's name where its protocol errors are counted and rate-limited ("KV",
    /// "iproto", "tank", "greenstack").
    pub kind: &'static str,
    /// What log lines call one of its connections ("connection", "iproto connection", ...).
    pub noun: &'static str,
    pub engine: Arc<Engine>,
    /// The users; with any configured, a connection holds a pre-login slot until it logs in.
    pub users: Arc<UserTable>,
    pub prelogin: Arc<PreLogin>,
    /// The counters every port counts into (bytes, protocol errors).
    pub io: Arc<ConnectionStats>,
    /// The largest frame taken once logged in.
    pub max_frame: usize,
    /// A connection silent this long is closed; zero: never.
    pub idle_timeout: Duration,
    /// Refuse logins on plain-text connections from beyond loopback (`require_tls`).
    pub require_tls: bool,
    /// Its connections open now and the requests they sent (`/status`, the web console).
    pub counters: PortCounters,
}

/// A front's own traffic, counted by the driver for every front alike.
#[derive(Default)]
pub struct PortCounters {
    /// Connections its sessions run on now.
    pub connections: AtomicU64,
    /// Frames its sessions handled, counted once per batch read.
    pub requests: AtomicU64,
}

/// Counts a connection open while the driver runs its session.
struct Open(Arc<Port>);

impl Open {
    fn new(port: &Arc<Port>) -> Open {
        port.counters.connections.fetch_add(1, Relaxed);
        Open(port.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.counters.connections.fetch_sub(1, Relaxed);
    }
}

impl Port {
    /// A port over `engine` with the default pre-login limits, frames up to 1 MiB and no idle
    /// timeout: for driving a front's sessions in-process (its tests, the fuzz targets).
    pub fn scratch(
        kind: &'static str,
        noun: &'static str,
        engine: Arc<Engine>,
        users: Arc<UserTable>,
    ) -> Arc<Port> {
        Arc::new(Port {
            kind,
            noun,
            engine,
            users,
            prelogin: Arc::new(PreLogin::new(Default::default())),
            io: Default::default(),
            max_frame: 1 << 20,
            idle_timeout: Duration::ZERO,
            require_tls: false,
            counters: Default::default(),
        })
    }
}

/// What `Session::check` found at the head of the buffer.
pub enum Check {
    /// A whole frame of this many bytes.
    Frame(usize),
    /// Not yet: the buffer needs this many bytes in all (room is reserved for them).
    Need(usize),
    /// Bad framing: the connection closes after `Session::refuse`.
    Bad(Fault),
}

/// Why a frame was refused by its check.
#[derive(Debug)]
pub struct Fault {
    /// Over the frame limit (counted apart before login).
    pub too_big: bool,
    pub why: String,
}

impl Fault {
    pub fn new(too_big: bool, why: impl std::fmt::Display) -> Fault {
        Fault {
            too_big,
            why: why.to_string(),
        }
    }
}

/// What the connection does after a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Answer what is answered and close.
    Close,
    /// The session hands the connection to something else (a change stream): the driver
    /// settles and sends nothing more, and `run` returns `Ended::Handoff`.
    Handoff,
}

/// Why a session is asked to settle everything it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The server stops: requests already read are answered.
    Stop,
    /// The client closed its side: what it sent is still answered where the protocol does.
    Eof,
    /// The session closes the connection itself (a bad frame, `Flow::Close`).
    Close,
    /// The connection is handed over.
    Handoff,
}

/// One whole frame, in place in the connection's buffer: read as a slice, or taken as shared
/// bytes (a produced bundle goes to the WAL as a slice of the buffer, not a copy). The frames
/// of one read are stepped over together, once the batch is handled (`start` is where this one
/// begins), rather than the buffer being advanced per frame.
pub struct Frame<'a> {
    buf: &'a mut BytesMut,
    start: usize,
    len: usize,
    taken: Option<Bytes>,
    socket: &'a MaybeTls,
}

/// Tells a request that waits long (a login's turn in the throttle) that its client went
/// away, so that the wait ends with it rather than holding others back.
#[derive(Clone, Copy)]
pub struct PeerWatch<'a> {
    socket: &'a MaybeTls,
}

impl PeerWatch<'_> {
    /// Returns once the peer has closed its side of the connection (or it failed). While bytes
    /// it sent wait unread, whether it is still there cannot be told: then it never returns.
    pub async fn gone(&self) {
        let mut probe = [0u8; 1];
        match self.socket.tcp().peek(&mut probe).await {
            Ok(0) | Err(_) => {}
            Ok(_) => std::future::pending().await,
        }
    }
}

impl<'a> Frame<'a> {
    fn new(buf: &'a mut BytesMut, start: usize, len: usize, socket: &'a MaybeTls) -> Frame<'a> {
        Frame {
            buf,
            start,
            len,
            taken: None,
            socket,
        }
    }

    /// What tells a long wait that the client went away.
    pub fn peer(&self) -> PeerWatch<'a> {
        PeerWatch {
            socket: self.socket,
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.taken {
            Some(b) => b,
            None => &self.buf[self.start..self.start + self.len],
        }
    }

    /// The frame as shared bytes, split off the buffer (not copied).
    pub fn take(&mut self) -> Bytes {
        if let Some(b) = &self.taken {
            return b.clone();
        }
        self.buf.advance(self.start);
        let b = self.buf.split_to(self.len).freeze();
        self.taken = Some(b.clone());
        b
    }

    /// A stream-parsed protocol (memcached's text) took only this much of what its check
    /// offered; zero means it needs more input before it can go on.
    pub fn consumed(&mut self, n: usize) {
        debug_assert!(self.taken.is_none() && n <= self.len);
        self.len = n.min(self.len);
    }

    /// Where the next frame starts in the buffer, and how many bytes this one took.
    fn done(self) -> (usize, usize) {
        match self.taken {
            // Split off with everything before it.
            Some(_) => (0, self.len),
            None => (self.start + self.len, self.len),
        }
    }
}

/// What a connection has to send.
#[derive(Default)]
pub struct Out {
    /// Replies that acknowledge no write (reads, errors, pings): they may leave before the WAL
    /// holds what earlier requests changed, as Tarantool answers a read.
    pub now: Vec<u8>,
    /// Replies in request order, sent once the WAL holds every change up to the session's
    /// owed LSN.
    pub acked: Outbox,
}

impl Out {
    /// The buffer of ordered replies (most fronts write only into it).
    pub fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.acked.buf
    }

    pub fn len(&self) -> usize {
        self.now.len() + self.acked.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One front's side of a connection. Every method but `handle` and `settle` is cheap and
/// synchronous; `wake` must be cancel-safe (it races the socket).
pub trait Session: Send {
    /// Replies are written once this much is pending, even mid-batch.
    const FLUSH_AT: usize = FLUSH_AT;

    /// The cheap look at the buffer's head: how long its first frame is, within `max_frame`.
    fn check(&mut self, buf: &[u8], max_frame: usize) -> Check;

    /// Handles one whole frame, writing replies into `out`.
    fn handle(&mut self, frame: &mut Frame<'_>, out: &mut Out)
        -> impl Future<Output = Flow> + Send;

    /// The last WAL record the replies in `out.acked` acknowledge.
    fn owed_lsn(&self) -> u64;

    /// Whether the connection is past its login (the pre-login bounds end then). A protocol
    /// with no login says so at once unless anonymous clients are refused everything.
    fn logged_in(&self) -> bool;

    /// Bytes sent before the first request (a greeting).
    fn greet(&mut self, _out: &mut Out) {}

    /// The protocol's answer to a frame `check` refused, written before the connection closes.
    fn refuse(&mut self, _fault: &Fault, _buf: &[u8], _out: &mut Out) {}

    /// Whether to take more requests now: false while the session holds as much as it may.
    fn reading(&self) -> bool {
        true
    }

    /// Whether the peer may be silent on purpose now (a long-poll, a held reply, a stream):
    /// no idle timeout then.
    fn waiting(&self) -> bool {
        false
    }

    /// Whether anything besides requests may make output now (`wake` is waited on only then:
    /// a connection with nothing held is woken by its socket alone).
    fn wakes(&self) -> bool {
        false
    }

    /// Resolves when something besides a request makes output (a held reply settled, a
    /// long-poll's data, a notice); `settle` then moves it into `Out`. Cancel-safe.
    fn wake(&mut self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }

    /// Before each send: moves what became ready into `out`; with `end`, everything that can
    /// still be answered. `Flow::Close` closes the connection after the send.
    fn settle(&mut self, _out: &mut Out, _end: Option<End>) -> impl Future<Output = Flow> + Send {
        std::future::ready(Flow::Continue)
    }

    /// Reads taken without waiting after a batch, so that requests already in the socket share
    /// one WAL wait with it (a pipelining producer answered per WAL write, not per read).
    fn coalesced_reads(&self) -> usize {
        0
    }
}

/// How `run` ended.
pub enum Ended {
    Closed,
    /// The session asked to hand the connection over: what is left to send (the WAL holds
    /// what it acknowledges), the connection's buffer and socket stay in the `Conn`.
    Handoff(Vec<u8>),
}

/// One accepted connection, as the driver holds it: its socket and buffer, and its bounds.
pub struct Conn {
    pub socket: MaybeTls,
    pub inbuf: BytesMut,
    pub peer: SocketAddr,
    pub stop: watch::Receiver<bool>,
    pub port: Arc<Port>,
    /// Held until the session logs in (None when no user is configured).
    slot: Option<PreLoginSlot>,
    login_deadline: Instant,
}

/// What a read came to.
enum Read {
    Data,
    /// The client closed its side.
    Eof,
    /// An error, the idle timeout or the login deadline: logged and counted here.
    Gone,
}

impl Conn {
    /// A new connection under `port`'s bounds; None when a pre-login cap is full (counted and
    /// logged by `limits`: the caller drops the socket).
    pub fn admit(
        socket: MaybeTls,
        peer: SocketAddr,
        stop: watch::Receiver<bool>,
        port: Arc<Port>,
    ) -> Option<Conn> {
        let slot = crate::limits::admit(&port.prelogin, &port.users, peer).ok()?;
        let login_deadline = Instant::now() + port.prelogin.limits.login_timeout;
        Some(Conn {
            socket,
            inbuf: BytesMut::with_capacity(16 << 10),
            peer,
            stop,
            port,
            slot,
            login_deadline,
        })
    }

    /// Whether the connection still holds its pre-login bounds.
    pub fn before_login(&self) -> bool {
        self.slot.is_some()
    }

    /// Whether a login on it is refused: `require_tls` is set, and it is a plain-text
    /// connection from beyond loopback (a password or its proof would cross the network in
    /// clear).
    pub fn login_needs_tls(&self) -> bool {
        let loopback = match self.peer.ip() {
            std::net::IpAddr::V4(a) => a.is_loopback(),
            std::net::IpAddr::V6(a) => {
                a.is_loopback() || a.to_ipv4_mapped().is_some_and(|a| a.is_loopback())
            }
        };
        self.port.require_tls && matches!(self.socket, MaybeTls::Plain(_)) && !loopback
    }

    /// The login deadline, while the connection has not logged in.
    pub fn login_deadline(&self) -> Option<Instant> {
        self.slot.as_ref().map(|_| self.login_deadline)
    }

    /// The frame limit now: the small one before login.
    pub fn max_frame(&self) -> usize {
        match self.slot {
            Some(_) => self.port.max_frame.min(PRELOGIN_MAX_BODY),
            None => self.port.max_frame,
        }
    }

    /// Sends `out`: the replies that wait for nothing, then the ordered ones once the WAL holds
    /// everything up to `owed_lsn`. If the WAL stopped without writing it, nothing of those is
    /// sent and the connection is to close. Before login, only until the login deadline.
    pub async fn send(&mut self, out: &mut Out, owed_lsn: u64) -> std::io::Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let Conn {
            socket,
            port,
            peer,
            slot,
            login_deadline,
            ..
        } = self;
        let login = slot
            .as_ref()
            .map(|_| (*login_deadline, &*port.prelogin, *peer));
        let sending = async {
            crate::tls::write_out(socket, &mut out.now, &port.io.bytes_out, FLUSH_AT).await?;
            if out.acked.is_empty() {
                return Ok(());
            }
            if let Err(e) = crate::request::acknowledged(&port.engine, owed_lsn).await {
                out.acked.clear();
                return Err(e);
            }
            out.acked
                .write_to(socket, &port.io.bytes_out, FLUSH_AT)
                .await
        };
        crate::limits::by_login_deadline(login, sending).await
    }

    /// Waits for the connection's first bytes (a front that sniffs its protocol); false when
    /// it ended first (logged).
    pub async fn first_bytes(&mut self) -> bool {
        let mut stop = crate::armed::watch_changes(self.stop.clone());
        while self.inbuf.is_empty() {
            if *self.stop.borrow() {
                return false;
            }
            tokio::select! {
                r = self.read(true, false) => match r {
                    Read::Data => {}
                    Read::Eof | Read::Gone => return false,
                },
                _ = stop.next() => return false,
            }
        }
        true
    }

    /// One read into the buffer: under the login deadline before login (from accept, so that a
    /// trickle of bytes does not move it), else the idle timeout unless `waiting`. With
    /// `reading` false, only the login deadline can end it.
    async fn read(&mut self, reading: bool, waiting: bool) -> Read {
        let Conn {
            socket,
            inbuf,
            port,
            peer,
            slot,
            login_deadline,
            ..
        } = self;
        let idle = port.idle_timeout;
        let deadline = slot.as_ref().map(|_| *login_deadline);
        let read = if !reading {
            // Not reading: the deadline still ends a connection that never logs in.
            match deadline {
                Some(d) => {
                    tokio::time::sleep_until(d.into()).await;
                    Err(())
                }
                None => std::future::pending().await,
            }
        } else if let Some(d) = deadline {
            tokio::time::timeout_at(d.into(), socket.read_buf(inbuf))
                .await
                .map_err(|_| ())
        } else if idle.is_zero() || waiting {
            Ok(socket.read_buf(inbuf).await)
        } else {
            tokio::time::timeout(idle, socket.read_buf(inbuf))
                .await
                .map_err(|_| ())
        };
        let (noun, peer) = (port.noun, *peer);
        match read {
            Ok(Ok(0)) => Read::Eof,
            Ok(Ok(n)) => {
                port.io.bytes_in.fetch_add(n as u64, Relaxed);
                Read::Data
            }
            Ok(Err(e)) => {
                log::debug!("{noun} from {peer}: {e}");
                Read::Gone
            }
            Err(()) if deadline.is_some() => {
                crate::limits::login_timed_out(&port.prelogin, peer);
                Read::Gone
            }
            Err(()) => {
                log::info!("closing {noun} from {peer}: idle for {idle:?}");
                Read::Gone
            }
        }
    }

    /// A frame refused by its check: counted, and logged (rate-limited).
    fn refused(&self, fault: &Fault) {
        let (kind, noun, peer) = (self.port.kind, self.port.noun, self.peer);
        if self.before_login() {
            self.port.io.protocol_errors.fetch_add(1, Relaxed);
            crate::limits::closing_before_login(
                &self.port.prelogin,
                peer,
                fault.too_big,
                &fault.why,
            );
        } else {
            self.port.io.protocol_error(
                kind,
                format_args!("closing {noun} from {peer}: {}", fault.why),
            );
        }
    }
}

/// A batch's frames, added to its front's request count when the batch ends (however it ends).
struct Handled<'a>(&'a AtomicU64, u64);

impl Drop for Handled<'_> {
    fn drop(&mut self) {
        if self.1 > 0 {
            self.0.fetch_add(self.1, Relaxed);
        }
    }
}

/// Runs a session on a connection until it closes or hands the connection over.
pub async fn run<S: Session>(conn: &mut Conn, s: &mut S) -> Ended {
    let open = Open::new(&conn.port);
    let mut out = Out::default();
    s.greet(&mut out);
    let mut stop_changes = crate::armed::watch_changes(conn.stop.clone());
    let mut coalesced = 0;
    loop {
        // Bytes of the buffer handled in this batch, stepped over once it ends.
        let mut pos = 0;
        let mut max_frame = conn.max_frame();
        // Frames handled in this batch, counted once it ends.
        let mut handled = Handled(&open.0.counters.requests, 0);
        while s.reading() {
            if conn.before_login() && s.logged_in() {
                conn.slot = None;
                max_frame = conn.max_frame();
            }
            match s.check(&conn.inbuf[pos..], max_frame) {
                Check::Frame(n) => {
                    handled.1 += 1;
                    let mut frame = Frame::new(&mut conn.inbuf, pos, n, &conn.socket);
                    let flow = s.handle(&mut frame, &mut out).await;
                    let took;
                    (pos, took) = frame.done();
                    match flow {
                        Flow::Continue if took == 0 => break,
                        Flow::Continue => {}
                        Flow::Close => return finish(conn, s, out, End::Close).await,
                        Flow::Handoff => {
                            conn.inbuf.advance(pos);
                            return hand_over(conn, s, out).await;
                        }
                    }
                    if out.len() >= S::FLUSH_AT && conn.send(&mut out, s.owed_lsn()).await.is_err()
                    {
                        return Ended::Closed;
                    }
                }
                Check::Need(n) => {
                    conn.inbuf.advance(pos);
                    pos = 0;
                    conn.inbuf.reserve(n.saturating_sub(conn.inbuf.len()));
                    break;
                }
                Check::Bad(fault) => {
                    conn.refused(&fault);
                    s.settle(&mut out, Some(End::Close)).await;
                    s.refuse(&fault, &conn.inbuf[pos..], &mut out);
                    let _ = conn.send(&mut out, s.owed_lsn()).await;
                    return Ended::Closed;
                }
            }
        }
        conn.inbuf.advance(pos);
        if conn.before_login() && s.logged_in() {
            conn.slot = None;
        }
        if coalesced < s.coalesced_reads() && !out.is_empty() && out.len() < S::FLUSH_AT {
            if let Ok(n @ 1..) = conn.socket.try_read_buf(&mut conn.inbuf) {
                conn.port.io.bytes_in.fetch_add(n as u64, Relaxed);
                coalesced += 1;
                continue;
            }
        }
        coalesced = 0;
        let stopping = *conn.stop.borrow();
        let end = stopping.then_some(End::Stop);
        let flow = s.settle(&mut out, end).await;
        if conn.send(&mut out, s.owed_lsn()).await.is_err() || stopping || flow == Flow::Close {
            return Ended::Closed;
        }
        let (reading, waiting, wakes) = (s.reading(), s.waiting(), s.wakes());
        // In a fixed order (no random start drawn per wait), the socket first: a wake that is
        // always ready (a stream with more to send) cannot starve the client's requests, and
        // what the others would bring is settled every turn anyway (held replies released,
        // the stop read) while the socket keeps the connection busy.
        tokio::select! {
            biased;
            r = conn.read(reading, waiting) => match r {
                Read::Data => {}
                Read::Eof => return finish(conn, s, out, End::Eof).await,
                Read::Gone => return Ended::Closed,
            },
            () = s.wake(), if wakes => {}
            // The next turn answers what was read and ends.
            _ = stop_changes.next() => {}
        }
    }
}

/// Settles what the session holds and sends it before closing.
async fn finish<S: Session>(conn: &mut Conn, s: &mut S, mut out: Out, end: End) -> Ended {
    s.settle(&mut out, Some(end)).await;
    let _ = conn.send(&mut out, s.owed_lsn()).await;
    Ended::Closed
}

/// Settles every held reply and waits for the WAL to hold what they acknowledge, then gives the
/// replies to whoever takes the connection over.
async fn hand_over<S: Session>(conn: &mut Conn, s: &mut S, mut out: Out) -> Ended {
    s.settle(&mut out, Some(End::Handoff)).await;
    if crate::request::acknowledged(&conn.port.engine, s.owed_lsn())
        .await
        .is_err()
    {
        return Ended::Closed;
    }
    let mut left = std::mem::take(&mut out.now);
    out.acked.drain_into(&mut left);
    Ended::Handoff(left)
}

/// Runs one accepted connection of `port` to its end: admitted under the pre-login caps, then
/// `open` runs it (a front's entry, which picks its session and calls `run`).
pub async fn serve_connection<F, Fut>(
    socket: MaybeTls,
    peer: SocketAddr,
    stop: watch::Receiver<bool>,
    port: Arc<Port>,
    open: F,
) where
    F: FnOnce(Conn) -> Fut,
    Fut: Future<Output = ()>,
{
    if let Some(conn) = Conn::admit(socket, peer, stop, port) {
        open(conn).await;
    }
}
