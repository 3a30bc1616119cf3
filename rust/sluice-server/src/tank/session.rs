//! One TANK connection: a Ping on accept (as TANK's broker sends), then each request answered
//! in turn. A produce is answered once the WAL holds its bundles; a consume whose partitions
//! are all at their tail waits, up to its max wait, until min bytes (at least one bundle) are
//! there to send. A frame that does not decode closes the connection with a log line.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_core::engine::TopicRead;
use sluice_core::partition_log::SharedChunk;
use sluice_core::topic::Topic;
use sluice_core::Error;
use sluice_proto::tank::request::{Consume, CreateTopic, Produce, Request};
use sluice_proto::tank::response::{
    create_error, first_bundle_is_sparse, produce_error, redirect, ConsumeAnswer, CreateTopicAck,
    Endpoint, PartitionAnswer, PartitionInfo, PartitionsAnswer, PartitionsInfo, ProduceAck,
    StatusInfo, TopicAnswer, TopicsInfo, TopologyInfo, TopologyNode,
};
use sluice_proto::tank::{self, Frame, PING_FRAME};

use super::TankContext;
use crate::auth;
use crate::driver::{Check, End, Fault, Flow, Frame as DriverFrame, Out, Outbox};
use crate::request::{self, Principal};
use crate::topic_placement::Lead;

/// Answers are sent once this many bytes wait.
const FLUSH_AT: usize = 256 << 10;
/// Reads whose requests may share one WAL wait before the answers go out.
const MAX_COALESCED_READS: usize = 16;
/// The least room a read is given.
const READ_AT_LEAST: usize = 64 << 10;
/// The most room a read is given for a frame whose length is not known yet (see `last_frame`).
const READ_AT_MOST: usize = 1 << 20;
/// How often a waiting consume looks at topics other than the first it names.
const POLL: Duration = Duration::from_millis(100);
/// Consumes one connection may keep waiting; one more is answered at once (empty at a tail),
/// so a peer cannot grow a connection's memory by asking without end.
const MAX_WAITING: usize = 256;
/// The version a Status answer reports: the broker whose bytes the protocol was checked against.
const TANK_VERSION: u32 = 400;

/// One TANK connection's state.
pub(super) struct Session {
    ctx: Arc<TankContext>,
    /// The last WAL record a produce answered so far wrote.
    owed_lsn: u64,
    /// Consumes waiting at a tail, oldest first; the connection goes on reading meanwhile.
    parked: Vec<Parked>,
    /// The frame `check` found: its message id and payload range.
    next: (u8, (usize, usize)),
    /// The length of the last frame read: a producer sends bundles of much the same size, and
    /// room for a whole one lets one read take it, where a read into less room would take part
    /// of it that then moves when the buffer grows to the length its header gives.
    last_frame: usize,
    /// Whether an anonymous client is served here (no users, or `[users.guest]`).
    served: bool,
    peer: SocketAddr,
}

impl Session {
    pub(super) fn new(ctx: Arc<TankContext>, peer: SocketAddr) -> Session {
        let served = crate::request::guest_served(&ctx.port.users.current());
        Session {
            ctx,
            owed_lsn: 0,
            parked: Vec::new(),
            next: (0, (0, 0)),
            last_frame: 0,
            served,
            peer,
        }
    }
}

impl crate::driver::Session for Session {
    const FLUSH_AT: usize = FLUSH_AT;

    fn check(&mut self, buf: &[u8], max_frame: usize) -> Check {
        match tank::check(buf, max_frame) {
            Ok(Frame::Complete { id, payload }) => {
                self.next = (id, payload);
                Check::Frame(payload.1)
            }
            // Room for the whole frame (its length is within max_frame), so that reads fill
            // it in large steps.
            Ok(Frame::Incomplete(need)) => Check::Need(
                need.max(self.last_frame.min(READ_AT_MOST))
                    .max(READ_AT_LEAST),
            ),
            Err(e) => Check::Bad(Fault::new(
                matches!(e, tank::DecodeError::TooLarge { .. }),
                e,
            )),
        }
    }

