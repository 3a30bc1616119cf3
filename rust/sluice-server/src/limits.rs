//! What a connection may cost before it logs in (only when users are configured): a small frame
//! limit, a deadline from accept, and caps on how many such connections there are, in total and
//! per source address. A client that never authenticates can then hold at most
//! `max_unauthenticated` connections of `PRELOGIN_MAX_BODY` buffered bytes each, for at most
//! `login_timeout`, whatever it sends (a 1-byte trickle does not move the deadline).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::auth::UserTable;
use crate::ratelimit::RateLimitedLog;

/// Largest request body a connection that has not logged in may send: room for HELLO, SASL
/// PLAIN with a long name and password, NOOP, VERSION. Larger gets E2BIG and the connection
/// closes before the body is buffered.
pub const PRELOGIN_MAX_BODY: usize = 4096;

/// The `[server]` settings that bound unauthenticated connections.
#[derive(Debug, Clone)]
pub struct LoginLimits {
    /// Connections not yet authenticated, in total; more are closed at accept.
    pub max_unauthenticated: usize,
    /// The same, per source address.
    pub max_unauthenticated_per_ip: usize,
    /// A connection not authenticated this long after accept is closed.
    pub login_timeout: Duration,
}

impl Default for LoginLimits {
    fn default() -> Self {
        LoginLimits {
            max_unauthenticated: 256,
            max_unauthenticated_per_ip: 64,
            login_timeout: Duration::from_secs(10),
        }
    }
}

/// Counters /metrics exports.
#[derive(Debug, Default)]
pub struct LoginStats {
    /// Connections closed at accept: too many unauthenticated ones (in total or from the address).
    pub refused_total_cap: AtomicU64,
    pub refused_ip_cap: AtomicU64,
    /// Connections closed because the login deadline passed.
    pub timed_out: AtomicU64,
    /// Connections closed for a frame over the pre-login limit.
    pub too_big: AtomicU64,
    /// SASL attempts that failed.
    pub auth_failures: AtomicU64,
    /// Unauthenticated connections open now.
    pub unauthenticated: AtomicU64,
}

/// The unauthenticated connections open now, counted per address, within `limits`.
#[derive(Default)]
pub struct PreLogin {
    pub limits: LoginLimits,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    pub stats: LoginStats,
    /// Closing lines for pre-login limits, at most one per interval.
    pub log: RateLimitedLog,
}

/// Why a connection was refused at accept.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Total(usize),
    PerIp(usize),
}

/// A slot among the unauthenticated connections, given back on drop (login, or close).
pub struct PreLoginSlot {
    owner: Arc<PreLogin>,
    ip: IpAddr,
}

impl Drop for PreLoginSlot {
    fn drop(&mut self) {
        self.owner.release(self.ip);
    }
}

impl PreLogin {
    pub fn new(limits: LoginLimits) -> PreLogin {
        PreLogin {
            limits,
            ..Default::default()
        }
    }

    /// Takes a slot for a new unauthenticated connection from `ip`, or says which cap is full.
    fn take_slot(self: &Arc<Self>, ip: IpAddr) -> Result<PreLoginSlot, Refused> {
        let limits = &self.limits;
        let this = self;
        let mut per_ip = this.per_ip.lock();
        let total = this.stats.unauthenticated.load(Relaxed) as usize;
        if total >= limits.max_unauthenticated {
            this.stats.refused_total_cap.fetch_add(1, Relaxed);
            return Err(Refused::Total(limits.max_unauthenticated));
        }
        let mine = per_ip.entry(ip).or_insert(0);
        if *mine >= limits.max_unauthenticated_per_ip {
            this.stats.refused_ip_cap.fetch_add(1, Relaxed);
            return Err(Refused::PerIp(limits.max_unauthenticated_per_ip));
        }
        *mine += 1;
        this.stats.unauthenticated.fetch_add(1, Relaxed);
        Ok(PreLoginSlot {
            owner: self.clone(),
            ip,
        })
    }

