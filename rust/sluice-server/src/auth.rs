//! Users and permissions: SASL logins against credentials from the configuration (never a
//! password at rest), and per-bucket permissions.
//!
//! A user's credentials are SCRAM keys per mechanism (`scram_sha512`, `scram_sha256`,
//! `scram_sha1`: salt, iterations, StoredKey, ServerKey; see `scram`) and, from configurations
//! older than SCRAM, a PBKDF2-SHA256 `password_hash`. PLAIN checks the password against the
//! `password_hash` when there is one, else against the strongest SCRAM keys.
//!
//! With no user configured the node serves anyone (loopback only, unless the operator says
//! --insecure), and every SASL login with an offered mechanism succeeds at once, whatever the
//! name and password (see `kv::sasl`).

use std::collections::HashMap;

use pbkdf2::pbkdf2_hmac;
use sha2::Sha256;

use crate::scram::{self, Mechanism, ScramError};

/// What SASL_LIST_MECHS answers: SCRAM strongest first, then PLAIN.
pub const MECHANISMS: &str = "SCRAM-SHA512 SCRAM-SHA256 SCRAM-SHA1 PLAIN";

/// The iteration count `sluice user hash` uses, and that of the fake salt of a mechanism no
/// user has keys for.
pub const DEFAULT_ITERATIONS: u32 = 100_000;

pub const READ: u8 = 1;
pub const WRITE: u8 = 2;
pub const STREAM: u8 = 4;
pub const ADMIN: u8 = 8;
/// The replication role: what nodes log in with to follow or take over each other's vbuckets.
/// It grants takeover streams (DCP STREAM_REQ with the takeover flag, TAP TAKEOVER_VBUCKETS)
/// and registering as a replica whose SEQNO_ACKNOWLEDGED count toward durable writes; both
/// change what a node promises, beyond reading its changes.
pub const REPLICATION: u8 = 16;

/// A configured permission's bits. `replication` includes `stream`: a replica has to open the
/// stream it replicates.
pub fn permission(name: &str) -> Option<u8> {
    match name {
        "read" => Some(READ),
        "write" => Some(WRITE),
        "stream" => Some(STREAM),
        "admin" => Some(ADMIN),
        "replication" => Some(REPLICATION | STREAM),
        _ => None,
    }
}

/// Whether permissions allow what the replication role does (see `REPLICATION`): the role
/// itself, or `admin`, which may move vbuckets through the admin endpoint anyway.
pub fn may_replicate(permissions: u8) -> bool {
    permissions & (REPLICATION | ADMIN) != 0
}

/// `pbkdf2-sha256:ITERATIONS:SALT_HEX:HASH_HEX`, as `sluice user hash` prints it.
#[derive(Debug, Clone)]
pub struct PasswordHash {
    iterations: u32,
    salt: Vec<u8>,
    hash: Vec<u8>,
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Why a configured password hash is unusable; the texts follow `users.NAME.password_hash:`
/// in the configuration check's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PasswordHashError {
    #[error("expected pbkdf2-sha256:ITERATIONS:SALT_HEX:HASH_HEX")]
    Form,
    #[error("unknown scheme {0:?}; sluice user hash makes pbkdf2-sha256")]
    Scheme(String),
    #[error("bad iteration count {0:?}")]
    Iterations(String),
    #[error("iteration count {0} is not in 1000..=10000000")]
    IterationsOutOfRange(u32),
    #[error("salt must be at least 8 bytes of hex")]
    Salt,
    #[error("hash must be 32 bytes of hex")]
    Hash,
}

