//! DCP's encoding of a stream's messages: snapshot markers, mutations, deletions and
//! expirations (as the connection's DCP_OPEN flags and controls ask), STREAM_END and
//! SET_VBUCKET_STATE, appended to the connection's output.

use sluice_core::item::{ChangeOp, ItemMeta, DATATYPE_CLIENT_BITS};
use sluice_proto::dcp::{
    opcode, DcpRequest, DocumentRef, SetVbucketState, SnapshotMarker, StreamEnd,
};

use crate::stream::{StreamSink, StreamView};

/// Appends one message and returns its length, for flow control.
fn framed(out: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>)) -> usize {
    let before = out.len();
    write(out);
    out.len() - before
}

/// DCP frames appended to a connection's output.
pub struct DcpSink<'a>(pub &'a mut Vec<u8>);

impl StreamSink for DcpSink<'_> {
    fn marker(
        &mut self,
        s: &StreamView,
        start: u64,
        end: u64,
        flags: u32,
        _checkpoint: Option<u64>,
    ) -> usize {
        framed(self.0, |out| {
            let _ = SnapshotMarker {
                vbucket: s.vbucket,
                start_seqno: start,
                end_seqno: end,
                flags,
            }
            .encode(out, s.opaque);
        })
    }

    fn document(
        &mut self,
        s: &StreamView,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: &ItemMeta,
        _backfill: bool,
    ) -> usize {
        self.write_document(s, op, key, value, meta)
    }

    fn end(&mut self, s: &StreamView, reason: u32) -> usize {
        framed(self.0, |out| {
            let _ = StreamEnd {
                vbucket: s.vbucket,
                reason,
            }
            .encode(out, s.opaque);
        })
    }

    fn vbucket_state(&mut self, s: &StreamView, state: u8) -> usize {
        framed(self.0, |out| {
            let _ = SetVbucketState {
                vbucket: s.vbucket,
                state,
                value: Vec::new(),
            }
            .encode(out, s.opaque);
        })
    }
}

impl DcpSink<'_> {
    fn write_document(
        &mut self,
        s: &StreamView,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: &ItemMeta,
    ) -> usize {
        let e = s.encoding;
        let opcode = match op {
            ChangeOp::Mutation => opcode::MUTATION,
            ChangeOp::Deletion => opcode::DELETION,
            ChangeOp::Expiration if e.expiry_opcode => opcode::EXPIRATION,
            ChangeOp::Expiration => opcode::DELETION,
        };
        let deleted = opcode != opcode::MUTATION;
        let mut datatype = meta.datatype & DATATYPE_CLIENT_BITS;
        let (value, kept) = sent_value(value, &mut datatype, deleted, e);
        let value = kept.as_deref().unwrap_or(value);
        let doc = DocumentRef {
            opcode,
            vbucket: s.vbucket,
            key,
            value: if e.no_value { &[] } else { value },
            by_seqno: meta.by_seqno,
            rev_seqno: meta.rev_seqno,
            cas: meta.cas,
            datatype: if e.no_value && !e.keep_datatype {
                0
            } else {
                datatype
            },
            flags: meta.flags,
            expiration: if deleted { 0 } else { meta.expiry },
            // A tombstone's expiry field holds its delete time.
            delete_time: if deleted { meta.expiry } else { 0 },
        };
        framed(self.0, |out| {
            // Keys and values are bounded by what the engine accepted: encoding cannot fail.
            let _ = doc.encode(out, s.opaque, e.delete_times);
        })
    }
}

/// A document's value as a stream sends it: with its extended attributes if the connection
/// asked for them (a deletion's user attributes only if it asked for those too), else its body
/// alone (nothing for a deletion) with the XATTR bit cleared. Returns the value, or one built
/// for the send when only some attributes go.
fn sent_value<'v>(
    value: &'v [u8],
    datatype: &mut u8,
    deleted: bool,
    e: crate::stream::Encoding,
) -> (&'v [u8], Option<Vec<u8>>) {
    use sluice_proto::xattr::{self, DATATYPE_XATTR};
    if *datatype & DATATYPE_XATTR == 0 {
        return (value, None);
    }
    let Ok((_, body)) = xattr::split(value) else {
        return (value, None);
    };
    if !e.xattrs {
        *datatype &= !DATATYPE_XATTR;
        return (if deleted { &[] } else { body }, None);
    }
    if !deleted || e.deleted_user_xattrs {
        return (value, None);
    }
    match xattr::with_system_attrs(value, body) {
        Some(kept) => (value, Some(kept)),
        None => {
            *datatype &= !DATATYPE_XATTR;
            (&[], None)
        }
    }
}
