//! Snapshots: every bucket's vbuckets, one vbucket at a time, to `snap/<lsn>.snap` through
//! `.inprogress`, a rename and a directory sync. The file's LSN is the last one handed out when
//! the capture began: all changes up to it are inside. Each vbucket is captured through a range
//! read (as a backfill is): its counters and last applied LSN are taken under its lock, then its
//! items come in chunks while writes go on, as of that moment. WAL replay skips, per vbucket,
//! exactly what the capture holds.
//!
//! Topics follow the buckets: each declaration, then every bundle its partitions keep.
//!
//! Retention keeps `snapshot_count` snapshots and the WAL segments the oldest of them needs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backfill::Backfill;
use crate::catalog::Catalog;
use crate::error::{Error, Result};
use crate::item::ChangeOp;
use crate::wal::record::{Record, RecordBody};
use crate::wal::xlog::{self, FileHeader, FileKind};
use crate::wal::WalWriter;

const BLOCK_TARGET: usize = 1 << 20;
/// Items copied out of a vbucket per lock acquisition.
const CHUNK_ITEMS: usize = 4096;

struct BlockWriter {
    out: BufWriter<File>,
    buf: Vec<u8>,
    at: usize,
}

impl BlockWriter {
    fn record(&mut self, r: &Record<'_>) {
        r.encode(&mut self.buf);
    }

    /// Seals the current block if it is big enough, or always with `force`; writes sealed blocks.
    fn seal(&mut self, force: bool) -> std::io::Result<()> {
        let payload = self.buf.len() - self.at - xlog::BLOCK_HEADER_LEN;
        if payload == 0 || (!force && payload < BLOCK_TARGET) {
            return Ok(());
        }
        xlog::finish_block(&mut self.buf, self.at);
        self.out.write_all(&self.buf)?;
        self.buf.clear();
        self.at = xlog::begin_block(&mut self.buf);
        if let Some(delay) = crate::errinj::SNAPSHOT_BLOCK_DELAY_MS.millis() {
            std::thread::sleep(delay);
        }
        Ok(())
    }
}

