//! `sluice bench`: a native, pipelined load generator for the memcached binary protocol, for
//! Tarantool's iproto and for Greenstack. It drives sluice, memcached and Tarantool alike: N connections, each
//! sending batches of `pipeline` requests (a read or a write by the mix, keys uniform over the
//! key space) and reading the replies, with every request's latency (send of its batch to its
//! reply) in an HdrHistogram. memcached: GET and SET; iproto: SELECT by primary key and REPLACE
//! of `[id, name, age]` tuples (the `users` space of README's example), `name` being the value;
//! Greenstack: GET and MUTATION (set) in the default bucket, on the root lane.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use sluice_proto::greenstack::payload::MapWriter;
use sluice_proto::greenstack::{self as gs, FrameOut};
use sluice_proto::iproto::client::{self as iproto, Body};
use sluice_proto::iproto::{codes, frame, greeting};
use sluice_proto::mcbp::{self, magic, opcode, status, HeaderFields};
use sluice_proto::msgpack;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

pub use sluice_core::config::Durability;

/// What the load speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// The memcached binary protocol: GET and SET of `key:NNN` keys.
    Memcached,
    /// Tarantool's iproto: SELECT (EQ, limit 1) and REPLACE in `space`, whose primary key is
    /// its first field, an unsigned id.
    Iproto { space: u32 },
    /// Greenstack: GET and MUTATION (set) of `key:NNN` ids in the default bucket.
    Greenstack,
}

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub target: SocketAddr,
    pub protocol: Protocol,
    pub connections: usize,
    pub pipeline: usize,
    pub duration: Duration,
    /// Stop after this many requests (0: only the duration bounds the run).
    pub count: u64,
    pub keys: u64,
    /// memcached only (iproto keys are unsigned ids).
    pub key_size: usize,
    pub value_size: usize,
    /// Fraction of reads (GET, SELECT); the rest are writes (SET, REPLACE).
    pub get_ratio: f64,
    /// Write every key once before measuring, so reads hit.
    pub prefill: bool,
    pub threads: usize,
    /// SASL PLAIN credentials (memcached) or chap-sha1 ones (iproto), when the target wants them.
    pub user: Option<(String, String)>,
    /// Connect over TLS (the target's certificate must carry its IP address).
    pub tls: Option<sluice_server::tls::ClientTls>,
    /// The durability level the writes ask for (memcached: majority and the persist levels, as
    /// a durability frame info; Greenstack: any level), else the bucket's.
    pub durability: Option<Durability>,
    /// memcached: say HELLO UnorderedExecution first, so that a durable write's reply does not
    /// hold back the replies behind it.
    pub unordered: bool,
}

#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    pub ops: u64,
    /// Reads (GET, SELECT) and writes (SET, REPLACE) answered without an error.
    pub gets: u64,
    pub sets: u64,
    pub misses: u64,
    pub errors: u64,
    pub seconds: f64,
    /// Requests that succeeded per second (errors are counted apart, not as throughput).
    pub ops_per_s: f64,
    /// (percentile, microseconds): p50, p90, p99, p99.9 and the maximum.
    pub latency_us: Vec<(f64, u64)>,
    /// The same of the reads alone (a read queued behind a durable write shows here).
    pub read_latency_us: Vec<(f64, u64)>,
    /// The status (iproto: error code) of a failed request, when one failed.
    pub first_error_status: Option<u32>,
}

fn key(i: u64, size: usize) -> Vec<u8> {
    let mut k = format!("key:{i:0>w$}", w = size.saturating_sub(4)).into_bytes();
    k.truncate(size.max(1));
    k
}

/// xorshift64*: cheap, seeded per connection, good enough to spread keys.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// memcached's durability frame info for a level (id 1, one byte: 1 majority, 2 majority and
/// persist on the active, 3 persist to majority); none for the levels it has no code for.
fn mcbp_durability(level: Option<Durability>) -> Option<[u8; 2]> {
    let code = match level? {
        Durability::Majority => 1,
        Durability::MajorityAndPersistActive => 2,
        Durability::PersistToMajority => 3,
        Durability::None | Durability::Persist => return None,
    };
    Some([0x11, code])
}

