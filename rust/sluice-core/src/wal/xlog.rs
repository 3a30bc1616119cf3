//! The file format shared by WAL segments and snapshots (Tarantool's xlog, simplified):
//!
//! ```text
//! SLUICE-XLOG | SLUICE-SNAP \n  1 \n  Instance: <hex> \n  LSN: <n> \n  CRC32C: <hex of the lines above> \n  \n
//! block*: magic 0xd5ba0bab (u32 BE) | payload length (u32 BE) | crc32c(payload) (u32 BE) | payload
//! EOF marker 0xd510aded (u32 BE), written on a clean close
//! ```
//! A payload is a run of msgpack records (see `record`). The reader tells a torn write from
//! damage, so that recovery can truncate the one and refuse the other; see `XlogReader::anomaly`
//! for the rule and why it holds.

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
/// The unit in which a power loss can leave file contents unwritten (a file-system block).
const PAGE: u64 = 4096;

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
    finish_spliced_block(out, at, &[]);
}

/// Finishes a block whose payload is `out[at + BLOCK_HEADER_LEN..]` with `spliced` values put
/// in: each `(pos, value)` goes before `out[pos]` (positions ascending, within the payload).
/// The values are written from where they are (see `write_spliced_at`), not copied into `out`.
pub fn finish_spliced_block(out: &mut [u8], at: usize, spliced: &[(usize, &[u8])]) {
    let from = at + BLOCK_HEADER_LEN;
    let mut payload_len = out.len() - from;
    let (mut crc, mut done) = (0, from);
    for &(pos, value) in spliced {
        crc = crc32c::crc32c_append(crc32c::crc32c_append(crc, &out[done..pos]), value);
        payload_len += value.len();
        done = pos;
    }
    let crc = crc32c::crc32c_append(crc, &out[done..]);
    out[at..at + 4].copy_from_slice(&BLOCK_MAGIC.to_be_bytes());
    out[at + 4..at + 8].copy_from_slice(&(payload_len as u32).to_be_bytes());
    out[at + 8..at + 12].copy_from_slice(&crc.to_be_bytes());
}

/// Writes `buf` with `spliced` values put in (as `finish_spliced_block` reads them) at
/// `offset` of `file`, in as few `pwritev` calls as the kernel takes.
pub fn write_spliced_at(
    file: &std::fs::File,
    buf: &[u8],
    spliced: &[(usize, &[u8])],
    mut offset: u64,
) -> std::io::Result<()> {
    use std::io::IoSlice;
    use std::os::fd::AsRawFd;
    let mut parts = Vec::with_capacity(2 * spliced.len() + 1);
    let mut done = 0;
    for &(pos, value) in spliced {
        parts.push(IoSlice::new(&buf[done..pos]));
        parts.push(IoSlice::new(value));
        done = pos;
    }
    parts.push(IoSlice::new(&buf[done..]));
    let mut parts = &mut parts[..];
    IoSlice::advance_slices(&mut parts, 0);
    while !parts.is_empty() {
        let n = parts.len().min(1024) as libc::c_int;
        // SAFETY: IoSlice is ABI-compatible with iovec on Unix, and the slices outlive the
        // call; the kernel only reads them.
        let written = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                parts.as_ptr().cast::<libc::iovec>(),
                n,
                offset as libc::off_t,
            )
        };
        if written < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        offset += written as u64;
        IoSlice::advance_slices(&mut parts, written as usize);
    }
    Ok(())
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

/// What kind of anomaly a block shows: a write that may have been cut short, or bytes that no
/// interrupted write of ours leaves behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Anomaly {
    /// The file ends inside the block: a header shorter than 12 bytes that begins like one, or
    /// a declared length running past the end of the file.
    EndsInside,
    /// A complete header with a wrong magic or impossible length, or a complete block whose
    /// checksum fails.
    Mismatch,
}

