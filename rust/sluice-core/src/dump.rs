//! `sluice wal-dump`: the records of a WAL segment or snapshot as JSON lines.

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

fn dump_all(path: &Path, out: &mut impl Write) -> std::result::Result<u64, DumpError> {
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
