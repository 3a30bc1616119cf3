//! `sluice bench`: a native, pipelined load generator for the memcached binary protocol. It
//! drives sluice and memcached alike: N connections, each sending batches of `pipeline`
//! requests (GET or SET by the mix, keys uniform over the key space) and reading the replies,
//! with every request's latency (send of its batch to its reply) in an HdrHistogram.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use sluice_proto::mcbp::{self, magic, opcode, status, HeaderFields};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub target: SocketAddr,
    pub connections: usize,
    pub pipeline: usize,
    pub duration: Duration,
    /// Stop after this many requests (0: only the duration bounds the run).
    pub count: u64,
    pub keys: u64,
    pub key_size: usize,
    pub value_size: usize,
    /// Fraction of GETs; the rest are SETs.
    pub get_ratio: f64,
    /// SET every key once before measuring, so GETs hit.
    pub prefill: bool,
    pub threads: usize,
    /// SASL PLAIN credentials, when the target wants them.
    pub user: Option<(String, String)>,
    /// Connect over TLS (the target's certificate must carry its IP address).
    pub tls: Option<sluice_server::tls::ClientTls>,
}

#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    pub ops: u64,
    pub gets: u64,
    pub sets: u64,
    pub misses: u64,
    pub errors: u64,
    pub seconds: f64,
    pub ops_per_s: f64,
    /// (percentile, microseconds): p50, p90, p99, p99.9 and the maximum.
    pub latency_us: Vec<(f64, u64)>,
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

fn push_request(out: &mut Vec<u8>, op: u8, k: &[u8], value: &[u8]) {
    let h = HeaderFields {
        magic: magic::REQUEST,
        opcode: op,
        ..Default::default()
    };
    let extras: &[u8] = if op == opcode::SET { &[0u8; 8] } else { &[] };
    mcbp::write_frame(
        out,
        &h,
        &[],
        extras,
        k,
        if op == opcode::SET { value } else { &[] },
    )
    .expect("bounded sizes");
}

async fn read_replies<S: AsyncRead + Unpin>(
    sock: &mut S,
    buf: &mut Vec<u8>,
    mut n: usize,
    mut each: impl FnMut(u8, u16),
) -> std::io::Result<()> {
    let mut chunk = vec![0u8; 64 << 10];
    while n > 0 {
        while n > 0 {
            match mcbp::frame_len(buf, usize::MAX >> 1) {
                Ok(Some(len)) => {
                    let r = mcbp::parse_response(&buf[..len])
                        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
                    each(r.opcode, r.status);
                    buf.drain(..len);
                    n -= 1;
                }
                Ok(None) => break,
                Err(e) => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
            }
        }
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

async fn login<S: AsyncRead + AsyncWrite + Unpin>(
    sock: &mut S,
    user: &Option<(String, String)>,
) -> std::io::Result<()> {
    let Some((u, p)) = user else { return Ok(()) };
    let mut req = Vec::new();
    let data = [&b"\0"[..], u.as_bytes(), b"\0", p.as_bytes()].concat();
    let h = HeaderFields {
        magic: magic::REQUEST,
        opcode: opcode::SASL_AUTH,
        ..Default::default()
    };
    mcbp::write_frame(&mut req, &h, &[], &[], b"PLAIN", &data).expect("small");
    sock.write_all(&req).await?;
    sock.flush().await?;
    let mut ok = false;
    read_replies(sock, &mut Vec::new(), 1, |_, st| ok = st == status::SUCCESS).await?;
    if ok {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "SASL PLAIN refused",
        ))
    }
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

async fn worker(shared: Arc<Shared>, seed: u64) -> std::io::Result<(Histogram<u64>, [u64; 5])> {
    with_stream!(shared.cfg, |sock| load(&shared, seed, &mut sock).await)
}

async fn load<S: AsyncRead + AsyncWrite + Unpin>(
    shared: &Shared,
    seed: u64,
    sock: &mut S,
) -> std::io::Result<(Histogram<u64>, [u64; 5])> {
    let cfg = &shared.cfg;
    login(sock, &cfg.user).await?;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    let value = vec![b'v'; cfg.value_size];
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
            let k = key(r % cfg.keys.max(1), cfg.key_size);
            let op = if (r >> 32) < threshold {
                opcode::GET
            } else {
                opcode::SET
            };
            push_request(&mut out, op, &k, &value);
        }
        let t0 = Instant::now();
        sock.write_all(&out).await?;
        sock.flush().await?;
        read_replies(sock, &mut inbuf, cfg.pipeline, |op, st| {
            ops += 1;
            match (op, st) {
                (opcode::GET, status::SUCCESS) => gets += 1,
                (opcode::GET, status::KEY_ENOENT) => {
                    gets += 1;
                    misses += 1
                }
                (opcode::SET, status::SUCCESS) => sets += 1,
                _ => errors += 1,
            }
            let _ = hist.record(t0.elapsed().as_micros().max(1) as u64);
        })
        .await?;
    }
    Ok((hist, [ops, gets, sets, misses, errors]))
}

async fn prefill(cfg: &BenchConfig) -> std::io::Result<()> {
    with_stream!(cfg, |sock| prefill_on(cfg, &mut sock).await)
}

async fn prefill_on<S: AsyncRead + AsyncWrite + Unpin>(
    cfg: &BenchConfig,
    sock: &mut S,
) -> std::io::Result<()> {
    login(sock, &cfg.user).await?;
    let value = vec![b'v'; cfg.value_size];
    let mut out = Vec::new();
    let mut i = 0;
    while i < cfg.keys {
        out.clear();
        let n = (cfg.keys - i).min(512);
        for j in 0..n {
            push_request(&mut out, opcode::SET, &key(i + j, cfg.key_size), &value);
        }
        sock.write_all(&out).await?;
        sock.flush().await?;
        read_replies(sock, &mut Vec::new(), n as usize, |_, _| {}).await?;
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
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
        let mut totals = [0u64; 5];
        for t in tasks {
            let (h, c) = t.await.map_err(std::io::Error::other)??;
            hist.add(&h)
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            for (a, b) in totals.iter_mut().zip(c) {
                *a += b;
            }
        }
        timer.abort();
        let seconds = start.elapsed().as_secs_f64();
        let latency_us = [50.0, 90.0, 99.0, 99.9]
            .iter()
            .map(|&p| (p, hist.value_at_quantile(p / 100.0)))
            .chain([(100.0, hist.max())])
            .collect();
        Ok(BenchReport {
            ops: totals[0],
            gets: totals[1],
            sets: totals[2],
            misses: totals[3],
            errors: totals[4],
            seconds,
            ops_per_s: totals[0] as f64 / seconds,
            latency_us,
        })
    })
}
