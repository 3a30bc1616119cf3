//! The file format shared by WAL segments and snapshots (Tarantool's xlog, simplified):
//!
//! ```text
//! SLUICE-XLOG | SLUICE-SNAP \n  1 \n  Instance: <hex> \n  LSN: <n> \n  CRC32C: <hex of the lines above> \n  \n
//! block*: magic 0xd5ba0bab (u32 BE) | payload length (u32 BE) | crc32c(payload) (u32 BE) | payload
//! EOF marker 0xd510aded (u32 BE), written on a clean close
//! ```
//! A payload is a run of msgpack records (see `record`). The reader tells a torn tail (a short
//! block, or a checksum mismatch in a block that runs to the end of the file) from damage
//! elsewhere, so that recovery can truncate the one and refuse the other. A block that looks
//! short is only a torn tail if no valid block follows it: a damaged length field in the middle
//! of a file must not pass for the end of the file.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const BLOCK_MAGIC: u32 = 0xd5ba_0bab;
pub const EOF_MARKER: u32 = 0xd510_aded;
pub const BLOCK_HEADER_LEN: usize = 12;
/// Larger than any block sluice writes (items are capped well below this).
pub const MAX_BLOCK_LEN: usize = 256 << 20;
const MAX_HEADER_LEN: usize = 4096;
/// The reason recovery recognises as a segment cut short while its header was being written.
pub const HEADER_TRUNCATED: &str = "file ends inside its header";
pub const FORMAT_VERSION: &str = "1";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Xlog,
    Snap,
}

impl FileKind {
    fn magic_line(self) -> &'static str {
        match self {
            FileKind::Xlog => "SLUICE-XLOG",
            FileKind::Snap => "SLUICE-SNAP",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileHeader {
    pub kind: FileKind,
    pub instance: String,
    /// WAL: the first LSN the segment holds. Snapshot: every LSN up to this one is included.
    pub lsn: u64,
}

impl FileHeader {
    pub fn encode(&self, out: &mut Vec<u8>) {
        let lines = format!(
            "{}\n{}\nInstance: {}\nLSN: {}\n",
            self.kind.magic_line(),
            FORMAT_VERSION,
            self.instance,
            self.lsn
        );
        let crc = crc32c::crc32c(lines.as_bytes());
        out.extend_from_slice(lines.as_bytes());
        out.extend_from_slice(format!("CRC32C: {crc:08x}\n\n").as_bytes());
    }
}

/// Starts a block in `out`; fill the payload after it, then call `finish_block`.
pub fn begin_block(out: &mut Vec<u8>) -> usize {
    let at = out.len();
    out.extend_from_slice(&[0u8; BLOCK_HEADER_LEN]);
    at
}

pub fn finish_block(out: &mut [u8], at: usize) {
    let payload_len = out.len() - at - BLOCK_HEADER_LEN;
    let crc = crc32c::crc32c(&out[at + BLOCK_HEADER_LEN..]);
    out[at..at + 4].copy_from_slice(&BLOCK_MAGIC.to_be_bytes());
    out[at + 4..at + 8].copy_from_slice(&(payload_len as u32).to_be_bytes());
    out[at + 8..at + 12].copy_from_slice(&crc.to_be_bytes());
}

/// What the reader found at the current offset.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<'a> {
    Block {
        offset: u64,
        payload: &'a [u8],
    },
    /// The EOF marker: the file was closed cleanly.
    Eof {
        offset: u64,
    },
    /// The file ends at a block boundary without the EOF marker (still open, or a crash).
    End {
        offset: u64,
    },
    /// An incomplete last write: everything from `offset` on is a torn tail.
    Torn {
        offset: u64,
        reason: String,
    },
    /// Damage that is not a torn tail.
    Corrupt {
        offset: u64,
        reason: String,
    },
}

pub struct XlogReader {
    path: PathBuf,
    r: BufReader<File>,
    file_len: u64,
    offset: u64,
    header: FileHeader,
    buf: Vec<u8>,
}

fn corrupt(path: &Path, offset: u64, reason: impl Into<String>) -> crate::Error {
    crate::Error::Corrupt {
        file: path.to_path_buf(),
        offset,
        reason: reason.into(),
    }
}

impl XlogReader {
    pub fn open(path: &Path) -> crate::Result<XlogReader> {
        let f = File::open(path).map_err(|e| crate::Error::io(path.display(), e))?;
        let file_len = f
            .metadata()
            .map_err(|e| crate::Error::io(path.display(), e))?
            .len();
        let mut r = BufReader::with_capacity(1 << 20, f);
        let mut head = Vec::new();
        // The header ends with an empty line; read byte-wise through the buffer.
        loop {
            let mut b = [0u8; 1];
            match r.read(&mut b) {
                Ok(0) => return Err(corrupt(path, head.len() as u64, HEADER_TRUNCATED)),
                Ok(_) => head.push(b[0]),
                Err(e) => return Err(crate::Error::io(path.display(), e)),
            }
            if head.ends_with(b"\n\n") {
                break;
            }
            if head.len() > MAX_HEADER_LEN {
                return Err(corrupt(path, 0, "header longer than 4096 bytes"));
            }
        }
        let header = parse_header(&head).map_err(|why| corrupt(path, 0, why))?;
        let offset = head.len() as u64;
        Ok(XlogReader {
            path: path.to_path_buf(),
            r,
            file_len,
            offset,
            header,
            buf: Vec::new(),
        })
    }

