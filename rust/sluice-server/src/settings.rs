//! The server's settings as they cross from the validated configuration (config.py's key table
//! builds them; JSON is the crossing) and their one check here: what no key's own type can say
//! (pairs of keys, files that must load, addresses that must parse, ranges that Rust relies on),
//! each failure naming its key. `Settings::check` turns them into the `ServerConfig` the server
//! starts with.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::config::defaults::{
    IDLE_TIMEOUT, IO_THREADS, MAX_CONNECTIONS, REPLICATION_NOOP_INTERVAL, REPLICATION_TLS,
    TLS_ADMIN,
};
use crate::config::ServerConfig;
use crate::limits::LoginLimits;
use crate::space::{FieldConfig, SpaceConfig};
use crate::tap::producer::TapConfig;

/// A setting the check refused: its key and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid config: {key}: {reason}")]
pub struct SettingsError {
    pub key: String,
    pub reason: String,
}

fn refuse(key: impl Into<String>, reason: impl std::fmt::Display) -> SettingsError {
    SettingsError {
        key: key.into(),
        reason: reason.to_string(),
    }
}

/// (name, {credential key: value}, {bucket: [permission, ...]}, {topic or prefix*:
/// [permission, ...]}): a `[users.NAME]` table, the credential keys those of the table
/// (password_hash, scram_sha512, scram_sha256, scram_sha1).
pub type UserSpec = (
    String,
    HashMap<String, String>,
    HashMap<String, Vec<String>>,
    HashMap<String, Vec<String>>,
);

/// (name, id, bucket, [(field name, type, is_nullable)], [0-based key fields]): a
/// `[spaces.NAME]` table.
pub type SpaceSpec = (String, u32, String, Vec<(String, String, bool)>, Vec<u32>);

/// The server's settings, by the names of config.py's keys (`Key.native` where it has one).
/// Absent keys take the defaults the key table documents, read from here.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub admin_listen: Option<String>,
    pub users: Vec<UserSpec>,
    pub max_connections: usize,
    /// Seconds.
    pub idle_timeout: f64,
    pub io_threads: usize,
    pub replica_of: Option<String>,
    pub replication_user: Option<String>,
    pub replication_password: Option<String>,
    pub replication_noop_interval: u32,
    pub tap_ack_interval: u32,
    pub tap_ack_window: u32,
    pub tap_grace_period: f64,
    pub tap_backoff: f64,
    pub tap_ttl: u8,
    pub tap_max_sessions: usize,
    pub tap_max_unacked_bytes: usize,
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_ip: usize,
    pub login_timeout: f64,
    /// Seconds a policy plugin may take (the Python side's policy host reads it).
    pub policy_timeout: f64,
    pub tls_certificate: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub tls_admin: bool,
    pub require_tls: bool,
    pub replication_tls: bool,
    pub replication_ca: Option<PathBuf>,
    pub replication_certificate: Option<PathBuf>,
    pub replication_key: Option<PathBuf>,
    /// The registered fronts' listeners by their keys (`listen`, `iproto_listen`, ...; each
    /// front declares its own); "" or absent: off.
    pub listeners: BTreeMap<String, String>,
    /// Their TLS listeners by their keys (`tls_listen`, `iproto_tls_listen`, ...).
    pub tls_listeners: BTreeMap<String, String>,
    pub spaces: Vec<SpaceSpec>,
    pub tarantool_upstream: Option<String>,
    pub tarantool_upstream_user: Option<String>,
    pub tarantool_upstream_password: Option<String>,
    pub tarantool_upstream_spaces: Vec<String>,
    pub tarantool_upstream_anonymous: bool,
    /// Bind the client listeners but accept nothing until told (a cluster's node converging).
    pub hold_connections: bool,
}

