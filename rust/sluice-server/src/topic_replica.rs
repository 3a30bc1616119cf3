//! A replica's copy of its active's topics. Every topic the active has (`STAT topics` on a DCP
//! connection) is declared here with the same partitions and settings and marked followed
//! (TANK producers are told this broker is read-only), and its partitions are streamed over
//! DCP (`dcp::topic_stream` on the active): each run of consecutive messages becomes a bundle
//! placed at its first sequence number (`Engine::produce` with a first sequence number), so
//! consumers here read the same messages by the same numbers. New topics on the active are
//! picked up within a second.
//!
//! In a cluster, a node copies only the partitions the map makes it a replica of, each from
//! its leader (`PartitionCopies`), and acknowledges what it placed (SEQNO_ACKNOWLEDGED), which
//! the leader counts for produces that ask for acks.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sluice_core::failover::FailoverEntry;
use sluice_core::topic::Topic;
use sluice_core::Engine;
use sluice_proto::mcbp::status;
use sluice_proto::tank::bundle::{self, codec, NewMessage};

use crate::dcp::consumer::{
    self, Batch, Consumer, ConsumerConfig, Event, Position, RollbackMode, SessionState, TopicInfo,
};
use crate::dcp::topic_stream::KEYED;
use crate::topic_placement::{Placement, Placements};

/// How often the active is asked for its topics.
const DISCOVER_EVERY: Duration = Duration::from_secs(1);
/// The most messages one placed bundle holds.
const MAX_BUNDLE: usize = 1024;