fn push_mcbp(out: &mut Vec<u8>, op: u8, k: &[u8], value: &[u8], durability: Option<[u8; 2]>) {
    let h = HeaderFields {
        magic: magic::REQUEST,
        opcode: op,
        ..Default::default()
    };
    let extras: &[u8] = if op == opcode::SET { &[0u8; 8] } else { &[] };
    let framing: &[u8] = match (&durability, op) {
        (Some(info), opcode::SET) => info,
        _ => &[],
    };
    mcbp::write_frame(
        out,
        &h,
        framing,
        extras,
        k,
        if op == opcode::SET { value } else { &[] },
    )
    .expect("bounded sizes");
}

/// Writes the load's requests for one protocol.
struct Requests {
    protocol: Protocol,
    durability: Option<Durability>,
    key_size: usize,
    value: Vec<u8>,
    /// The key or tuple of the iproto request being written.
    scratch: Vec<u8>,
    /// The sync of the last iproto request.
    sync: u64,
}

impl Requests {
    fn new(cfg: &BenchConfig) -> Requests {
        Requests {
            protocol: cfg.protocol,
            durability: cfg.durability,
            key_size: cfg.key_size,
            value: vec![b'v'; cfg.value_size],
            scratch: Vec::with_capacity(64 + cfg.value_size),
            sync: 0,
        }
    }

    /// A read or a write of key number `i`. An iproto request's sync carries whether it is a
    /// read (its low bit), as replies may come back out of order (a SELECT overtakes a REPLACE
    /// that waits for the WAL).
    fn push(&mut self, out: &mut Vec<u8>, read: bool, i: u64) {
        match self.protocol {
            Protocol::Memcached => {
                let op = if read { opcode::GET } else { opcode::SET };
                push_mcbp(
                    out,
                    op,
                    &key(i, self.key_size),
                    &self.value,
                    mcbp_durability(self.durability),
                )
            }
            Protocol::Greenstack => {
                let scratch = &mut self.scratch;
                scratch.clear();
                self.sync += 1;
                let k = key(i, self.key_size);
                let op = if read {
                    MapWriter::new(scratch, 1).bin("id", &k);
                    gs::opcode::GET
                } else {
                    let mut m = MapWriter::new(scratch, 3 + self.durability.is_some() as u32);
                    m.uint("type", 1).bin("id", &k).bin("value", &self.value);
                    if let Some(d) = self.durability {
                        m.str("durability", d.as_str());
                    }
                    gs::opcode::MUTATION
                };
                FrameOut {
                    opcode: op,
                    opaque: (self.sync << 1 | read as u64) as u32,
                    payload: scratch,
                    ..FrameOut::default()
                }
                .write(out);
            }
            Protocol::Iproto { space } => {
                let scratch = &mut self.scratch;
                scratch.clear();
                self.sync += 1;
                let sync = self.sync << 1 | read as u64;
                if read {
                    msgpack::write_array_len(scratch, 1);
                    msgpack::write_uint(scratch, i);
                    let select = iproto::Select {
                        space_id: space,
                        index_id: 0,
                        iterator: codes::iterator::EQ,
                        offset: 0,
                        limit: 1,
                        key: scratch,
                    };
                    iproto::write_select(out, sync, &select);
                } else {
                    msgpack::write_array_len(scratch, 3);
                    msgpack::write_uint(scratch, i);
                    msgpack::write_str_bytes(scratch, &self.value);
                    msgpack::write_uint(scratch, 30);
                    iproto::write_replace(out, sync, space, scratch);
                }
            }
        }
    }
}

/// How one request went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Hit,
    Miss,
    Stored,
    /// The status (memcached, Greenstack) or error code (iproto) of a failed request.
    Error(u32),
}

