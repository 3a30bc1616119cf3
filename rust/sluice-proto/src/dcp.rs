//! DCP, Couchbase's Database Change Protocol (shared/reference/couchbase-kv/dcp/documentation):
//! the messages a consumer and a producer exchange, each one memcached binary frame (`mcbp`).
//!
//! DCP is full duplex: the producer sends its stream messages (snapshot marker, mutation,
//! deletion, ...) as *requests* (magic 0x80) and matches any response by opaque, so every message
//! here encodes as a request unless it is a response to one. A stream's opaque is the opaque of
//! its STREAM_REQ, which is why `encode` takes the opaque instead of the structs holding it.
//!
//! Each message is a struct with `encode`, which appends a whole frame, and `decode`, which reads
//! an already split `mcbp::Request` / `mcbp::Response` after checking opcode, extras length and
//! which sections must be absent; `decode_frame` does both steps for a frame in a buffer.
//! Framing extras (the stream-id frame info, magic 0x08) are accepted and left in the
//! `mcbp::Request` for the caller: `mcbp::frame_infos` reads them.
//!
//! Where the documents contradict themselves the command's own page wins and a comment says
//! so; several of their example hex dumps do not agree with their own field tables, which the
//! tests spell out byte by byte.

use std::fmt;

use crate::mcbp::{self, FrameError, HeaderFields, Request, Response};

/// DCP opcodes (BinaryProtocol.md's opcode table and each command's page agree on these).
pub mod opcode {
    pub const OPEN: u8 = 0x50;
    pub const ADD_STREAM: u8 = 0x51;
    pub const CLOSE_STREAM: u8 = 0x52;
    pub const STREAM_REQ: u8 = 0x53;
    /// DCP's failover-log request; not the plain-KV `mcbp::opcode::GET_FAILOVER_LOG` (0x96).
    pub const GET_FAILOVER_LOG: u8 = 0x54;
    pub const STREAM_END: u8 = 0x55;
    pub const SNAPSHOT_MARKER: u8 = 0x56;
    pub const MUTATION: u8 = 0x57;
    pub const DELETION: u8 = 0x58;
    pub const EXPIRATION: u8 = 0x59;
    /// Obsolete ("Not Supported in 3.0", flush.md).
    pub const FLUSH: u8 = 0x5a;
    pub const SET_VBUCKET_STATE: u8 = 0x5b;
    pub const NOOP: u8 = 0x5c;
    pub const BUFFER_ACKNOWLEDGEMENT: u8 = 0x5d;
    pub const CONTROL: u8 = 0x5e;
    pub const SYSTEM_EVENT: u8 = 0x5f;
    pub const PREPARE: u8 = 0x60;
    pub const SEQNO_ACKNOWLEDGED: u8 = 0x61;
    pub const COMMIT: u8 = 0x62;
    pub const ABORT: u8 = 0x63;
    pub const SEQNO_ADVANCED: u8 = 0x64;
    pub const OSO_SNAPSHOT: u8 = 0x65;
    pub const CACHE_TRANSFER: u8 = 0x66;
    pub const CACHE_TRANSFER_END: u8 = 0x67;
}

/// DCP_OPEN flags (open-connection.md), a big-endian u32 in the extras.
pub mod open_flag {
    /// Set: open a producer (the sender is the consumer). Clear: open a consumer.
    pub const PRODUCER: u32 = 0x01;
    /// "Invalid, should always be clear" (open-connection.md). It was the notifier flag; the
    /// page no longer defines a notifier connection, so there is no NOTIFIER constant to send.
    pub const INVALID: u32 = 0x02;
    pub const INCLUDE_XATTRS: u32 = 0x04;
    pub const NO_VALUE: u32 = 0x08;
    pub const INCLUDE_DELETE_TIMES: u32 = 0x20;
    pub const NO_VALUE_WITH_UNDERLYING_DATATYPE: u32 = 0x40;
    pub const INCLUDE_DELETED_USER_XATTRS: u32 = 0x100;
    /// Needs collections (it relies on seqno-advanced).
    pub const SKIP_DELETES_IN_INITIAL_BACKFILL: u32 = 0x200;
}

/// STREAM_REQ / ADD_STREAM flags (add-stream.md; stream-request.md points there).
pub mod stream_flag {
    pub const TAKEOVER: u32 = 0x01;
    pub const DISK_ONLY: u32 = 0x02;
    /// The server replaces the end seqno with the vbucket's current high seqno.
    pub const TO_LATEST: u32 = 0x04;
    /// Removed in 5.0: use `open_flag::NO_VALUE` instead.
    pub const NO_VALUE: u32 = 0x08;
    pub const ACTIVE_VB_ONLY: u32 = 0x10;
    /// Check the vbucket uuid even at start seqno 0, answering ROLLBACK on a mismatch.
    pub const STRICT_VBUUID: u32 = 0x20;
    /// Start at the current high seqno; the start seqno is ignored.
    pub const FROM_LATEST: u32 = 0x40;
    /// Skip the purge-seqno rollback; the client may miss deletions.
    pub const IGNORE_PURGED_TOMBSTONES: u32 = 0x80;
    pub const CACHE_TRANSFER: u32 = 0x100;
}

/// Snapshot-type bits of a snapshot marker (snapshot-marker.md).
pub mod snapshot_flag {
    pub const MEMORY: u32 = 0x01;
    pub const DISK: u32 = 0x02;
    pub const CHECKPOINT: u32 = 0x04;
    /// The consumer answers the marker once the whole snapshot has arrived.
    pub const ACK: u32 = 0x08;
    /// History (change streams): mutations of history collections are not deduplicated.
    pub const HISTORY: u32 = 0x10;
    /// The snapshot may hold a key more than once (7.2+).
    pub const MAY_CONTAIN_DUPLICATES: u32 = 0x20;
}

/// Why a stream ended: the 4-byte extras of STREAM_END (stream-end.md).
pub mod stream_end_reason {
    pub const OK: u32 = 0x00;
    pub const CLOSED: u32 = 0x01;
    pub const STATE_CHANGED: u32 = 0x02;
    pub const DISCONNECTED: u32 = 0x03;
    /// Cursor dropped: the client read too slowly and should reconnect.
    pub const TOO_SLOW: u32 = 0x04;
    pub const BACKFILL_FAILED: u32 = 0x05;
    /// The vbucket is rolling back: reopen the stream and follow the rollback protocol.
    pub const ROLLBACK: u32 = 0x06;
    pub const FILTER_EMPTY: u32 = 0x07;
    pub const LOST_PRIVILEGES: u32 = 0x08;
}

/// The state byte of SET_VBUCKET_STATE (set-vbucket-state.md).
pub mod vbucket_state {
    pub const ACTIVE: u8 = 0x01;
    pub const REPLICA: u8 = 0x02;
    pub const PENDING: u8 = 0x03;
    pub const DEAD: u8 = 0x04;
}

/// Status codes DCP adds to `mcbp::status` (stream-request.md, close-stream.md, control.md).
pub mod status {
    /// Only once the client sent the control `v7_dcp_status_codes=true`.
    pub const DCP_STREAM_NOT_FOUND: u16 = 0x0a;
    /// Only once the client sent the control `v7_dcp_status_codes=true`.
    pub const OPAQUE_NO_MATCH: u16 = 0x0b;
    pub const DCP_STREAMID_INVALID: u16 = 0x8d;
}

/// The longest connection name DCP_OPEN allows ("no more space than 200 bytes").
pub const MAX_NAME_LEN: usize = 200;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DcpError {
    /// The frame itself is broken (section lengths, magic).
    Frame(FrameError),
    /// The frame is some other message than the decoder reads.
    WrongOpcode { expected: u8, got: u8 },
    /// The extras are not a length the command's page defines.
    ExtrasLen { opcode: u8, len: usize },
    /// A section the page says must (not) be there, or a value that does not fit its layout.
    Malformed(&'static str),
    /// A response whose status this message defines no body for (an error answer); the caller
    /// still has the `mcbp::Response`, with any error text in its value.
    Status(u16),
    /// A documented format this codec does not implement (the snapshot marker v2).
    Unsupported(&'static str),
}

impl fmt::Display for DcpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DcpError::Frame(e) => write!(f, "{e}"),
            DcpError::WrongOpcode { expected, got } => {
                write!(f, "expected opcode 0x{expected:02x}, got 0x{got:02x}")
            }
            DcpError::ExtrasLen { opcode, len } => {
                write!(f, "opcode 0x{opcode:02x} cannot have {len} bytes of extras")
            }
            DcpError::Malformed(why) => write!(f, "malformed DCP message: {why}"),
            DcpError::Status(s) => write!(f, "response status 0x{s:04x}"),
            DcpError::Unsupported(what) => write!(f, "unsupported: {what}"),
        }
    }
}

impl std::error::Error for DcpError {}

impl From<FrameError> for DcpError {
    fn from(e: FrameError) -> Self {
        DcpError::Frame(e)
    }
}