impl PasswordHash {
    pub fn parse(s: &str) -> Result<PasswordHash, PasswordHashError> {
        let parts: Vec<&str> = s.split(':').collect();
        let [scheme, iterations, salt, hash] = parts[..] else {
            return Err(PasswordHashError::Form);
        };
        if scheme != "pbkdf2-sha256" {
            return Err(PasswordHashError::Scheme(scheme.to_string()));
        }
        let iterations: u32 = iterations
            .parse()
            .map_err(|_| PasswordHashError::Iterations(iterations.to_string()))?;
        if !(1_000..=10_000_000).contains(&iterations) {
            return Err(PasswordHashError::IterationsOutOfRange(iterations));
        }
        let salt = unhex(salt)
            .filter(|s| s.len() >= 8)
            .ok_or(PasswordHashError::Salt)?;
        let hash = unhex(hash)
            .filter(|h| h.len() == 32)
            .ok_or(PasswordHashError::Hash)?;
        Ok(PasswordHash {
            iterations,
            salt,
            hash,
        })
    }

    pub fn verify(&self, password: &[u8]) -> bool {
        let mut out = [0u8; 32];
        pbkdf2_hmac::<Sha256>(password, &self.salt, self.iterations, &mut out);
        scram::constant_time_eq(&out, &self.hash)
    }
}

/// Why a configured SCRAM credential is unusable; the texts follow `users.NAME.scram_shaN:`
/// in the configuration check's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScramKeysError {
    #[error("expected {0}:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX from sluice user hash")]
    Form(&'static str),
    #[error("bad iteration count {0:?}")]
    Iterations(String),
    #[error("iteration count {0} is not in 1000..=10000000")]
    IterationsOutOfRange(u32),
    #[error("salt must be at least 8 bytes of hex")]
    Salt,
    #[error("stored and server keys must be {0} bytes of hex each")]
    Key(usize),
}

/// `scram-shaN:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX`, as `sluice user hash` prints
/// it, for `mechanism`.
pub fn parse_scram_keys(mechanism: Mechanism, s: &str) -> Result<scram::Keys, ScramKeysError> {
    let parts: Vec<&str> = s.split(':').collect();
    let [scheme, iterations, salt, stored_key, server_key] = parts[..] else {
        return Err(ScramKeysError::Form(mechanism.scheme()));
    };
    if scheme != mechanism.scheme() {
        return Err(ScramKeysError::Form(mechanism.scheme()));
    }
    let iterations: u32 = iterations
        .parse()
        .map_err(|_| ScramKeysError::Iterations(iterations.to_string()))?;
    if !(1_000..=10_000_000).contains(&iterations) {
        return Err(ScramKeysError::IterationsOutOfRange(iterations));
    }
    let salt = unhex(salt)
        .filter(|s| s.len() >= 8)
        .ok_or(ScramKeysError::Salt)?;
    let key = |k: &str| {
        unhex(k)
            .filter(|k| k.len() == mechanism.key_len())
            .ok_or(ScramKeysError::Key(mechanism.key_len()))
    };
    Ok(scram::Keys {
        mechanism,
        iterations,
        salt,
        stored_key: key(stored_key)?,
        server_key: key(server_key)?,
    })
}

/// A user's credentials as configured.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// `password_hash` (PLAIN only).
    pub password_hash: Option<PasswordHash>,
    /// SCRAM keys, one per mechanism at most.
    pub scram: Vec<scram::Keys>,
    /// `chap_sha1`: sha1(sha1(password)), what Tarantool's chap-sha1 AUTH (iproto) checks.
    pub chap_sha1: Option<[u8; 20]>,
}

/// The name of the user an iproto session is before it authenticates; `[users.guest]` has no
/// credentials, only permissions.
pub const GUEST: &str = "guest";

/// sha1(sha1("")): guest's password is empty, as in Tarantool.
fn empty_chap_sha1() -> [u8; 20] {
    sha1(&sha1(b""))
}

pub fn sha1(data: &[u8]) -> [u8; 20] {
    let d = ring::digest::digest(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY, data);
    let mut out = [0u8; 20];
    out.copy_from_slice(d.as_ref());
    out
}

/// The outcome of a chap-sha1 AUTH (iproto).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChapOutcome {
    /// Logged in as this user.
    Ok(String),
    /// No user of that name (Tarantool's ER_NO_SUCH_USER).
    NoSuchUser,
    /// A wrong scramble, or a user without chap-sha1 credentials (ER_PASSWORD_MISMATCH).
    Mismatch,
}

