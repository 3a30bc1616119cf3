//! The built-in router of a cluster, for clients that read no map: tarantool-python, net.box
//! and the other iproto connectors, and memcached's text protocol. A request for a key whose
//! vbucket is active on another node is forwarded to that node and answered as if it were
//! served here: the owner's answer (its errors, its durability, after its WAL) under the
//! client's SYNC. An iproto SELECT that is not a point read asks every node for its part (the
//! vbuckets active there), merges the parts in key order and applies OFFSET and LIMIT once; a
//! node that does not answer fails the SELECT, never leaving a silent partial result.
//!
//! The binary memcached protocol is not routed: its clients read the map (NOT_MY_VBUCKET
//! carries it). `iproto_link` and `text_link` are the connections to the other nodes, one per
//! node and protocol, shared by every client connection of this node.

pub mod iproto_link;
pub mod text_link;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};

use crate::metrics::metric;
use sluice_core::vbucket::VbSet;

/// One node of the cluster map, as the router reaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteNode {
    /// Its KV listener (the memcached text protocol is served there).
    pub kv: Option<SocketAddr>,
    /// Its iproto listener, if it has one.
    pub iproto: Option<SocketAddr>,
}

/// Where each vbucket is active, by the map's nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routes {
    /// This node's index among `nodes`, if it is in the map.
    pub this: Option<usize>,
    pub nodes: Vec<RouteNode>,
    /// Per vbucket, the index of the node it is active on (-1: none).
    pub actives: Vec<i32>,
}

impl Routes {
    /// The node `vbucket` is active on, when that is another node.
    pub fn elsewhere(&self, vbucket: u16) -> Option<&RouteNode> {
        let i = *self.actives.get(vbucket as usize)?;
        if i < 0 || Some(i as usize) == self.this {
            return None;
        }
        self.nodes.get(i as usize)
    }

    /// A vbucket among the first `count` that no node is active for (a SELECT over every
    /// vbucket cannot be answered whole then).
    pub fn without_active(&self, count: u16) -> Option<u16> {
        (0..count).find(|&vb| self.actives.get(vb as usize).is_none_or(|&i| i < 0))
    }

    /// The parts of a read over every vbucket: this node's vbuckets (empty when it is active
    /// for none), and each other node some vbucket is active on with its vbuckets.
    pub fn parts(&self) -> (VbSet, Vec<(&RouteNode, VbSet)>) {
        let mut sets = vec![VbSet::default(); self.nodes.len()];
        let mut here = VbSet::default();
        for (vb, &i) in self.actives.iter().enumerate() {
            if i < 0 {
                continue;
            }
            if Some(i as usize) == self.this {
                here.insert(vb as u16);
            } else if let Some(s) = sets.get_mut(i as usize) {
                s.insert(vb as u16);
            }
        }
        let others = self
            .nodes
            .iter()
            .zip(sets)
            .enumerate()
            .filter(|&(i, (_, s))| Some(i) != self.this && s != VbSet::default())
            .map(|(_, (n, s))| (n, s))
            .collect();
        (here, others)
    }
}

/// The login the router's connections use on the other nodes: the nodes' replication login,
/// which a node accepts a forwarded request's user from.
#[derive(Clone, Debug, Default)]
pub struct Login {
    pub username: Option<String>,
    pub password: Option<String>,
}

/// Requests routed, by front (for /metrics).
#[derive(Default)]
pub struct RouterStats {
    pub iproto_forwarded: AtomicU64,
    pub iproto_fanned_out: AtomicU64,
    pub text_forwarded: AtomicU64,
    /// Routed requests that failed because the other node could not be reached or answer.
    pub failed: AtomicU64,
}

#[derive(Default)]
pub struct Router {
    routes: RwLock<Option<Arc<Routes>>>,
    /// Read by each link as it connects: a new password reaches the next connection.
    login: Arc<RwLock<Login>>,
    iproto: Mutex<HashMap<SocketAddr, Arc<iproto_link::Link>>>,
    text: Mutex<HashMap<SocketAddr, Arc<text_link::Link>>>,
    pub stats: RouterStats,
}

impl Router {
    /// Puts a cluster map's routes in force (None: the node left the cluster).
    pub fn set_routes(&self, routes: Option<Routes>) {
        *self.routes.write().unwrap_or_else(|e| e.into_inner()) = routes.map(Arc::new);
    }

    /// The routes in force, if the node is in a cluster.
    pub fn routes(&self) -> Option<Arc<Routes>> {
        self.routes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn set_login(&self, login: Login) {
        *self.login.write().unwrap_or_else(|e| e.into_inner()) = login;
    }

    /// The user the other nodes log in as to forward requests here (the replication login's).
    pub fn login_user(&self) -> Option<String> {
        self.login
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .username
            .clone()
    }

    /// The shared iproto connection to `addr`, opened on first use.
    pub fn iproto(&self, addr: SocketAddr) -> Arc<iproto_link::Link> {
        let mut links = self.iproto.lock().unwrap_or_else(|e| e.into_inner());
        links
            .entry(addr)
            .or_insert_with(|| Arc::new(iproto_link::Link::start(addr, self.login.clone())))
            .clone()
    }

    /// The shared text connection to `addr`, opened on first use.
    pub fn text(&self, addr: SocketAddr) -> Arc<text_link::Link> {
        let mut links = self.text.lock().unwrap_or_else(|e| e.into_inner());
        links
            .entry(addr)
            .or_insert_with(|| Arc::new(text_link::Link::start(addr)))
            .clone()
    }

    pub fn metrics(&self, o: &mut String) {
        metric(
            o,
            "sluice_routed_requests_total",
            "counter",
            "Requests of clients that read no cluster map (iproto, memcached text) this node sent \
             on to the node their key's vbucket is active on (forwarded), or asked every node's \
             part of (an iproto SELECT over every vbucket: fanned_out).",
        );
        let s = &self.stats;
        for (front, how, n) in [
            ("iproto", "forwarded", &s.iproto_forwarded),
            ("iproto", "fanned_out", &s.iproto_fanned_out),
            ("text", "forwarded", &s.text_forwarded),
        ] {
            o.push_str(&format!(
                "sluice_routed_requests_total{{front=\"{front}\",how=\"{how}\"}} {}\n",
                n.load(Relaxed)
            ));
        }
        metric(
            o,
            "sluice_routed_failures_total",
            "counter",
            "Routed requests answered with an error because the node they went to could not be \
             reached or did not answer.",
        );
        o.push_str(&format!(
            "sluice_routed_failures_total {}\n",
            s.failed.load(Relaxed)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_name_the_other_nodes_only() {
        let node = |port| RouteNode {
            kv: Some(SocketAddr::from(([127, 0, 0, 1], port))),
            iproto: None,
        };
        let r = Routes {
            this: Some(1),
            nodes: vec![node(1), node(2), node(3)],
            actives: vec![0, 1, 2, -1, 0],
        };
        assert_eq!(r.elsewhere(0), Some(&node(1)));
        assert_eq!(r.elsewhere(1), None);
        assert_eq!(r.elsewhere(3), None);
        assert_eq!(r.elsewhere(9), None);
        let (here, others) = r.parts();
        let set = |vbs: &[u16]| {
            let mut s = VbSet::default();
            vbs.iter().for_each(|&vb| s.insert(vb));
            s
        };
        assert_eq!(here, set(&[1]));
        assert_eq!(
            others,
            vec![(&node(1), set(&[0, 4])), (&node(3), set(&[2]))]
        );
    }
}
