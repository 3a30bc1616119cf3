//! Replies of the KV commands: the success and error frames (Couchbase's JSON error context
//! with XERROR), the engine's errors as statuses, and replies held until a durable write settles.

use std::future::Future;
use std::pin::Pin;

use sluice_core::Error;
use sluice_proto::mcbp::{self, magic, status, HeaderFields, Request};

/// A reply whose bytes are known once its write settles (success or the error it met).
pub struct HeldReply(pub(super) Pin<Box<dyn Future<Output = Vec<u8>> + Send>>);

impl Future for HeldReply {
    type Output = Vec<u8>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Vec<u8>> {
        self.0.as_mut().poll(cx)
    }
}

/// The engine's errors as the protocol's status codes.
pub fn status_of(e: &Error) -> u16 {
    match e {
        Error::NotFound => status::KEY_ENOENT,
        // Without XERROR, as Couchbase answers clients that cannot know LOCKED (`status_for`).
        Error::Exists | Error::Locked => status::KEY_EEXISTS,
        Error::LockedTmpFail | Error::NotLocked => status::ETMPFAIL,
        Error::NotStored => status::NOT_STORED,
        Error::NotNumeric => status::DELTA_BADVAL,
        Error::TooBig { .. } => status::E2BIG,
        Error::InvalidKey(_) | Error::InvalidArgument(_) | Error::InvalidConfig { .. } => {
            status::EINVAL
        }
        Error::NotMyVbucket(_) => status::NOT_MY_VBUCKET,
        Error::TempFail(_) | Error::Closed => status::ETMPFAIL,
        // The change is applied and the WAL keeps retrying it: its durability is unknown.
        Error::WalFailed(_) => status::SYNC_WRITE_AMBIGUOUS,
        Error::DurabilityImpossible(_) => status::DURABILITY_IMPOSSIBLE,
        Error::SyncWriteAmbiguous(_) => status::SYNC_WRITE_AMBIGUOUS,
        Error::NoSuchBucket(_) => status::NO_BUCKET,
        Error::Corrupt { .. } | Error::Io(_) => status::EINTERNAL,
    }
}

/// The engine's errors as the statuses a client that negotiated XERROR (or not) is told:
/// Couchbase keeps LOCKED and NOT_LOCKED for clients that know every status.
pub fn status_for(e: &Error, xerror: bool) -> u16 {
    match e {
        Error::Locked | Error::LockedTmpFail if xerror => status::LOCKED,
        Error::NotLocked if xerror => status::NOT_LOCKED,
        other => status_of(other),
    }
}

/// An error reply built from a raw header alone (its opcode and opaque), for frames that do not
/// parse or are not read at all.
pub(crate) fn reply_to_header(header: &[u8], st: u16, message: &[u8], out: &mut Vec<u8>) {
    if header.len() >= mcbp::HEADER_LEN {
        let opaque = u32::from_be_bytes(header[12..16].try_into().expect("4 bytes"));
        mcbp::write_response(out, header[1], opaque, st, 0, message);
    }
}

/// The cluster map a NOT_MY_VBUCKET reply carries, as Couchbase's does: its JSON and the
/// datatype to send it with. Clients parse any JSON body of that status as a map.
pub(super) type MapSource<'a> = &'a (dyn Fn() -> (std::sync::Arc<str>, u8) + Send + Sync);

pub(super) struct Reply<'a> {
    pub(super) out: &'a mut Vec<u8>,
    pub(super) req: &'a Request<'a>,
    pub(super) map: MapSource<'a>,
}

impl Reply<'_> {
    pub(super) fn send(
        &mut self,
        st: u16,
        cas: u64,
        extras: &[u8],
        key: &[u8],
        value: &[u8],
        datatype: u8,
    ) {
        let h = HeaderFields {
            magic: magic::RESPONSE,
            opcode: self.req.opcode,
            datatype,
            word: st,
            opaque: self.req.opaque,
            cas,
        };
        // Sections are bounded by what the engine holds (keys 250 bytes, values max_item_size).
        let _ = mcbp::write_frame(self.out, &h, &[], extras, key, value);
    }

    pub(super) fn ok(&mut self) {
        self.send(status::SUCCESS, 0, &[], &[], &[], 0);
    }

    pub(super) fn error(&mut self, st: u16, message: &str, xerror: bool) {
        error_frame(
            self.out,
            self.req.opcode,
            self.req.opaque,
            st,
            message,
            xerror,
            self.map,
        );
    }
}

/// An error reply: the message as text, or as Couchbase's JSON error context with XERROR;
/// NOT_MY_VBUCKET carries the cluster map instead.
pub(super) fn error_frame(
    out: &mut Vec<u8>,
    opcode: u8,
    opaque: u32,
    st: u16,
    message: &str,
    xerror: bool,
    map: MapSource<'_>,
) {
    if st == status::NOT_MY_VBUCKET {
        let (config, datatype) = map();
        mcbp::write_response(out, opcode, opaque, st, datatype, config.as_bytes());
    } else if xerror {
        let body = format!("{{\"error\":{{\"context\":{}}}}}", json_string(message));
        mcbp::write_response(out, opcode, opaque, st, 0x01, body.as_bytes());
    } else {
        mcbp::write_response(out, opcode, opaque, st, 0, message.as_bytes());
    }
}

pub(super) fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
