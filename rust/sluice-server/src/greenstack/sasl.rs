//! Greenstack's login: SASL PLAIN and SCRAM over SASL_AUTH, through the login throttle shared
//! with every port; the password hash is checked off the I/O thread.

use std::sync::atomic::Ordering::Relaxed;

use sluice_proto::greenstack::payload::{Fields, MapWriter};
use sluice_proto::greenstack::{status, Frame};

use super::reply::{failure, reply, ReplyTo};
use crate::auth::MECHANISMS;
use crate::scram::{self, Mechanism};

use super::session::*;

impl Session {
    /// SASL AUTH: PLAIN in one step; SCRAM in two (the client-first message, answered
    /// "authentication continue" with the server-first one; then the client-final message,
    /// which begins `c=`). A step that checks a secret waits the turn failed logins impose
    /// (shared with the other fronts) and is checked off the connection's task.
    pub(super) fn sasl_auth(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Run {
        let (mechanism, challenge) = match (
            fields.required("mechanism", Fields::str),
            fields.required("challenge", Fields::bytes),
        ) {
            (Ok(m), Ok(c)) => (m, c),
            (Err(e), _) | (_, Err(e)) => {
                return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string()))
            }
        };
        let users = self.ctx.port.users.current();
        let scram = match mechanism {
            "PLAIN" => None,
            m => match Mechanism::from_sasl_name(m.as_bytes()) {
                Some(m) => Some(m),
                None => {
                    return Run::Now(failure(
                        f,
                        status::INVALID_ARGUMENTS,
                        &format!("mechanism {mechanism:?}: this server takes {MECHANISMS}"),
                    ))
                }
            },
        };
        let refused = |why: &str| failure(f, status::AUTHENTICATION_ERROR, why);
        if self.login_needs_tls {
            return Run::Now(refused(crate::request::TLS_REQUIRED));
        }
        // Whoever logs in next, the permissions are read again.
        self.perms.set(None);
        self.admin.set(None);
        let Some(m) = scram else {
            self.user = None;
            self.scram = None;
            let user = crate::auth::plain_user(challenge).to_vec();
            let challenge = challenge.to_vec();
            return self.check_secret(f, user, refused(PLAIN_REFUSED), move |users| {
                if users.required() {
                    users
                        .authenticate_plain(&challenge)
                        .map(|u| (u, Vec::new()))
                } else {
                    Some((
                        String::from_utf8_lossy(crate::auth::plain_user(&challenge)).into_owned(),
                        Vec::new(),
                    ))
                }
            });
        };
        if !challenge.starts_with(b"c=") {
            // A client-first message: a new login forgets the last.
            self.user = None;
            self.scram = None;
            if !users.required() {
                return Run::Now(match scram::parse_client_first(challenge) {
                    Ok(first) => {
                        self.user = Some(first.user);
                        reply(f, status::SUCCESS, &[])
                    }
                    Err(e) => refused(&e.to_string()),
                });
            }
            return Run::Now(match users.scram_start(m, challenge) {
                Ok((exchange, server_first)) => {
                    self.scram = Some(exchange);
                    let mut p = Vec::new();
                    MapWriter::new(&mut p, 1).bin("challenge", server_first.as_bytes());
                    reply(f, status::AUTHENTICATION_CONTINUE, &p)
                }
                Err(e) => refused(&e.to_string()),
            });
        }
        let exchange = match self.scram.take() {
            Some(ex) if ex.mechanism() == m => ex,
            Some(ex) => {
                return Run::Now(refused(&format!(
                    "the SCRAM exchange under way is {}, not {mechanism}",
                    ex.mechanism().sasl_name()
                )))
            }
            None => {
                return Run::Now(refused(
                    "a client-final message with no SCRAM exchange under way: send the client-first one first",
                ))
            }
        };
        let user = exchange.user().as_bytes().to_vec();
        let client_final = challenge.to_vec();
        self.check_secret(f, user, refused(PLAIN_REFUSED), move |users| {
            let name = exchange.user().to_string();
            match exchange.finish(&client_final) {
                // Removed by a reload since the exchange started: no longer a user.
                Ok(server_final) if users.get(&name).is_some() => {
                    let mut p = Vec::new();
                    MapWriter::new(&mut p, 1).bin("challenge", server_final.as_bytes());
                    Some((name, p))
                }
                Ok(_) | Err(_) => None,
            }
        })
    }

    /// A login step that checks a secret: after the wait failed logins impose, `check` runs
    /// off the async workers and gives the user and the success reply's payload, or None
    /// (answered `refused`, counted, logged and told to the admins).
    pub(super) fn check_secret(
        &self,
        f: &Frame<'_>,
        user: Vec<u8>,
        refused: Vec<u8>,
        check: impl FnOnce(&crate::auth::Users) -> Option<(String, Vec<u8>)> + Send + 'static,
    ) -> Run {
        let ip = self.peer.ip();
        let ctx = self.ctx.clone();
        let to = ReplyTo::of(f);
        let deadline = self.login_deadline;
        Run::Later(Box::pin(async move {
            let _turn = match ctx.throttle.turn(&user, ip, deadline.map(Into::into)).await {
                Ok(t) => t,
                Err(throttled) => {
                    ctx.port.prelogin.stats.auth_failures.fetch_add(1, Relaxed);
                    let why = throttled.message(&user);
                    return (to.failure(status::TEMPORARY_FAILURE, &why), Login::None);
                }
            };
            let users = ctx.port.users.current();
            let who = tokio::task::spawn_blocking(move || check(&users))
                .await
                .ok()
                .flatten();
            match who {
                Some((name, payload)) => {
                    ctx.throttle.succeeded(&user);
                    (to.reply(status::SUCCESS, &payload), Login::User(name))
                }
                None => {
                    ctx.throttle.failed(&user, ip);
                    ctx.failed_logins
                        .record(&String::from_utf8_lossy(&user), ip);
                    ctx.port.prelogin.stats.auth_failures.fetch_add(1, Relaxed);
                    ctx.throttle.log.warn(|| {
                        format!(
                            "failed Greenstack login for user {:?} from {ip}",
                            String::from_utf8_lossy(&user)
                        )
                    });
                    (refused, Login::None)
                }
            }
        }))
    }
}
