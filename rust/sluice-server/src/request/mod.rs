//! The request layer every front shares, under none of them: what a reply that acknowledges
//! a write waits for, and who may do what. A front turns its protocol's request into calls on
//! the engine and its answer into bytes; the rules in between are here, once.

use sluice_core::Engine;

use crate::auth::Users;

/// Waits until the WAL holds every change up to `owed_lsn`, which the replies about to be sent
/// acknowledge; Err (logged) when it stopped without writing them, or fails to (a full disk):
/// the connection then closes unanswered, at once, rather than acknowledge what a restart
/// would not have or keep its client waiting for the disk. The changes stay queued and are
/// written once the disk has room: their outcome is unknown to the client, as for any
/// connection lost before its reply.
pub async fn acknowledged(engine: &Engine, owed_lsn: u64) -> std::io::Result<()> {
    engine
        .wal()
        .written_unless_failing(owed_lsn)
        .await
        .map_err(|e| {
            log::warn!("closing a connection with unsent replies: {e}");
            std::io::Error::other(e.to_string())
        })
}

/// What a login refused by `require_tls` is told, on every front.
pub const TLS_REQUIRED: &str = "login refused: require_tls is set and this plain-text connection \
    comes from beyond loopback; connect to the TLS port";

/// Who a session acts as, for permission checks.
#[derive(Debug, Clone, Copy)]
pub enum Principal<'a> {
    /// A user that logged in.
    User(&'a str),
    /// Nobody logged in: on protocols where an anonymous client is served (iproto, TANK), it
    /// has `[users.guest]`'s grants, as a Tarantool session that sent no AUTH.
    Guest,
    /// Nobody logged in, on a protocol where that grants nothing (memcached, Greenstack).
    Nobody,
}

/// The permission bits (`auth::READ`, `auth::WRITE`, ...) `who` has on `bucket`: every one on a
/// node with no users.
pub fn permissions(users: &Users, who: Principal<'_>, bucket: &str) -> u8 {
    user_of(users, who).map_or(u8::MAX, |u| u.map_or(0, |u| u.permissions(bucket)))
}

/// The user whose grants `who` has: None when the node has no users (everything is allowed),
/// Some(None) when it is nobody's.
fn user_of<'u>(users: &'u Users, who: Principal<'_>) -> Option<Option<&'u crate::auth::User>> {
    if !users.required() {
        return None;
    }
    Some(match who {
        Principal::User(name) => users.get(name),
        Principal::Guest => users.guest(),
        Principal::Nobody => None,
    })
}

/// The permission bits `who` has on the topic `topic` (its `[users.NAME] topics` grants):
/// every one on a node with no users.
pub fn topic_permissions(users: &Users, who: Principal<'_>, topic: &str) -> u8 {
    user_of(users, who).map_or(u8::MAX, |u| u.map_or(0, |u| u.topic_permissions(topic)))
}

/// Whether an anonymous client is served at all on a protocol that serves one as guest: a node
/// with no users, or one with `[users.guest]`. Otherwise such a connection is held to the
/// bounds of one that has not logged in (`limits`).
pub fn guest_served(users: &Users) -> bool {
    !users.required() || users.guest().is_some()
}
