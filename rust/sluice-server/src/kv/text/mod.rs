//! memcached's text protocol and its meta commands on the KV port, for the clients that speak
//! them (pymemcache, python-memcached, telnet, `stats` scripts, memcaslap). A connection whose
//! first byte is not a binary magic is handed here (`connection`), as memcached sniffs it.
//!
//! The session reads command lines from its own buffer, answers every complete command in
//! order (pipelining), and sends once per round, after the WAL holds every change the replies
//! acknowledge, as the binary path does. Keys live in the bucket `default`: the text protocol
//! has no bucket selection. When users are configured the text protocol is refused: it has no
//! SASL (memcached refuses ASCII when SASL is on).
//!
//! `parse` reads lines and the classic commands' arguments, `meta` runs the meta commands.

use std::net::SocketAddr;
use std::sync::Arc;

use sluice_core::bucket::Bucket;
use sluice_core::item::Item;
use sluice_core::{Error, StoreMode, StoreRequest, Written};

use super::KvContext;
use crate::driver::{Check, Conn, Flow as DriverFlow, Frame, Out};
use parse::{Line, StoreVerb, BAD_FORMAT};

mod meta;
pub mod parse;
mod route;

/// A multi-get's line may be this long even when max_body is smaller (4,000 keys of 250 bytes).
const MULTIGET_LINE: usize = 1 << 20;

/// What the connection does after a command.
pub enum Flow {
    /// Not all of the command is in the buffer yet.
    More,
    Continue,
    Close,
}

/// One text connection's state.
pub struct TextSession {
    ctx: Arc<KvContext>,
    bucket: Arc<Bucket>,
    /// The last WAL record a reply given so far acknowledges (the driver sends the replies
    /// once the WAL holds it).
    owed_lsn: u64,
    /// The users' generation last checked (a node that has users refuses the text protocol);
    /// `u64::MAX` until the first command.
    users_generation: u64,
    /// Bytes of a refused value still to be skipped as they arrive.
    swallow: usize,
    /// Largest value accepted: the bucket's max_item_size within the server's max_body.
    max_value: usize,
    /// Longest retrieval line (many keys): the server's max_body, at least `MULTIGET_LINE`.
    max_multiget: usize,
    peer: SocketAddr,
    /// Answers held in order behind forwarded commands' (in a cluster).
    held: route::Held,
}

/// The reply to a user with a key: what the text protocol says for an engine error.
fn engine_error(e: &Error, out: &mut Vec<u8>) {
    match e {
        Error::InvalidKey(_) => line(out, BAD_FORMAT),
        Error::NotNumeric => line(
            out,
            "CLIENT_ERROR cannot increment or decrement non-numeric value",
        ),
        Error::TooBig { .. } => line(out, "SERVER_ERROR object too large for cache"),
        Error::NotMyVbucket(vb) => line(
            out,
            &format!("SERVER_ERROR vbucket {vb} is not active on this node"),
        ),
        e => {
            let why: String = e
                .to_string()
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .collect();
            line(out, &format!("SERVER_ERROR {why}"))
        }
    }
}

