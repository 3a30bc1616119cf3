//! Text commands routed in a cluster (see `crate::router`): a command for one key whose vbucket
//! is active on another node is sent there and its answer given as the client's; a multi-key
//! get asks each node for its keys and answers in the order the keys were asked. A node that
//! does not answer gets the client a SERVER_ERROR, never part of an answer. The meta commands
//! are answered here (for keys active here; others get the error they get on a node on its
//! own).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use sluice_core::vbucket::VbState;

use super::{line, parse, Flow, TextSession};
use crate::router::text_link::{Answer, Answered};
use crate::router::Routes;

const ROUTED_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection's answers held in order behind a forwarded command's: the text protocol
/// answers in order and has no request ids, so while a forwarded answer is on its way,
/// whatever comes after it waits here, and the connection goes on reading.
#[derive(Default)]
pub(super) struct Held {
    queue: VecDeque<Slot>,
}

enum Slot {
    Ready(Vec<u8>),
    Forwarded {
        answer: Answered,
        noreply: bool,
        given_up_at: Instant,
        /// The answer, once `wait` took it.
        got: Option<Result<Vec<u8>, String>>,
    },
}

impl Held {
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub fn push_ready(&mut self, bytes: Vec<u8>) {
        if !bytes.is_empty() {
            self.queue.push_back(Slot::Ready(bytes));
        }
    }

    /// Resolves once the first forwarded answer came or waited too long. Cancel-safe.
    pub async fn wait(&mut self) {
        let Some(Slot::Forwarded {
            answer,
            given_up_at,
            got: got @ None,
            ..
        }) = self.queue.front_mut()
        else {
            return;
        };
        let until = *given_up_at;
        match tokio::time::timeout_at(until.into(), answer).await {
            Ok(Ok(r)) => *got = Some(r),
            Ok(Err(_)) => *got = Some(Err("the connection to the node failed".into())),
            Err(_) => {}
        }
    }

    /// Moves the answers at the front that are ready into `out`, in order; a forwarded one
    /// that failed or waited too long becomes a SERVER_ERROR. Returns how many failed.
    pub fn release(&mut self, out: &mut Vec<u8>) -> u64 {
        let mut failed = 0;
        let now = Instant::now();
        while let Some(front) = self.queue.front_mut() {
            match front {
                Slot::Ready(bytes) => out.extend_from_slice(bytes),
                Slot::Forwarded {
                    answer,
                    noreply,
                    given_up_at,
                    got,
                } => {
                    if got.is_none() {
                        match answer.try_recv() {
                            Ok(r) => *got = Some(r),
                            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                                *got = Some(Err("the connection to the node failed".into()))
                            }
                            Err(tokio::sync::oneshot::error::TryRecvError::Empty)
                                if *given_up_at <= now =>
                            {
                                *got = Some(Err(format!("no answer within {ROUTED_TIMEOUT:?}")))
                            }
                            Err(_) => break,
                        }
                    }
                    match got.take().expect("set above") {
                        Ok(answer) if !*noreply => out.extend_from_slice(&answer),
                        Ok(_) => {}
                        Err(why) => {
                            failed += 1;
                            if !*noreply {
                                line(out, &format!("SERVER_ERROR {}", one_line(&why)));
                            }
                        }
                    }
                }
            }
            self.queue.pop_front();
        }
        failed
    }
}

impl TextSession {
    /// The node `key` is active on, when it is another one that serves the text protocol.
    fn owner_elsewhere(&self, routes: &Routes, key: &[u8]) -> Option<SocketAddr> {
        let vb = self.bucket.vbucket_of(key);
        if self.ctx.engine.vbucket_state(&self.bucket, vb) == Some(VbState::Active) {
            return None;
        }
        routes.elsewhere(vb).and_then(|n| n.kv)
    }