impl Credentials {
    /// Adds the credential configured under `key` (`password_hash`, `scram_sha512`,
    /// `scram_sha256`, `scram_sha1`); the error is the text after `users.NAME.KEY: `.
    pub fn add(&mut self, key: &str, value: &str) -> Result<(), String> {
        if key == "chap_sha1" {
            let bytes = unhex(value)
                .and_then(|b| <[u8; 20]>::try_from(b).ok())
                .ok_or("expected 40 hex digits, sha1(sha1(password)), from sluice user hash")?;
            self.chap_sha1 = Some(bytes);
            return Ok(());
        }
        if key == "password_hash" {
            self.password_hash = Some(PasswordHash::parse(value).map_err(|e| e.to_string())?);
            return Ok(());
        }
        let mechanism = Mechanism::ALL
            .into_iter()
            .find(|m| m.scheme().replace('-', "_") == key)
            .ok_or_else(|| {
                "unknown credential (known: password_hash, scram_sha512, scram_sha256, scram_sha1, \
                 chap_sha1)"
                    .to_string()
            })?;
        let keys = parse_scram_keys(mechanism, value).map_err(|e| e.to_string())?;
        self.scram.retain(|k| k.mechanism != mechanism);
        self.scram.push(keys);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.password_hash.is_none() && self.scram.is_empty() && self.chap_sha1.is_none()
    }

    pub fn scram(&self, mechanism: Mechanism) -> Option<&scram::Keys> {
        self.scram.iter().find(|k| k.mechanism == mechanism)
    }

    /// What PLAIN checks a password against: the `password_hash`, else the strongest keys.
    fn plain_check(&self) -> Option<PlainCheck<'_>> {
        match &self.password_hash {
            Some(h) => Some(PlainCheck::Hash(h)),
            None => Mechanism::ALL
                .into_iter()
                .find_map(|m| self.scram(m))
                .map(PlainCheck::Scram),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum PlainCheck<'a> {
    Hash(&'a PasswordHash),
    Scram(&'a scram::Keys),
}

impl PlainCheck<'_> {
    fn iterations(self) -> u32 {
        match self {
            PlainCheck::Hash(h) => h.iterations,
            PlainCheck::Scram(k) => k.iterations,
        }
    }

    fn verify(self, password: &[u8]) -> bool {
        match self {
            PlainCheck::Hash(h) => h.verify(password),
            PlainCheck::Scram(k) => k.verify_password(password),
        }
    }

    /// The same check with a salt of its own and a hash nothing matches: what a name no user
    /// has costs.
    fn dummy(self) -> Credentials {
        let salt = b"sluice-unknown-user".to_vec();
        match self {
            PlainCheck::Hash(h) => Credentials {
                password_hash: Some(PasswordHash {
                    iterations: h.iterations,
                    salt,
                    hash: vec![0; 32],
                }),
                scram: Vec::new(),
                chap_sha1: None,
            },
            PlainCheck::Scram(k) => Credentials {
                password_hash: None,
                scram: vec![scram::Keys {
                    salt,
                    stored_key: vec![0; k.stored_key.len()],
                    ..k.clone()
                }],
                chap_sha1: None,
            },
        }
    }
}

/// The authcid (user name) of a SASL PLAIN message `authzid NUL authcid NUL passwd`.
pub fn plain_user(data: &[u8]) -> &[u8] {
    data.split(|&b| b == 0).nth(1).unwrap_or_default()
}

#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub credentials: Credentials,
    /// Bucket name (or "*" for every bucket) -> permission bits.
    pub buckets: HashMap<String, u8>,
    /// Topic name, or a prefix ending in "*" ("logs.*"; "*": every topic) -> permission bits
    /// (READ, WRITE, STREAM, ADMIN).
    pub topics: Vec<(String, u8)>,
}

impl User {
    pub fn permissions(&self, bucket: &str) -> u8 {
        self.buckets.get(bucket).copied().unwrap_or(0) | self.buckets.get("*").copied().unwrap_or(0)
    }

