//! A node's side of a cluster map: the map (from etcd, through the Python side, which keeps the
//! node's lease and watches the map) says for every vbucket which node is active and which
//! follow it; the node converges on it. Vbuckets it is active for become active here (a
//! replica promoted gets a new failover entry, as in a failover), those it is a replica for
//! become replicas and stream from their active over DCP, one connection per active node and
//! bucket, a stream per vbucket; the rest go dead and answer NOT_MY_VBUCKET. Clients are served
//! the map itself (CCCP), numbered with its revision in etcd.
//!
//! Two rules keep two actives from accepting writes for one vbucket: a dead copy that holds data
//! is never made active here (only a replica is promoted, or a copy that never held anything, as
//! when the cluster forms); and a vbucket being taken over onto this node is left to the
//! takeover.

use std::collections::BTreeMap;
use std::sync::Arc;

use sluice_core::bucket::Bucket;
use sluice_core::vbucket::VbState;
use sluice_core::Engine;

use crate::clustermap::{Assigned, ClusterMap};
use crate::replica::{Followers, ReplicaConfig};

/// What converging on a map did.
#[derive(Debug, Default, Clone)]
pub struct Converged {
    /// (bucket, vbucket) made active here from a replica copy: failovers carried out.
    pub promoted: Vec<(String, u16)>,
    /// (bucket, vbucket) made active here from an empty copy.
    pub activated: Vec<(String, u16)>,
    /// (bucket, vbucket) that became replicas here.
    pub to_replica: Vec<(String, u16)>,
    /// (bucket, vbucket) that went dead here.
    pub to_dead: Vec<(String, u16)>,
    /// (bucket, vbucket) the map makes active here but whose dead copy holds data: left dead.
    pub refused: Vec<(String, u16)>,
    /// Replication connections running after the change: (bucket, active, vbuckets).
    pub streams: Vec<(String, String, Vec<u16>)>,
}

/// The replication login, connection settings and address of this node, for the streams.
#[derive(Clone)]
pub struct Replication {
    pub username: Option<String>,
    pub password: Option<String>,
    pub noop_interval: u32,
    pub tls: Option<crate::tls::ClientTls>,
}

impl Replication {
    /// Following `active` for `vbuckets` (None: every replica vbucket) with these settings.
    fn following(&self, active: String, vbuckets: Option<Vec<u16>>) -> ReplicaConfig {
        ReplicaConfig {
            active,
            username: self.username.clone(),
            password: self.password.clone(),
            noop_interval: self.noop_interval,
            tls: self.tls.clone(),
            vbuckets,
        }
    }
}

fn role(map: &Assigned, vb: u16) -> VbState {
    let Some(this) = map.this.map(|t| t as i32) else {
        return VbState::Dead;
    };
    match map.chains.get(vb as usize) {
        Some(c) if c.first() == Some(&this) => VbState::Active,
        Some(c) if c.iter().skip(1).any(|&n| n == this) => VbState::Replica,
        _ => VbState::Dead,
    }
}

/// Moves vbucket `vb` of `bucket` from the node at `source` to this one by a takeover stream
/// (see `replica::take_over`). A replication stream that followed it here (a map's replica)
/// gives way to the takeover's.
/// The parts of a node a cluster map changes (shared handles: a caller may keep one while the
/// server is used from elsewhere).
#[derive(Clone)]
pub struct Member {
    pub engine: Arc<Engine>,
    pub followers: Arc<Followers>,
    pub clustermap: Arc<ClusterMap>,
    pub replication: Replication,
    pub topic_copies: Arc<crate::topic_replica::PartitionCopies>,
}

impl Member {
    pub fn take_over(
        &self,
        bucket: &Arc<Bucket>,
        vb: u16,
        source: &str,
        timeout: std::time::Duration,
    ) -> Result<crate::replica::TakeoverReport, String> {
        if let Some(active) = self.followers.follows_everything() {
            return Err(format!(
            "this node follows {active} and replicates every vbucket; a vbucket moves only to a \
             node that does not (promote it first)"
        ));
        }
        self.followers.release(bucket.name(), vb);
        let config = self.replication.following(source.to_string(), None);
        let r =
            crate::replica::take_over(&self.engine, bucket, vb, &config, timeout, &self.clustermap)
                .map_err(|e| e.to_string());
        self.followers.restore(bucket.name(), vb);
        r
    }

