//! `Server`: the network server (memcached binary protocol, DCP, TAP, admin HTTP) over an open
//! engine, with its users and the policy plugins' side of the host.

use std::path::PathBuf;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use pyo3::prelude::*;
use sluice_server::limits::LoginLimits;
use sluice_server::policy::PolicyHost;
use sluice_server::tap::producer::TapConfig;

use crate::engine::EmbeddedEngine;
use crate::errors::{config_err, to_py, ClosedError, ConfigError, SluiceError};
use crate::policy;
use crate::settings::{secs, socket_addr, BUCKET_DEFAULTS};

/// sluice-server's defaults, the one definition of each: the keyword defaults of `Server` and
/// `DEFAULTS`, which config.py reads, both come from here.
pub(crate) static TAP_DEFAULTS: LazyLock<TapConfig> = LazyLock::new(TapConfig::default);
pub(crate) static LOGIN_DEFAULTS: LazyLock<LoginLimits> = LazyLock::new(LoginLimits::default);
pub(crate) static POLICY_TIMEOUT: LazyLock<Duration> =
    LazyLock::new(|| PolicyHost::default().timeout());

pub(crate) use sluice_server::config::defaults::{
    IDLE_TIMEOUT, IO_THREADS, MAX_CONNECTIONS, REPLICATION_NOOP_INTERVAL, REPLICATION_TLS,
    TLS_ADMIN,
};

/// The Greenstack port while the engine opens: it takes connections, answers HELLO and tells
/// them the server is warming up; `Server(..., greenstack_warmup=)` takes it over and tells
/// them warm-up is done.
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
    iproto_address: Option<String>,
    tank_address: Option<String>,
    greenstack_address: Option<String>,
    policies: Arc<PolicyHost>,
}

/// (name, id, bucket, [(field name, type, is_nullable)], [0-based key fields]) from the
/// validated configuration (config.py's `Config.space_list`).
type SpaceSpec = (String, u32, String, Vec<(String, String, bool)>, Vec<u32>);

fn spaces_of(specs: Vec<SpaceSpec>) -> Vec<sluice_server::iproto::SpaceConfig> {
    specs
        .into_iter()
        .map(
            |(name, id, bucket, format, primary_key)| sluice_server::iproto::SpaceConfig {
                name,
                id,
                bucket,
                format: format
                    .into_iter()
                    .map(
                        |(name, field_type, is_nullable)| sluice_server::iproto::FieldConfig {
                            name,
                            field_type,
                            is_nullable,
                        },
                    )
                    .collect(),
                primary_key,
            },
        )
        .collect()
}

type UserSpec = (
    String,
    std::collections::HashMap<String, String>,
    std::collections::HashMap<String, Vec<String>>,
);

/// (name, {credential key: value}, {bucket: [permission, ...]}) from the validated
/// configuration; the credential keys are those of [users.NAME] (password_hash, scram_sha512,
/// scram_sha256, scram_sha1).
fn users_of(specs: Vec<UserSpec>) -> PyResult<sluice_server::auth::Users> {
    let mut users = Vec::with_capacity(specs.len());
    for (name, given, buckets) in specs {
        let mut credentials = sluice_server::auth::Credentials::default();
        for (key, value) in given {
            credentials
                .add(&key, &value)
                .map_err(|e| config_err(&format!("users.{name}.{key}"), e))?;
        }
        // guest (iproto's unauthenticated sessions) has permissions only.
        if credentials.is_empty() && name != sluice_server::auth::GUEST {
            return Err(config_err(
                &format!("users.{name}"),
                "no credentials: put the output of `sluice user hash` under it",
            ));
        }
        let mut perms = std::collections::HashMap::new();
        for (bucket, names) in buckets {
            let mut bits = 0;
            for p in names {
                bits |= sluice_server::auth::permission(&p).ok_or_else(|| {
                    config_err(
                        &format!("users.{name}.buckets.{bucket}"),
                        format!("unknown permission {p:?}"),
                    )
                })?;
            }
            perms.insert(bucket, bits);
        }
        users.push(sluice_server::auth::User {
            name,
            credentials,
            buckets: perms,
        });
    }
    Ok(sluice_server::auth::Users::new(users))
}

