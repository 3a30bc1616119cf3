//! A real Tarantool followed as its replica (Tarantool's applier, the network side): connect
//! and read the greeting, log in with chap-sha1, ask for the ballot (VOTE), fetch the snapshot
//! (FETCH_SNAPSHOT, anonymous; or JOIN, registered in its `_cluster`), then SUBSCRIBE from a
//! vclock and receive every row after it,
//! answering heartbeats with the vclock applied so far, so the upstream's
//! `box.info.replication` shows this reader following it. Anonymous: nothing takes a slot in
//! the upstream's `_cluster`; the user needs Tarantool's `replication` role.
//!
//! Rows are handed to the caller as `sluice_proto::iproto::xrow::Row`s, borrowed from the read
//! buffer. `sluice tarantool-tail` prints them; `iproto::follow` applies them to spaces.

use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use sluice_proto::iproto::client::{self, Ballot, Vclock};
use sluice_proto::iproto::xrow::{self, Row};
use sluice_proto::iproto::{codes, frame, greeting};
use sluice_proto::msgpack::Reader;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The largest row accepted from an upstream (Tarantool's own limit on a packet is 2 GiB; a
/// tuple is at most its `memtx_max_tuple_size`, 1 MiB by default).
const MAX_ROW: usize = 256 << 20;

/// How often the replica tells the upstream its vclock while following. The upstream drops a
/// replica it has not heard from for 4 × its `replication_timeout` (1 s by default), and
/// sends heartbeats only when it has no rows to send, so the replica speaks up on its own.
const ACK_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the upstream answered with error {code}: {message}")]
    Refused { code: u32, message: String },
    #[error("the upstream sent something that is not iproto: {0}")]
    Protocol(String),
    #[error("no answer from the upstream within {0:?}")]
    Timeout(Duration),
    /// The caller could not take a row (its store is full or failing); the rows from the
    /// position it kept come again on the next connection.
    #[error("{0}")]
    Local(String),
}

fn protocol(why: impl ToString) -> UpstreamError {
    UpstreamError::Protocol(why.to_string())
}

/// Where and as whom to follow.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// HOST:PORT.
    pub address: String,
    /// None: guest.
    pub user: Option<(String, String)>,
    /// For the connection, the login and each answer before the row stream; the stream itself
    /// waits as long as the upstream's heartbeats keep coming.
    pub timeout: Duration,
}

/// `[tarantool_upstream]`.
#[derive(Debug, Clone)]
pub struct FollowConfig {
    pub upstream: UpstreamConfig,
    /// The configured spaces to follow, by name; empty: every configured space.
    pub spaces: Vec<String>,
    /// Follow as an anonymous replica (FETCH_SNAPSHOT; nothing registered upstream), or JOIN
    /// and be registered in the upstream's `_cluster`, which then keeps the WAL this node has
    /// not acknowledged.
    pub anonymous: bool,
}

/// What the caller's row handler says.
pub enum Next {
    Continue,
    /// Not during a snapshot, which is read to its end.
    Stop,
    /// The caller cannot take the row now (its store is full or its WAL behind): the same
    /// row comes again after `RETRY_AFTER`.
    Retry,
}

/// The version a JOIN announces (Tarantool's version id of 2.6.0: major << 16 | minor << 8 |
/// patch), the protocol sluice speaks.
const TARANTOOL_VERSION_ID: u32 = 0x02_06_00;

/// How long a row the caller could not take waits before it is handed over again.
const RETRY_AFTER: Duration = Duration::from_millis(10);

/// One logged-in connection to the upstream.
pub struct Upstream {
    socket: TcpStream,
    buf: BytesMut,
    sync: u64,
    timeout: Duration,
    /// What the greeting said: `Tarantool 2.6.0` and the instance's uuid.
    pub version: String,
    pub instance_uuid: String,
}

