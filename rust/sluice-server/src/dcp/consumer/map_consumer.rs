//! A reader's streams that follow the cluster map. Each vbucket streams from the node the
//! bucket config (GET_CLUSTER_CONFIG, what Couchbase's clients follow too) names its active.
//! When it moves (a takeover ends its stream with STATE_CHANGED, a node refuses it with
//! NOT_MY_VBUCKET, or the connection to its node is lost and the cluster fails the node over)
//! it is requested again, from the position the reader last saw, on the node the map names
//! then; a promoted replica that lacks the end of what was seen answers with a rollback, as
//! for any resumed stream. The reader sees one stream: one channel, one connection per node.
//!
//! Where the map shows one node serving every active vbucket (a node on its own, or a replica
//! of one), the streams start on the node given as they always did (no vbuckets named: its
//! active ones, or a replica's) and only moves are followed; a lost connection there is an
//! error, as there is nowhere else to go.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sluice_proto::dcp::{opcode as dcp_op, stream_end_reason};
use sluice_proto::mcbp::{opcode as op, status};

use super::session::ConsumerSession;
use super::{Consumer, ConsumerConfig, ConsumerError, Event, EventSender, Position, SessionState};

/// How long after a failed placement a vbucket is placed again: doubling from the first to
/// the last while none of its streams delivers (a failover takes a lease's TTL plus the
/// auto-failover timeout; a takeover's new map comes within milliseconds).
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// How long reading the map from one node may take: a dead node should not hold up asking
/// the next one.
const MAP_TIMEOUT: Duration = Duration::from_secs(2);

/// A bucket's vbucket map as its config gives it: the servers (`host:port`), and each
/// vbucket's active as an index into them (None where no node serves it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketMap {
    pub servers: Vec<String>,
    pub actives: Vec<Option<usize>>,
}

