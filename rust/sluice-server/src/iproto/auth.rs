//! AUTH: chap-sha1 against the users' `chap_sha1` (sha1(sha1(password))), with this
//! connection's salt. A failure is counted and slows the next attempts for the same name and
//! address (`throttle::LoginThrottle`, shared with SASL); the connection stays open and keeps
//! the user it had (guest until an AUTH succeeds), as Tarantool's does.

use std::sync::atomic::Ordering::Relaxed;

use sluice_proto::iproto::{codes, response};

use super::failure::{Failure, Outcome};
use super::session::Session;
use crate::auth::{ChapOutcome, GUEST};

impl Session {
    /// A login refused (a wrong password, or throttled): counted with every port's.
    fn count_auth_failure(&self) {
        self.ctx
            .port
            .prelogin
            .stats
            .auth_failures
            .fetch_add(1, Relaxed);
    }

    /// `scramble`: None for `TUPLE []` (guest's return without a password), Err with
    /// the ER_INVALID_MSGPACK text for a malformed one, judged after the user is known.
    pub(super) async fn auth(
        &mut self,
        user: &[u8],
        mechanism: Option<&[u8]>,
        scramble: Result<Option<[u8; 20]>, &'static str>,
        sync: u64,
        peer: crate::driver::PeerWatch<'_>,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let name = String::from_utf8_lossy(user).into_owned();
        let ip = self.peer.ip();
        if self.login_needs_tls {
            return Err(Failure::new(
                codes::ER_ACCESS_DENIED,
                crate::request::TLS_REQUIRED,
            ));
        }
        // A connection the driver closes at its login deadline is answered before then.
        let deadline = self
            .login_deadline
            .filter(|_| !crate::request::guest_served(&self.users));
        let throttle = self.ctx.throttle.clone();
        let turn = tokio::select! {
            turn = throttle.turn(user, ip, deadline.map(Into::into)) => turn,
            _ = self.stop.changed() => Err(crate::throttle::Throttled { retry_in: std::time::Duration::ZERO }),
            // Its client went away: it leaves the line (the driver finds the end next).
            _ = peer.gone() => Err(crate::throttle::Throttled { retry_in: std::time::Duration::ZERO }),
        };
        let _turn = match turn {
            Ok(t) => t,
            Err(throttled) => {
                self.count_auth_failure();
                return Err(Failure::new(
                    codes::ER_ACCESS_DENIED,
                    throttled.message(user),
                ));
            }
        };
        let users = self.ctx.port.users.current();
        let outcome = match (scramble, mechanism) {
            // An unknown user first, as Tarantool checks.
            _ if users.required() && name != GUEST && users.get(&name).is_none() => {
                ChapOutcome::NoSuchUser
            }
            (Err(why), _) => return Err(Failure::new(codes::ER_INVALID_MSGPACK, why)),
            (Ok(None), _) => users.authenticate_chap_sha1(&name, &self.salt, b""),
            (Ok(Some(s)), Some(b"chap-sha1")) => {
                users.authenticate_chap_sha1(&name, &self.salt, &s)
            }
            (Ok(Some(_)), _) => ChapOutcome::Mismatch,
        };
        match outcome {
            ChapOutcome::Ok(who) => {
                self.ctx.throttle.succeeded(user);
                self.user = Some(who);
                self.refresh_permissions();
                response::write_ok(out, sync, self.ctx.catalog.schema_version);
                Ok(())
            }
            failed => {
                self.ctx.throttle.failed(user, ip);
                self.count_auth_failure();
                self.ctx
                    .throttle
                    .log
                    .warn(|| format!("failed iproto login for user {name:?} from {ip}"));
                Err(match failed {
                    ChapOutcome::NoSuchUser => Failure::new(
                        codes::ER_NO_SUCH_USER,
                        format!("User '{name}' is not found"),
                    ),
                    _ => Failure::new(
                        codes::ER_PASSWORD_MISMATCH,
                        format!("Incorrect password supplied for user '{name}'"),
                    ),
                })
            }
        }
    }
}