/// A DCP request (or producer-to-consumer message, which DCP also sends as a request).
pub trait DcpRequest: Sized {
    const OPCODE: u8;
    /// Appends the whole frame; fails, appending nothing, when a section is too long for the
    /// header (a key over 65535 bytes, a body over 4 GiB, a DCP_OPEN name over 200 bytes).
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError>;
    fn decode(req: &Request<'_>) -> Result<Self, DcpError>;
    fn decode_frame(frame: &[u8]) -> Result<Self, DcpError> {
        Self::decode(&mcbp::parse_request(frame)?)
    }
}

/// A response to a DCP request.
pub trait DcpResponse: Sized {
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError>;
    fn decode(resp: &Response<'_>) -> Result<Self, DcpError>;
    fn decode_frame(frame: &[u8]) -> Result<Self, DcpError> {
        Self::decode(&mcbp::parse_response(frame)?)
    }
}

// ---- helpers -----------------------------------------------------------------------------------

/// Reads big-endian integers off a slice whose length the caller has checked; a short slice is
/// still an error, never a panic.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DcpError> {
        if self.0.len() < n {
            return Err(DcpError::Malformed("extras end inside a field"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, DcpError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, DcpError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, DcpError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, DcpError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }
}

fn check_opcode(expected: u8, got: u8) -> Result<(), DcpError> {
    if expected == got {
        Ok(())
    } else {
        Err(DcpError::WrongOpcode { expected, got })
    }
}

/// Opcode and extras length of a request; most DCP messages allow exactly one extras length.
fn check_request(req: &Request<'_>, op: u8, extras: &[usize]) -> Result<(), DcpError> {
    check_opcode(op, req.opcode)?;
    if !extras.contains(&req.extras.len()) {
        return Err(DcpError::ExtrasLen {
            opcode: op,
            len: req.extras.len(),
        });
    }
    Ok(())
}

fn no_key(key: &[u8]) -> Result<(), DcpError> {
    if key.is_empty() {
        Ok(())
    } else {
        Err(DcpError::Malformed("this message must not have a key"))
    }
}

fn no_value(value: &[u8]) -> Result<(), DcpError> {
    if value.is_empty() {
        Ok(())
    } else {
        Err(DcpError::Malformed("this message must not have a value"))
    }
}

fn must_have_key(key: &[u8]) -> Result<(), DcpError> {
    if key.is_empty() {
        Err(DcpError::Malformed("this message must have a key"))
    } else {
        Ok(())
    }
}

/// The fields of a request header that vary between DCP messages.
#[derive(Default)]
struct Head {
    opcode: u8,
    vbucket: u16,
    datatype: u8,
    cas: u64,
}

fn write_request(
    out: &mut Vec<u8>,
    h: Head,
    opaque: u32,
    extras: &[u8],
    key: &[u8],
    value: &[u8],
) -> Result<(), DcpError> {
    let fields = HeaderFields {
        magic: mcbp::magic::REQUEST,
        opcode: h.opcode,
        datatype: h.datatype,
        word: h.vbucket,
        opaque,
        cas: h.cas,
    };
    Ok(mcbp::write_frame(out, &fields, &[], extras, key, value)?)
}

fn write_response(
    out: &mut Vec<u8>,
    opcode: u8,
    status: u16,
    opaque: u32,
    extras: &[u8],
    value: &[u8],
) -> Result<(), DcpError> {
    let fields = HeaderFields {
        magic: mcbp::magic::RESPONSE,
        opcode,
        word: status,
        opaque,
        ..Default::default()
    };
    Ok(mcbp::write_frame(out, &fields, &[], extras, &[], value)?)
}

// ---- connection setup --------------------------------------------------------------------------

/// DCP_OPEN (0x50): names the connection and says whether the server side is a producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenConnection {
    /// At most 200 bytes; `service-name:unique-information` is the recommended form.
    pub name: Vec<u8>,
    pub flags: u32,
    /// The first 4 bytes of the extras: "Reserved" in the page's layout, "seqno" in its example
    /// breakdown. Kept as read so a frame re-encodes byte for byte.
    pub reserved: u32,
    /// Optional JSON object (6.5+), e.g. `{"consumer_name":"..."}`; empty when absent.
    pub value: Vec<u8>,
}

impl DcpRequest for OpenConnection {
    const OPCODE: u8 = opcode::OPEN;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        check_name(&self.name)?;
        let mut extras = [0u8; 8];
        extras[..4].copy_from_slice(&self.reserved.to_be_bytes());
        extras[4..].copy_from_slice(&self.flags.to_be_bytes());
        let h = Head {
            opcode: Self::OPCODE,
            ..Default::default()
        };
        write_request(out, h, opaque, &extras, &self.name, &self.value)
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[8])?;
        check_name(req.key)?;
        let mut r = Reader(req.extras);
        let reserved = r.u32()?;
        let flags = r.u32()?;
        Ok(OpenConnection {
            name: req.key.to_vec(),
            flags,
            reserved,
            value: req.value.to_vec(),
        })
    }
}

fn check_name(name: &[u8]) -> Result<(), DcpError> {
    must_have_key(name)?;
    if name.len() > MAX_NAME_LEN {
        return Err(DcpError::Malformed("connection name longer than 200 bytes"));
    }
    Ok(())
}

/// DCP_CONTROL (0x5e): one connection setting, both key and value as text (control.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Control {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

impl DcpRequest for Control {
    const OPCODE: u8 = opcode::CONTROL;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        self.check()?;
        let h = Head {
            opcode: Self::OPCODE,
            ..Default::default()
        };
        write_request(out, h, opaque, &[], &self.key, &self.value)
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        // The page's example header claims 4 bytes of extras, but its layout lists only a key
        // and a value and its own bytes carry no extras: we follow the layout (no extras).
        check_request(req, Self::OPCODE, &[0])?;
        let c = Control {
            key: req.key.to_vec(),
            value: req.value.to_vec(),
        };
        c.check()?;
        Ok(c)
    }
}

impl Control {
    fn check(&self) -> Result<(), DcpError> {
        must_have_key(&self.key)?;
        if self.value.is_empty() {
            return Err(DcpError::Malformed("control must have a value"));
        }
        Ok(())
    }
}

/// DCP_ADD_STREAM (0x51): tells a consumer to request a stream from its producer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddStream {
    pub vbucket: u16,
    /// `stream_flag` bits, passed on in the consumer's STREAM_REQ.
    pub flags: u32,
}

impl DcpRequest for AddStream {
    const OPCODE: u8 = opcode::ADD_STREAM;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        write_request(out, h, opaque, &self.flags.to_be_bytes(), &[], &[])
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[4])?;
        no_key(req.key)?;
        no_value(req.value)?;
        Ok(AddStream {
            vbucket: req.vbucket,
            flags: Reader(req.extras).u32()?,
        })
    }
}

/// The success answer to ADD_STREAM: 4 bytes of extras holding the opaque the new stream's
/// messages will carry. (The page's prose also mentions "the vbucket identifier in the extra
/// field", but its layout and example have only the opaque; we follow those.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddStreamResponse {
    pub stream_opaque: u32,
}

impl DcpResponse for AddStreamResponse {
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        write_response(
            out,
            opcode::ADD_STREAM,
            mcbp::status::SUCCESS,
            opaque,
            &self.stream_opaque.to_be_bytes(),
            &[],
        )
    }
    fn decode(resp: &Response<'_>) -> Result<Self, DcpError> {
        check_opcode(opcode::ADD_STREAM, resp.opcode)?;
        if resp.status != mcbp::status::SUCCESS {
            return Err(DcpError::Status(resp.status));
        }
        if resp.extras.len() != 4 {
            return Err(DcpError::ExtrasLen {
                opcode: opcode::ADD_STREAM,
                len: resp.extras.len(),
            });
        }
        no_key(resp.key)?;
        no_value(resp.value)?;
        Ok(AddStreamResponse {
            stream_opaque: Reader(resp.extras).u32()?,
        })
    }
}

/// The answer to a request whose response carries nothing but a status: DCP_OPEN, CONTROL,
/// CLOSE_STREAM, NOOP, BUFFER_ACKNOWLEDGEMENT, SET_VBUCKET_STATE, SNAPSHOT_MARKER (with the ack
/// flag), SEQNO_ACKNOWLEDGED, and the error answer to the stream messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusResponse {
    pub opcode: u8,
    pub status: u16,
}

impl DcpResponse for StatusResponse {
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        write_response(out, self.opcode, self.status, opaque, &[], &[])
    }
    /// A success must have an empty body (every documented one does); an error may carry text
    /// in its value, which stays in the `mcbp::Response`.
    fn decode(resp: &Response<'_>) -> Result<Self, DcpError> {
        if resp.status == mcbp::status::SUCCESS
            && !(resp.extras.is_empty() && resp.key.is_empty() && resp.value.is_empty())
        {
            return Err(DcpError::Malformed("a status-only success has a body"));
        }
        Ok(StatusResponse {
            opcode: resp.opcode,
            status: resp.status,
        })
    }
}

// ---- streams -----------------------------------------------------------------------------------

/// DCP_STREAM_REQ (0x53): 48 bytes of extras (stream-request.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRequest {
    pub vbucket: u16,
    /// `stream_flag` bits.
    pub flags: u32,
    /// The last seqno the consumer has.
    pub start_seqno: u64,
    /// 0xffff_ffff_ffff_ffff streams forever.
    pub end_seqno: u64,
    /// 0 asks for everything, skipping the history check.
    pub vbucket_uuid: u64,
    pub snap_start_seqno: u64,
    pub snap_end_seqno: u64,
    /// Optional JSON (collections filter, stream id, purge seqno; stream-request-value.md);
    /// empty when absent.
    pub value: Vec<u8>,
}

