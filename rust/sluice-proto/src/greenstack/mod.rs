//! Greenstack, the full-duplex protocol Couchbase designed and never shipped (seed 001; the
//! numbers its own library, trondn/Greenstack, fixed): frames, their flag bytes and flex
//! headers (this module), and the numbering of opcodes, statuses and flex keys. Payloads are
//! msgpack maps (the library used FlatBuffers); their schemas are in docs/greenstack.md.
//!
//! ```text
//! frame:  length u32 (of the body) | body
//! body:   opaque u32 | opcode u16 | flag byte+ | [status u16] | [flex length u32 | flex] | payload
//! flags:  bit 0 response (a status follows the flags), 1 flex header present, 2 fence,
//!         3 more, 4 quiet, 7 another flag byte follows (none is defined: its bits must be 0)
//! flex:   entries of key u16 | length u16 | value
//! ```
//! Network byte order throughout. Every length is checked against what is left before
//! anything is read or allocated for it; a length over the caller's limit is an error before
//! any of the frame is buffered.

pub mod payload;
#[cfg(test)]
mod tests;

/// Opcodes by component: generic 0x0000-0x03ff, memcached 0x0400-0x07ff, clients
/// 0x0800-0x0bff. Those Greenstack's library numbered keep their numbers; sluice numbers the
/// rest inside the seed's ranges (volatile until they settle, docs/greenstack.md).
pub mod opcode {
    pub const HELLO: u16 = 0x0001;
    pub const SASL_AUTH: u16 = 0x0002;
    pub const SELECT_BUCKET: u16 = 0x0400;
    pub const LIST_BUCKETS: u16 = 0x0401;
    pub const CREATE_BUCKET: u16 = 0x0402;
    pub const DELETE_BUCKET: u16 = 0x0403;
    pub const ASSUME_ROLE: u16 = 0x0404;
    pub const MUTATION: u16 = 0x0405;
    pub const GET: u16 = 0x0406;
    // Numbered by sluice (volatile).
    pub const DELETE: u16 = 0x0407;
    pub const TOUCH: u16 = 0x0408;
    pub const GET_ALL_VB_SEQNOS: u16 = 0x0409;
    /// Sent by the server: `{kind, ...}` (back off, shutting down).
    pub const NOTICE: u16 = 0x0410;
    /// DCP over Greenstack (sluice's numbers): the client's commands, then the stream
    /// messages the server sends.
    pub const DCP_OPEN: u16 = 0x0500;
    pub const DCP_STREAM_REQUEST: u16 = 0x0501;
    pub const DCP_SNAPSHOT_MARKER: u16 = 0x0502;
    pub const DCP_MUTATION: u16 = 0x0503;
    pub const DCP_DELETION: u16 = 0x0504;
    pub const DCP_EXPIRATION: u16 = 0x0505;
    pub const DCP_STREAM_END: u16 = 0x0506;
    pub const DCP_CLOSE_STREAM: u16 = 0x0507;
    pub const DCP_BUFFER_ACK: u16 = 0x0508;
}

/// Statuses by component, as the opcodes. The generic ones are Greenstack's library's.
pub mod status {
    pub const SUCCESS: u16 = 0x0000;
    pub const INVALID_ARGUMENTS: u16 = 0x0001;
    pub const INTERNAL_ERROR: u16 = 0x0002;
    pub const AUTHENTICATION_ERROR: u16 = 0x0003;
    pub const AUTHENTICATION_STALE: u16 = 0x0004;
    pub const NOT_INITIALIZED: u16 = 0x0005;
    pub const INVALID_STATE: u16 = 0x0006;
    pub const NO_ACCESS: u16 = 0x0007;
    pub const NOT_FOUND: u16 = 0x0008;
    pub const UNKNOWN_COMMAND: u16 = 0x0009;
    pub const USER_AGENT_BLACKLISTED: u16 = 0x000a;
    pub const NOT_IMPLEMENTED: u16 = 0x000b;
    /// SCRAM's next step: the reply carries the server-first message (sluice's number).
    pub const AUTHENTICATION_CONTINUE: u16 = 0x000c;
    // Memcached's, numbered by sluice (volatile).
    pub const KEY_EXISTS: u16 = 0x0400;
    pub const NOT_STORED: u16 = 0x0401;
    pub const TOO_BIG: u16 = 0x0402;
    pub const NOT_MY_VBUCKET: u16 = 0x0403;
    pub const TEMPORARY_FAILURE: u16 = 0x0404;
    pub const LOCKED: u16 = 0x0405;
    pub const DURABILITY_IMPOSSIBLE: u16 = 0x0406;
    pub const SYNC_WRITE_AMBIGUOUS: u16 = 0x0407;
    /// The request waited past its flex header's "ignore unless executed before".
    pub const NOT_EXECUTED_IN_TIME: u16 = 0x0408;
    /// A DCP stream request must start again from `rollback_seqno` (sluice's number).
    pub const ROLLBACK: u16 = 0x0409;
}

