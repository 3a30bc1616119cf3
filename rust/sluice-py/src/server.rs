//! `Server`: the network server (memcached binary protocol, DCP, TAP, admin HTTP) over an open
//! engine, with its users and the policy plugins' side of the host.

use std::sync::Arc;

use pyo3::prelude::*;
use sluice_server::policy::PolicyHost;

use crate::engine::EmbeddedEngine;
use crate::errors::{config_err, to_py, ClosedError, ConfigError, SluiceError};
use crate::policy;
use crate::settings::{secs, socket_addr, BUCKET_DEFAULTS};

/// The Greenstack port while the engine opens: it takes connections, answers HELLO and tells
/// them the server is warming up; `Server(..., greenstack_warmup=)` takes it over and tells
/// them warm-up is done.
/// Checks the server's settings as `Server` does when it starts, loading the TLS certificate
/// and key they name, without binding anything: what `sluice config check` runs. `max_item`:
/// the largest item any bucket takes; `replica`: whether the node starts as a replica.
#[pyfunction]
pub(crate) fn check_server_settings(
    settings: &str,
    max_item: usize,
    replica: bool,
) -> PyResult<()> {
    let checked = sluice_server::settings::Settings::from_json(settings)
        .and_then(|s| s.check(max_item, replica))
        .map_err(|e| ConfigError::new_err(e.to_string()))?;
    if let Some(t) = checked.config.tls {
        sluice_server::tls::ReloadableTls::load(t)
            .map_err(|e| ConfigError::new_err(format!("invalid config: {e}")))?;
    }
    Ok(())
}

/// A topic partition as the cluster side places it: (leader, copies, copies in sync, the
/// leader's KV address when this node copies it, whether this node's copy is in sync).
type PlacedPartition = (String, u8, u8, String, bool);

#[pyclass(module = "sluice._native", frozen)]
pub(crate) struct GreenstackWarmup {
    inner: parking_lot::Mutex<Option<sluice_server::greenstack::Warmup>>,
    address: String,
}

#[pymethods]
impl GreenstackWarmup {
    #[new]
    fn new(address: &str) -> PyResult<Self> {
        let addr = socket_addr("greenstack_listen", address)?;
        let warmup = sluice_server::greenstack::Warmup::start(addr)
            .map_err(|e| SluiceError::new_err(format!("cannot listen: {e}")))?;
        Ok(GreenstackWarmup {
            address: warmup.local_addr().to_string(),
            inner: parking_lot::Mutex::new(Some(warmup)),
        })
    }

    /// The address bound (a port 0 becomes the real one).
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }
}

impl GreenstackWarmup {
    fn take(&self) -> PyResult<sluice_server::greenstack::Warmup> {
        self.inner
            .lock()
            .take()
            .ok_or_else(|| SluiceError::new_err("this warm-up was taken over by a Server already"))
    }
}

/// The network server (memcached binary protocol) over an open engine.
#[pyclass(module = "sluice._native", frozen)]
pub(crate) struct Server {
    inner: parking_lot::Mutex<Option<sluice_server::Server>>,
    address: String,
    admin_address: Option<String>,
    tls_address: Option<String>,
    /// The registered fronts that listen: name -> "HOST:PORT" bound, in plain and with TLS.
    fronts: std::collections::BTreeMap<String, String>,
    tls_fronts: std::collections::BTreeMap<String, String>,
    policies: Arc<PolicyHost>,
}

type UserSpec = sluice_server::settings::UserSpec;

/// The users as `sluice_server` checks them; a refusal names its key.
fn users_of(specs: Vec<UserSpec>) -> PyResult<sluice_server::auth::Users> {
    sluice_server::settings::users_of(specs).map_err(|e| ConfigError::new_err(e.to_string()))
}

