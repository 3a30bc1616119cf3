//! DCP over Greenstack (docs/greenstack.md): a connection opens DCP once, then asks for
//! vbucket streams; each stream's messages go out as the server's own requests on the opaque
//! of the request that opened it, quiet (not answered), with the `more` bit on every message
//! but its STREAM END. The streams are the same as on the memcached port (`crate::stream`:
//! backfill, then the checkpoint cursor; DCP's rollback rule), only the encoding differs.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use sluice_core::bucket::Bucket;
use sluice_core::item::{ChangeOp, ItemMeta, DATATYPE_CLIENT_BITS};
use sluice_proto::dcp::stream_end_reason;
use sluice_proto::greenstack::payload::{Fields, MapWriter, PayloadError};
use sluice_proto::greenstack::{flag, flex_key, opcode, status, FlexEntry, FrameOut};

use super::GreenstackContext;
use crate::stream::{turn_order, Encoding, Progress, StartAt, StartRefused, Stream, StreamSink};

/// What one stream may write before the next takes its turn.
const TURN_BYTES: usize = 64 << 10;
/// The longest DCP name taken (it names the streams' cursors).
const MAX_NAME: usize = 200;

/// Why a DCP command failed.
pub(super) enum Refusal {
    /// The status and message to answer.
    Status(u16, String),
    /// A stream request's history diverged from the vbucket's: start again from this seqno.
    Rollback(u64),
}

/// A connection's DCP side: its name, flow control and open streams.
pub(super) struct DcpProducer {
    ctx: Arc<GreenstackContext>,
    bucket: Arc<Bucket>,
    name: String,
    /// The client's window (0: no flow control) and the bytes it has not acknowledged.
    buffer_size: usize,
    unacked: usize,
    streams: BTreeMap<u16, Stream>,
    turn: u16,
}

fn invalid(e: PayloadError) -> Refusal {
    Refusal::Status(status::INVALID_ARGUMENTS, e.to_string())
}