/// The first flag byte's bits.
pub mod flag {
    pub const RESPONSE: u8 = 0x01;
    pub const FLEX: u8 = 0x02;
    pub const FENCE: u8 = 0x04;
    pub const MORE: u8 = 0x08;
    pub const QUIET: u8 = 0x10;
    pub const NEXT_BYTE: u8 = 0x80;
    /// Bits 5 and 6 are unassigned.
    pub const KNOWN: u8 = RESPONSE | FLEX | FENCE | MORE | QUIET | NEXT_BYTE;
}

/// Flex header keys (seed 001's table) and the lengths a fixed-width value must have.
pub mod flex_key {
    pub const LANE_ID: u16 = 0x0000;
    pub const TXID: u16 = 0x0004;
    pub const PRIORITY: u16 = 0x0005;
    pub const DCP_ID: u16 = 0x0006;
    pub const VBUCKET_ID: u16 = 0x0007;
    pub const HASH: u16 = 0x0008;
    pub const IGNORE_UNLESS_EXECUTED_BEFORE: u16 = 0x0009;
    pub const COMMAND_TIMINGS: u16 = 0x000a;

    /// The one length a key's value may have, for the fixed-width keys.
    pub fn fixed_len(key: u16) -> Option<usize> {
        match key {
            PRIORITY => Some(1),
            VBUCKET_ID => Some(2),
            HASH | IGNORE_UNLESS_EXECUTED_BEFORE => Some(4),
            _ => None,
        }
    }
}

/// The frame length field.
pub const LENGTH_LEN: usize = 4;
/// The smallest body: opaque, opcode and one flag byte.
pub const MIN_BODY: usize = 7;
/// The most flag bytes a frame may carry (none past the first is defined).
pub const MAX_FLAG_BYTES: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The bytes end before `what`.
    Short(&'static str),
    /// A frame longer than the limit.
    TooLarge { len: usize, max: usize },
    /// A field holds what the protocol does not allow.
    Invalid(String),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Short(what) => write!(f, "the frame ends inside {what}"),
            DecodeError::TooLarge { len, max } => {
                write!(f, "a frame of {len} bytes is over the limit of {max}")
            }
            DecodeError::Invalid(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for DecodeError {}

/// What `check` found at the front of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Not a whole frame yet: at least this many bytes in all are needed.
    Incomplete(usize),
    /// A whole frame of this many bytes (with its length field).
    Complete(usize),
}

/// Looks at the front of `buf` without copying. A body longer than `max_body` is an error
/// before anything is buffered for it; one shorter than the smallest frame is an error too.
pub fn check(buf: &[u8], max_body: usize) -> Result<Check, DecodeError> {
    let Some(head) = buf.get(..LENGTH_LEN) else {
        return Ok(Check::Incomplete(LENGTH_LEN));
    };
    let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len > max_body {
        return Err(DecodeError::TooLarge { len, max: max_body });
    }
    if len < MIN_BODY {
        return Err(DecodeError::Invalid(format!(
            "a frame body of {len} bytes: the smallest is {MIN_BODY}"
        )));
    }
    let total = LENGTH_LEN + len;
    Ok(if buf.len() < total {
        Check::Incomplete(total)
    } else {
        Check::Complete(total)
    })
}

/// A decoded frame, borrowing its flex header and payload from the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    pub opaque: u32,
    pub opcode: u16,
    /// The first flag byte.
    pub flags: u8,
    /// Responses only.
    pub status: Option<u16>,
    /// The flex header's entries, checked whole (`flex_entries` walks them).
    pub flex: &'a [u8],
    pub payload: &'a [u8],
}

fn take<'a>(
    body: &'a [u8],
    at: &mut usize,
    n: usize,
    what: &'static str,
) -> Result<&'a [u8], DecodeError> {
    let b = body
        .get(*at..)
        .and_then(|rest| rest.get(..n))
        .ok_or(DecodeError::Short(what))?;
    *at += n;
    Ok(b)
}