#[pymethods]
impl Server {
    /// Starts serving with `settings`, the server's settings as JSON (config.py's
    /// `Config.server_settings`; keys it leaves out take their defaults), checked here once;
    /// a refused one raises ConfigError naming its key, a listener that cannot bind
    /// SluiceError. `greenstack_warmup`: the Greenstack port opened while the engine recovered.
    #[new]
    #[pyo3(signature = (engine, settings, *, greenstack_warmup=None))]
    fn new(
        py: Python<'_>,
        engine: &EmbeddedEngine,
        settings: &str,
        greenstack_warmup: Option<&GreenstackWarmup>,
    ) -> PyResult<Self> {
        let config_error =
            |e: sluice_server::settings::SettingsError| ConfigError::new_err(e.to_string());
        let max_item = engine
            .engine
            .buckets()
            .iter()
            .map(|b| b.config.max_item_size)
            .max()
            .unwrap_or(BUCKET_DEFAULTS.max_item_size);
        let checked = sluice_server::settings::Settings::from_json(settings)
            .and_then(|s| s.check(max_item, engine.engine.config().replica))
            .map_err(config_error)?;
        let policies = Arc::new(PolicyHost::default());
        policies.set_timeout(checked.policy_timeout);
        let config = checked.config;
        let e = engine.engine.clone();
        let host = policies.clone();
        let warmup = greenstack_warmup.map(GreenstackWarmup::take).transpose()?;
        let server = crate::logging::detach_command(py, || {
            let prebound = match warmup {
                Some(w) => vec![w.into_prebound()?],
                None => Vec::new(),
            };
            sluice_server::Server::start_with(
                e,
                config,
                host,
                prebound,
                sluice_server::server::FRONTS,
            )
        })
        .map_err(|err| {
            use std::io::ErrorKind::{AddrInUse, AddrNotAvailable, InvalidInput};
            match err.kind() {
                InvalidInput => ConfigError::new_err(format!("invalid config: {err}")),
                // A listener that cannot bind names itself, its address and its key.
                AddrInUse | AddrNotAvailable => {
                    SluiceError::new_err(format!("cannot listen: {err}"))
                }
                // A file it could not write (the admin token on a full disk) names itself.
                _ => SluiceError::new_err(format!("cannot start: {err}")),
            }
        })?;
        let address = server.local_addr().to_string();
        let admin_address = server.admin_addr().map(|a| a.to_string());
        let tls_address = server.tls_addr().map(|a| a.to_string());
        let bound = |addr: fn(&sluice_server::front::Running) -> Option<std::net::SocketAddr>| {
            server
                .fronts()
                .iter()
                .filter_map(|r| Some((r.declaration.name.to_string(), addr(r)?.to_string())))
                .collect()
        };
        let fronts = bound(|r| r.addr);
        let tls_fronts = bound(|r| r.tls_addr);
        Ok(Server {
            fronts,
            tls_fronts,
            inner: parking_lot::Mutex::new(Some(server)),
            address,
            admin_address,
            tls_address,
            policies,
        })
    }

    /// Starts accepting client connections (held with `hold_connections=True`).
    fn accept_connections(&self) -> PyResult<()> {
        match self.inner.lock().as_ref() {
            Some(s) => {
                s.accept_connections();
                Ok(())
            }
            None => Err(ClosedError::new_err("the server is stopped")),
        }
    }

    /// Installs (True) or removes (False) the plugin for a policy kind ("ack", "retransmit",
    /// "slow_consumer", "filter"). Without one the native default decides, with no Python call.
    fn policy_install(&self, kind: &str, installed: bool) -> PyResult<()> {
        self.policies
            .set_installed(policy::kind_of(kind)?, installed);
        Ok(())
    }

    /// How long the server waits for a plugin's answer before using the default.
    fn policy_set_timeout(&self, seconds: f64) -> PyResult<()> {
        self.policies.set_timeout(secs("policy.timeout", seconds)?);
        Ok(())
    }

    /// The next question for a plugin, waiting up to `wait` seconds (GIL released); None if
    /// none came.
    #[pyo3(signature = (kind, wait=0.5))]
    fn policy_next(
        &self,
        py: Python<'_>,
        kind: &str,
        wait: f64,
    ) -> PyResult<Option<policy::PolicyCall>> {
        Ok(policy::next_call(
            py,
            &self.policies,
            policy::kind_of(kind)?,
            wait,
        ))
    }

