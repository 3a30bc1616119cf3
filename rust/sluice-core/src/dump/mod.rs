//! `sluice wal-dump`: the records of a WAL segment or snapshot as JSON lines, sluice's own or
//! Tarantool's (`tarantool`).

mod tarantool;

use std::io::Write;
use std::path::Path;

use sluice_proto::msgpack::Reader;

use crate::error::{Error, Result};
use crate::wal::record;
use crate::wal::xlog::{Next, XlogReader};

/// Writes one JSON object per record, then a final line describing how the file ended.
/// Damage is reported in that line (with its byte offset), not as an error, so that a person
/// can see everything readable before it.
pub fn dump(path: &Path, out: &mut impl Write) -> Result<u64> {
    match dump_all(path, out) {
        // The reader went away (`sluice wal-dump FILE | head`): not an error.
        Err(DumpError::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(DumpError::Output(e)) => Err(Error::io("writing output", e)),
        Err(DumpError::Input(e)) => Err(e),
        Ok(n) => Ok(n),
    }
}

enum DumpError {
    Input(Error),
    Output(std::io::Error),
}

impl From<Error> for DumpError {
    fn from(e: Error) -> Self {
        DumpError::Input(e)
    }
}

/// The first line every sluice WAL segment or snapshot starts with.
const SLUICE_FILE_TYPES: [&str; 2] = ["SLUICE-XLOG", "SLUICE-SNAP"];
/// The first lines of Tarantool's files, whose layout sluice's follows but does not share.
const TARANTOOL_FILE_TYPES: [&str; 5] = ["XLOG", "SNAP", "VYLOG", "RUN", "INDEX"];

/// Whose file it is, by its first line.
enum FileType {
    Sluice,
    Tarantool,
}

/// Tells a sluice WAL segment or snapshot from a Tarantool file by its first line, and refuses
/// anything else naming what it is instead of how its header fails to parse.
fn check_file_type(path: &Path) -> Result<FileType> {
    use std::io::Read;
    let mut head = Vec::with_capacity(64);
    std::fs::File::open(path)
        .and_then(|f| f.take(64).read_to_end(&mut head))
        .map_err(|e| Error::io(path.display(), e))?;
    // A sluice first line, or the start of one (a file cut inside its header, which the
    // reader reports as such).
    let sluice = SLUICE_FILE_TYPES.iter().any(|t| {
        let line = format!("{t}\n");
        line.as_bytes()
            .starts_with(&head[..head.len().min(line.len())])
    });
    if sluice {
        return Ok(FileType::Sluice);
    }
    let first = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let first = String::from_utf8_lossy(first);
    if first == "XLOG" || first == "SNAP" {
        return Ok(FileType::Tarantool);
    }
    let why = if TARANTOOL_FILE_TYPES.contains(&first.as_ref()) {
        format!("a Tarantool {first} file (vinyl's), which sluice does not read")
    } else {
        "not a sluice WAL segment or snapshot (their first line is SLUICE-XLOG or SLUICE-SNAP), \
         nor a Tarantool .xlog or .snap"
            .to_string()
    };
    Err(Error::InvalidArgument(format!(
        "{} is {why}",
        path.display()
    )))
}

fn dump_all(path: &Path, out: &mut impl Write) -> std::result::Result<u64, DumpError> {
    if let FileType::Tarantool = check_file_type(path)? {
        return tarantool::dump(path, out);
    }
    let mut r = XlogReader::open(path)?;
    let io = DumpError::Output;
    let header = r.header().clone();
    let kind = match header.kind {
        crate::wal::xlog::FileKind::Xlog => "xlog",
        crate::wal::xlog::FileKind::Snap => "snap",
    };
    writeln!(
        out,
        "{}",
        serde_json::json!({"file": kind, "instance": header.instance, "lsn": header.lsn})
    )
    .map_err(io)?;
    let mut n = 0;
    loop {
        let end = match r.next_block()? {
            Next::Block { offset, payload } => {
                let mut rd = Reader::new(payload);
                let mut bad = None;
                while !rd.is_empty() {
                    match record::decode(&mut rd) {
                        Ok(rec) => {
                            writeln!(out, "{}", rec.to_json()).map_err(io)?;
                            n += 1;
                        }
                        Err(e) => {
                            bad = Some(
                                serde_json::json!({"end": "corrupt", "offset": offset, "reason": e.to_string()}),
                            );
                            break;
                        }
                    }
                }
                match bad {
                    Some(b) => b,
                    None => continue,
                }
            }
            Next::Eof { offset } => serde_json::json!({"end": "eof", "offset": offset}),
            Next::End { offset } => serde_json::json!({"end": "no-eof-marker", "offset": offset}),
            Next::Torn { offset, reason } => {
                serde_json::json!({"end": "torn", "offset": offset, "reason": reason})
            }
            Next::Corrupt { offset, reason } => {
                serde_json::json!({"end": "corrupt", "offset": offset, "reason": reason})
            }
        };
        writeln!(out, "{end}").map_err(io)?;
        return Ok(n);
    }
}