    /// Routes the command `verb` `args` (its line `len` bytes of `buf`) when its key is active
    /// on another node: Some(what `step` returns), or None to run it here.
    pub(super) async fn route(
        &mut self,
        routes: &Routes,
        verb: &[u8],
        args: &[&[u8]],
        buf: &[u8],
        len: usize,
        out: &mut Vec<u8>,
    ) -> Option<(usize, Flow)> {
        match verb {
            b"get" | b"gets" => self.route_get(routes, verb, &[], args, len, out).await,
            b"gat" | b"gats" => {
                let (exptime, keys) = args.split_first()?;
                self.route_get(routes, verb, &[exptime], keys, len, out)
                    .await
            }
            b"set" | b"add" | b"replace" | b"append" | b"prepend" | b"cas" => {
                let addr = self.owner_elsewhere(routes, args.first()?)?;
                let bytes =
                    args.get(3)
                        .and_then(|b| parse::number(b))
                        .filter(|&n| n as usize <= self.max_value)? as usize;
                let end = len + bytes + 2;
                if buf.len() < end {
                    return Some((0, Flow::More));
                }
                let (args, noreply) = parse::noreply(args);
                let mut request = command_line(verb, &[], args);
                request.extend_from_slice(&buf[len..end]);
                self.forward(addr, request, noreply, out).await;
                Some((end, Flow::Continue))
            }
            b"delete" | b"incr" | b"decr" | b"touch" => {
                let addr = self.owner_elsewhere(routes, args.first()?)?;
                let (args, noreply) = parse::noreply(args);
                let request = command_line(verb, &[], args);
                self.forward(addr, request, noreply, out).await;
                Some((len, Flow::Continue))
            }
            _ => None,
        }
    }

    /// Sends a one-line-answer command on; its answer (none with `noreply`) takes its place
    /// in order among this connection's answers when it comes (`Held`), and the connection
    /// goes on meanwhile.
    async fn forward(
        &mut self,
        addr: SocketAddr,
        request: Vec<u8>,
        noreply: bool,
        out: &mut Vec<u8>,
    ) {
        let ctx = self.ctx.clone();
        let router = &ctx.clustermap.router;
        router.stats.text_forwarded.fetch_add(1, Relaxed);
        // What this command's turn already wrote goes before it.
        self.held.push_ready(std::mem::take(out));
        match router
            .text(addr)
            .send(request, Answer::Line, ROUTED_TIMEOUT)
            .await
        {
            Ok(answer) => self.held.queue.push_back(Slot::Forwarded {
                answer,
                noreply,
                given_up_at: Instant::now() + ROUTED_TIMEOUT,
                got: None,
            }),
            Err(why) => {
                router.stats.failed.fetch_add(1, Relaxed);
                if !noreply {
                    let mut refusal = Vec::new();
                    line(&mut refusal, &format!("SERVER_ERROR {}", one_line(&why)));
                    self.held.push_ready(refusal);
                }
            }
        }
    }