    /// "HOST:PORT" actually bound.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// Replaces the users and permissions (SIGHUP); connections see them on their next request.
    fn set_users(&self, users: Vec<UserSpec>) -> PyResult<()> {
        let users = users_of(users)?;
        if let Some(s) = self.inner.lock().as_ref() {
            s.set_users(users);
        }
        Ok(())
    }

    /// "HOST:PORT" of each registered front that listens in plain, by its name ("memcached",
    /// "iproto", "tank", "greenstack").
    #[getter]
    fn fronts(&self) -> std::collections::BTreeMap<String, String> {
        self.fronts.clone()
    }

    /// "HOST:PORT" of each registered front's TLS listener that runs, by the front's name.
    #[getter]
    fn tls_fronts(&self) -> std::collections::BTreeMap<String, String> {
        self.tls_fronts.clone()
    }

    /// "HOST:PORT" of the TLS KV listener, if it runs.
    #[getter]
    fn tls_address(&self) -> Option<&str> {
        self.tls_address.as_deref()
    }

    /// Reads the TLS certificate and key again (SIGHUP): connections accepted afterwards get
    /// them. Returns False when no TLS is configured; raises ConfigError (the old certificate
    /// stays in use) when the files cannot be used.
    fn reload_tls(&self, py: Python<'_>) -> PyResult<bool> {
        let guard = self.inner.lock();
        let Some(s) = guard.as_ref() else {
            return Err(ClosedError::new_err("the server is stopped"));
        };
        py.detach(|| s.reload_tls())
            .map_err(|e| ConfigError::new_err(format!("invalid config: {e}")))
    }

    /// "HOST:PORT" of the admin endpoint (/metrics, /status), if it runs.
    #[getter]
    fn admin_address(&self) -> Option<&str> {
        self.admin_address.as_deref()
    }

    /// Failover: stops following the active and makes every replica vbucket active. Returns
    /// {bucket: [vbuckets promoted]}.
    fn promote(&self, py: Python<'_>) -> PyResult<std::collections::BTreeMap<String, Vec<u16>>> {
        let followers = match self.inner.lock().as_ref() {
            Some(s) => s.followers(),
            None => return Err(ClosedError::new_err("the server is stopped")),
        };
        let done = py.detach(|| followers.promote()).map_err(to_py)?;
        Ok(done.into_iter().collect())
    }

