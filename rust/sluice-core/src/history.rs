//! A vbucket's past: its items as they stood at an earlier seqno, rebuilt from this node's own
//! snapshot and WAL files, for a rollback that keeps what the node still shares with its new
//! active. The base is the newest snapshot that holds the vbucket at or below that seqno (or
//! nothing, when the WAL reaches back to its first LSN); the WAL after it adds the vbucket's
//! changes up to the seqno. When the files cannot say (no such base, a gap in the WAL, an
//! earlier rollback in between, damage), the answer is None and the caller re-streams the
//! vbucket whole.

use std::path::Path;

use sluice_proto::msgpack::Reader;

use crate::checkpoint::CheckpointConfig;
use crate::error::Result;
use crate::vbucket::{VBucket, VbState};
use crate::wal::record::{self, Record, RecordBody};
use crate::wal::xlog::{self, Next, XlogReader};

/// What a file says about one vbucket, record by record.
enum Step {
    Go,
    /// The file cannot serve as (part of) the history asked for.
    Unusable,
    /// Everything this file holds for the vbucket has been read.
    Done,
}

fn each_record(path: &Path, mut f: impl FnMut(&Record<'_>) -> Step) -> Result<Step> {
    let mut r = XlogReader::open(path)?;
    loop {
        match r.next_block()? {
            Next::Block { payload, .. } => {
                let mut rd = Reader::new(payload);
                while !rd.is_empty() {
                    let Ok(rec) = record::decode(&mut rd) else {
                        return Ok(Step::Unusable);
                    };
                    match f(&rec) {
                        Step::Go => {}
                        other => return Ok(other),
                    }
                }
            }
            Next::Eof { .. } => return Ok(Step::Done),
            // The segment being written ends where the writer is; nothing after it exists yet.
            Next::End { .. } | Next::Torn { .. } => return Ok(Step::Done),
            Next::Corrupt { .. } => return Ok(Step::Unusable),
        }
    }
}

/// The vbucket from one snapshot, if it holds it at or below `upto`; with its last LSN.
fn from_snapshot(path: &Path, bucket: u16, vbid: u16, upto: u64) -> Result<Option<(VBucket, u64)>> {
    let mut vb = VBucket::new(bucket, vbid, VbState::Replica, CheckpointConfig::default());
    let mut lsn = None;
    let step = each_record(path, |rec| {
        if rec.bucket != bucket || rec.vbucket != vbid {
            return if lsn.is_some() && !matches!(rec.body, RecordBody::Bucket { .. }) {
                Step::Done
            } else {
                Step::Go
            };
        }
        match &rec.body {
            RecordBody::VbucketSnapshot {
                high_seqno,
                max_cas,
                purge_seqno,
                ..
            } => {
                if *high_seqno > upto {
                    return Step::Unusable;
                }
                vb.high_seqno = *high_seqno;
                vb.purge_seqno = *purge_seqno;
                vb.clock.observe(*max_cas);
                lsn = Some(rec.lsn);
            }
            RecordBody::Change {
                key, value, meta, ..
            } if lsn.is_some() => vb.recover_item(key, value, meta),
            _ => {}
        }
        Step::Go
    })?;
    Ok(match (step, lsn) {
        (Step::Done, Some(l)) => Some((vb, l)),
        _ => None,
    })
}

/// The vbucket's items as of `upto`, or None when this node's files cannot rebuild them.
pub fn vbucket_at(
    snap_dir: &Path,
    wal_dir: &Path,
    bucket: u16,
    vbid: u16,
    upto: u64,
) -> Result<Option<VBucket>> {
    let mut base = None;
    for (_, path, inprogress) in xlog::list_files(snap_dir, "snap")?.iter().rev() {
        if *inprogress {
            continue;
        }
        if let Some(found) = from_snapshot(path, bucket, vbid, upto)? {
            base = Some(found);
            break;
        }
    }
    let (mut vb, base_lsn) = base.unwrap_or_else(|| {
        (
            VBucket::new(bucket, vbid, VbState::Replica, CheckpointConfig::default()),
            0,
        )
    });
    let segments = xlog::list_files(wal_dir, "xlog")?;
    // The segments holding LSNs after the base, which must reach back to it with no gap.
    let first_needed = segments
        .iter()
        .rposition(|s| s.0 <= base_lsn + 1)
        .unwrap_or(usize::MAX);
    if first_needed == usize::MAX {
        return Ok(None);
    }
    let mut expected = base_lsn + 1;
    for (first, path, _) in &segments[first_needed..] {
        if *first > expected {
            return Ok(None);
        }
        let mut broken = false;
        let step = each_record(path, |rec| {
            if rec.lsn < expected {
                return Step::Go;
            }
            if rec.lsn != expected {
                broken = true;
                return Step::Unusable;
            }
            expected += 1;
            if rec.bucket != bucket || rec.vbucket != vbid {
                return Step::Go;
            }
            match &rec.body {
                RecordBody::Change {
                    key, value, meta, ..
                } if meta.by_seqno <= upto => {
                    if meta.by_seqno <= vb.high_seqno {
                        return Step::Unusable;
                    }
                    vb.recover_item(key, value, meta);
                }
                RecordBody::PurgeSeqno(s) if *s <= upto => vb.purge_seqno = vb.purge_seqno.max(*s),
                // History before an earlier rollback belongs to a branch this one left.
                RecordBody::Rollback(_) => return Step::Unusable,
                _ => {}
            }
            Step::Go
        })?;
        if broken || matches!(step, Step::Unusable) {
            return Ok(None);
        }
    }
    Ok(Some(vb))
}
