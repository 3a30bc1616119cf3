//! Tarantool's `.xlog` and `.snap` files (format 0.12 and 0.13), as far as a reader needs
//! them: the text meta block, and each block's 19-byte fixed header.
//!
//! ```text
//! XLOG | SNAP \n  0.13 \n  Version: 2.6.0-.. \n  Instance: <uuid> \n  VClock: {1: 10} \n
//! [PrevVClock: {..} \n]  \n
//! block*: magic u32 BE (0xd5ba0bab rows, 0xd5ba0bba zstd-compressed rows)
//!         | MP_UINT length of the rows | MP_UINT 0 | MP_UINT crc32c of the rows
//!         | MP_STR padding to 19 bytes | rows (`xrow`)
//! EOF marker 0xd510aded, written on a clean close
//! ```
//!
//! Pure: the caller reads the file, checks the CRC (crc32c of the bytes as stored, compressed
//! or not) and decompresses.

use std::fmt;

use crate::msgpack::Reader;

pub const ROW_MAGIC: u32 = 0xd5ba_0bab;
pub const ZROW_MAGIC: u32 = 0xd5ba_0bba;
pub const EOF_MARKER: u32 = 0xd510_aded;
pub const FIXHEADER_SIZE: usize = 19;
/// The longest meta block accepted: Tarantool's is a few lines (a vclock has at most 32
/// components).
pub const MAX_META: usize = 4096;

/// Why a file or block cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XlogError(pub String);

impl fmt::Display for XlogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for XlogError {}

fn err(why: impl Into<String>) -> XlogError {
    XlogError(why.into())
}

/// The meta block at the head of a file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Meta {
    /// `XLOG`, `SNAP` (or `VYLOG`, `RUN`, `INDEX` for vinyl's files).
    pub filetype: String,
    /// `0.13` or `0.12`.
    pub version: String,
    /// The Tarantool that wrote it (`Version:`), if given.
    pub tarantool: Option<String>,
    /// `Instance:` (`Server:` in 0.12).
    pub instance: Option<String>,
    /// Per replica id, its LSN before the file's first row (`VClock:`).
    pub vclock: Vec<(u32, u64)>,
    /// `PrevVClock:`, kept by WAL files to detect a missing one.
    pub prev_vclock: Option<Vec<(u32, u64)>>,
}

/// The meta block at the start of `head` (the file's first bytes, at least up to the blank
/// line that ends it) and its length. Refuses what is not a Tarantool file or a version this
/// reader does not know; `Ok(None)` means `head` ends before the blank line.
pub fn parse_meta(head: &[u8]) -> Result<Option<(Meta, usize)>, XlogError> {
    let Some(end) = head.windows(2).position(|w| w == b"\n\n") else {
        if head.len() >= MAX_META {
            return Err(err(format!(
                "no end of the meta block in its first {MAX_META} bytes"
            )));
        }
        return Ok(None);
    };
    let text = std::str::from_utf8(&head[..end]).map_err(|_| err("the meta block is not text"))?;
    let mut lines = text.lines();
    let filetype = lines.next().unwrap_or_default().to_string();
    if !["XLOG", "SNAP", "VYLOG", "RUN", "INDEX"].contains(&filetype.as_str()) {
        return Err(err(format!("{filetype:?} is not a Tarantool file type")));
    }
    let version = lines.next().unwrap_or_default().to_string();
    if version != "0.13" && version != "0.12" {
        return Err(err(format!(
            "format version {version:?}: this reader knows 0.12 and 0.13"
        )));
    }
    let mut meta = Meta {
        filetype,
        version,
        ..Meta::default()
    };
    for line in lines {
        let Some((key, value)) = line.split_once(": ") else {
            return Err(err(format!("meta line {line:?} is not `Key: value`")));
        };
        match key {
            "Version" => meta.tarantool = Some(value.to_string()),
            "Instance" | "Server" => meta.instance = Some(value.to_string()),
            "VClock" => meta.vclock = parse_vclock(value)?,
            "PrevVClock" => meta.prev_vclock = Some(parse_vclock(value)?),
            // Keys of later versions are not needed to read the rows.
            _ => {}
        }
    }
    Ok(Some((meta, end + 2)))
}