impl Default for Settings {
    fn default() -> Settings {
        let tap = TapConfig::default();
        let login = LoginLimits::default();
        Settings {
            admin_listen: None,
            users: Vec::new(),
            max_connections: MAX_CONNECTIONS,
            idle_timeout: IDLE_TIMEOUT.as_secs_f64(),
            io_threads: IO_THREADS,
            replica_of: None,
            replication_user: None,
            replication_password: None,
            replication_noop_interval: REPLICATION_NOOP_INTERVAL,
            tap_ack_interval: tap.ack_interval,
            tap_ack_window: tap.ack_window,
            tap_grace_period: tap.grace_period.as_secs_f64(),
            tap_backoff: tap.backoff.as_secs_f64(),
            tap_ttl: tap.ttl,
            tap_max_sessions: tap.max_sessions,
            tap_max_unacked_bytes: tap.max_unacked_bytes,
            max_unauthenticated: login.max_unauthenticated,
            max_unauthenticated_per_ip: login.max_unauthenticated_per_ip,
            login_timeout: login.login_timeout.as_secs_f64(),
            policy_timeout: crate::policy::PolicyHost::default().timeout().as_secs_f64(),
            tls_certificate: None,
            tls_key: None,
            tls_client_ca: None,
            tls_admin: TLS_ADMIN,
            require_tls: false,
            replication_tls: REPLICATION_TLS,
            replication_ca: None,
            replication_certificate: None,
            replication_key: None,
            listeners: BTreeMap::from([("listen".into(), "127.0.0.1:11210".into())]),
            tls_listeners: BTreeMap::new(),
            spaces: Vec::new(),
            tarantool_upstream: None,
            tarantool_upstream_user: None,
            tarantool_upstream_password: None,
            tarantool_upstream_spaces: Vec::new(),
            tarantool_upstream_anonymous: true,
            hold_connections: false,
        }
    }
}

/// A number of seconds as a duration.
pub fn secs(key: &str, v: f64) -> Result<Duration, SettingsError> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| refuse(key, format!("{v} is not a non-negative number of seconds")))
}

/// `HOST:PORT` as an address (a name is resolved).
pub fn socket_addr(key: &str, text: &str) -> Result<SocketAddr, SettingsError> {
    text.parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(text)
                .map_err(|e| e.to_string())
                .and_then(|mut a| a.next().ok_or_else(|| "no address".to_string()))
        })
        .map_err(|e| refuse(key, format!("{text:?} is not HOST:PORT ({e})")))
}

/// An optional address: None when absent or "".
fn optional_addr(key: &str, text: &Option<String>) -> Result<Option<SocketAddr>, SettingsError> {
    text.as_deref()
        .filter(|a| !a.is_empty())
        .map(|a| socket_addr(key, a))
        .transpose()
}

/// At least `min`, or the key's refusal.
fn at_least<T: PartialOrd + Copy>(key: &str, v: T, min: T, what: &str) -> Result<T, SettingsError> {
    if v < min {
        return Err(refuse(key, format!("must be at least {what}")));
    }
    Ok(v)
}

/// What the check makes of the settings.
pub struct Checked {
    pub config: ServerConfig,
    pub policy_timeout: Duration,
}

impl Settings {
    /// Parses the JSON the Python side sends; a key this build does not know is refused by
    /// name, as a wrong type is.
    pub fn from_json(text: &str) -> Result<Settings, SettingsError> {
        serde_json::from_str(text).map_err(|e| refuse("server settings", e))
    }

