//! A node taking a TAP feed: TAP messages sent to it as commands (what a relay between two
//! servers forwards) are applied to its bucket. An item keeps the hops it arrived with, so
//! this node's own TAP streams send it on with one less and not at all once none are left:
//! that is what stops two nodes that tap each other from passing a change back and forth
//! forever.

use sluice_core::bucket::Bucket;
use sluice_core::item::with_tap_hops;
use sluice_core::vbucket::VbState;
use sluice_core::{Error, StoreMode, StoreRequest, Written};
use sluice_proto::tap::{message_flag, opcode, TapMessage};

use super::reply::Reply;
use super::{Flow, KvSession};
use sluice_core::Engine;

/// A TAP message applied: the write it made, if any (its ACK waits for the WAL like any
/// write's reply), and whether the sender asked for an ACK.
struct Applied {
    written: Option<Written<()>>,
    ack: bool,
}

/// Applies one TAP message. Failures are answered whether or not an ACK was asked for, so
/// that a producer tracking its messages can send a temporarily failed one again.
fn apply(engine: &Engine, bucket: &Bucket, frame: &[u8]) -> Result<Applied, Error> {
    let m = TapMessage::decode(frame).map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let written =
        match m.opcode {
            // A keys-only feed cannot be applied; it is accepted and left alone.
            opcode::MUTATION if m.tap_flags & message_flag::NO_VALUE != 0 => None,
            opcode::MUTATION => {
                let req = StoreRequest {
                    key: m.key,
                    value: m.value,
                    flags: m.item_flags,
                    expiry: m.expiry,
                    // A message with no hops left still arrives; it just goes no further.
                    datatype: with_tap_hops(m.datatype, m.ttl.max(1)),
                    cas: 0,
                    mode: StoreMode::Set,
                    durability: None,
                    preserve_expiry: false,
                };
                Some(engine.write_fed_store(bucket, &req)?.map(|_| ()))
            }
            opcode::DELETE => match engine.write_fed_delete(bucket, m.key) {
                Ok(w) => Some(w.map(|_| ())),
                Err(Error::NotFound) => None,
                Err(e) => return Err(e),
            },
            opcode::FLUSH => Some(engine.write_flush(bucket)?.map(|_| ())),
            opcode::VBUCKET_SET => match m.engine_code().and_then(VbState::from_code) {
                // Its ACK, like a write's, waits for the WAL to hold the new state.
                Some(state) => Some(engine.write_vbucket_state(bucket, m.vbucket, state)?),
                None => return Err(Error::InvalidArgument(
                    "TAP_VBUCKET_SET needs a 4-byte state (1 active, 2 replica, 3 pending, 4 dead)"
                        .into(),
                )),
            },
            _ => None,
        };
    Ok(Applied {
        written,
        ack: m.tap_flags & message_flag::ACK != 0,
    })
}

impl KvSession {
    /// A TAP message sent as a command (a TAP feed): applied, answered when it asks for an ACK or fails.
    pub(super) fn tap_apply(&mut self, frame: &[u8], reply: &mut Reply<'_>) -> Flow {
        let xerror = self.features.xerror;
        let bucket = self.bucket.clone();
        match apply(&self.ctx.engine, &bucket, frame) {
            // A TAP message is answered when it asks for an ACK, or failed.
            Ok(applied) => {
                self.ctx
                    .tap_applied
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match applied.written {
                    Some(w) => {
                        let quiet = !applied.ack;
                        return self.answer_write(&bucket, w, reply, quiet, |_, r, _| r.ok());
                    }
                    None if applied.ack => reply.ok(),
                    None => {}
                }
            }
            Err(e) => fail!(reply, xerror, e),
        }
        Flow::Continue
    }
}