    fn release(&self, ip: IpAddr) {
        let mut per_ip = self.per_ip.lock();
        if let Some(n) = per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                per_ip.remove(&ip);
            }
        }
        self.stats.unauthenticated.fetch_sub(1, Relaxed);
    }

    /// The Prometheus lines of these counters.
    pub fn metrics(&self, o: &mut String) {
        let s = &self.stats;
        let _ = writeln!(
            o,
            "# HELP sluice_unauthenticated_connections Connections open now that have not logged in.\n\
             # TYPE sluice_unauthenticated_connections gauge\n\
             sluice_unauthenticated_connections {}",
            s.unauthenticated.load(Relaxed)
        );
        let _ = writeln!(
            o,
            "# HELP sluice_prelogin_closed_total Connections closed before logging in, by reason.\n\
             # TYPE sluice_prelogin_closed_total counter\n\
             sluice_prelogin_closed_total{{reason=\"max_unauthenticated\"}} {}\n\
             sluice_prelogin_closed_total{{reason=\"max_unauthenticated_per_ip\"}} {}\n\
             sluice_prelogin_closed_total{{reason=\"login_timeout\"}} {}\n\
             sluice_prelogin_closed_total{{reason=\"frame_too_big\"}} {}",
            s.refused_total_cap.load(Relaxed),
            s.refused_ip_cap.load(Relaxed),
            s.timed_out.load(Relaxed),
            s.too_big.load(Relaxed),
        );
        let _ = writeln!(
            o,
            "# HELP sluice_auth_failures_total SASL logins refused (wrong password or unknown user).\n\
             # TYPE sluice_auth_failures_total counter\n\
             sluice_auth_failures_total {}",
            s.auth_failures.load(Relaxed)
        );
    }
}

/// A new connection's pre-login slot: None when no user is configured (nothing to log in to),
/// Err when a cap is full (the caller closes the connection; it is counted and logged here).
pub fn admit(
    prelogin: &Arc<PreLogin>,
    users: &UserTable,
    peer: SocketAddr,
) -> Result<Option<PreLoginSlot>, Refused> {
    if !users.current().required() {
        return Ok(None);
    }
    match prelogin.take_slot(peer.ip().to_canonical()) {
        Ok(slot) => Ok(Some(slot)),
        Err(why) => {
            prelogin.log.warn(|| {
                let cap = match &why {
                    Refused::Total(n) => format!("max_unauthenticated ({n})"),
                    Refused::PerIp(n) => format!("max_unauthenticated_per_ip ({n})"),
                };
                format!("refusing connection from {peer}: {cap} connections are not logged in")
            });
            Err(why)
        }
    }
}

/// Logs (rate-limited) and counts a connection closed before login for a bad frame.
pub fn closing_before_login(
    prelogin: &PreLogin,
    peer: SocketAddr,
    too_big: bool,
    e: &dyn std::fmt::Display,
) {
    if too_big {
        prelogin.stats.too_big.fetch_add(1, Relaxed);
    }
    prelogin
        .log
        .info(|| format!("closing connection from {peer} before login: {e}"));
}

/// Logs (rate-limited) and counts a connection closed at its login deadline.
/// Runs `io` (a send to a client); before login (`login`: the deadline, limits and peer) only
/// until the login deadline, after which the connection is to be closed as timed out.
pub async fn by_login_deadline<T>(
    login: Option<(Instant, &PreLogin, SocketAddr)>,
    io: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    let Some((deadline, prelogin, peer)) = login else {
        return io.await;
    };
    match tokio::time::timeout_at(deadline.into(), io).await {
        Ok(r) => r,
        Err(_) => {
            login_timed_out(prelogin, peer);
            Err(std::io::ErrorKind::TimedOut.into())
        }
    }
}

pub fn login_timed_out(prelogin: &PreLogin, peer: SocketAddr) {
    prelogin.stats.timed_out.fetch_add(1, Relaxed);
    prelogin.log.info(|| {
        format!(
            "closing connection from {peer}: not logged in within {:?}",
            prelogin.limits.login_timeout
        )
    });
}
