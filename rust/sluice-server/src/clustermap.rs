//! The cluster map Couchbase's clients bootstrap from (CCCP: GET_CLUSTER_CONFIG, the body of a
//! NOT_MY_VBUCKET reply, and the config pushed to clients that asked for change notifications):
//! per bucket, the nodes serving it and, for every vbucket, the server-list index of its active
//! node, then its replicas (-1 for none).
//!
//! A node knows its part of the layout and builds its map from that: its own vbuckets' states;
//! the replicas that follow its active vbuckets (their DCP streams, each replica having told its
//! KV address in the DCP control `sluice_kv_address`); the active it follows itself
//! (`replica_of`); and where the vbuckets it gave away went (the takeover consumer's address).
//! There is no cluster manager to number the maps, so a map's `rev` is the time in milliseconds
//! at which this node saw its layout change (always rising here): maps from different nodes
//! compare without coordination, the newest change winning, as long as the nodes' clocks agree
//! (NTP) to within the time between two changes.
//!
//! A node bound to a wildcard or loopback address does not know the name clients reach it by,
//! so its map names it `$HOST`, which clients replace with the address they connected to, as
//! Couchbase does.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use parking_lot::Mutex;
use sluice_core::bucket::Bucket;
use sluice_core::vbucket::VbState;
use sluice_core::Engine;
use tokio::sync::watch;

/// What clients write for the address they connected to.
pub const THIS_HOST: &str = "$HOST";

/// A node's KV address as the map names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// `host:port` (IPv6 hosts in brackets), as in `serverList`.
    pub fn server(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Parses `host:port` (`[v6]:port` too); a wildcard host becomes `peer`, the address the
    /// node was reached from.
    pub fn parse(text: &str, peer: Option<IpAddr>) -> Option<Endpoint> {
        let (host, port) = text.rsplit_once(':')?;
        let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.len() > 255 || host.contains(['"', '\\', '/', ' ']) {
            return None;
        }
        let host = match (host.parse::<IpAddr>(), peer) {
            (Ok(ip), Some(p)) if ip.is_unspecified() => p.to_string(),
            _ => host.to_string(),
        };
        Some(Endpoint { host, port })
    }
}

/// The part of the layout a map shows: the servers and each vbucket's chain of server indexes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Layout {
    pub servers: Vec<Endpoint>,
    pub chains: Vec<Vec<i32>>,
}

impl Layout {
    fn index_of(&mut self, e: &Endpoint) -> i32 {
        match self.servers.iter().position(|s| s == e) {
            Some(i) => i as i32,
            None => {
                self.servers.push(e.clone());
                (self.servers.len() - 1) as i32
            }
        }
    }

    pub fn num_replicas(&self) -> usize {
        self.chains
            .iter()
            .map(|c| c.len().saturating_sub(1))
            .max()
            .unwrap_or(0)
    }
}

/// A map a cluster gives: its revision, its servers (this node's index among them, if it is
/// one) and every vbucket's chain, the same for every bucket.
#[derive(Debug, Clone)]
pub struct Assigned {
    pub rev: i64,
    pub servers: Vec<Endpoint>,
    pub this: Option<usize>,
    pub chains: Vec<Vec<i32>>,
}

impl Assigned {
    fn layout(&self, num_vbuckets: u16) -> Layout {
        let width = self.chains.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let chains = (0..num_vbuckets as usize)
            .map(|vb| {
                let mut c = self.chains.get(vb).cloned().unwrap_or_default();
                c.resize(width, -1);
                c
            })
            .collect();
        Layout {
            servers: self.servers.clone(),
            chains,
        }
    }
}

struct Served {
    layout: Layout,
    rev: i64,
    /// The bucket config JSON of this layout and rev, built once: NOT_MY_VBUCKET replies, config
    /// requests and pushes serve it as it is (a client sending to the wrong vbucket must not
    /// cost a map build per request). A changed layout, seen by `refresh` (every second, and at
    /// once after a promotion or a vbucket move), drops it.
    config: Option<std::sync::Arc<str>>,
}

