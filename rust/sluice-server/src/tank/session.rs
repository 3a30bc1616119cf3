//! One TANK connection: a Ping on accept (as TANK's broker sends), then each request answered
//! in turn. A produce is answered once the WAL holds its bundles; a consume whose partitions
//! are all at their tail waits, up to its max wait, until min bytes (at least one bundle) are
//! there to send. A frame that does not decode closes the connection with a log line.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use sluice_core::engine::TopicRead;
use sluice_core::topic::Topic;
use sluice_core::Error;
use sluice_proto::tank::request::{Consume, CreateTopic, Produce, Request};
use sluice_proto::tank::response::{
    create_error, produce_error, ConsumeAnswer, CreateTopicAck, PartitionAnswer, PartitionsAnswer,
    PartitionsInfo, ProduceAck, StatusInfo, TopicAnswer, TopicsInfo,
};
use sluice_proto::tank::{self, Frame, PING_FRAME};
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use super::TankContext;
use crate::tls::MaybeTls;

/// Answers are sent once this many bytes wait.
const FLUSH_AT: usize = 256 << 10;
/// A produce entry refused for a reason of this node's (the WAL failing, a full queue).
const SYSTEM_ERROR: u8 = 0x03;
/// How often a waiting consume looks at topics other than the first it names.
const POLL: Duration = Duration::from_millis(100);
/// The version a Status answer reports: the broker whose bytes the protocol was checked against.
const TANK_VERSION: u32 = 400;

pub(super) async fn run(
    mut socket: MaybeTls,
    peer: SocketAddr,
    ctx: Arc<TankContext>,
    mut stop: watch::Receiver<bool>,
) {
    if crate::tls::send_all(&mut socket, &PING_FRAME)
        .await
        .is_err()
    {
        return;
    }
    ctx.io.bytes_out.fetch_add(PING_FRAME.len() as u64, Relaxed);
    let mut inbuf = BytesMut::with_capacity(16 << 10);
    let mut out = Vec::new();
    let mut owed_lsn = 0;
    loop {
        loop {
            let (id, payload) = match tank::check(&inbuf, ctx.max_frame) {
                Ok(Frame::Complete { id, payload }) => (id, payload),
                Ok(Frame::Incomplete(_)) => break,
                Err(e) => {
                    ctx.io.protocol_error(
                        "tank",
                        format_args!("closing TANK connection from {peer}: {e}"),
                    );
                    let _ = send(&mut socket, &mut out, owed_lsn, &ctx).await;
                    return;
                }
            };
            let frame = inbuf.split_to(payload.1);
            let req = match Request::decode(id, &frame[payload.0..]) {
                Ok(r) => r,
                Err(e) => {
                    ctx.io.protocol_error(
                        "tank",
                        format_args!("closing TANK connection from {peer}: message {id:#04x}: {e}"),
                    );
                    let _ = send(&mut socket, &mut out, owed_lsn, &ctx).await;
                    return;
                }
            };
            match req {
                Request::Ping => {}
                Request::Produce(p) => produce(&ctx, &p, &mut out, &mut owed_lsn),
                Request::Consume(c) => {
                    // What is answered already goes first: a consume may wait.
                    if send(&mut socket, &mut out, owed_lsn, &ctx).await.is_err() {
                        return;
                    }
                    consume(&ctx, &c, &mut out, &mut stop).await;
                }
                Request::CreateTopic(c) => create_topic(&ctx, &c, &mut out),
                Request::DiscoverPartitions { request_id, topic } => {
                    discover_partitions(&ctx, request_id, topic, &mut out)
                }
                Request::DiscoverTopics { request_id, .. } => {
                    let topics = ctx.engine.topics();
                    TopicsInfo {
                        request_id,
                        cluster_aware: false,
                        topics: topics
                            .iter()
                            .map(|t| (t.name.as_bytes(), true, t.num_partitions()))
                            .collect(),
                    }
                    .write(&mut out)
                }
                Request::Status { request_id } => status(&ctx, request_id, &mut out),
            }
            if out.len() >= FLUSH_AT && send(&mut socket, &mut out, owed_lsn, &ctx).await.is_err() {
                return;
            }
        }
        if send(&mut socket, &mut out, owed_lsn, &ctx).await.is_err() || *stop.borrow() {
            return;
        }
        let idle = ctx.idle_timeout;
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
                Ok(Ok(n)) => { ctx.io.bytes_in.fetch_add(n as u64, Relaxed); }
                Ok(Err(e)) => {
                    log::debug!("TANK connection from {peer}: {e}");
                    return;
                }
                Err(_) => {
                    log::info!("closing TANK connection from {peer}: idle for {idle:?}");
                    return;
                }
            },
            _ = stop.changed() => return,
        }
    }
}