impl<'a> Frame<'a> {
    /// Decodes a frame body (the bytes after its length field).
    pub fn decode(body: &'a [u8]) -> Result<Frame<'a>, DecodeError> {
        let mut at = 0;
        let b = take(body, &mut at, 4, "its opaque")?;
        let opaque = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let b = take(body, &mut at, 2, "its opcode")?;
        let opcode = u16::from_be_bytes([b[0], b[1]]);
        let flags = take(body, &mut at, 1, "its flags")?[0];
        if flags & !flag::KNOWN != 0 {
            return Err(DecodeError::Invalid(format!(
                "unassigned flag bits {:#04x} in the first flag byte",
                flags & !flag::KNOWN
            )));
        }
        let mut more = flags & flag::NEXT_BYTE != 0;
        let mut count = 1;
        while more {
            let next = take(body, &mut at, 1, "a flag byte its previous one announces")?[0];
            count += 1;
            if count > MAX_FLAG_BYTES {
                return Err(DecodeError::Invalid(format!(
                    "more than {MAX_FLAG_BYTES} flag bytes"
                )));
            }
            if next & !flag::NEXT_BYTE != 0 {
                return Err(DecodeError::Invalid(format!(
                    "flag byte {count} has bits {:#04x} set, and no bit of it is defined",
                    next & !flag::NEXT_BYTE
                )));
            }
            more = next & flag::NEXT_BYTE != 0;
        }
        let status = if flags & flag::RESPONSE != 0 {
            let b = take(body, &mut at, 2, "its status")?;
            Some(u16::from_be_bytes([b[0], b[1]]))
        } else {
            None
        };
        let flex = if flags & flag::FLEX != 0 {
            let b = take(body, &mut at, 4, "its flex header's length")?;
            let n = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
            let flex = take(body, &mut at, n, "its flex header")?;
            for entry in FlexEntries(flex) {
                entry?;
            }
            flex
        } else {
            &[]
        };
        Ok(Frame {
            opaque,
            opcode,
            flags,
            status,
            flex,
            payload: &body[at..],
        })
    }

    pub fn is_response(&self) -> bool {
        self.flags & flag::RESPONSE != 0
    }

    pub fn has(&self, bit: u8) -> bool {
        self.flags & bit != 0
    }

    /// The flex header's entries, in order (checked when the frame was decoded).
    pub fn flex_entries(&self) -> FlexEntries<'a> {
        FlexEntries(self.flex)
    }

    /// The value of the first entry with `key`.
    pub fn flex_value(&self, key: u16) -> Option<&'a [u8]> {
        self.flex_entries()
            .filter_map(Result::ok)
            .find(|e| e.key == key)
            .map(|e| e.value)
    }
}

/// One flex header entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlexEntry<'a> {
    pub key: u16,
    pub value: &'a [u8],
}

/// A flex header's entries; an entry that runs past the header, or a fixed-width key of
/// another length, is an error (and ends them).
pub struct FlexEntries<'a>(&'a [u8]);

impl<'a> Iterator for FlexEntries<'a> {
    type Item = Result<FlexEntry<'a>, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let r = (|| {
            let head = self
                .0
                .get(..4)
                .ok_or(DecodeError::Short("a flex header entry's key and length"))?;
            let key = u16::from_be_bytes([head[0], head[1]]);
            let len = u16::from_be_bytes([head[2], head[3]]) as usize;
            let value = self.0[4..]
                .get(..len)
                .ok_or(DecodeError::Short("a flex header entry's value"))?;
            if flex_key::fixed_len(key).is_some_and(|n| n != len) {
                return Err(DecodeError::Invalid(format!(
                    "flex key {key:#06x} takes {} bytes, not {len}",
                    flex_key::fixed_len(key).unwrap_or(0)
                )));
            }
            self.0 = &self.0[4 + len..];
            Ok(FlexEntry { key, value })
        })();
        if r.is_err() {
            self.0 = &[];
        }
        Some(r)
    }
}

/// What a frame to write holds.
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameOut<'a> {
    pub opaque: u32,
    pub opcode: u16,
    /// The first flag byte's bits other than RESPONSE and FLEX, which follow from `status`
    /// and `flex`.
    pub flags: u8,
    pub status: Option<u16>,
    pub flex: &'a [FlexEntry<'a>],
    pub payload: &'a [u8],
}

impl FrameOut<'_> {
    /// Appends the whole frame (length field first) to `out`. Flex values are at most 65535
    /// bytes each (the caller's to keep).
    pub fn write(&self, out: &mut Vec<u8>) {
        self.write_with(out, |out| out.extend_from_slice(self.payload));
    }

    /// `write`, the payload written by `payload` straight into `out` (not copied from a
    /// buffer of its own); `self.payload` is not used.
    pub fn write_with(&self, out: &mut Vec<u8>, payload: impl FnOnce(&mut Vec<u8>)) {
        let at = out.len();
        out.extend_from_slice(&[0; LENGTH_LEN]);
        out.extend_from_slice(&self.opaque.to_be_bytes());
        out.extend_from_slice(&self.opcode.to_be_bytes());
        let mut flags = self.flags & !(flag::RESPONSE | flag::FLEX | flag::NEXT_BYTE);
        if self.status.is_some() {
            flags |= flag::RESPONSE;
        }
        if !self.flex.is_empty() {
            flags |= flag::FLEX;
        }
        out.push(flags);
        if let Some(s) = self.status {
            out.extend_from_slice(&s.to_be_bytes());
        }
        if !self.flex.is_empty() {
            let len: usize = self.flex.iter().map(|e| 4 + e.value.len()).sum();
            out.extend_from_slice(&(len as u32).to_be_bytes());
            for e in self.flex {
                out.extend_from_slice(&e.key.to_be_bytes());
                out.extend_from_slice(&(e.value.len() as u16).to_be_bytes());
                out.extend_from_slice(e.value);
            }
        }
        payload(out);
        let body = (out.len() - at - LENGTH_LEN) as u32;
        out[at..at + LENGTH_LEN].copy_from_slice(&body.to_be_bytes());
    }
}
