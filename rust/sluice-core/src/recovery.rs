//! Recovery: the newest valid snapshot, then WAL records with a higher LSN. A torn tail of the
//! last segment is truncated with a warning; damage anywhere else stops start-up with the file
//! and byte offset, unless `force` is set, in which case it is logged and skipped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sluice_proto::msgpack::Reader;

use crate::checkpoint::CheckpointConfig;
use crate::error::{Error, Result};
use crate::vbucket::{VBucket, VbState};
use crate::wal::record::{self, Record, RecordBody};
use crate::wal::xlog::{self, FileKind, Next, XlogReader};

pub struct RecoveredBucket {
    pub id: u16,
    pub name: String,
    pub vbuckets: Vec<VBucket>,
}

/// What recovery did, for the ready line and for tests.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub snapshot: Option<PathBuf>,
    pub snapshot_lsn: u64,
    pub snapshot_records: u64,
    pub wal_segments: usize,
    pub wal_records: u64,
    pub last_lsn: u64,
    pub unclean_shutdown: bool,
    pub truncated: Option<(PathBuf, u64)>,
    /// Damage skipped under force recovery (empty otherwise).
    pub skipped_damage: Vec<String>,
    /// Damaged files renamed to `*.damaged`.
    pub moved_aside: Vec<PathBuf>,
    pub duration: Duration,
}

pub struct Recovered {
    pub instance: String,
    pub buckets: Vec<RecoveredBucket>,
    /// The LSN to continue after: the last one replayed, or higher if files on disk hold
    /// higher ones that could not be replayed.
    pub last_lsn: u64,
    pub unclean: bool,
    pub report: Report,
}

#[derive(Default)]
struct State {
    buckets: BTreeMap<u16, RecoveredBucket>,
}

impl State {
    fn apply(&mut self, rec: &Record<'_>, from_wal: bool) -> std::result::Result<(), String> {
        if let RecordBody::Bucket { name, num_vbuckets } = rec.body {
            let name = String::from_utf8(name.to_vec())
                .map_err(|_| "bucket name is not UTF-8".to_string())?;
            match self.buckets.get(&rec.bucket) {
                Some(b) if b.name != name || b.vbuckets.len() != num_vbuckets as usize => {
                    return Err(format!(
                        "bucket id {} declared twice differently",
                        rec.bucket
                    ))
                }
                Some(_) => {}
                None => {
                    let cfg = CheckpointConfig::default();
                    let vbuckets = (0..num_vbuckets)
                        .map(|v| VBucket::new(rec.bucket, v, VbState::Dead, cfg))
                        .collect();
                    self.buckets.insert(
                        rec.bucket,
                        RecoveredBucket {
                            id: rec.bucket,
                            name,
                            vbuckets,
                        },
                    );
                }
            }
            return Ok(());
        }
        let vb = self
            .buckets
            .get_mut(&rec.bucket)
            .and_then(|b| b.vbuckets.get_mut(rec.vbucket as usize))
            .ok_or_else(|| {
                format!(
                    "record for unknown bucket {} vbucket {}",
                    rec.bucket, rec.vbucket
                )
            })?;
        if from_wal && rec.lsn <= vb.last_lsn {
            return Ok(());
        }
        match &rec.body {
            RecordBody::Change {
                key, value, meta, ..
            } => {
                if meta.by_seqno <= vb.high_seqno && from_wal {
                    return Err(format!(
                        "seqno {} of vbucket {} is not above its high seqno {}",
                        meta.by_seqno, rec.vbucket, vb.high_seqno
                    ));
                }
                // A snapshot lists each vbucket's items in ascending seqnos up to its high seqno.
                if !from_wal
                    && (meta.by_seqno <= vb.store.last_seqno() || meta.by_seqno > vb.high_seqno)
                {
                    return Err(format!(
                        "seqno {} of vbucket {} is out of order (after {}, high seqno {})",
                        meta.by_seqno,
                        rec.vbucket,
                        vb.store.last_seqno(),
                        vb.high_seqno
                    ));
                }
                vb.recover_item(key, value, meta);
            }
            RecordBody::VbucketState { state, .. } => vb.state = *state,
            RecordBody::FailoverEntry(e) => vb.failover.push(*e),
            RecordBody::PurgeSeqno(s) => vb.purge_seqno = vb.purge_seqno.max(*s),
            // A rollback is always followed by a snapshot holding its result. Without that
            // snapshot (a crash between them) the vbucket stays as it was before the rollback
            // and its producer asks for the same rollback again.
            RecordBody::Rollback(_) => {}
            RecordBody::FailoverReset => vb.failover.replace_all(Vec::new()),
            RecordBody::VbucketSnapshot {
                state,
                high_seqno,
                max_cas,
                purge_seqno,
            } => {
                vb.state = *state;
                vb.high_seqno = *high_seqno;
                vb.clock.observe(*max_cas);
                vb.purge_seqno = *purge_seqno;
            }
            RecordBody::Bucket { .. } => unreachable!("handled above"),
        }
        vb.last_lsn = vb.last_lsn.max(rec.lsn);
        Ok(())
    }
}

