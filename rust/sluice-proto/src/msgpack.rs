//! MessagePack primitives. The WAL row codec uses the typed subset (unsigned integers, nil,
//! booleans, binary and string payloads, arrays and maps); iproto reads any value through
//! [`Reader::read_value`] and steps over whole values with [`Reader::skip_value`]. The reader
//! borrows from its input and checks every length against the bytes that remain before handing
//! out a slice, so a hostile length can never cause an allocation or a read past the end, and
//! nesting is bounded by the caller's depth limit, so a hostile nesting cannot exhaust a stack.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The input ended inside a value; `needed` more bytes were required.
    Truncated { offset: usize, needed: usize },
    /// A marker byte that is not the type the caller asked for.
    UnexpectedMarker {
        offset: usize,
        marker: u8,
        expected: &'static str,
    },
    /// Arrays and maps nested deeper than the caller allows.
    TooDeep { offset: usize, limit: usize },
    /// A marker byte that MessagePack leaves unused (0xc1).
    Reserved { offset: usize },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Truncated { offset, needed } => {
                write!(
                    f,
                    "msgpack value truncated at offset {offset} ({needed} more bytes needed)"
                )
            }
            DecodeError::UnexpectedMarker {
                offset,
                marker,
                expected,
            } => {
                write!(
                    f,
                    "msgpack marker 0x{marker:02x} at offset {offset}, expected {expected}"
                )
            }
            DecodeError::TooDeep { offset, limit } => {
                write!(
                    f,
                    "msgpack nesting deeper than {limit} levels at offset {offset}"
                )
            }
            DecodeError::Reserved { offset } => {
                write!(f, "msgpack reserved marker 0xc1 at offset {offset}")
            }
        }
    }
}

impl std::error::Error for DecodeError {}

#[inline]
pub fn write_uint(out: &mut Vec<u8>, v: u64) {
    // Encoded in place: a copy of its variable length from a stack buffer is a call to memcpy.
    let at = out.len();
    out.resize(at + MAX_UINT_LEN, 0);
    let end = put_uint(out, at, v);
    out.truncate(end);
}

/// Longest encoding of an unsigned integer.
pub const MAX_UINT_LEN: usize = 9;

/// Encodes an unsigned integer into `buf` at `at` and returns the position after it. For hot
/// paths that assemble fixed fields in a stack buffer; `buf` needs MAX_UINT_LEN bytes from `at`.
#[inline]
pub fn put_uint(buf: &mut [u8], at: usize, v: u64) -> usize {
    let b = &mut buf[at..at + MAX_UINT_LEN];
    if v < 0x80 {
        b[0] = v as u8;
        at + 1
    } else if v <= u8::MAX as u64 {
        b[0] = 0xcc;
        b[1] = v as u8;
        at + 2
    } else if v <= u16::MAX as u64 {
        b[0] = 0xcd;
        b[1..3].copy_from_slice(&(v as u16).to_be_bytes());
        at + 3
    } else if v <= u32::MAX as u64 {
        b[0] = 0xce;
        b[1..5].copy_from_slice(&(v as u32).to_be_bytes());
        at + 5
    } else {
        b[0] = 0xcf;
        b[1..9].copy_from_slice(&v.to_be_bytes());
        at + 9
    }
}

/// Encodes the header of a binary payload of `len` bytes (bin 8/16/32) into `buf` at `at`;
/// returns the position after it. `buf` needs 5 bytes from `at`.
#[inline]
pub fn put_bin_header(buf: &mut [u8], at: usize, len: usize) -> usize {
    let b = &mut buf[at..at + 5];
    if len <= u8::MAX as usize {
        b[0] = 0xc4;
        b[1] = len as u8;
        at + 2
    } else if len <= u16::MAX as usize {
        b[0] = 0xc5;
        b[1..3].copy_from_slice(&(len as u16).to_be_bytes());
        at + 3
    } else {
        b[0] = 0xc6;
        b[1..5].copy_from_slice(&(len as u32).to_be_bytes());
        at + 5
    }
}

pub fn write_nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

pub fn write_bool(out: &mut Vec<u8>, v: bool) {
    out.push(if v { 0xc3 } else { 0xc2 });
}