impl BucketMap {
    /// From a bucket config's JSON text.
    pub fn parse(text: &[u8]) -> Result<BucketMap, String> {
        let v: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
        let m = v
            .get("vBucketServerMap")
            .ok_or("no vBucketServerMap: not a bucket config")?;
        let servers = m
            .get("serverList")
            .and_then(|s| s.as_array())
            .ok_or("no serverList")?
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or("a server is not text"))
            .collect::<Result<Vec<_>, _>>()?;
        let actives = m
            .get("vBucketMap")
            .and_then(|s| s.as_array())
            .ok_or("no vBucketMap")?
            .iter()
            .map(|chain| {
                let a = chain
                    .as_array()
                    .and_then(|c| c.first())
                    .and_then(|a| a.as_i64())
                    .ok_or("a vbucket's chain names no active")?;
                match a {
                    -1 => Ok(None),
                    i if (0..servers.len() as i64).contains(&i) => Ok(Some(i as usize)),
                    _ => Err("a chain names a server the list lacks"),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(BucketMap { servers, actives })
    }

    /// The address of `vb`'s active, if a node serves it.
    pub fn active(&self, vb: u16) -> Option<&str> {
        let i = (*self.actives.get(usize::from(vb))?)?;
        Some(&self.servers[i])
    }

    /// Whether the actives are on more than one node: a cluster, where each vbucket streams
    /// from its own active.
    pub fn spread(&self) -> bool {
        let mut actives = self.actives.iter().flatten();
        let first = actives.next();
        actives.any(|a| Some(a) != first)
    }
}

/// The bucket map the producer at `address` serves (logging in with `config`'s credentials
/// and selecting its bucket), on a connection of its own closed afterwards.
pub fn bucket_map(config: &ConsumerConfig, address: &str) -> Result<BucketMap, ConsumerError> {
    let config = ConsumerConfig {
        address: address.to_string(),
        setup_timeout: Some(config.setup_timeout.unwrap_or(MAP_TIMEOUT).min(MAP_TIMEOUT)),
        state: SessionState::default(),
        ..config.clone()
    };
    let (_ctx, crx) = mpsc::channel();
    let socket = Arc::new(Mutex::new(None));
    let mut s = ConsumerSession::log_in(&config, EventSender::unread(), crx, &socket)?;
    let r = s.call(op::GET_CLUSTER_CONFIG, &[], &[], &[], "GET_CLUSTER_CONFIG");
    let _ = s.sock.shutdown(std::net::Shutdown::Both);
    let mut map = BucketMap::parse(&r?)
        .map_err(|why| ConsumerError::BadAnswer(format!("GET_CLUSTER_CONFIG: {why}")))?;
    // "$HOST" is Couchbase's "the host you asked": a node listening on every address.
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    for s in &mut map.servers {
        if let Some(port) = s.strip_prefix("$HOST") {
            *s = format!("{host}{port}");
        }
    }
    Ok(map)
}

/// One node's connection.
struct Node {
    address: String,
    consumer: Consumer,
}

/// A vbucket waiting for a node to stream from: since when, and why.
struct Unplaced {
    since: Instant,
    why: String,
}

/// The reader's end of streams that follow the map (see the module's doc).
pub struct MapConsumer {
    config: ConsumerConfig,
    /// Follow moves; false: one connection to the node given, as `Consumer`.
    follow: bool,
    /// How long a vbucket may go without a node before the whole stream fails.
    move_timeout: Duration,
    /// Dropped before the connections: a thread waiting for room in it then stops.
    events: Option<Receiver<(u32, Event)>>,
    tx: SyncSender<(u32, Event)>,
    nodes: BTreeMap<u32, Node>,
    next_connection: u32,
    /// Where each vbucket stands as the reader has seen it.
    positions: BTreeMap<u16, Position>,
    /// The connection each vbucket streams on (none once its stream is over).
    owner: BTreeMap<u16, u32>,
    unplaced: BTreeMap<u16, Unplaced>,
    retry_at: Instant,
    retry: Duration,
    /// The map last read, if any.
    map: Option<BucketMap>,
    finished: bool,
}

impl MapConsumer {
    /// Streams as `config` asks; with `follow`, from each vbucket's active, following moves,
    /// giving up on a vbucket no node serves for `move_timeout`. Topic, takeover, replica and
    /// TLS connections are not followed: they are tied to the node given. With `follow` this
    /// reads the map first (a round trip, up to 2 s when the node does not answer).
    pub fn start(config: ConsumerConfig, follow: bool, move_timeout: Duration) -> MapConsumer {
        let follow = follow
            && config.topic.is_none()
            && config.tls.is_none()
            && !config.takeover
            && config.replica_name.is_none();
        let (tx, rx) = mpsc::sync_channel(4);
        let mut m = MapConsumer {
            positions: config.state.vbuckets.clone(),
            config,
            follow,
            move_timeout,
            events: Some(rx),
            tx,
            nodes: BTreeMap::new(),
            next_connection: 0,
            owner: BTreeMap::new(),
            unplaced: BTreeMap::new(),
            retry_at: Instant::now(),
            retry: RETRY_FIRST,
            map: None,
            finished: false,
        };
        m.plan();
        m
    }

    /// Waits for the next event, up to `timeout`; None on timeout. Moves are followed here,
    /// on the reader's thread, between events.
    pub fn next_event(&mut self, timeout: Duration) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.finished {
                return Some(Event::Finished);
            }
            if !self.unplaced.is_empty() && Instant::now() >= self.retry_at {
                if let Err(why) = self.place() {
                    return Some(self.fail(why));
                }
            }
            if self.nodes.is_empty() && self.unplaced.is_empty() {
                self.finished = true;
                return Some(Event::Finished);
            }
            let now = Instant::now();
            let mut wait = deadline.saturating_duration_since(now);
            if !self.unplaced.is_empty() {
                wait = wait.min(self.retry_at.saturating_duration_since(now));
            }
            match self.events.as_ref()?.recv_timeout(wait) {
                Ok((connection, event)) => {
                    if let Some(e) = self.take(connection, event) {
                        return Some(e);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                // This end holds a sender: never while it lives.
                Err(RecvTimeoutError::Disconnected) => return Some(Event::Finished),
            }
            if Instant::now() >= deadline {
                return None;
            }
        }
    }

    /// Requests a vbucket's stream again after a rollback the reader has handled.
    pub fn resume(&self, vbucket: u16) {
        if let Some(n) = self.owner.get(&vbucket).and_then(|c| self.nodes.get(c)) {
            n.consumer.link().resume(vbucket);
        }
    }

    /// The first placement: by the map where it is spread over nodes, else on the node given.
    fn plan(&mut self) {
        if self.follow {
            match bucket_map(&self.config, &self.config.address) {
                Ok(map) if map.spread() => {
                    let wanted = match &self.config.vbuckets {
                        Some(v) => v.clone(),
                        None => (0..map.actives.len() as u16).collect(),
                    };
                    let now = Instant::now();
                    for vb in wanted {
                        self.unplaced.insert(
                            vb,
                            Unplaced {
                                since: now,
                                why: "not placed yet".into(),
                            },
                        );
                    }
                    self.map = Some(map);
                    return;
                }
                Ok(map) => self.map = Some(map),
                Err(e) => log::debug!(
                    "DCP consumer '{}': no cluster map from {} ({e}); streaming from it alone",
                    self.config.name,
                    self.config.address
                ),
            }
        }
        let (address, vbuckets) = (self.config.address.clone(), self.config.vbuckets.clone());
        self.open(address, vbuckets, false);
    }

    /// Where `vb` resumes: what the reader saw. A stream this consumer began "from now" (the
    /// state given did not cover it) that has seen no document starts from now again: its
    /// failover log alone would make it start at the beginning of the new node's history.
    fn resume_position(&self, vb: u16) -> Position {
        let began_now = self.config.from_now && !self.config.state.vbuckets.contains_key(&vb);
        match self.positions.get(&vb) {
            Some(p) if !(began_now && p.seqno == 0) => p.clone(),
            _ => Position::default(),
        }
    }

    /// A connection to `address` for `vbuckets` (None: what the configuration says there).
    fn open(&mut self, address: String, vbuckets: Option<Vec<u16>>, by_map: bool) {
        let id = self.next_connection;
        self.next_connection += 1;
        let state = match &vbuckets {
            Some(v) => SessionState {
                vbuckets: v.iter().map(|&vb| (vb, self.resume_position(vb))).collect(),
            },
            None => self.config.state.clone(),
        };
        for &vb in vbuckets.iter().flatten() {
            self.owner.insert(vb, id);
        }
        let config = ConsumerConfig {
            address: address.clone(),
            vbuckets,
            state,
            end_refused_streams: self.follow,
            active_only: by_map,
            ..self.config.clone()
        };
        let events = EventSender {
            tx: self.tx.clone(),
            connection: id,
        };
        let consumer = Consumer::start_sending(config, events);
        self.nodes.insert(id, Node { address, consumer });
    }

    /// An event of connection `id`: what the reader is handed, if anything.
    fn take(&mut self, id: u32, event: Event) -> Option<Event> {
        match event {
            Event::Batch(mut b) => {
                for (vb, p) in &b.positions {
                    self.positions.insert(*vb, p.clone());
                    self.owner.insert(*vb, id);
                }
                if !b.is_empty() {
                    self.retry = RETRY_FIRST;
                }
                if !self.follow {
                    return Some(Event::Batch(b));
                }
                let mut moved = Vec::new();
                b.ended.retain(|&(vb, reason)| {
                    if reason == stream_end_reason::STATE_CHANGED {
                        moved.push(vb);
                        return false;
                    }
                    true
                });
                // Those streams are over (their end seqno, or closed): not to be placed.
                for &(vb, _) in &b.ended {
                    self.owner.remove(&vb);
                }
                let address = self.nodes.get(&id).map_or("", |n| n.address.as_str());
                let now = Instant::now();
                let mut unplaced = Vec::new();
                for vb in moved {
                    unplaced.push((vb, format!("it changed state on {address}")));
                }
                for vb in std::mem::take(&mut b.refused) {
                    unplaced.push((vb, format!("{address} does not serve it as active")));
                }
                for (vb, why) in unplaced {
                    log::info!(
                        "DCP consumer '{}': vbucket {vb} moved ({why}); following the cluster map",
                        self.config.name
                    );
                    self.owner.remove(&vb);
                    self.unplaced.insert(vb, Unplaced { since: now, why });
                }
                Some(Event::Batch(b))
            }
            Event::Rollback {
                vbucket,
                seqno,
                position,
            } => {
                // The reader's `resume` goes to this connection, where the stream waits.
                self.positions.insert(vbucket, position.clone());
                self.owner.insert(vbucket, id);
                Some(Event::Rollback {
                    vbucket,
                    seqno,
                    position,
                })
            }
            Event::VbucketState { opaque, .. } => {
                // This reader asks for no takeover streams: a producer that hands a vbucket
                // over anyway is refused.
                if let Some(n) = self.nodes.get(&id) {
                    n.consumer
                        .link()
                        .respond(dcp_op::SET_VBUCKET_STATE, opaque, status::EINVAL);
                }
                None
            }
            Event::Finished => {
                // Its streams ended; following, one resumed there just as it finished is placed
                // again.
                self.nodes.remove(&id);
                if self.follow {
                    self.orphan(id, "its connection ended");
                }
                None
            }
            Event::Failed(why) => {
                let node = self.nodes.remove(&id);
                if self.follow && self.map.as_ref().is_some_and(BucketMap::spread) {
                    log::warn!(
                        "DCP consumer '{}': {why}; streaming the vbuckets of {} from where the \
                         cluster map says",
                        self.config.name,
                        node.as_ref().map_or("", |n| n.address.as_str())
                    );
                    self.orphan(id, &why);
                    None
                } else {
                    Some(self.fail(why))
                }
            }
        }
    }

    /// The vbuckets streaming on connection `id` are to be placed again.
    fn orphan(&mut self, id: u32, why: &str) {
        let now = Instant::now();
        let vbs: Vec<u16> = self
            .owner
            .iter()
            .filter(|(_, c)| **c == id)
            .map(|(vb, _)| *vb)
            .collect();
        for vb in vbs {
            self.owner.remove(&vb);
            self.unplaced.entry(vb).or_insert(Unplaced {
                since: now,
                why: why.to_string(),
            });
        }
    }

    /// Places the unplaced vbuckets where a freshly read map says; an error when one cannot
    /// be placed ever (it does not exist, or no node serves it outside a cluster) or has not
    /// been for `move_timeout`.
    fn place(&mut self) -> Result<(), String> {
        // The map from the first node that answers: those streaming, the one given, the
        // servers of the last map.
        let mut candidates: Vec<String> = self.nodes.values().map(|n| n.address.clone()).collect();
        candidates.push(self.config.address.clone());
        candidates.extend(self.map.iter().flat_map(|m| m.servers.iter().cloned()));
        let mut unread = Vec::new();
        let mut fresh = None;
        for (i, address) in candidates.iter().enumerate() {
            if candidates[..i].contains(address) {
                continue;
            }
            match bucket_map(&self.config, address) {
                Ok(m) => {
                    fresh = Some(m);
                    break;
                }
                Err(e) => unread.push(format!("{address}: {e}")),
            }
        }
        let mut by_node: BTreeMap<String, Vec<u16>> = BTreeMap::new();
        if let Some(map) = &fresh {
            for (&vb, u) in &self.unplaced {
                if usize::from(vb) >= map.actives.len() {
                    return Err(format!(
                        "vbucket {vb} does not exist: the bucket has {} vbuckets",
                        map.actives.len()
                    ));
                }
                match map.active(vb) {
                    Some(a) => by_node.entry(a.to_string()).or_default().push(vb),
                    None if !map.spread() => {
                        return Err(format!("vbucket {vb}: no node serves it ({})", u.why));
                    }
                    None => {}
                }
            }
        }
        if fresh.is_some() {
            self.map = fresh;
        }
        for (address, vbs) in by_node {
            for vb in &vbs {
                self.unplaced.remove(vb);
            }
            let there = self
                .nodes
                .iter()
                .find(|(_, n)| n.address == address)
                .map(|(id, _)| *id);
            match there {
                Some(id) => {
                    for vb in vbs {
                        let p = self.resume_position(vb);
                        self.nodes[&id].consumer.link().resume_at(vb, p);
                        self.owner.insert(vb, id);
                    }
                }
                None => self.open(address, Some(vbs), true),
            }
        }
        if let Some((vb, u)) = self
            .unplaced
            .iter()
            .find(|(_, u)| u.since.elapsed() > self.move_timeout)
        {
            let mut why = format!(
                "vbucket {vb} has had no node to stream from for {} s: {}",
                self.move_timeout.as_secs(),
                u.why
            );
            if !unread.is_empty() {
                why += &format!(
                    "; no node answered for the cluster map ({})",
                    unread.join("; ")
                );
            }
            return Err(why);
        }
        self.retry_at = Instant::now() + self.retry;
        self.retry = (self.retry * 2).min(RETRY_MAX);
        Ok(())
    }

    /// Stops every connection; the reader is told `why`.
    fn fail(&mut self, why: String) -> Event {
        self.finished = true;
        self.events.take();
        self.nodes.clear();
        Event::Failed(why)
    }
}

impl Drop for MapConsumer {
    fn drop(&mut self) {
        self.events.take();
        self.nodes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_config_gives_each_vbuckets_active() {
        let text = br#"{"rev": 7, "vBucketServerMap": {"serverList": ["a:1", "b:2"],
            "vBucketMap": [[0, 1], [1, 0], [-1, 0]]}}"#;
        let m = BucketMap::parse(text).unwrap();
        assert_eq!(m.active(0), Some("a:1"));
        assert_eq!(m.active(1), Some("b:2"));
        assert_eq!(m.active(2), None);
        assert_eq!(m.active(3), None);
        assert!(m.spread());
        let one = br#"{"vBucketServerMap": {"serverList": ["a:1", "b:2"],
            "vBucketMap": [[1, 0], [1, -1], [-1, -1]]}}"#;
        assert!(!BucketMap::parse(one).unwrap().spread());
        for bad in [
            &br#"{"rev": 1}"#[..],
            br#"{"vBucketServerMap": {"serverList": ["a:1"], "vBucketMap": [[1]]}}"#,
            br#"{"vBucketServerMap": {"serverList": [1], "vBucketMap": []}}"#,
            br#"{"vBucketServerMap": {"serverList": ["a:1"], "vBucketMap": [[]]}}"#,
            b"not json",
        ] {
            assert!(
                BucketMap::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