    /// get, gets, gat, gats over keys some of which are active elsewhere.
    async fn route_get(
        &mut self,
        routes: &Routes,
        verb: &[u8],
        before: &[&[u8]],
        keys: &[&[u8]],
        len: usize,
        out: &mut Vec<u8>,
    ) -> Option<(usize, Flow)> {
        let mut elsewhere: HashMap<SocketAddr, Vec<&[u8]>> = HashMap::new();
        let mut here = Vec::new();
        for &k in keys {
            match self.owner_elsewhere(routes, k) {
                Some(addr) => elsewhere.entry(addr).or_default().push(k),
                None => here.push(k),
            }
        }
        if elsewhere.is_empty() {
            return None;
        }
        let router = &self.ctx.clustermap.router;
        // Every node is asked before any answer is awaited.
        let mut asked = Vec::with_capacity(elsewhere.len());
        for (addr, ks) in &elsewhere {
            router.stats.text_forwarded.fetch_add(1, Relaxed);
            let link = router.text(*addr);
            let request = command_line(verb, before, ks);
            asked.push(tokio::spawn(async move {
                link.call(request, Answer::Values, ROUTED_TIMEOUT).await
            }));
        }
        let mut answers = Vec::new();
        if !here.is_empty() {
            let touch = match before.first() {
                Some(e) => Some(parse::exptime(e)?),
                None => None,
            };
            let with_cas = verb.ends_with(b"s");
            let mut local = Vec::new();
            self.get(here.iter().copied(), with_cas, touch, &mut local)
                .await;
            answers.push(local);
        }
        for a in asked {
            match a.await {
                Ok(Ok(answer)) => answers.push(answer),
                Ok(Err(why)) => return Some(self.get_failed(&why, len, out)),
                Err(e) => return Some(self.get_failed(&e.to_string(), len, out)),
            }
        }
        // Each answer's VALUE blocks by key, given in the order the keys were asked.
        let mut blocks: HashMap<&[u8], &[u8]> = HashMap::new();
        for answer in &answers {
            match value_blocks(answer) {
                Ok(found) => blocks.extend(found),
                Err(error_line) => {
                    out.extend_from_slice(error_line);
                    return Some((len, Flow::Continue));
                }
            }
        }
        for k in keys {
            if let Some(block) = blocks.get(k) {
                out.extend_from_slice(block);
            }
        }
        line(out, "END");
        Some((len, Flow::Continue))
    }

    fn get_failed(&self, why: &str, len: usize, out: &mut Vec<u8>) -> (usize, Flow) {
        self.ctx
            .clustermap
            .router
            .stats
            .failed
            .fetch_add(1, Relaxed);
        line(out, &format!("SERVER_ERROR {}", one_line(why)));
        (len, Flow::Continue)
    }
}

/// `verb before... words...\r\n`.
fn command_line(verb: &[u8], before: &[&[u8]], words: &[&[u8]]) -> Vec<u8> {
    let mut out = verb.to_vec();
    for w in before.iter().chain(words) {
        out.push(b' ');
        out.extend_from_slice(w);
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// An error as one line of text.
fn one_line(why: &str) -> String {
    why.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// A VALUE block's key and its bytes (its lines and data).
type Block<'a> = (&'a [u8], &'a [u8]);

/// The VALUE blocks of a get's answer by key (its END left out), or the error line it is.
fn value_blocks(answer: &[u8]) -> Result<Vec<Block<'_>>, &[u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < answer.len() {
        let rest = &answer[at..];
        let nl = rest.windows(2).position(|w| w == b"\r\n").ok_or(rest)?;
        let head = &rest[..nl];
        if head == b"END" {
            break;
        }
        let mut words = head.split(|&b| b == b' ');
        if words.next() != Some(b"VALUE") {
            return Err(&rest[..nl + 2]);
        }
        let key = words.next().ok_or(rest)?;
        let bytes = words.nth(1).and_then(parse::number).ok_or(rest)? as usize;
        let end = nl + 2 + bytes + 2;
        if rest.len() < end {
            return Err(rest);
        }
        out.push((key, &rest[..end]));
        at += end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_blocks_by_key() {
        let a = b"VALUE a 0 1\r\nx\r\nVALUE bb 5 2 9\r\nyz\r\nEND\r\n";
        let got = value_blocks(a).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], (&b"a"[..], &b"VALUE a 0 1\r\nx\r\n"[..]));
        assert_eq!(got[1].0, b"bb");
        assert_eq!(value_blocks(b"END\r\n").unwrap(), vec![]);
        assert_eq!(
            value_blocks(b"SERVER_ERROR busy\r\n"),
            Err(&b"SERVER_ERROR busy\r\n"[..])
        );
        assert_eq!(
            command_line(b"gat", &[b"10"], &[b"a", b"b"]),
            b"gat 10 a b\r\n"
        );
    }
}
