//! Bundles (TANK's tank_encoding.md): the unit messages are produced, stored and consumed in.
//! A header (flags: codec in bits 0-1, the message count in bits 2-5 when it is 1 to 15,
//! SPARSE in bit 6; a varint count otherwise; for a sparse bundle the first message's sequence
//! number and the distance to the last), then the message set, compressed as a whole with
//! Snappy when the codec says so. Each message: flags (HaveKey 1, UseLastSpecifiedTS 2,
//! SeqNumPrevPlusOne 4), in a sparse bundle the distance from the previous message for those
//! between the first and the last, a millisecond timestamp unless it repeats the last one
//! given, a u8-length key when it has one, and a varint-length payload.

use std::borrow::Cow;

use super::{put_varint, DecodeError, Reader};

pub mod codec {
    pub const NONE: u8 = 0;
    pub const SNAPPY: u8 = 1;
}

/// A message's flags (TANK's `TankFlags::BundleMsgFlags`).
pub mod msg_flag {
    pub const HAVE_KEY: u8 = 1;
    pub const USE_LAST_SPECIFIED_TS: u8 = 2;
    pub const SEQ_NUM_PREV_PLUS_ONE: u8 = 4;
}

const CODEC_MASK: u8 = 0x03;
pub const SPARSE: u8 = 0x40;
const EXTRA_FLAGS: u8 = 0x80;

/// One bundle as sent and stored; the message set is borrowed, compressed or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle<'a> {
    pub codec: u8,
    pub count: u64,
    /// A sparse bundle's first and last sequence numbers.
    pub sparse: Option<(u64, u64)>,
    pub message_set: &'a [u8],
}

/// A message read from a bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    pub seq: u64,
    pub ts: u64,
    pub key: Option<&'a [u8]>,
    pub content: &'a [u8],
}

/// A message to write into a bundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewMessage<'a> {
    pub ts: u64,
    pub key: Option<&'a [u8]>,
    pub content: &'a [u8],
}

impl<'a> Bundle<'a> {
    /// Reads a whole bundle (without the length that precedes it on the wire).
    pub fn parse(bytes: &'a [u8]) -> Result<Bundle<'a>, DecodeError> {
        let mut r = Reader::new(bytes);
        let flags = r.u8("a bundle's flags")?;
        if flags & EXTRA_FLAGS != 0 {
            return Err(DecodeError::Invalid(
                "a bundle with extra flags (bit 7) is not supported".into(),
            ));
        }
        let codec = flags & CODEC_MASK;
        if codec > codec::SNAPPY {
            return Err(DecodeError::Invalid(format!(
                "unknown bundle codec {codec}"
            )));
        }
        let count = match (flags >> 2) & 0x0f {
            0 => r.varint("a bundle's message count")?,
            n => n as u64,
        };
        if count == 0 {
            return Err(DecodeError::Invalid("a bundle of no messages".into()));
        }
        let sparse = if flags & SPARSE != 0 {
            let first = r.u64("a sparse bundle's first sequence number")?;
            let last = if count > 1 {
                let gap = r.varint("a sparse bundle's last sequence number")?;
                first
                    .checked_add(gap)
                    .and_then(|s| s.checked_add(1))
                    .ok_or_else(|| {
                        DecodeError::Invalid("a sparse bundle's sequence numbers overflow".into())
                    })?
            } else {
                first
            };
            Some((first, last))
        } else {
            None
        };
        // Each message takes at least its flags and a payload length: a count past that is a lie.
        if codec == codec::NONE && count > r.remaining() as u64 / 2 {
            return Err(DecodeError::Invalid(format!(
                "a bundle claims {count} messages in {} bytes",
                r.remaining()
            )));
        }
        Ok(Bundle {
            codec,
            count,
            sparse,
            message_set: r.rest(),
        })
    }

    /// How many sequence numbers the bundle takes in its log: its message count, or a sparse
    /// bundle's first to last (messages may skip numbers between).
    pub fn span(&self) -> u64 {
        self.sparse
            .map_or(self.count, |(first, last)| last - first + 1)
    }

    /// Checks the message set of a bundle that is not sparse without decoding its messages
    /// one by one: a plain set must hold `count` whole messages (flags, timestamp, key and
    /// payload within the bytes); a Snappy set must be well-formed Snappy of at most `max`
    /// bytes, room for `count` messages. A sparse bundle's numbering needs its messages read
    /// (`messages`).
    pub fn check_set(&self, max: usize) -> Result<(), DecodeError> {
        if self.codec == codec::NONE {
            return check_plain_set(self.message_set, self.count);
        }
        let len = super::snappy::check(self.message_set, max)?;
        if self.count > len as u64 / 2 {
            return Err(DecodeError::Invalid(format!(
                "a bundle claims {} messages in {len} bytes",
                self.count
            )));
        }
        Ok(())
    }

    /// The message set uncompressed; a Snappy set whose declared length is over `max` is an
    /// error before anything is allocated for it.
    pub fn messages_bytes(&self, max: usize) -> Result<Cow<'a, [u8]>, DecodeError> {
        if self.codec == codec::NONE {
            return Ok(Cow::Borrowed(self.message_set));
        }
        let mut out = Vec::new();
        self.decompress_into(&mut out, max)?;
        Ok(Cow::Owned(out))
    }