pub fn write_array_len(out: &mut Vec<u8>, n: u32) {
    if n < 16 {
        out.push(0x90 | n as u8);
    } else if n <= u16::MAX as u32 {
        out.push(0xdc);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdd);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

#[inline]
pub fn write_map_len(out: &mut Vec<u8>, n: u32) {
    if n < 16 {
        out.push(0x80 | n as u8);
    } else if n <= u16::MAX as u32 {
        out.push(0xde);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdf);
        out.extend_from_slice(&n.to_be_bytes());
    }
}

#[inline]
pub fn write_bin(out: &mut Vec<u8>, b: &[u8]) {
    let mut h = [0u8; 5];
    let n = put_bin_header(&mut h, 0, b.len());
    out.extend_from_slice(&h[..n]);
    out.extend_from_slice(b);
}

#[inline]
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= u8::MAX as usize {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= u16::MAX as usize {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

/// A signed integer in its shortest form; non-negative values are written as unsigned
/// integers, as Tarantool and most MessagePack libraries do.
pub fn write_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        write_uint(out, v as u64);
    } else if v >= -32 {
        out.push(v as i8 as u8);
    } else if v >= i8::MIN as i64 {
        out.extend_from_slice(&[0xd0, v as i8 as u8]);
    } else if v >= i16::MIN as i64 {
        out.push(0xd1);
        out.extend_from_slice(&(v as i16).to_be_bytes());
    } else if v >= i32::MIN as i64 {
        out.push(0xd2);
        out.extend_from_slice(&(v as i32).to_be_bytes());
    } else {
        out.push(0xd3);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

pub fn write_f64(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_bits().to_be_bytes());
}

/// A string payload given as bytes (iproto strings need not be UTF-8).
pub fn write_str_bytes(out: &mut Vec<u8>, s: &[u8]) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= u8::MAX as usize {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= u16::MAX as usize {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s);
}

/// An array header always in its 32-bit form (`dd`), as Tarantool writes IPROTO_DATA, so that
/// the count can be patched in place once the elements are written.
pub fn write_array32_len(out: &mut Vec<u8>, n: u32) {
    out.push(0xdd);
    out.extend_from_slice(&n.to_be_bytes());
}

/// One MessagePack token: a scalar whole, or the header of an array or map whose elements
/// follow in the input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    /// Any non-negative integer, whichever marker carried it.
    UInt(u64),
    /// A negative integer (a signed marker holding a non-negative value reads as `UInt`).
    Int(i64),
    F32(f32),
    F64(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext(i8, &'a [u8]),
}

/// A forward-only reader over one buffer.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let remaining = self.buf.len() - self.pos;
        if n > remaining {
            return Err(DecodeError::Truncated {
                offset: self.pos,
                needed: n - remaining,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn marker(&mut self) -> Result<(usize, u8), DecodeError> {
        let at = self.pos;
        match self.buf.get(at) {
            Some(&m) => {
                self.pos = at + 1;
                Ok((at, m))
            }
            None => Err(DecodeError::Truncated {
                offset: at,
                needed: 1,
            }),
        }
    }

    /// A big-endian integer of `n` bytes (1, 2, 4 or 8).
    #[inline]
    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        let b = self.take(n)?;
        Ok(match *b {
            [a] => a as u64,
            [a, b] => u16::from_be_bytes([a, b]) as u64,
            [a, b, c, d] => u32::from_be_bytes([a, b, c, d]) as u64,
            _ => b.iter().fold(0u64, |acc, b| (acc << 8) | *b as u64),
        })
    }

    #[inline]
    pub fn read_uint(&mut self) -> Result<u64, DecodeError> {
        let (at, m) = self.marker()?;
        match m {
            0x00..=0x7f => Ok(m as u64),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            _ => Err(DecodeError::UnexpectedMarker {
                offset: at,
                marker: m,
                expected: "unsigned integer",
            }),
        }
    }

    /// Reads nil as `None`, an unsigned integer as `Some`.
    pub fn read_opt_uint(&mut self) -> Result<Option<u64>, DecodeError> {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            return Ok(None);
        }
        self.read_uint().map(Some)
    }

    pub fn read_bool(&mut self) -> Result<bool, DecodeError> {
        let (at, m) = self.marker()?;
        match m {
            0xc2 => Ok(false),
            0xc3 => Ok(true),
            _ => Err(DecodeError::UnexpectedMarker {
                offset: at,
                marker: m,
                expected: "boolean",
            }),
        }
    }

    pub fn read_array_len(&mut self) -> Result<u32, DecodeError> {
        let (at, m) = self.marker()?;
        match m {
            0x90..=0x9f => Ok((m & 0x0f) as u32),
            0xdc => Ok(self.be(2)? as u32),
            0xdd => Ok(self.be(4)? as u32),
            _ => Err(DecodeError::UnexpectedMarker {
                offset: at,
                marker: m,
                expected: "array",
            }),
        }
    }

    pub fn read_map_len(&mut self) -> Result<u32, DecodeError> {
        let (at, m) = self.marker()?;
        match m {
            0x80..=0x8f => Ok((m & 0x0f) as u32),
            0xde => Ok(self.be(2)? as u32),
            0xdf => Ok(self.be(4)? as u32),
            _ => Err(DecodeError::UnexpectedMarker {
                offset: at,
                marker: m,
                expected: "map",
            }),
        }
    }

    /// Binary payload (bin 8/16/32); the length is checked against the input before slicing.
    pub fn read_bin(&mut self) -> Result<&'a [u8], DecodeError> {
        let (at, m) = self.marker()?;
        let n = match m {
            0xc4 => self.be(1)?,
            0xc5 => self.be(2)?,
            0xc6 => self.be(4)?,
            _ => {
                return Err(DecodeError::UnexpectedMarker {
                    offset: at,
                    marker: m,
                    expected: "binary",
                })
            }
        };
        self.take(n as usize)
    }

    /// The marker of the next value without consuming it.
    pub fn peek_marker(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    /// The input not read yet.
    pub fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }

    /// Reads one token of any type. Arrays and maps yield their header only.
    #[inline]
    pub fn read_value(&mut self) -> Result<Value<'a>, DecodeError> {
        let (at, m) = self.marker()?;
        Ok(match m {
            0x00..=0x7f => Value::UInt(m as u64),
            0x80..=0x8f => Value::Map((m & 0x0f) as u32),
            0x90..=0x9f => Value::Array((m & 0x0f) as u32),
            0xa0..=0xbf => Value::Str(self.take((m & 0x1f) as usize)?),
            0xc0 => Value::Nil,
            0xc1 => return Err(DecodeError::Reserved { offset: at }),
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.be(1 << (m - 0xc4))?;
                Value::Bin(self.take(n as usize)?)
            }
            0xc7..=0xc9 => {
                let n = self.be(1 << (m - 0xc7))?;
                let t = self.take(1)?[0] as i8;
                Value::Ext(t, self.take(n as usize)?)
            }
            0xca => Value::F32(f32::from_bits(self.be(4)? as u32)),
            0xcb => Value::F64(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Value::UInt(self.be(1 << (m - 0xcc))?),
            0xd0..=0xd3 => {
                let n = 1usize << (m - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                let v = ((raw << shift) as i64) >> shift;
                if v >= 0 {
                    Value::UInt(v as u64)
                } else {
                    Value::Int(v)
                }
            }
            0xd4..=0xd8 => {
                let t = self.take(1)?[0] as i8;
                Value::Ext(t, self.take(1 << (m - 0xd4))?)
            }
            0xd9..=0xdb => {
                let n = self.be(1 << (m - 0xd9))?;
                Value::Str(self.take(n as usize)?)
            }
            0xdc | 0xdd => Value::Array(self.be(2 << (m - 0xdc))? as u32),
            0xde | 0xdf => Value::Map(self.be(2 << (m - 0xde))? as u32),
            0xe0..=0xff => Value::Int(m as i8 as i64),
        })
    }

    /// Steps over one whole value (an array or map with everything in it), allowing at most
    /// `max_depth` levels of nesting. Iterative, so hostile nesting costs no stack; every
    /// element needs at least one byte, so it ends within the input's length.
    pub fn skip_value(&mut self, max_depth: usize) -> Result<(), DecodeError> {
        // A scalar, what most fields are, is one read, without the walk below.
        if let Some(0x00..=0x7f | 0xa0..=0xdb | 0xe0..=0xff) = self.buf.get(self.pos) {
            return self.read_value().map(|_| ());
        }
        // Elements still to read at each open level: the first levels on the stack (every
        // request skips a header, a body and a tuple, so no allocation for them), deeper
        // ones in `spill`.
        const INLINE: usize = 16;
        let mut inline = [0u64; INLINE];
        let mut spill: Vec<u64> = Vec::new();
        let mut depth = 0usize;
        let mut left: u64 = 1;
        loop {
            while left == 0 {
                if depth == 0 {
                    return Ok(());
                }
                depth -= 1;
                left = if depth < INLINE {
                    inline[depth]
                } else {
                    spill.pop().expect("one per level past the inline ones")
                };
            }
            left -= 1;
            let at = self.pos;
            let children = match self.read_value()? {
                Value::Array(n) => n as u64,
                Value::Map(n) => 2 * n as u64,
                _ => 0,
            };
            if children > 0 {
                if depth >= max_depth {
                    return Err(DecodeError::TooDeep {
                        offset: at,
                        limit: max_depth,
                    });
                }
                if depth < INLINE {
                    inline[depth] = left;
                } else {
                    spill.push(left);
                }
                depth += 1;
                left = children;
            }
        }
    }

    /// The bytes of the next whole value, stepped over (see [`Reader::skip_value`]).
    pub fn read_raw_value(&mut self, max_depth: usize) -> Result<&'a [u8], DecodeError> {
        let start = self.pos;
        self.skip_value(max_depth)?;
        Ok(&self.buf[start..self.pos])
    }

    /// Any integer that fits an i64 (unsigned ones above i64::MAX are refused).
    pub fn read_int(&mut self) -> Result<i64, DecodeError> {
        let at = self.pos;
        match self.read_value()? {
            Value::UInt(v) if v <= i64::MAX as u64 => Ok(v as i64),
            Value::Int(v) => Ok(v),
            _ => {
                self.pos = at;
                Err(DecodeError::UnexpectedMarker {
                    offset: at,
                    marker: self.buf[at],
                    expected: "integer within i64",
                })
            }
        }
    }

    /// String payload as raw bytes (UTF-8 is the caller's concern).
    pub fn read_str(&mut self) -> Result<&'a [u8], DecodeError> {
        let (at, m) = self.marker()?;
        let n = match m {
            0xa0..=0xbf => (m & 0x1f) as u64,
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            _ => {
                return Err(DecodeError::UnexpectedMarker {
                    offset: at,
                    marker: m,
                    expected: "string",
                })
            }
        };
        self.take(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn uint_encodings_match_the_spec() {
        let cases: &[(u64, &[u8])] = &[
            (0, &[0x00]),
            (0x7f, &[0x7f]),
            (0x80, &[0xcc, 0x80]),
            (0x100, &[0xcd, 0x01, 0x00]),
            (0x1_0000, &[0xce, 0x00, 0x01, 0x00, 0x00]),
            (
                u64::MAX,
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            ),
        ];
        for (v, bytes) in cases {
            let mut out = Vec::new();
            write_uint(&mut out, *v);
            assert_eq!(&out[..], *bytes, "encoding of {v}");
            assert_eq!(Reader::new(bytes).read_uint().unwrap(), *v);
        }
    }

    #[test]
    fn values_of_every_marker_family_read_back() {
        let mut out = Vec::new();
        write_int(&mut out, -1);
        write_int(&mut out, -200);
        write_int(&mut out, i64::MIN);
        write_int(&mut out, 7);
        write_f64(&mut out, 1.5);
        write_str_bytes(&mut out, &[0xff; 40]);
        write_array32_len(&mut out, 2);
        write_nil(&mut out);
        write_bool(&mut out, true);
        out.extend_from_slice(&[0xd4, 0x01, 0x2a]); // fixext 1
        out.extend_from_slice(&[0xd0, 0x05]); // int8 holding 5
        let mut r = Reader::new(&out);
        assert_eq!(r.read_value().unwrap(), Value::Int(-1));
        assert_eq!(r.read_value().unwrap(), Value::Int(-200));
        assert_eq!(r.read_value().unwrap(), Value::Int(i64::MIN));
        assert_eq!(r.read_value().unwrap(), Value::UInt(7));
        assert_eq!(r.read_value().unwrap(), Value::F64(1.5));
        assert_eq!(r.read_value().unwrap(), Value::Str(&[0xff; 40][..]));
        assert_eq!(r.read_value().unwrap(), Value::Array(2));
        assert_eq!(r.read_value().unwrap(), Value::Nil);
        assert_eq!(r.read_value().unwrap(), Value::Bool(true));
        assert_eq!(r.read_value().unwrap(), Value::Ext(1, &[0x2a][..]));
        assert_eq!(r.read_value().unwrap(), Value::UInt(5));
        assert!(r.is_empty());
    }

    #[test]
    fn skip_value_steps_over_nested_containers_and_bounds_depth() {
        // {"a": [1, [2, 3]], "b": nil} then a trailing 9
        let v = [
            0x82, 0xa1, b'a', 0x92, 0x01, 0x92, 0x02, 0x03, 0xa1, b'b', 0xc0, 0x09,
        ];
        let mut r = Reader::new(&v);
        assert_eq!(r.read_raw_value(8).unwrap(), &v[..11]);
        assert_eq!(r.read_uint().unwrap(), 9);
        let mut r = Reader::new(&v);
        assert!(matches!(r.skip_value(1), Err(DecodeError::TooDeep { .. })));
        let deep = [0x91u8; 10_000];
        let err = Reader::new(&deep).skip_value(64).unwrap_err();
        assert!(matches!(err, DecodeError::TooDeep { limit: 64, .. }));
        // Nesting past the levels kept on the stack: [[...[1, 2]...], 3], 40 deep, then 4.
        let mut nested = vec![0x92u8; 40];
        nested.extend_from_slice(&[0x01, 0x02]);
        nested.extend(std::iter::repeat_n(0x03u8, 39));
        nested.push(0x04);
        let mut r = Reader::new(&nested);
        assert_eq!(r.read_raw_value(64).unwrap().len(), nested.len() - 1);
        assert_eq!(r.read_uint().unwrap(), 4);
        // A claimed 2^32-1 elements with nothing behind them: truncated, not a long loop.
        let huge = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert!(matches!(
            Reader::new(&huge).skip_value(4),
            Err(DecodeError::Truncated { .. })
        ));
    }

    proptest! {
        #[test]
        fn any_bytes_skip_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut r = Reader::new(&bytes);
            while !r.is_empty() {
                if r.skip_value(16).is_err() {
                    break;
                }
            }
        }

        #[test]
        fn ints_round_trip(v in any::<i64>()) {
            let mut out = Vec::new();
            write_int(&mut out, v);
            prop_assert_eq!(Reader::new(&out).read_int().unwrap(), v);
        }
    }

    #[test]
    fn hostile_bin_length_is_refused_without_allocating() {
        let input = [0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2, 3];
        let err = Reader::new(&input).read_bin().unwrap_err();
        assert_eq!(
            err,
            DecodeError::Truncated {
                offset: 5,
                needed: 0xffff_ffff - 3
            }
        );
    }

    proptest! {
        #[test]
        fn roundtrip(v in any::<u64>(), b in proptest::collection::vec(any::<u8>(), 0..70000), n in any::<u32>(), s in "[a-z]{0,300}") {
            let mut out = Vec::new();
            write_uint(&mut out, v);
            write_bin(&mut out, &b);
            write_array_len(&mut out, n);
            write_map_len(&mut out, n);
            write_str(&mut out, &s);
            write_nil(&mut out);
            write_bool(&mut out, true);
            let mut r = Reader::new(&out);
            prop_assert_eq!(r.read_uint().unwrap(), v);
            prop_assert_eq!(r.read_bin().unwrap(), &b[..]);
            prop_assert_eq!(r.read_array_len().unwrap(), n);
            prop_assert_eq!(r.read_map_len().unwrap(), n);
            prop_assert_eq!(r.read_str().unwrap(), s.as_bytes());
            prop_assert_eq!(r.read_opt_uint().unwrap(), None);
            prop_assert!(r.read_bool().unwrap());
            prop_assert!(r.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut r = Reader::new(&input);
            while !r.is_empty() {
                let before = r.position();
                let _ = r.read_uint().or_else(|_| r.read_bin().map(|_| 0)).or_else(|_| r.read_array_len().map(u64::from));
                if r.position() == before { break; }
            }
        }
    }
}
