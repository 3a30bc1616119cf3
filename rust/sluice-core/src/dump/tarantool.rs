//! Tarantool's own `.xlog` and `.snap` files as JSON lines: the meta block, every row as
//! Tarantool's `xlog` Lua module shows it (`sluice_proto::iproto::xrow`), then how the file
//! ends. Blocks are read one at a time, their CRC checked and zstd-compressed ones
//! decompressed; a block cut short at the end of the file is a torn tail, a CRC that does not
//! match is damage, each reported with its offset after everything readable before it.

use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::Path;

use sluice_proto::iproto::xlog::{self, FixHeader, Marker, FIXHEADER_SIZE, MAX_META};
use sluice_proto::iproto::xrow;
use sluice_proto::msgpack::Reader;

use super::DumpError;
use crate::error::Error;

/// The largest block read (stored or decompressed). Tarantool writes blocks of about 128 KiB
/// of rows, a single row being at most its `memtx_max_tuple_size` (1 MiB by default).
const MAX_BLOCK: u64 = 256 << 20;

/// How the file ended, as the last line says it.
enum End {
    Eof,
    NoEofMarker,
    Torn(String),
    Corrupt(String),
}

pub(super) fn dump(path: &Path, out: &mut impl Write) -> Result<u64, DumpError> {
    let io = |e: std::io::Error| DumpError::Input(Error::io(path.display(), e));
    let mut file = std::fs::File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut head = Vec::with_capacity(MAX_META);
    (&mut file)
        .take(MAX_META as u64)
        .read_to_end(&mut head)
        .map_err(io)?;
    let bad_file = |why: String| {
        DumpError::Input(Error::InvalidArgument(format!("{}: {why}", path.display())))
    };
    let (meta, meta_len) = match xlog::parse_meta(&head) {
        Ok(Some(found)) => found,
        Ok(None) => return Err(bad_file("the file ends inside its meta block".into())),
        Err(e) => return Err(bad_file(e.to_string())),
    };
    let vclock = |v: &[(u32, u64)]| -> serde_json::Value {
        v.iter()
            .map(|(id, lsn)| (id.to_string(), serde_json::Value::from(*lsn)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let mut first = serde_json::json!({
        "file": meta.filetype,
        "version": meta.version,
        "tarantool": meta.tarantool,
        "instance": meta.instance,
        "vclock": vclock(&meta.vclock),
    });
    if let Some(prev) = &meta.prev_vclock {
        first["prev_vclock"] = vclock(prev);
    }
    let write = DumpError::Output;
    writeln!(out, "{first}").map_err(write)?;

    file.seek(SeekFrom::Start(meta_len as u64)).map_err(io)?;
    let mut file = BufReader::with_capacity(1 << 20, file);
    let mut offset = meta_len as u64;
    let mut rows = 0u64;
    let mut stored = Vec::new();
    let mut text = String::new();
    let end = loop {
        let mut magic = [0u8; 4];
        let got = read_full(&mut file, &mut magic).map_err(io)?;
        if got == 0 {
            break End::NoEofMarker;
        }
        if got < magic.len() {
            break End::Torn("the file ends inside a block's magic".into());
        }
        match xlog::marker(magic) {
            Marker::Eof => break End::Eof,
            Marker::Other(m) => {
                break End::Corrupt(format!("{m:#010x} is neither a block's magic nor the end"))
            }
            Marker::Block { .. } => {}
        }
        let mut fix = [0u8; FIXHEADER_SIZE];
        fix[..4].copy_from_slice(&magic);
        if read_full(&mut file, &mut fix[4..]).map_err(io)? < FIXHEADER_SIZE - 4 {
            break End::Torn("the file ends inside a block's header".into());
        }
        let header: FixHeader = match xlog::decode_fixheader(&fix) {
            Ok(h) => h,
            Err(e) => break End::Corrupt(e.to_string()),
        };
        let left = file_len.saturating_sub(offset + FIXHEADER_SIZE as u64);
        if header.len > MAX_BLOCK {
            break End::Corrupt(format!(
                "a block of {} bytes, more than any Tarantool writes",
                header.len
            ));
        }
        if header.len > left {
            break End::Torn(format!(
                "a block of {} bytes with {left} left in the file",
                header.len
            ));
        }
        stored.clear();
        stored.resize(header.len as usize, 0);
        file.read_exact(&mut stored).map_err(io)?;
        if tarantool_crc32c(&stored) != header.crc32c {
            break End::Corrupt("the block's CRC does not match its bytes".into());
        }
        let decompressed;
        let block: &[u8] = if header.compressed {
            match decompress(&stored) {
                Ok(b) => {
                    decompressed = b;
                    &decompressed
                }
                Err(why) => break End::Corrupt(why),
            }
        } else {
            &stored
        };
        let mut r = Reader::new(block);
        let mut damaged = None;
        while !r.is_empty() {
            text.clear();
            let row = xrow::decode_row(&mut r).and_then(|row| row.write_json(&mut text));
            if let Err(e) = row {
                damaged = Some(format!("a row of the block is malformed: {e}"));
                break;
            }
            writeln!(out, "{text}").map_err(write)?;
            rows += 1;
        }
        if let Some(why) = damaged {
            break End::Corrupt(why);
        }
        offset += (FIXHEADER_SIZE as u64) + header.len;
    };
    let last = match end {
        End::Eof => serde_json::json!({"end": "eof", "offset": offset}),
        End::NoEofMarker => serde_json::json!({"end": "no-eof-marker", "offset": offset}),
        End::Torn(reason) => serde_json::json!({"end": "torn", "offset": offset, "reason": reason}),
        End::Corrupt(reason) => {
            serde_json::json!({"end": "corrupt", "offset": offset, "reason": reason})
        }
    };
    writeln!(out, "{last}").map_err(write)?;
    Ok(rows)
}

/// Tarantool's block checksum: CRC-32C started from 0 and not inverted at the end (the
/// `crc32c` crate's is the standard one, started from and finished with all ones).
fn tarantool_crc32c(bytes: &[u8]) -> u32 {
    !crc32c::crc32c_append(!0, bytes)
}

/// Reads until `buf` is full or the input ends; how many bytes it read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A compressed block's rows: its zstd frames one after another, at most `MAX_BLOCK` bytes.
fn decompress(stored: &[u8]) -> Result<Vec<u8>, String> {
    let mut input = stored;
    let mut out = Vec::new();
    while !input.is_empty() {
        let decoder = ruzstd::decoding::StreamingDecoder::new(&mut input)
            .map_err(|e| format!("a compressed block is not zstd: {e}"))?;
        let room = MAX_BLOCK + 1 - out.len() as u64;
        decoder
            .take(room)
            .read_to_end(&mut out)
            .map_err(|e| format!("a compressed block does not decompress: {e}"))?;
        if out.len() as u64 > MAX_BLOCK {
            return Err(format!(
                "a compressed block holds more than {MAX_BLOCK} bytes"
            ));
        }
    }
    Ok(out)
}
