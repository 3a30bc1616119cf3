//! Warm-up: the Greenstack port opens before the engine has recovered its data, so clients
//! can connect and learn where the server is, as Couchbase's do during a bucket's warm-up.
//! A connection then says HELLO (answered as always, and told `warming_up`); every other
//! request is answered "not initialized". Once the server runs, each connection goes on as an
//! ordinary session and is told `warmup_done` first (`session::WarmStart`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use sluice_proto::greenstack::{self as gs, opcode, status, Check, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::reply::{failure, hello_reply, write_notice};
use super::session::WarmStart;

/// Connections taken during warm-up; past this many, more are closed at once.
const MAX_WARM_CONNECTIONS: usize = 1024;
/// The largest frame body taken during warm-up (no one has logged in yet).
const MAX_WARM_FRAME: usize = crate::limits::PRELOGIN_MAX_BODY;

/// A connection taken during warm-up, handed to the server when it starts.
pub struct WarmConnection {
    pub(super) socket: std::net::TcpStream,
    pub(super) peer: SocketAddr,
    pub(super) start: WarmStart,
}

/// What warm-up hands the server: the bound listener and the connections it holds.
pub struct Warmed {
    pub listener: std::net::TcpListener,
    pub connections: Vec<WarmConnection>,
}

/// The Greenstack port during warm-up: its own small runtime, until `finish`.
pub struct Warmup {
    addr: SocketAddr,
    runtime: tokio::runtime::Runtime,
    done: watch::Sender<bool>,
    accepting: tokio::task::JoinHandle<std::io::Result<Warmed>>,
}

impl Warmup {
    /// Binds `addr` and answers connections until `finish`.
    pub fn start(addr: SocketAddr) -> std::io::Result<Warmup> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sluice-warmup")
            .enable_all()
            .build()?;
        let std_listener = std::net::TcpListener::bind(addr).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("Greenstack listener {addr} (greenstack_listen): {e}"),
            )
        })?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let listener = {
            let _enter = runtime.enter();
            TcpListener::from_std(std_listener)?
        };
        let (done, done_rx) = watch::channel(false);
        let accepting = runtime.spawn(accept(listener, done_rx, Instant::now()));
        Ok(Warmup {
            addr,
            runtime,
            done,
            accepting,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Ends warm-up: no more is read once each connection's whole frames are answered; the
    /// listener and the connections come back for the server.
    pub fn finish(self) -> std::io::Result<Warmed> {
        let _ = self.done.send(true);
        let warmed = self
            .runtime
            .block_on(self.accepting)
            .map_err(std::io::Error::other)??;
        // The sockets left the runtime (`into_std`): dropping it closes nothing of theirs.
        self.runtime.shutdown_background();
        Ok(warmed)
    }

    /// Ends warm-up, its listener and connections handed to the server as the Greenstack
    /// front's (`Server::start_with`).
    pub fn into_prebound(self) -> std::io::Result<crate::front::Prebound> {
        let warmed = self.finish()?;
        Ok(crate::front::Prebound {
            name: super::FRONT.declaration.name,
            listener: warmed.listener,
            warm: Box::new(warmed.connections),
        })
    }
}

async fn accept(
    listener: TcpListener,
    mut done: watch::Receiver<bool>,
    started: Instant,
) -> std::io::Result<Warmed> {
    let mut connections = JoinSet::new();
    // A connection's task ends when it closes, or when warm-up ends: then it hands its socket
    // back, whichever branch below sees it end.
    let mut taken = Vec::new();
    loop {
        tokio::select! {
            _ = done.changed() => break,
            accepted = listener.accept() => {
                let Ok((socket, peer)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                if connections.len() >= MAX_WARM_CONNECTIONS {
                    log::warn!("refusing Greenstack connection from {peer} during warm-up: {MAX_WARM_CONNECTIONS} are open");
                    continue;
                }
                let _ = socket.set_nodelay(true);
                connections.spawn(warm_session(socket, peer, done.clone()));
            }
            Some(ended) = connections.join_next(), if !connections.is_empty() => {
                if let Ok(Some(c)) = ended {
                    taken.push(c);
                }
            }
        }
    }
    while let Some(ended) = connections.join_next().await {
        if let Ok(Some(c)) = ended {
            taken.push(c);
        }
    }
    let warmup = started.elapsed();
    for c in &mut taken {
        c.start.warmup = warmup;
    }
    Ok(Warmed {
        listener: listener.into_std()?,
        connections: taken,
    })
}

/// One connection during warm-up; None when it closed or sent something unreadable.
async fn warm_session(
    mut socket: TcpStream,
    peer: SocketAddr,
    mut done: watch::Receiver<bool>,
) -> Option<WarmConnection> {
    let mut inbuf = BytesMut::with_capacity(4 << 10);
    let mut out = Vec::new();
    let (mut hello, mut next_opaque) = (false, 1u32);
    loop {
        loop {
            match gs::check(&inbuf, MAX_WARM_FRAME) {
                Ok(Check::Complete(n)) => {
                    let frame = inbuf.split_to(n);
                    let f = match Frame::decode(&frame[gs::LENGTH_LEN..]) {
                        Ok(f) => f,
                        Err(e) => {
                            log::info!(
                                "closing Greenstack connection from {peer} during warm-up: {e}"
                            );
                            return None;
                        }
                    };
                    if f.is_response() {
                        continue;
                    }
                    if f.opcode == opcode::HELLO {
                        hello = true;
                        out.extend_from_slice(&hello_reply(&f));
                        write_notice(&mut out, next_opaque, "warming_up", 1, |m| {
                            m.str(
                                "message",
                                "the server is recovering its data; a warmup_done notice follows",
                            );
                        });
                        next_opaque += 1;
                    } else {
                        out.extend_from_slice(&failure(
                            &f,
                            status::NOT_INITIALIZED,
                            "the server is warming up (recovering its data): wait for the warmup_done notice",
                        ));
                    }
                }
                Ok(Check::Incomplete(_)) => break,
                Err(e) => {
                    log::info!("closing Greenstack connection from {peer} during warm-up: {e}");
                    return None;
                }
            }
        }
        if !out.is_empty() {
            tokio::select! {
                r = socket.write_all(&out) => r.ok()?,
                // Warm-up ended a second ago and the client still does not read its replies:
                // the server does not wait for it to start, and it is not carried over.
                _ = async {
                    let _ = done.wait_for(|&d| d).await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                } => {
                    log::info!(
                        "closing Greenstack connection from {peer} at the end of warm-up: it \
                         does not read its replies"
                    );
                    return None;
                }
            }
            out.clear();
        }
        if *done.borrow() {
            break;
        }
        tokio::select! {
            r = socket.read_buf(&mut inbuf) => match r {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            },
            _ = done.changed() => {}
        }
    }
    let socket = socket.into_std().ok()?;
    Some(WarmConnection {
        socket,
        peer,
        start: WarmStart {
            inbuf,
            hello,
            next_opaque,
            warmup: Duration::ZERO,
        },
    })
}
