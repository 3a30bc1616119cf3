//! Users and permissions: SASL PLAIN against PBKDF2-SHA256 hashes from the configuration
//! (never a password at rest), and per-bucket permissions. With no user configured the node
//! serves anyone (loopback only, unless the operator says --insecure).

use std::collections::HashMap;

use pbkdf2::pbkdf2_hmac;
use sha2::Sha256;

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
        // Constant time: every byte is compared whatever the first difference.
        out.iter()
            .zip(&self.hash)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub hash: PasswordHash,
    /// Bucket name (or "*" for every bucket) -> permission bits.
    pub buckets: HashMap<String, u8>,
}

impl User {
    pub fn permissions(&self, bucket: &str) -> u8 {
        self.buckets.get(bucket).copied().unwrap_or(0) | self.buckets.get("*").copied().unwrap_or(0)
    }
}

#[derive(Debug, Clone, Default)]
pub struct Users {
    by_name: HashMap<String, User>,
    /// Checked for a name no user has, so that an unknown user takes as long as a wrong
    /// password: the largest iteration count configured, a salt of its own.
    dummy: Option<PasswordHash>,
}

impl Users {
    pub fn new(users: Vec<User>) -> Users {
        let dummy = users
            .iter()
            .map(|u| u.hash.iterations)
            .max()
            .map(|iterations| PasswordHash {
                iterations,
                salt: b"sluice-unknown-user".to_vec(),
                hash: vec![0; 32],
            });
        Users {
            by_name: users.into_iter().map(|u| (u.name.clone(), u)).collect(),
            dummy,
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
        let user = std::str::from_utf8(authc)
            .ok()
            .and_then(|name| self.by_name.get(name));
        match (user, &self.dummy) {
            (Some(user), _) => user.hash.verify(pass).then(|| user.name.clone()),
            (None, Some(dummy)) => {
                // Same work as a wrong password; its result does not matter.
                std::hint::black_box(dummy.verify(pass));
                None
            }
            (None, None) => None,
        }
    }
}

/// The users in force: replaced whole on reload (SIGHUP); sessions read them per request.
#[derive(Debug, Default)]
pub struct UserTable(parking_lot::RwLock<std::sync::Arc<Users>>);

impl UserTable {
    pub fn new(users: Users) -> UserTable {
        UserTable(parking_lot::RwLock::new(std::sync::Arc::new(users)))
    }

    /// The users now; a reload after this call does not change what it returned.
    pub fn current(&self) -> std::sync::Arc<Users> {
        self.0.read().clone()
    }

    pub fn replace(&self, users: Users) {
        *self.0.write() = std::sync::Arc::new(users);
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
        let hash = PasswordHash::parse(HASH).unwrap();
        Users::new(vec![User {
            name: "ada".into(),
            hash,
            buckets: HashMap::from([("default".into(), READ | WRITE)]),
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
            u.dummy.as_ref().map(|d| d.iterations),
            Some(1000),
            "an unknown user costs a hash of the configured cost"
        );
        assert_eq!(u.get("ada").unwrap().permissions("default"), READ | WRITE);
        assert_eq!(u.get("ada").unwrap().permissions("other"), 0);
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
}