/// Appends a reply line and its "\r\n".
fn line(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends a decimal number.
fn decimal(out: &mut Vec<u8>, n: impl std::fmt::Display) {
    use std::io::Write;
    let _ = write!(out, "{n}");
}

/// An item's remaining time to live in seconds, -1 for none (the meta protocol's `t`).
fn ttl(it: &Item) -> i64 {
    match it.meta.expiry {
        0 => -1,
        e => (e as i64 - sluice_core::hlc::now_secs() as i64).max(0),
    }
}

impl TextSession {
    pub fn new(ctx: Arc<KvContext>, max_body: usize, peer: SocketAddr) -> TextSession {
        let bucket = ctx
            .engine
            .bucket("default")
            .expect("the default bucket always exists");
        let max_value = bucket.config.max_item_size.min(max_body);
        TextSession {
            ctx,
            bucket,
            owed_lsn: 0,
            users_generation: u64::MAX,
            swallow: 0,
            max_value,
            max_multiget: max_body.max(MULTIGET_LINE),
            peer,
            held: Default::default(),
        }
    }

    /// Waits for a write to meet its level (at level `none`: nothing to wait for here, the
    /// connection waits for the WAL before it sends the reply).
    async fn settle<T>(&mut self, w: Written<T>) -> Result<T, Error> {
        self.owed_lsn = self.owed_lsn.max(w.lsn());
        if !w.needs_settling() {
            return Ok(w.value);
        }
        let engine = &self.ctx.engine;
        let timer = tokio::time::sleep(engine.settle_timeout(&self.bucket, &w));
        engine.settled(&self.bucket, w, timer).await
    }

    /// Handles the command at the head of `buf`: how many bytes it took, and what next
    /// (`Continue` always takes some).
    pub async fn step(&mut self, buf: &[u8], out: &mut Vec<u8>) -> (usize, Flow) {
        if self.swallow > 0 {
            let n = self.swallow.min(buf.len());
            self.swallow -= n;
            return (n, if n == 0 { Flow::More } else { Flow::Continue });
        }
        let (cmd, len) = match parse::next_line(buf, self.max_multiget) {
            Line::Complete(l, n) => (l, n),
            Line::Incomplete => return (0, Flow::More),
            Line::TooLong => {
                line(out, "CLIENT_ERROR line too long");
                self.ctx.stats.protocol_error(
                    "text",
                    format_args!(
                        "closing connection from {}: a command line over {} bytes",
                        self.peer,
                        parse::MAX_LINE
                    ),
                );
                return (0, Flow::Close);
            }
        };
        let mut words = parse::words(cmd);
        let Some(verb) = words.next() else {
            line(out, "ERROR");
            return (len, Flow::Continue);
        };
        // In a cluster, a key active on another node is that node's to answer.
        if let Some(routes) = self.ctx.clustermap.router.routes() {
            let args: Vec<&[u8]> = parse::words(cmd).skip(1).collect();
            if let Some(done) = self.route(&routes, verb, &args, buf, len, out).await {
                return done;
            }
        }
        match verb {
            b"get" => self.get(words, false, None, out).await,
            b"gets" => self.get(words, true, None, out).await,
            b"gat" | b"gats" => match words.next().map(parse::exptime) {
                Some(Some(exp)) => self.get(words, verb == b"gats", Some(exp), out).await,
                Some(None) => line(out, "CLIENT_ERROR invalid exptime argument"),
                None => line(out, "ERROR"),
            },
            _ => {
                // Every other command has a few words: more than memcached's 24 is not a command.
                let mut args: [&[u8]; 24] = [&[]; 24];
                let mut n = 0;
                for w in words {
                    if n == args.len() {
                        line(out, "ERROR");
                        return (len, Flow::Continue);
                    }
                    args[n] = w;
                    n += 1;
                }
                return self.command(verb, &args[..n], buf, len, out).await;
            }
        }
        (len, Flow::Continue)
    }

    async fn command(
        &mut self,
        verb: &[u8],
        args: &[&[u8]],
        buf: &[u8],
        len: usize,
        out: &mut Vec<u8>,
    ) -> (usize, Flow) {
        let store = match verb {
            b"set" => Some(StoreVerb::Set),
            b"add" => Some(StoreVerb::Add),
            b"replace" => Some(StoreVerb::Replace),
            b"append" => Some(StoreVerb::Append),
            b"prepend" => Some(StoreVerb::Prepend),
            b"cas" => Some(StoreVerb::Cas),
            _ => None,
        };
        if let Some(v) = store {
            return self.store(v, args, buf, len, out).await;
        }
        match verb {
            b"ms" => return self.meta_set(args, buf, len, out).await,
            b"mg" => self.meta_get(args, out).await,
            b"md" => self.meta_delete(args, out).await,
            b"ma" => self.meta_arithmetic(args, out).await,
            b"me" => self.meta_debug(args, out),
            b"mn" => line(out, "MN"),
            b"delete" => self.delete(args, out).await,
            b"incr" | b"decr" => self.arithmetic(verb == b"incr", args, out).await,
            b"touch" => self.touch(args, out).await,
            b"flush_all" => self.flush_all(args, out).await,
            b"stats" => self.stats(args, out),
            // Neither takes arguments, noreply included: ERROR, and quit keeps the connection.
            // memcached 1.6 ignores them, but libmemcached's conformance checks (memccapable)
            // hold a server of sluice's version to the protocol text, which refuses them.
            b"version" | b"quit" if !args.is_empty() => line(out, "ERROR"),
            b"version" => line(out, &format!("VERSION {}", env!("CARGO_PKG_VERSION"))),
            // sluice's log level is its configuration's (RUST_LOG, --log-level): the command
            // is answered as memcached does for the clients that send it, and changes nothing.
            b"verbosity" => match parse::noreply(args) {
                ([level], noreply) if parse::number(level).is_some() => {
                    if !noreply {
                        line(out, "OK")
                    }
                }
                // memcached suppresses even the refusal of `verbosity noreply`.
                ([], true) => {}
                ([], false) => line(out, "ERROR"),
                _ => line(out, BAD_FORMAT),
            },
            b"quit" => return (len, Flow::Close),
            _ => line(out, "ERROR"),
        }
        (len, Flow::Continue)
    }

    /// The data block after a command line of `len` bytes: Ok(Some(data, total bytes)) once it
    /// is all in `buf`, Ok(None) until then; Err(bytes to take) when it was refused and the
    /// refusal written.
    fn data_block<'b>(
        &mut self,
        buf: &'b [u8],
        len: usize,
        bytes: usize,
        out: &mut Vec<u8>,
    ) -> Result<Option<(&'b [u8], usize)>, usize> {
        if bytes > self.max_value {
            // memcached: the value is read and dropped, and the connection goes on.
            line(out, "SERVER_ERROR object too large for cache");
            self.swallow = bytes.saturating_add(2);
            return Err(len);
        }
        let end = len + bytes + 2;
        if buf.len() < end {
            return Ok(None);
        }
        if &buf[len + bytes..end] != b"\r\n" {
            line(out, "CLIENT_ERROR bad data chunk");
            return Err(end);
        }
        Ok(Some((&buf[len..len + bytes], end)))
    }

    /// set, add, replace, append, prepend, cas.
    async fn store(
        &mut self,
        verb: StoreVerb,
        args: &[&[u8]],
        buf: &[u8],
        len: usize,
        out: &mut Vec<u8>,
    ) -> (usize, Flow) {
        let s = match parse::store_line(verb, args) {
            Ok(s) => s,
            Err(None) => {
                line(out, "ERROR");
                return (len, Flow::Continue);
            }
            Err(Some(bad)) => {
                line(out, bad.reply);
                if let Some(n) = bad.skip {
                    self.swallow = n.saturating_add(2);
                }
                return (len, Flow::Continue);
            }
        };
        let (data, end) = match self.data_block(buf, len, s.bytes, out) {
            Ok(Some(d)) => d,
            Ok(None) => return (0, Flow::More),
            Err(took) => return (took, Flow::Continue),
        };
        let engine = &self.ctx.engine;
        if verb == StoreVerb::Cas && s.cas == 0 {
            // No item has CAS 0 (the engine would take 0 as "no CAS check" and store).
            let word = match engine.get(&self.bucket, s.key) {
                Ok(Some(_)) => "EXISTS",
                Ok(None) => "NOT_FOUND",
                Err(e) => {
                    engine_error(&e, out);
                    return (end, Flow::Continue);
                }
            };
            if !s.noreply {
                line(out, word);
            }
            return (end, Flow::Continue);
        }
        let written = match verb {
            StoreVerb::Append | StoreVerb::Prepend => {
                let at_end = verb == StoreVerb::Append;
                engine
                    .write_concat(&self.bucket, s.key, data, at_end, 0, None)
                    .map(|w| w.map(|_| ()))
            }
            _ => {
                let mode = match verb {
                    StoreVerb::Add => StoreMode::Add,
                    StoreVerb::Replace => StoreMode::Replace,
                    _ => StoreMode::Set,
                };
                let req = StoreRequest {
                    key: s.key,
                    value: data,
                    flags: s.flags,
                    expiry: s.exptime,
                    datatype: 0,
                    cas: s.cas,
                    mode,
                    durability: None,
                    preserve_expiry: false,
                };
                engine
                    .write_store(&self.bucket, &req)
                    .map(|w| w.map(|_| ()))
            }
        };
        let result = match written {
            Ok(w) => self.settle(w).await,
            Err(e) => Err(e),
        };
        let word = match (verb, result) {
            (_, Ok(())) => "STORED",
            // A key locked by a Couchbase client (GET_LOCKED) takes only writes with the lock's
            // CAS: to a text client it is a CAS that does not match, or an item not stored.
            (StoreVerb::Cas, Err(Error::Exists | Error::Locked)) => "EXISTS",
            (StoreVerb::Cas, Err(Error::NotFound)) => "NOT_FOUND",
            (_, Err(Error::Exists | Error::Locked | Error::NotFound | Error::NotStored)) => {
                "NOT_STORED"
            }
            (_, Err(e)) => {
                engine_error(&e, out);
                return (end, Flow::Continue);
            }
        };
        if !s.noreply {
            line(out, word);
        }
        (end, Flow::Continue)
    }

    /// get, gets, gat, gats: a VALUE for each key found, then END. An error on any key answers
    /// the whole command with it, and so does a reply past `MAX_GET_REPLY`.
    async fn get<'a>(
        &mut self,
        keys: impl Iterator<Item = &'a [u8]>,
        with_cas: bool,
        touch: Option<u32>,
        out: &mut Vec<u8>,
    ) {
        let start = out.len();
        let mut any = false;
        for word in keys {
            any = true;
            let Some(key) = parse::key(word) else {
                out.truncate(start);
                return line(out, BAD_FORMAT);
            };
            let found = match touch {
                None => self.ctx.engine.get(&self.bucket, key),
                Some(exp) => match self.ctx.engine.write_touch(&self.bucket, key, exp, None) {
                    Ok(w) => self.settle(w).await.map(|(_, it)| Some(it)),
                    Err(e) => Err(e),
                }
                .or_else(|e| match e {
                    Error::NotFound => Ok(None),
                    e => Err(e),
                }),
            };
            match found {
                Ok(Some(_)) if out.len() - start > MAX_GET_REPLY => {
                    // Repeated keys could make one reply any size: memcached's answer when it
                    // cannot hold one.
                    out.truncate(start);
                    return line(out, "SERVER_ERROR out of memory writing get response");
                }
                Ok(Some(it)) => {
                    out.extend_from_slice(b"VALUE ");
                    out.extend_from_slice(key);
                    out.push(b' ');
                    decimal(out, it.meta.flags);
                    out.push(b' ');
                    decimal(out, it.body().len());
                    if with_cas {
                        out.push(b' ');
                        decimal(out, it.meta.cas);
                    }
                    out.extend_from_slice(b"\r\n");
                    out.extend_from_slice(it.body());
                    out.extend_from_slice(b"\r\n");
                }
                Ok(None) => {}
                Err(e) => {
                    out.truncate(start);
                    return engine_error(&e, out);
                }
            }
        }
        if any {
            line(out, "END");
        } else {
            line(out, "ERROR");
        }
    }

    /// delete <key> [0] [noreply]
    async fn delete(&mut self, args: &[&[u8]], out: &mut Vec<u8>) {
        let (args, noreply) = parse::noreply(args);
        let key = match args {
            [key] | [key, b"0"] => *key,
            [] => return line(out, "ERROR"),
            _ => {
                return line(
                    out,
                    "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]",
                )
            }
        };
        let Some(key) = parse::key(key) else {
            return line(out, BAD_FORMAT);
        };
        let r = match self.ctx.engine.write_delete(&self.bucket, key, 0, None) {
            Ok(w) => self.settle(w).await.map(|_| ()),
            Err(e) => Err(e),
        };
        match r {
            Ok(()) if !noreply => line(out, "DELETED"),
            Err(Error::NotFound) if !noreply => line(out, "NOT_FOUND"),
            Ok(()) | Err(Error::NotFound) => {}
            Err(e) => engine_error(&e, out),
        }
    }

    /// incr|decr <key> <delta> [noreply]: a missing key is NOT_FOUND (no initial value here).
    async fn arithmetic(&mut self, increment: bool, args: &[&[u8]], out: &mut Vec<u8>) {
        let (args, noreply) = parse::noreply(args);
        let [key, delta] = args else {
            return line(out, "ERROR");
        };
        let Some(key) = parse::key(key) else {
            return line(out, BAD_FORMAT);
        };
        let Some(delta) = parse::number(delta) else {
            return line(out, "CLIENT_ERROR invalid numeric delta argument");
        };
        let engine = &self.ctx.engine;
        let r = match engine.write_arithmetic(
            &self.bucket,
            key,
            delta,
            0,
            u32::MAX,
            increment,
            0,
            None,
        ) {
            Ok(w) => self.settle(w).await,
            Err(e) => Err(e),
        };
        match r {
            Ok((_, n)) if !noreply => {
                decimal(out, n);
                out.extend_from_slice(b"\r\n");
            }
            Err(Error::NotFound) if !noreply => line(out, "NOT_FOUND"),
            Ok(_) | Err(Error::NotFound) => {}
            Err(e) => engine_error(&e, out),
        }
    }

    /// touch <key> <exptime> [noreply]
    async fn touch(&mut self, args: &[&[u8]], out: &mut Vec<u8>) {
        let (args, noreply) = parse::noreply(args);
        let [key, exp] = args else {
            return line(out, "ERROR");
        };
        let Some(key) = parse::key(key) else {
            return line(out, BAD_FORMAT);
        };
        let Some(exp) = parse::exptime(exp) else {
            return line(out, "CLIENT_ERROR invalid exptime argument");
        };
        let r = match self.ctx.engine.write_touch(&self.bucket, key, exp, None) {
            Ok(w) => self.settle(w).await.map(|_| ()),
            Err(e) => Err(e),
        };
        match r {
            Ok(()) if !noreply => line(out, "TOUCHED"),
            Err(Error::NotFound) if !noreply => line(out, "NOT_FOUND"),
            Ok(()) | Err(Error::NotFound) => {}
            Err(e) => engine_error(&e, out),
        }
    }

    /// flush_all [delay] [noreply]: the bucket emptied now, or after `delay` (seconds, or a
    /// Unix time past 30 days, as memcached reads an expiry): then what it holds at that time
    /// goes, and what is stored after stays. The delayed flush is not kept across a restart.
    async fn flush_all(&mut self, args: &[&[u8]], out: &mut Vec<u8>) {
        let (args, noreply) = parse::noreply(args);
        match args {
            [] => {}
            [delay] => match parse::exptime(delay) {
                Some(0) => {}
                Some(d) => {
                    let now = sluice_core::hlc::now_secs() as u64;
                    let secs = match u64::from(d) {
                        relative if relative <= 30 * 86_400 => relative,
                        absolute => absolute.saturating_sub(now),
                    };
                    let (engine, bucket) = (self.ctx.engine.clone(), self.bucket.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
                        let flushed = match engine.write_flush(&bucket) {
                            Ok(w) => engine.wal().written(w.lsn()).await.map(|()| w.value),
                            Err(e) => Err(e),
                        };
                        match flushed {
                            Ok(n) => log::info!(
                                "flush_all after {secs} s: bucket {:?} emptied ({n} items)",
                                bucket.name()
                            ),
                            Err(e) => log::warn!(
                                "flush_all after {secs} s: bucket {:?} not emptied: {e}",
                                bucket.name()
                            ),
                        }
                    });
                    if !noreply {
                        line(out, "OK");
                    }
                    return;
                }
                None => return line(out, "CLIENT_ERROR invalid exptime argument"),
            },
            _ => return line(out, "ERROR"),
        }
        let r = match self.ctx.engine.write_flush(&self.bucket) {
            Ok(w) => self.settle(w).await.map(|_| ()),
            Err(e) => Err(e),
        };
        match r {
            Ok(()) if !noreply => line(out, "OK"),
            Ok(()) => {}
            Err(e) => engine_error(&e, out),
        }
    }

    /// stats [items|slabs|settings|sizes]: the general group, as the binary STAT gives it, and
    /// memcached's others in their shapes. sluice has no slab classes: `items` and `slabs`
    /// answer for the whole bucket as class 1 (its chunk size the mean item's), and nothing
    /// when it is empty, as memcached for a class without items; `sizes` is disabled, as in
    /// memcached by default.
    fn stats(&self, args: &[&[u8]], out: &mut Vec<u8>) {
        use std::sync::atomic::Ordering::Relaxed;
        let b = &self.bucket;
        let stats: Vec<(String, String)> = match args {
            [] => crate::kv::general_stats(&self.ctx, b)
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            [group] if *group == b"items" || *group == b"slabs" => {
                let items = crate::kv::stat::live_items(b) as u64;
                let bytes = b.mem_used() as u64;
                match (items, *group == b"items") {
                    (0, true) => Vec::new(),
                    (_, true) => vec![
                        ("items:1:number".into(), items.to_string()),
                        ("items:1:mem_requested".into(), bytes.to_string()),
                        (
                            "items:1:evicted".into(),
                            b.stats.evictions.load(Relaxed).to_string(),
                        ),
                        (
                            "items:1:outofmemory".into(),
                            b.stats.tmp_failures.load(Relaxed).to_string(),
                        ),
                        (
                            "items:1:expired_unfetched".into(),
                            b.stats.expired_by_pager.load(Relaxed).to_string(),
                        ),
                    ],
                    (0, false) => vec![
                        ("active_slabs".into(), "0".into()),
                        ("total_malloced".into(), bytes.to_string()),
                    ],
                    (_, false) => vec![
                        ("1:chunk_size".into(), bytes.div_ceil(items).to_string()),
                        ("1:used_chunks".into(), items.to_string()),
                        ("1:total_chunks".into(), items.to_string()),
                        ("1:mem_requested".into(), bytes.to_string()),
                        ("active_slabs".into(), "1".into()),
                        ("total_malloced".into(), bytes.to_string()),
                    ],
                }
            }
            [b"settings"] => vec![
                ("maxbytes".into(), b.config.memory_quota.to_string()),
                ("item_size_max".into(), b.config.max_item_size.to_string()),
                (
                    "evictions".into(),
                    match b.config.eviction {
                        sluice_core::config::Eviction::None => "off",
                        _ => "on",
                    }
                    .into(),
                ),
                ("cas_enabled".into(), "yes".into()),
                ("flush_enabled".into(), "yes".into()),
                ("binding_protocol".into(), "auto-negotiate".into()),
            ],
            [b"sizes"] => vec![("sizes_status".into(), "disabled".into())],
            _ => return line(out, "ERROR"),
        };
        for (k, v) in stats {
            out.extend_from_slice(b"STAT ");
            out.extend_from_slice(k.as_bytes());
            out.push(b' ');
            out.extend_from_slice(v.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        line(out, "END");
    }
}

/// The largest reply to one retrieval command (a line of repeated keys could ask for any
/// size): room for a few items of the largest size.
const MAX_GET_REPLY: usize = 64 << 20;

/// Runs a text connection whose first bytes are in `inbuf`, until the client quits or closes,
/// the server stops, or the connection is idle for `idle_timeout` (zero: never).
impl crate::driver::Session for TextSession {
    /// Commands are lines, some with a data block after them: the session parses as it goes
    /// (`step`), taking what it can of what is buffered.
    fn check(&mut self, buf: &[u8], _max_frame: usize) -> Check {
        match buf.len() {
            0 => Check::Need(0),
            n => Check::Frame(n),
        }
    }

    async fn handle(&mut self, frame: &mut Frame<'_>, out: &mut Out) -> DriverFlow {
        let out = &mut out.acked.buf;
        let generation = self.ctx.users.generation();
        if generation != self.users_generation {
            self.users_generation = generation;
            if self.ctx.users.current().required() {
                // No SASL in the text protocol: with users configured, it would bypass them.
                log::info!(
                    "closing a text-protocol connection from {}: this node has users, and \
                     memcached's text protocol cannot authenticate (use the binary protocol)",
                    self.peer
                );
                line(
                    out,
                    "CLIENT_ERROR authentication required: this node has users; use the binary \
                     protocol with SASL PLAIN",
                );
                frame.consumed(0);
                return DriverFlow::Close;
            }
        }
        let (took, flow) = if self.held.is_empty() {
            self.step(frame.bytes(), out).await
        } else {
            // Behind a forwarded command's answer still to come: held in order after it.
            let mut later = Vec::new();
            let r = self.step(frame.bytes(), &mut later).await;
            self.held.push_ready(later);
            r
        };
        frame.consumed(took);
        match flow {
            Flow::More | Flow::Continue => DriverFlow::Continue,
            Flow::Close => DriverFlow::Close,
        }
    }

    fn owed_lsn(&self) -> u64 {
        self.owed_lsn
    }

    /// No login: with users configured the text protocol is refused (`handle`).
    fn logged_in(&self) -> bool {
        true
    }

    fn waiting(&self) -> bool {
        !self.held.is_empty()
    }

    fn wakes(&self) -> bool {
        !self.held.is_empty()
    }

    fn wake(&mut self) -> impl std::future::Future<Output = ()> + Send {
        self.held.wait()
    }

    /// Moves the held answers that are ready into `out`; as the connection ends, waits a
    /// little for those still to come.
    async fn settle(&mut self, out: &mut Out, end: Option<crate::driver::End>) -> DriverFlow {
        if end.is_some() {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(2), async {
                while !self.held.is_empty() {
                    self.held.wait().await;
                    self.release(&mut out.acked.buf);
                }
            })
            .await;
        }
        self.release(&mut out.acked.buf);
        DriverFlow::Continue
    }
}

impl TextSession {
    fn release(&mut self, out: &mut Vec<u8>) {
        let failed = self.held.release(out);
        if failed > 0 {
            let stats = &self.ctx.clustermap.router.stats;
            stats
                .failed
                .fetch_add(failed, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// Runs a text-protocol connection until the client closes it or the server stops.
pub async fn run(mut conn: Conn, ctx: Arc<KvContext>) {
    let max_body = conn.port.max_frame;
    let mut session = TextSession::new(ctx, max_body, conn.peer);
    crate::driver::run(&mut conn, &mut session).await;
}