fn invalid(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

/// Where the first reply in `buf` ends, if it is all there.
fn reply_len(protocol: Protocol, buf: &[u8]) -> std::io::Result<Option<usize>> {
    match protocol {
        Protocol::Memcached => mcbp::frame_len(buf, usize::MAX >> 1).map_err(invalid),
        Protocol::Iproto { .. } => frame::check(buf, usize::MAX >> 1).map_err(invalid),
        Protocol::Greenstack => match gs::check(buf, usize::MAX >> 1).map_err(invalid)? {
            gs::Check::Complete(n) => Ok(Some(n)),
            gs::Check::Incomplete(_) => Ok(None),
        },
    }
}

fn outcome(protocol: Protocol, reply: &[u8]) -> std::io::Result<Outcome> {
    match protocol {
        Protocol::Memcached => {
            let r = mcbp::parse_response(reply).map_err(invalid)?;
            Ok(match (r.opcode, r.status) {
                (opcode::GET, status::SUCCESS) => Outcome::Hit,
                (opcode::GET, status::KEY_ENOENT) => Outcome::Miss,
                (opcode::SET, status::SUCCESS) => Outcome::Stored,
                (_, st) => Outcome::Error(st as u32),
            })
        }
        Protocol::Greenstack => {
            let f = gs::Frame::decode(&reply[gs::LENGTH_LEN..]).map_err(invalid)?;
            let read = f.opaque & 1 == 1;
            Ok(match f.status {
                Some(gs::status::SUCCESS) if read => Outcome::Hit,
                Some(gs::status::SUCCESS) => Outcome::Stored,
                Some(gs::status::NOT_FOUND) if read => Outcome::Miss,
                st => Outcome::Error(st.unwrap_or(u16::MAX) as u32),
            })
        }
        Protocol::Iproto { .. } => {
            let r = iproto::decode_response(reply).map_err(invalid)?;
            let read = r.sync & 1 == 1;
            Ok(match r.body {
                Body::Error { code, .. } => Outcome::Error(code),
                Body::Data { count: 0, .. } if read => Outcome::Miss,
                _ if read => Outcome::Hit,
                _ => Outcome::Stored,
            })
        }
    }
}

/// Whether a whole Greenstack frame is a response (else a request of the server's own).
fn is_response(frame: &[u8]) -> bool {
    // length u32, opaque u32, opcode u16, then the first flag byte.
    frame
        .get(gs::LENGTH_LEN + 6)
        .is_some_and(|flags| flags & gs::flag::RESPONSE != 0)
}

/// Reads `n` replies into `each`, leaving any bytes past them in `buf`.
async fn read_replies<S: AsyncRead + Unpin>(
    sock: &mut S,
    protocol: Protocol,
    buf: &mut Vec<u8>,
    mut n: usize,
    mut each: impl FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut chunk = vec![0u8; 64 << 10];
    while n > 0 {
        let mut at = 0;
        while n > 0 {
            match reply_len(protocol, &buf[at..])? {
                // A Greenstack server's own request (a notice) answers nothing of ours.
                Some(len)
                    if protocol == Protocol::Greenstack && !is_response(&buf[at..at + len]) =>
                {
                    at += len;
                }
                Some(len) => {
                    each(&buf[at..at + len])?;
                    at += len;
                    n -= 1;
                }
                None => break,
            }
        }
        buf.drain(..at);
        if n > 0 {
            let got = sock.read(&mut chunk).await?;
            if got == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            buf.extend_from_slice(&chunk[..got]);
        }
    }
    Ok(())
}

/// memcached: one request on a connection that has nothing else in flight; its reply's status
/// and value.
async fn call_once<S: AsyncRead + AsyncWrite + Unpin>(
    sock: &mut S,
    opcode: u8,
    key: &[u8],
    value: &[u8],
) -> std::io::Result<(u16, Vec<u8>)> {
    let h = HeaderFields {
        magic: magic::REQUEST,
        opcode,
        ..Default::default()
    };
    let mut req = Vec::new();
    mcbp::write_frame(&mut req, &h, &[], &[], key, value).expect("small");
    sock.write_all(&req).await?;
    sock.flush().await?;
    let mut answer = (0, Vec::new());
    read_replies(sock, Protocol::Memcached, &mut Vec::new(), 1, |reply| {
        let r = mcbp::parse_response(reply).map_err(invalid)?;
        answer = (r.status, r.value.to_vec());
        Ok(())
    })
    .await?;
    Ok(answer)
}

async fn login<S: AsyncRead + AsyncWrite + Unpin>(
    sock: &mut S,
    user: &Option<(String, String)>,
) -> std::io::Result<()> {
    let Some((u, p)) = user else { return Ok(()) };
    let data = [&b"\0"[..], u.as_bytes(), b"\0", p.as_bytes()].concat();
    let (st, _) = call_once(sock, opcode::SASL_AUTH, b"PLAIN", &data).await?;
    if st == status::SUCCESS {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "SASL PLAIN refused",
        ))
    }
}