    /// Checks what no key's own type can say and builds the server's configuration.
    /// `max_item`: the largest item a bucket takes (the frame limit follows from it);
    /// `replica`: whether the engine was opened as a replica (`replica_of` needs it).
    pub fn check(self, max_item: usize, replica: bool) -> Result<Checked, SettingsError> {
        let tls = match (self.tls_certificate, self.tls_key) {
            (Some(certificate), Some(key)) => Some(crate::tls::TlsSettings {
                certificate,
                key,
                client_ca: self.tls_client_ca,
                admin: self.tls_admin,
            }),
            (None, None) => {
                if self.tls_client_ca.is_some() {
                    return Err(refuse(
                        "tls.client_ca",
                        "needs tls.certificate and tls.key (the TLS listener's own certificate)",
                    ));
                }
                None
            }
            (Some(_), None) => return Err(refuse("tls.key", "required with tls.certificate")),
            (None, Some(_)) => return Err(refuse("tls.certificate", "required with tls.key")),
        };
        let tls_listeners = addresses(self.tls_listeners)?;
        if let (Some(key), None) = (tls_listeners.keys().next(), &tls) {
            return Err(refuse(
                key.clone(),
                "set, but no certificate is configured (tls.certificate, tls.key)",
            ));
        }
        let replication_tls = if self.replication_tls {
            let ca = self.replication_ca.ok_or_else(|| {
                refuse(
                    "replication.ca",
                    "required with replication.tls: the CA the active's certificate must chain to",
                )
            })?;
            let identity = match (&self.replication_certificate, &self.replication_key) {
                (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
                (None, None) => None,
                (Some(_), None) => {
                    return Err(refuse(
                        "replication.key",
                        "required with replication.certificate",
                    ))
                }
                (None, Some(_)) => {
                    return Err(refuse(
                        "replication.certificate",
                        "required with replication.key",
                    ))
                }
            };
            let tls = crate::tls::ClientTls::load("replication", &ca, identity).map_err(|e| {
                let text = e.to_string();
                match text.split_once(": ") {
                    Some((key, reason)) => refuse(key, reason),
                    None => refuse("replication.tls", text),
                }
            })?;
            Some(tls)
        } else {
            for (key, v) in [
                ("replication.ca", &self.replication_ca),
                ("replication.certificate", &self.replication_certificate),
                ("replication.key", &self.replication_key),
            ] {
                if v.is_some() {
                    return Err(refuse(key, "set, but replication.tls is false"));
                }
            }
            None
        };
        at_least("tap.ack_interval", self.tap_ack_interval, 1, "1")?;
        at_least("tap.ack_window", self.tap_ack_window, 1, "1")?;
        if !(1..=sluice_core::item::MAX_TAP_HOPS).contains(&self.tap_ttl) {
            return Err(refuse("tap.ttl", "must be 1 to 31 hops"));
        }
        at_least("tap.max_sessions", self.tap_max_sessions, 1, "1")?;
        at_least(
            "tap.max_unacked_bytes",
            self.tap_max_unacked_bytes,
            64 << 10,
            "64 KiB",
        )?;
        let tap = TapConfig {
            ack_interval: self.tap_ack_interval,
            ack_window: self.tap_ack_window,
            grace_period: secs("tap.grace_period", self.tap_grace_period)?,
            backoff: secs("tap.backoff", self.tap_backoff)?,
            ttl: self.tap_ttl,
            max_sessions: self.tap_max_sessions,
            max_unacked_bytes: self.tap_max_unacked_bytes,
        };
        let login = LoginLimits {
            max_unauthenticated: at_least("max_unauthenticated", self.max_unauthenticated, 1, "1")?,
            max_unauthenticated_per_ip: at_least(
                "max_unauthenticated_per_ip",
                self.max_unauthenticated_per_ip,
                1,
                "1",
            )?,
            login_timeout: secs("login_timeout", self.login_timeout)?,
        };
        if login.login_timeout.is_zero() {
            return Err(refuse("login_timeout", "must be more than 0"));
        }
        let policy_timeout = secs("policy.timeout", self.policy_timeout)?;
        if !(1..=10800).contains(&self.replication_noop_interval) {
            return Err(refuse(
                "replication.noop_interval",
                "must be 1 to 10800 seconds",
            ));
        }
        let replica_of = match self.replica_of.filter(|a| !a.is_empty()) {
            None => None,
            Some(a) => {
                socket_addr("replication.replica_of", &a)?;
                if !replica {
                    return Err(refuse(
                        "replication.replica_of",
                        "the engine was not opened as a replica (EngineSettings replica=True)",
                    ));
                }
                Some(crate::replica::ReplicaConfig {
                    active: a,
                    username: self.replication_user.clone(),
                    password: self.replication_password.clone(),
                    noop_interval: self.replication_noop_interval,
                    tls: replication_tls.clone(),
                    vbuckets: None,
                })
            }
        };
        let admin_listen = optional_addr("admin_listen", &self.admin_listen)?;
        let listeners = addresses(self.listeners)?;
        at_least("max_connections", self.max_connections, 1, "1")?;
        let spaces = spaces_of(self.spaces);
        let tarantool_upstream = match self.tarantool_upstream.filter(|a| !a.is_empty()) {
            None => None,
            Some(a) => {
                socket_addr("tarantool_upstream.address", &a)?;
                for name in &self.tarantool_upstream_spaces {
                    if !spaces.iter().any(|s| &s.name == name) {
                        return Err(refuse(
                            "tarantool_upstream.spaces",
                            format!("no space {name:?} is configured ([spaces.{name}])"),
                        ));
                    }
                }
                if spaces.is_empty() {
                    return Err(refuse(
                        "tarantool_upstream.address",
                        "no space to follow into: declare the followed spaces in [spaces.NAME]",
                    ));
                }
                let user = self
                    .tarantool_upstream_user
                    .filter(|u| !u.is_empty())
                    .map(|u| (u, self.tarantool_upstream_password.unwrap_or_default()));
                Some(crate::upstream::FollowConfig {
                    upstream: crate::upstream::UpstreamConfig {
                        address: a,
                        user,
                        timeout: Duration::from_secs(10),
                    },
                    spaces: self.tarantool_upstream_spaces,
                    anonymous: self.tarantool_upstream_anonymous,
                })
            }
        };
        let config = ServerConfig {
            admin_listen,
            max_connections: self.max_connections,
            // The largest value plus room for key, extras and framing extras.
            max_body: max_item + 1024,
            idle_timeout: secs("idle_timeout", self.idle_timeout)?,
            worker_threads: self.io_threads.max(1),
            users: users_of(self.users)?,
            replica_of,
            replication_login: (self.replication_user, self.replication_password),
            replication_noop_interval: self.replication_noop_interval,
            replication_tls,
            tap,
            login,
            tls,
            require_tls: self.require_tls,
            listeners,
            tls_listeners,
            spaces,
            tarantool_upstream,
            hold_connections: self.hold_connections,
        };
        Ok(Checked {
            config,
            policy_timeout,
        })
    }
}

/// Listener addresses by key, those set ("" is off), each parsed.
fn addresses(
    keys: BTreeMap<String, String>,
) -> Result<BTreeMap<String, SocketAddr>, SettingsError> {
    let mut out = BTreeMap::new();
    for (key, address) in keys {
        if let Some(a) = optional_addr(&key, &Some(address))? {
            out.insert(key, a);
        }
    }
    Ok(out)
}

fn spaces_of(specs: Vec<SpaceSpec>) -> Vec<SpaceConfig> {
    specs
        .into_iter()
        .map(|(name, id, bucket, format, primary_key)| SpaceConfig {
            name,
            id,
            bucket,
            format: format
                .into_iter()
                .map(|(name, field_type, is_nullable)| FieldConfig {
                    name,
                    field_type,
                    is_nullable,
                })
                .collect(),
            primary_key,
        })
        .collect()
}

/// The users, their credentials checked and their permissions named.
pub fn users_of(specs: Vec<UserSpec>) -> Result<crate::auth::Users, SettingsError> {
    let mut users = Vec::with_capacity(specs.len());
    for (name, given, buckets, topic_grants) in specs {
        let mut credentials = crate::auth::Credentials::default();
        for (key, value) in given {
            credentials
                .add(&key, &value)
                .map_err(|e| refuse(format!("users.{name}.{key}"), e))?;
        }
        // guest (the anonymous sessions of iproto and TANK) has permissions only.
        if credentials.is_empty() && name != crate::auth::GUEST {
            return Err(refuse(
                format!("users.{name}"),
                "no credentials: put the output of `sluice user hash` under it",
            ));
        }
        let mut perms = HashMap::new();
        for (bucket, names) in buckets {
            let mut bits = 0;
            for p in names {
                bits |= crate::auth::permission(&p).ok_or_else(|| {
                    refuse(
                        format!("users.{name}.buckets.{bucket}"),
                        format!("unknown permission {p:?}"),
                    )
                })?;
            }
            perms.insert(bucket, bits);
        }
        let mut topics = Vec::new();
        for (topic, names) in topic_grants {
            let key = || format!("users.{name}.topics.{topic}");
            if topic.is_empty() || topic[..topic.len() - 1].contains('*') {
                return Err(refuse(
                    key(),
                    "a topic name, or a prefix ending in \"*\" (\"logs.*\")",
                ));
            }
            let mut bits = 0;
            for p in names {
                bits |= crate::auth::permission(&p)
                    .filter(|&b| b & crate::auth::REPLICATION == 0)
                    .ok_or_else(|| refuse(key(), format!("unknown permission {p:?}")))?;
            }
            topics.push((topic, bits));
        }
        users.push(crate::auth::User {
            name,
            credentials,
            buckets: perms,
            topics,
        });
    }
    Ok(crate::auth::Users::new(users))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_keys_take_their_defaults_and_unknown_ones_are_refused() {
        let s = Settings::from_json(r#"{"admin_listen": "127.0.0.1:0"}"#).unwrap();
        let checked = s.check(1 << 20, false).unwrap();
        assert_eq!(checked.config.max_connections, MAX_CONNECTIONS);
        assert_eq!(checked.config.listeners["listen"].port(), 11210);
        assert!(checked.config.tls_listeners.is_empty());
        let e = Settings::from_json(r#"{"admin_listen": "", "iproto_lisen": "x"}"#).unwrap_err();
        assert!(e.reason.contains("unknown field `iproto_lisen`"), "{e}");
    }

    #[test]
    fn a_failure_names_its_key() {
        let bad = |json: &str| {
            Settings::from_json(json)
                .unwrap()
                .check(1 << 20, false)
                .err()
                .unwrap()
                .to_string()
        };
        assert_eq!(
            bad(r#"{"tls_key": "/k.pem"}"#),
            "invalid config: tls.certificate: required with tls.key"
        );
        assert_eq!(
            bad(r#"{"listeners": {"iproto_listen": "nowhere"}}"#)
                .split(" (")
                .next()
                .unwrap(),
            "invalid config: iproto_listen: \"nowhere\" is not HOST:PORT"
        );
        assert_eq!(
            bad(r#"{"tls_listeners": {"tank_tls_listen": "127.0.0.1:0"}}"#),
            "invalid config: tank_tls_listen: set, but no certificate is configured \
             (tls.certificate, tls.key)"
        );
        assert_eq!(
            bad(r#"{"max_unauthenticated": 0}"#),
            "invalid config: max_unauthenticated: must be at least 1"
        );
        assert_eq!(
            bad(r#"{"replica_of": "127.0.0.1:11210"}"#),
            "invalid config: replication.replica_of: the engine was not opened as a replica \
             (EngineSettings replica=True)"
        );
    }

    #[test]
    fn a_front_listens_where_its_key_says_and_not_when_it_is_empty() {
        let s = Settings::from_json(
            r#"{"listeners": {"listen": "127.0.0.1:0", "iproto_listen": "127.0.0.1:3301",
                "tank_listen": ""}}"#,
        )
        .unwrap();
        let c = s.check(1 << 20, false).unwrap().config;
        assert_eq!(c.listeners.len(), 2);
        assert_eq!(c.listeners["iproto_listen"].port(), 3301);
    }
}
