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
use sluice_proto::mcbp::FrameError;

use crate::server::Shared;

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

/// The unauthenticated connections open now, counted per address.
#[derive(Default)]
pub struct PreLogin {
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    pub stats: LoginStats,
    /// Closing lines for pre-login limits, at most one per interval.
    pub log: RateLimitedLog,
    /// Failed SASL attempts, which slow the next ones down.
    pub throttle: crate::login::LoginThrottle,
}

/// Why a connection was refused at accept.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Total(usize),
    PerIp(usize),
}

/// A slot among the unauthenticated connections, given back on drop (login, or close).
pub struct PreLoginSlot {
    owner: Arc<Shared>,
    ip: IpAddr,
}

impl Drop for PreLoginSlot {
    fn drop(&mut self) {
        self.owner.prelogin.release(self.ip);
    }
}

impl PreLogin {
    /// Takes a slot for a new unauthenticated connection from `ip`, or says which cap is full.
    pub fn admit(shared: &Arc<Shared>, ip: IpAddr) -> Result<PreLoginSlot, Refused> {
        let limits = &shared.config.login;
        let this = &shared.prelogin;
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
            owner: shared.clone(),
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

/// A log line that an attacker can trigger (a refused connection, a failed login): written at
/// most once per interval, with how many occurrences it stands for.
#[derive(Debug)]
pub struct RateLimitedLog {
    interval: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl Default for RateLimitedLog {
    fn default() -> Self {
        RateLimitedLog::new(Duration::from_secs(10))
    }
}

impl RateLimitedLog {
    pub fn new(interval: Duration) -> RateLimitedLog {
        RateLimitedLog {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one occurrence; returns how many (this one included) the caller's line stands for
    /// when a line is due, None when it is not.
    pub fn due(&self) -> Option<u64> {
        self.due_at(Instant::now())
    }

    /// `due` at a given moment (tests pass their own clock).
    pub fn due_at(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock();
        st.1 += 1;
        match st.0 {
            Some(last) if now.duration_since(last) < self.interval => None,
            _ => {
                st.0 = Some(now);
                Some(std::mem::take(&mut st.1))
            }
        }
    }

    /// Logs `what` at info level when a line is due, naming how many it stands for.
    pub fn info(&self, what: impl FnOnce() -> String) {
        if let Some(n) = self.due() {
            if n > 1 {
                log::info!(
                    "{} (and {} more like it since the last such line)",
                    what(),
                    n - 1
                );
            } else {
                log::info!("{}", what());
            }
        } else {
            log::debug!("{}", what());
        }
    }

    /// The same at warning level.
    pub fn warn(&self, what: impl FnOnce() -> String) {
        if let Some(n) = self.due() {
            if n > 1 {
                log::warn!(
                    "{} (and {} more like it since the last such line)",
                    what(),
                    n - 1
                );
            } else {
                log::warn!("{}", what());
            }
        } else {
            log::debug!("{}", what());
        }
    }
}

/// A new connection's pre-login slot: None when no user is configured (nothing to log in to),
/// Err when a cap is full (the caller closes the connection; it is counted and logged here).
pub fn admit(shared: &Arc<Shared>, peer: SocketAddr) -> Result<Option<PreLoginSlot>, Refused> {
    if !shared.users.read().required() {
        return Ok(None);
    }
    match PreLogin::admit(shared, peer.ip().to_canonical()) {
        Ok(slot) => Ok(Some(slot)),
        Err(why) => {
            shared.prelogin.log.warn(|| {
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
pub fn closing_before_login(shared: &Shared, peer: SocketAddr, e: &FrameError) {
    if let FrameError::TooBig { .. } = e {
        shared.prelogin.stats.too_big.fetch_add(1, Relaxed);
    }
    shared
        .prelogin
        .log
        .info(|| format!("closing connection from {peer} before login: {e}"));
}

/// Logs (rate-limited) and counts a connection closed at its login deadline.
pub fn login_timed_out(shared: &Shared, peer: SocketAddr) {
    shared.prelogin.stats.timed_out.fetch_add(1, Relaxed);
    shared.prelogin.log.info(|| {
        format!(
            "closing connection from {peer}: not logged in within {:?}",
            shared.config.login.login_timeout
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_limited_line_counts_what_it_skipped() {
        let log = RateLimitedLog::new(Duration::from_secs(3600));
        assert_eq!(log.due(), Some(1));
        assert_eq!(log.due(), None);
        assert_eq!(log.due(), None);
        let log = RateLimitedLog::new(Duration::ZERO);
        assert_eq!(log.due(), Some(1));
        assert_eq!(log.due(), Some(1));
    }
}