    async fn handle(&mut self, frame: &mut DriverFrame<'_>, out: &mut Out) -> Flow {
        let ctx = &self.ctx;
        let (id, payload) = self.next;
        // Taken: a produced bundle goes to the WAL as a slice of it, not a copy.
        let frame = frame.take();
        self.last_frame = frame.len();
        let req = match Request::decode(id, &frame[payload.0..]) {
            Ok(r) => r,
            Err(e) => {
                ctx.port.io.protocol_error(
                    "tank",
                    format_args!(
                        "closing TANK connection from {}: message {id:#04x}: {e}",
                        self.peer
                    ),
                );
                return Flow::Close;
            }
        };
        let buf = &mut out.acked.buf;
        match req {
            Request::Ping => {}
            Request::Produce(p) => {
                let (mut errors, copies) = produce(ctx, self.peer, &frame, &p, &mut self.owed_lsn);
                if !copies.is_empty() {
                    wait_for_copies(&mut errors, &copies, p.ack_timeout).await;
                }
                ProduceAck {
                    request_id: p.request_id,
                    errors: &errors,
                }
                .write(buf);
            }
            Request::Consume(c) => {
                let mut p = Parked::new(ctx, self.peer, &c);
                let full = self.parked.len() >= MAX_WAITING;
                if !p.answer(&mut out.acked, Instant::now(), full) {
                    self.parked.push(p);
                }
            }
            Request::CreateTopic(c) => create_topic(ctx, self.peer, &c, buf, &mut self.owed_lsn),
            Request::DiscoverPartitions {
                request_id,
                topic,
                partitions,
            } => discover_partitions(ctx, self.peer, request_id, topic, partitions, buf),
            Request::DiscoverTopology { request_id, .. } => discover_topology(ctx, request_id, buf),
            Request::DiscoverTopics { request_id, .. } => {
                let topics = ctx.port.engine.topics();
                let users = ctx.port.users.current();
                // In a cluster, as a cluster-aware broker answers: each topic with its
                // replication factor (its first partition's copies in the map).
                TopicsInfo {
                    request_id,
                    cluster_aware: ctx.clustermap.topics.current().is_some(),
                    // Only those it may read.
                    topics: topics
                        .iter()
                        .filter(|t| {
                            let bits =
                                request::topic_permissions(&users, Principal::Guest, &t.name);
                            bits & auth::READ != 0
                        })
                        .map(|t| {
                            let copies = ctx.clustermap.topics.placed(&t.name, 0).copies;
                            (t.name.as_bytes(), true, t.num_partitions(), copies)
                        })
                        .collect(),
                }
                .write(buf)
            }
            Request::Status { request_id } => status(ctx, request_id, buf),
        }
        Flow::Continue
    }

    fn owed_lsn(&self) -> u64 {
        self.owed_lsn
    }

    /// TANK has no login: a connection is served at once where anonymous clients are.
    fn logged_in(&self) -> bool {
        self.served
    }

    /// A Ping on accept, as TANK's broker sends.
    fn greet(&mut self, out: &mut Out) {
        out.now.extend_from_slice(&PING_FRAME);
    }

    /// A connection with a consume waiting is quiet on purpose.
    fn waiting(&self) -> bool {
        !self.parked.is_empty()
    }

    fn coalesced_reads(&self) -> usize {
        MAX_COALESCED_READS
    }

    fn wakes(&self) -> bool {
        !self.parked.is_empty()
    }

    /// A produce to the first topic a waiting consume names, the WAL writing a bundle one
    /// found appended but not yet written, or a max wait passing.
    fn wake(&mut self) -> impl std::future::Future<Output = ()> + Send {
        let now = Instant::now();
        let next_look = self
            .parked
            .iter()
            .map(|p| {
                p.deadline
                    .map_or(POLL, |d| d.saturating_duration_since(now))
            })
            .min()
            .map(|d| d.min(POLL));
        let seen = self.parked.first().and_then(|p| p.seen.clone());
        let unwritten = self.parked.iter().filter_map(|p| p.unwritten_lsn).min();
        let engine = self.ctx.port.engine.clone();
        async move {
            let Some(d) = next_look else {
                return std::future::pending().await;
            };
            let produced = async {
                match &seen {
                    Some((topic, g)) => topic.changes.changed(*g).await,
                    None => std::future::pending().await,
                }
            };
            let written = async {
                match unwritten {
                    // A failing WAL answers at once: then only a produce or the time wakes.
                    Some(lsn) if engine.wal().written_unless_failing(lsn).await.is_ok() => {}
                    Some(_) => std::future::pending().await,
                    None => std::future::pending().await,
                }
            };
            let _ = tokio::time::timeout(d, async {
                tokio::select! {
                    _ = produced => {}
                    _ = written => {}
                }
            })
            .await;
        }
    }

