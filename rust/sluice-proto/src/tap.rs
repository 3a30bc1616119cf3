//! TAP, memcached's change stream (seed 000; memcached engine-pu `protocol_binary.h`): the
//! client's TAP_CONNECT and the messages a producer sends back, each one memcached binary frame.
//!
//! A TAP message is a *request* (magic 0x80) from the producer; the client answers the ones
//! flagged ACK with a response of the same opcode and opaque, and the opaque is the producer's
//! sequence number. Every message starts its extras with the same 8 bytes: engine-specific
//! length (u16), TAP flags (u16), TTL (u8, hops left) and 3 reserved bytes; TAP_MUTATION adds the
//! item's flags and expiry. Engine-specific bytes sit between the extras and the key, which is
//! why `TapMessage::decode` reads the frame itself instead of a split `mcbp::Request`.
//!
//! The seed's byte dumps disagree with their own field tables about TAP_CONNECT's extras:
//! memcached defines 4 bytes of flags; the field tables show 8. Both are accepted (8 bytes are
//! read as a big-endian u64 whose value must fit the 32 flag bits); 4 is what is sent.

use std::fmt;

use crate::mcbp::{self, HeaderFields, Request, HEADER_LEN};

pub mod opcode {
    pub const CONNECT: u8 = 0x40;
    pub const MUTATION: u8 = 0x41;
    pub const DELETE: u8 = 0x42;
    pub const FLUSH: u8 = 0x43;
    pub const OPAQUE: u8 = 0x44;
    pub const VBUCKET_SET: u8 = 0x45;
    pub const CHECKPOINT_START: u8 = 0x46;
    pub const CHECKPOINT_END: u8 = 0x47;

    pub fn is_tap_message(op: u8) -> bool {
        (MUTATION..=CHECKPOINT_END).contains(&op)
    }
}

/// TAP_CONNECT flags. Data for a flag follows the name in the body, in flag-bit order.
pub mod connect_flag {
    /// u64: the oldest change wanted, seconds since the epoch; a future time means new
    /// changes only.
    pub const BACKFILL: u32 = 0x01;
    /// Existing items only, then the connection closes.
    pub const DUMP: u32 = 0x02;
    /// u16 count, then that many u16 vbucket ids.
    pub const LIST_VBUCKETS: u32 = 0x04;
    /// Hand the listed vbuckets over to the client at the end.
    pub const TAKEOVER_VBUCKETS: u32 = 0x08;
    pub const SUPPORT_ACK: u32 = 0x10;
    pub const REQUEST_KEYS_ONLY: u32 = 0x20;
    /// u16 count, then (u16 vbucket, u64 checkpoint id) pairs: where the client stands.
    pub const CHECKPOINT: u32 = 0x40;
    /// The session (and its cursors) outlives disconnects until the server stops.
    pub const REGISTERED_CLIENT: u32 = 0x80;
    pub const KNOWN: u32 = 0xff;
}

/// Flags in a TAP message's extras.
pub mod message_flag {
    /// The client must answer this message (and so every message before it).
    pub const ACK: u16 = 0x01;
    /// The item has a value that was left out.
    pub const NO_VALUE: u16 = 0x02;
}

/// TAP_OPAQUE codes, carried as a u32 in the engine-specific bytes.
pub mod opaque_code {
    pub const ENABLE_AUTO_NACK: u32 = 0;
    /// A vbucket's backfill begins.
    pub const INITIAL_VBUCKET_STREAM: u32 = 1;
    pub const ENABLE_CHECKPOINT_SYNC: u32 = 2;
    pub const OPEN_CHECKPOINT: u32 = 3;
    pub const CLOSE_TAP_STREAM: u32 = 7;
    /// A vbucket's backfill is complete.
    pub const CLOSE_BACKFILL: u32 = 8;
}