    pub fn header(&self) -> &FileHeader {
        &self.header
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    fn read_exact_or_short(&mut self, n: usize) -> io::Result<usize> {
        self.buf.clear();
        self.buf.resize(n, 0);
        let mut got = 0;
        while got < n {
            match self.r.read(&mut self.buf[got..]) {
                Ok(0) => break,
                Ok(k) => got += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(got)
    }

    pub fn next_block(&mut self) -> crate::Result<Next<'_>> {
        let at = self.offset;
        let remaining = self.file_len.saturating_sub(at);
        if remaining == 0 {
            return Ok(Next::End { offset: at });
        }
        let path = self.path.clone();
        let io_err = |e| crate::Error::io(path.display(), e);
        let got = self
            .read_exact_or_short(BLOCK_HEADER_LEN.min(remaining as usize))
            .map_err(io_err)?;
        let head = &self.buf[..got];
        if got >= 4 && u32::from_be_bytes(head[..4].try_into().expect("4 bytes")) == EOF_MARKER {
            return Ok(Next::Eof { offset: at });
        }
        if got < BLOCK_HEADER_LEN {
            return self
                .anomaly(at, format!("short block header ({got} bytes)"))
                .map_err(io_err);
        }
        let head: [u8; BLOCK_HEADER_LEN] = head.try_into().expect("12 bytes");
        let magic = u32::from_be_bytes(head[0..4].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_be_bytes(head[8..12].try_into().expect("4 bytes"));
        if magic != BLOCK_MAGIC {
            return self
                .anomaly(at, format!("bad block magic 0x{magic:08x}"))
                .map_err(io_err);
        }
        if len > MAX_BLOCK_LEN {
            return self
                .anomaly(at, format!("block length {len} exceeds {MAX_BLOCK_LEN}"))
                .map_err(io_err);
        }
        let body_remaining = remaining - BLOCK_HEADER_LEN as u64;
        if (len as u64) > body_remaining {
            return self
                .anomaly(
                    at,
                    format!("short block: {len} bytes declared, {body_remaining} present"),
                )
                .map_err(io_err);
        }
        let got = self.read_exact_or_short(len).map_err(io_err)?;
        if got < len {
            return self
                .anomaly(at, "file shrank while reading".into())
                .map_err(io_err);
        }
        let end = at + (BLOCK_HEADER_LEN + len) as u64;
        if crc32c::crc32c(&self.buf) != crc {
            return self
                .anomaly(at, "block checksum mismatch".into())
                .map_err(io_err);
        }
        self.offset = end;
        Ok(Next::Block {
            offset: at,
            payload: &self.buf,
        })
    }

    /// Classifies something wrong at `at`. It is a torn tail (an incomplete last write) only
    /// when the file was not closed cleanly (no EOF marker at its end) and no valid block
    /// follows; anything else is damage. This one rule covers short blocks, checksum
    /// mismatches and the zero-filled or garbage pages a power loss can leave.
    fn anomaly(&self, at: u64, reason: String) -> io::Result<Next<'static>> {
        if self.ends_with_eof_marker()? {
            return Ok(Next::Corrupt {
                offset: at,
                reason: format!("{reason}, in a file that was closed cleanly"),
            });
        }
        Ok(match self.valid_block_after(at + 1)? {
            Some(next) => Next::Corrupt {
                offset: at,
                reason: format!("{reason}, and a valid block follows at {next}"),
            },
            None => Next::Torn { offset: at, reason },
        })
    }

    fn ends_with_eof_marker(&self) -> io::Result<bool> {
        if self.file_len < 4 {
            return Ok(false);
        }
        let mut tail = [0u8; 4];
        self.r
            .get_ref()
            .read_exact_at(&mut tail, self.file_len - 4)?;
        Ok(u32::from_be_bytes(tail) == EOF_MARKER)
    }

    /// Moves to the first valid block after the damage at `offset`; false if there is none.
    /// Only force recovery uses this, to keep what follows a damaged block.
    pub fn resync_after(&mut self, offset: u64) -> io::Result<bool> {
        use std::io::{Seek, SeekFrom};
        match self.valid_block_after(offset + 1)? {
            Some(at) => {
                self.r.seek(SeekFrom::Start(at))?;
                self.offset = at;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Scans the file from `from` for a block whose magic, length and checksum are all valid.
    /// Only runs when something looks torn, so its cost never touches a healthy file.
    fn valid_block_after(&self, from: u64) -> io::Result<Option<u64>> {
        use std::io::{Seek, SeekFrom};
        let mut f = self.r.get_ref().try_clone()?;
        f.seek(SeekFrom::Start(from))?;
        let mut rest = Vec::new();
        f.read_to_end(&mut rest)?;
        let magic = BLOCK_MAGIC.to_be_bytes();
        let mut i = 0;
        while i + BLOCK_HEADER_LEN <= rest.len() {
            if rest[i..i + 4] == magic {
                let len =
                    u32::from_be_bytes(rest[i + 4..i + 8].try_into().expect("4 bytes")) as usize;
                let crc = u32::from_be_bytes(rest[i + 8..i + 12].try_into().expect("4 bytes"));
                let body = i + BLOCK_HEADER_LEN;
                if len <= MAX_BLOCK_LEN
                    && body + len <= rest.len()
                    && crc32c::crc32c(&rest[body..body + len]) == crc
                {
                    return Ok(Some(from + i as u64));
                }
            }
            i += 1;
        }
        Ok(None)
    }
}

fn parse_header(head: &[u8]) -> Result<FileHeader, String> {
    let text = std::str::from_utf8(head).map_err(|_| "header is not UTF-8".to_string())?;
    let mut lines = text.lines();
    let kind = match lines.next() {
        Some("SLUICE-XLOG") => FileKind::Xlog,
        Some("SLUICE-SNAP") => FileKind::Snap,
        other => return Err(format!("unknown file type {other:?}")),
    };
    match lines.next() {
        Some(FORMAT_VERSION) => {}
        other => return Err(format!("unsupported format version {other:?}")),
    }
    let mut instance = None;
    let mut lsn = None;
    let mut crc = None;
    for line in lines {
        if let Some(v) = line.strip_prefix("Instance: ") {
            instance = Some(v.to_string());
        } else if let Some(v) = line.strip_prefix("LSN: ") {
            lsn = Some(v.parse::<u64>().map_err(|_| format!("bad LSN {v:?}"))?);
        } else if let Some(v) = line.strip_prefix("CRC32C: ") {
            crc =
                Some(u32::from_str_radix(v, 16).map_err(|_| format!("bad header checksum {v:?}"))?);
        }
    }
    let covered = text.find("CRC32C: ").ok_or("header has no CRC32C line")?;
    if crc32c::crc32c(&head[..covered]) != crc.ok_or("header has no CRC32C line")? {
        return Err("header checksum mismatch".into());
    }
    Ok(FileHeader {
        kind,
        instance: instance.ok_or("header has no Instance line")?,
        lsn: lsn.ok_or("header has no LSN line")?,
    })
}

/// `wal/00000000000000000042.xlog` style names: the LSN zero-padded to 20 digits.
pub fn file_name(lsn: u64, ext: &str) -> String {
    format!("{lsn:020}.{ext}")
}

/// Files in `dir` named `<lsn>.<ext>` (optionally `.inprogress`), sorted by LSN.
pub fn list_files(dir: &Path, ext: &str) -> crate::Result<Vec<(u64, PathBuf, bool)>> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(crate::Error::io(dir.display(), e)),
    };
    for entry in rd {
        let entry = entry.map_err(|e| crate::Error::io(dir.display(), e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let (stem, inprogress) = match name.strip_suffix(".inprogress") {
            Some(s) => (s, true),
            None => (name, false),
        };
        let Some(lsn) = stem.strip_suffix(&format!(".{ext}")) else {
            continue;
        };
        if lsn.len() != 20 {
            continue;
        }
        if let Ok(lsn) = lsn.parse::<u64>() {
            out.push((lsn, entry.path(), inprogress));
        }
    }
    out.sort();
    Ok(out)
}

/// fsync a directory so that a create or rename in it survives a crash.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_file(path: &Path, blocks: &[&[u8]], eof: bool) -> Vec<u64> {
        let mut out = Vec::new();
        FileHeader {
            kind: FileKind::Xlog,
            instance: "abc".into(),
            lsn: 1,
        }
        .encode(&mut out);
        let mut offsets = Vec::new();
        for b in blocks {
            offsets.push(out.len() as u64);
            let at = begin_block(&mut out);
            out.extend_from_slice(b);
            finish_block(&mut out, at);
        }
        if eof {
            out.extend_from_slice(&EOF_MARKER.to_be_bytes());
        }
        File::create(path).unwrap().write_all(&out).unwrap();
        offsets
    }

    fn collect(path: &Path) -> (Vec<Vec<u8>>, String) {
        let mut r = XlogReader::open(path).unwrap();
        let mut blocks = Vec::new();
        loop {
            match r.next_block().unwrap() {
                Next::Block { payload, .. } => blocks.push(payload.to_vec()),
                other => return (blocks, format!("{other:?}")),
            }
        }
    }

    #[test]
    fn clean_file_reads_back_with_eof() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.xlog");
        write_file(&p, &[b"one", b"two"], true);
        let (blocks, end) = collect(&p);
        assert_eq!(blocks, vec![b"one".to_vec(), b"two".to_vec()]);
        assert!(end.starts_with("Eof"));
    }

    #[test]
    fn torn_tail_versus_damage_in_the_middle() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.xlog");
        let offs = write_file(&p, &[b"one", b"two"], false);
        // cut inside the second block: torn
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(len - 1)
            .unwrap();
        let (blocks, end) = collect(&p);
        assert_eq!(blocks.len(), 1);
        assert_eq!(
            end,
            format!(
                "Torn {{ offset: {}, reason: \"short block: 3 bytes declared, 2 present\" }}",
                offs[1]
            )
        );
        // flip a byte in the first block's payload: damage, since another block follows
        write_file(&p, &[b"one", b"two"], false);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[offs[0] as usize + BLOCK_HEADER_LEN] ^= 0x40;
        std::fs::write(&p, &bytes).unwrap();
        let (_, end) = collect(&p);
        assert!(
            end.starts_with(&format!("Corrupt {{ offset: {}", offs[0])),
            "{end}"
        );
        // the same flip in the last block is a torn tail
        write_file(&p, &[b"one", b"two"], false);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[offs[1] as usize + BLOCK_HEADER_LEN] ^= 0x40;
        std::fs::write(&p, &bytes).unwrap();
        let (_, end) = collect(&p);
        assert!(
            end.starts_with(&format!("Torn {{ offset: {}", offs[1])),
            "{end}"
        );
    }
}