pub struct XlogReader {
    path: PathBuf,
    /// The file was closed cleanly: its name has lost `.inprogress` (the writer renames only
    /// after the EOF marker is written and synced) or it ends with the EOF marker.
    closed: Option<bool>,
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
        let header = parse_header(&head).map_err(|why| corrupt(path, 0, why.to_string()))?;
        let offset = head.len() as u64;
        Ok(XlogReader {
            path: path.to_path_buf(),
            closed: None,
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

    pub fn file_len(&self) -> u64 {
        self.file_len
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
        let path = self.path.clone();
        let io_err = |e| crate::Error::io(path.display(), e);
        if remaining == 0 {
            // A file renamed from `.inprogress` had its EOF marker: without it, it lost its end.
            if self.closed_cleanly().map_err(io_err)? {
                return Ok(Next::Corrupt {
                    offset: at,
                    reason: "the file ends without its EOF marker, but it was closed cleanly"
                        .into(),
                });
            }
            return Ok(Next::End { offset: at });
        }
        let got = self
            .read_exact_or_short(BLOCK_HEADER_LEN.min(remaining as usize))
            .map_err(io_err)?;
        let head = &self.buf[..got];
        if got >= 4 && u32::from_be_bytes(head[..4].try_into().expect("4 bytes")) == EOF_MARKER {
            // Nothing is ever written after the marker: bytes there are damage.
            if remaining > 4 {
                return Ok(Next::Corrupt {
                    offset: at,
                    reason: format!("{} bytes after the EOF marker", remaining - 4),
                });
            }
            return Ok(Next::Eof { offset: at });
        }
        if got < BLOCK_HEADER_LEN {
            // A prefix of a block header (or of the EOF marker) starts like one; a lost page
            // reads as zeros. Anything else is not the start of a block.
            let n = got.min(4);
            let starts_like = |word: u32| head[..n] == word.to_be_bytes()[..n];
            let kind = if starts_like(BLOCK_MAGIC)
                || starts_like(EOF_MARKER)
                || head.iter().all(|&b| b == 0)
            {
                Anomaly::EndsInside
            } else {
                Anomaly::Mismatch
            };
            return self
                .anomaly(at, format!("short block header ({got} bytes)"), kind)
                .map_err(io_err);
        }
        let head: [u8; BLOCK_HEADER_LEN] = head.try_into().expect("12 bytes");
        let magic = u32::from_be_bytes(head[0..4].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_be_bytes(head[8..12].try_into().expect("4 bytes"));
        if magic != BLOCK_MAGIC {
            return self
                .anomaly(
                    at,
                    format!("bad block magic 0x{magic:08x}"),
                    Anomaly::Mismatch,
                )
                .map_err(io_err);
        }
        if len > MAX_BLOCK_LEN {
            return self
                .anomaly(
                    at,
                    format!("block length {len} exceeds {MAX_BLOCK_LEN}"),
                    Anomaly::Mismatch,
                )
                .map_err(io_err);
        }
        let body_remaining = remaining - BLOCK_HEADER_LEN as u64;
        if (len as u64) > body_remaining {
            return self
                .anomaly(
                    at,
                    format!("short block: {len} bytes declared, {body_remaining} present"),
                    Anomaly::EndsInside,
                )
                .map_err(io_err);
        }
        let got = self.read_exact_or_short(len).map_err(io_err)?;
        if got < len {
            return self
                .anomaly(at, "file shrank while reading".into(), Anomaly::EndsInside)
                .map_err(io_err);
        }
        let end = at + (BLOCK_HEADER_LEN + len) as u64;
        if crc32c::crc32c(&self.buf) != crc {
            return self
                .anomaly(at, "block checksum mismatch".into(), Anomaly::Mismatch)
                .map_err(io_err);
        }
        self.offset = end;
        Ok(Next::Block {
            offset: at,
            payload: &self.buf,
        })
    }

    /// Classifies something wrong at `at` as a torn write (`Torn`: recovery may cut it off) or
    /// damage (`Corrupt`: recovery stops unless forced). The rule:
    ///
    /// - A file that was closed cleanly has no torn write: whatever is wrong in it is damage.
    ///   The writer appends only to `.inprogress` files and renames one only after its EOF
    ///   marker is written and synced, so a name without `.inprogress`, or an EOF marker at the
    ///   end, means the file was complete once.
    /// - Anything with a valid block after it is damage: a write that was cut short is the last.
    /// - What remains is at the end of a file that was being written. Blocks are appended with
    ///   `pwrite` in whole batches. A process killed mid-write leaves a prefix of the write, and
    ///   a prefix ends *inside* a block: a short header, or a declared length running past the
    ///   end of the file. That is a torn write.
    /// - A power loss can also leave pages the file size covers but the data never reached:
    ///   they read as zeros, from a page boundary (or from where the file ended before) to the
    ///   end. Such a zero tail is a torn write too; it only touches data not yet synced, which no
    ///   `persist` or `fsync` acknowledgement covered.
    /// - A complete block whose checksum fails, or a bad magic followed by anything but such
    ///   zeros, is damage even at the very end: no interrupted write of ours leaves one. (Losing
    ///   a middle page of an un-synced write to a power loss could; recovery then refuses,
    ///   naming the block, and `--force-recovery` keeps every intact record.)
    fn anomaly(&mut self, at: u64, reason: String, kind: Anomaly) -> io::Result<Next<'static>> {
        if self.closed_cleanly()? {
            return Ok(Next::Corrupt {
                offset: at,
                reason: format!("{reason}, in a file that was closed cleanly"),
            });
        }
        if let Some(next) = self.valid_block_after(at + 1)? {
            return Ok(Next::Corrupt {
                offset: at,
                reason: format!("{reason}, and a valid block follows at {next}"),
            });
        }
        if kind == Anomaly::EndsInside {
            return Ok(Next::Torn { offset: at, reason });
        }
        if let Some(zeros) = self.lost_pages_from(at)? {
            return Ok(Next::Torn {
                offset: at,
                reason: format!(
                    "{reason}; zeros from byte {zeros} to the end (pages never written)"
                ),
            });
        }
        Ok(Next::Corrupt {
            offset: at,
            reason: format!("{reason} at the end of the file, which no interrupted write leaves"),
        })
    }

    /// Whether the file was closed cleanly (see `anomaly`); looked up once, when first needed.
    fn closed_cleanly(&mut self) -> io::Result<bool> {
        if let Some(c) = self.closed {
            return Ok(c);
        }
        let renamed = !self
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".inprogress"));
        let c = renamed || self.ends_with_eof_marker()?;
        self.closed = Some(c);
        Ok(c)
    }