    /// Its permission bits on `topic`: those of every grant whose name or prefix covers it.
    pub fn topic_permissions(&self, topic: &str) -> u8 {
        self.topics
            .iter()
            .filter(|(grant, _)| match grant.strip_suffix('*') {
                Some(prefix) => topic.starts_with(prefix),
                None => grant == topic,
            })
            .fold(0, |bits, (_, b)| bits | b)
    }
}

#[derive(Debug, Clone, Default)]
pub struct Users {
    by_name: HashMap<String, User>,
    /// Checked by PLAIN for a name no user has, so that an unknown user takes as long as a
    /// wrong password: the costliest check configured, with a salt of its own.
    dummy: Option<Credentials>,
    /// Per mechanism, the iteration count a SCRAM exchange for a user without keys announces:
    /// the largest configured for that mechanism.
    fake_iterations: HashMap<Mechanism, u32>,
}

impl Users {
    pub fn new(users: Vec<User>) -> Users {
        let dummy = users
            .iter()
            .filter_map(|u| u.credentials.plain_check())
            .max_by_key(|c| c.iterations())
            .map(PlainCheck::dummy);
        let mut fake_iterations = HashMap::new();
        for keys in users.iter().flat_map(|u| &u.credentials.scram) {
            let most = fake_iterations.entry(keys.mechanism).or_insert(0);
            *most = keys.iterations.max(*most);
        }
        Users {
            by_name: users.into_iter().map(|u| (u.name.clone(), u)).collect(),
            dummy,
            fake_iterations,
        }
    }

    /// Authentication is required once any user is configured.
    pub fn required(&self) -> bool {
        !self.by_name.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&User> {
        self.by_name.get(name)
    }

    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.by_name.keys().cloned().collect();
        v.sort();
        v
    }

    /// SASL PLAIN (RFC 4616): `authzid NUL authcid NUL passwd`; an authzid, when given, must be
    /// the user itself. Returns the user's name when the password matches.
    pub fn authenticate_plain(&self, data: &[u8]) -> Option<String> {
        let mut parts = data.split(|&b| b == 0);
        let (authz, authc, pass) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || (!authz.is_empty() && authz != authc) {
            return None;
        }
        let name = std::str::from_utf8(authc).ok()?;
        self.verify_password(name, pass).then(|| name.to_string())
    }

    /// Whether `password` is the user's (PLAIN, the admin endpoint's HTTP Basic). A name no
    /// user has costs the same work as a wrong password.
    pub fn verify_password(&self, name: &str, password: &[u8]) -> bool {
        let check = self
            .by_name
            .get(name)
            .and_then(|u| u.credentials.plain_check());
        match (check, &self.dummy) {
            (Some(check), _) => check.verify(password),
            (None, Some(dummy)) => {
                // Same work as a wrong password; its result does not matter.
                std::hint::black_box(dummy.plain_check().map(|c| c.verify(password)));
                false
            }
            (None, None) => false,
        }
    }

    /// The permissions of an iproto session that has not authenticated: `[users.guest]`'s.
    pub fn guest(&self) -> Option<&User> {
        self.by_name.get(GUEST)
    }