/// memcached: HELLO with UnorderedExecution (and AltRequestSupport, for the durability frame
/// info); the server must grant UnorderedExecution.
async fn hello_unordered<S: AsyncRead + AsyncWrite + Unpin>(sock: &mut S) -> std::io::Result<()> {
    let features: Vec<u8> = [
        mcbp::feature::UNORDERED_EXECUTION,
        mcbp::feature::ALT_REQUEST_SUPPORT,
    ]
    .iter()
    .flat_map(|f| f.to_be_bytes())
    .collect();
    let (_, granted) = call_once(sock, opcode::HELLO, b"sluice bench", &features).await?;
    if granted
        .chunks_exact(2)
        .any(|c| u16::from_be_bytes([c[0], c[1]]) == mcbp::feature::UNORDERED_EXECUTION)
    {
        Ok(())
    } else {
        Err(std::io::Error::other(
            "the server did not grant HELLO UnorderedExecution",
        ))
    }
}

/// iproto: reads the greeting, then AUTHs with chap-sha1 when there is a user.
async fn iproto_login<S: AsyncRead + AsyncWrite + Unpin>(
    sock: &mut S,
    user: &Option<(String, String)>,
) -> std::io::Result<()> {
    let mut text = [0u8; greeting::GREETING_SIZE];
    sock.read_exact(&mut text).await?;
    let hello = greeting::parse(&text).map_err(invalid)?;
    let Some((u, p)) = user else { return Ok(()) };
    let scramble = iproto::chap_sha1_scramble(&hello.salt, p.as_bytes(), sluice_server::auth::sha1);
    let mut req = Vec::new();
    iproto::write_auth(&mut req, 0, u, &scramble);
    sock.write_all(&req).await?;
    sock.flush().await?;
    let mut refused = None;
    read_replies(
        sock,
        Protocol::Iproto { space: 0 },
        &mut Vec::new(),
        1,
        |reply| {
            if let Body::Error { message, .. } =
                iproto::decode_response(reply).map_err(invalid)?.body
            {
                refused = Some(String::from_utf8_lossy(message).into_owned());
            }
            Ok(())
        },
    )
    .await?;
    match refused {
        None => Ok(()),
        Some(m) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("chap-sha1 AUTH refused: {m}"),
        )),
    }
}

async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    sock: &mut S,
    cfg: &BenchConfig,
) -> std::io::Result<()> {
    match cfg.protocol {
        Protocol::Memcached if cfg.unordered => {
            hello_unordered(sock).await?;
            login(sock, &cfg.user).await
        }
        Protocol::Memcached => login(sock, &cfg.user).await,
        Protocol::Iproto { .. } => iproto_login(sock, &cfg.user).await,
        Protocol::Greenstack => greenstack_login(sock, &cfg.user).await,
    }
}