pub struct ClusterMap {
    /// The KV listener as bound.
    listen: SocketAddr,
    this_node: Endpoint,
    /// The TLS KV port, when that listener runs.
    tls_port: Option<u16>,
    /// The active this node follows (`replica_of`), until a promotion.
    active: Mutex<Option<Endpoint>>,
    /// Replicas by the name their DCP streams carry (`consumer_name`), with their KV address.
    replicas: Mutex<HashMap<String, Endpoint>>,
    /// Vbuckets handed over to another node, by bucket and vbucket.
    moved: Mutex<HashMap<(String, u16), Endpoint>>,
    /// Vbuckets being taken over onto this node. Their passing states (replica, pending) are
    /// not published: the source's map, whose rev rises when it hands them over, is the one
    /// that tells clients they moved, and a destination that published its passing states
    /// would end with a newer rev than the source's and have clients follow its own view.
    arriving: Mutex<std::collections::HashSet<(String, u16)>>,
    served: Mutex<HashMap<String, Served>>,
    /// A cluster's map, when this node is in one: it replaces the layout the node works out.
    cluster: Mutex<Option<Assigned>>,
    /// What the node's cluster side last reported of the cluster (nodes, orchestrator,
    /// rebalance), for /status and /metrics.
    report: Mutex<Option<serde_json::Value>>,
    /// The newest rev of any bucket: connections that asked for pushes watch it.
    changed: watch::Sender<i64>,
    /// Who leads each topic partition, when the node is in a cluster.
    pub topics: crate::topic_placement::Placements,
    /// Where requests of clients that read no map go, when the node is in a cluster.
    pub router: crate::router::Router,
    /// What the admin endpoint asked of the cluster ("rebalance"), for the cluster side to
    /// write to etcd (`take_requests`).
    requests: Mutex<Vec<String>>,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl ClusterMap {
    /// `listen`: the KV listener as bound; `tls`: the TLS KV listener's, if any.
    pub fn new(listen: SocketAddr, tls: Option<SocketAddr>) -> ClusterMap {
        let ip = listen.ip();
        let host = if ip.is_unspecified() || ip.is_loopback() {
            THIS_HOST.to_string()
        } else {
            ip.to_string()
        };
        ClusterMap {
            listen,
            this_node: Endpoint {
                host,
                port: listen.port(),
            },
            tls_port: tls.map(|a| a.port()),
            active: Mutex::new(None),
            replicas: Mutex::new(HashMap::new()),
            moved: Mutex::new(HashMap::new()),
            arriving: Mutex::new(std::collections::HashSet::new()),
            served: Mutex::new(HashMap::new()),
            cluster: Mutex::new(None),
            report: Mutex::new(None),
            changed: watch::channel(0).0,
            topics: Default::default(),
            router: Default::default(),
            requests: Mutex::new(Vec::new()),
        }
    }

    /// This node's KV address, told to the nodes it streams from: as the cluster map names it
    /// (what it advertises), else as bound (a wildcard host stands for the address it is
    /// reached at).
    pub fn kv_address(&self) -> String {
        let assigned = self.cluster.lock();
        match assigned.as_ref().and_then(|a| a.servers.get(a.this?)) {
            Some(e) => e.server(),
            None => self.listen.to_string(),
        }
    }

    /// Sets (or, on promotion, clears) the active this node follows.
    pub fn set_active(&self, active: Option<&str>) {
        *self.active.lock() = active.and_then(|a| Endpoint::parse(a, None));
    }

    /// A replica named `name` told its KV address (`reported`, a wildcard host standing for
    /// `peer`, the address its stream comes from).
    pub fn learn_replica(&self, name: &str, reported: &Endpoint) {
        self.replicas
            .lock()
            .insert(name.to_string(), reported.clone());
    }

    /// The KV address a replica told (`host:port`), for /status.
    pub fn replica_address(&self, name: &str) -> Option<String> {
        self.replicas.lock().get(name).map(Endpoint::server)
    }

    /// Vbucket `vb` of `bucket` was handed over to the node at `to`.
    pub fn moved(&self, bucket: &str, vb: u16, to: &Endpoint) {
        self.moved
            .lock()
            .insert((bucket.to_string(), vb), to.clone());
    }

    /// Vbucket `vb` of `bucket` is being taken over onto this node: until `arrived` (or
    /// `not_arriving` when the takeover fails), the map shows it here, as it will be.
    pub fn arriving(&self, bucket: &str, vb: u16) {
        self.arriving.lock().insert((bucket.to_string(), vb));
    }

    /// Whether vbucket `vb` of `bucket` is being taken over onto this node.
    pub fn is_arriving(&self, bucket: &str, vb: u16) -> bool {
        self.arriving.lock().contains(&(bucket.to_string(), vb))
    }

    /// The takeover onto this node failed: the vbucket shows its real state again.
    pub fn not_arriving(&self, bucket: &str, vb: u16) {
        self.arriving.lock().remove(&(bucket.to_string(), vb));
    }

    /// A vbucket taken over onto this node is no longer elsewhere.
    pub fn arrived(&self, bucket: &str, vb: u16) {
        self.moved.lock().remove(&(bucket.to_string(), vb));
        self.arriving.lock().remove(&(bucket.to_string(), vb));
    }

    /// Connections that asked for change notifications watch this (the newest rev).
    pub fn subscribe(&self) -> watch::Receiver<i64> {
        self.changed.subscribe()
    }

    /// Serves a cluster's map from now on, in place of the layout this node works out.
    pub fn assign(&self, map: Assigned) {
        *self.cluster.lock() = Some(map);
    }

    /// Keeps what the cluster side reports of the cluster.
    pub fn set_report(&self, report: serde_json::Value) {
        *self.report.lock() = Some(report);
    }

    /// The cluster's last report, if this node is in a cluster.
    /// Queues a request to the cluster (`rebalance`) for the cluster side; false when this
    /// node is not in a cluster.
    pub fn request(&self, what: &str) -> bool {
        if self.report.lock().is_none() {
            return false;
        }
        self.requests.lock().push(what.to_string());
        true
    }

    /// The requests queued since the last call.
    pub fn take_requests(&self) -> Vec<String> {
        std::mem::take(&mut *self.requests.lock())
    }

    pub fn report(&self) -> Option<serde_json::Value> {
        self.report.lock().clone()
    }

    /// The cluster map assigned, if any.
    pub fn assigned(&self) -> Option<Assigned> {
        self.cluster.lock().clone()
    }

    /// The layout this node sees for `bucket` now.
    pub fn layout(&self, engine: &Engine, bucket: &Bucket) -> Layout {
        if let Some(a) = &*self.cluster.lock() {
            return a.layout(bucket.num_vbuckets());
        }
        let mut l = Layout {
            servers: vec![self.this_node.clone()],
            chains: Vec::with_capacity(bucket.num_vbuckets() as usize),
        };
        let active = self.active.lock().clone();
        let replicas = self.replicas.lock().clone();
        let moved = self.moved.lock().clone();
        let arriving = self.arriving.lock().clone();
        for vb in 0..bucket.num_vbuckets() {
            let state = if arriving.contains(&(bucket.name().to_string(), vb)) {
                Some(VbState::Active)
            } else {
                engine.vbucket_state(bucket, vb)
            };
            let chain = match state {
                Some(VbState::Active | VbState::Pending) => {
                    let mut c = vec![0];
                    for f in bucket.acks.following(vb) {
                        if let Some(e) = replicas.get(&f.name) {
                            let i = l.index_of(e);
                            if !c.contains(&i) {
                                c.push(i);
                            }
                        }
                    }
                    c
                }
                Some(VbState::Replica) => match &active {
                    Some(a) => vec![l.index_of(a), 0],
                    None => vec![-1, 0],
                },
                Some(VbState::Dead) | None => match moved.get(&(bucket.name().to_string(), vb)) {
                    Some(to) => vec![l.index_of(to)],
                    None => vec![-1],
                },
            };
            l.chains.push(chain);
        }
        let width = l.num_replicas() + 1;
        for c in &mut l.chains {
            c.resize(width, -1);
        }
        l
    }

    /// Brings every bucket's rev up to date; tells the watchers when one changed.
    pub fn refresh(&self, engine: &Engine) {
        for b in engine.buckets() {
            self.current(engine, &b);
        }
    }

    /// The layout of `bucket` and its rev, raised when the layout differs from the last one.
    fn current(&self, engine: &Engine, bucket: &Bucket) -> (Layout, i64) {
        let layout = self.layout(engine, bucket);
        let assigned_rev = self.cluster.lock().as_ref().map(|a| a.rev);
        let mut served = self.served.lock();
        let newest = served.values().map(|s| s.rev).max().unwrap_or(0);
        let s = served
            .entry(bucket.name().to_string())
            .or_insert_with(|| Served {
                layout: Layout::default(),
                rev: 0,
                config: None,
            });
        if let Some(rev) = assigned_rev {
            // The cluster numbers its maps (etcd's revision of the map).
            if s.rev != rev || s.layout != layout {
                s.rev = rev;
                s.layout = layout.clone();
                s.config = None;
                drop(served);
                self.changed.send_replace(rev);
            }
            return (layout, rev);
        }
        if s.layout != layout && s.rev != 0 && self.active.lock().is_some() {
            // A replica's view changes when its active's does (a vbucket the active gave away
            // goes dead here too): the active's map, raised when it made the change, is the
            // one clients follow, so the replica serves its view without outbidding it.
            s.layout = layout.clone();
            s.config = None;
            return (layout, s.rev);
        }
        if s.layout != layout {
            // Rising on this node whatever the clock does.
            s.rev = now_ms().max(newest + 1).max(s.rev + 1);
            s.layout = layout.clone();
            s.config = None;
            let rev = s.rev;
            drop(served);
            self.changed.send_replace(rev);
            return (layout, rev);
        }
        (layout, s.rev)
    }

    fn nodes_ext(&self, servers: &[Endpoint]) -> Vec<serde_json::Value> {
        let this = match &*self.cluster.lock() {
            Some(a) => a.this,
            None => Some(0),
        };
        servers
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut services = serde_json::json!({"kv": s.port});
                let mut node = serde_json::json!({"hostname": s.host});
                if Some(i) == this {
                    if let Some(p) = self.tls_port {
                        services["kvSSL"] = p.into();
                    }
                    node["thisNode"] = true.into();
                }
                node["services"] = services;
                node
            })
            .collect()
    }

    /// The bucket config Couchbase serves for `bucket`, with its rev: the one built for the
    /// layout `refresh` last saw (built now if there is none yet).
    pub fn bucket_config(&self, engine: &Engine, bucket: &Bucket) -> (i64, std::sync::Arc<str>) {
        if let Some(s) = self.served.lock().get(bucket.name()) {
            if let Some(config) = &s.config {
                return (s.rev, config.clone());
            }
        }
        let (layout, rev) = self.current(engine, bucket);
        let config: std::sync::Arc<str> = self
            .build_bucket_config(engine, bucket, &layout, rev)
            .into();
        if let Some(s) = self.served.lock().get_mut(bucket.name()) {
            if s.rev == rev && s.layout == layout {
                s.config = Some(config.clone());
            }
        }
        (rev, config)
    }

    fn build_bucket_config(
        &self,
        engine: &Engine,
        bucket: &Bucket,
        layout: &Layout,
        rev: i64,
    ) -> String {
        let config = serde_json::json!({
            "rev": rev,
            "revEpoch": 1,
            "name": bucket.name(),
            "uuid": bucket_uuid(engine, bucket),
            "nodeLocator": "vbucket",
            "collectionsManifestUid": "0",
            "nodesExt": self.nodes_ext(&layout.servers),
            "vBucketServerMap": {
                "hashAlgorithm": "CRC",
                "numReplicas": layout.num_replicas(),
                "serverList": layout.servers.iter().map(Endpoint::server).collect::<Vec<_>>(),
                "vBucketMap": &layout.chains,
            },
            "bucketCapabilitiesVer": "",
            "bucketCapabilities": [
                "cccp", "nodesExt", "touch", "dcp", "xattr", "durableWrite", "collections",
                "rangeScan", "tombstonedUserXAttrs", "subdoc.AccessDeleted",
                "subdoc.ReplaceBodyWithXattr", "subdoc.DocumentMacroSupport",
                "subdoc.ReviveDocument"
            ],
            "clusterCapabilitiesVer": [1, 0],
            "clusterCapabilities": {},
        });
        config.to_string()
    }

    /// The cluster-level config (no bucket selected): the nodes this node knows, no vbuckets.
    pub fn cluster_config(&self, engine: &Engine) -> (i64, std::sync::Arc<str>) {
        let mut servers = match &*self.cluster.lock() {
            Some(a) => a.servers.clone(),
            None => vec![self.this_node.clone()],
        };
        let mut rev = 0;
        for b in engine.buckets() {
            let (layout, r) = self.current(engine, &b);
            rev = rev.max(r);
            for s in layout.servers {
                if !servers.contains(&s) {
                    servers.push(s);
                }
            }
        }
        let config = serde_json::json!({
            "rev": rev,
            "revEpoch": 1,
            "nodesExt": self.nodes_ext(&servers),
            "clusterCapabilitiesVer": [1, 0],
            "clusterCapabilities": {},
        });
        (rev, config.to_string().into())
    }
}