/// Follows the active's topics on a thread of its own, and each topic on one more.
pub struct TopicFollower {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// The active a follower copies from, and how it logs in there.
#[derive(Clone)]
pub struct Upstream {
    /// The active's memcached address.
    pub active: String,
    /// The bucket the DCP logins select (the stream permission on it covers topics).
    pub bucket: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub tls: Option<crate::tls::ClientTls>,
    pub noop_interval: u32,
}

impl Upstream {
    fn consumer_config(&self, name: String) -> ConsumerConfig {
        ConsumerConfig {
            address: self.active.clone(),
            bucket: self.bucket.clone(),
            username: self.username.clone(),
            password: self.password.clone(),
            tls: self.tls.clone(),
            name,
            ..ConsumerConfig::default()
        }
    }
}

impl TopicFollower {
    pub fn start(engine: Arc<Engine>, upstream: Upstream) -> TopicFollower {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("sluice-topic-replica".into())
                .spawn(move || discover(engine, upstream, stop))
                .expect("spawn a thread")
        };
        TopicFollower {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops following; returns once nothing more is placed.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TopicFollower {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sleeps `d` or until stopped.
fn pause(d: Duration, stop: &AtomicBool) {
    let until = Instant::now() + d;
    while Instant::now() < until && !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn discover(engine: Arc<Engine>, upstream: Upstream, stop: Arc<AtomicBool>) {
    let node = engine.instance().to_string();
    let mut copies: HashMap<String, JoinHandle<()>> = HashMap::new();
    let mut refused: HashMap<String, String> = HashMap::new();
    // One connection, kept: the active is asked every second, and a connection opened and
    // closed for each question would fill its log.
    let mut probe = consumer::Probe::new(ConsumerConfig {
        setup_timeout: Some(Duration::from_secs(2)),
        noop_interval: 0,
        ..upstream.consumer_config(format!("replication-topics:{node}"))
    });
    while !stop.load(Ordering::Acquire) {
        match probe.topics() {
            Ok(topics) => {
                for t in topics {
                    if copies.contains_key(&t.name) {
                        continue;
                    }
                    match declare(&engine, &t) {
                        Ok(topic) => {
                            refused.remove(&t.name);
                            let (engine, upstream, stop) =
                                (engine.clone(), upstream.clone(), stop.clone());
                            let thread = std::thread::Builder::new()
                                .name(format!("sluice-topic-{}", t.name))
                                .spawn(move || {
                                    let every: Vec<u16> = (0..topic.num_partitions()).collect();
                                    copy(&engine, &topic, &every, &upstream, None, &stop)
                                })
                                .expect("spawn a thread");
                            copies.insert(t.name, thread);
                        }
                        // Said once per topic and reason, not every second.
                        Err(why) if refused.get(&t.name) != Some(&why) => {
                            log::error!("the active's topic {:?} is not copied: {why}", t.name);
                            refused.insert(t.name, why);
                        }
                        Err(_) => {}
                    }
                }
            }
            Err(e) => log::debug!(
                "asking {} for its topics: {e}; asking again",
                upstream.active
            ),
        }
        pause(DISCOVER_EVERY, &stop);
    }
    for (_, t) in copies {
        let _ = t.join();
    }
}

/// The topic here, as the active has it: created if missing, marked followed.
fn declare(engine: &Engine, t: &TopicInfo) -> Result<Arc<Topic>, String> {
    let topic = match engine.topic(&t.name) {
        Some(here) if here.num_partitions() != t.partitions => {
            return Err(format!(
                "it has {} partition(s) here and {} on the active",
                here.num_partitions(),
                t.partitions
            ))
        }
        Some(here) => here,
        None => {
            let created = engine
                .create_topic(&t.name, t.partitions, &t.settings)
                .map_err(|e| e.to_string())?;
            log::info!(
                "topic {:?} declared as the active has it, to copy it",
                t.name
            );
            created
        }
    };
    topic.set_followed(true);
    Ok(topic)
}

/// Copies `partitions` of `topic` from the upstream until stopped, connecting again after a
/// failure. `replica`: the name its acknowledgements count under on the upstream (a cluster
/// node copying partitions the upstream leads), or None to send none.
fn copy(
    engine: &Engine,
    topic: &Arc<Topic>,
    partitions: &[u16],
    upstream: &Upstream,
    replica: Option<&str>,
    stop: &AtomicBool,
) {
    let mut backoff = Duration::from_millis(50);
    while !stop.load(Ordering::Acquire) {
        let mut state = SessionState::default();
        for &p in partitions {
            let hwm = topic.high_water_mark(p);
            let history = topic.history(p).iter().map(|e| (e.uuid, e.seqno)).collect();
            state.vbuckets.insert(
                p,
                Position {
                    failover: history,
                    seqno: hwm,
                    snap_start: hwm,
                    snap_end: hwm,
                    disk: false,
                },
            );
        }
        let consumer = Consumer::start(ConsumerConfig {
            topic: Some(topic.name.clone()),
            vbuckets: Some(partitions.to_vec()),
            state,
            rollback: RollbackMode::Ask,
            batch_size: 4096,
            buffer_size: 32 << 20,
            noop_interval: upstream.noop_interval,
            replica_name: replica.map(str::to_string),
            // A copy in sync and one catching up may stream from one leader at once (each
            // its own partitions): their connections' names differ.
            ..upstream.consumer_config(format!(
                "replication:{}:topic:{}{}",
                engine.instance(),
                topic.name,
                if replica.is_some() { ":acked" } else { "" }
            ))
        });
        let why = follow(engine, topic, &consumer, replica.is_some(), stop);
        drop(consumer);
        let Some(why) = why else {
            return;
        };
        if stop.load(Ordering::Acquire) {
            return;
        }
        log::warn!(
            "copying topic {:?} from {}: {why}; again in {backoff:?}",
            topic.name,
            upstream.active
        );
        pause(backoff, stop);
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Places what the stream brings until stopped (None) or the connection fails (why).
/// `acknowledge`: tell the upstream, after each batch, how far each partition is held here.
fn follow(
    engine: &Engine,
    topic: &Topic,
    consumer: &Consumer,
    acknowledge: bool,
    stop: &AtomicBool,
) -> Option<String> {
    while !stop.load(Ordering::Acquire) {
        match consumer.next_event(Duration::from_millis(100)) {
            None => {}
            Some(Event::Batch(b)) => {
                if let Err(why) = place(engine, topic, &b) {
                    return Some(why);
                }
                // The upstream's history, as its stream answers gave it, is this copy's (unless
                // this copy was told to stop: its partitions may be led here now).
                if stop.load(Ordering::Acquire) {
                    return None;
                }
                for (p, pos) in &b.positions {
                    let history: Vec<FailoverEntry> = pos
                        .failover
                        .iter()
                        .map(|&(uuid, seqno)| FailoverEntry { uuid, seqno })
                        .collect();
                    if !history.is_empty() {
                        match engine.adopt_topic_history(topic, *p, &history) {
                            Ok(true) => {}
                            Ok(false) => {
                                return Some(format!(
                                    "partition {p} has a branch of history the upstream lacks"
                                ))
                            }
                            Err(e) => return Some(e.to_string()),
                        }
                    }
                }
                if acknowledge {
                    let mut held = BTreeMap::new();
                    for (&p, &seq) in b.vbucket.iter().zip(&b.seqno) {
                        held.insert(p, seq);
                    }
                    let acks: Vec<(u16, u64, u64)> =
                        held.into_iter().map(|(p, seq)| (p, seq, seq)).collect();
                    consumer.link().acknowledge(&acks);
                }
            }
            Some(Event::Rollback { .. }) if stop.load(Ordering::Acquire) => return None,
            Some(Event::Rollback { vbucket, seqno, .. }) => {
                // This copy holds messages the upstream does not: taken by a leader it
                // followed, or by itself as a leader, that no copy in sync got. They go, and
                // the copy follows again from where the two histories part.
                return Some(match engine.truncate_topic(topic, vbucket, seqno) {
                    Ok(hwm) => format!(
                        "partition {vbucket} parted from the upstream's history after {seqno}: \
                         cut back to {hwm}"
                    ),
                    Err(e) => e.to_string(),
                });
            }
            Some(Event::VbucketState { opaque, .. }) => {
                consumer.link().respond(
                    sluice_proto::dcp::opcode::SET_VBUCKET_STATE,
                    opaque,
                    status::EINVAL,
                );
            }
            Some(Event::Finished) => return Some("every stream ended".into()),
            Some(Event::Failed(e)) => return Some(e.to_string()),
        }
    }
    None
}

/// A cluster node's copies of the partitions it replicates: per topic and leader, one
/// connection streaming those partitions, started, changed and stopped as the map moves.
#[derive(Default)]
pub struct PartitionCopies {
    running: Mutex<HashMap<CopyKey, Copying>>,
    /// Copies told to stop, not waited for (one may be connecting to a leader that is gone
    /// for its whole timeout); joined once they finish, and all at `stop`.
    stopping: Mutex<Vec<JoinHandle<()>>>,
}

/// A copying connection: the topic, its leader's KV address, and whether its copies are in
/// sync (only those acknowledge: a copy still catching up must not count toward a produce's
/// acks, as a failover would not promote it).
pub type CopyKey = (String, String, bool);

struct Copying {
    partitions: Vec<u16>,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl PartitionCopies {
    /// Copies what `wanted` names, (topic, leader's KV address, in sync) to partitions, and
    /// nothing else. A copy whose leader or partitions changed is told to stop and not waited
    /// for: a partition promoted here is led at once (a failover is not held up by a copy
    /// still connecting to its old leader), and whatever such a copy still places lands at
    /// the partition's end before this node's own produces, or is refused as behind it.
    /// `replica`: the name acknowledgements count under (this node's).
    pub fn apply(
        &self,
        engine: &Arc<Engine>,
        upstream: &Upstream,
        replica: &str,
        wanted: HashMap<CopyKey, Vec<u16>>,
    ) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let stale: Vec<CopyKey> = running
            .iter()
            .filter(|(k, c)| wanted.get(*k) != Some(&c.partitions))
            .map(|(k, _)| k.clone())
            .collect();
        let mut stopping = self.stopping.lock().unwrap_or_else(|e| e.into_inner());
        for c in stale.iter().filter_map(|k| running.remove(k)) {
            c.stop.store(true, Ordering::Release);
            stopping.push(c.thread);
        }
        // Those that finished are reaped.
        let (done, left): (Vec<_>, Vec<_>) = std::mem::take(&mut *stopping)
            .into_iter()
            .partition(|t| t.is_finished());
        *stopping = left;
        drop(stopping);
        for t in done {
            let _ = t.join();
        }
        for ((name, leader, in_sync), partitions) in wanted {
            if running.contains_key(&(name.clone(), leader.clone(), in_sync)) {
                continue;
            }
            let Some(topic) = engine.topic(&name) else {
                log::warn!("topic {name:?} is not declared here: its partitions are not copied");
                continue;
            };
            log::info!("copying partition(s) {partitions:?} of topic {name:?} from {leader}");
            let stop = Arc::new(AtomicBool::new(false));
            let upstream = Upstream {
                active: leader.clone(),
                ..upstream.clone()
            };
            let (engine, stop_flag, parts) = (engine.clone(), stop.clone(), partitions.clone());
            let replica = in_sync.then(|| replica.to_string());
            let thread = std::thread::Builder::new()
                .name(format!("sluice-copy-{name}"))
                .spawn(move || {
                    copy(
                        &engine,
                        &topic,
                        &parts,
                        &upstream,
                        replica.as_deref(),
                        &stop_flag,
                    )
                })
                .expect("spawn a thread");
            running.insert(
                (name, leader, in_sync),
                Copying {
                    partitions,
                    stop,
                    thread,
                },
            );
        }
    }
}

impl PartitionCopies {
    /// Puts a cluster map's placement of topics in force here: the copies `wanted` (as
    /// `apply`), a branch of history started on each partition it makes this node lead, then
    /// the placement itself. Copies of partitions now led here are told to stop before the
    /// branches start, so that one still placing its last batch does not take its old
    /// leader's history over them (a failed branch is said in the log: the partition is led
    /// all the same).
    pub fn place(
        &self,
        engine: &Arc<Engine>,
        placements: &Placements,
        upstream: &Upstream,
        replica: &str,
        wanted: HashMap<CopyKey, Vec<u16>>,
        placement: Placement,
    ) {
        let led = placements.newly_led(&placement);
        self.apply(engine, upstream, replica, wanted);
        for (name, p) in led {
            let Some(topic) = engine.topic(&name) else {
                continue;
            };
            if let Err(e) = engine.start_topic_branch(&topic, p) {
                log::error!("topic {name:?} partition {p}: no branch of history started: {e}");
            }
        }
        placements.set(placement);
    }

    /// Stops every copy (the server stops); returns once none places anything.
    pub fn stop(&self) {
        let running = std::mem::take(&mut *self.running.lock().unwrap_or_else(|e| e.into_inner()));
        for c in running.values() {
            c.stop.store(true, Ordering::Release);
        }
        for (_, c) in running {
            let _ = c.thread.join();
        }
        let stopping =
            std::mem::take(&mut *self.stopping.lock().unwrap_or_else(|e| e.into_inner()));
        for t in stopping {
            let _ = t.join();
        }
    }
}

impl Drop for PartitionCopies {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Each run of consecutive messages of one partition in `b` as a bundle at its first
/// sequence number.
fn place(engine: &Engine, topic: &Topic, b: &Batch) -> Result<(), String> {
    let mut i = 0;
    while i < b.len() {
        let p = b.vbucket[i];
        let mut j = i + 1;
        while j < b.len()
            && b.vbucket[j] == p
            && b.seqno[j] == b.seqno[j - 1] + 1
            && j - i < MAX_BUNDLE
        {
            j += 1;
        }
        let messages: Vec<NewMessage<'_>> = (i..j)
            .map(|r| {
                let key = &b.keys[b.key_offsets[r] as usize..b.key_offsets[r + 1] as usize];
                NewMessage {
                    ts: b.cas[r] / 1_000_000,
                    key: (b.flags[r] & KEYED != 0).then_some(key),
                    content: &b.values
                        [b.value_offsets[r] as usize..b.value_offsets[r + 1] as usize],
                }
            })
            .collect();
        let mut out = Vec::new();
        bundle::write(&mut out, &messages, codec::NONE);
        // Nobody waits on a copy's bundle: the WAL writes it in its turn.
        let _ = engine
            .produce(topic, p, Some(b.seqno[i]), out.into())
            .map_err(|e| format!("placing partition {p} at {}: {e}", b.seqno[i]))?;
        i = j;
    }
    Ok(())
}