    /// Tarantool's chap-sha1: `scramble = sha1(password) XOR sha1(salt[..20] + sha1(sha1(password)))`,
    /// checked against the stored sha1(sha1(password)): XOR the scramble with sha1(salt + stored)
    /// gives sha1(password), whose sha1 must be the stored value. `guest` has the empty password;
    /// an empty `scramble` (an AUTH with no scramble) is guest's login only. With no user
    /// configured, any login succeeds (the node serves anyone, as SASL does then).
    pub fn authenticate_chap_sha1(&self, name: &str, salt: &[u8], scramble: &[u8]) -> ChapOutcome {
        if !self.required() {
            return ChapOutcome::Ok(name.to_string());
        }
        let stored = if name == GUEST {
            Some(empty_chap_sha1())
        } else {
            match self.by_name.get(name) {
                None => return ChapOutcome::NoSuchUser,
                Some(u) => u.credentials.chap_sha1,
            }
        };
        let Some(stored) = stored else {
            return ChapOutcome::Mismatch;
        };
        if name == GUEST && scramble.is_empty() {
            return ChapOutcome::Ok(name.to_string());
        }
        if scramble.len() != 20 || salt.len() < 20 {
            return ChapOutcome::Mismatch;
        }
        let mut buf = Vec::with_capacity(40);
        buf.extend_from_slice(&salt[..20]);
        buf.extend_from_slice(&stored);
        let mask = sha1(&buf);
        let mut step1 = [0u8; 20];
        for (i, b) in step1.iter_mut().enumerate() {
            *b = scramble[i] ^ mask[i];
        }
        if scram::constant_time_eq(&sha1(&step1), &stored) {
            ChapOutcome::Ok(name.to_string())
        } else {
            ChapOutcome::Mismatch
        }
    }