impl Upstream {
    /// Connects, reads the greeting and logs in (as guest without a user).
    pub async fn connect(config: &UpstreamConfig) -> Result<Upstream, UpstreamError> {
        let t = config.timeout;
        let socket = within(t, TcpStream::connect(&config.address)).await??;
        socket.set_nodelay(true)?;
        let mut up = Upstream {
            socket,
            buf: BytesMut::with_capacity(64 << 10),
            sync: 0,
            timeout: t,
            version: String::new(),
            instance_uuid: String::new(),
        };
        let mut text = [0u8; greeting::GREETING_SIZE];
        within(t, up.socket.read_exact(&mut text)).await??;
        let hello = greeting::parse(&text).map_err(|e| protocol(format!("greeting: {e:?}")))?;
        up.version = hello.version.clone();
        up.instance_uuid = hello.instance_uuid.clone();
        if let Some((user, password)) = &config.user {
            let scramble =
                client::chap_sha1_scramble(&hello.salt, password.as_bytes(), crate::auth::sha1);
            let mut req = Vec::new();
            let sync = up.next_sync();
            client::write_auth(&mut req, sync, user, &scramble);
            up.send(&req).await?;
            up.answer(|_| Ok(())).await?;
        }
        Ok(up)
    }

    fn next_sync(&mut self) -> u64 {
        self.sync += 1;
        self.sync
    }

    async fn send(&mut self, bytes: &[u8]) -> Result<(), UpstreamError> {
        within(self.timeout, self.socket.write_all(bytes)).await??;
        Ok(())
    }

    /// Every tuple of a space (a system view such as `_vspace`), each as its MessagePack
    /// bytes.
    pub async fn select_all(&mut self, space_id: u32) -> Result<Vec<Vec<u8>>, UpstreamError> {
        let mut req = Vec::new();
        let sync = self.next_sync();
        let select = client::Select {
            space_id,
            index_id: 0,
            iterator: codes::iterator::ALL,
            offset: 0,
            limit: u32::MAX,
            key: b"\x90",
        };
        client::write_select(&mut req, sync, &select);
        self.send(&req).await?;
        let n = within(self.timeout, self.fill()).await??;
        let answer = client::decode_response(&self.buf[..n]).map_err(protocol);
        let out = answer.and_then(|a| match a.body {
            client::Body::Error { code, message } => Err(UpstreamError::Refused {
                code,
                message: String::from_utf8_lossy(message).into_owned(),
            }),
            _ => Ok(a.rows().map(<[u8]>::to_vec).collect()),
        });
        self.buf.advance(n);
        out
    }

