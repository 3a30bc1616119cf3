//! One connection to another node's iproto listener, shared by every client connection here
//! that forwards to it: requests go out under syncs of its own, pipelined, and answers come
//! back by them. It connects (and logs in with the nodes' replication login) on first use and
//! again after a failure; a failure answers every request in flight with it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use sluice_proto::iproto::{client, codes, frame, greeting};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use std::sync::{Arc, RwLock};

use super::Login;

/// How long connecting and logging in may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest answer taken (a SELECT's part is at most its LIMIT of tuples).
const MAX_ANSWER: usize = 256 << 20;
/// Requests waiting to be written.
const QUEUE: usize = 4096;
/// Requests encoded and not yet written that stop more being taken from the queue.
const MAX_UNSENT: usize = 4 << 20;
/// How long a request may wait for room in that queue.
const QUEUE_WAIT: Duration = Duration::from_secs(10);

/// A node's answer: its response code (0 OK, else 0x8000 | error) and body.
#[derive(Debug)]
pub struct Reply {
    pub code: u32,
    pub body: Vec<u8>,
}

/// Where an answer goes: a caller waiting for it, or a client connection's queue of answers
/// (tagged with what it knows the request by), which it writes as they come.
pub enum Replier {
    Once(oneshot::Sender<Result<Reply, String>>),
    Tagged(mpsc::UnboundedSender<(u64, Result<Reply, String>)>, u64),
}

impl Replier {
    fn send(self, r: Result<Reply, String>) {
        match self {
            Replier::Once(tx) => {
                let _ = tx.send(r);
            }
            Replier::Tagged(tx, tag) => {
                let _ = tx.send((tag, r));
            }
        }
    }
}

struct Call {
    code: u32,
    forwarded_for: Option<String>,
    /// The vbuckets the node is to read (`client::write_relayed`).
    part: Option<Vec<u8>>,
    body: Vec<u8>,
    reply: Replier,
}

pub struct Link {
    addr: SocketAddr,
    tx: mpsc::Sender<Call>,
}

impl Link {
    /// Starts the link's task on the current runtime; it connects on the first request.
    pub fn start(addr: SocketAddr, login: Arc<RwLock<Login>>) -> Link {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(addr, login, rx));
        Link { addr, tx }
    }

    /// Sends `code` with `body` (a request's MessagePack body) to the node, as `forwarded_for`
    /// (the user the request runs as there), and waits up to `timeout` for the answer.
    pub async fn call(
        &self,
        code: u32,
        forwarded_for: Option<&str>,
        part: Option<Vec<u8>>,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<Reply, String> {
        let (reply, answer) = oneshot::channel();
        self.send(code, forwarded_for, part, body, Replier::Once(reply))
            .await?;
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(format!("the connection to {} failed", self.addr)),
            Err(_) => Err(format!("{} did not answer within {timeout:?}", self.addr)),
        }
    }
}

impl Link {
    /// Queues a request whose answer goes to `reply`, without waiting for it (a client
    /// connection that pipelines forwarded requests).
    pub async fn send(
        &self,
        code: u32,
        forwarded_for: Option<&str>,
        part: Option<Vec<u8>>,
        body: Vec<u8>,
        reply: Replier,
    ) -> Result<(), String> {
        let call = Call {
            code,
            forwarded_for: forwarded_for.map(str::to_string),
            part,
            body,
            reply,
        };
        match tokio::time::timeout(QUEUE_WAIT, self.tx.send(call)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(format!("the connection to {} is closed", self.addr)),
            Err(_) => Err(format!(
                "{} takes no more requests (the connection to it is stuck)",
                self.addr
            )),
        }
    }
}

async fn run(addr: SocketAddr, login: Arc<RwLock<Login>>, mut rx: mpsc::Receiver<Call>) {
    while let Some(first) = rx.recv().await {
        let login = login.read().unwrap_or_else(|e| e.into_inner()).clone();
        match tokio::time::timeout(CONNECT_TIMEOUT, connect(addr, &login)).await {
            Ok(Ok(stream)) => serve(stream, first, &mut rx).await,
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e,
                    _ => format!("connecting to {addr} took over {CONNECT_TIMEOUT:?}"),
                };
                log::warn!("routing iproto requests to {addr}: {why}");
                first.reply.send(Err(why.clone()));
                // What queued meanwhile fails too; the next request tries again.
                while let Ok(c) = rx.try_recv() {
                    c.reply.send(Err(why.clone()));
                }
            }
        }
    }
}