#[pymethods]
impl Server {
    /// Binds `listen` ("HOST:PORT", port 0 for any) and starts serving; binding errors raise here.
    #[new]
    #[pyo3(signature = (engine, listen, *, admin_listen=None, users=Vec::new(), max_connections=MAX_CONNECTIONS, idle_timeout=IDLE_TIMEOUT.as_secs_f64(), io_threads=IO_THREADS, replica_of=None, replication_user=None, replication_password=None, replication_noop_interval=REPLICATION_NOOP_INTERVAL, tap_ack_interval=TAP_DEFAULTS.ack_interval, tap_ack_window=TAP_DEFAULTS.ack_window, tap_grace_period=TAP_DEFAULTS.grace_period.as_secs_f64(), tap_backoff=TAP_DEFAULTS.backoff.as_secs_f64(), tap_ttl=TAP_DEFAULTS.ttl, tap_max_sessions=TAP_DEFAULTS.max_sessions, tap_max_unacked_bytes=TAP_DEFAULTS.max_unacked_bytes, max_unauthenticated=LOGIN_DEFAULTS.max_unauthenticated, max_unauthenticated_per_ip=LOGIN_DEFAULTS.max_unauthenticated_per_ip, login_timeout=LOGIN_DEFAULTS.login_timeout.as_secs_f64(), policy_timeout=POLICY_TIMEOUT.as_secs_f64(), tls_listen=None, tls_certificate=None, tls_key=None, tls_client_ca=None, tls_admin=TLS_ADMIN, replication_tls=REPLICATION_TLS, replication_ca=None, replication_certificate=None, replication_key=None, iproto_listen=None, tank_listen=None, greenstack_listen=None, spaces=Vec::new(), tarantool_upstream=None, tarantool_upstream_user=None, tarantool_upstream_password=None, tarantool_upstream_spaces=Vec::new(), tarantool_upstream_anonymous=true, greenstack_warmup=None, hold_connections=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: &EmbeddedEngine,
        listen: &str,
        admin_listen: Option<&str>,
        users: Vec<UserSpec>,
        max_connections: usize,
        idle_timeout: f64,
        io_threads: usize,
        replica_of: Option<&str>,
        replication_user: Option<String>,
        replication_password: Option<String>,
        replication_noop_interval: u32,
        tap_ack_interval: u32,
        tap_ack_window: u32,
        tap_grace_period: f64,
        tap_backoff: f64,
        tap_ttl: u8,
        tap_max_sessions: usize,
        tap_max_unacked_bytes: usize,
        max_unauthenticated: usize,
        max_unauthenticated_per_ip: usize,
        login_timeout: f64,
        policy_timeout: f64,
        tls_listen: Option<&str>,
        tls_certificate: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_client_ca: Option<PathBuf>,
        tls_admin: bool,
        replication_tls: bool,
        replication_ca: Option<PathBuf>,
        replication_certificate: Option<PathBuf>,
        replication_key: Option<PathBuf>,
        iproto_listen: Option<&str>,
        tank_listen: Option<&str>,
        greenstack_listen: Option<&str>,
        spaces: Vec<SpaceSpec>,
        tarantool_upstream: Option<&str>,
        tarantool_upstream_user: Option<String>,
        tarantool_upstream_password: Option<String>,
        tarantool_upstream_spaces: Vec<String>,
        tarantool_upstream_anonymous: bool,
        greenstack_warmup: Option<&GreenstackWarmup>,
        hold_connections: bool,
    ) -> PyResult<Self> {
        let tls = match (tls_certificate, tls_key) {
            (Some(certificate), Some(key)) => Some(sluice_server::tls::TlsSettings {
                certificate,
                key,
                client_ca: tls_client_ca,
                admin: tls_admin,
            }),
            (None, None) => {
                if tls_client_ca.is_some() {
                    return Err(config_err(
                        "tls.client_ca",
                        "needs tls.certificate and tls.key (the TLS listener's own certificate)",
                    ));
                }
                None
            }
            (Some(_), None) => return Err(config_err("tls.key", "required with tls.certificate")),
            (None, Some(_)) => return Err(config_err("tls.certificate", "required with tls.key")),
        };
        let tls_listen = tls_listen
            .filter(|a| !a.is_empty())
            .map(|a| socket_addr("tls_listen", a))
            .transpose()?;
        if tls_listen.is_some() && tls.is_none() {
            return Err(config_err(
                "tls_listen",
                "set, but no certificate is configured (tls.certificate, tls.key)",
            ));
        }
        let replication_tls = if replication_tls {
            let ca = replication_ca.ok_or_else(|| {
                config_err(
                    "replication.ca",
                    "required with replication.tls: the CA the active's certificate must chain to",
                )
            })?;
            let identity = match (&replication_certificate, &replication_key) {
                (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
                (None, None) => None,
                (Some(_), None) => {
                    return Err(config_err(
                        "replication.key",
                        "required with replication.certificate",
                    ))
                }
                (None, Some(_)) => {
                    return Err(config_err(
                        "replication.certificate",
                        "required with replication.key",
                    ))
                }
            };
            Some(
                sluice_server::tls::ClientTls::load("replication", &ca, identity)
                    .map_err(|e| ConfigError::new_err(format!("invalid config: {e}")))?,
            )
        } else {
            for (key, v) in [
                ("replication.ca", &replication_ca),
                ("replication.certificate", &replication_certificate),
                ("replication.key", &replication_key),
            ] {
                if v.is_some() {
                    return Err(config_err(key, "set, but replication.tls is false"));
                }
            }
            None
        };
        if tap_ack_interval == 0 {
            return Err(config_err("tap.ack_interval", "must be at least 1"));
        }
        if tap_ack_window == 0 {
            return Err(config_err("tap.ack_window", "must be at least 1"));
        }
        if !(1..=sluice_core::item::MAX_TAP_HOPS).contains(&tap_ttl) {
            return Err(config_err("tap.ttl", "must be 1 to 31 hops"));
        }
        let tap = TapConfig {
            ack_interval: tap_ack_interval,
            ack_window: tap_ack_window,
            grace_period: secs("tap.grace_period", tap_grace_period)?,
            backoff: secs("tap.backoff", tap_backoff)?,
            ttl: tap_ttl,
            max_sessions: tap_max_sessions,
            max_unacked_bytes: tap_max_unacked_bytes,
        };
        if tap_max_sessions == 0 {
            return Err(config_err("tap.max_sessions", "must be at least 1"));
        }
        if tap_max_unacked_bytes < 64 << 10 {
            return Err(config_err(
                "tap.max_unacked_bytes",
                "must be at least 64 KiB",
            ));
        }
        if max_unauthenticated == 0 {
            return Err(config_err("max_unauthenticated", "must be at least 1"));
        }
        if max_unauthenticated_per_ip == 0 {
            return Err(config_err(
                "max_unauthenticated_per_ip",
                "must be at least 1",
            ));
        }
        let login = LoginLimits {
            max_unauthenticated,
            max_unauthenticated_per_ip,
            login_timeout: secs("login_timeout", login_timeout)?,
        };
        if login.login_timeout.is_zero() {
            return Err(config_err("login_timeout", "must be more than 0"));
        }
        let policies = Arc::new(PolicyHost::default());
        policies.set_timeout(secs("policy.timeout", policy_timeout)?);
        if !(1..=10800).contains(&replication_noop_interval) {
            return Err(config_err(
                "replication.noop_interval",
                "must be 1 to 10800 seconds",
            ));
        }
        let replica_of = match replica_of.filter(|a| !a.is_empty()) {
            None => None,
            Some(a) => {
                socket_addr("replication.replica_of", a)?;
                if !engine.engine.config().replica {
                    return Err(config_err(
                        "replication.replica_of",
                        "the engine was not opened as a replica (EngineSettings replica=True)",
                    ));
                }
                Some(sluice_server::replica::ReplicaConfig {
                    active: a.to_string(),
                    username: replication_user.clone(),
                    password: replication_password.clone(),
                    noop_interval: replication_noop_interval,
                    tls: replication_tls.clone(),
                    vbuckets: None,
                })
            }
        };
        let addr = socket_addr("listen", listen)?;
        let admin_listen = admin_listen
            .filter(|a| !a.is_empty())
            .map(|a| socket_addr("admin_listen", a))
            .transpose()?;
        let iproto_listen = iproto_listen
            .filter(|a| !a.is_empty())
            .map(|a| socket_addr("iproto_listen", a))
            .transpose()?;
        let tank_listen = tank_listen
            .filter(|a| !a.is_empty())
            .map(|a| socket_addr("tank_listen", a))
            .transpose()?;
        let greenstack_listen = greenstack_listen
            .filter(|a| !a.is_empty())
            .map(|a| socket_addr("greenstack_listen", a))
            .transpose()?;
        if max_connections == 0 {
            return Err(config_err("max_connections", "must be at least 1"));
        }
        let tarantool_upstream = match tarantool_upstream.filter(|a| !a.is_empty()) {
            None => None,
            Some(a) => {
                socket_addr("tarantool_upstream.address", a)?;
                for name in &tarantool_upstream_spaces {
                    if !spaces.iter().any(|s| &s.0 == name) {
                        return Err(config_err(
                            "tarantool_upstream.spaces",
                            format!("no space {name:?} is configured ([spaces.{name}])"),
                        ));
                    }
                }
                if spaces.is_empty() {
                    return Err(config_err(
                        "tarantool_upstream.address",
                        "no space to follow into: declare the followed spaces in [spaces.NAME]",
                    ));
                }
                let user = tarantool_upstream_user
                    .filter(|u| !u.is_empty())
                    .map(|u| (u, tarantool_upstream_password.unwrap_or_default()));
                Some(sluice_server::iproto::follow::FollowConfig {
                    upstream: sluice_server::upstream::UpstreamConfig {
                        address: a.to_string(),
                        user,
                        timeout: std::time::Duration::from_secs(10),
                    },
                    spaces: tarantool_upstream_spaces,
                    anonymous: tarantool_upstream_anonymous,
                })
            }
        };
        let max_item = engine
            .engine
            .buckets()
            .iter()
            .map(|b| b.config.max_item_size)
            .max()
            .unwrap_or(BUCKET_DEFAULTS.max_item_size);
        let config = sluice_server::ServerConfig {
            listen: addr,
            admin_listen,
            max_connections,
            // The largest value plus room for key, extras and framing extras.
            max_body: max_item + 1024,
            idle_timeout: secs("idle_timeout", idle_timeout)?,
            worker_threads: io_threads.max(1),
            users: users_of(users)?,
            replica_of,
            replication_login: (replication_user, replication_password),
            replication_noop_interval,
            replication_tls,
            tap,
            login,
            tls_listen,
            tls,
            iproto_listen,
            tank_listen,
            greenstack_listen,
            spaces: spaces_of(spaces),
            tarantool_upstream,
            hold_connections,
        };
        let e = engine.engine.clone();
        let host = policies.clone();
        let warmup = greenstack_warmup.map(GreenstackWarmup::take).transpose()?;
        let server = py
            .detach(|| {
                let warm = warmup
                    .map(sluice_server::greenstack::Warmup::finish)
                    .transpose()?;
                sluice_server::Server::start_with(e, config, host, warm)
            })
            .map_err(|err| {
                if err.kind() == std::io::ErrorKind::InvalidInput {
                    ConfigError::new_err(format!("invalid config: {err}"))
                } else {
                    SluiceError::new_err(format!("cannot listen: {err}"))
                }
            })?;
        let address = server.local_addr().to_string();
        let admin_address = server.admin_addr().map(|a| a.to_string());
        let tls_address = server.tls_addr().map(|a| a.to_string());
        let iproto_address = server.iproto_addr().map(|a| a.to_string());
        let tank_address = server.tank_addr().map(|a| a.to_string());
        let greenstack_address = server.greenstack_addr().map(|a| a.to_string());
        Ok(Server {
            iproto_address,
            tank_address,
            greenstack_address,
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

    /// "HOST:PORT" of the iproto listener, if it runs.
    #[getter]
    fn iproto_address(&self) -> Option<&str> {
        self.iproto_address.as_deref()
    }

    /// "HOST:PORT" of the TANK listener, if it runs.
    #[getter]
    fn tank_address(&self) -> Option<&str> {
        self.tank_address.as_deref()
    }

    /// "HOST:PORT" of the Greenstack listener, if it runs.
    #[getter]
    fn greenstack_address(&self) -> Option<&str> {
        self.greenstack_address.as_deref()
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
            py.detach(move || s.shutdown(grace));
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
