//! Where a cluster places its topics' partitions: which node leads each (the cluster map's
//! `topics`, set by the cluster side as it converges), so that the TANK front serves the
//! partitions led here and sends the client to the leader of the others, as TANK's clustered
//! broker does. A node on its own leads every partition itself; in a cluster, a partition the
//! map does not place yet has no leader (TANK's 0xfd, which its client retries), so that a
//! message is never taken by a node the placement then makes a copy. With each leader, the map gives the partition's copies and how many of them are in
//! sync, which a produce's `required acks` is counted against.

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
    /// No node now (its leader failed and no copy may take over, or the map places it
    /// nowhere yet).
    Nobody,
}

/// One partition as the map places it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub lead: Lead,
    /// Its copies, the leader's among them (TANK's replication factor).
    pub copies: u8,
    /// The copies in sync (the leader's among them): holding every message acknowledged with
    /// acks from all of them, and the only ones a failover may promote.
    pub in_sync: u8,
    /// This node holds a copy it does not lead (a copy, or the leader of a partition whose
    /// leader changes, which streams it to its copies until the new leader leads).
    pub copy_here: bool,
}

impl Placed {
    /// A partition of a node on its own.
    pub const HERE: Placed = Placed {
        lead: Lead::Here,
        copies: 1,
        in_sync: 1,
        copy_here: false,
    };

    /// A partition of a cluster's topic the map does not place yet.
    pub const UNPLACED: Placed = Placed {
        lead: Lead::Nobody,
        ..Placed::HERE
    };

    /// How many copies besides the leader must hold a produced bundle before it is
    /// acknowledged, for a produce's `required acks`, as TANK's clustered broker counts them:
    /// 0 asks for every copy in sync, 255 for a majority of the copies in sync (the leader one
    /// of them), N for N. None when the partition has too few copies for that (TANK's error
    /// "insufficient replicas").
    pub fn peers_needed(&self, required_acks: u8) -> Option<usize> {
        let in_sync = self.in_sync.max(1) as usize;
        match required_acks {
            0 => Some(in_sync - 1),
            255 => Some(in_sync / 2),
            n if n > 200 => None,
            n => {
                let n = n as usize;
                (n < self.copies as usize && n < in_sync).then_some(n)
            }
        }
    }
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
    pub topics: HashMap<String, Vec<Placed>>,
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

    /// The partitions `next` makes this node lead that the placement in force does not (all
    /// it leads, after the empty placement a node of a cluster starts with). Each
    /// starts a branch of its history (`Engine::start_topic_branch`) before `next` is in
    /// force, so that a copy holding messages this node never had is cut back to its end.
    pub fn newly_led(&self, next: &Placement) -> Vec<(String, u16)> {
        let now = self.current();
        let mut led = Vec::new();
        for (topic, parts) in &next.topics {
            for (p, placed) in parts.iter().enumerate() {
                let was_here = now.as_ref().is_some_and(|now| {
                    now.topics
                        .get(topic)
                        .and_then(|parts| parts.get(p))
                        .is_some_and(|before| before.lead == Lead::Here)
                });
                if placed.lead == Lead::Here && !was_here {
                    led.push((topic.clone(), p as u16));
                }
            }
        }
        led
    }

    /// Who leads `partition` of `topic`: here on a node on its own; in a cluster, who the map
    /// says, or nobody yet.
    pub fn lead(&self, topic: &str, partition: u16) -> Lead {
        self.placed(topic, partition).lead
    }

    /// Where the map places `partition` of `topic`: here, alone, on a node on its own; in a
    /// cluster, where the map says (`Placed::UNPLACED` before it places it).
    pub fn placed(&self, topic: &str, partition: u16) -> Placed {
        if !self.clustered.load(Ordering::Acquire) {
            return Placed::HERE;
        }
        let p = self.current.read().unwrap_or_else(|e| e.into_inner());
        p.topics
            .get(topic)
            .and_then(|parts| parts.get(partition as usize).copied())
            .unwrap_or(Placed::UNPLACED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_on_its_own_leads_and_a_cluster_leads_what_its_map_places() {
        let p = Placements::default();
        assert_eq!(p.lead("events", 3), Lead::Here);
        assert!(p.current().is_none());
        let there: SocketAddrV4 = "10.0.0.2:11011".parse().unwrap();
        p.set(Placement {
            cluster: "c".into(),
            topics: HashMap::from([(
                "events".to_string(),
                [Lead::Here, Lead::At(there), Lead::Nobody]
                    .map(|lead| Placed {
                        lead,
                        ..Placed::HERE
                    })
                    .to_vec(),
            )]),
            nodes: Vec::new(),
        });
        assert_eq!(p.lead("events", 0), Lead::Here);
        assert_eq!(p.lead("events", 1), Lead::At(there));
        assert_eq!(p.lead("events", 2), Lead::Nobody);
        // A topic the map does not place yet is led by no node until it does.
        assert_eq!(p.lead("other", 1), Lead::Nobody);
        // Partition 1 comes to be led here; 0 was already.
        let mut next = p.current().unwrap().as_ref().clone();
        next.topics.get_mut("events").unwrap()[1].lead = Lead::Here;
        assert_eq!(p.newly_led(&next), vec![("events".to_string(), 1)]);
        assert_eq!(Placements::default().newly_led(&next).len(), 2);
    }

    #[test]
    fn required_acks_count_as_tanks_broker_counts_them() {
        let three = |in_sync| Placed {
            lead: Lead::Here,
            copies: 3,
            in_sync,
            copy_here: false,
        };
        // 0: every copy in sync; a copy out of sync is not waited for.
        assert_eq!(three(3).peers_needed(0), Some(2));
        assert_eq!(three(2).peers_needed(0), Some(1));
        assert_eq!(Placed::HERE.peers_needed(0), Some(0));
        // 255: a majority of those in sync, the leader one of them.
        assert_eq!(three(3).peers_needed(255), Some(1));
        assert_eq!(three(1).peers_needed(255), Some(0));
        // N: N copies, which must exist and be in sync.
        assert_eq!(three(3).peers_needed(2), Some(2));
        assert_eq!(three(3).peers_needed(3), None);
        assert_eq!(three(2).peers_needed(2), None);
        assert_eq!(three(3).peers_needed(201), None);
    }
}