/// Sends what is answered, once the WAL holds every bundle a produce answer acknowledges.
async fn send(
    socket: &mut MaybeTls,
    out: &mut Vec<u8>,
    owed_lsn: u64,
    ctx: &TankContext,
) -> std::io::Result<()> {
    crate::kv::send_acknowledged(socket, out, &ctx.engine, owed_lsn, &ctx.io, FLUSH_AT).await
}

fn topic_named(ctx: &TankContext, name: &[u8]) -> Option<Arc<Topic>> {
    std::str::from_utf8(name)
        .ok()
        .and_then(|n| ctx.engine.topic(n))
}

/// One error byte per partition entry; an unknown topic gets one 0xff for all of its entries,
/// as TANK's broker answers.
fn produce(ctx: &TankContext, p: &Produce<'_>, out: &mut Vec<u8>, owed_lsn: &mut u64) {
    let mut errors = Vec::with_capacity(p.entries());
    for t in &p.topics {
        let Some(topic) = topic_named(ctx, t.name) else {
            errors.push(produce_error::UNKNOWN_TOPIC);
            continue;
        };
        for part in &t.partitions {
            if part.base_seq.is_some() {
                // Bundles placed at a sequence number of the producer's (mirroring) are not
                // stored yet.
                log::debug!(
                    "ProduceWithSeqnum to {:?} refused: not supported",
                    topic.name
                );
                errors.push(produce_error::INVALID_REQUEST);
                continue;
            }
            errors.push(
                match ctx.engine.produce(&topic, part.partition, part.bundle) {
                    Ok(w) => {
                        *owed_lsn = (*owed_lsn).max(w.lsn());
                        let (first, last) = w.value;
                        ctx.stats
                            .produced_messages
                            .fetch_add(last - first + 1, Relaxed);
                        ctx.stats.produced_bundles.fetch_add(1, Relaxed);
                        produce_error::OK
                    }
                    Err(Error::InvalidArgument(why)) => {
                        log::debug!("a TANK produce refused: {why}");
                        produce_error::INVALID_REQUEST
                    }
                    Err(e) => {
                        log::warn!("a TANK produce to {:?} failed: {e}", topic.name);
                        SYSTEM_ERROR
                    }
                },
            );
        }
    }
    ProduceAck {
        request_id: p.request_id,
        errors: &errors,
    }
    .write(out);
}

/// Reads every partition the consume names, from where `seqs` says (u64::MAX is fixed to the
/// tail at the first look). Returns the answer, its chunks, and whether any partition is at
/// its tail.
fn read_once<'a>(
    ctx: &TankContext,
    c: &Consume<'a>,
    topics: &[Option<Arc<Topic>>],
    seqs: &mut [Vec<u64>],
    chunks: &mut Vec<u8>,
) -> (ConsumeAnswer<'a>, bool) {
    chunks.clear();
    let mut at_tail = false;
    let mut answers = Vec::with_capacity(c.topics.len());
    for ((t, topic), seqs) in c.topics.iter().zip(topics).zip(seqs.iter_mut()) {
        let Some(topic) = topic else {
            answers.push(TopicAnswer {
                name: t.name,
                partitions: PartitionsAnswer::UnknownTopic {
                    requested: t.partitions.len() as u8,
                },
            });
            continue;
        };
        let mut parts = Vec::with_capacity(t.partitions.len());
        for (p, seq) in t.partitions.iter().zip(seqs.iter_mut()) {
            let before = chunks.len();
            let read = ctx
                .engine
                .read_topic(topic, p.partition, *seq, p.fetch_size, chunks);
            parts.push(match read {
                Err(_) => PartitionAnswer::UnknownPartition {
                    partition: p.partition,
                },
                Ok(TopicRead::Chunk {
                    base_seq,
                    high_water_mark,
                    ..
                }) => PartitionAnswer::Data {
                    partition: p.partition,
                    base_seq,
                    high_water_mark,
                    chunk_len: (chunks.len() - before) as u32,
                },
                Ok(TopicRead::Tail {
                    high_water_mark,
                    first_available,
                }) => {
                    at_tail = true;
                    if *seq == u64::MAX {
                        *seq = high_water_mark + 1;
                    }
                    PartitionAnswer::Data {
                        partition: p.partition,
                        base_seq: first_available,
                        high_water_mark,
                        chunk_len: 0,
                    }
                }
                Ok(TopicRead::OutOfRange {
                    high_water_mark,
                    first_available,
                }) => PartitionAnswer::BoundaryCheck {
                    partition: p.partition,
                    high_water_mark,
                    first_available,
                },
            });
        }
        answers.push(TopicAnswer {
            name: t.name,
            partitions: PartitionsAnswer::Known(parts),
        });
    }
    (
        ConsumeAnswer {
            request_id: c.request_id,
            topics: answers,
        },
        at_tail,
    )
}