fn corrupt(path: &Path, offset: u64, reason: impl Into<String>) -> Error {
    Error::Corrupt {
        file: path.to_path_buf(),
        offset,
        reason: reason.into(),
    }
}

/// Loads one snapshot whole; any damage makes it unusable.
fn load_snapshot(path: &Path, instance: &mut Option<String>) -> Result<(State, u64, u64)> {
    let mut r = XlogReader::open(path)?;
    if r.header().kind != FileKind::Snap {
        return Err(corrupt(path, 0, "not a snapshot file"));
    }
    check_instance(path, &r.header().instance, instance)?;
    let lsn = r.header().lsn;
    let mut state = State::default();
    let mut n = 0;
    loop {
        match r.next_block()? {
            Next::Block { offset, payload } => {
                let mut rd = Reader::new(payload);
                while !rd.is_empty() {
                    let rec = record::decode(&mut rd)
                        .map_err(|e| corrupt(path, offset, e.to_string()))?;
                    state
                        .apply(&rec, false)
                        .map_err(|e| corrupt(path, offset, e))?;
                    n += 1;
                }
            }
            Next::Eof { .. } => return Ok((state, lsn, n)),
            Next::End { offset } => {
                return Err(corrupt(
                    path,
                    offset,
                    "snapshot ends without its EOF marker",
                ))
            }
            Next::Torn { offset, reason } | Next::Corrupt { offset, reason } => {
                return Err(corrupt(path, offset, reason))
            }
        }
    }
}

fn check_instance(path: &Path, found: &str, instance: &mut Option<String>) -> Result<()> {
    match instance {
        Some(i) if i != found => Err(corrupt(
            path,
            0,
            format!("belongs to instance {found}, the data directory to {i}"),
        )),
        Some(_) => Ok(()),
        None => {
            *instance = Some(found.to_string());
            Ok(())
        }
    }
}

fn new_instance() -> String {
    format!(
        "{:016x}{:016x}",
        crate::failover::random_uuid(),
        crate::failover::random_uuid()
    )
}

/// Removes segments at the end of the WAL that hold no record: a header cut short, or a header
/// alone. The writer starts a new segment before it closes the old one, so a crash in between
/// leaves such a file after a segment without its EOF marker; that one is then the last.
fn drop_empty_tail(segments: &mut Vec<(u64, PathBuf, bool)>, report: &mut Report) -> Result<()> {
    while let Some((_, path, _)) = segments.last() {
        let empty = match XlogReader::open(path) {
            // No block, or only a torn first one: nothing in it was ever durable.
            Ok(mut r) => matches!(
                r.next_block()?,
                Next::End { .. } | Next::Eof { .. } | Next::Torn { .. }
            ),
            Err(Error::Corrupt { reason, .. }) => reason == xlog::HEADER_TRUNCATED,
            Err(e) => return Err(e),
        };
        if !empty {
            return Ok(());
        }
        log::warn!(
            "WAL {}: holds no record (a crash while it was being started); removing it",
            path.display()
        );
        std::fs::remove_file(path).map_err(|e| Error::io(path.display(), e))?;
        report.truncated = Some((path.clone(), 0));
        report.unclean_shutdown = true;
        segments.pop();
    }
    Ok(())
}

/// Moves a damaged file out of the way (`NAME.damaged`), so that it is neither read, counted by
/// retention, nor overwritten by a new file of the same name. Nothing damaged is ever deleted.
fn move_aside(path: &Path, report: &mut Report) -> Result<()> {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".damaged");
    let dest = path.with_file_name(name);
    std::fs::rename(path, &dest).map_err(|e| Error::io(path.display(), e))?;
    log::warn!(
        "moved damaged {} aside to {}",
        path.display(),
        dest.display()
    );
    report.moved_aside.push(dest);
    Ok(())
}

