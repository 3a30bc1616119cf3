//! The replicators of a node that follows an active, one per bucket: started, changed as the
//! cluster map says, stopped for good by a promotion.

use super::*;

/// The replicators of a node that follows an active, one per bucket. A promotion stops them
/// for good.
pub struct Followers {
    engine: Arc<Engine>,
    replicators: Mutex<Vec<Replicator>>,
    /// The copy of the active's topics.
    topics: Mutex<Option<crate::topic_replica::TopicFollower>>,
    /// Names the active while this node follows it, and shows the promotion.
    clustermap: Arc<ClusterMap>,
    policies: Arc<PolicyHost>,
    /// (bucket, vbucket) a takeover onto this node streams: no replicator may follow them
    /// meanwhile, whatever the map or a concurrent takeover's restart asks.
    withheld: Mutex<BTreeSet<(String, u16)>>,
    /// Held while the replicators are changed as a whole (stopped, then started), so that two
    /// changes do not interleave: one would restart what the other just stopped.
    changing: Mutex<()>,
}

impl Followers {
    /// Starts following `active` for every bucket (None: this node is active; nothing runs).
    pub fn start(
        engine: Arc<Engine>,
        active: Option<&ReplicaConfig>,
        policies: &Arc<PolicyHost>,
        clustermap: Arc<ClusterMap>,
    ) -> Followers {
        clustermap.set_active(active.map(|rc| rc.active.as_str()));
        let replicators = match active {
            Some(rc) => engine
                .buckets()
                .into_iter()
                .map(|b| {
                    let address = Some(clustermap.kv_address());
                    Replicator::start(engine.clone(), b, rc.clone(), policies.clone(), address)
                })
                .collect(),
            None => Vec::new(),
        };
        // The topics here are copies from the start (none is produced to before the follower
        // reaches the active); their DCP logins select a bucket both nodes have, for the
        // stream permission.
        if active.is_some() {
            for t in engine.topics() {
                t.set_followed(true);
            }
        }
        let topics = active
            .zip(engine.buckets().first().cloned())
            .map(|(rc, b)| {
                crate::topic_replica::TopicFollower::start(
                    engine.clone(),
                    crate::topic_replica::Upstream {
                        active: rc.active.clone(),
                        bucket: b.name().to_string(),
                        username: rc.username.clone(),
                        password: rc.password.clone(),
                        tls: rc.tls.clone(),
                        noop_interval: rc.noop_interval,
                    },
                )
            });
        Followers {
            engine,
            replicators: Mutex::new(replicators),
            topics: Mutex::new(topics),
            clustermap,
            policies: policies.clone(),
            withheld: Mutex::new(BTreeSet::new()),
            changing: Mutex::new(()),
        }
    }

    /// `wanted` without the withheld vbuckets (a replicator left with none is not wanted).
    pub(super) fn without_withheld(
        &self,
        wanted: &[(Arc<Bucket>, ReplicaConfig)],
    ) -> Vec<(Arc<Bucket>, ReplicaConfig)> {
        let withheld = self.withheld.lock();
        wanted
            .iter()
            .filter_map(|(b, c)| {
                let mut c = c.clone();
                if let Some(v) = &mut c.vbuckets {
                    v.retain(|vb| !withheld.contains(&(b.name().to_string(), *vb)));
                    if v.is_empty() {
                        return None;
                    }
                }
                Some((b.clone(), c))
            })
            .collect()
    }

    /// Held by a cluster map's convergence from its `stop_unwanted` to its `start_wanted`.
    pub fn changing(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.changing.lock()
    }

    /// A cluster map's replication: stops the replicators `wanted` has no place for (another
    /// active, other vbuckets), so that no stream applies to vbuckets whose state is about to
    /// change. `start_wanted` starts the rest once the states are set.
    pub fn stop_unwanted(&self, wanted: &[(Arc<Bucket>, ReplicaConfig)]) {
        let wanted = self.without_withheld(wanted);
        let stopped: Vec<Replicator> = {
            let mut running = self.replicators.lock();
            let (keep, stop) = std::mem::take(&mut *running)
                .into_iter()
                .partition(|r| wanted.iter().any(|(b, c)| r.runs(b, c)));
            *running = keep;
            stop
        };
        for mut r in stopped {
            r.stop();
        }
    }

    /// Starts the replicators of `wanted` not running yet.
    pub fn start_wanted(&self, wanted: Vec<(Arc<Bucket>, ReplicaConfig)>) {
        let wanted = self.without_withheld(&wanted);
        let mut running = self.replicators.lock();
        for (b, c) in wanted {
            if !running.iter().any(|r| r.runs(&b, &c)) {
                let address = Some(self.clustermap.kv_address());
                running.push(Replicator::start(
                    self.engine.clone(),
                    b,
                    c,
                    self.policies.clone(),
                    address,
                ));
            }
        }
    }

    /// Whether a replicator follows every replica vbucket (`replica_of`), not a map's share.
    pub fn follows_everything(&self) -> Option<String> {
        self.replicators
            .lock()
            .iter()
            .find(|r| r.config.vbuckets.is_none())
            .map(|r| r.config.active.clone())
    }

    /// Stops following vbucket `vb` of `bucket` until `restore` (a takeover onto this node is
    /// about to stream it); the replicator that followed it goes on with the others.
    pub fn release(&self, bucket: &str, vb: u16) {
        let _changing = self.changing.lock();
        self.withheld.lock().insert((bucket.to_string(), vb));
        let wanted: Vec<(Arc<Bucket>, ReplicaConfig)> = {
            let running = self.replicators.lock();
            running
                .iter()
                .filter_map(|r| Some((self.engine.bucket(&r.bucket).ok()?, r.config.clone())))
                .collect()
        };
        self.stop_unwanted(&wanted);
        self.start_wanted(wanted);
    }

    /// The takeover of `vb` is over: the map may have it followed again.
    pub fn restore(&self, bucket: &str, vb: u16) {
        self.withheld.lock().remove(&(bucket.to_string(), vb));
    }

    /// The replicators running now (none on an active node or after a promotion).
    pub fn running(&self) -> parking_lot::MutexGuard<'_, Vec<Replicator>> {
        self.replicators.lock()
    }

    /// Stops every replicator (the server is stopping, or the node is promoted).
    pub fn stop(&self) {
        for mut r in std::mem::take(&mut *self.replicators.lock()) {
            r.stop();
        }
        if let Some(mut t) = self.topics.lock().take() {
            t.stop();
        }
    }

    /// Failover: stops following the active, then makes every replica vbucket active (each
    /// with a new failover entry). Returns (bucket, vbuckets promoted) per bucket.
    pub fn promote(&self) -> sluice_core::Result<Vec<(String, Vec<u16>)>> {
        self.stop();
        for t in self.engine.topics() {
            t.set_followed(false);
        }
        let mut out = Vec::new();
        for b in self.engine.buckets() {
            let promoted = self.engine.promote(&b)?;
            if !promoted.is_empty() {
                log::warn!(
                    "promoted {} vbucket(s) of bucket {:?} to active",
                    promoted.len(),
                    b.name()
                );
            }
            out.push((b.name().to_string(), promoted));
        }
        self.clustermap.set_active(None);
        self.clustermap.refresh(&self.engine);
        Ok(out)
    }
}