/// Answers a consume: at once when any partition has data or none is at its tail, else once
/// min bytes (at least one bundle) arrive or the max wait passes.
async fn consume(
    ctx: &TankContext,
    c: &Consume<'_>,
    out: &mut Vec<u8>,
    stop: &mut watch::Receiver<bool>,
) {
    let topics: Vec<Option<Arc<Topic>>> =
        c.topics.iter().map(|t| topic_named(ctx, t.name)).collect();
    let mut seqs: Vec<Vec<u64>> = c
        .topics
        .iter()
        .map(|t| t.partitions.iter().map(|p| p.seq).collect())
        .collect();
    let deadline = Instant::now().checked_add(Duration::from_millis(c.max_wait_ms));
    let wanted = (c.min_bytes as usize).max(1);
    let mut chunks = Vec::new();
    let mut waiting = false;
    loop {
        let generation = topics
            .iter()
            .flatten()
            .next()
            .map(|t| (t.clone(), t.changes.generation()));
        let (answer, at_tail) = read_once(ctx, c, &topics, &mut seqs, &mut chunks);
        let now = Instant::now();
        let expired = deadline.is_some_and(|d| now >= d) || c.max_wait_ms == 0;
        if !at_tail || chunks.len() >= wanted || expired || *stop.borrow() {
            if waiting {
                ctx.stats.long_polls.fetch_sub(1, Relaxed);
            }
            ctx.stats.consumes.fetch_add(1, Relaxed);
            ctx.stats
                .consumed_bytes
                .fetch_add(chunks.len() as u64, Relaxed);
            answer.write_headers(out);
            out.extend_from_slice(&chunks);
            return;
        }
        if !waiting {
            waiting = true;
            ctx.stats.long_polls.fetch_add(1, Relaxed);
        }
        let left = deadline
            .map_or(POLL, |d| d.saturating_duration_since(now))
            .min(POLL);
        match generation {
            Some((topic, g)) => {
                tokio::select! {
                    _ = topic.changes.changed(g) => {}
                    _ = tokio::time::sleep(left) => {}
                    _ = stop.changed() => {}
                }
            }
            None => tokio::time::sleep(left).await,
        }
    }
}

fn create_topic(ctx: &TankContext, c: &CreateTopic<'_>, out: &mut Vec<u8>) {
    let error = match (std::str::from_utf8(c.topic), std::str::from_utf8(c.config)) {
        (Ok(name), Ok(config)) if !name.is_empty() && c.partitions > 0 => {
            match ctx.engine.create_topic(name, c.partitions, config) {
                Ok(_) => create_error::OK,
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

fn discover_partitions(ctx: &TankContext, request_id: u32, name: &[u8], out: &mut Vec<u8>) {
    let partitions = topic_named(ctx, name)
        .map(|t| {
            (0..t.num_partitions())
                .map(|p| {
                    let part = t.lock_partition(p).expect("in range");
                    (part.log.first_available(), part.log.high_water_mark())
                })
                .collect()
        })
        .unwrap_or_default();
    PartitionsInfo {
        request_id,
        topic: name,
        partitions,
    }
    .write(out);
}

fn status(ctx: &TankContext, request_id: u32, out: &mut Vec<u8>) {
    let topics = ctx.engine.topics();
    let partitions: u32 = topics.iter().map(|t| t.num_partitions() as u32).sum();
    StatusInfo {
        request_id,
        global_flags: 0,
        cluster_aware: false,
        topics: topics.len() as u32,
        partitions,
        open_partitions: partitions,
        open_partitions_time: 0,
        startup_ts: ctx.started_unix,
        version: TANK_VERSION,
    }
    .write(out);
}