/// TAP_VBUCKET_SET states, a u32 in the engine-specific bytes.
pub mod vbucket_state {
    pub const ACTIVE: u32 = 1;
    pub const REPLICA: u32 = 2;
    pub const PENDING: u32 = 3;
    pub const DEAD: u32 = 4;
}

/// Most vbuckets a LIST_VBUCKETS or CHECKPOINT list may name.
pub const MAX_LISTED: usize = 1024;
/// Length of the extras every TAP message starts with.
pub const COMMON_EXTRAS: usize = 8;
/// Length of TAP_MUTATION's extras.
pub const MUTATION_EXTRAS: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapError(pub String);

impl fmt::Display for TapError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TapError {}

fn bad(why: impl Into<String>) -> TapError {
    TapError(why.into())
}

/// A checked TAP_CONNECT.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TapConnect {
    /// The client's name: a named session may be resumed (empty: anonymous).
    pub name: Vec<u8>,
    pub flags: u32,
    /// BACKFILL's value: seconds since the epoch.
    pub backfill_since: Option<u64>,
    /// LIST_VBUCKETS' vbuckets, in the order given.
    pub vbuckets: Option<Vec<u16>>,
    /// CHECKPOINT's (vbucket, checkpoint id) pairs.
    pub checkpoints: Vec<(u16, u64)>,
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], TapError> {
        if self.buf.len() < n {
            return Err(bad(format!(
                "TAP_CONNECT: {what} needs {n} bytes, {} left",
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u16(&mut self, what: &str) -> Result<u16, TapError> {
        Ok(u16::from_be_bytes(
            self.take(2, what)?.try_into().expect("2"),
        ))
    }
    fn u64(&mut self, what: &str) -> Result<u64, TapError> {
        Ok(u64::from_be_bytes(
            self.take(8, what)?.try_into().expect("8"),
        ))
    }
    /// A u16 count of entries of `size` bytes each, checked against what is left before
    /// anything is allocated.
    fn count(&mut self, size: usize, what: &str) -> Result<usize, TapError> {
        let n = self.u16(what)? as usize;
        if n > MAX_LISTED {
            return Err(bad(format!(
                "TAP_CONNECT: {what} names {n} vbuckets (at most {MAX_LISTED})"
            )));
        }
        if self.buf.len() < n * size {
            return Err(bad(format!(
                "TAP_CONNECT: {what} names {n} entries but only {} bytes follow",
                self.buf.len()
            )));
        }
        Ok(n)
    }
}

impl TapConnect {
    pub fn decode(req: &Request<'_>) -> Result<TapConnect, TapError> {
        if req.opcode != opcode::CONNECT {
            return Err(bad(format!(
                "opcode 0x{:02x} is not TAP_CONNECT",
                req.opcode
            )));
        }
        let flags = match req.extras.len() {
            0 => 0,
            4 => u32::from_be_bytes(req.extras.try_into().expect("4")),
            8 => {
                let wide = u64::from_be_bytes(req.extras.try_into().expect("8"));
                u32::try_from(wide)
                    .map_err(|_| bad(format!("TAP_CONNECT: flags {wide:#x} exceed 32 bits")))?
            }
            n => {
                return Err(bad(format!(
                    "TAP_CONNECT: extras of {n} bytes (flags take 4, or 8)"
                )))
            }
        };
        if flags & !connect_flag::KNOWN != 0 {
            return Err(bad(format!(
                "TAP_CONNECT: unknown flags {:#x}",
                flags & !connect_flag::KNOWN
            )));
        }
        if flags & connect_flag::TAKEOVER_VBUCKETS != 0 && flags & connect_flag::LIST_VBUCKETS == 0
        {
            return Err(bad(
                "TAP_CONNECT: TAKEOVER_VBUCKETS needs LIST_VBUCKETS (which vbuckets to take)",
            ));
        }
        let mut r = Reader { buf: req.value };
        let mut c = TapConnect {
            name: req.key.to_vec(),
            flags,
            ..Default::default()
        };
        if flags & connect_flag::BACKFILL != 0 {
            c.backfill_since = Some(r.u64("BACKFILL's time")?);
        }
        if flags & connect_flag::LIST_VBUCKETS != 0 {
            let n = r.count(2, "LIST_VBUCKETS")?;
            let mut list = Vec::with_capacity(n);
            for _ in 0..n {
                list.push(r.u16("LIST_VBUCKETS")?);
            }
            c.vbuckets = Some(list);
        }
        if flags & connect_flag::CHECKPOINT != 0 {
            let n = r.count(10, "CHECKPOINT")?;
            c.checkpoints.reserve(n);
            for _ in 0..n {
                let vb = r.u16("CHECKPOINT")?;
                c.checkpoints.push((vb, r.u64("CHECKPOINT")?));
            }
        }
        if !r.buf.is_empty() {
            return Err(bad(format!(
                "TAP_CONNECT: {} bytes after the data its flags announce",
                r.buf.len()
            )));
        }
        Ok(c)
    }

    /// Appends TAP_CONNECT with 4 bytes of flags (0 when no flag is set).
    pub fn encode(&self, out: &mut Vec<u8>, opaque: u32) -> Result<(), TapError> {
        let mut value = Vec::new();
        if let Some(t) = self.backfill_since {
            value.extend_from_slice(&t.to_be_bytes());
        }
        if let Some(list) = &self.vbuckets {
            value.extend_from_slice(&(list.len() as u16).to_be_bytes());
            for vb in list {
                value.extend_from_slice(&vb.to_be_bytes());
            }
        }
        if self.flags & connect_flag::CHECKPOINT != 0 {
            value.extend_from_slice(&(self.checkpoints.len() as u16).to_be_bytes());
            for (vb, id) in &self.checkpoints {
                value.extend_from_slice(&vb.to_be_bytes());
                value.extend_from_slice(&id.to_be_bytes());
            }
        }
        let extras = self.flags.to_be_bytes();
        let h = HeaderFields {
            magic: mcbp::magic::REQUEST,
            opcode: opcode::CONNECT,
            opaque,
            ..Default::default()
        };
        let extras: &[u8] = if self.flags == 0 { &[] } else { &extras };
        mcbp::write_frame(out, &h, &[], extras, &self.name, &value).map_err(|e| bad(e.to_string()))
    }
}

/// One TAP message, either direction (a producer sends them; a node taking a TAP feed
/// receives them as commands).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TapMessage<'a> {
    pub opcode: u8,
    pub vbucket: u16,
    /// The producer's sequence number for this message.
    pub opaque: u32,
    pub cas: u64,
    pub datatype: u8,
    pub engine_specific: &'a [u8],
    pub tap_flags: u16,
    /// Hops left: a node applying this message forwards it with one less, and not at 0.
    pub ttl: u8,
    /// TAP_MUTATION only.
    pub item_flags: u32,
    pub expiry: u32,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

impl<'a> TapMessage<'a> {
    /// Appends the message as a request frame.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let extras_len = if self.opcode == opcode::MUTATION {
            MUTATION_EXTRAS
        } else {
            COMMON_EXTRAS
        };
        let body = extras_len + self.engine_specific.len() + self.key.len() + self.value.len();
        out.reserve(HEADER_LEN + body);
        out.push(mcbp::magic::REQUEST);
        out.push(self.opcode);
        out.extend_from_slice(&(self.key.len() as u16).to_be_bytes());
        out.push(extras_len as u8);
        out.push(self.datatype);
        out.extend_from_slice(&self.vbucket.to_be_bytes());
        out.extend_from_slice(&(body as u32).to_be_bytes());
        out.extend_from_slice(&self.opaque.to_be_bytes());
        out.extend_from_slice(&self.cas.to_be_bytes());
        out.extend_from_slice(&(self.engine_specific.len() as u16).to_be_bytes());
        out.extend_from_slice(&self.tap_flags.to_be_bytes());
        out.extend_from_slice(&[self.ttl, 0, 0, 0]);
        if extras_len == MUTATION_EXTRAS {
            out.extend_from_slice(&self.item_flags.to_be_bytes());
            out.extend_from_slice(&self.expiry.to_be_bytes());
        }
        out.extend_from_slice(self.engine_specific);
        out.extend_from_slice(self.key);
        out.extend_from_slice(self.value);
    }

    /// Reads a whole request frame (as `mcbp::frame_len` split it).
    pub fn decode(frame: &'a [u8]) -> Result<TapMessage<'a>, TapError> {
        let req = mcbp::parse_request(frame).map_err(|e| bad(e.to_string()))?;
        if !opcode::is_tap_message(req.opcode) {
            return Err(bad(format!(
                "opcode 0x{:02x} is not a TAP message",
                req.opcode
            )));
        }
        if !req.framing.is_empty() {
            return Err(bad("TAP messages take no framing extras"));
        }
        let want = if req.opcode == opcode::MUTATION {
            MUTATION_EXTRAS
        } else {
            COMMON_EXTRAS
        };
        if req.extras.len() != want {
            return Err(bad(format!(
                "TAP message 0x{:02x}: extras of {} bytes, expected {want}",
                req.opcode,
                req.extras.len()
            )));
        }
        let e = req.extras;
        let es_len = u16::from_be_bytes([e[0], e[1]]) as usize;
        // Key and value are contiguous after the extras; the engine-specific bytes come first.
        let start = HEADER_LEN + want;
        let rest = &frame[start..];
        let key_len = req.key.len();
        if rest.len() < es_len + key_len {
            return Err(bad(format!(
                "TAP message: engine-specific length {es_len} and key length {key_len} exceed \
                 the {} bytes after the extras",
                rest.len()
            )));
        }
        let (engine_specific, rest) = rest.split_at(es_len);
        let (key, value) = rest.split_at(key_len);
        let (item_flags, expiry) = if want == MUTATION_EXTRAS {
            (
                u32::from_be_bytes(e[8..12].try_into().expect("4")),
                u32::from_be_bytes(e[12..16].try_into().expect("4")),
            )
        } else {
            (0, 0)
        };
        Ok(TapMessage {
            opcode: req.opcode,
            vbucket: req.vbucket,
            opaque: req.opaque,
            cas: req.cas,
            datatype: req.datatype,
            engine_specific,
            tap_flags: u16::from_be_bytes([e[2], e[3]]),
            ttl: e[4],
            item_flags,
            expiry,
            key,
            value,
        })
    }

    /// The u32 in the engine-specific bytes (TAP_OPAQUE's code, TAP_VBUCKET_SET's state).
    pub fn engine_code(&self) -> Option<u32> {
        self.engine_specific
            .get(..4)
            .map(|b| u32::from_be_bytes(b.try_into().expect("4")))
    }
}

/// Byte offsets inside an encoded TAP message, for re-sending one under a new sequence number.
pub const OPAQUE_AT: usize = 12;
pub const TAP_FLAGS_AT: usize = HEADER_LEN + 2;

#[cfg(test)]
mod tests {
    use super::*;

    fn connect(frame: &[u8]) -> Result<TapConnect, TapError> {
        TapConnect::decode(&mcbp::parse_request(frame).unwrap())
    }

    /// Seed 000's first example, byte for byte: a plain connect named "node1".
    #[test]
    fn seed_plain_connect() {
        let frame = [
            0x80, 0x40, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, b'n', b'o', b'd', b'e', b'1',
        ];
        let c = connect(&frame).unwrap();
        assert_eq!(c.name, b"node1");
        assert_eq!(c.flags, 0);
        let mut out = Vec::new();
        c.encode(&mut out, 0).unwrap();
        assert_eq!(out, frame);
    }

    /// The BACKFILL example as its field table gives it: 8 bytes of extras, body 0x15.
    #[test]
    fn seed_backfill_with_eight_byte_extras() {
        let mut frame = vec![0x80, 0x40, 0x00, 0x05, 0x08, 0, 0, 0, 0, 0, 0, 0x15];
        frame.extend_from_slice(&[0; 12]);
        frame.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1]);
        frame.extend_from_slice(b"node1");
        frame.extend_from_slice(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        let c = connect(&frame).unwrap();
        assert_eq!(c.flags, connect_flag::BACKFILL);
        assert_eq!(c.backfill_since, Some(0xffff_ffff));
        // Sent back with memcached's 4 bytes of flags.
        let mut out = Vec::new();
        c.encode(&mut out, 0).unwrap();
        assert_eq!(out[4], 4);
        assert_eq!(connect(&out).unwrap(), c);
    }

    #[test]
    fn list_vbuckets_and_checkpoints() {
        let c = TapConnect {
            name: b"node1".to_vec(),
            flags: connect_flag::LIST_VBUCKETS | connect_flag::CHECKPOINT | connect_flag::DUMP,
            vbuckets: Some(vec![1, 2, 5]),
            checkpoints: vec![(1, 7), (5, 9)],
            ..Default::default()
        };
        let mut out = Vec::new();
        c.encode(&mut out, 3).unwrap();
        assert_eq!(connect(&out).unwrap(), c);
    }

    #[test]
    fn connect_errors_before_allocating() {
        let req = |extras: &'static [u8], value: &'static [u8]| Request {
            magic: 0x80,
            opcode: opcode::CONNECT,
            datatype: 0,
            vbucket: 0,
            opaque: 0,
            cas: 0,
            framing: &[],
            extras,
            key: b"n",
            value,
        };
        // A count far larger than what follows.
        let e = TapConnect::decode(&req(&[0, 0, 0, 4], &[0x03, 0xff, 0, 1])).unwrap_err();
        assert!(e.0.contains("LIST_VBUCKETS"), "{e}");
        let e = TapConnect::decode(&req(&[0, 0, 0, 4], &[0x00, 0x03, 0, 1])).unwrap_err();
        assert!(e.0.contains("only 2 bytes"), "{e}");
        let e = TapConnect::decode(&req(&[0, 0, 1, 0], &[])).unwrap_err();
        assert!(e.0.contains("unknown flags"), "{e}");
        let e = TapConnect::decode(&req(&[0, 0, 0, 1], &[0, 1])).unwrap_err();
        assert!(e.0.contains("BACKFILL"), "{e}");
        let e = TapConnect::decode(&req(&[0, 0, 0], &[])).unwrap_err();
        assert!(e.0.contains("extras of 3"), "{e}");
        let e = TapConnect::decode(&req(&[0, 0, 0, 0], &[1])).unwrap_err();
        assert!(e.0.contains("after the data"), "{e}");
        let e = TapConnect::decode(&req(&[0, 0, 0, 8], &[])).unwrap_err();
        assert!(e.0.contains("needs LIST_VBUCKETS"), "{e}");
    }

    #[test]
    fn message_round_trip_with_engine_specific_bytes() {
        let m = TapMessage {
            opcode: opcode::MUTATION,
            vbucket: 5,
            opaque: 77,
            cas: 0x1234,
            engine_specific: &[9, 9],
            tap_flags: message_flag::ACK,
            ttl: 3,
            item_flags: 0xdead,
            expiry: 60,
            key: b"k",
            value: b"value",
            ..Default::default()
        };
        let mut out = Vec::new();
        m.encode(&mut out);
        assert_eq!(mcbp::frame_len(&out, 1 << 20).unwrap(), Some(out.len()));
        assert_eq!(TapMessage::decode(&out).unwrap(), m);
        assert_eq!(
            u16::from_be_bytes([out[TAP_FLAGS_AT], out[TAP_FLAGS_AT + 1]]),
            message_flag::ACK
        );
        // An engine-specific length past the body is refused, not read.
        out[HEADER_LEN + 1] = 200;
        assert!(TapMessage::decode(&out).is_err());
    }
}
