//! Where a cluster places its topics' partitions: which node leads each (the cluster map's
//! `topics`, set by the cluster side as it converges), so that the TANK front serves the
//! partitions led here and sends the client to the leader of the others, as TANK's clustered
//! broker does. A node on its own, or a topic the map does not name yet, leads every partition
//! itself.

use std::collections::HashMap;
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

/// Who leads a partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lead {
    Here,
    /// Another node, at its TANK listener.
    At(SocketAddrV4),
    /// No node now (its leader failed and no copy may take over).
    Nobody,
}

/// One node of the cluster as DiscoverTopology tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacedNode {
    /// Its position in the map's node list, from 1 (TANK's node ids start there).
    pub id: u16,
    /// Its TANK listener, if it has one.
    pub tank: Option<SocketAddrV4>,
    pub available: bool,
    /// The partitions it holds a copy of (leads or follows).
    pub partitions: u16,
}

/// The placement the map gives: the cluster's name, each topic's leaders by partition, and its
/// nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub cluster: String,
    pub topics: HashMap<String, Vec<Lead>>,
    pub nodes: Vec<PlacedNode>,
}

/// The placement in force, read on every produce and consume (a read lock held for a lookup;
/// a node on its own never takes it).
#[derive(Default)]
pub struct Placements {
    clustered: AtomicBool,
    current: RwLock<Arc<Placement>>,
}

impl Placements {
    /// Puts a new placement in force (the cluster map changed).
    pub fn set(&self, p: Placement) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(p);
        self.clustered.store(true, Ordering::Release);
    }

    /// The placement in force, if the node is in a cluster.
    pub fn current(&self) -> Option<Arc<Placement>> {
        self.clustered.load(Ordering::Acquire).then(|| {
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }

    /// Who leads `partition` of `topic`: here unless the map places it elsewhere.
    pub fn lead(&self, topic: &str, partition: u16) -> Lead {
        if !self.clustered.load(Ordering::Acquire) {
            return Lead::Here;
        }
        let p = self.current.read().unwrap_or_else(|e| e.into_inner());
        match p.topics.get(topic) {
            Some(leads) => leads.get(partition as usize).copied().unwrap_or(Lead::Here),
            None => Lead::Here,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_on_its_own_and_unplaced_topics_lead_here() {
        let p = Placements::default();
        assert_eq!(p.lead("events", 3), Lead::Here);
        assert!(p.current().is_none());
        let there: SocketAddrV4 = "10.0.0.2:11011".parse().unwrap();
        p.set(Placement {
            cluster: "c".into(),
            topics: HashMap::from([(
                "events".to_string(),
                vec![Lead::Here, Lead::At(there), Lead::Nobody],
            )]),
            nodes: Vec::new(),
        });
        assert_eq!(p.lead("events", 0), Lead::Here);
        assert_eq!(p.lead("events", 1), Lead::At(there));
        assert_eq!(p.lead("events", 2), Lead::Nobody);
        assert_eq!(p.lead("other", 1), Lead::Here);
    }
}