pub fn recover(wal_dir: &Path, snap_dir: &Path, force: bool) -> Result<Recovered> {
    let mut report = Report::default();
    for (_, path, inprogress) in xlog::list_files(snap_dir, "snap")? {
        if inprogress {
            log::warn!("removing unfinished snapshot {}", path.display());
            std::fs::remove_file(&path).map_err(|e| Error::io(path.display(), e))?;
        }
    }
    let snaps = xlog::list_files(snap_dir, "snap")?;
    let mut segments = xlog::list_files(wal_dir, "xlog")?;
    drop_empty_tail(&mut segments, &mut report)?;
    // The highest LSN any file on disk may hold: new LSNs start above it, whatever was lost,
    // so that no LSN is ever handed out twice.
    // A snapshot's name is an LSN it holds; a segment's name is the first LSN it may hold, so
    // only the one before it is known to be used (records read below raise this further).
    let mut max_seen = snaps.iter().map(|s| s.0).max().unwrap_or(0);
    max_seen = max_seen.max(
        segments
            .iter()
            .map(|s| s.0.saturating_sub(1))
            .max()
            .unwrap_or(0),
    );
    let mut instance: Option<String> = None;

    // The newest valid snapshot; an older one serves if the WAL still reaches back to it.
    let mut state = State::default();
    let mut snap_lsn = 0;
    let mut damaged_snaps = Vec::new();
    for (lsn, path, _) in snaps.iter().rev() {
        let mut inst = instance.clone();
        match load_snapshot(path, &mut inst) {
            Ok((s, l, n)) => {
                state = s;
                snap_lsn = l;
                instance = inst;
                report.snapshot = Some(path.clone());
                report.snapshot_records = n;
                break;
            }
            Err(e) => {
                log::error!("snapshot {} (LSN {lsn}) is unusable: {e}", path.display());
                damaged_snaps.push((path.clone(), e));
            }
        }
    }
    if let Some((_, first_error)) = damaged_snaps.first() {
        let reaches = segments
            .first()
            .map(|s| s.0 <= snap_lsn + 1)
            .unwrap_or(false);
        if !reaches {
            if !force {
                return Err(first_error.clone());
            }
            report.skipped_damage.push(first_error.to_string());
        }
        for (path, _) in &damaged_snaps {
            move_aside(path, &mut report)?;
        }
    }
    report.snapshot_lsn = snap_lsn;

    let mut expected = snap_lsn + 1;
    let mut last_lsn = snap_lsn;
    let mut unclean = false;
    // Segments wholly at or below the snapshot's LSN are not needed.
    let needed: Vec<_> = segments
        .iter()
        .enumerate()
        .filter(|(i, _)| {
            segments
                .get(i + 1)
                .map(|n| n.0 > snap_lsn + 1)
                .unwrap_or(true)
        })
        .map(|(_, s)| s.clone())
        .collect();
    // Damage is fatal unless forced; forced, it is logged, reported, and skipped.
    let note = |e: Error, report: &mut Report| -> Result<()> {
        if !force {
            return Err(e);
        }
        log::error!("{e}; skipping it because of --force-recovery");
        report.skipped_damage.push(e.to_string());
        Ok(())
    };
    for (idx, (first, path, _)) in needed.iter().enumerate() {
        let is_last = idx + 1 == needed.len();
        let mut r = match XlogReader::open(path) {
            Ok(r) => r,
            Err(e @ Error::Corrupt { .. }) => {
                note(e, &mut report)?;
                move_aside(path, &mut report)?;
                unclean |= is_last;
                continue;
            }
            Err(e) => return Err(e),
        };
        if r.header().kind != FileKind::Xlog {
            note(corrupt(path, 0, "not a WAL segment"), &mut report)?;
            move_aside(path, &mut report)?;
            continue;
        }
        check_instance(path, &r.header().instance.clone(), &mut instance)?;
        if *first > expected {
            note(
                corrupt(
                    path,
                    0,
                    format!(
                        "WAL segment starts at LSN {first}, LSNs {expected}..{first} are missing"
                    ),
                ),
                &mut report,
            )?;
            expected = *first;
        }
        report.wal_segments += 1;
        let mut records_in_file = 0u64;
        let mut damaged = false;
        let clean = loop {
            let damage = match r.next_block()? {
                Next::Block { offset, payload } => {
                    let mut rd = Reader::new(payload);
                    let mut bad = None;
                    while !rd.is_empty() {
                        let rec = match record::decode(&mut rd) {
                            Ok(rec) => rec,
                            Err(e) => {
                                bad = Some(corrupt(path, offset, e.to_string()));
                                break;
                            }
                        };
                        records_in_file += 1;
                        max_seen = max_seen.max(rec.lsn);
                        if rec.lsn < expected {
                            continue;
                        }
                        if rec.lsn > expected {
                            note(
                                corrupt(
                                    path,
                                    offset,
                                    format!("LSN {} where {expected} was expected", rec.lsn),
                                ),
                                &mut report,
                            )?;
                            damaged = true;
                            expected = rec.lsn;
                        }
                        if let Err(e) = state.apply(&rec, true) {
                            bad = Some(corrupt(path, offset, e));
                            break;
                        }
                        expected += 1;
                        last_lsn = rec.lsn;
                        report.wal_records += 1;
                    }
                    match bad {
                        Some(e) => (e, offset),
                        None => continue,
                    }
                }
                Next::Eof { .. } => break true,
                Next::End { offset } => {
                    // Without its EOF marker, a segment is still whole when the next one starts
                    // exactly where it ends (a crash or error while it was being closed).
                    if is_last || needed.get(idx + 1).map(|n| n.0) == Some(expected) {
                        break false;
                    }
                    (corrupt(path, offset, "segment ends without its EOF marker and the next one does not continue it"), offset)
                }
                Next::Torn { offset, reason } => {
                    if is_last {
                        log::warn!(
                            "WAL {}: torn tail at byte offset {offset} ({reason}); truncating",
                            path.display()
                        );
                        let f = std::fs::OpenOptions::new()
                            .write(true)
                            .open(path)
                            .map_err(|e| Error::io(path.display(), e))?;
                        f.set_len(offset)
                            .map_err(|e| Error::io(path.display(), e))?;
                        f.sync_all().map_err(|e| Error::io(path.display(), e))?;
                        report.truncated = Some((path.clone(), offset));
                        break false;
                    }
                    (corrupt(path, offset, reason), offset)
                }
                Next::Corrupt { offset, reason } => (corrupt(path, offset, reason), offset),
            };
            // Forced past damage: carry on from the next valid block, if any.
            note(damage.0, &mut report)?;
            damaged = true;
            if !r
                .resync_after(damage.1)
                .map_err(|e| Error::io(path.display(), e))?
            {
                break false;
            }
        };
        let inprogress = path.extension().is_some_and(|e| e == "inprogress");
        if damaged {
            move_aside(path, &mut report)?;
            unclean |= is_last;
        } else if is_last {
            unclean = !clean || inprogress;
            seal_segment(path, clean, records_in_file)?;
        } else if !clean || inprogress {
            log::warn!("WAL {}: was not closed cleanly; sealing it", path.display());
            seal_segment(path, clean, records_in_file)?;
        }
    }
    report.last_lsn = last_lsn;
    report.unclean_shutdown |= unclean;
    let unclean = report.unclean_shutdown;
    if unclean {
        log::warn!("the last shutdown was not clean; active vbuckets get a new failover entry");
    }
    let instance = instance.unwrap_or_else(new_instance);
    let buckets = state.buckets.into_values().collect();
    Ok(Recovered {
        instance,
        buckets,
        last_lsn: last_lsn.max(max_seen),
        unclean,
        report,
    })
}

/// Closes the recovered last segment for good: EOF marker appended (if missing) and the
/// `.inprogress` suffix dropped. A segment without records is removed.
fn seal_segment(path: &Path, has_eof: bool, records: u64) -> Result<()> {
    let io = |e| Error::io(path.display(), e);
    if records == 0 {
        std::fs::remove_file(path).map_err(io)?;
        return Ok(());
    }
    if !has_eof {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(io)?;
        f.write_all(&xlog::EOF_MARKER.to_be_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    if let Some(name) = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".inprogress"))
    {
        let dest = path.with_file_name(name);
        std::fs::rename(path, &dest).map_err(io)?;
        if let Some(dir) = path.parent() {
            xlog::sync_dir(dir).map_err(io)?;
        }
    }
    Ok(())
}