/// A bucket's uuid as clients see it: stable for the node's instance and the bucket's name.
fn bucket_uuid(engine: &Engine, bucket: &Bucket) -> String {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(format!("{}/{}", engine.instance(), bucket.name()).as_bytes());
    d[..16].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_print() {
        let peer: IpAddr = "10.0.0.7".parse().unwrap();
        let e = Endpoint::parse("0.0.0.0:11210", Some(peer)).unwrap();
        assert_eq!(e.server(), "10.0.0.7:11210");
        let e = Endpoint::parse("[::1]:11211", Some(peer)).unwrap();
        assert_eq!(
            (e.host.as_str(), e.server()),
            ("::1", "[::1]:11211".to_string())
        );
        let e = Endpoint::parse("db1.example:11210", None).unwrap();
        assert_eq!(e.server(), "db1.example:11210");
        for bad in [
            "", "host", "host:0", "host:x", ":11210", "a\"b:1", "h:70000",
        ] {
            assert!(Endpoint::parse(bad, None).is_none(), "{bad}");
        }
    }

    #[test]
    fn loopback_and_wildcard_listeners_are_named_host() {
        let m = ClusterMap::new("127.0.0.1:11210".parse().unwrap(), None);
        assert_eq!(m.this_node.host, THIS_HOST);
        let m = ClusterMap::new("0.0.0.0:11210".parse().unwrap(), None);
        assert_eq!(m.this_node.host, THIS_HOST);
        let m = ClusterMap::new("10.1.2.3:11210".parse().unwrap(), None);
        assert_eq!(m.this_node.server(), "10.1.2.3:11210");
    }
}