/// Connects, reads the greeting and logs in when the login has a password.
async fn connect(addr: SocketAddr, login: &Login) -> Result<TcpStream, String> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    let mut hello = [0u8; greeting::GREETING_SIZE];
    s.read_exact(&mut hello)
        .await
        .map_err(|e| format!("reading {addr}'s greeting: {e}"))?;
    let hello = greeting::parse(&hello).map_err(|e| format!("{addr}: {e}"))?;
    if let (Some(user), Some(password)) = (&login.username, &login.password) {
        let scramble = client::chap_sha1_scramble(&hello.salt, password.as_bytes(), sha1);
        let mut out = Vec::new();
        client::write_auth(&mut out, 0, user, &scramble);
        s.write_all(&out)
            .await
            .map_err(|e| format!("logging in to {addr}: {e}"))?;
        let mut buf = Vec::new();
        let packet = read_packet(&mut s, &mut buf).await?;
        let (code, _, body) = client::split_reply(&packet).map_err(|e| e.to_string())?;
        if code != codes::OK {
            return Err(format!(
                "{addr} refused the replication login {user:?}: {}",
                String::from_utf8_lossy(body)
            ));
        }
    }
    Ok(s)
}

fn sha1(data: &[u8]) -> [u8; 20] {
    let d = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, data);
    d.as_ref().try_into().expect("SHA-1 is 20 bytes")
}

/// Reads one whole packet (length prefix included).
async fn read_packet(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<Vec<u8>, String> {
    loop {
        match frame::check(buf, MAX_ANSWER) {
            Ok(Some(n)) => return Ok(buf.drain(..n).collect()),
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the node closed the connection".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn encode(out: &mut Vec<u8>, sync: u64, c: &Call) {
    client::write_relayed(
        out,
        c.code,
        sync,
        c.forwarded_for.as_deref(),
        c.part.as_deref(),
        &c.body,
    );
}

/// Writes requests and reads answers until the connection fails; then every request in flight
/// gets the failure.
async fn serve(stream: TcpStream, first: Call, rx: &mut mpsc::Receiver<Call>) {
    let peer = stream.peer_addr().ok();
    let (mut rd, mut wr) = stream.into_split();
    let mut pending: HashMap<u64, Replier> = HashMap::new();
    let mut next_sync = 1u64;
    let mut out = Vec::new();
    encode(&mut out, next_sync, &first);
    pending.insert(next_sync, first.reply);
    next_sync += 1;
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    // Bytes of `out` written so far. Writing goes a part at a time beside reading: a node that
    // stops reading while it writes its answers would otherwise wait for us as we wait for it.
    let mut sent = 0;
    let why = 'conn: loop {
        tokio::select! {
            written = wr.write(&out[sent..]), if sent < out.len() => match written {
                Ok(0) => break 'conn "the node stopped taking requests".to_string(),
                Ok(n) => {
                    sent += n;
                    if sent == out.len() {
                        out.clear();
                        sent = 0;
                    }
                }
                Err(e) => break 'conn format!("writing: {e}"),
            },
            call = rx.recv(), if out.len() < MAX_UNSENT => {
                let Some(call) = call else { return };
                encode(&mut out, next_sync, &call);
                pending.insert(next_sync, call.reply);
                next_sync += 1;
                // Whatever else waits goes in the same write.
                while let Ok(c) = rx.try_recv() {
                    encode(&mut out, next_sync, &c);
                    pending.insert(next_sync, c.reply);
                    next_sync += 1;
                }
            }
            read = rd.read_buf(&mut buf) => {
                match read {
                    Ok(0) => break 'conn "the node closed the connection".to_string(),
                    Err(e) => break 'conn format!("reading: {e}"),
                    Ok(_) => {}
                }
                let mut at = 0;
                loop {
                    match frame::check(&buf[at..], MAX_ANSWER) {
                        Ok(Some(n)) => {
                            let packet = &buf[at..at + n];
                            at += n;
                            match client::split_reply(packet) {
                                Ok((code, sync, body)) => {
                                    if let Some(reply) = pending.remove(&sync) {
                                        reply.send(Ok(Reply { code, body: body.to_vec() }));
                                    }
                                }
                                Err(e) => break 'conn format!("an answer that does not read: {e}"),
                            }
                        }
                        Ok(None) => break,
                        Err(e) => break 'conn e.to_string(),
                    }
                }
                buf.drain(..at);
            }
        }
    };
    let why = match peer {
        Some(p) => format!("the connection to {p} failed: {why}"),
        None => why,
    };
    log::warn!("routing iproto requests: {why}");
    for (_, reply) in pending {
        reply.send(Err(why.clone()));
    }
}