impl DcpProducer {
    /// DCP OPEN `{name, buffer_size?}` on the selected bucket.
    pub(super) fn open(
        ctx: Arc<GreenstackContext>,
        bucket: Arc<Bucket>,
        fields: &Fields<'_>,
    ) -> Result<DcpProducer, Refusal> {
        let name = fields.required("name", Fields::str).map_err(invalid)?;
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(Refusal::Status(
                status::INVALID_ARGUMENTS,
                format!("field 'name': 1 to {MAX_NAME} bytes"),
            ));
        }
        let buffer_size = fields
            .uint_max("buffer_size", u32::MAX as u64)
            .map_err(invalid)?
            .unwrap_or(0) as usize;
        Ok(DcpProducer {
            ctx,
            bucket,
            name: format!("greenstack:{name}"),
            buffer_size,
            unacked: 0,
            streams: BTreeMap::new(),
            turn: 0,
        })
    }

    /// DCP STREAM REQUEST: the stream opens (its failover log answered) or the refusal.
    pub(super) fn stream_request(
        &mut self,
        opaque: u32,
        fields: &Fields<'_>,
    ) -> Result<Vec<(u64, u64)>, Refusal> {
        let parsed = (|| {
            let vbucket = fields.required("vbucket", |f, n| f.uint_max(n, u16::MAX as u64))?;
            let start_seqno = fields.uint("start_seqno")?.unwrap_or(0);
            Ok::<_, PayloadError>(StartAt {
                start_seqno,
                end_seqno: fields.uint("end_seqno")?.unwrap_or(u64::MAX),
                vbucket_uuid: fields.uint("vbucket_uuid")?.unwrap_or(0),
                snap_start_seqno: fields.uint("snap_start_seqno")?.unwrap_or(start_seqno),
                snap_end_seqno: fields.uint("snap_end_seqno")?.unwrap_or(start_seqno),
                from_latest: fields.bool("from_latest")?.unwrap_or(false),
                to_latest: fields.bool("to_latest")?.unwrap_or(false),
                ignore_purged_tombstones: false,
            })
            .map(|at| (vbucket as u16, at))
        })();
        let (vb, asked) = parsed.map_err(invalid)?;
        if self.streams.contains_key(&vb) {
            return Err(Refusal::Status(
                status::KEY_EXISTS,
                format!("a stream of vbucket {vb} is open on this connection"),
            ));
        }
        let engine = &self.ctx.port.engine;
        let pos = engine
            .stream_position(&self.bucket, vb)
            .filter(|p| p.state != sluice_core::vbucket::VbState::Dead)
            .ok_or_else(|| {
                Refusal::Status(
                    status::NOT_MY_VBUCKET,
                    format!("vbucket {vb} is not streamable here"),
                )
            })?;
        let (start, end) = asked.resolve(&pos).map_err(|refused| match refused {
            StartRefused::Rollback(seqno) => Refusal::Rollback(seqno),
            StartRefused::OutOfRange(why) => Refusal::Status(status::INVALID_ARGUMENTS, why),
        })?;
        let stream = Stream::open(
            engine,
            self.bucket.clone(),
            vb,
            opaque,
            &self.name,
            start,
            end,
            Encoding {
                delete_times: true,
                expiry_opcode: true,
                ..Encoding::default()
            },
            false,
            &pos,
        )
        .map_err(|e| Refusal::Status(super::reply::status_of(&e), e.to_string()))?;
        self.streams.insert(vb, stream);
        self.ctx.stats.dcp_streams.fetch_add(1, Relaxed);
        Ok(pos.failover.iter().map(|e| (e.uuid, e.seqno)).collect())
    }

    /// DCP CLOSE STREAM `{vbucket}`: its STREAM END (closed) is appended to `out`.
    pub(super) fn close_stream(
        &mut self,
        fields: &Fields<'_>,
        out: &mut Vec<u8>,
    ) -> Result<(), Refusal> {
        let vb = fields
            .required("vbucket", |f, n| f.uint_max(n, u16::MAX as u64))
            .map_err(invalid)? as u16;
        let Some(mut s) = self.streams.remove(&vb) else {
            return Err(Refusal::Status(
                status::NOT_FOUND,
                format!("no stream of vbucket {vb} is open on this connection"),
            ));
        };
        s.write_end(&mut GreenstackSink(out), stream_end_reason::CLOSED);
        self.retire(&mut s);
        Ok(())
    }

    /// DCP BUFFER ACK `{bytes}`: the client has processed that many bytes of messages.
    pub(super) fn buffer_ack(&mut self, fields: &Fields<'_>) -> Result<(), Refusal> {
        let n = fields.required("bytes", Fields::uint).map_err(invalid)?;
        self.unacked = self
            .unacked
            .saturating_sub(n.min(usize::MAX as u64) as usize);
        Ok(())
    }

    /// The bytes the streams may still send before the client acknowledges some.
    fn window(&self) -> usize {
        if self.buffer_size == 0 {
            usize::MAX
        } else {
            self.buffer_size.saturating_sub(self.unacked)
        }
    }

    /// Whether the streams could send now if the bucket changed.
    pub(super) fn can_send(&self) -> bool {
        !self.streams.is_empty() && self.window() > 0
    }

    pub(super) fn has_streams(&self) -> bool {
        !self.streams.is_empty()
    }

    pub(super) fn bucket(&self) -> &Arc<Bucket> {
        &self.bucket
    }

    /// Appends the streams' messages, taking turns, until `out` holds `limit` bytes, the
    /// window is full or nothing is left to send. Returns whether anything was written.
    pub(super) fn fill(&mut self, out: &mut Vec<u8>, limit: usize) -> bool {
        let engine = self.ctx.port.engine.clone();
        let mut wrote = false;
        let mut idle_round = false;
        while !idle_round && out.len() < limit && self.window() > 0 && !self.streams.is_empty() {
            idle_round = true;
            for vb in turn_order(&self.streams, self.turn) {
                let window = self.window();
                if window == 0 || out.len() >= limit {
                    self.turn = vb;
                    break;
                }
                let s = self.streams.get_mut(&vb).expect("listed above");
                let before = out.len();
                let (n, progress) =
                    s.fill(&engine, &mut GreenstackSink(out), window.min(TURN_BYTES));
                self.ctx.stats.dcp_items.fetch_add(
                    std::mem::take(&mut s.sent_backfill) + std::mem::take(&mut s.sent_memory),
                    Relaxed,
                );
                if self.buffer_size > 0 {
                    self.unacked += n;
                }
                match progress {
                    Progress::Sent => idle_round = false,
                    Progress::Idle => {}
                    Progress::Ended(_) => {
                        let mut s = self.streams.remove(&vb).expect("listed above");
                        self.retire(&mut s);
                        idle_round = false;
                    }
                }
                wrote |= out.len() > before;
                self.turn = vb.wrapping_add(1);
            }
        }
        wrote
    }

    fn retire(&self, s: &mut Stream) {
        s.close(&self.ctx.port.engine);
        self.ctx.stats.dcp_streams.fetch_sub(1, Relaxed);
    }
}

