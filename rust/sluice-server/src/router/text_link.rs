//! One connection to another node's KV listener in memcached's text protocol, shared by every
//! client connection here that forwards to it. The protocol answers in order and has no
//! request ids: requests are written in turn and each answer is read as its command's kind
//! says it ends. It connects on first use and again after a failure, which answers every
//! request in flight with it.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const QUEUE: usize = 4096;
/// Requests not yet written that stop more being taken from the queue.
const MAX_UNSENT: usize = 4 << 20;
/// The longest answer line taken.
const MAX_LINE: usize = 8 << 10;
/// The largest value block taken.
const MAX_VALUE: usize = 256 << 20;

/// How an answer ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// One line (storage, delete, incr/decr, touch).
    Line,
    /// VALUE blocks, then END (get, gets, gat, gats); or one error line.
    Values,
}

/// Where an answer goes.
type Replier = oneshot::Sender<Result<Vec<u8>, String>>;

struct Call {
    request: Vec<u8>,
    answer: Answer,
    reply: Replier,
}

pub struct Link {
    addr: SocketAddr,
    tx: mpsc::Sender<Call>,
}

impl Link {
    pub fn start(addr: SocketAddr) -> Link {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(addr, rx));
        Link { addr, tx }
    }

    /// Sends `request` (whole commands, each with its data block) and returns the answer's
    /// bytes as the node wrote them.
    pub async fn call(
        &self,
        request: Vec<u8>,
        answer: Answer,
        timeout: Duration,
    ) -> Result<Vec<u8>, String> {
        let got = self.send(request, answer, timeout).await?;
        match tokio::time::timeout(timeout, got).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(format!("the connection to {} failed", self.addr)),
            Err(_) => Err(format!("{} did not answer within {timeout:?}", self.addr)),
        }
    }
}

impl Link {
    /// Queues `request` without waiting for its answer, which comes on the receiver (a client
    /// connection that pipelines: it writes the answers in its own order).
    pub async fn send(
        &self,
        request: Vec<u8>,
        answer: Answer,
        timeout: Duration,
    ) -> Result<Answered, String> {
        let (reply, got) = oneshot::channel();
        let call = Call {
            request,
            answer,
            reply,
        };
        match tokio::time::timeout(timeout, self.tx.send(call)).await {
            Ok(Ok(())) => Ok(got),
            Ok(Err(_)) => Err(format!("the connection to {} is closed", self.addr)),
            Err(_) => Err(format!("{} takes no more requests", self.addr)),
        }
    }
}

/// Where a queued request's answer comes.
pub type Answered = oneshot::Receiver<Result<Vec<u8>, String>>;

async fn run(addr: SocketAddr, mut rx: mpsc::Receiver<Call>) {
    while let Some(first) = rx.recv().await {
        let connected = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await;
        match connected {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                serve(stream, first, &mut rx).await
            }
            failed => {
                let why = match failed {
                    Ok(Err(e)) => format!("connecting to {addr}: {e}"),
                    _ => format!("connecting to {addr} took over {CONNECT_TIMEOUT:?}"),
                };
                log::warn!("routing text requests: {why}");
                let _ = first.reply.send(Err(why.clone()));
                while let Ok(c) = rx.try_recv() {
                    let _ = c.reply.send(Err(why.clone()));
                }
            }
        }
    }
}

/// The length of the whole answer at the head of `buf` of the given kind, once it is all there.
pub fn answer_len(buf: &[u8], answer: Answer) -> Result<Option<usize>, String> {
    let mut at = 0;
    loop {
        let Some(nl) = buf[at..].windows(2).position(|w| w == b"\r\n") else {
            if buf.len() - at > MAX_LINE {
                return Err("an answer line too long".into());
            }
            return Ok(None);
        };
        let line = &buf[at..at + nl];
        let after = at + nl + 2;
        match answer {
            Answer::Line => return Ok(Some(after)),
            Answer::Values if line == b"END" => return Ok(Some(after)),
            Answer::Values if line.starts_with(b"VALUE ") => {
                let bytes: usize = line
                    .split(|&b| b == b' ')
                    .nth(3)
                    .and_then(|w| std::str::from_utf8(w).ok())
                    .and_then(|w| w.parse().ok())
                    .filter(|&n| n <= MAX_VALUE)
                    .ok_or("a VALUE line without its length")?;
                if buf.len() < after + bytes + 2 {
                    return Ok(None);
                }
                at = after + bytes + 2;
            }
            // An error ends the answer.
            Answer::Values => return Ok(Some(after)),
        }
    }
}

async fn serve(stream: TcpStream, first: Call, rx: &mut mpsc::Receiver<Call>) {
    let (mut rd, mut wr) = stream.into_split();
    let mut waiting: VecDeque<(Answer, Replier)> = VecDeque::new();
    let mut out = first.request;
    waiting.push_back((first.answer, first.reply));
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    // Writing goes a part at a time beside reading (see iproto_link).
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
                out.extend_from_slice(&call.request);
                waiting.push_back((call.answer, call.reply));
                while let Ok(c) = rx.try_recv() {
                    out.extend_from_slice(&c.request);
                    waiting.push_back((c.answer, c.reply));
                }
            }
            read = rd.read_buf(&mut buf) => {
                match read {
                    Ok(0) => break 'conn "the node closed the connection".to_string(),
                    Err(e) => break 'conn format!("reading: {e}"),
                    Ok(_) => {}
                }
                let mut at = 0;
                while let Some((kind, _)) = waiting.front() {
                    match answer_len(&buf[at..], *kind) {
                        Ok(Some(n)) => {
                            let (_, reply) = waiting.pop_front().expect("looked at");
                            let _ = reply.send(Ok(buf[at..at + n].to_vec()));
                            at += n;
                        }
                        Ok(None) => break,
                        Err(e) => break 'conn e,
                    }
                }
                if at > 0 {
                    buf.drain(..at);
                }
                if waiting.is_empty() && !buf.is_empty() {
                    break 'conn "an answer nothing asked for".to_string();
                }
            }
        }
    };
    log::warn!("routing text requests: {why}");
    for (_, reply) in waiting {
        let _ = reply.send(Err(why.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_end_as_their_kind_says() {
        assert_eq!(answer_len(b"STORED\r\nEXTRA", Answer::Line), Ok(Some(8)));
        assert_eq!(answer_len(b"STOR", Answer::Line), Ok(None));
        let values = b"VALUE k 0 5\r\nab\r\nc\r\nVALUE j 1 0 7\r\n\r\nEND\r\n";
        assert_eq!(answer_len(values, Answer::Values), Ok(Some(values.len())));
        assert_eq!(answer_len(&values[..20], Answer::Values), Ok(None));
        assert_eq!(
            answer_len(b"SERVER_ERROR no\r\n", Answer::Values),
            Ok(Some(17))
        );
        assert!(answer_len(b"VALUE k 0 x\r\n", Answer::Values).is_err());
    }
}
