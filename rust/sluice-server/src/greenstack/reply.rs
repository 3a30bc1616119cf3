//! Greenstack's replies and notices as bytes: a reply carries its request's opaque, opcode and
//! lane; a failure is its status and `{"message": why}`; an engine error maps to a status as
//! docs/greenstack.md lists them. Shared by the session, its DCP streams and warm-up.

use sluice_core::Error;
use sluice_proto::greenstack::payload::MapWriter;
use sluice_proto::greenstack::{flag, flex_key, opcode, status, FlexEntry, Frame, FrameOut};

use crate::auth::MECHANISMS;

/// What a reply to a request carries over from it: opaque, opcode, lane, and whether it is
/// quiet (its success is not answered).
pub struct ReplyTo {
    opaque: u32,
    opcode: u16,
    lane: Option<Vec<u8>>,
    quiet: bool,
}

impl ReplyTo {
    pub fn of(req: &Frame<'_>) -> ReplyTo {
        ReplyTo {
            opaque: req.opaque,
            opcode: req.opcode,
            lane: req.flex_value(flex_key::LANE_ID).map(<[u8]>::to_vec),
            quiet: req.has(flag::QUIET),
        }
    }

    pub fn reply(&self, st: u16, payload: &[u8]) -> Vec<u8> {
        self.reply_flagged(st, 0, payload)
    }

    /// A reply with flag bits besides the response bit (`more`).
    pub fn reply_flagged(&self, st: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
        self.reply_with(st, flags, |out| out.extend_from_slice(payload))
    }

    /// A reply whose payload `payload` writes in place.
    pub fn reply_with(&self, st: u16, flags: u8, payload: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::new();
        let to = (self.opaque, self.opcode, self.lane.as_deref(), self.quiet);
        write_reply(&mut out, to, st, flags, payload);
        out
    }

    /// A failure's reply: the status and `{"message": why}`.
    pub fn failure(&self, st: u16, why: &str) -> Vec<u8> {
        let mut p = Vec::new();
        MapWriter::new(&mut p, 1).str("message", why);
        self.reply(st, &p)
    }
}

/// HELLO's reply: who the server is and the SASL mechanisms it takes.
pub fn hello_reply(f: &Frame<'_>) -> Vec<u8> {
    let mechanisms: Vec<&str> = MECHANISMS.split(' ').collect();
    let mut p = Vec::new();
    MapWriter::new(&mut p, 3)
        .str("user_agent", "sluice")
        .str("user_agent_version", env!("CARGO_PKG_VERSION"))
        .strs("sasl_mechanisms", mechanisms.into_iter());
    reply(f, status::SUCCESS, &p)
}

/// A notice: a request of opcode NOTICE, `{kind, ...}` with the `n` fields `fields` writes.
pub fn write_notice(
    out: &mut Vec<u8>,
    opaque: u32,
    kind: &str,
    n: u32,
    fields: impl FnOnce(&mut MapWriter<'_>),
) {
    let mut body = Vec::new();
    fields(MapWriter::new(&mut body, n + 1).str("kind", kind));
    FrameOut {
        opaque,
        opcode: opcode::NOTICE,
        flags: 0,
        status: None,
        flex: &[],
        payload: &body,
    }
    .write(out);
}

/// Writes a reply into `out` to the request of `(opaque, opcode, lane, quiet)`: its lane
/// echoed, the payload `payload` writes; nothing for a quiet request's success.
pub fn write_reply(
    out: &mut Vec<u8>,
    (opaque, opcode, lane, quiet): (u32, u16, Option<&[u8]>, bool),
    st: u16,
    flags: u8,
    payload: impl FnOnce(&mut Vec<u8>),
) {
    if st == status::SUCCESS && quiet {
        return;
    }
    let flex = lane.map(|value| FlexEntry {
        key: flex_key::LANE_ID,
        value,
    });
    FrameOut {
        opaque,
        opcode,
        flags,
        status: Some(st),
        flex: flex.as_slice(),
        payload: &[],
    }
    .write_with(out, payload);
}

/// A success reply to `f` written into `out` in place (nothing for a quiet request).
pub fn write_success(f: &Frame<'_>, out: &mut Vec<u8>, payload: impl FnOnce(&mut Vec<u8>)) {
    let to = (
        f.opaque,
        f.opcode,
        f.flex_value(flex_key::LANE_ID),
        f.has(flag::QUIET),
    );
    write_reply(out, to, status::SUCCESS, 0, payload);
}

/// A reply to `req`: same opaque and opcode, its lane echoed.
pub fn reply(req: &Frame<'_>, st: u16, payload: &[u8]) -> Vec<u8> {
    ReplyTo::of(req).reply(st, payload)
}

pub fn failure(req: &Frame<'_>, st: u16, why: &str) -> Vec<u8> {
    ReplyTo::of(req).failure(st, why)
}

/// The status an engine error answers with (docs/greenstack.md).
pub fn status_of(e: &Error) -> u16 {
    match e {
        Error::NotFound => status::NOT_FOUND,
        Error::Exists => status::KEY_EXISTS,
        Error::NotStored => status::NOT_STORED,
        Error::TooBig { .. } => status::TOO_BIG,
        Error::NotMyVbucket(_) => status::NOT_MY_VBUCKET,
        Error::Locked | Error::LockedTmpFail => status::LOCKED,
        Error::TempFail(_) => status::TEMPORARY_FAILURE,
        Error::DurabilityImpossible(_) => status::DURABILITY_IMPOSSIBLE,
        Error::SyncWriteAmbiguous(_) => status::SYNC_WRITE_AMBIGUOUS,
        Error::NoSuchBucket(_) => status::NOT_FOUND,
        Error::InvalidKey(_) | Error::InvalidArgument(_) | Error::NotNumeric => {
            status::INVALID_ARGUMENTS
        }
        _ => status::INTERNAL_ERROR,
    }
}
