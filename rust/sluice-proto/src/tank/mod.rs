//! TANK's wire protocol (phaistos-networks/TANK): little-endian frames `{msg id: u8, payload
//! length: u32}`, requests and answers for produce, consume, discovery, topic creation and
//! status (`request`, `response`), and the bundles messages travel and are stored in
//! (`bundle`). Where TANK's protocol document and its broker disagree, the broker's bytes (as
//! recorded from it) win: a version-3 Consume carries a flags byte, a Snappy bundle keeps its
//! message count outside the compressed set, an unknown topic is answered with partition id
//! 0xffff, and a consume past the high-water mark with flag 0x01 and the first available
//! sequence number.
//!
//! Every decoder checks a length against what is left before it reads or allocates; counts
//! the peer sends are bounded by the bytes that would hold them.

pub mod bundle;
pub mod request;
pub mod response;
pub mod snappy;

/// Message ids (TANK's `TankAPIMsgType`).
pub mod msg {
    pub const PRODUCE: u8 = 0x01;
    pub const CONSUME: u8 = 0x02;
    pub const PING: u8 = 0x03;
    pub const PRODUCE_WITH_SEQNUM: u8 = 0x05;
    pub const DISCOVER_PARTITIONS: u8 = 0x06;
    pub const CREATE_TOPIC: u8 = 0x07;
    pub const RELOAD_CONF: u8 = 0x08;
    pub const CONSUME_PEER: u8 = 0x09;
    pub const STATUS: u8 = 0x0a;
    pub const DISCOVER_TOPICS: u8 = 0x0b;
    pub const DISCOVER_TOPOLOGY: u8 = 0x0c;
}

/// A frame's header: message id and payload length.
pub const HEADER: usize = 5;

/// The Ping a broker sends on accept.
pub const PING_FRAME: [u8; HEADER] = [msg::PING, 0, 0, 0, 0];

/// Sequence number 0 in a consume: from the first message available.
pub const SEQ_FIRST_AVAILABLE: u64 = 0;
/// Sequence number u64::MAX in a consume: from the next message published (the tail).
pub const SEQ_TAIL: u64 = u64::MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The bytes end before `what`.
    Short(&'static str),
    /// A varint longer than 10 bytes or past 64 bits.
    BadVarint,
    /// A frame's payload is over the limit.
    TooLarge { len: usize, max: usize },
    /// A field holds a value the protocol does not allow.
    Invalid(String),
    /// A Snappy message set that does not decompress.
    Snappy(String),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Short(what) => write!(f, "the bytes end inside {what}"),
            DecodeError::BadVarint => write!(f, "a varint is longer than 64 bits"),
            DecodeError::TooLarge { len, max } => {
                write!(f, "a payload of {len} bytes is over the limit of {max}")
            }
            DecodeError::Invalid(why) => f.write_str(why),
            DecodeError::Snappy(why) => {
                write!(f, "a Snappy message set does not decompress: {why}")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

/// What `check` found at the front of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// Not yet a whole frame; at least this many bytes in all are needed.
    Incomplete(usize),
    /// A whole frame: its message id and the payload's range in the buffer.
    Complete { id: u8, payload: (usize, usize) },
}

/// Looks at the front of `buf` without copying: a whole frame, or how much is still missing.
/// A payload length over `max_payload` is an error before anything is buffered for it.
pub fn check(buf: &[u8], max_payload: usize) -> Result<Frame, DecodeError> {
    if buf.len() < HEADER {
        return Ok(Frame::Incomplete(HEADER));
    }
    let len = u32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > max_payload {
        return Err(DecodeError::TooLarge {
            len,
            max: max_payload,
        });
    }
    if buf.len() < HEADER + len {
        return Ok(Frame::Incomplete(HEADER + len));
    }
    Ok(Frame::Complete {
        id: buf[0],
        payload: (HEADER, HEADER + len),
    })
}

/// Starts a frame of `id` in `out`; `finish_frame` writes its length once the payload is in.
pub fn start_frame(out: &mut Vec<u8>, id: u8) -> usize {
    let at = out.len();
    out.push(id);
    out.extend_from_slice(&[0; 4]);
    at
}

pub fn finish_frame(out: &mut [u8], at: usize) {
    let len = (out.len() - at - HEADER) as u32;
    out[at + 1..at + HEADER].copy_from_slice(&len.to_le_bytes());
}

/// A little-endian reader over a payload.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    #[inline]
    pub fn position(&self) -> usize {
        self.pos
    }

    #[inline]
    pub fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Short(what));
        }
        let b = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(b)
    }

    #[inline]
    pub fn rest(&mut self) -> &'a [u8] {
        let b = &self.buf[self.pos..];
        self.pos = self.buf.len();
        b
    }

    #[inline]
    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.bytes(1, what)?[0])
    }

    #[inline]
    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    #[inline]
    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    #[inline]
    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let b = self.bytes(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// A str8: a u8 length, then that many bytes.
    #[inline]
    pub fn str8(&mut self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let n = self.u8(what)? as usize;
        self.bytes(n, what)
    }

    /// An unsigned LEB128 varint (7 bits a byte, low first), as TANK's Switch/compress.h.
    #[inline]
    pub fn varint(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8(what)?;
            let part = (b & 0x7f) as u64;
            if shift == 63 && part > 1 {
                return Err(DecodeError::BadVarint);
            }
            v |= part << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError::BadVarint)
    }

    /// A varint that must fit a length within what is left of the buffer.
    #[inline]
    pub fn varint_len(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.varint(what)?;
        if n > self.remaining() as u64 {
            return Err(DecodeError::Short(what));
        }
        Ok(n as usize)
    }
}

pub fn put_varint(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(varint(&mut [0; 10], v));
}

/// `v` as a varint (LEB128, as TANK writes them), in `buf`.
pub fn varint(buf: &mut [u8; 10], mut v: u64) -> &[u8] {
    let mut n = 0;
    while v >= 0x80 {
        buf[n] = v as u8 | 0x80;
        v >>= 7;
        n += 1;
    }
    buf[n] = v as u8;
    &buf[..=n]
}

pub fn put_str8(out: &mut Vec<u8>, s: &[u8]) {
    debug_assert!(s.len() <= u8::MAX as usize);
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

#[cfg(test)]
mod tests;
