//! SASL on the memcached port, through the login throttle (`throttle`): PLAIN's SASL_AUTH and
//! SCRAM's SASL_STEP (the client's proof; the user name is the one its SASL_AUTH gave) wait
//! their turn before the password is checked; SCRAM's SASL_AUTH checks nothing and does not
//! wait; a malformed one counts as a failure. The wait comes before the check, so a client
//! cannot learn the outcome sooner by dropping the connection. The wait is an async sleep of
//! the connection's task. Failures are counted (`sluice_auth_failures_total`) and logged at
//! most once per 10 s; unknown user names are treated like known ones (`auth::Users` checks a
//! dummy hash of the same cost), so neither the delay nor the time taken tells whether a user
//! exists.

use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use sluice_proto::mcbp::{self, status};
use tokio::sync::watch;

use crate::kv::{Flow, KvSession};
use crate::limits::PreLogin;
use crate::throttle::LoginThrottle;

/// A SASL request's user name (empty when there is none), and whether it checks a secret
/// (PLAIN's SASL_AUTH, SCRAM's SASL_STEP) and so waits its turn.
fn attempt(session: &KvSession, frame: &[u8]) -> (Vec<u8>, bool) {
    match mcbp::parse_request(frame) {
        Ok(req) if req.opcode == mcbp::opcode::SASL_STEP => {
            let user = session.scram_user().unwrap_or_default();
            (user.as_bytes().to_vec(), true)
        }
        Ok(req) if req.key == b"PLAIN" => (crate::auth::plain_user(req.value).to_vec(), true),
        Ok(req) => match crate::scram::parse_client_first(req.value) {
            Ok(first) => (first.user.into_bytes(), false),
            Err(_) => (Vec::new(), false),
        },
        Err(_) => (Vec::new(), true),
    }
}

/// Runs a SASL_AUTH or SASL_STEP request: waits its turn when it checks a secret (an async
/// sleep; the connection reads nothing meanwhile), checks it off the async workers, and counts
/// the outcome (a SCRAM exchange that goes on is neither success nor failure). Returns
/// Close when the wait would outlast `deadline` (the connection's login deadline) or the
/// server stops meanwhile.
#[allow(clippy::too_many_arguments)]
pub async fn sasl_auth(
    session: &mut KvSession,
    frame: &[u8],
    ip: IpAddr,
    prelogin: &PreLogin,
    throttle: &LoginThrottle,
    deadline: Option<Instant>,
    stop: &mut watch::Receiver<bool>,
    peer: crate::driver::PeerWatch<'_>,
    out: &mut Vec<u8>,
) -> Flow {
    let (user, checks) = attempt(session, frame);
    let turn = if checks {
        tokio::select! {
            turn = throttle.turn(&user, ip, deadline.map(Into::into)) => Some(turn),
            _ = stop.changed() => return Flow::Close,
            // Its client went away: it leaves the line.
            _ = peer.gone() => return Flow::Close,
        }
    } else {
        None
    };
    if let Some(Err(throttled)) = &turn {
        prelogin.stats.auth_failures.fetch_add(1, Relaxed);
        throttle.log.warn(|| {
            format!(
                "SASL login for user {:?} from {ip} not checked: throttled after failed logins \
                 (retry in {:.1} s)",
                String::from_utf8_lossy(&user),
                throttled.retry_in.as_secs_f64()
            )
        });
        let why = throttled.message(&user);
        crate::kv::reply_to_header(frame, status::ETMPFAIL, why.as_bytes(), out);
        return Flow::Continue;
    }
    // The password hash is slow on purpose (a few milliseconds): it holds the other connections
    // of this I/O thread for as long, as memcached's SASL does.
    let flow = session.handle(frame, out);
    if session.authenticated() {
        throttle.succeeded(&user);
    } else if session.scram_user().is_some() {
        // SCRAM's first message answered: the proof comes with SASL_STEP.
    } else {
        throttle.failed(&user, ip);
        prelogin.stats.auth_failures.fetch_add(1, Relaxed);
        throttle.log.warn(|| {
            format!(
                "failed SASL login for user {:?} from {ip}",
                String::from_utf8_lossy(&user)
            )
        });
    }
    flow
}