    /// Answers the waiting consumes that can be: produces just handled may answer one
    /// (readers see a bundle once the WAL holds it: wait for that here, not after sending, so
    /// that the produce's answer and the consume's go out in one write, where a client tails
    /// and produces on one connection as tank-cli's p2c does); a max wait may have passed. At
    /// the server's stop, every one is answered with what there is.
    async fn settle(&mut self, out: &mut Out, end: Option<End>) -> Flow {
        if self.parked.is_empty() {
            return Flow::Continue;
        }
        if !out.is_empty() {
            // A failure is the send's to report.
            let wal = self.ctx.port.engine.wal();
            let _ = wal.written_unless_failing(self.owed_lsn).await;
        }
        let now = Instant::now();
        let force = end == Some(End::Stop);
        self.parked
            .retain_mut(|p| !p.answer(&mut out.acked, now, force));
        Flow::Continue
    }
}

fn topic_named(ctx: &TankContext, name: &[u8]) -> Option<Arc<Topic>> {
    std::str::from_utf8(name)
        .ok()
        .and_then(|n| ctx.port.engine.topic(n))
}

/// Whether a TANK connection may do what needs `need` (`auth::READ`, `WRITE` or `ADMIN`) on
/// the topic `name`. TANK has no login: its connections have `[users.guest]`'s grants (every
/// one on a node with no users). A refusal is counted and logged, naming what was refused.
fn may(ctx: &TankContext, peer: SocketAddr, name: &[u8], need: u8, what: &str) -> bool {
    let name = String::from_utf8_lossy(name);
    let users = ctx.port.users.current();
    if request::topic_permissions(&users, Principal::Guest, &name) & need == need {
        return true;
    }
    ctx.stats.refused.fetch_add(1, Relaxed);
    let permission = match need {
        auth::READ => "read",
        auth::WRITE => "write",
        _ => "admin",
    };
    ctx.port.io.warn_limited(
        "TANK access",
        format_args!(
            "TANK connection from {peer}: {what} {name:?} refused: TANK clients have the grants \
             of [users.guest], and it has no {permission} permission on the topic \
             ([users.guest] topics)"
        ),
    );
    false
}

/// A bundle stored here whose answer waits until `peers` copies of its partition hold it
/// (a produce's `required acks`, in a cluster).
struct AwaitedCopies {
    /// Its error byte in the answer.
    at: usize,
    topic: Arc<Topic>,
    partition: u16,
    last_seq: u64,
    peers: usize,
}

/// How long a produce waits for its copies when its `ack timeout` is 0, as TANK's broker.
const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_millis(8000);