impl Drop for DcpProducer {
    /// The connection went: its streams' cursors go with it (else they would hold the
    /// bucket's checkpoints).
    fn drop(&mut self) {
        for mut s in std::mem::take(&mut self.streams).into_values() {
            self.retire(&mut s);
        }
    }
}

/// Stream messages as Greenstack frames: the server's requests, quiet, on the stream's opaque,
/// the vbucket in the flex header, `more` on all but STREAM END.
struct GreenstackSink<'a>(&'a mut Vec<u8>);

impl GreenstackSink<'_> {
    fn message(
        &mut self,
        s: &crate::stream::StreamView,
        opcode: u16,
        more: bool,
        payload: &[u8],
    ) -> usize {
        let before = self.0.len();
        let vb = s.vbucket.to_be_bytes();
        FrameOut {
            opaque: s.opaque,
            opcode,
            flags: flag::QUIET | if more { flag::MORE } else { 0 },
            status: None,
            flex: &[FlexEntry {
                key: flex_key::VBUCKET_ID,
                value: &vb,
            }],
            payload,
        }
        .write(self.0);
        self.0.len() - before
    }
}

impl StreamSink for GreenstackSink<'_> {
    fn marker(
        &mut self,
        s: &crate::stream::StreamView,
        start: u64,
        end: u64,
        flags: u32,
        _checkpoint: Option<u64>,
    ) -> usize {
        let mut p = Vec::with_capacity(32);
        MapWriter::new(&mut p, 3)
            .uint("start", start)
            .uint("end", end)
            .uint("flags", flags as u64);
        self.message(s, opcode::DCP_SNAPSHOT_MARKER, true, &p)
    }

    fn document(
        &mut self,
        s: &crate::stream::StreamView,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: &ItemMeta,
        _backfill: bool,
    ) -> usize {
        let mut p = Vec::with_capacity(96 + key.len() + value.len());
        let opcode = match op {
            ChangeOp::Mutation => {
                MapWriter::new(&mut p, 8)
                    .uint("seqno", meta.by_seqno)
                    .uint("rev_seqno", meta.rev_seqno)
                    .bin("key", key)
                    // Greenstack's stream carries bodies, without extended attributes.
                    .bin("value", sluice_proto::xattr::body(value, meta.datatype))
                    .uint("flags", meta.flags as u64)
                    .uint("expiration", meta.expiry as u64)
                    .uint("cas", meta.cas)
                    .uint(
                        "datatype",
                        (meta.datatype
                            & DATATYPE_CLIENT_BITS
                            & !sluice_proto::xattr::DATATYPE_XATTR) as u64,
                    );
                opcode::DCP_MUTATION
            }
            ChangeOp::Deletion | ChangeOp::Expiration => {
                // A tombstone's expiry field holds its delete time.
                MapWriter::new(&mut p, 5)
                    .uint("seqno", meta.by_seqno)
                    .uint("rev_seqno", meta.rev_seqno)
                    .bin("key", key)
                    .uint("cas", meta.cas)
                    .uint("delete_time", meta.expiry as u64);
                if op == ChangeOp::Deletion {
                    opcode::DCP_DELETION
                } else {
                    opcode::DCP_EXPIRATION
                }
            }
        };
        self.message(s, opcode, true, &p)
    }

    fn end(&mut self, s: &crate::stream::StreamView, reason: u32) -> usize {
        let mut p = Vec::new();
        MapWriter::new(&mut p, 1).uint("reason", reason as u64);
        self.message(s, opcode::DCP_STREAM_END, false, &p)
    }

    /// Takeover is not offered over Greenstack: no stream asks for one.
    fn vbucket_state(&mut self, _s: &crate::stream::StreamView, _state: u8) -> usize {
        0
    }
}