impl DcpRequest for StreamRequest {
    const OPCODE: u8 = opcode::STREAM_REQ;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let mut e = Vec::with_capacity(48);
        e.extend_from_slice(&self.flags.to_be_bytes());
        e.extend_from_slice(&0u32.to_be_bytes()); // reserved
        for v in [
            self.start_seqno,
            self.end_seqno,
            self.vbucket_uuid,
            self.snap_start_seqno,
            self.snap_end_seqno,
        ] {
            e.extend_from_slice(&v.to_be_bytes());
        }
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        write_request(out, h, opaque, &e, &[], &self.value)
    }
    /// The reserved word is ignored, as its name asks.
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[48])?;
        no_key(req.key)?;
        let mut r = Reader(req.extras);
        let flags = r.u32()?;
        let _reserved = r.u32()?;
        Ok(StreamRequest {
            vbucket: req.vbucket,
            flags,
            start_seqno: r.u64()?,
            end_seqno: r.u64()?,
            vbucket_uuid: r.u64()?,
            snap_start_seqno: r.u64()?,
            snap_end_seqno: r.u64()?,
            value: req.value.to_vec(),
        })
    }
}

/// One failover-log entry: the vbucket uuid of a history branch and the seqno it began at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailoverLogEntry {
    pub vbucket_uuid: u64,
    pub seqno: u64,
}

fn encode_failover_log(entries: &[FailoverLogEntry]) -> Vec<u8> {
    let mut v = Vec::with_capacity(entries.len() * 16);
    for e in entries {
        v.extend_from_slice(&e.vbucket_uuid.to_be_bytes());
        v.extend_from_slice(&e.seqno.to_be_bytes());
    }
    v
}

/// A failover log is a whole number of 16-byte (uuid, seqno) entries, newest first.
pub fn decode_failover_log(value: &[u8]) -> Result<Vec<FailoverLogEntry>, DcpError> {
    // `chunks_exact` rather than `len() % 16`: the workspace's rust-version (1.80) predates
    // `is_multiple_of`, which clippy asks for.
    let chunks = value.chunks_exact(16);
    if value.is_empty() || !chunks.remainder().is_empty() {
        return Err(DcpError::Malformed(
            "a failover log is one or more 16-byte entries",
        ));
    }
    chunks
        .map(|c| {
            let mut r = Reader(c);
            Ok(FailoverLogEntry {
                vbucket_uuid: r.u64()?,
                seqno: r.u64()?,
            })
        })
        .collect()
}

/// The two answers to STREAM_REQ that have a body (stream-request.md): success with the
/// vbucket's failover log, or ROLLBACK (0x23) with the seqno to roll back to. Any other status
/// decodes as `DcpError::Status`.
///
/// rollback.md says "the producer sends its failover log and the rollback point", but
/// stream-request.md's rollback example carries only the 8-byte seqno; we follow
/// stream-request.md (a client fetches the log with GET_FAILOVER_LOG).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamRequestResponse {
    /// Newest entry first.
    Ok(Vec<FailoverLogEntry>),
    Rollback(u64),
}

impl DcpResponse for StreamRequestResponse {
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        match self {
            StreamRequestResponse::Ok(log) => {
                if log.is_empty() {
                    return Err(DcpError::Malformed(
                        "a failover log is one or more 16-byte entries",
                    ));
                }
                write_response(
                    out,
                    opcode::STREAM_REQ,
                    mcbp::status::SUCCESS,
                    opaque,
                    &[],
                    &encode_failover_log(log),
                )
            }
            StreamRequestResponse::Rollback(seqno) => write_response(
                out,
                opcode::STREAM_REQ,
                mcbp::status::ROLLBACK,
                opaque,
                &[],
                &seqno.to_be_bytes(),
            ),
        }
    }
    fn decode(resp: &Response<'_>) -> Result<Self, DcpError> {
        check_opcode(opcode::STREAM_REQ, resp.opcode)?;
        match resp.status {
            mcbp::status::SUCCESS | mcbp::status::ROLLBACK => {}
            s => return Err(DcpError::Status(s)),
        }
        if !resp.extras.is_empty() {
            return Err(DcpError::ExtrasLen {
                opcode: opcode::STREAM_REQ,
                len: resp.extras.len(),
            });
        }
        no_key(resp.key)?;
        if resp.status == mcbp::status::ROLLBACK {
            if resp.value.len() != 8 {
                return Err(DcpError::Malformed(
                    "a rollback answer carries an 8-byte seqno",
                ));
            }
            return Ok(StreamRequestResponse::Rollback(Reader(resp.value).u64()?));
        }
        Ok(StreamRequestResponse::Ok(decode_failover_log(resp.value)?))
    }
}

/// DCP_GET_FAILOVER_LOG (0x54): no extras, key or value; the vbucket is in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetFailoverLog {
    pub vbucket: u16,
}

impl DcpRequest for GetFailoverLog {
    const OPCODE: u8 = opcode::GET_FAILOVER_LOG;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        write_request(out, h, opaque, &[], &[], &[])
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[0])?;
        no_key(req.key)?;
        no_value(req.value)?;
        Ok(GetFailoverLog {
            vbucket: req.vbucket,
        })
    }
}

/// The success answer to GET_FAILOVER_LOG: the log, newest entry first (failover-log.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailoverLogResponse {
    pub entries: Vec<FailoverLogEntry>,
}

impl DcpResponse for FailoverLogResponse {
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        if self.entries.is_empty() {
            return Err(DcpError::Malformed(
                "a failover log is one or more 16-byte entries",
            ));
        }
        write_response(
            out,
            opcode::GET_FAILOVER_LOG,
            mcbp::status::SUCCESS,
            opaque,
            &[],
            &encode_failover_log(&self.entries),
        )
    }
    fn decode(resp: &Response<'_>) -> Result<Self, DcpError> {
        check_opcode(opcode::GET_FAILOVER_LOG, resp.opcode)?;
        if resp.status != mcbp::status::SUCCESS {
            return Err(DcpError::Status(resp.status));
        }
        if !resp.extras.is_empty() {
            return Err(DcpError::ExtrasLen {
                opcode: opcode::GET_FAILOVER_LOG,
                len: resp.extras.len(),
            });
        }
        no_key(resp.key)?;
        Ok(FailoverLogResponse {
            entries: decode_failover_log(resp.value)?,
        })
    }
}

/// DCP_STREAM_END (0x55): the producer has nothing more for this vbucket stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamEnd {
    pub vbucket: u16,
    /// A `stream_end_reason` (the page calls the extras "flags").
    pub reason: u32,
}

impl DcpRequest for StreamEnd {
    const OPCODE: u8 = opcode::STREAM_END;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        write_request(out, h, opaque, &self.reason.to_be_bytes(), &[], &[])
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[4])?;
        no_key(req.key)?;
        no_value(req.value)?;
        Ok(StreamEnd {
            vbucket: req.vbucket,
            reason: Reader(req.extras).u32()?,
        })
    }
}

/// DCP_CLOSE_STREAM (0x52): close the stream of the vbucket in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CloseStream {
    pub vbucket: u16,
}

impl DcpRequest for CloseStream {
    const OPCODE: u8 = opcode::CLOSE_STREAM;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        write_request(out, h, opaque, &[], &[], &[])
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[0])?;
        no_key(req.key)?;
        no_value(req.value)?;
        Ok(CloseStream {
            vbucket: req.vbucket,
        })
    }
}

/// DCP_SNAPSHOT_MARKER (0x56) in its original (V1) form: 20 bytes of extras, start seqno, end
/// seqno, snapshot type.
///
/// snapshot-marker.md also defines V2 (1 byte of extras holding a version, the fields in the
/// value: v2.0 adds max-visible and high-completed seqnos, v2.2 purge and high-prepared seqnos),
/// sent only after sync replication or the `max_marker_version` control. It is not implemented:
/// `decode` answers `DcpError::Unsupported` for 1 byte of extras. (The page's V2 example is also
/// unusable as a reference: its extras-length byte is 0x14 and its body length 0, where its own
/// table says 0x01 and 0x25, and its value bytes do not match the documented offsets.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotMarker {
    pub vbucket: u16,
    pub start_seqno: u64,
    pub end_seqno: u64,
    /// `snapshot_flag` bits.
    pub flags: u32,
}

impl DcpRequest for SnapshotMarker {
    const OPCODE: u8 = opcode::SNAPSHOT_MARKER;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let mut e = [0u8; 20];
        e[..8].copy_from_slice(&self.start_seqno.to_be_bytes());
        e[8..16].copy_from_slice(&self.end_seqno.to_be_bytes());
        e[16..].copy_from_slice(&self.flags.to_be_bytes());
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        write_request(out, h, opaque, &e, &[], &[])
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        if req.opcode == Self::OPCODE && req.extras.len() == 1 {
            return Err(DcpError::Unsupported("snapshot marker v2"));
        }
        check_request(req, Self::OPCODE, &[20])?;
        no_key(req.key)?;
        // "Can only have a value if V2 format is in use".
        no_value(req.value)?;
        let mut r = Reader(req.extras);
        Ok(SnapshotMarker {
            vbucket: req.vbucket,
            start_seqno: r.u64()?,
            end_seqno: r.u64()?,
            flags: r.u32()?,
        })
    }
}

