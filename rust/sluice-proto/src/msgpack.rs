//! The subset of MessagePack sluice writes and reads: unsigned integers, nil, booleans, binary
//! and string payloads, arrays and maps. The reader borrows from its input and checks every
//! length against the bytes that remain before handing out a slice, so a hostile length can
//! never cause an allocation or a read past the end.

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
        }
    }
}

impl std::error::Error for DecodeError {}

pub fn write_uint(out: &mut Vec<u8>, v: u64) {
    let mut b = [0u8; MAX_UINT_LEN];
    let n = put_uint(&mut b, 0, v);
    out.extend_from_slice(&b[..n]);
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

pub fn write_bin(out: &mut Vec<u8>, b: &[u8]) {
    let mut h = [0u8; 5];
    let n = put_bin_header(&mut h, 0, b.len());
    out.extend_from_slice(&h[..n]);
    out.extend_from_slice(b);
}

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

    fn marker(&mut self) -> Result<(usize, u8), DecodeError> {
        let at = self.pos;
        Ok((at, self.take(1)?[0]))
    }

    fn be(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | *b as u64))
    }

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