    /// The message set uncompressed into `out` (replacing what it held): a buffer kept from
    /// one bundle to the next costs no allocation and no page faults. A plain set is copied.
    pub fn decompress_into(&self, out: &mut Vec<u8>, max: usize) -> Result<(), DecodeError> {
        if self.codec == codec::NONE {
            out.clear();
            out.extend_from_slice(self.message_set);
            return Ok(());
        }
        let len = snap::raw::decompress_len(self.message_set)
            .map_err(|e| DecodeError::Snappy(e.to_string()))?;
        if len > max {
            return Err(DecodeError::TooLarge { len, max });
        }
        // Only bytes the buffer never held are zeroed: the decompressor overwrites the rest.
        if out.len() < len {
            out.resize(len, 0);
        } else {
            out.truncate(len);
        }
        let n = snap::raw::Decoder::new()
            .decompress(self.message_set, out)
            .map_err(|e| DecodeError::Snappy(e.to_string()))?;
        out.truncate(n);
        if self.count > out.len() as u64 / 2 {
            return Err(DecodeError::Invalid(format!(
                "a bundle claims {} messages in {} bytes",
                self.count,
                out.len()
            )));
        }
        Ok(())
    }

    /// The messages of `set` (this bundle's `messages_bytes`): a bundle that is not sparse
    /// numbers them from `base_seq`, the sequence number its first message was given.
    pub fn messages<'b>(&self, set: &'b [u8], base_seq: u64) -> Messages<'b> {
        Messages {
            r: Reader::new(set),
            count: self.count,
            index: 0,
            next_seq: self.sparse.map_or(base_seq, |(first, _)| first),
            last_seq: self.sparse.map(|(_, last)| last),
            ts: 0,
        }
    }
}

/// The messages of a message set, in order; an error ends them.
pub struct Messages<'b> {
    r: Reader<'b>,
    count: u64,
    index: u64,
    next_seq: u64,
    last_seq: Option<u64>,
    ts: u64,
}

impl<'b> Messages<'b> {
    fn read(&mut self) -> Result<Message<'b>, DecodeError> {
        let flags = self.r.u8("a message's flags")?;
        let seq = match self.last_seq {
            Some(last) if self.index + 1 == self.count && self.index > 0 => last,
            Some(_) if self.index > 0 && flags & msg_flag::SEQ_NUM_PREV_PLUS_ONE == 0 => {
                let gap = self.r.varint("a message's sequence number")?;
                self.next_seq.checked_add(gap).ok_or_else(|| {
                    DecodeError::Invalid("a message's sequence number overflows".into())
                })?
            }
            _ => self.next_seq,
        };
        if flags & msg_flag::USE_LAST_SPECIFIED_TS == 0 {
            self.ts = self.r.u64("a message's timestamp")?;
        }
        let key = if flags & msg_flag::HAVE_KEY != 0 {
            Some(self.r.str8("a message's key")?)
        } else {
            None
        };
        let len = self.r.varint_len("a message's content")?;
        let content = self.r.bytes(len, "a message's content")?;
        self.next_seq = seq.wrapping_add(1);
        self.index += 1;
        Ok(Message {
            seq,
            ts: self.ts,
            key,
            content,
        })
    }
}

impl<'b> Iterator for Messages<'b> {
    type Item = Result<Message<'b>, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.index >= self.count {
            return None;
        }
        let m = self.read();
        if m.is_err() {
            self.index = self.count;
        }
        Some(m)
    }
}

/// Whether `set` (plain, not sparse) holds `count` whole messages: each one's fields are
/// skipped by their lengths, nothing copied.
fn check_plain_set(set: &[u8], count: u64) -> Result<(), DecodeError> {
    let mut r = Reader::new(set);
    for _ in 0..count {
        let flags = r.u8("a message's flags")?;
        if flags & msg_flag::USE_LAST_SPECIFIED_TS == 0 {
            r.bytes(8, "a message's timestamp")?;
        }
        if flags & msg_flag::HAVE_KEY != 0 {
            r.str8("a message's key")?;
        }
        let len = r.varint_len("a message's content")?;
        r.bytes(len, "a message's content")?;
    }
    Ok(())
}

/// Appends a bundle of `messages` (not sparse) to `out`, its message set compressed with
/// Snappy when `codec` says so. A message whose timestamp repeats the last one written says
/// so instead of writing it again, as TANK's client does. Keys are at most 255 bytes.
pub fn write(out: &mut Vec<u8>, messages: &[NewMessage<'_>], codec: u8) {
    assert!(!messages.is_empty(), "a bundle holds one message or more");
    let count = messages.len() as u64;
    let mut flags = codec & CODEC_MASK;
    if count <= 15 {
        flags |= (count as u8) << 2;
    }
    out.push(flags);
    if count > 15 {
        put_varint(out, count);
    }
    if codec == codec::NONE {
        write_message_set(out, messages);
    } else {
        let mut set = Vec::new();
        write_message_set(&mut set, messages);
        let compressed = snap::raw::Encoder::new()
            .compress_vec(&set)
            .expect("a message set within Snappy's 4 GiB");
        out.extend_from_slice(&compressed);
    }
}

fn write_message_set(out: &mut Vec<u8>, messages: &[NewMessage<'_>]) {
    let mut last_ts = None;
    for m in messages {
        let mut flags = 0;
        if m.key.is_some() {
            flags |= msg_flag::HAVE_KEY;
        }
        if last_ts == Some(m.ts) {
            flags |= msg_flag::USE_LAST_SPECIFIED_TS;
        }
        out.push(flags);
        if last_ts != Some(m.ts) {
            out.extend_from_slice(&m.ts.to_le_bytes());
            last_ts = Some(m.ts);
        }
        if let Some(k) = m.key {
            assert!(
                k.len() <= u8::MAX as usize,
                "a TANK key is at most 255 bytes"
            );
            out.push(k.len() as u8);
            out.extend_from_slice(k);
        }
        put_varint(out, m.content.len() as u64);
        out.extend_from_slice(m.content);
    }
}
