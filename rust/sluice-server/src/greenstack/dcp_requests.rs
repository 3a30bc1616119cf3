//! Greenstack's DCP requests: DCP_OPEN, the stream requests and acknowledgements of a DCP
//! connection over Greenstack (the streams themselves are `dcp`), and GET_ALL_VB_SEQNOS.

use std::sync::Arc;

use sluice_core::vbucket::VbState;
use sluice_proto::greenstack::payload::Fields;
use sluice_proto::greenstack::{flag, opcode, status, Frame};

use super::dcp::DcpProducer;
use super::reply::{failure, reply, ReplyTo};
use crate::auth::{READ, STREAM};

use super::session::*;

impl Session {
    /// DCP OPEN `{name, buffer_size?}`: needs the `stream` permission on the selected bucket.
    pub(super) fn dcp_open(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let bucket = match self.bucket_for(f, STREAM) {
            Ok(b) => b,
            Err(reply) => return reply,
        };
        if self.dcp.is_some() {
            return failure(
                f,
                status::INVALID_STATE,
                "this connection has opened DCP already",
            );
        }
        match DcpProducer::open(self.ctx.clone(), Arc::clone(bucket), fields) {
            Ok(d) => {
                self.dcp = Some(d);
                reply(f, status::SUCCESS, &[])
            }
            Err(refused) => refusal(f, refused),
        }
    }

    /// DCP STREAM REQUEST, CLOSE STREAM and BUFFER ACK, once DCP is open.
    pub(super) fn dcp_command(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let Some(dcp) = self.dcp.as_ref() else {
            return failure(f, status::INVALID_STATE, "open DCP first (DCP OPEN)");
        };
        // Checked again per stream, not only at OPEN: a users reload that took the permission
        // away refuses the connection's next streams, as the memcached port does.
        let bucket = dcp.bucket().name();
        if f.opcode == opcode::DCP_STREAM_REQUEST && self.permissions(bucket) & STREAM != STREAM {
            return failure(
                f,
                status::NO_ACCESS,
                &format!("the user lacks the stream permission on bucket {bucket}"),
            );
        }
        let dcp = self.dcp.as_mut().expect("checked above");
        let to = ReplyTo::of(f);
        let done = match f.opcode {
            opcode::DCP_STREAM_REQUEST => match dcp.stream_request(f.opaque, fields) {
                Ok(failover_log) => {
                    let mut p = Vec::new();
                    sluice_proto::msgpack::write_map_len(&mut p, 1);
                    sluice_proto::msgpack::write_str(&mut p, "failover_log");
                    sluice_proto::msgpack::write_array_len(&mut p, failover_log.len() as u32);
                    for (uuid, seqno) in failover_log {
                        sluice_proto::msgpack::write_array_len(&mut p, 2);
                        sluice_proto::msgpack::write_uint(&mut p, uuid);
                        sluice_proto::msgpack::write_uint(&mut p, seqno);
                    }
                    // The stream's messages follow; its STREAM END is the last frame.
                    return to.reply_flagged(status::SUCCESS, flag::MORE, &p);
                }
                Err(refused) => Err(refused),
            },
            opcode::DCP_CLOSE_STREAM => {
                let mut end = Vec::new();
                match dcp.close_stream(fields, &mut end) {
                    Ok(()) => {
                        end.extend_from_slice(&to.reply(status::SUCCESS, &[]));
                        return end;
                    }
                    Err(refused) => Err(refused),
                }
            }
            _ => dcp.buffer_ack(fields),
        };
        match done {
            Ok(()) => to.reply(status::SUCCESS, &[]),
            Err(refused) => refusal(f, refused),
        }
    }

    /// GET_ALL_VB_SEQNOS `{state?}` ("active" by default): `{vbuckets: [[vbucket, seqno]...]}`.
    pub(super) fn all_vb_seqnos(&self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let bucket = match self.bucket_for(f, READ) {
            Ok(b) => b,
            Err(reply) => return reply,
        };
        let state = match fields.str("state") {
            Ok(None) => VbState::Active,
            Ok(Some(s)) => match VbState::parse(s) {
                Some(st) => st,
                None => {
                    return failure(
                        f,
                        status::INVALID_ARGUMENTS,
                        &format!("field 'state': no vbucket state {s:?}"),
                    )
                }
            },
            Err(e) => return failure(f, status::INVALID_ARGUMENTS, &e.to_string()),
        };
        let engine = &self.ctx.port.engine;
        let seqnos: Vec<(u16, u64)> = engine
            .high_seqnos(bucket)
            .into_iter()
            .enumerate()
            .map(|(vb, high)| (vb as u16, high))
            .filter(|&(vb, _)| engine.vbucket_state(bucket, vb) == Some(state))
            .collect();
        let mut p = Vec::new();
        sluice_proto::msgpack::write_map_len(&mut p, 1);
        sluice_proto::msgpack::write_str(&mut p, "vbuckets");
        sluice_proto::msgpack::write_array_len(&mut p, seqnos.len() as u32);
        for (vb, high) in seqnos {
            sluice_proto::msgpack::write_array_len(&mut p, 2);
            sluice_proto::msgpack::write_uint(&mut p, vb as u64);
            sluice_proto::msgpack::write_uint(&mut p, high);
        }
        reply(f, status::SUCCESS, &p)
    }
}