// ---- documents ---------------------------------------------------------------------------------

/// DCP_MUTATION (0x57), mutation.md: 31 bytes of extras, by_seqno (8), rev_seqno (8), flags (4),
/// expiration (4), lock_time (4), nmeta (2), nru (1).
///
/// The page's extras diagram also draws a `clen` byte after NRU, which would make 32 bytes; its
/// "Total 31 bytes", its example (extras length 0x1f, key at offset 55) and its value-length
/// formula all say 31, so there is no clen.
///
/// The extended metadata (`nmeta` bytes) follows the value: value length = body - key - nmeta
/// - 31.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mutation {
    pub vbucket: u16,
    /// With collections enabled, prefixed by the collection id as unsigned LEB128.
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub by_seqno: u64,
    pub rev_seqno: u64,
    pub flags: u32,
    pub expiration: u32,
    pub lock_time: u32,
    /// Internal to the server; consumers may ignore it.
    pub nru: u8,
    pub cas: u64,
    /// Describes the value as sent (JSON, XATTR, SNAPPY bits), not the stored document.
    pub datatype: u8,
    pub extended_meta: Vec<u8>,
}

/// Splits the value section into the value proper and the trailing extended metadata.
fn split_meta(section: &[u8], nmeta: u16) -> Result<(&[u8], &[u8]), DcpError> {
    let nmeta = nmeta as usize;
    if nmeta > section.len() {
        return Err(DcpError::Malformed(
            "extended metadata longer than what follows the key",
        ));
    }
    Ok(section.split_at(section.len() - nmeta))
}

fn nmeta_len(meta: &[u8]) -> Result<u16, DcpError> {
    u16::try_from(meta.len())
        .map_err(|_| DcpError::Malformed("extended metadata longer than 65535 bytes"))
}

fn concat(a: &[u8], b: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(a.len() + b.len());
    v.extend_from_slice(a);
    v.extend_from_slice(b);
    v
}

impl DcpRequest for Mutation {
    const OPCODE: u8 = opcode::MUTATION;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        must_have_key(&self.key)?;
        let mut e = Vec::with_capacity(31);
        e.extend_from_slice(&self.by_seqno.to_be_bytes());
        e.extend_from_slice(&self.rev_seqno.to_be_bytes());
        e.extend_from_slice(&self.flags.to_be_bytes());
        e.extend_from_slice(&self.expiration.to_be_bytes());
        e.extend_from_slice(&self.lock_time.to_be_bytes());
        e.extend_from_slice(&nmeta_len(&self.extended_meta)?.to_be_bytes());
        e.push(self.nru);
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            datatype: self.datatype,
            cas: self.cas,
        };
        let body = concat(&self.value, &self.extended_meta);
        write_request(out, h, opaque, &e, &self.key, &body)
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[31])?;
        must_have_key(req.key)?;
        let mut r = Reader(req.extras);
        let by_seqno = r.u64()?;
        let rev_seqno = r.u64()?;
        let flags = r.u32()?;
        let expiration = r.u32()?;
        let lock_time = r.u32()?;
        let nmeta = r.u16()?;
        let nru = r.u8()?;
        let (value, meta) = split_meta(req.value, nmeta)?;
        Ok(Mutation {
            vbucket: req.vbucket,
            key: req.key.to_vec(),
            value: value.to_vec(),
            by_seqno,
            rev_seqno,
            flags,
            expiration,
            lock_time,
            nru,
            cas: req.cas,
            datatype: req.datatype,
            extended_meta: meta.to_vec(),
        })
    }
}

/// The two deletion formats (deletion.md): which one a producer sends is fixed by the DCP_OPEN
/// flag `INCLUDE_DELETE_TIMES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeletionFormat {
    /// 18 bytes of extras: by_seqno, rev_seqno, nmeta (u16); the extended metadata ends the body.
    V1 { extended_meta: Vec<u8> },
    /// 21 bytes of extras: by_seqno, rev_seqno, delete_time (u32), one unused byte (written 0,
    /// ignored when read). A delete_time of 0 means an in-memory delete.
    V2 { delete_time: u32 },
}

/// DCP_DELETION (0x58).
///
/// The page says a deletion "must not have value", yet its own datatype section describes the
/// value of a deletion (XATTRs), and DCP_OPEN's `INCLUDE_DELETED_USER_XATTRS` puts user xattrs
/// "within deletion values": we accept and keep a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deletion {
    pub vbucket: u16,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub by_seqno: u64,
    pub rev_seqno: u64,
    pub cas: u64,
    pub datatype: u8,
    pub format: DeletionFormat,
}

impl DcpRequest for Deletion {
    const OPCODE: u8 = opcode::DELETION;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        must_have_key(&self.key)?;
        let mut e = Vec::with_capacity(21);
        e.extend_from_slice(&self.by_seqno.to_be_bytes());
        e.extend_from_slice(&self.rev_seqno.to_be_bytes());
        let body = match &self.format {
            DeletionFormat::V1 { extended_meta } => {
                e.extend_from_slice(&nmeta_len(extended_meta)?.to_be_bytes());
                concat(&self.value, extended_meta)
            }
            DeletionFormat::V2 { delete_time } => {
                e.extend_from_slice(&delete_time.to_be_bytes());
                e.push(0);
                self.value.clone()
            }
        };
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            datatype: self.datatype,
            cas: self.cas,
        };
        write_request(out, h, opaque, &e, &self.key, &body)
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[18, 21])?;
        must_have_key(req.key)?;
        let mut r = Reader(req.extras);
        let by_seqno = r.u64()?;
        let rev_seqno = r.u64()?;
        let (value, format) = if req.extras.len() == 18 {
            let (value, meta) = split_meta(req.value, r.u16()?)?;
            (
                value,
                DeletionFormat::V1 {
                    extended_meta: meta.to_vec(),
                },
            )
        } else {
            let delete_time = r.u32()?;
            let _unused = r.u8()?;
            (req.value, DeletionFormat::V2 { delete_time })
        };
        Ok(Deletion {
            vbucket: req.vbucket,
            key: req.key.to_vec(),
            value: value.to_vec(),
            by_seqno,
            rev_seqno,
            cas: req.cas,
            datatype: req.datatype,
            format,
        })
    }
}

/// DCP_EXPIRATION (0x59), sent only after the control `enable_expiry_opcode=true`: 20 bytes of
/// extras, by_seqno, rev_seqno, delete_time (expiration.md's layout, "Total 20 bytes").
///
/// The page's example header says extras length 0x12 and body 0x17 (copied from the deletion
/// example), but its bytes hold the 20-byte layout: delete time at 40-43, key at 44-48. We follow
/// the layout. As with deletions, the datatype section describes a value (XATTRs) although the
/// request "must not have value": we accept and keep one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiration {
    pub vbucket: u16,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub by_seqno: u64,
    pub rev_seqno: u64,
    pub delete_time: u32,
    pub cas: u64,
    pub datatype: u8,
}

impl DcpRequest for Expiration {
    const OPCODE: u8 = opcode::EXPIRATION;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        must_have_key(&self.key)?;
        let mut e = [0u8; 20];
        e[..8].copy_from_slice(&self.by_seqno.to_be_bytes());
        e[8..16].copy_from_slice(&self.rev_seqno.to_be_bytes());
        e[16..].copy_from_slice(&self.delete_time.to_be_bytes());
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            datatype: self.datatype,
            cas: self.cas,
        };
        write_request(out, h, opaque, &e, &self.key, &self.value)
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[20])?;
        must_have_key(req.key)?;
        let mut r = Reader(req.extras);
        Ok(Expiration {
            vbucket: req.vbucket,
            key: req.key.to_vec(),
            value: req.value.to_vec(),
            by_seqno: r.u64()?,
            rev_seqno: r.u64()?,
            delete_time: r.u32()?,
            cas: req.cas,
            datatype: req.datatype,
        })
    }
}

// ---- control traffic ---------------------------------------------------------------------------

/// DCP_NOOP (0x5c): the producer's liveness probe; the consumer answers with a
/// `StatusResponse`. Nothing but the header (and its opaque).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Noop;

impl DcpRequest for Noop {
    const OPCODE: u8 = opcode::NOOP;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            ..Default::default()
        };
        write_request(out, h, opaque, &[], &[], &[])
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[0])?;
        no_key(req.key)?;
        no_value(req.value)?;
        Ok(Noop)
    }
}

/// DCP_BUFFER_ACKNOWLEDGEMENT (0x5d): the consumer has processed this many bytes (headers
/// included) and the producer may send that much more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferAcknowledgement {
    pub bytes: u32,
}

impl DcpRequest for BufferAcknowledgement {
    const OPCODE: u8 = opcode::BUFFER_ACKNOWLEDGEMENT;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            ..Default::default()
        };
        write_request(out, h, opaque, &self.bytes.to_be_bytes(), &[], &[])
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[4])?;
        no_key(req.key)?;
        no_value(req.value)?;
        Ok(BufferAcknowledgement {
            bytes: Reader(req.extras).u32()?,
        })
    }
}