    /// Converges on a cluster map: `servers` are the nodes' KV addresses ("HOST:PORT"), `this`
    /// this node's index among them (None: it is not in the map), `chains` every vbucket's
    /// active then replicas (indexes into `servers`, -1 for none), `rev` the map's revision,
    /// served to clients. Returns what changed: {"promoted": [(bucket, vb)], "activated",
    /// "to_replica", "to_dead", "refused", "streams": [(bucket, active, [vb])]}.
    fn converge<'py>(
        &self,
        py: Python<'py>,
        rev: i64,
        servers: Vec<String>,
        this: Option<usize>,
        chains: Vec<Vec<i32>>,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let mut endpoints = Vec::with_capacity(servers.len());
        for s in &servers {
            endpoints.push(
                sluice_server::clustermap::Endpoint::parse(s, None).ok_or_else(|| {
                    SluiceError::new_err(format!("cluster map: bad server address {s:?}"))
                })?,
            );
        }
        if this.is_some_and(|t| t >= servers.len()) {
            return Err(config_err(
                "cluster map",
                "this node's index is beyond the servers",
            ));
        }
        if let Some(bad) = chains
            .iter()
            .flatten()
            .find(|&&i| i < -1 || i >= servers.len() as i32)
        {
            return Err(SluiceError::new_err(format!(
                "cluster map: a chain names server {bad}, beyond the servers"
            )));
        }
        let map = sluice_server::clustermap::Assigned {
            rev,
            servers: endpoints,
            this,
            chains,
        };
        let member = self.member()?;
        let done = py.detach(|| member.converge(map)).map_err(to_py)?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("promoted", done.promoted)?;
        d.set_item("activated", done.activated)?;
        d.set_item("to_replica", done.to_replica)?;
        d.set_item("to_dead", done.to_dead)?;
        d.set_item("refused", done.refused)?;
        d.set_item("streams", done.streams)?;
        Ok(d)
    }

    /// What the cluster side sees of the cluster (a JSON object: nodes_up, failed_over,
    /// orchestrator, orchestrator_here, rebalance {state, done, total}), shown by /status and
    /// /metrics.
    fn report_cluster(&self, report: &str) -> PyResult<()> {
        let value: serde_json::Value = serde_json::from_str(report)
            .map_err(|e| SluiceError::new_err(format!("cluster report: {e}")))?;
        match self.inner.lock().as_ref() {
            Some(s) => {
                s.report_cluster(value);
                Ok(())
            }
            None => Err(ClosedError::new_err("the server is stopped")),
        }
    }

    /// Puts the cluster map's topic placement in force: `topics` gives each topic's partitions
    /// in order as (leader: "here", the leader's TANK address "IPv4:PORT", "" while none
    /// leads it, or "handing over" on the leader of a partition whose leader changes, which
    /// takes no messages and still streams the partition to its copies; its copies; those in
    /// sync; the leader's KV address when this node holds a copy it does not lead, else "";
    /// whether this node's copy is in sync, its acknowledgements counting toward produces);
    /// `nodes` the map's nodes in order: (TANK address or "", whether it is available, how
    /// many partitions it holds a copy of). The copies this node holds are streamed from their
    /// leaders (logging in to `bucket` with the replication login) before the new leaders are
    /// in force.
    fn place_topics(
        &self,
        py: Python<'_>,
        cluster: String,
        bucket: String,
        topics: std::collections::HashMap<String, Vec<PlacedPartition>>,
        nodes: Vec<(String, bool, u16)>,
    ) -> PyResult<()> {
        use sluice_server::topic_placement::{Lead, Placed, PlacedNode, Placement};
        let address = |a: &str| {
            a.parse::<std::net::SocketAddrV4>().map_err(|_| {
                ConfigError::new_err(format!(
                    "a TANK address in the cluster map is {a:?}, not IPv4:PORT (TANK's clients \
                     are sent to a leader by its IPv4 address)"
                ))
            })
        };
        let mut placement = Placement {
            cluster,
            ..Placement::default()
        };
        let mut copied: std::collections::HashMap<(String, String, bool), Vec<u16>> =
            std::collections::HashMap::new();
        for (topic, parts) in topics {
            let mut placed = Vec::with_capacity(parts.len());
            for (p, (lead, copies, in_sync, copy_from, counted)) in parts.iter().enumerate() {
                let handing_over = lead == "handing over";
                let lead = match lead.as_str() {
                    "here" => Lead::Here,
                    "" | "handing over" => Lead::Nobody,
                    a => Lead::At(address(a)?),
                };
                placed.push(Placed {
                    lead,
                    copies: *copies,
                    in_sync: *in_sync,
                    copy_here: !copy_from.is_empty() || handing_over,
                });
                if !copy_from.is_empty() {
                    copied
                        .entry((topic.clone(), copy_from.clone(), *counted))
                        .or_default()
                        .push(p as u16);
                }
            }
            placement.topics.insert(topic, placed);
        }
        for (i, (tank, available, partitions)) in nodes.into_iter().enumerate() {
            placement.nodes.push(PlacedNode {
                id: i as u16 + 1,
                tank: if tank.is_empty() {
                    None
                } else {
                    Some(address(&tank)?)
                },
                available,
                partitions,
            });
        }
        let member = self.member()?;
        let replication = member.replication.clone();
        let upstream = sluice_server::topic_replica::Upstream {
            active: String::new(),
            bucket,
            username: replication.username,
            password: replication.password,
            tls: replication.tls,
            noop_interval: replication.noop_interval,
        };
        let name = member.engine.instance().to_string();
        py.detach(|| {
            member.topic_copies.place(
                &member.engine,
                &member.clustermap.topics,
                &upstream,
                &name,
                copied,
                placement,
            )
        });
        Ok(())
    }

    /// Puts the cluster map's routes in force for the clients that read no map (iproto and
    /// memcached text): `nodes` the map's nodes in order as (KV address, iproto address or
    /// ""), `actives` per vbucket the index of the node it is active on (-1: none), `this`
    /// this node's index. The router logs in to the others with the replication login.
    fn route(
        &self,
        this: Option<usize>,
        nodes: Vec<(String, String)>,
        actives: Vec<i32>,
    ) -> PyResult<()> {
        use sluice_server::router::{Login, RouteNode, Routes};
        let address = |a: &str| -> PyResult<Option<std::net::SocketAddr>> {
            if a.is_empty() {
                return Ok(None);
            }
            match std::net::ToSocketAddrs::to_socket_addrs(a) {
                Ok(mut found) => Ok(found.next()),
                Err(e) => Err(SluiceError::new_err(format!(
                    "cluster map: the address {a:?} does not resolve: {e}"
                ))),
            }
        };
        let mut routed = Vec::with_capacity(nodes.len());
        for (kv, iproto) in &nodes {
            routed.push(RouteNode {
                kv: address(kv)?,
                iproto: address(iproto)?,
            });
        }
        let member = self.member()?;
        let router = &member.clustermap.router;
        router.set_login(Login {
            username: member.replication.username.clone(),
            password: member.replication.password.clone(),
        });
        router.set_routes(Some(Routes {
            this,
            nodes: routed,
            actives,
        }));
        Ok(())
    }

    /// What the admin endpoint asked of the cluster since the last call ("rebalance"), for
    /// the cluster side to write to etcd.
    fn take_cluster_requests(&self) -> PyResult<Vec<String>> {
        Ok(self.member()?.clustermap.take_requests())
    }

    /// Per vbucket of `bucket` here, the KV addresses of the replicas that follow it: those
    /// whose streams registered, what majority writes count ("" where a replica did not say).
    fn followers(&self, bucket: &str) -> PyResult<Vec<Vec<String>>> {
        let member = self.member()?;
        let b = member.engine.bucket(bucket).map_err(to_py)?;
        Ok((0..b.num_vbuckets())
            .map(|vb| {
                b.acks
                    .following(vb)
                    .iter()
                    .map(|f| {
                        member
                            .clustermap
                            .replica_address(&f.name)
                            .unwrap_or_default()
                    })
                    .collect()
            })
            .collect())
    }

    /// Moves vbucket `vbucket` of `bucket` here from the node at `source` ("HOST:PORT") by a
    /// takeover stream. Returns {"items", "seconds", "writes_paused_ms", "high_seqno"}.
    #[pyo3(signature = (bucket, vbucket, source, timeout=60.0))]
    fn take_over<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        vbucket: u16,
        source: &str,
        timeout: f64,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let timeout = secs("timeout", timeout)?;
        let member = self.member()?;
        let b = member.engine.bucket(bucket).map_err(to_py)?;
        // The server is not held meanwhile: the map may change, the node may be stopped.
        let r = py
            .detach(|| member.take_over(&b, vbucket, source, timeout))
            .map_err(SluiceError::new_err)?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("items", r.items)?;
        d.set_item("seconds", r.seconds)?;
        d.set_item("writes_paused_ms", r.writes_paused_ms)?;
        d.set_item("high_seqno", r.high_seqno)?;
        Ok(d)
    }

    /// Stops accepting, lets connections finish what they hold (up to `grace` seconds), stops.
    #[pyo3(signature = (grace=5.0))]
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = secs("grace", grace)?;
        let server = self.inner.lock().take();
        if let Some(mut s) = server {
            crate::logging::detach_command(py, move || s.shutdown(grace));
        }
        Ok(())
    }
}

impl Server {
    /// The node's parts a cluster map changes, taken without keeping the server locked.
    fn member(&self) -> PyResult<sluice_server::cluster::Member> {
        match self.inner.lock().as_ref() {
            Some(s) => Ok(s.member()),
            None => Err(ClosedError::new_err("the server is stopped")),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut s) = self.inner.lock().take() {
            // SAFETY: a read-only query of the interpreter's state.
            if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
                Python::attach(|py| {
                    py.detach(move || s.shutdown(std::time::Duration::from_secs(5)))
                });
            } else {
                s.shutdown(std::time::Duration::from_secs(5));
            }
        }
    }
}
