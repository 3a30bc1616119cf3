//! SASL on the KV front: SASL_LIST_MECHS, SASL_AUTH and SASL_STEP for PLAIN and SCRAM-SHA1,
//! -SHA256, -SHA512. A SCRAM exchange spans two requests (AUTH with the client-first message,
//! answered AUTH_CONTINUE with the server-first one; STEP with the client-final message,
//! answered SUCCESS with the server's signature); the session keeps it in between. `login`
//! throttles the attempts around this.
//!
//! A node with no users authenticates no one: any SASL_AUTH with an offered mechanism succeeds
//! at once, whatever the name and password, SCRAM included (Couchbase's SDKs take a SUCCESS to
//! the first message as the end of the login). Clients that always log in, as those SDKs do,
//! work on the embedded default.

use sluice_proto::mcbp::{opcode as op, status};

use super::{KvSession, Reply};
use crate::auth::{plain_user, Users, MECHANISMS};
use crate::scram::{self, Mechanism};

/// How a SASL request ends.
enum Outcome {
    /// Logged in as this user; the reply's body.
    LoggedIn(String, Vec<u8>),
    /// A SCRAM exchange goes on: the server-first message.
    Continue(scram::Exchange, String),
    Refused(String),
}

impl KvSession {
    /// The user a SCRAM exchange under way (between SASL_AUTH and SASL_STEP) is for.
    pub fn scram_user(&self) -> Option<&str> {
        self.scram.as_ref().map(|e| e.user())
    }

    pub(super) fn sasl(&mut self, users: &Users, reply: &mut Reply<'_>) {
        let req = reply.req;
        let outcome = match req.opcode {
            op::SASL_LIST_MECHS => {
                reply.send(status::SUCCESS, 0, &[], &[], MECHANISMS.as_bytes(), 0);
                return;
            }
            op::SASL_AUTH => {
                self.ctx
                    .stats
                    .auth_cmds
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                // A new login forgets the last one: who logged in, any exchange under way.
                self.user = None;
                self.scram = None;
                let mechanism = Mechanism::from_sasl_name(req.key);
                match (req.key, mechanism) {
                    (b"PLAIN", _) if !users.required() => {
                        let name = String::from_utf8_lossy(plain_user(req.value)).into_owned();
                        Outcome::LoggedIn(name, b"Authenticated".to_vec())
                    }
                    (b"PLAIN", _) => match users.authenticate_plain(req.value) {
                        Some(name) => Outcome::LoggedIn(name, b"Authenticated".to_vec()),
                        None => Outcome::Refused("Auth failure".into()),
                    },
                    (_, Some(_)) if !users.required() => match scram::parse_client_first(req.value)
                    {
                        Ok(first) => Outcome::LoggedIn(first.user, b"Authenticated".to_vec()),
                        Err(e) => Outcome::Refused(e.to_string()),
                    },
                    (_, Some(m)) => match users.scram_start(m, req.value) {
                        Ok((exchange, server_first)) => Outcome::Continue(exchange, server_first),
                        Err(e) => Outcome::Refused(e.to_string()),
                    },
                    (name, None) => Outcome::Refused(format!(
                        "unknown mechanism {:?}; offered: {MECHANISMS}",
                        String::from_utf8_lossy(name)
                    )),
                }
            }
            _ => match self.scram.take() {
                None => Outcome::Refused(
                    "SASL_STEP without a SCRAM exchange under way: start one with SASL_AUTH".into(),
                ),
                Some(ex) if ex.mechanism().sasl_name().as_bytes() != req.key => {
                    Outcome::Refused(format!(
                        "SASL_STEP names mechanism {:?}, the exchange under way is {}",
                        String::from_utf8_lossy(req.key),
                        ex.mechanism().sasl_name()
                    ))
                }
                Some(ex) => {
                    let user = ex.user().to_string();
                    match ex.finish(req.value) {
                        // Removed by a reload since the exchange started: no longer a user.
                        Ok(_) if users.get(&user).is_none() => {
                            Outcome::Refused(scram::ScramError::Failed.to_string())
                        }
                        Ok(server_final) => Outcome::LoggedIn(user, server_final.into_bytes()),
                        Err(e) => Outcome::Refused(e.to_string()),
                    }
                }
            },
        };
        match outcome {
            Outcome::LoggedIn(name, body) => {
                self.user = Some(name);
                reply.send(status::SUCCESS, 0, &[], &[], &body, 0);
            }
            Outcome::Continue(exchange, server_first) => {
                self.scram = Some(exchange);
                reply.send(
                    status::AUTH_CONTINUE,
                    0,
                    &[],
                    &[],
                    server_first.as_bytes(),
                    0,
                );
            }
            Outcome::Refused(why) => {
                self.ctx
                    .stats
                    .auth_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                reply.error(status::AUTH_ERROR, &why, self.features.xerror)
            }
        }
    }
}