/// DCP_SET_VBUCKET_STATE (0x5b): hands a vbucket over during takeover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetVbucketState {
    pub vbucket: u16,
    /// A `vbucket_state`.
    pub state: u8,
    /// Optional (set-vbucket-state-value.md); empty when absent.
    pub value: Vec<u8>,
}

impl DcpRequest for SetVbucketState {
    const OPCODE: u8 = opcode::SET_VBUCKET_STATE;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        write_request(out, h, opaque, &[self.state], &[], &self.value)
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[1])?;
        no_key(req.key)?;
        Ok(SetVbucketState {
            vbucket: req.vbucket,
            state: Reader(req.extras).u8()?,
            value: req.value.to_vec(),
        })
    }
}

/// DCP_SEQNO_ACKNOWLEDGED (0x61): the consumer's highest prepared seqno (sync replication).
/// sluice's replicas acknowledge the end of each whole snapshot they hold; a consumer that set
/// the control `persisted_seqno_acks` adds the seqno it holds on disk as an 8-byte value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqnoAcknowledged {
    pub vbucket: u16,
    pub prepared_seqno: u64,
    pub persisted_seqno: Option<u64>,
}

impl DcpRequest for SeqnoAcknowledged {
    const OPCODE: u8 = opcode::SEQNO_ACKNOWLEDGED;
    fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), DcpError> {
        let h = Head {
            opcode: Self::OPCODE,
            vbucket: self.vbucket,
            ..Default::default()
        };
        let value = self.persisted_seqno.map(u64::to_be_bytes);
        let value: &[u8] = match &value {
            Some(v) => v,
            None => &[],
        };
        write_request(
            out,
            h,
            opaque,
            &self.prepared_seqno.to_be_bytes(),
            &[],
            value,
        )
    }
    fn decode(req: &Request<'_>) -> Result<Self, DcpError> {
        check_request(req, Self::OPCODE, &[8])?;
        no_key(req.key)?;
        let persisted_seqno = match req.value.len() {
            0 => None,
            8 => Some(Reader(req.value).u64()?),
            _ => {
                return Err(DcpError::Malformed(
                    "SEQNO_ACKNOWLEDGED value must be empty or 8 bytes",
                ))
            }
        };
        Ok(SeqnoAcknowledged {
            vbucket: req.vbucket,
            prepared_seqno: Reader(req.extras).u64()?,
            persisted_seqno,
        })
    }
}

// ---- the hot path's document form -----------------------------------------------------------

/// MUTATION, DELETION or EXPIRATION borrowed from a frame or from the item it describes: what a
/// producer encodes and a consumer decodes per document, with no allocation. It leaves out what
/// sluice neither sends nor keeps (lock time, NRU, extended metadata are written as 0 / empty and
/// skipped when read). The owned message types above are the full-fidelity codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DocumentRef<'a> {
    /// `opcode::MUTATION`, `DELETION` or `EXPIRATION`.
    pub opcode: u8,
    pub vbucket: u16,
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub by_seqno: u64,
    pub rev_seqno: u64,
    pub cas: u64,
    pub datatype: u8,
    /// Mutations only.
    pub flags: u32,
    /// Mutations only: the item's expiry.
    pub expiration: u32,
    /// Deletions in the v2 format and expirations: when the document was deleted (0 when the
    /// producer does not know).
    pub delete_time: u32,
}

impl<'a> DocumentRef<'a> {
    /// Appends the frame. Deletions use the v2 (21-byte, delete time) format when
    /// `delete_times`, as DCP_OPEN's INCLUDE_DELETE_TIMES asks, else v1 (18 bytes).
    pub fn encode(
        &self,
        out: &mut Vec<u8>,
        opaque: u32,
        delete_times: bool,
    ) -> Result<(), DcpError> {
        must_have_key(self.key)?;
        let mut e = [0u8; 31];
        e[..8].copy_from_slice(&self.by_seqno.to_be_bytes());
        e[8..16].copy_from_slice(&self.rev_seqno.to_be_bytes());
        let extras = match self.opcode {
            opcode::MUTATION => {
                e[16..20].copy_from_slice(&self.flags.to_be_bytes());
                e[20..24].copy_from_slice(&self.expiration.to_be_bytes());
                // lock time, nmeta 0, nru 0
                &e[..31]
            }
            opcode::DELETION if delete_times => {
                e[16..20].copy_from_slice(&self.delete_time.to_be_bytes());
                &e[..21]
            }
            opcode::DELETION => &e[..18],
            opcode::EXPIRATION => {
                e[16..20].copy_from_slice(&self.delete_time.to_be_bytes());
                &e[..20]
            }
            _ => return Err(DcpError::Malformed("not a document message")),
        };
        let h = Head {
            opcode: self.opcode,
            vbucket: self.vbucket,
            datatype: self.datatype,
            cas: self.cas,
        };
        write_request(out, h, opaque, extras, self.key, self.value)
    }

