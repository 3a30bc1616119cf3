//! A native TAP client that reads a stream as fast as the socket allows, acknowledging every
//! message that asks: what the TAP benchmark measures the producer with, so that the reader is
//! never the bottleneck.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use sluice_proto::mcbp::{self, magic, HEADER_LEN};
use sluice_proto::tap::{message_flag, opcode, TapConnect, TAP_FLAGS_AT};

#[derive(Debug, Clone, Default)]
pub struct DrainReport {
    pub messages: u64,
    pub mutations: u64,
    pub deletions: u64,
    pub acks_sent: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// The producer closed the connection (a DUMP or takeover that finished).
    pub closed: bool,
}

/// Connects, sends `connect`, and reads until `want` mutations and deletions arrived (0: until
/// the producer closes), or `timeout` passes.
pub fn drain(
    addr: SocketAddr,
    connect: &TapConnect,
    want: u64,
    timeout: Duration,
) -> std::io::Result<DrainReport> {
    let mut sock = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    sock.set_nodelay(true)?;
    let mut out = Vec::new();
    connect
        .encode(&mut out, 0)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    sock.write_all(&out)?;
    let started = Instant::now();
    let deadline = started + timeout;
    let mut r = DrainReport::default();
    let mut buf = vec![0u8; 4 << 20];
    let (mut start, mut end) = (0usize, 0usize);
    let mut acks = Vec::new();
    loop {
        if want > 0 && r.mutations + r.deletions >= want {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        sock.set_read_timeout(Some(deadline - now))?;
        if end == buf.len() {
            buf.copy_within(start..end, 0);
            end -= start;
            start = 0;
            if end == buf.len() {
                buf.resize(buf.len() * 2, 0);
            }
        }
        let n = match sock.read(&mut buf[end..]) {
            Ok(0) => {
                r.closed = true;
                break;
            }
            Ok(n) => n,
            // A stop and resume of the process (SIGSTOP, SIGCONT) ends a read with a timeout
            // with EINTR: read again.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break
            }
            Err(e) => return Err(e),
        };
        end += n;
        r.bytes += n as u64;
        while end - start >= HEADER_LEN {
            let f = &buf[start..end];
            let body = u32::from_be_bytes(f[8..12].try_into().expect("4")) as usize;
            if f.len() < HEADER_LEN + body {
                break;
            }
            if f[0] == magic::REQUEST {
                r.messages += 1;
                match f[1] {
                    opcode::MUTATION => r.mutations += 1,
                    opcode::DELETE => r.deletions += 1,
                    _ => {}
                }
                let flags = if body >= 4 {
                    u16::from_be_bytes([f[TAP_FLAGS_AT], f[TAP_FLAGS_AT + 1]])
                } else {
                    0
                };
                if flags & message_flag::ACK != 0 {
                    let h = mcbp::HeaderFields {
                        magic: magic::RESPONSE,
                        opcode: f[1],
                        opaque: u32::from_be_bytes(f[12..16].try_into().expect("4")),
                        ..Default::default()
                    };
                    let _ = mcbp::write_frame(&mut acks, &h, &[], &[], &[], &[]);
                    r.acks_sent += 1;
                }
            }
            start += HEADER_LEN + body;
        }
        if !acks.is_empty() {
            sock.write_all(&acks)?;
            acks.clear();
        }
        if start == end {
            start = 0;
            end = 0;
        }
    }
    r.seconds = started.elapsed().as_secs_f64();
    Ok(r)
}