/// Greenstack: HELLO, SASL PLAIN when there is a user, SELECT BUCKET default; each must
/// succeed.
async fn greenstack_login<S: AsyncRead + AsyncWrite + Unpin>(
    sock: &mut S,
    user: &Option<(String, String)>,
) -> std::io::Result<()> {
    let mut steps: Vec<(u16, Vec<u8>)> = Vec::new();
    let mut p = Vec::new();
    MapWriter::new(&mut p, 1).str("user_agent", "sluice bench");
    steps.push((gs::opcode::HELLO, p));
    if let Some((u, pw)) = user {
        let mut p = Vec::new();
        let data = [&b"\0"[..], u.as_bytes(), b"\0", pw.as_bytes()].concat();
        MapWriter::new(&mut p, 2)
            .str("mechanism", "PLAIN")
            .bin("challenge", &data);
        steps.push((gs::opcode::SASL_AUTH, p));
    }
    let mut p = Vec::new();
    MapWriter::new(&mut p, 1).str("name", "default");
    steps.push((gs::opcode::SELECT_BUCKET, p));
    for (op, payload) in steps {
        let mut req = Vec::new();
        FrameOut {
            opcode: op,
            payload: &payload,
            ..FrameOut::default()
        }
        .write(&mut req);
        sock.write_all(&req).await?;
        sock.flush().await?;
        let mut st = None;
        read_replies(sock, Protocol::Greenstack, &mut Vec::new(), 1, |reply| {
            st = gs::Frame::decode(&reply[gs::LENGTH_LEN..])
                .map_err(invalid)?
                .status;
            Ok(())
        })
        .await?;
        if st != Some(gs::status::SUCCESS) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("Greenstack opcode {op:#06x} answered {st:?}"),
            ));
        }
    }
    Ok(())
}

struct Shared {
    cfg: BenchConfig,
    sent: AtomicU64,
    stop: AtomicBool,
}

/// Connects to the target and runs `$body` with `$sock` bound to the stream: plain TCP as it
/// is, or TLS over it (each a concrete type, so the load loop is compiled for both).
macro_rules! with_stream {
    ($cfg:expr, |$sock:ident| $body:expr) => {{
        let tcp = TcpStream::connect($cfg.target).await?;
        tcp.set_nodelay(true)?;
        match &$cfg.tls {
            None => {
                let mut $sock = tcp;
                $body
            }
            Some(tls) => {
                let name = sluice_server::tls::server_name(&$cfg.target.to_string())
                    .map_err(std::io::Error::other)?;
                let mut $sock = tokio_rustls::TlsConnector::from(tls.config.clone())
                    .connect(name, tcp)
                    .await?;
                $body
            }
        }
    }};
}

/// A connection's latencies (all requests, reads alone), counts (ops, gets, sets, misses,
/// errors) and the status of its first failed request.
type Measured = (Histogram<u64>, Histogram<u64>, [u64; 5], Option<u32>);

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

async fn worker(shared: Arc<Shared>, seed: u64) -> std::io::Result<Measured> {
    with_stream!(shared.cfg, |sock| load(&shared, seed, &mut sock).await)
}

async fn load<S: AsyncRead + AsyncWrite + Unpin>(
    shared: &Shared,
    seed: u64,
    sock: &mut S,
) -> std::io::Result<Measured> {
    let cfg = &shared.cfg;
    handshake(sock, cfg).await?;
    let (mut hist, mut reads) = (histogram(), histogram());
    let mut first_error = None;
    let mut requests = Requests::new(cfg);
    let mut rng = Rng(seed | 1);
    let (mut gets, mut sets, mut misses, mut errors, mut ops) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut out = Vec::with_capacity(cfg.pipeline * (64 + cfg.value_size));
    let mut inbuf = Vec::with_capacity(1 << 16);
    let threshold = (cfg.get_ratio * u32::MAX as f64) as u64;
    while !shared.stop.load(Ordering::Relaxed) {
        if cfg.count > 0
            && shared
                .sent
                .fetch_add(cfg.pipeline as u64, Ordering::Relaxed)
                >= cfg.count
        {
            break;
        }
        out.clear();
        for _ in 0..cfg.pipeline {
            let r = rng.next();
            requests.push(&mut out, (r >> 32) < threshold, r % cfg.keys.max(1));
        }
        let t0 = Instant::now();
        sock.write_all(&out).await?;
        sock.flush().await?;
        read_replies(sock, cfg.protocol, &mut inbuf, cfg.pipeline, |reply| {
            ops += 1;
            let us = t0.elapsed().as_micros().max(1) as u64;
            match outcome(cfg.protocol, reply)? {
                Outcome::Hit => gets += 1,
                Outcome::Miss => {
                    gets += 1;
                    misses += 1
                }
                Outcome::Stored => sets += 1,
                Outcome::Error(st) => {
                    errors += 1;
                    first_error.get_or_insert(st);
                }
            }
            let _ = hist.record(us);
            if is_read(cfg.protocol, reply) {
                let _ = reads.record(us);
            }
            Ok(())
        })
        .await?;
    }
    Ok((hist, reads, [ops, gets, sets, misses, errors], first_error))
}