    pub fn decode(req: &Request<'a>) -> Result<DocumentRef<'a>, DcpError> {
        let allowed: &[usize] = match req.opcode {
            opcode::MUTATION => &[31],
            opcode::DELETION => &[18, 21],
            opcode::EXPIRATION => &[20],
            _ => return Err(DcpError::Malformed("not a document message")),
        };
        check_request(req, req.opcode, allowed)?;
        must_have_key(req.key)?;
        let mut r = Reader(req.extras);
        let mut d = DocumentRef {
            opcode: req.opcode,
            vbucket: req.vbucket,
            key: req.key,
            value: req.value,
            by_seqno: r.u64()?,
            rev_seqno: r.u64()?,
            cas: req.cas,
            datatype: req.datatype,
            flags: 0,
            expiration: 0,
            delete_time: 0,
        };
        match (req.opcode, req.extras.len()) {
            (opcode::MUTATION, _) => {
                d.flags = r.u32()?;
                d.expiration = r.u32()?;
                let _lock_time = r.u32()?;
                d.value = split_meta(req.value, r.u16()?)?.0;
            }
            (opcode::DELETION, 18) => d.value = split_meta(req.value, r.u16()?)?.0,
            _ => d.delete_time = r.u32()?,
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::fmt::Debug;

    /// The documents' hex dumps, transcribed row by row as whitespace-separated hex bytes.
    fn hex(s: &str) -> Vec<u8> {
        s.split_whitespace()
            .map(|b| u8::from_str_radix(b, 16).expect("hex byte"))
            .collect()
    }

    fn encoded<T: DcpRequest>(m: &T, opaque: u32) -> Vec<u8> {
        let mut out = Vec::new();
        m.encode(&mut out, opaque).unwrap();
        out
    }

    fn encoded_response<T: DcpResponse>(m: &T, opaque: u32) -> Vec<u8> {
        let mut out = Vec::new();
        m.encode(&mut out, opaque).unwrap();
        out
    }

    /// Decodes a documented request, checks its opaque and that it is the whole frame.
    fn request<T: DcpRequest>(frame: &[u8], opaque: u32) -> T {
        assert_eq!(mcbp::frame_len(frame, 1 << 20), Ok(Some(frame.len())));
        let r = mcbp::parse_request(frame).unwrap();
        assert_eq!(r.opaque, opaque);
        T::decode(&r).unwrap()
    }

    fn response<T: DcpResponse>(frame: &[u8], opaque: u32) -> T {
        assert_eq!(mcbp::frame_len(frame, 1 << 20), Ok(Some(frame.len())));
        let r = mcbp::parse_response(frame).unwrap();
        assert_eq!(r.opaque, opaque);
        T::decode(&r).unwrap()
    }

    // ---- open-connection.md ----

    #[test]
    fn documented_open_connection() {
        let req = hex("80 50 00 18  08 00 00 00  00 00 00 20  00 00 00 01  00 00 00 00  00 00 00 00
                       00 00 00 00  00 00 00 00
                       62 75 63 6b  65 74 73 74  72 65 61 6d  20 76 62 5b  31 30 30 2d  31 30 35 5d");
        let m: OpenConnection = request(&req, 1);
        assert_eq!(
            m,
            OpenConnection {
                name: b"bucketstream vb[100-105]".to_vec(),
                flags: 0, // consumer
                reserved: 0,
                value: vec![],
            }
        );
        assert_eq!(m.flags & open_flag::PRODUCER, 0);
        assert_eq!(encoded(&m, 1), req);

        let resp =
            hex("81 50 00 00  00 00 00 00  00 00 00 00  00 00 00 01  00 00 00 00  00 00 00 00");
        let s: StatusResponse = response(&resp, 1);
        assert_eq!(
            s,
            StatusResponse {
                opcode: opcode::OPEN,
                status: mcbp::status::SUCCESS
            }
        );
        assert_eq!(encoded_response(&s, 1), resp);
    }

    #[test]
    fn open_connection_name_limits() {
        let mut m = OpenConnection {
            name: vec![b'n'; 201],
            flags: open_flag::PRODUCER,
            reserved: 0,
            value: vec![],
        };
        let mut out = Vec::new();
        assert!(m.encode(&mut out, 0).is_err());
        assert!(out.is_empty());
        m.name.truncate(200);
        assert_eq!(OpenConnection::decode_frame(&encoded(&m, 9)), Ok(m));
    }

    // ---- control.md ----

    #[test]
    fn documented_control() {
        // The dump as printed: its header (key length 0, extras 4, vbucket 5, body 4 — the
        // add-stream example's header) does not describe its own 15 bytes of key and value.
        let printed = hex(
            "80 5e 00 00  04 00 00 05  00 00 00 04  00 00 00 01  00 00 00 00  00 00 00 00
                           65 6e 61 62  6c 65 5f 6e  6f 6f 70 74  72 75 65",
        );
        assert!(Control::decode_frame(&printed).is_err());
        // The same bytes with the header the page's layout implies: key "enable_noop" (11),
        // no extras, value "true", body 15.
        let mut fixed = printed.clone();
        fixed[2..12].copy_from_slice(&[0x00, 0x0b, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x0f]);
        let m: Control = request(&fixed, 1);
        assert_eq!(
            m,
            Control {
                key: b"enable_noop".to_vec(),
                value: b"true".to_vec()
            }
        );
        assert_eq!(encoded(&m, 1), fixed);
        // The printed response is no better: opcode 0x51, extras 4 and body 4 with no body.
        let printed_resp =
            hex("81 51 00 00  04 00 00 00  00 00 00 04  00 00 00 01  00 00 00 00  00 00 00 00");
        assert!(StatusResponse::decode_frame(&printed_resp).is_err());
    }

    // ---- add-stream.md ----

    #[test]
    fn documented_add_stream() {
        let req = hex(
            "80 51 00 00  04 00 00 05  00 00 00 04  00 00 00 01  00 00 00 00  00 00 00 00
                       00 00 00 01",
        );
        let m: AddStream = request(&req, 1);
        assert_eq!(
            m,
            AddStream {
                vbucket: 5,
                flags: stream_flag::TAKEOVER
            }
        );
        assert_eq!(encoded(&m, 1), req);
        let resp = hex(
            "81 51 00 00  04 00 00 00  00 00 00 04  00 00 00 01  00 00 00 00  00 00 00 00
                        00 00 10 00",
        );
        let r: AddStreamResponse = response(&resp, 1);
        assert_eq!(r.stream_opaque, 0x1000);
        assert_eq!(encoded_response(&r, 1), resp);
    }

    // ---- stream-request.md ----

    #[test]
    fn documented_stream_request_rollback_then_success() {
        let first = hex("80 53 00 00  30 00 00 00  00 00 00 30  00 00 10 00  00 00 00 00  00 00 00 00
                         00 00 00 00  00 00 00 00  00 00 00 00  00 ff ee dd  ff ff ff ff  ff ff ff ff
                         00 00 00 00  fe ed de ca  00 00 00 00  00 ff ee dd  00 00 00 00  00 ff ee ff");
        let m: StreamRequest = request(&first, 0x1000);
        assert_eq!(
            m,
            StreamRequest {
                vbucket: 0,
                flags: 0,
                start_seqno: 0x00ff_eedd,
                end_seqno: u64::MAX,
                vbucket_uuid: 0xfeed_deca,
                // The field table says 0x0000000000000000; the bytes at 56-63 say 0xffeedd.
                // The bytes are what a decoder sees (and keep snap_start <= start <= snap_end).
                snap_start_seqno: 0x00ff_eedd,
                snap_end_seqno: 0x00ff_eeff,
                value: vec![],
            }
        );
        assert_eq!(encoded(&m, 0x1000), first);

        let rollback = hex(
            "81 53 00 00  00 00 00 23  00 00 00 08  00 00 10 00  00 00 00 00  00 00 00 00
                            00 00 00 00  00 00 00 00",
        );
        let r: StreamRequestResponse = response(&rollback, 0x1000);
        assert_eq!(r, StreamRequestResponse::Rollback(0));
        assert_eq!(encoded_response(&r, 0x1000), rollback);

        let retry = hex("80 53 00 00  30 00 00 00  00 00 00 30  00 00 10 00  00 00 00 00  00 00 00 00
                         00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 00  ff ff ff ff  ff ff ff ff
                         00 00 00 00  fe ed de ca  00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 00");
        let m: StreamRequest = request(&retry, 0x1000);
        assert_eq!(
            m,
            StreamRequest {
                vbucket: 0,
                flags: 0,
                start_seqno: 0,
                end_seqno: u64::MAX,
                vbucket_uuid: 0xfeed_deca,
                snap_start_seqno: 0,
                snap_end_seqno: 0,
                value: vec![],
            }
        );
        assert_eq!(encoded(&m, 0x1000), retry);

        let ok = hex(&format!(
            "81 53 00 00  00 00 00 00  00 00 00 40  00 00 10 00  00 00 00 00  00 00 00 00 {DOC_FAILOVER_LOG}"
        ));
        let r: StreamRequestResponse = response(&ok, 0x1000);
        assert_eq!(r, StreamRequestResponse::Ok(doc_failover_entries()));
        assert_eq!(encoded_response(&r, 0x1000), ok);
    }

    /// The four-entry failover log both stream-request.md and failover-log.md print.
    const DOC_FAILOVER_LOG: &str = "00 00 00 00  fe ed de ca  00 00 00 00  00 00 54 32
                                    00 00 00 00  00 de ca fe  00 00 00 00  01 34 32 14
                                    00 00 00 00  fe ed fa ce  00 00 00 00  00 00 00 04
                                    00 00 00 00  de ad be ef  00 00 00 00  00 00 65 24";

    fn doc_failover_entries() -> Vec<FailoverLogEntry> {
        [
            (0xfeed_deca, 0x5432),
            (0x00de_cafe, 0x0134_3214),
            (0xfeed_face, 0x4),
            (0xdead_beef, 0x6524),
        ]
        .into_iter()
        .map(|(vbucket_uuid, seqno)| FailoverLogEntry {
            vbucket_uuid,
            seqno,
        })
        .collect()
    }

    #[test]
    fn stream_request_errors_and_bad_bodies() {
        // A status without a documented body is handed back as such.
        let mut out = Vec::new();
        StatusResponse {
            opcode: opcode::STREAM_REQ,
            status: mcbp::status::NOT_MY_VBUCKET,
        }
        .encode(&mut out, 3)
        .unwrap();
        assert_eq!(
            StreamRequestResponse::decode_frame(&out),
            Err(DcpError::Status(mcbp::status::NOT_MY_VBUCKET))
        );
        // A rollback without exactly 8 bytes, a log that is not whole entries.
        let mut out = Vec::new();
        write_response(
            &mut out,
            opcode::STREAM_REQ,
            mcbp::status::ROLLBACK,
            0,
            &[],
            &[0; 7],
        )
        .unwrap();
        assert!(StreamRequestResponse::decode_frame(&out).is_err());
        let mut out = Vec::new();
        write_response(&mut out, opcode::STREAM_REQ, 0, 0, &[], &[0; 17]).unwrap();
        assert!(StreamRequestResponse::decode_frame(&out).is_err());
    }

    // ---- failover-log.md ----

    #[test]
    fn documented_failover_log() {
        let req =
            hex("80 54 00 00  00 00 00 00  00 00 00 00  de ad be ef  00 00 00 00  00 00 00 00");
        let m: GetFailoverLog = request(&req, 0xdead_beef);
        assert_eq!(m, GetFailoverLog { vbucket: 0 });
        assert_eq!(encoded(&m, 0xdead_beef), req);
        let resp = hex(&format!(
            "81 54 00 00  00 00 00 00  00 00 00 40  de ad be ef  00 00 00 00  00 00 00 00 {DOC_FAILOVER_LOG}"
        ));
        let r: FailoverLogResponse = response(&resp, 0xdead_beef);
        assert_eq!(r.entries, doc_failover_entries());
        assert_eq!(encoded_response(&r, 0xdead_beef), resp);
    }

    // ---- stream-end.md, close-stream.md ----

    #[test]
    fn documented_stream_end_and_close_stream() {
        let end = hex(
            "80 55 00 00  04 00 00 00  00 00 00 04  de ad be ef  00 00 00 00  00 00 00 00
                       00 00 00 00",
        );
        let m: StreamEnd = request(&end, 0xdead_beef);
        assert_eq!(
            m,
            StreamEnd {
                vbucket: 0,
                reason: stream_end_reason::OK
            }
        );
        assert_eq!(encoded(&m, 0xdead_beef), end);

        let close =
            hex("80 52 00 00  00 00 00 05  00 00 00 00  de ad be ef  00 00 00 00  00 00 00 00");
        let m: CloseStream = request(&close, 0xdead_beef);
        assert_eq!(m, CloseStream { vbucket: 5 });
        assert_eq!(encoded(&m, 0xdead_beef), close);
    }

    // ---- snapshot-marker.md ----

    #[test]
    fn documented_snapshot_marker_v1() {
        // As printed, bytes 8-11 (total body) are 0 though 20 bytes of extras follow; the field
        // table says 0x00000014.
        let printed = hex(
            "80 56 00 00  14 00 00 00  00 00 00 00  de ad be ef  00 00 00 00  00 00 00 00
                           00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 08  00 00 00 01",
        );
        assert!(SnapshotMarker::decode_frame(&printed).is_err());
        let mut fixed = printed.clone();
        fixed[11] = 0x14;
        let m: SnapshotMarker = request(&fixed, 0xdead_beef);
        assert_eq!(
            m,
            SnapshotMarker {
                vbucket: 0,
                start_seqno: 0,
                end_seqno: 8,
                // Labelled "(disk)" in the breakdown, but the flag table makes 0x01 Memory.
                flags: snapshot_flag::MEMORY,
            }
        );
        assert_eq!(encoded(&m, 0xdead_beef), fixed);
    }

    #[test]
    fn snapshot_marker_v2_is_refused_not_misread() {
        // The page's V2 example as printed (its header does not match its own table either).
        let printed = hex("80 56 00 00  14 00 00 00  00 00 00 00  de ad be ef  00 00 00 00  00 00 00 00
                           01 00 00 00  00 00 00 00  01 00 00 00  00 00 00 00  08 00 00 00  02 00 00 00
                           00 00 00 00  08 00 00 00  00 00 00 00  07");
        assert!(SnapshotMarker::decode_frame(&printed).is_err());
        // A well-formed V2 header (1 byte of extras, the v2.0 value) is named as unsupported.
        let mut out = Vec::new();
        let h = Head {
            opcode: opcode::SNAPSHOT_MARKER,
            ..Default::default()
        };
        write_request(&mut out, h, 0, &[0x00], &[], &[0; 36]).unwrap();
        assert_eq!(
            SnapshotMarker::decode_frame(&out),
            Err(DcpError::Unsupported("snapshot marker v2"))
        );
    }

    // ---- mutation.md ----

    #[test]
    fn documented_mutation() {
        let req = hex(
            "80 57 00 05  1f 00 02 10  00 00 00 29  00 00 12 10  00 00 00 00  00 00 00 00
                       00 00 00 00  00 00 00 04  00 00 00 00  00 00 00 01  00 00 00 00  00 00 00 00
                       00 00 00 00  00 00 00 68  65 6c 6c 6f  77 6f 72 6c  64",
        );
        let m: Mutation = request(&req, 0x1210);
        assert_eq!(
            m,
            Mutation {
                vbucket: 0x0210,
                key: b"hello".to_vec(),
                value: b"world".to_vec(),
                by_seqno: 4,
                rev_seqno: 1,
                flags: 0,
                expiration: 0,
                lock_time: 0,
                nru: 0,
                cas: 0,
                datatype: 0,
                extended_meta: vec![],
            }
        );
        assert_eq!(encoded(&m, 0x1210), req);
        let d = DocumentRef::decode(&mcbp::parse_request(&req).unwrap()).unwrap();
        assert_eq!(
            (d.key, d.value, d.by_seqno, d.rev_seqno),
            (&b"hello"[..], &b"world"[..], 4, 1)
        );
        let mut out = Vec::new();
        d.encode(&mut out, 0x1210, true).unwrap();
        assert_eq!(out, req);
    }

    #[test]
    fn mutation_extended_meta_follows_the_value() {
        let m = Mutation {
            vbucket: 1,
            key: b"k".to_vec(),
            value: b"value".to_vec(),
            by_seqno: 2,
            rev_seqno: 3,
            flags: 4,
            expiration: 5,
            lock_time: 6,
            nru: 7,
            cas: 8,
            datatype: 1,
            extended_meta: vec![0x01, 0x02, 0x00],
        };
        let out = encoded(&m, 0);
        // nmeta at extras offset 28, the meta at the very end.
        assert_eq!(&out[24 + 28..24 + 30], &[0x00, 0x03]);
        assert_eq!(&out[out.len() - 3..], &[0x01, 0x02, 0x00]);
        assert_eq!(Mutation::decode_frame(&out), Ok(m));
        // nmeta larger than what follows the key.
        let mut bad = out.clone();
        bad[24 + 29] = 0x20;
        assert!(Mutation::decode_frame(&bad).is_err());
    }

    // ---- deletion.md ----

    #[test]
    fn documented_deletion_v1() {
        // As printed: 51 bytes, whose header says key length 5, extras 18, body 23 (47 bytes),
        // and whose "key" bytes at 42-50 read "\x01c::hello" (the table: "Key (43-50): hello").
        let printed = hex("80 58 00 05  12 00 02 10  00 00 00 17  00 00 12 10  00 00 00 00  00 00 00 00
                           00 00 00 00  00 00 00 05  00 00 00 00  00 00 00 01  00 00 01 63  3a 3a 68 65
                           6c 6c 6f");
        assert!(Deletion::decode_frame(&printed).is_err());
        // Header and extras as printed (they agree with the table), then the key "hello".
        let mut fixed = printed[..42].to_vec();
        fixed.extend_from_slice(b"hello");
        let m: Deletion = request(&fixed, 0x1210);
        assert_eq!(
            m,
            Deletion {
                vbucket: 0x0210,
                key: b"hello".to_vec(),
                value: vec![],
                by_seqno: 5,
                rev_seqno: 1,
                cas: 0,
                datatype: 0,
                format: DeletionFormat::V1 {
                    extended_meta: vec![]
                },
            }
        );
        assert_eq!(encoded(&m, 0x1210), fixed);
        let d = DocumentRef::decode(&mcbp::parse_request(&fixed).unwrap()).unwrap();
        assert_eq!(
            (d.opcode, d.key, d.by_seqno, d.rev_seqno),
            (opcode::DELETION, &b"hello"[..], 5, 1)
        );
        let mut out = Vec::new();
        d.encode(&mut out, 0x1210, false).unwrap();
        assert_eq!(out, fixed);
    }

    #[test]
    fn deletion_v2_layout() {
        let m = Deletion {
            vbucket: 3,
            key: b"gone".to_vec(),
            value: vec![],
            by_seqno: 0x0102_0304_0506_0708,
            rev_seqno: 9,
            cas: 0xabcd,
            datatype: 0,
            format: DeletionFormat::V2 {
                delete_time: 0x6000_0000,
            },
        };
        let out = encoded(&m, 4);
        assert_eq!(out[4], 21);
        assert_eq!(&out[24 + 16..24 + 21], &[0x60, 0, 0, 0, 0]);
        assert_eq!(Deletion::decode_frame(&out), Ok(m));
    }

    // ---- expiration.md ----

    #[test]
    fn documented_expiration() {
        // As printed the header says extras 0x12, body 0x17, but the bytes follow the page's
        // 20-byte layout: delete time at 40-43, key at 44-48 (49 bytes in all).
        let printed = hex("80 59 00 05  12 00 02 10  00 00 00 17  00 00 12 10  00 00 00 00  00 00 00 00
                           00 00 00 00  00 00 00 05  00 00 00 00  00 00 00 01  00 00 00 00  68 65 6c 6c
                           6f");
        assert!(Expiration::decode_frame(&printed).is_err());
        let mut fixed = printed.clone();
        fixed[4] = 0x14;
        fixed[11] = 0x19;
        let m: Expiration = request(&fixed, 0x1210);
        assert_eq!(
            m,
            Expiration {
                vbucket: 0x0210,
                key: b"hello".to_vec(),
                value: vec![],
                by_seqno: 5,
                rev_seqno: 1,
                delete_time: 0,
                cas: 0,
                datatype: 0,
            }
        );
        assert_eq!(encoded(&m, 0x1210), fixed);
        let d = DocumentRef::decode(&mcbp::parse_request(&fixed).unwrap()).unwrap();
        assert_eq!(
            (d.opcode, d.key, d.by_seqno, d.delete_time),
            (opcode::EXPIRATION, &b"hello"[..], 5, 0)
        );
        let mut out = Vec::new();
        d.encode(&mut out, 0x1210, true).unwrap();
        assert_eq!(out, fixed);
    }

    // ---- no-op.md, buffer-ack.md ----

    #[test]
    fn documented_noop() {
        // As printed the request is 28 bytes (a stray zero row) and its opaque bytes are 0,
        // though the breakdown says 0x00000005. The header's body length (0) makes it 24 bytes.
        let printed = hex(
            "80 5c 00 00  00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 00  00 00 00 00
                           00 00 00 00",
        );
        assert_eq!(mcbp::frame_len(&printed, 1 << 20), Ok(Some(24)));
        let m: Noop = request(&printed[..24], 0);
        assert_eq!(encoded(&m, 0), &printed[..24]);

        let resp =
            hex("81 5c 00 00  00 00 00 00  00 00 00 00  00 00 00 05  00 00 00 00  00 00 00 00");
        let s: StatusResponse = response(&resp, 5);
        assert_eq!(
            s,
            StatusResponse {
                opcode: opcode::NOOP,
                status: 0
            }
        );
        assert_eq!(encoded_response(&s, 5), resp);
    }

    #[test]
    fn documented_buffer_acknowledgement() {
        let req = hex(
            "80 5d 00 00  04 00 00 00  00 00 00 04  00 00 00 05  00 00 00 00  00 00 00 00
                       00 00 10 00",
        );
        let m: BufferAcknowledgement = request(&req, 5);
        assert_eq!(m, BufferAcknowledgement { bytes: 4096 });
        assert_eq!(encoded(&m, 5), req);
        let resp =
            hex("81 5d 00 00  00 00 00 00  00 00 00 00  00 00 00 05  00 00 00 00  00 00 00 00");
        let s: StatusResponse = response(&resp, 5);
        assert_eq!(s.opcode, opcode::BUFFER_ACKNOWLEDGEMENT);
        assert_eq!(encoded_response(&s, 5), resp);
    }

    // ---- set-vbucket-state.md, seqno-acknowledged.md ----

    #[test]
    fn documented_set_vbucket_state() {
        let req = hex(
            "80 5b 00 00  01 00 00 00  00 00 00 01  de ad be ef  00 00 00 00  00 00 00 00
                       04",
        );
        let m: SetVbucketState = request(&req, 0xdead_beef);
        assert_eq!(
            m,
            SetVbucketState {
                vbucket: 0,
                state: vbucket_state::DEAD,
                value: vec![]
            }
        );
        assert_eq!(encoded(&m, 0xdead_beef), req);
    }

    #[test]
    fn documented_seqno_acknowledged() {
        let req = hex(
            "80 61 00 00  08 00 02 10  00 00 00 08  00 00 12 10  00 00 00 00  00 00 00 00
                       00 00 00 00  00 00 00 04",
        );
        let m: SeqnoAcknowledged = request(&req, 0x1210);
        assert_eq!(
            m,
            SeqnoAcknowledged {
                vbucket: 0x0210,
                prepared_seqno: 4,
                persisted_seqno: None,
            }
        );
        assert_eq!(encoded(&m, 0x1210), req);
    }

    #[test]
    fn wrong_opcode_and_extras_are_named() {
        let noop = encoded(&Noop, 0);
        assert_eq!(
            CloseStream::decode_frame(&noop),
            Err(DcpError::WrongOpcode {
                expected: opcode::CLOSE_STREAM,
                got: opcode::NOOP
            })
        );
        let mut out = Vec::new();
        let h = Head {
            opcode: opcode::STREAM_END,
            ..Default::default()
        };
        write_request(&mut out, h, 0, &[0; 3], &[], &[]).unwrap();
        assert_eq!(
            StreamEnd::decode_frame(&out),
            Err(DcpError::ExtrasLen {
                opcode: opcode::STREAM_END,
                len: 3
            })
        );
    }

    // ---- properties ----

    /// Runs every decoder over one frame; none may panic.
    fn decode_all(frame: &[u8]) {
        let _ = OpenConnection::decode_frame(frame);
        let _ = Control::decode_frame(frame);
        let _ = AddStream::decode_frame(frame);
        let _ = AddStreamResponse::decode_frame(frame);
        let _ = StatusResponse::decode_frame(frame);
        let _ = StreamRequest::decode_frame(frame);
        let _ = StreamRequestResponse::decode_frame(frame);
        let _ = GetFailoverLog::decode_frame(frame);
        let _ = FailoverLogResponse::decode_frame(frame);
        let _ = StreamEnd::decode_frame(frame);
        let _ = CloseStream::decode_frame(frame);
        let _ = SnapshotMarker::decode_frame(frame);
        let _ = Mutation::decode_frame(frame);
        let _ = Deletion::decode_frame(frame);
        let _ = Expiration::decode_frame(frame);
        let _ = Noop::decode_frame(frame);
        let _ = BufferAcknowledgement::decode_frame(frame);
        let _ = SetVbucketState::decode_frame(frame);
        let _ = SeqnoAcknowledged::decode_frame(frame);
    }

    fn round_trip<T: DcpRequest + PartialEq + Debug>(
        m: &T,
        opaque: u32,
    ) -> Result<(), TestCaseError> {
        let mut out = Vec::new();
        m.encode(&mut out, opaque).unwrap();
        prop_assert_eq!(mcbp::frame_len(&out, usize::MAX).unwrap(), Some(out.len()));
        let r = mcbp::parse_request(&out).unwrap();
        prop_assert_eq!(
            (r.magic, r.opcode, r.opaque),
            (mcbp::magic::REQUEST, T::OPCODE, opaque)
        );
        prop_assert_eq!(&T::decode(&r).unwrap(), m);
        Ok(())
    }

    fn round_trip_response<T: DcpResponse + PartialEq + Debug>(
        m: &T,
        opaque: u32,
    ) -> Result<(), TestCaseError> {
        let mut out = Vec::new();
        m.encode(&mut out, opaque).unwrap();
        let r = mcbp::parse_response(&out).unwrap();
        prop_assert_eq!((r.magic, r.opaque), (mcbp::magic::RESPONSE, opaque));
        prop_assert_eq!(&T::decode(&r).unwrap(), m);
        Ok(())
    }

    fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..max)
    }

    fn key() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 1..40)
    }

    fn failover_log() -> impl Strategy<Value = Vec<FailoverLogEntry>> {
        proptest::collection::vec(
            (any::<u64>(), any::<u64>()).prop_map(|(vbucket_uuid, seqno)| FailoverLogEntry {
                vbucket_uuid,
                seqno,
            }),
            1..10,
        )
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(buf in bytes(300)) {
            decode_all(&buf);
            if let Ok(Some(n)) = mcbp::frame_len(&buf, usize::MAX) {
                decode_all(&buf[..n]);
            }
        }

        /// Well-formed frames with DCP opcodes and arbitrary sections reach past the frame
        /// checks into every decoder's own length checks.
        #[test]
        fn well_framed_garbage_never_panics(op in 0x50u8..0x68, response in any::<bool>(), word in any::<u16>(),
                                            extras in bytes(60), key in bytes(30), value in bytes(100)) {
            let h = HeaderFields {
                magic: if response { mcbp::magic::RESPONSE } else { mcbp::magic::REQUEST },
                opcode: op,
                word,
                ..Default::default()
            };
            let mut out = Vec::new();
            mcbp::write_frame(&mut out, &h, &[], &extras, &key, &value).unwrap();
            decode_all(&out);
        }

        #[test]
        fn setup_messages_round_trip(opaque in any::<u32>(), name in proptest::collection::vec(any::<u8>(), 1..=200),
                                     flags in any::<u32>(), reserved in any::<u32>(), value in bytes(60),
                                     ckey in key(), cvalue in proptest::collection::vec(any::<u8>(), 1..40),
                                     vb in any::<u16>(), stream_opaque in any::<u32>(), status in any::<u16>()) {
            round_trip(&OpenConnection { name, flags, reserved, value }, opaque)?;
            round_trip(&Control { key: ckey, value: cvalue }, opaque)?;
            round_trip(&AddStream { vbucket: vb, flags }, opaque)?;
            round_trip_response(&AddStreamResponse { stream_opaque }, opaque)?;
            round_trip_response(&StatusResponse { opcode: opcode::OPEN, status }, opaque)?;
            round_trip(&Noop, opaque)?;
            round_trip(&BufferAcknowledgement { bytes: flags }, opaque)?;
        }

        #[test]
        fn stream_messages_round_trip(opaque in any::<u32>(), vb in any::<u16>(), flags in any::<u32>(),
                                      s in any::<[u64; 5]>(), value in bytes(60), log in failover_log(),
                                      rollback in any::<u64>(), state in any::<u8>()) {
            round_trip(&StreamRequest {
                vbucket: vb, flags, start_seqno: s[0], end_seqno: s[1], vbucket_uuid: s[2],
                snap_start_seqno: s[3], snap_end_seqno: s[4], value: value.clone(),
            }, opaque)?;
            round_trip_response(&StreamRequestResponse::Ok(log.clone()), opaque)?;
            round_trip_response(&StreamRequestResponse::Rollback(rollback), opaque)?;
            round_trip(&GetFailoverLog { vbucket: vb }, opaque)?;
            round_trip_response(&FailoverLogResponse { entries: log }, opaque)?;
            round_trip(&StreamEnd { vbucket: vb, reason: flags }, opaque)?;
            round_trip(&CloseStream { vbucket: vb }, opaque)?;
            round_trip(&SnapshotMarker { vbucket: vb, start_seqno: s[0], end_seqno: s[1], flags }, opaque)?;
            round_trip(&SetVbucketState { vbucket: vb, state, value }, opaque)?;
            round_trip(&SeqnoAcknowledged { vbucket: vb, prepared_seqno: s[2], persisted_seqno: Some(s[1]) }, opaque)?;
        }

        #[test]
        fn documents_round_trip(opaque in any::<u32>(), vb in any::<u16>(), key in key(), value in bytes(200),
                                meta in bytes(20), seq in any::<[u64; 3]>(), w in any::<[u32; 3]>(),
                                nru in any::<u8>(), datatype in any::<u8>(), v2 in any::<bool>()) {
            round_trip(&Mutation {
                vbucket: vb, key: key.clone(), value: value.clone(), by_seqno: seq[0], rev_seqno: seq[1],
                flags: w[0], expiration: w[1], lock_time: w[2], nru, cas: seq[2], datatype,
                extended_meta: meta.clone(),
            }, opaque)?;
            let format = if v2 {
                DeletionFormat::V2 { delete_time: w[0] }
            } else {
                DeletionFormat::V1 { extended_meta: meta }
            };
            round_trip(&Deletion {
                vbucket: vb, key: key.clone(), value: value.clone(), by_seqno: seq[0], rev_seqno: seq[1],
                cas: seq[2], datatype, format,
            }, opaque)?;
            round_trip(&Expiration {
                vbucket: vb, key, value, by_seqno: seq[0], rev_seqno: seq[1], delete_time: w[1],
                cas: seq[2], datatype,
            }, opaque)?;
        }
    }
}