/// `{1: 10, 2: 5}` (or `{}`).
pub fn parse_vclock(text: &str) -> Result<Vec<(u32, u64)>, XlogError> {
    let bad = || err(format!("vclock {text:?} is not {{id: lsn, ...}}"));
    let inner = text
        .trim()
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .ok_or_else(bad)?;
    if inner.trim().is_empty() {
        return Ok(Vec::new());
    }
    inner
        .split(',')
        .map(|pair| {
            let (id, lsn) = pair.split_once(':').ok_or_else(bad)?;
            let id: u32 = id.trim().parse().map_err(|_| bad())?;
            let lsn: u64 = lsn.trim().parse().map_err(|_| bad())?;
            (id < 32).then_some((id, lsn)).ok_or_else(bad)
        })
        .collect()
}

/// A block's fixed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixHeader {
    /// The rows are zstd-compressed.
    pub compressed: bool,
    /// The stored length of the rows (compressed or not).
    pub len: u64,
    /// crc32c of the stored bytes.
    pub crc32c: u32,
}

/// What the next 4 bytes of a file announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    Block { compressed: bool },
    Eof,
    Other(u32),
}

pub fn marker(bytes: [u8; 4]) -> Marker {
    match u32::from_be_bytes(bytes) {
        ROW_MAGIC => Marker::Block { compressed: false },
        ZROW_MAGIC => Marker::Block { compressed: true },
        EOF_MARKER => Marker::Eof,
        other => Marker::Other(other),
    }
}

/// A block's 19-byte fixed header (starting with its magic).
pub fn decode_fixheader(bytes: &[u8; FIXHEADER_SIZE]) -> Result<FixHeader, XlogError> {
    let compressed = match marker([bytes[0], bytes[1], bytes[2], bytes[3]]) {
        Marker::Block { compressed } => compressed,
        _ => return Err(err("not a block's magic")),
    };
    let mut r = Reader::new(&bytes[4..]);
    let bad = |_| err("the block's fixed header is malformed");
    let len = r.read_uint().map_err(bad)?;
    let _previous_crc = r.read_uint().map_err(bad)?;
    let crc = r.read_uint().map_err(bad)?;
    let crc32c = u32::try_from(crc).map_err(|_| err("the block's CRC is wider than 32 bits"))?;
    Ok(FixHeader {
        compressed,
        len,
        crc32c,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_meta_block_of_a_tarantool_2_6_xlog() {
        let head = b"XLOG\n0.13\nVersion: 2.6.0-0-g47aa4e01e\nInstance: 41d08516-512d-4b05-9d15-c98cbbd19a5e\nVClock: {1: 60}\nPrevVClock: {1: 59}\n\n\xd5\x10\xad\xed";
        let (meta, len) = parse_meta(head).unwrap().unwrap();
        assert_eq!(&head[len..], b"\xd5\x10\xad\xed");
        assert_eq!(meta.filetype, "XLOG");
        assert_eq!(meta.tarantool.as_deref(), Some("2.6.0-0-g47aa4e01e"));
        assert_eq!(meta.vclock, vec![(1, 60)]);
        assert_eq!(meta.prev_vclock, Some(vec![(1, 59)]));
        assert_eq!(parse_meta(&head[..20]).unwrap(), None, "cut before its end");
        assert!(parse_meta(b"SLUICE-XLOG\n1\n\n").is_err());
        assert!(parse_meta(b"XLOG\n0.11\n\n").is_err());
        assert_eq!(parse_vclock("{}").unwrap(), vec![]);
        assert_eq!(parse_vclock("{1: 3, 2: 9}").unwrap(), vec![(1, 3), (2, 9)]);
        assert!(parse_vclock("{40: 1}").is_err());
    }

    #[test]
    fn a_fixed_header_as_tarantool_writes_it() {
        // magic, len 122, crc32p 0, crc32c ce 890a1a1f, padding fixstr of 7 zero bytes
        let bytes: [u8; 19] = [
            0xd5, 0xba, 0x0b, 0xab, 0x7a, 0x00, 0xce, 0x89, 0x0a, 0x1a, 0x1f, 0xa7, 0, 0, 0, 0, 0,
            0, 0,
        ];
        assert_eq!(
            decode_fixheader(&bytes).unwrap(),
            FixHeader {
                compressed: false,
                len: 122,
                crc32c: 0x890a_1a1f
            }
        );
        let mut z = bytes;
        z[3] = 0xba;
        assert!(decode_fixheader(&z).unwrap().compressed);
        let mut bad = bytes;
        bad[4] = 0xc1;
        assert!(decode_fixheader(&bad).is_err());
        assert_eq!(marker([0xd5, 0x10, 0xad, 0xed]), Marker::Eof);
    }
}