pub fn write(
    catalog: &Arc<Catalog>,
    wal: &WalWriter,
    snap_dir: &Path,
    wal_dir: &Path,
    instance: &str,
    keep: usize,
    lock: &Mutex<()>,
) -> Result<PathBuf> {
    let _one_at_a_time = lock.lock();
    wal.request_rotate();
    let lsn = wal.last_lsn();
    let done = snap_dir.join(xlog::file_name(lsn, "snap"));
    if done.exists() {
        return Ok(done);
    }
    let tmp = snap_dir.join(format!("{}.inprogress", xlog::file_name(lsn, "snap")));
    let items = match write_file(catalog, &tmp, instance, lsn) {
        Ok(n) => n,
        Err(e) => {
            // A snapshot that failed (disk full, I/O error) leaves nothing behind.
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, &done).map_err(|e| Error::io(done.display(), e))?;
    xlog::sync_dir(snap_dir).map_err(|e| Error::io(snap_dir.display(), e))?;
    log::info!("snapshot {} written: {items} items", done.display());
    collect_garbage(snap_dir, wal_dir, keep)?;
    Ok(done)
}

/// Writes every vbucket into `tmp`, synced; returns how many items it holds.
fn write_file(catalog: &Arc<Catalog>, tmp: &Path, instance: &str, lsn: u64) -> Result<u64> {
    let io = |e| Error::io(tmp.display(), e);
    let file = File::create(tmp).map_err(io)?;
    let mut head = Vec::new();
    FileHeader {
        kind: FileKind::Snap,
        instance: instance.to_string(),
        lsn,
    }
    .encode(&mut head);
    let mut w = BlockWriter {
        out: BufWriter::with_capacity(1 << 20, file),
        buf: Vec::with_capacity(2 * BLOCK_TARGET),
        at: 0,
    };
    w.out.write_all(&head).map_err(io)?;
    w.at = xlog::begin_block(&mut w.buf);
    let mut items = 0u64;
    for bucket in catalog.all() {
        let name = bucket.name().to_string();
        w.record(&Record {
            lsn: 0,
            bucket: bucket.id,
            vbucket: 0,
            body: RecordBody::Bucket {
                name: name.as_bytes(),
                num_vbuckets: bucket.num_vbuckets(),
            },
        });
        for v in 0..bucket.num_vbuckets() {
            // The vbucket's counters and a range read are taken under one lock; the items then
            // come in chunks, the lock held per chunk only, while writes go on. The range read
            // keeps replaced versions readable, so the capture is the vbucket as of `last_lsn`.
            let mut capture = {
                let mut vb = bucket.lock_vbucket(v).expect("in range");
                w.record(&Record {
                    lsn: vb.last_lsn,
                    bucket: bucket.id,
                    vbucket: v,
                    body: RecordBody::VbucketSnapshot {
                        state: vb.state,
                        high_seqno: vb.high_seqno,
                        max_cas: vb.clock.last(),
                        purge_seqno: vb.purge_seqno,
                    },
                });
                if let Some(p) = &vb.follow_position {
                    w.record(&Record {
                        lsn: vb.last_lsn,
                        bucket: bucket.id,
                        vbucket: v,
                        body: RecordBody::FollowPosition(p),
                    });
                }
                for e in vb.failover.entries().iter().rev() {
                    w.record(&Record {
                        lsn: 0,
                        bucket: bucket.id,
                        vbucket: v,
                        body: RecordBody::FailoverEntry(*e),
                    });
                }
                let high = vb.high_seqno;
                Backfill::begin_locked(bucket.clone(), &mut vb, 1, high)
            };
            loop {
                let chunk = capture.next_chunk(CHUNK_ITEMS);
                if chunk.is_empty() {
                    break;
                }
                for it in &chunk {
                    let op = if it.meta.deleted {
                        ChangeOp::Deletion
                    } else {
                        ChangeOp::Mutation
                    };
                    w.record(&Record {
                        lsn: 0,
                        bucket: bucket.id,
                        vbucket: v,
                        body: RecordBody::Change {
                            op,
                            key: it.key(),
                            value: it.value(),
                            meta: it.meta,
                        },
                    });
                    items += 1;
                    // Blocks stay near BLOCK_TARGET whatever a vbucket holds.
                    w.seal(false).map_err(io)?;
                }
            }
            w.seal(false).map_err(io)?;
        }
    }
    for topic in catalog.topics() {
        w.record(&Record {
            lsn: 0,
            bucket: topic.id,
            vbucket: 0,
            body: RecordBody::Topic {
                name: topic.name.as_bytes(),
                partitions: topic.num_partitions(),
                config: topic.config_text.as_bytes(),
            },
        });
        // Its messages are its partitions' segment files (`partition_log`), which recovery
        // opens: a snapshot names the topic and carries none of its bytes.
    }
    w.seal(true).map_err(io)?;
    w.out
        .write_all(&xlog::EOF_MARKER.to_be_bytes())
        .map_err(io)?;
    let file = w
        .out
        .into_inner()
        .map_err(|e| Error::io(tmp.display(), e.into_error()))?;
    file.sync_all().map_err(io)?;
    drop(file);
    Ok(items)
}

/// Removes snapshots beyond the newest `keep`, and WAL segments whose every LSN is covered by
/// the oldest snapshot kept.
pub fn collect_garbage(snap_dir: &Path, wal_dir: &Path, keep: usize) -> Result<()> {
    let snaps: Vec<_> = xlog::list_files(snap_dir, "snap")?
        .into_iter()
        .filter(|s| !s.2)
        .collect();
    if snaps.len() > keep {
        for (_, path, _) in &snaps[..snaps.len() - keep] {
            std::fs::remove_file(path).map_err(|e| Error::io(path.display(), e))?;
            log::info!("removed old snapshot {}", path.display());
        }
    }
    let Some(oldest_kept) = snaps.get(snaps.len().saturating_sub(keep)).map(|s| s.0) else {
        return Ok(());
    };
    let segs = xlog::list_files(wal_dir, "xlog")?;
    for pair in segs.windows(2) {
        let (first, path, inprogress) = &pair[0];
        let next_first = pair[1].0;
        if !inprogress && next_first <= oldest_kept + 1 {
            std::fs::remove_file(path).map_err(|e| Error::io(path.display(), e))?;
            log::debug!(
                "removed WAL segment {} (LSNs from {first} are in a snapshot)",
                path.display()
            );
        }
    }
    xlog::sync_dir(wal_dir).map_err(|e| Error::io(wal_dir.display(), e))?;
    Ok(())
}