/// Whether a reply answers a read (memcached: by opcode; the others carry it in the
/// opaque's or sync's low bit).
fn is_read(protocol: Protocol, reply: &[u8]) -> bool {
    match protocol {
        Protocol::Memcached => reply.get(1) == Some(&opcode::GET),
        Protocol::Greenstack => reply.get(gs::LENGTH_LEN + 3).is_some_and(|b| b & 1 == 1),
        Protocol::Iproto { .. } => iproto::decode_response(reply).is_ok_and(|r| r.sync & 1 == 1),
    }
}

async fn prefill(cfg: &BenchConfig) -> std::io::Result<()> {
    with_stream!(cfg, |sock| prefill_on(cfg, &mut sock).await)
}

async fn prefill_on<S: AsyncRead + AsyncWrite + Unpin>(
    cfg: &BenchConfig,
    sock: &mut S,
) -> std::io::Result<()> {
    handshake(sock, cfg).await?;
    let mut requests = Requests::new(cfg);
    let (mut out, mut inbuf) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < cfg.keys {
        out.clear();
        let n = (cfg.keys - i).min(512);
        for j in 0..n {
            requests.push(&mut out, false, i + j);
        }
        sock.write_all(&out).await?;
        sock.flush().await?;
        let mut failed = 0;
        read_replies(sock, cfg.protocol, &mut inbuf, n as usize, |reply| {
            failed += matches!(outcome(cfg.protocol, reply)?, Outcome::Error(_)) as u64;
            Ok(())
        })
        .await?;
        if failed > 0 {
            return Err(std::io::Error::other(format!(
                "the prefill's writes failed ({failed} of {n})"
            )));
        }
        i += n;
    }
    Ok(())
}

pub fn run(cfg: BenchConfig) -> std::io::Result<BenchReport> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async move {
        if cfg.prefill {
            prefill(&cfg).await?;
        }
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            sent: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let start = Instant::now();
        let tasks: Vec<_> = (0..cfg.connections.max(1))
            .map(|i| {
                tokio::spawn(worker(
                    shared.clone(),
                    0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1),
                ))
            })
            .collect();
        let sh = shared.clone();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(sh.cfg.duration).await;
            sh.stop.store(true, Ordering::Relaxed);
        });
        let (mut hist, mut reads) = (histogram(), histogram());
        let mut totals = [0u64; 5];
        let mut first_error_status = None;
        for t in tasks {
            let (h, r, c, e) = t.await.map_err(std::io::Error::other)??;
            first_error_status = first_error_status.or(e);
            hist.add(&h)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            reads
                .add(&r)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            for (a, b) in totals.iter_mut().zip(c) {
                *a += b;
            }
        }
        timer.abort();
        let seconds = start.elapsed().as_secs_f64();
        let percentiles = |h: &Histogram<u64>| {
            [50.0, 90.0, 99.0, 99.9]
                .iter()
                .map(|&p| (p, h.value_at_quantile(p / 100.0)))
                .chain([(100.0, h.max())])
                .collect()
        };
        Ok(BenchReport {
            ops: totals[0],
            gets: totals[1],
            sets: totals[2],
            misses: totals[3],
            errors: totals[4],
            seconds,
            // Requests that succeeded: an error answered at once is no throughput.
            ops_per_s: (totals[0] - totals[4]) as f64 / seconds,
            latency_us: percentiles(&hist),
            read_latency_us: percentiles(&reads),
            first_error_status,
        })
    })
}