    /// The upstream's ballot; None from an upstream that does not know VOTE.
    pub async fn ballot(&mut self) -> Result<Option<Ballot>, UpstreamError> {
        let mut req = Vec::new();
        let sync = self.next_sync();
        client::write_vote(&mut req, sync);
        self.send(&req).await?;
        match self
            .answer(|body| client::decode_ballot(body).map_err(protocol))
            .await
        {
            Ok(ballot) => Ok(Some(ballot)),
            Err(UpstreamError::Refused { code, .. }) if code == codes::ER_UNKNOWN_REQUEST_TYPE => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// FETCH_SNAPSHOT: hands every row of the upstream's read view to `each` and returns the
    /// read view's vclock, from which to SUBSCRIBE (rows after it were not in the read view).
    pub async fn fetch_snapshot(
        &mut self,
        each: impl FnMut(&Row<'_>) -> Result<Next, UpstreamError>,
    ) -> Result<Vclock, UpstreamError> {
        let mut req = Vec::new();
        let sync = self.next_sync();
        client::write_fetch_snapshot(&mut req, sync);
        self.send(&req).await?;
        let start = self.answer(vclock_of).await?;
        self.rows_until_ok(1, each).await?;
        Ok(start)
    }

    /// JOIN as `instance_uuid`, registering in the upstream's `_cluster` (which needs write
    /// access to it: Tarantool's `replication` role): hands every row of the upstream's read
    /// view, then of its final stage, to `each`, and returns the vclock to SUBSCRIBE from.
    pub async fn join(
        &mut self,
        instance_uuid: &str,
        each: impl FnMut(&Row<'_>) -> Result<Next, UpstreamError>,
    ) -> Result<Vclock, UpstreamError> {
        let mut req = Vec::new();
        let sync = self.next_sync();
        client::write_join(&mut req, sync, instance_uuid, TARANTOOL_VERSION_ID);
        self.send(&req).await?;
        // OK with the read view's vclock, the read view; OK with the final stage's end, the
        // final stage; OK with the upstream's vclock.
        let last = self.rows_until_ok(3, each).await?;
        vclock_of(&last)
    }

    /// Hands the rows that come to `each` (again after `RETRY_AFTER` when it says so) until
    /// the `oks`-th OK, and returns that OK's body.
    async fn rows_until_ok(
        &mut self,
        oks: usize,
        mut each: impl FnMut(&Row<'_>) -> Result<Next, UpstreamError>,
    ) -> Result<Vec<u8>, UpstreamError> {
        let mut seen = 0;
        loop {
            let t = self.timeout;
            let n = within(t, self.fill()).await??;
            let row = decode(&self.buf[..n])?;
            match row.header.kind {
                codes::OK => {
                    seen += 1;
                    if seen == oks {
                        let body = row.body.unwrap_or(b"\x80").to_vec();
                        self.buf.advance(n);
                        return Ok(body);
                    }
                }
                k if k & codes::TYPE_ERROR != 0 => return Err(refusal(&row)),
                _ => {
                    if matches!(each(&row)?, Next::Retry) {
                        // The row stays in the buffer and comes again.
                        tokio::time::sleep(RETRY_AFTER).await;
                        continue;
                    }
                }
            }
            self.buf.advance(n);
        }
    }

    /// SUBSCRIBE from `vclock`: hands every row after it to `each` until `each` says stop or
    /// the connection fails, and None for each heartbeat (the upstream has nothing more for
    /// now); the vclock of the rows handed over so far goes back to the upstream every
    /// `ACK_EVERY` and in answer to its heartbeats, as `acknowledge` gives it for the vclock of
    /// the rows handed over (a caller that makes rows durable later acknowledges less). `idle` bounds the wait for
    /// the next row or heartbeat (Tarantool sends one every `replication_timeout`, 1 s by
    /// default, when it has no rows to send).
    pub async fn subscribe(
        &mut self,
        instance_uuid: &str,
        anonymous: bool,
        mut vclock: Vclock,
        idle: Duration,
        mut each: impl FnMut(Option<&Row<'_>>) -> Result<Next, UpstreamError>,
        mut acknowledge: impl FnMut(&Vclock) -> Vclock,
    ) -> Result<Vclock, UpstreamError> {
        let mut req = Vec::new();
        let sync = self.next_sync();
        client::write_subscribe(&mut req, sync, instance_uuid, &vclock, anonymous);
        self.send(&req).await?;
        self.answer(|_| Ok(())).await?;
        let mut ack = Vec::new();
        let mut heard = Instant::now();
        let mut acked = Instant::now();
        loop {
            let wait = ACK_EVERY.saturating_sub(acked.elapsed());
            // Reading is cancel-safe: what arrived stays in the buffer for the next round.
            let mut heartbeat = false;
            let mut stop = false;
            let mut retry = false;
            if let Ok(n) = tokio::time::timeout(wait, self.fill()).await {
                let n = n?;
                heard = Instant::now();
                let row = decode(&self.buf[..n])?;
                let kind = row.header.kind;
                if kind & codes::TYPE_ERROR != 0 {
                    return Err(refusal(&row));
                }
                if kind == codes::OK {
                    heartbeat = true;
                    stop = matches!(each(None)?, Next::Stop);
                } else {
                    in_order(&vclock, &row)?;
                    match each(Some(&row))? {
                        // The row stays in the buffer and comes again.
                        Next::Retry => retry = true,
                        next => {
                            if let (Some(id), Some(lsn)) = (row.header.replica_id, row.header.lsn) {
                                vclock.insert(id, lsn);
                            }
                            stop = matches!(next, Next::Stop);
                        }
                    }
                }
                if !retry {
                    self.buf.advance(n);
                }
            } else if heard.elapsed() >= idle {
                return Err(UpstreamError::Timeout(idle));
            }
            if heartbeat || acked.elapsed() >= ACK_EVERY {
                ack.clear();
                client::write_vclock_ack(&mut ack, &acknowledge(&vclock));
                within(self.timeout, self.socket.write_all(&ack)).await??;
                acked = Instant::now();
            }
            if stop {
                return Ok(vclock);
            }
            if retry {
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }

    /// The answer to the last request: `body` of an OK handed to `read`, an error as
    /// `Refused`.
    async fn answer<T>(
        &mut self,
        read: impl FnOnce(&[u8]) -> Result<T, UpstreamError>,
    ) -> Result<T, UpstreamError> {
        let t = self.timeout;
        let n = within(t, self.fill()).await??;
        let row = decode(&self.buf[..n])?;
        let out = if row.header.kind & codes::TYPE_ERROR != 0 {
            Err(refusal(&row))
        } else {
            read(row.body.unwrap_or(b"\x80"))
        };
        self.buf.advance(n);
        out
    }

    /// Reads until the buffer holds a whole packet; its length (prefix included).
    async fn fill(&mut self) -> Result<usize, UpstreamError> {
        loop {
            match frame::check(&self.buf, MAX_ROW) {
                Ok(Some(n)) => return Ok(n),
                Ok(None) => {}
                Err(e) => return Err(protocol(e.message())),
            }
            if self.socket.read_buf(&mut self.buf).await? == 0 {
                return Err(UpstreamError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the upstream closed the connection",
                )));
            }
        }
    }
}

async fn within<F: std::future::Future>(t: Duration, f: F) -> Result<F::Output, UpstreamError> {
    tokio::time::timeout(t, f)
        .await
        .map_err(|_| UpstreamError::Timeout(t))
}

/// One packet (length prefix included) as a row.
fn decode(packet: &[u8]) -> Result<Row<'_>, UpstreamError> {
    let mut r = Reader::new(packet);
    r.read_uint().map_err(protocol)?;
    let row = xrow::decode_row(&mut r).map_err(protocol)?;
    if !r.is_empty() {
        return Err(protocol("bytes after a row's body"));
    }
    Ok(row)
}

/// A replicated row must come from a replica id Tarantool can have (below 32) and after what
/// the vclock holds of that id: anything else would be kept as a position no later
/// SUBSCRIBE can resume from, or apply a row twice.
fn in_order(vclock: &Vclock, row: &Row<'_>) -> Result<(), UpstreamError> {
    let (Some(id), Some(lsn)) = (row.header.replica_id, row.header.lsn) else {
        return Ok(());
    };
    if id >= 32 {
        return Err(protocol(format!(
            "a row from replica id {id}: ids are below 32"
        )));
    }
    match vclock.get(&id) {
        Some(&had) if lsn <= had => Err(protocol(format!(
            "a row of replica {id} with LSN {lsn}, not after {had}"
        ))),
        _ => Ok(()),
    }
}

fn vclock_of(body: &[u8]) -> Result<Vclock, UpstreamError> {
    client::body_vclock(body)
        .map_err(protocol)?
        .ok_or_else(|| protocol("an OK without the vclock it must carry"))
}

/// An error row as `Refused`: its code and message (IPROTO_ERROR_24).
fn refusal(row: &Row<'_>) -> UpstreamError {
    let code = row.header.kind & !codes::TYPE_ERROR;
    let mut message = String::new();
    if let Some(body) = row.body {
        let mut r = Reader::new(body);
        if let Ok(n) = r.read_map_len() {
            for _ in 0..n {
                let Ok(key) = r.read_uint() else { break };
                if key == codes::KEY_ERROR_24 as u64 {
                    if let Ok(text) = r.read_str() {
                        message = String::from_utf8_lossy(text).into_owned();
                    }
                    break;
                }
                if r.skip_value(sluice_proto::iproto::MAX_DEPTH).is_err() {
                    break;
                }
            }
        }
    }
    UpstreamError::Refused { code, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::iproto::xrow::RowHeader;

    fn row(replica_id: u32, lsn: u64) -> Row<'static> {
        Row {
            header: RowHeader {
                replica_id: Some(replica_id),
                lsn: Some(lsn),
                ..RowHeader::default()
            },
            body: None,
        }
    }

    #[test]
    fn rows_must_come_after_the_vclock_from_a_possible_replica_id() {
        let vclock = Vclock::from([(1, 10)]);
        assert!(in_order(&vclock, &row(1, 11)).is_ok());
        assert!(in_order(&vclock, &row(2, 1)).is_ok());
        for (id, lsn) in [(1, 10), (1, 3), (32, 1), (u32::MAX, 1)] {
            let e = in_order(&vclock, &row(id, lsn)).unwrap_err();
            assert!(matches!(e, UpstreamError::Protocol(_)), "{e}");
        }
    }
}