    /// Where the file's tail of zeros begins, if it covers what a power loss leaves unwritten:
    /// everything from the block at `at`, or from a page boundary at or after it, to the end.
    fn lost_pages_from(&self, at: u64) -> io::Result<Option<u64>> {
        let len = (self.file_len - at) as usize;
        let mut rest = vec![0u8; len];
        self.r.get_ref().read_exact_at(&mut rest, at)?;
        let nonzero = rest
            .iter()
            .rposition(|&b| b != 0)
            .map(|i| at + i as u64 + 1);
        let zeros_from = match nonzero {
            None => at,
            Some(end) => end.div_ceil(PAGE) * PAGE,
        };
        Ok((zeros_from < self.file_len).then_some(zeros_from))
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

/// Why a file's header is unusable: the reason of the `Corrupt` error that names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum HeaderError {
    #[error("header is not UTF-8")]
    NotUtf8,
    /// The first line, if any.
    #[error("unknown file type {0:?}")]
    FileType(Option<String>),
    /// The second line, if any.
    #[error("unsupported format version {0:?}")]
    Version(Option<String>),
    #[error("bad LSN {0:?}")]
    Lsn(String),
    #[error("bad header checksum {0:?}")]
    Checksum(String),
    /// `field`: "CRC32C", "Instance" or "LSN".
    #[error("header has no {0} line")]
    Missing(&'static str),
    #[error("header checksum mismatch")]
    ChecksumMismatch,
}

fn parse_header(head: &[u8]) -> Result<FileHeader, HeaderError> {
    let text = std::str::from_utf8(head).map_err(|_| HeaderError::NotUtf8)?;
    let mut lines = text.lines();
    let kind = match lines.next() {
        Some("SLUICE-XLOG") => FileKind::Xlog,
        Some("SLUICE-SNAP") => FileKind::Snap,
        other => return Err(HeaderError::FileType(other.map(str::to_string))),
    };
    match lines.next() {
        Some(FORMAT_VERSION) => {}
        other => return Err(HeaderError::Version(other.map(str::to_string))),
    }
    let mut instance = None;
    let mut lsn = None;
    let mut crc = None;
    for line in lines {
        if let Some(v) = line.strip_prefix("Instance: ") {
            instance = Some(v.to_string());
        } else if let Some(v) = line.strip_prefix("LSN: ") {
            lsn = Some(
                v.parse::<u64>()
                    .map_err(|_| HeaderError::Lsn(v.to_string()))?,
            );
        } else if let Some(v) = line.strip_prefix("CRC32C: ") {
            crc =
                Some(u32::from_str_radix(v, 16).map_err(|_| HeaderError::Checksum(v.to_string()))?);
        }
    }
    let covered = text
        .find("CRC32C: ")
        .ok_or(HeaderError::Missing("CRC32C"))?;
    if crc32c::crc32c(&head[..covered]) != crc.ok_or(HeaderError::Missing("CRC32C"))? {
        return Err(HeaderError::ChecksumMismatch);
    }
    Ok(FileHeader {
        kind,
        instance: instance.ok_or(HeaderError::Missing("Instance"))?,
        lsn: lsn.ok_or(HeaderError::Missing("LSN"))?,
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

    #[test]
    fn header_errors_say_what_is_wrong() {
        let header = |instance: &str, lsn: &str| {
            let lines = format!("SLUICE-XLOG\n1\nInstance: {instance}\nLSN: {lsn}\n");
            let crc = crc32c::crc32c(lines.as_bytes());
            format!("{lines}CRC32C: {crc:08x}\n\n").into_bytes()
        };
        let why = |head: &[u8]| parse_header(head).unwrap_err().to_string();
        assert_eq!(parse_header(&header("abc", "7")).unwrap().lsn, 7);
        assert_eq!(why(b"\xff\n\n"), "header is not UTF-8");
        assert_eq!(
            why(b"SLUICE-LOG\n\n"),
            "unknown file type Some(\"SLUICE-LOG\")"
        );
        assert_eq!(why(b""), "unknown file type None");
        assert_eq!(
            why(b"SLUICE-SNAP\n2\n\n"),
            "unsupported format version Some(\"2\")"
        );
        assert_eq!(why(b"SLUICE-SNAP\n"), "unsupported format version None");
        assert_eq!(why(&header("abc", "x1")), "bad LSN \"x1\"");
        assert_eq!(
            why(b"SLUICE-XLOG\n1\nCRC32C: zz\n\n"),
            "bad header checksum \"zz\""
        );
        assert_eq!(
            why(b"SLUICE-XLOG\n1\nLSN: 1\n\n"),
            "header has no CRC32C line"
        );
        let mut tampered = header("abc", "7");
        tampered[20] = b'x';
        assert_eq!(why(&tampered), "header checksum mismatch");
        let no_instance = b"SLUICE-XLOG\n1\nLSN: 1\n";
        let crc = crc32c::crc32c(no_instance);
        let mut head = no_instance.to_vec();
        head.extend_from_slice(format!("CRC32C: {crc:08x}\n\n").as_bytes());
        assert_eq!(why(&head), "header has no Instance line");
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

    fn end_of(path: &Path) -> String {
        collect(path).1
    }

    fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
        let mut bytes = std::fs::read(path).unwrap();
        f(&mut bytes);
        std::fs::write(path, &bytes).unwrap();
    }

    #[test]
    fn torn_write_versus_damage_in_a_file_being_written() {
        let d = tempfile::tempdir().unwrap();
        // Still being written (or the process died): `.inprogress`, no EOF marker.
        let p = d.path().join("a.xlog.inprogress");
        let offs = write_file(&p, &[b"one", b"two"], false);
        // cut inside the second block: a prefix of a write, torn
        edit(&p, |b| b.truncate(b.len() - 1));
        let (blocks, end) = collect(&p);
        assert_eq!(blocks.len(), 1);
        assert_eq!(
            end,
            format!(
                "Torn {{ offset: {}, reason: \"short block: 3 bytes declared, 2 present\" }}",
                offs[1]
            )
        );
        // a few bytes of the next block's header: torn
        write_file(&p, &[b"one", b"two"], false);
        edit(&p, |b| b.extend_from_slice(&BLOCK_MAGIC.to_be_bytes()[..3]));
        assert!(end_of(&p).starts_with("Torn"), "{}", end_of(&p));
        // a short tail that is not the start of a block: damage
        write_file(&p, &[b"one", b"two"], false);
        edit(&p, |b| b.extend_from_slice(b"garbage"));
        assert!(end_of(&p).starts_with("Corrupt"), "{}", end_of(&p));
        // a flipped byte in the first block: damage, since another block follows
        write_file(&p, &[b"one", b"two"], false);
        edit(&p, |b| b[offs[0] as usize + BLOCK_HEADER_LEN] ^= 0x40);
        let end = end_of(&p);
        assert!(
            end.starts_with(&format!("Corrupt {{ offset: {}", offs[0])),
            "{end}"
        );
        // the same flip in the last block: a complete block with a bad checksum is damage too,
        // no interrupted write leaves one
        write_file(&p, &[b"one", b"two"], false);
        edit(&p, |b| b[offs[1] as usize + BLOCK_HEADER_LEN] ^= 0x40);
        let end = end_of(&p);
        assert!(
            end.starts_with(&format!("Corrupt {{ offset: {}", offs[1])),
            "{end}"
        );
    }

    #[test]
    fn a_zero_tail_is_torn_only_where_a_power_loss_can_leave_one() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.xlog.inprogress");
        let big = vec![7u8; 3 * PAGE as usize];
        // zeros from a block boundary to the end (the file size reached the disk, its data not)
        let offs = write_file(&p, &[b"one", &big], false);
        edit(&p, |b| b.extend_from_slice(&[0u8; 8192]));
        let end = end_of(&p);
        assert!(end.starts_with("Torn"), "{end}");
        // the last block's pages zeroed from a page boundary on
        write_file(&p, &[b"one", &big], false);
        edit(&p, |b| {
            let from = (offs[1] as usize).div_ceil(PAGE as usize) * PAGE as usize + 1;
            let from = from.div_ceil(PAGE as usize) * PAGE as usize;
            b[from..].fill(0);
        });
        let end = end_of(&p);
        assert!(
            end.starts_with(&format!("Torn {{ offset: {}", offs[1])),
            "{end}"
        );
        // zeros that stop short of the end are no lost page: damage
        write_file(&p, &[b"one", &big], false);
        edit(&p, |b| {
            let n = b.len();
            b[n - 200..n - 100].fill(0)
        });
        assert!(end_of(&p).starts_with("Corrupt"), "{}", end_of(&p));
    }

    #[test]
    fn any_damage_in_a_cleanly_closed_file_is_reported() {
        let d = tempfile::tempdir().unwrap();
        let big = vec![7u8; 3 * PAGE as usize];
        for (name, eof) in [
            ("a.xlog", true),
            ("b.xlog.inprogress", true),
            ("c.xlog", false),
        ] {
            let p = d.path().join(name);
            let offs = write_file(&p, &[b"one", &big], eof);
            let clean = std::fs::read(&p).unwrap();
            let n = clean.len();
            let last = offs[1];
            for what in [
                "last 16 bytes flipped",
                "last 4 KiB zeroed",
                "cut inside the last block",
                "zeros appended",
            ] {
                let mut bytes = clean.clone();
                match what {
                    "last 16 bytes flipped" => bytes[n - 16..].iter_mut().for_each(|x| *x ^= 0xff),
                    "last 4 KiB zeroed" => bytes[n - 4096..].fill(0),
                    "cut inside the last block" => bytes.truncate(n - 100),
                    _ => bytes.extend_from_slice(&[0; 4096]),
                }
                std::fs::write(&p, &bytes).unwrap();
                let end = end_of(&p);
                // `b` keeps its EOF marker only where the damage leaves it; `c` ends at the
                // last block (an `.xlog` without its marker).
                let at = match (what, eof) {
                    ("zeros appended", true) => n as u64 - 4,
                    ("zeros appended", false) => n as u64,
                    _ => last,
                };
                assert!(
                    end.starts_with(&format!("Corrupt {{ offset: {at}"))
                        || (name != "a.xlog" && end.starts_with("Torn")),
                    "{name}, {what}: {end}"
                );
                if name == "a.xlog" {
                    let why = if what == "zeros appended" {
                        "after the EOF marker"
                    } else {
                        "closed cleanly"
                    };
                    assert!(end.contains(why), "{what}: {end}");
                }
            }
            // An `.xlog` cut exactly at a block boundary lost its EOF marker: damage.
            std::fs::write(&p, &clean[..if eof { n - 4 } else { n }]).unwrap();
            let end = end_of(&p);
            if name.ends_with(".inprogress") {
                assert!(end.starts_with("End"), "{name}: {end}");
            } else {
                assert!(end.starts_with("Corrupt"), "{name}: {end}");
            }
        }
    }
}
