//! One client connection: a read buffer checked with `mcbp::frame_len` before anything is
//! parsed, every complete frame handled in order (pipelining: replies in request order, quiet
//! commands silent on success), and one write per round. The connection reads again only after
//! writing, so a peer that sends but never reads stalls itself, not the server's memory.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::BytesMut;
use sluice_proto::mcbp::{self, FrameError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::kv::{Flow, Session};
use crate::server::Shared;

/// Replies are written once this much is pending, even mid-batch.
const FLUSH_AT: usize = 1 << 20;

pub async fn run(
    mut socket: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut session = Session::new(shared.clone());
    let mut inbuf = BytesMut::with_capacity(16 << 10);
    let mut out: Vec<u8> = Vec::with_capacity(16 << 10);
    let max_body = shared.config.max_body;
    let idle = shared.config.idle_timeout;
    loop {
        loop {
            match mcbp::frame_len(&inbuf, max_body) {
                Ok(Some(n)) => {
                    let frame = inbuf.split_to(n);
                    let flow = if session.may_block(&frame) {
                        // A durability wait parks this thread, not the runtime's others.
                        tokio::task::block_in_place(|| session.handle(&frame, &mut out))
                    } else {
                        session.handle(&frame, &mut out)
                    };
                    match flow {
                        Flow::Continue => {}
                        Flow::Close => {
                            let _ = write_out(&mut socket, &mut out, &shared).await;
                            return;
                        }
                        Flow::DcpProducer(open) => {
                            let p = crate::dcp::producer::run(
                                socket, inbuf, out, session, open, peer, shared, stop,
                            );
                            return Box::pin(p).await;
                        }
                        Flow::TapProducer(connect, opaque) => {
                            let p = crate::tap::producer::run(
                                socket, inbuf, out, session, connect, opaque, peer, shared, stop,
                            );
                            return Box::pin(p).await;
                        }
                    }
                    if out.len() >= FLUSH_AT
                        && write_out(&mut socket, &mut out, &shared).await.is_err()
                    {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    shared.stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    log::warn!("closing connection from {peer}: {e}");
                    if let FrameError::TooBig { .. } = e {
                        session.refuse_too_big(&inbuf, &mut out);
                    }
                    let _ = write_out(&mut socket, &mut out, &shared).await;
                    return;
                }
            }
        }
        if !out.is_empty() && write_out(&mut socket, &mut out, &shared).await.is_err() {
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
                Ok(Ok(n)) => { shared.stats.bytes_in.fetch_add(n as u64, Ordering::Relaxed); }
                Ok(Err(e)) => {
                    log::debug!("connection from {peer}: {e}");
                    return;
                }
                Err(_) => {
                    log::info!("closing connection from {peer}: idle for {:?}", idle);
                    return;
                }
            },
            _ = stop.changed() => {
                // Shutting down: requests already read were answered above.
                return;
            }
        }
    }
}

async fn write_out(
    socket: &mut TcpStream,
    out: &mut Vec<u8>,
    shared: &Shared,
) -> std::io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let r = socket.write_all(out).await;
    shared
        .stats
        .bytes_out
        .fetch_add(out.len() as u64, Ordering::Relaxed);
    out.clear();
    if out.capacity() > 4 * FLUSH_AT {
        out.shrink_to(FLUSH_AT);
    }
    r
}
