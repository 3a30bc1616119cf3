//! A node taking a TAP feed: TAP messages sent to it as commands (what a relay between two
//! servers forwards) are applied to its bucket. An item keeps the hops it arrived with, so
//! this node's own TAP streams send it on with one less and not at all once none are left:
//! that is what stops two nodes that tap each other from passing a change back and forth
//! forever.

use sluice_core::item::with_tap_hops;
use sluice_core::vbucket::VbState;
use sluice_core::{Error, StoreMode, StoreRequest};
use sluice_proto::mcbp::{self, magic, status};
use sluice_proto::tap::{message_flag, opcode, TapMessage};

use sluice_core::bucket::Bucket;

use crate::server::Shared;

fn respond(out: &mut Vec<u8>, op: u8, opaque: u32, st: u16, why: &str) {
    let h = mcbp::HeaderFields {
        magic: magic::RESPONSE,
        opcode: op,
        word: st,
        opaque,
        ..Default::default()
    };
    let _ = mcbp::write_frame(out, &h, &[], &[], &[], why.as_bytes());
}

/// Applies one TAP message; answers when it asked for an ACK, or failed (so that a producer
/// tracking its messages can send a temporarily failed one again).
pub fn apply(shared: &Shared, bucket: &Bucket, frame: &[u8], out: &mut Vec<u8>) {
    let m = match TapMessage::decode(frame) {
        Ok(m) => m,
        Err(e) => {
            let (op, opaque) = (
                frame[1],
                u32::from_be_bytes(frame[12..16].try_into().expect("4")),
            );
            return respond(out, op, opaque, status::EINVAL, &e.to_string());
        }
    };
    let engine = &shared.engine;
    let result: Result<(), Error> = match m.opcode {
        // A keys-only feed cannot be applied; it is accepted and left alone.
        opcode::MUTATION if m.tap_flags & message_flag::NO_VALUE != 0 => Ok(()),
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
            };
            engine.store(bucket, &req).map(|_| ())
        }
        opcode::DELETE => match engine.delete(bucket, m.key, 0, None) {
            Ok(_) | Err(Error::NotFound) => Ok(()),
            Err(e) => Err(e),
        },
        opcode::FLUSH => engine.flush(bucket).map(|_| ()),
        opcode::VBUCKET_SET => match m.engine_code().and_then(VbState::from_code) {
            Some(state) => engine.set_vbucket_state(bucket, m.vbucket, state),
            None => Err(Error::InvalidArgument(
                "TAP_VBUCKET_SET needs a 4-byte state (1 active, 2 replica, 3 pending, 4 dead)"
                    .into(),
            )),
        },
        _ => Ok(()),
    };
    match result {
        Ok(()) => {
            shared
                .tap
                .applied
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if m.tap_flags & message_flag::ACK != 0 {
                respond(out, m.opcode, m.opaque, status::SUCCESS, "");
            }
        }
        Err(e) => respond(
            out,
            m.opcode,
            m.opaque,
            crate::kv::status_of(&e),
            &e.to_string(),
        ),
    }
}