    /// Starts a SCRAM exchange from a client-first message: the exchange and the server-first
    /// message. A user without keys for `mechanism` (unknown, or configured without them) gets
    /// an exchange that runs the same and fails at the end.
    pub fn scram_start(
        &self,
        mechanism: Mechanism,
        client_first: &[u8],
    ) -> Result<(scram::Exchange, String), ScramError> {
        let first = scram::parse_client_first(client_first)?;
        let keys = self
            .by_name
            .get(&first.user)
            .and_then(|u| u.credentials.scram(mechanism));
        let (keys, known) = match keys {
            Some(keys) => (keys.clone(), true),
            None => {
                let iterations = self
                    .fake_iterations
                    .get(&mechanism)
                    .copied()
                    .unwrap_or(DEFAULT_ITERATIONS);
                (scram::fake_keys(mechanism, &first.user, iterations)?, false)
            }
        };
        scram::Exchange::start(first, keys, known)
    }
}

/// The users in force: replaced whole on reload (SIGHUP); sessions read them per request.
#[derive(Debug, Default)]
pub struct UserTable {
    users: parking_lot::RwLock<(std::sync::Arc<Users>, u64)>,
    /// Moves on with every reload, so that a connection can keep its own copy of the table
    /// and check one word per request instead of taking the lock.
    generation: std::sync::atomic::AtomicU64,
}

impl UserTable {
    pub fn new(users: Users) -> UserTable {
        UserTable {
            users: parking_lot::RwLock::new((std::sync::Arc::new(users), 0)),
            generation: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The users now; a reload after this call does not change what it returned.
    pub fn current(&self) -> std::sync::Arc<Users> {
        self.users.read().0.clone()
    }

    /// The users now and the generation they belong to.
    pub fn current_with_generation(&self) -> (std::sync::Arc<Users>, u64) {
        self.users.read().clone()
    }

    /// The generation of the users now: it changes when `replace` does.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn replace(&self, users: Users) {
        let mut guard = self.users.write();
        let next = guard.1 + 1;
        *guard = (std::sync::Arc::new(users), next);
        self.generation
            .store(next, std::sync::atomic::Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // pbkdf2-sha256 of "secret" with salt "0123456789abcdef" (hex of ASCII) and 1000 rounds,
    // computed independently with Python's hashlib.pbkdf2_hmac.
    const HASH: &str =
        "pbkdf2-sha256:1000:30313233343536373839616263646566:b622961f2e0500609613c827e86b4a85ac43d8e79e0145165c54ffa7569a365f";

    fn users() -> Users {
        let mut credentials = Credentials::default();
        credentials.add("password_hash", HASH).unwrap();
        Users::new(vec![User {
            name: "ada".into(),
            credentials,
            buckets: HashMap::from([("default".into(), READ | WRITE)]),
            topics: Vec::new(),
        }])
    }

    #[test]
    fn plain_accepts_the_password_and_nothing_else() {
        let u = users();
        assert_eq!(
            u.authenticate_plain(b"\0ada\0secret").as_deref(),
            Some("ada")
        );
        assert_eq!(
            u.authenticate_plain(b"ada\0ada\0secret").as_deref(),
            Some("ada")
        );
        assert_eq!(u.authenticate_plain(b"\0ada\0Secret"), None);
        assert_eq!(
            u.authenticate_plain(b"bob\0ada\0secret"),
            None,
            "no acting as another user"
        );
        assert_eq!(u.authenticate_plain(b"\0nobody\0secret"), None);
        assert_eq!(u.authenticate_plain(b"ada secret"), None);
        assert_eq!(
            u.dummy
                .as_ref()
                .and_then(|d| d.plain_check())
                .map(|c| c.iterations()),
            Some(1000),
            "an unknown user costs a hash of the configured cost"
        );
        assert_eq!(u.get("ada").unwrap().permissions("default"), READ | WRITE);
        assert_eq!(u.get("ada").unwrap().permissions("other"), 0);
    }

    /// A client's chap-sha1 scramble, as tarantool-python computes it.
    fn chap_scramble(password: &[u8], salt: &[u8]) -> Vec<u8> {
        let s1 = sha1(password);
        let s2 = sha1(&s1);
        let mask = sha1(&[&salt[..20], &s2[..]].concat());
        s1.iter().zip(mask).map(|(a, b)| a ^ b).collect()
    }

    #[test]
    fn chap_sha1_checks_the_scramble_and_guest_has_the_empty_password() {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let mut credentials = Credentials::default();
        credentials
            .add("chap_sha1", &hex(&sha1(&sha1(b"secret"))))
            .unwrap();
        let users = Users::new(vec![
            User {
                name: "app".into(),
                credentials,
                buckets: HashMap::new(),
                topics: Vec::new(),
            },
            User {
                name: GUEST.into(),
                credentials: Credentials::default(),
                buckets: HashMap::from([("users".into(), READ)]),
                topics: Vec::new(),
            },
        ]);
        let salt = [7u8; 32];
        let ok = chap_scramble(b"secret", &salt);
        assert_eq!(
            users.authenticate_chap_sha1("app", &salt, &ok),
            ChapOutcome::Ok("app".into())
        );
        let other_salt = [8u8; 32];
        assert_eq!(
            users.authenticate_chap_sha1("app", &other_salt, &ok),
            ChapOutcome::Mismatch,
            "a scramble is good for its salt only"
        );
        assert_eq!(
            users.authenticate_chap_sha1("app", &salt, &chap_scramble(b"wrong", &salt)),
            ChapOutcome::Mismatch
        );
        assert_eq!(
            users.authenticate_chap_sha1("nobody", &salt, &ok),
            ChapOutcome::NoSuchUser
        );
        assert_eq!(
            users.authenticate_chap_sha1(GUEST, &salt, b""),
            ChapOutcome::Ok(GUEST.into())
        );
        assert_eq!(
            users.authenticate_chap_sha1(GUEST, &salt, &chap_scramble(b"", &salt)),
            ChapOutcome::Ok(GUEST.into())
        );
        assert_eq!(
            users.authenticate_chap_sha1(GUEST, &salt, &chap_scramble(b"x", &salt)),
            ChapOutcome::Mismatch
        );
        assert_eq!(users.guest().unwrap().permissions("users"), READ);
        assert!(Credentials::default().add("chap_sha1", "abc").is_err());
    }

    #[test]
    fn hash_strings_are_checked() {
        let err = |s: &str| PasswordHash::parse(s).unwrap_err();
        let salt = "3031323334353637";
        let hash = "00".repeat(32);
        assert_eq!(err("plain:secret"), PasswordHashError::Form);
        assert_eq!(
            err("md5:1000:00:00").to_string(),
            "unknown scheme \"md5\"; sluice user hash makes pbkdf2-sha256"
        );
        assert_eq!(
            err(&format!("pbkdf2-sha256:many:{salt}:{hash}")).to_string(),
            "bad iteration count \"many\""
        );
        assert_eq!(
            err(&format!("pbkdf2-sha256:10:{salt}:{hash}")).to_string(),
            "iteration count 10 is not in 1000..=10000000"
        );
        assert_eq!(
            err(&format!("pbkdf2-sha256:1000:3031:{hash}")).to_string(),
            "salt must be at least 8 bytes of hex"
        );
        assert_eq!(
            err(&format!("pbkdf2-sha256:1000:{salt}:00")).to_string(),
            "hash must be 32 bytes of hex"
        );
        assert_eq!(
            PasswordHashError::Form.to_string(),
            "expected pbkdf2-sha256:ITERATIONS:SALT_HEX:HASH_HEX"
        );
    }

    /// `scram-shaN:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX` of `password`.
    fn scram_string(mechanism: Mechanism, password: &[u8], iterations: u32) -> String {
        let k = scram::Keys::derive(mechanism, password, b"0123456789abcdef", iterations);
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        format!(
            "{}:{iterations}:{}:{}:{}",
            mechanism.scheme(),
            hex(&k.salt),
            hex(&k.stored_key),
            hex(&k.server_key)
        )
    }

    #[test]
    fn scram_credentials_serve_plain_and_scram_and_are_checked() {
        let mut credentials = Credentials::default();
        for m in Mechanism::ALL {
            let key = m.scheme().replace('-', "_");
            credentials
                .add(&key, &scram_string(m, b"pw", 1000))
                .unwrap();
        }
        assert_eq!(credentials.scram.len(), 3);
        let users = Users::new(vec![User {
            name: "ada".into(),
            credentials: credentials.clone(),
            buckets: HashMap::new(),
            topics: Vec::new(),
        }]);
        assert_eq!(
            users.authenticate_plain(b"\0ada\0pw").as_deref(),
            Some("ada")
        );
        assert_eq!(users.authenticate_plain(b"\0ada\0nope"), None);
        assert_eq!(users.authenticate_plain(b"\0bob\0pw"), None);
        assert_eq!(users.fake_iterations[&Mechanism::Sha1], 1000);
        let (_, known) = users
            .scram_start(Mechanism::Sha256, b"n,,n=ada,r=x")
            .unwrap();
        let (_, unknown) = users
            .scram_start(Mechanism::Sha256, b"n,,n=bob,r=x")
            .unwrap();
        let tail = |s: &str| s.split_once(",s=").unwrap().1.to_string();
        assert_eq!(
            tail(&known),
            format!(
                "{},i=1000",
                sluice_proto::base64::encode(b"0123456789abcdef")
            )
        );
        assert!(unknown.contains(",i=1000"), "{unknown}");
        assert_eq!(
            tail(&unknown),
            tail(
                &users
                    .scram_start(Mechanism::Sha256, b"n,,n=bob,r=y")
                    .unwrap()
                    .1
            ),
            "an unknown user's salt is the same at every look"
        );

        let err = |key: &str, value: &str| Credentials::default().add(key, value).unwrap_err();
        let sha1 = scram_string(Mechanism::Sha1, b"pw", 1000);
        assert_eq!(
            err("scram_sha256", &sha1),
            "expected scram-sha256:ITERATIONS:SALT_HEX:STOREDKEY_HEX:SERVERKEY_HEX from sluice \
             user hash"
        );
        assert_eq!(
            err("scram_sha1", &sha1.replace(":1000:", ":10:")),
            "iteration count 10 is not in 1000..=10000000"
        );
        let short = sha1.rsplit_once(':').unwrap().0.to_string() + ":00";
        assert_eq!(
            err("scram_sha1", &short),
            "stored and server keys must be 20 bytes of hex each"
        );
        assert!(err("password", "x").starts_with("unknown credential"));
    }
}