    /// Converges this node on `map`.
    pub fn converge(&self, map: Assigned) -> sluice_core::Result<Converged> {
        let Member {
            engine,
            followers,
            clustermap,
            replication,
            ..
        } = self;
        let mut done = Converged::default();
        // The streams the map wants, per bucket and active node.
        let mut wanted: Vec<(Arc<Bucket>, ReplicaConfig)> = Vec::new();
        for b in engine.buckets() {
            let mut by_active: BTreeMap<usize, Vec<u16>> = BTreeMap::new();
            for vb in 0..b.num_vbuckets() {
                if role(&map, vb) != VbState::Replica {
                    continue;
                }
                let active = map.chains[vb as usize][0];
                if active >= 0 && (active as usize) < map.servers.len() {
                    by_active.entry(active as usize).or_default().push(vb);
                }
            }
            for (active, vbuckets) in by_active {
                wanted.push((
                    b.clone(),
                    replication.following(map.servers[active].server(), Some(vbuckets)),
                ));
            }
        }
        // No stream may apply to a vbucket while its state changes under it.
        let changing = followers.changing();
        followers.stop_unwanted(&wanted);
        for b in engine.buckets() {
            let mut last = None;
            for vb in 0..b.num_vbuckets() {
                if clustermap.is_arriving(b.name(), vb) {
                    continue;
                }
                let Some(pos) = engine.stream_position(&b, vb) else {
                    continue;
                };
                let want = role(&map, vb);
                if pos.state == want {
                    continue;
                }
                let key = (b.name().to_string(), vb);
                match (pos.state, want) {
                    (VbState::Replica | VbState::Pending, VbState::Active) => {
                        done.promoted.push(key);
                    }
                    (VbState::Dead, VbState::Active) if pos.high_seqno > 0 => {
                        log::warn!(
                        "cluster map: vbucket {vb} of bucket {:?} is to be active here, but its \
                         copy here is dead with data (high seqno {}); leaving it dead",
                        b.name(),
                        pos.high_seqno
                    );
                        done.refused.push(key);
                        continue;
                    }
                    (_, VbState::Active) => done.activated.push(key),
                    (_, VbState::Replica) => done.to_replica.push(key),
                    _ => done.to_dead.push(key),
                }
                last = Some(engine.write_vbucket_state(&b, vb, want)?);
            }
            // One wait per bucket: the last state record written means every earlier one is.
            if let Some(w) = last {
                engine.settle(&b, w)?;
            }
        }
        done.streams = wanted
            .iter()
            .map(|(b, c)| {
                (
                    b.name().to_string(),
                    c.active.clone(),
                    c.vbuckets.clone().unwrap_or_default(),
                )
            })
            .collect();
        followers.start_wanted(wanted);
        drop(changing);
        if !done.promoted.is_empty() {
            log::warn!(
                "cluster map rev {}: {} vbucket(s) promoted to active here (failover)",
                map.rev,
                done.promoted.len()
            );
        }
        clustermap.assign(map);
        clustermap.refresh(engine);
        Ok(done)
    }
}

/// The cluster as this node last saw it, for /metrics (nothing when it is in no cluster).
pub fn metrics(clustermap: &ClusterMap, o: &mut String) {
    use crate::metrics::metric;
    use std::fmt::Write;
    let (Some(map), Some(r)) = (clustermap.assigned(), clustermap.report()) else {
        return;
    };
    let num = |k: &str| r.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    let reb = r.get("rebalance").cloned().unwrap_or_default();
    let running = reb.get("state").and_then(|s| s.as_str()) == Some("running");
    let (done, total) = (
        reb.get("done").and_then(|v| v.as_f64()).unwrap_or(0.0),
        reb.get("total").and_then(|v| v.as_f64()).unwrap_or(0.0),
    );
    let progress = if running && total > 0.0 {
        done / total
    } else {
        1.0
    };
    for (name, help, value) in [
        (
            "sluice_cluster_map_revision",
            "Revision (in etcd) of the vbucket map this node serves.",
            map.rev as f64,
        ),
        (
            "sluice_cluster_nodes_up",
            "Nodes registered in etcd (their leases alive).",
            num("nodes_up"),
        ),
        (
            "sluice_cluster_nodes_failed_over",
            "Nodes of the map failed over and not back.",
            num("failed_over"),
        ),
        (
            "sluice_cluster_orchestrator",
            "1 when this node is the cluster's orchestrator.",
            num("orchestrator_here"),
        ),
        (
            "sluice_cluster_rebalance_running",
            "1 while a rebalance runs.",
            f64::from(u8::from(running)),
        ),
        (
            "sluice_cluster_rebalance_progress",
            "Share of the running rebalance's moves done (1: none runs).",
            progress,
        ),
    ] {
        metric(o, name, "gauge", help);
        let _ = writeln!(o, "{name} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clustermap::Endpoint;

    fn map(this: Option<usize>, chains: Vec<Vec<i32>>) -> Assigned {
        Assigned {
            rev: 7,
            servers: (0..3)
                .map(|i| Endpoint {
                    host: "127.0.0.1".into(),
                    port: 11210 + i,
                })
                .collect(),
            this,
            chains,
        }
    }

    #[test]
    fn roles_come_from_the_chain() {
        let m = map(
            Some(1),
            vec![vec![1, 0], vec![0, 1], vec![2, 0], vec![1, -1], vec![]],
        );
        let roles: Vec<VbState> = (0..6).map(|vb| role(&m, vb)).collect();
        assert_eq!(
            roles,
            [
                VbState::Active,
                VbState::Replica,
                VbState::Dead,
                VbState::Active,
                VbState::Dead,
                VbState::Dead
            ]
        );
        let outside = map(None, vec![vec![1, 0]]);
        assert_eq!(role(&outside, 0), VbState::Dead);
    }
}