/// Waits, up to the produce's `ack timeout` (ms), for the copies each bundle needs; a bundle
/// whose copies did not all come gets 0x03 (it stays stored here, as on TANK's broker). A copy
/// whose stream is down is waited for too: it may connect again in time.
async fn wait_for_copies(errors: &mut [u8], copies: &[AwaitedCopies], ack_timeout_ms: u32) {
    let timeout = match ack_timeout_ms {
        0 => DEFAULT_ACK_TIMEOUT,
        ms => Duration::from_millis(ms as u64),
    };
    let deadline = tokio::time::Instant::now() + timeout;
    for c in copies {
        let held = async {
            loop {
                match c
                    .topic
                    .acks
                    .acked(c.partition, c.last_seq, false, c.peers)
                    .await
                {
                    Ok(()) => return,
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        };
        if tokio::time::timeout_at(deadline, held).await.is_err() {
            errors[c.at] = produce_error::ACKS_TIMED_OUT;
        }
    }
}

/// One error byte per partition entry; an unknown topic gets one 0xff for all of its entries,
/// and a topic this node copies from its active, or that the client may not write, one 0xfe
/// (read-only), as TANK's broker answers in read-only mode. Returns the error bytes and the
/// bundles whose answer waits for copies (`wait_for_copies`).
/// `frame`: the request's bytes, which the bundles of `p` are slices of.
fn produce(
    ctx: &TankContext,
    peer: SocketAddr,
    frame: &bytes::Bytes,
    p: &Produce<'_>,
    owed_lsn: &mut u64,
) -> (Vec<u8>, Vec<AwaitedCopies>) {
    let mut errors = Vec::with_capacity(p.entries());
    let mut copies = Vec::new();
    // A broker on its own takes no acks into account, as TANK's.
    let clustered = ctx.clustermap.topics.current().is_some();
    for t in &p.topics {
        // Refused as a topic read-only for this client: once per topic, as a replica's copy.
        if !may(ctx, peer, t.name, auth::WRITE, "a produce to") {
            errors.push(produce_error::READ_ONLY);
            continue;
        }
        let Some(topic) = topic_named(ctx, t.name) else {
            errors.push(produce_error::UNKNOWN_TOPIC);
            continue;
        };
        if topic.is_followed() {
            // A replica's copy: what is produced goes to the active.
            log::debug!(
                "a TANK produce to {:?} refused: a replica's copy",
                topic.name
            );
            errors.push(produce_error::READ_ONLY);
            continue;
        }
        for part in &t.partitions {
            if part.partition >= topic.num_partitions() {
                errors.push(produce_error::UNKNOWN_PARTITION);
                continue;
            }
            let placed = ctx.clustermap.topics.placed(&topic.name, part.partition);
            // A partition no node leads (its leader failed over, or the map places it nowhere
            // yet) answers so whatever the acks asked: a client tries it again later, where
            // "insufficient replicas" would end its produce.
            if placed.lead == Lead::Nobody {
                errors.push(redirect::NO_LEADER);
                continue;
            }
            // Checked before the redirect to a leader, as TANK's broker does.
            let peers = match placed.peers_needed(p.required_acks) {
                Some(n) => n,
                None if !clustered => 0,
                None => {
                    errors.push(produce_error::INSUFFICIENT_REPLICAS);
                    continue;
                }
            };
            if let Lead::At(leader) = placed.lead {
                errors.push(redirect::OTHER_LEADER);
                Endpoint::from(leader).write(&mut errors);
                continue;
            }
            errors.push(
                match ctx.port.engine.produce(
                    &topic,
                    part.partition,
                    part.base_seq,
                    frame.slice_ref(part.bundle),
                ) {
                    Ok(w) => {
                        *owed_lsn = (*owed_lsn).max(w.lsn());
                        let (first, last) = w.value;
                        ctx.stats
                            .produced_messages
                            .fetch_add(last - first + 1, Relaxed);
                        ctx.stats.produced_bundles.fetch_add(1, Relaxed);
                        if peers > 0 {
                            copies.push(AwaitedCopies {
                                at: errors.len(),
                                topic: topic.clone(),
                                partition: part.partition,
                                last_seq: last,
                                peers,
                            });
                        }
                        produce_error::OK
                    }
                    Err(Error::InvalidArgument(why)) => {
                        log::debug!("a TANK produce refused: {why}");
                        produce_error::INVALID
                    }
                    // A full disk, say: answered at once (TANK's error byte carries no text),
                    // the cause in the log.
                    Err(e) => {
                        ctx.port.io.warn_limited(
                            "TANK produce",
                            format_args!(
                                "a TANK produce to {:?} from {peer} failed: {e}",
                                topic.name
                            ),
                        );
                        produce_error::IO_FAULT
                    }
                },
            );
        }
    }
    (errors, copies)
}

/// A consume waiting for data: what it asks, owned, so the connection goes on reading (a
/// client may produce on the connection it tails on, as tank-cli's p2c does).
struct Parked {
    ctx: Arc<TankContext>,
    request_id: u32,
    /// Bytes of bundles that answer it at once (at least one bundle).
    wanted: usize,
    /// None: it waits as long as the connection lives.
    deadline: Option<Instant>,
    topics: Vec<Asked>,
    /// Counted in `long_polls`.
    counted: bool,
    /// The first named topic's signal and its generation before the last look.
    seen: Option<(Arc<Topic>, u64)>,
    /// A bundle the last look found appended but not yet in the WAL file: its LSN.
    unwritten_lsn: Option<u64>,
}

/// One topic a waiting consume asks for: its name, the topic if it exists, and per partition
/// (id, next sequence number, fetch size).
struct Asked {
    name: Vec<u8>,
    topic: Option<Arc<Topic>>,
    partitions: Vec<(u16, u64, u32)>,
}

impl Parked {
    /// A topic the client may not read is answered as unknown.
    fn new(ctx: &Arc<TankContext>, peer: SocketAddr, c: &Consume<'_>) -> Parked {
        Parked {
            ctx: ctx.clone(),
            request_id: c.request_id,
            // No more than the fetch sizes let one answer hold.
            wanted: (c.min_bytes as usize)
                .min(
                    c.topics
                        .iter()
                        .flat_map(|t| &t.partitions)
                        .map(|p| p.fetch_size as usize)
                        .sum(),
                )
                .max(1),
            deadline: Instant::now().checked_add(Duration::from_millis(c.max_wait_ms)),
            topics: c
                .topics
                .iter()
                .map(|t| Asked {
                    name: t.name.to_vec(),
                    topic: may(ctx, peer, t.name, auth::READ, "a consume of")
                        .then(|| topic_named(ctx, t.name))
                        .flatten(),
                    partitions: t
                        .partitions
                        .iter()
                        .map(|p| (p.partition, p.seq, p.fetch_size))
                        .collect(),
                })
                .collect(),
            counted: false,
            seen: None,
            unwritten_lsn: None,
        }
    }

    /// Reads every partition it names, from where it stands (u64::MAX is fixed to the tail at
    /// the first look). Answers into `out` and returns true when no partition is at its tail
    /// at the first look (what is there answers at once, as TANK's broker does), when its min
    /// bytes (one at least) are there, or when `now` is past its deadline or `force` is set;
    /// otherwise nothing is written and it waits.
    fn answer(&mut self, out: &mut Outbox, now: Instant, force: bool) -> bool {
        // The generation before the look: a produce after it wakes the wait.
        self.seen = self.topics.iter().find_map(|a| a.topic.clone()).map(|t| {
            let g = t.changes.generation();
            (t, g)
        });
        let ctx = self.ctx.clone();
        self.unwritten_lsn = None;
        // Each partition read puts one shared chunk here.
        let mut chunks: Vec<SharedChunk> = Vec::new();
        let mut chunk_bytes = 0;
        let mut at_tail = false;
        let mut redirected = false;
        let mut answers = Vec::with_capacity(self.topics.len());
        for Asked {
            name,
            topic,
            partitions: parts,
        } in &mut self.topics
        {
            let Some(topic) = topic else {
                answers.push(TopicAnswer {
                    name,
                    partitions: PartitionsAnswer::UnknownTopic {
                        requested: parts.len() as u8,
                    },
                });
                continue;
            };
            let mut known = Vec::with_capacity(parts.len());
            for (partition, seq, fetch_size) in parts.iter_mut() {
                // A partition led elsewhere is answered at once with its leader, as TANK's
                // clustered broker does; the client asks there.
                match ctx.clustermap.topics.lead(&topic.name, *partition) {
                    Lead::Here => {}
                    Lead::At(leader) => {
                        redirected = true;
                        known.push(PartitionAnswer::OtherLeader {
                            partition: *partition,
                            leader: leader.into(),
                        });
                        continue;
                    }
                    Lead::Nobody => {
                        redirected = true;
                        known.push(PartitionAnswer::NoLeader {
                            partition: *partition,
                        });
                        continue;
                    }
                }
                let before = chunks.len();
                let read =
                    ctx.port
                        .engine
                        .read_topic(topic, *partition, *seq, *fetch_size, &mut chunks);
                known.push(match read {
                    Err(_) => PartitionAnswer::UnknownPartition {
                        partition: *partition,
                    },
                    // A chunk that starts with a sparse bundle leaves its numbering to that
                    // bundle's header, as TANK's broker answers.
                    Ok(TopicRead::Chunk {
                        high_water_mark,
                        len,
                        ..
                    }) if chunks[before..]
                        .first()
                        .is_some_and(|c| first_bundle_is_sparse(&c.bytes)) =>
                    {
                        chunk_bytes += len;
                        PartitionAnswer::SparseData {
                            partition: *partition,
                            high_water_mark,
                            chunk_len: len as u32,
                        }
                    }
                    Ok(TopicRead::Chunk {
                        base_seq,
                        high_water_mark,
                        len,
                    }) => {
                        chunk_bytes += len;
                        PartitionAnswer::Data {
                            partition: *partition,
                            base_seq,
                            high_water_mark,
                            chunk_len: len as u32,
                        }
                    }
                    Ok(TopicRead::Tail {
                        high_water_mark,
                        first_available,
                        unwritten_lsn,
                    }) => {
                        at_tail = true;
                        if let Some(lsn) = unwritten_lsn {
                            self.unwritten_lsn =
                                Some(self.unwritten_lsn.map_or(lsn, |l| l.min(lsn)));
                        }
                        if *seq == u64::MAX {
                            *seq = high_water_mark + 1;
                        }
                        PartitionAnswer::Data {
                            partition: *partition,
                            base_seq: first_available,
                            high_water_mark,
                            chunk_len: 0,
                        }
                    }
                    Ok(TopicRead::OutOfRange {
                        high_water_mark,
                        first_available,
                    }) => PartitionAnswer::BoundaryCheck {
                        partition: *partition,
                        high_water_mark,
                        first_available,
                    },
                });
            }
            answers.push(TopicAnswer {
                name,
                partitions: PartitionsAnswer::Known(known),
            });
        }
        let expired = self.deadline.is_some_and(|d| now >= d);
        // Once waiting, a consume waits for its min bytes, not for the first bundle to come
        // (TANK's broker counts what is appended for a waiting consume the same way).
        if (at_tail || self.counted)
            && chunk_bytes < self.wanted
            && !expired
            && !force
            && !redirected
        {
            self.count_wait(true);
            return false;
        }
        ctx.stats.consumes.fetch_add(1, Relaxed);
        ctx.stats
            .consumed_bytes
            .fetch_add(chunk_bytes as u64, Relaxed);
        ConsumeAnswer {
            request_id: self.request_id,
            topics: answers,
        }
        .write_headers(&mut out.buf);
        for c in chunks {
            out.shared(c);
        }
        self.count_wait(false);
        true
    }
}

impl Parked {
    /// Counts it in the long-polls of the front and of every topic it names, or no more.
    fn count_wait(&mut self, waiting: bool) {
        if self.counted == waiting {
            return;
        }
        self.counted = waiting;
        let gauges = std::iter::once(&self.ctx.stats.long_polls).chain(
            self.topics
                .iter()
                .filter_map(|a| Some(&a.topic.as_ref()?.long_polls)),
        );
        for g in gauges {
            if waiting {
                g.fetch_add(1, Relaxed);
            } else {
                g.fetch_sub(1, Relaxed);
            }
        }
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        // The connection closed with this consume waiting.
        self.count_wait(false);
    }
}

/// Answered, as a produce is, once the WAL holds the topic's declaration.
/// Creating a topic needs the admin permission on it: refused, it is answered as a read-only
/// broker's.
fn create_topic(
    ctx: &TankContext,
    peer: SocketAddr,
    c: &CreateTopic<'_>,
    out: &mut Vec<u8>,
    owed_lsn: &mut u64,
) {
    let error = match (std::str::from_utf8(c.topic), std::str::from_utf8(c.config)) {
        _ if !may(ctx, peer, c.topic, auth::ADMIN, "CreateTopic") => create_error::READ_ONLY,
        (Ok(name), Ok(config)) if !name.is_empty() && c.partitions > 0 => {
            match ctx.port.engine.write_topic(name, c.partitions, config) {
                Ok(w) => {
                    *owed_lsn = (*owed_lsn).max(w.lsn());
                    create_error::OK
                }
                Err(Error::Exists) => create_error::EXISTS,
                Err(Error::InvalidArgument(why)) => {
                    log::info!("CreateTopic {name:?} refused: {why}");
                    create_error::BAD_CONFIG
                }
                Err(e) => {
                    log::warn!("CreateTopic {name:?} failed: {e}");
                    create_error::SYSTEM
                }
            }
        }
        (Ok(_), Err(_)) => create_error::BAD_CONFIG,
        _ => create_error::INVALID,
    };
    CreateTopicAck {
        request_id: c.request_id,
        topic: c.topic,
        error,
    }
    .write(out);
}

/// Every partition of a topic (or those `asked` names, u16 LE ids) with its first and last
/// sequence numbers; one led by another node names it, as TANK's clustered broker answers.
/// An unknown topic, or one the client may not read, has no partitions.
fn discover_partitions(
    ctx: &TankContext,
    peer: SocketAddr,
    request_id: u32,
    name: &[u8],
    asked: &[u8],
    out: &mut Vec<u8>,
) {
    let info = |t: &Topic, p: u16| match ctx.clustermap.topics.lead(&t.name, p) {
        Lead::At(leader) => PartitionInfo::OtherLeader(leader.into()),
        Lead::Nobody => PartitionInfo::NoLeader,
        Lead::Here => {
            let part = t.lock_partition(p).expect("in range");
            let (first, hwm) = (part.log.first_available(), part.log.high_water_mark());
            // A partition that holds nothing: TANK's broker answers 0 and 0.
            PartitionInfo::Range {
                first: if first > hwm { 0 } else { first },
                high_water_mark: hwm,
            }
        }
    };
    let partitions = may(ctx, peer, name, auth::READ, "DiscoverPartitions of")
        .then(|| topic_named(ctx, name))
        .flatten()
        .map(|t| {
            if asked.is_empty() {
                (0..t.num_partitions()).map(|p| info(&t, p)).collect()
            } else {
                asked
                    .chunks_exact(2)
                    .map(|id| u16::from_le_bytes([id[0], id[1]]))
                    .filter(|&p| p < t.num_partitions())
                    .map(|p| info(&t, p))
                    .collect()
            }
        })
        .unwrap_or_default();
    PartitionsInfo {
        request_id,
        topic: name,
        partitions,
    }
    .write(out);
}

/// The cluster's nodes as the map names them, or a broker on its own.
fn discover_topology(ctx: &TankContext, request_id: u32, out: &mut Vec<u8>) {
    let placement = ctx.clustermap.topics.current();
    TopologyInfo {
        request_id,
        cluster: placement.as_ref().map(|p| {
            (
                p.cluster.as_bytes(),
                p.nodes
                    .iter()
                    .map(|n| TopologyNode {
                        id: n.id,
                        available: n.available,
                        endpoint: n.tank.map(Endpoint::from),
                        partitions: n.partitions,
                    })
                    .collect(),
            )
        }),
    }
    .write(out);
}

fn status(ctx: &TankContext, request_id: u32, out: &mut Vec<u8>) {
    let topics = ctx.port.engine.topics();
    let partitions: u32 = topics.iter().map(|t| t.num_partitions() as u32).sum();
    // A cluster-aware broker names its cluster and how many of its nodes are available.
    let cluster = ctx.clustermap.topics.current().map(|p| {
        let available = p.nodes.iter().filter(|n| n.available).count() as u32;
        (p.cluster.as_bytes().to_vec(), available)
    });
    StatusInfo {
        request_id,
        global_flags: 0,
        cluster,
        topics: topics.len() as u32,
        partitions,
        open_partitions: partitions,
        open_partitions_time: 0,
        startup_ts: ctx.started_unix,
        version: TANK_VERSION,
    }
    .write(out);
}
