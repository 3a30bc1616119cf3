//! A vbucket's change stream, whichever protocol carries it: its changes after the consumer's
//! start, as snapshots. Older history comes by backfill (one disk snapshot up to the high seqno
//! taken when it began), then the stream follows its checkpoint cursor (memory snapshots); the
//! cursor is registered atomically with the backfill, so the two meet without a gap or a
//! duplicate. Messages go to a `StreamSink`: DCP frames (`dcp::sink`), TAP's staged rounds, or
//! a test's recording. The stream's vocabulary (snapshot flags, STREAM_END reasons, vbucket
//! state codes) is DCP's, which the other protocols map from.

use std::collections::VecDeque;
use std::sync::Arc;

use sluice_core::backfill::Backfill;
use sluice_core::bucket::Bucket;
use sluice_core::checkpoint::{CheckpointBatch, CursorHandle, CursorId, CursorRead};
use sluice_core::engine::StreamPosition;
use sluice_core::failover::{rollback_point, ResumePoint};
use sluice_core::item::{ChangeOp, ItemMeta};
use sluice_core::vbucket::VbState;
use sluice_core::{Engine, Result};
use sluice_proto::dcp::{snapshot_flag, stream_end_reason, vbucket_state};

/// How a connection wants documents encoded (DCP_OPEN flags and controls).
#[derive(Debug, Clone, Copy, Default)]
pub struct Encoding {
    pub no_value: bool,
    pub keep_datatype: bool,
    pub delete_times: bool,
    pub expiry_opcode: bool,
    /// Documents' extended attributes go with their values (DCP_OPEN's INCLUDE_XATTRS);
    /// otherwise a value is sent as its body alone.
    pub xattrs: bool,
    /// A deletion's user attributes go too (INCLUDE_DELETED_USER_XATTRS); otherwise its
    /// system ones only.
    pub deleted_user_xattrs: bool,
}

/// What a stream's fill did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Wrote messages; may have more.
    Sent,
    /// Nothing to send until the vbucket changes.
    Idle,
    /// Wrote its STREAM_END with this reason; remove it.
    Ended(u32),
}

enum Phase {
    Backfill(Backfill),
    Memory,
}

/// A takeover stream hands its vbucket to the consumer (rebalance.md): once caught up, the
/// source goes pending (writes get a temporary failure) and says so with SET_VBUCKET_STATE;
/// once drained, it sends SET_VBUCKET_STATE active; on the consumer's answer the source goes
/// dead (writes get NOT_MY_VBUCKET) and the stream ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    Off,
    CatchingUp,
    Draining(std::time::Instant),
    AwaitingActive(std::time::Instant),
    HandedOver,
}

pub struct Stream {
    pub vbucket: u16,
    pub opaque: u32,
    bucket: Arc<Bucket>,
    /// The vbucket's state when the stream opened: a stream ends when its vbucket dies, or
    /// stops being active if it was (takeover, failover).
    opened_in: VbState,
    /// The vbucket's `history` when the stream opened: a cut since (a rollback, a new history)
    /// ends the stream with ROLLBACK, and the consumer asking again learns where to go back to.
    history: u64,
    cursor_name: String,
    cursor: Option<(CursorId, CursorHandle)>,
    phase: Phase,
    /// The last seqno this stream has sent (or the consumer's start).
    last_seqno: u64,
    /// The end of the last snapshot marker sent (the consumer's start before the first).
    snapshot_end: u64,
    snapshot_checkpoint: Option<u64>,
    end_seqno: u64,
    encoding: Encoding,
    /// Read from the cursor, not yet sent (flow control stopped the connection mid-batch).
    pending: VecDeque<CheckpointBatch>,
    pending_pos: usize,
    /// Whether a dropped cursor ends the stream (the consumer declared cursor dropping).
    end_when_dropped: bool,
    /// The vbucket's version when a fill last found nothing to send: until it moves, fills
    /// return at once (a connection streaming many vbuckets is woken by a change to any).
    idle_at: Option<u64>,
    /// Items sent by backfill and from memory, for the producer's metrics.
    pub sent_backfill: u64,
    pub sent_memory: u64,
    pub takeover: Takeover,
    /// The replica name this stream's SEQNO_ACKNOWLEDGED count under, when it is a replica's.
    pub acks_as: Option<String>,
}

/// A connection's vbuckets whose streams may have something to send, in the order they take
/// turns, starting at `turn`. Idle streams are left out here, by a look at their vbucket's
/// version: a replica's connection streams every vbucket, and one write wakes it.
pub fn turn_order(streams: &std::collections::BTreeMap<u16, Stream>, turn: u16) -> Vec<u16> {
    streams
        .range(turn..)
        .chain(streams.range(..turn))
        .filter(|(_, s)| !s.is_idle())
        .map(|(vb, _)| *vb)
        .collect()
}

/// Where a stream's messages go: DCP frames onto the wire, or events a TAP connection encodes
/// its own way. Each method returns the bytes it used, for the caller's budget.
pub trait StreamSink {
    /// A snapshot `[start, end]` begins (`snapshot_flag` bits: DISK for a backfill); a memory
    /// snapshot names its checkpoint.
    fn marker(
        &mut self,
        s: &StreamView,
        start: u64,
        end: u64,
        flags: u32,
        checkpoint: Option<u64>,
    ) -> usize;
    /// One change; `backfill` tells whether it came from disk or memory.
    #[allow(clippy::too_many_arguments)]
    fn document(
        &mut self,
        s: &StreamView,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: &ItemMeta,
        backfill: bool,
    ) -> usize;
    /// The backfill's last change was passed on.
    fn backfill_end(&mut self, _s: &StreamView) -> usize {
        0
    }
    fn end(&mut self, s: &StreamView, reason: u32) -> usize;
    /// A takeover's state change (`vbucket_state` codes).
    fn vbucket_state(&mut self, s: &StreamView, state: u8) -> usize;
}

impl Stream {
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        engine: &Engine,
        bucket: Arc<Bucket>,
        vbucket: u16,
        opaque: u32,
        connection: &str,
        start_seqno: u64,
        end_seqno: u64,
        encoding: Encoding,
        end_when_dropped: bool,
        opened_at: &StreamPosition,
    ) -> Result<Stream> {
        let cursor_name = format!("dcp:{connection}:{vbucket}");
        let mut s = Stream {
            vbucket,
            opaque,
            bucket,
            opened_in: opened_at.state,
            history: opened_at.history,
            cursor_name,
            cursor: None,
            phase: Phase::Memory,
            last_seqno: start_seqno,
            snapshot_end: start_seqno,
            snapshot_checkpoint: None,
            end_seqno,
            encoding,
            pending: VecDeque::new(),
            pending_pos: 0,
            end_when_dropped,
            idle_at: None,
            sent_backfill: 0,
            sent_memory: 0,
            acks_as: None,
            takeover: Takeover::Off,
        };
        if start_seqno < end_seqno {
            s.register(engine)?;
        }
        Ok(s)
    }

    fn register(&mut self, engine: &Engine) -> Result<()> {
        let (reg, handle, backfill) = engine.open_cursor(
            &self.bucket,
            self.vbucket,
            &self.cursor_name,
            self.last_seqno,
        )?;
        self.cursor = Some((reg.id, handle));
        self.phase = match backfill {
            Some(b) => Phase::Backfill(b),
            None => Phase::Memory,
        };
        Ok(())
    }

    /// The consumer answered SET_VBUCKET_STATE active: the vbucket is now its. Returns how long
    /// writes to the vbucket were refused here.
    pub fn takeover_acknowledged(&mut self, engine: &Engine) -> Option<std::time::Duration> {
        let Takeover::AwaitingActive(since) = self.takeover else {
            return None;
        };
        // Queued, not waited for: this task must not block on the WAL (a restart before the
        // record is written finds the vbucket pending, refusing writes).
        if let Err(e) = engine.write_vbucket_state(&self.bucket, self.vbucket, VbState::Dead) {
            log::error!("takeover of vbucket {}: {e}", self.vbucket);
        }
        self.takeover = Takeover::HandedOver;
        Some(since.elapsed())
    }

    /// Releases the cursor (and any backfill) so the checkpoints need not keep changes for it.
    /// A takeover cut short before the consumer was told to go active gives the vbucket back
    /// to this node; after that, the vbucket stays pending here (the consumer may be active).
    pub fn close(&mut self, engine: &Engine) {
        match self.takeover {
            Takeover::Draining(_) => {
                log::warn!(
                    "takeover of vbucket {} cut short while draining; it is active here again",
                    self.vbucket
                );
                let _ = engine.write_vbucket_state(&self.bucket, self.vbucket, VbState::Active);
                self.takeover = Takeover::Off;
            }
            Takeover::AwaitingActive(_) => {
                log::error!(
                    "takeover of vbucket {} cut short after the consumer was told to go active; \
                     the vbucket stays pending here until an operator decides",
                    self.vbucket
                );
                self.takeover = Takeover::Off;
            }
            _ => {}
        }
        if let Some((id, _)) = self.cursor.take() {
            engine.remove_cursor(&self.bucket, self.vbucket, id);
        }
        self.phase = Phase::Memory;
        self.pending.clear();
    }

    /// Whether a fill would return at once with nothing: the stream found nothing to send and
    /// its vbucket has not changed since.
    pub fn is_idle(&self) -> bool {
        self.takeover == Takeover::Off && self.idle_at == Some(self.bucket.version(self.vbucket))
    }

    pub fn is_backfilling(&self) -> bool {
        matches!(self.phase, Phase::Backfill(_))
    }

    fn finished(&self) -> bool {
        self.last_seqno >= self.end_seqno && self.last_seqno >= self.snapshot_end
    }

    /// The last seqno this stream has sent, or the consumer's start before it sent any: the
    /// most a consumer of it can have received.
    pub fn last_sent_seqno(&self) -> u64 {
        self.last_seqno
    }

    /// Writes STREAM_END with `reason`; returns its length.
    pub fn write_end(&self, sink: &mut impl StreamSink, reason: u32) -> usize {
        sink.end(&self.view(), reason)
    }

    fn write_marker(
        &mut self,
        sink: &mut impl StreamSink,
        start: u64,
        end: u64,
        flags: u32,
        checkpoint: Option<u64>,
    ) -> usize {
        self.snapshot_end = end;
        sink.marker(&self.view(), start, end, flags, checkpoint)
    }

    pub fn view(&self) -> StreamView {
        StreamView {
            vbucket: self.vbucket,
            opaque: self.opaque,
            encoding: self.encoding,
        }
    }

    /// Writes up to about `budget` bytes of this stream's messages (at least one message when
    /// there is one, as flow control lets one message overflow the window). Returns the bytes
    /// written and what happened.
    pub fn fill(
        &mut self,
        engine: &Engine,
        out: &mut impl StreamSink,
        budget: usize,
    ) -> (usize, Progress) {
        if self.is_idle() {
            return (0, Progress::Idle);
        }
        let version = self.bucket.version(self.vbucket);
        self.idle_at = None;
        let mut used = 0;
        let (state, history) = engine
            .stream_state(&self.bucket, self.vbucket)
            .map_or((None, self.history), |(s, h)| (Some(s), h));
        if self.takeover == Takeover::HandedOver {
            used += self.write_end(out, stream_end_reason::OK);
            self.close(engine);
            return (used, Progress::Ended(stream_end_reason::OK));
        }
        let state_changed = match state {
            None | Some(VbState::Dead) => true,
            // The takeover itself made it pending.
            Some(VbState::Pending) if self.takeover != Takeover::Off => false,
            Some(s) => self.opened_in == VbState::Active && s != VbState::Active,
        };
        if state_changed {
            used += self.write_end(out, stream_end_reason::STATE_CHANGED);
            self.close(engine);
            return (used, Progress::Ended(stream_end_reason::STATE_CHANGED));
        }
        if history != self.history {
            log::info!(
                "stream {} of vbucket {} ends: the vbucket's history was cut",
                self.cursor_name,
                self.vbucket
            );
            used += self.write_end(out, stream_end_reason::ROLLBACK);
            self.close(engine);
            return (used, Progress::Ended(stream_end_reason::ROLLBACK));
        }
        if self.finished() {
            used += self.write_end(out, stream_end_reason::OK);
            self.close(engine);
            return (used, Progress::Ended(stream_end_reason::OK));
        }
        loop {
            if used >= budget {
                return (used, Progress::Sent);
            }
            match &mut self.phase {
                Phase::Backfill(_) => used += self.fill_backfill(out, budget - used),
                Phase::Memory => {
                    if self.pending.is_empty() {
                        match self.read_cursor(engine) {
                            Ok(true) => {}
                            Ok(false) => {
                                if self.takeover != Takeover::Off {
                                    match self.hand_over(engine, out) {
                                        Some(n) if n > 0 => {
                                            used += n;
                                            continue;
                                        }
                                        _ => {}
                                    }
                                }
                                if used > 0 {
                                    return (used, Progress::Sent);
                                }
                                if self.takeover == Takeover::Off {
                                    self.idle_at = Some(version);
                                }
                                return (0, Progress::Idle);
                            }
                            Err(reason) => {
                                used += self.write_end(out, reason);
                                self.close(engine);
                                return (used, Progress::Ended(reason));
                            }
                        }
                    }
                    used += self.fill_memory(out, budget - used);
                }
            }
            if self.finished() {
                used += self.write_end(out, stream_end_reason::OK);
                self.close(engine);
                return (used, Progress::Ended(stream_end_reason::OK));
            }
        }
    }

    /// Called when the stream has nothing more to send: moves a takeover on once the consumer
    /// holds everything up to the high seqno. Returns the bytes written.
    fn hand_over(&mut self, engine: &Engine, out: &mut impl StreamSink) -> Option<usize> {
        let high = engine
            .stream_position(&self.bucket, self.vbucket)?
            .high_seqno;
        if !self.pending.is_empty() || self.last_seqno < high {
            return None;
        }
        let (next, state) = match self.takeover {
            Takeover::CatchingUp => {
                // Queued, not waited for (this task must not block on the WAL). The consumer is
                // told PENDING now and ACTIVE on a later turn; the record is normally written
                // by then, but nothing here checks it: a crash in between can restart this
                // node with the vbucket active while the consumer takes it over.
                if let Err(e) =
                    engine.write_vbucket_state(&self.bucket, self.vbucket, VbState::Pending)
                {
                    log::error!("takeover of vbucket {}: {e}", self.vbucket);
                    return None;
                }
                (
                    Takeover::Draining(std::time::Instant::now()),
                    vbucket_state::PENDING,
                )
            }
            Takeover::Draining(since) => (Takeover::AwaitingActive(since), vbucket_state::ACTIVE),
            _ => return None,
        };
        self.takeover = next;
        Some(out.vbucket_state(&self.view(), state))
    }

    fn fill_backfill(&mut self, out: &mut impl StreamSink, budget: usize) -> usize {
        let Phase::Backfill(b) = &mut self.phase else {
            return 0;
        };
        let (start, end) = b.range();
        let mut used = 0;
        if self.snapshot_end < end {
            // The backfill is one disk snapshot, consistent only at its end.
            used += self.write_marker(
                out,
                start,
                end,
                snapshot_flag::DISK | snapshot_flag::CHECKPOINT,
                None,
            );
            self.snapshot_checkpoint = None;
        }
        let this = self.view();
        let mut last = self.last_seqno;
        let mut sent = 0;
        let Phase::Backfill(b) = &mut self.phase else {
            unreachable!()
        };
        b.read_with(4096, |item| {
            if used >= budget && sent > 0 {
                return false;
            }
            let meta = item.meta();
            let op = if meta.deleted {
                ChangeOp::Deletion
            } else {
                ChangeOp::Mutation
            };
            used += out.document(&this, op, item.key(), item.value(), &meta, true);
            last = meta.by_seqno;
            sent += 1;
            true
        });
        self.sent_backfill += sent;
        self.last_seqno = last;
        if b.is_done() {
            // The snapshot is complete at its end even if its last seqnos were superseded.
            self.last_seqno = self.last_seqno.max(end);
            self.phase = Phase::Memory;
            used += out.backfill_end(&this);
        }
        used
    }

    /// Reads the next changes from the cursor into `pending`. Ok(false): nothing new.
    /// Err(reason): the stream must end.
    fn read_cursor(&mut self, engine: &Engine) -> std::result::Result<bool, u32> {
        let Some((id, handle)) = &self.cursor else {
            return Ok(false);
        };
        let read = if handle.is_dropped() {
            CursorRead::Dropped
        } else {
            engine.read_cursor(&self.bucket, self.vbucket, *id, 4096)
        };
        match read {
            CursorRead::Batches(b) if b.is_empty() => Ok(false),
            CursorRead::Batches(b) => {
                self.pending.extend(b);
                self.pending_pos = 0;
                Ok(true)
            }
            CursorRead::Dropped => {
                self.cursor = None;
                if self.end_when_dropped {
                    log::info!(
                        "DCP stream {} of vbucket {} ends: its cursor was dropped (too slow)",
                        self.cursor_name,
                        self.vbucket
                    );
                    return Err(stream_end_reason::TOO_SLOW);
                }
                // Without cursor dropping the stream goes on by backfill from where it is.
                match self.register(engine) {
                    Ok(()) => Ok(true),
                    Err(e) => {
                        log::warn!("DCP stream {}: {e}", self.cursor_name);
                        Err(stream_end_reason::BACKFILL_FAILED)
                    }
                }
            }
        }
    }

    fn fill_memory(&mut self, out: &mut impl StreamSink, budget: usize) -> usize {
        let mut used = 0;
        let this = self.view();
        while let Some(batch) = self.pending.front() {
            if used >= budget {
                break;
            }
            let Some(change) = batch.changes.get(self.pending_pos) else {
                self.pending.pop_front();
                self.pending_pos = 0;
                continue;
            };
            let seqno = change.seqno();
            if seqno > self.snapshot_end {
                // A new snapshot: the rest of this checkpoint as it stood when read, whole.
                let mut flags = snapshot_flag::MEMORY;
                if self.snapshot_checkpoint != Some(batch.checkpoint_id) {
                    flags |= snapshot_flag::CHECKPOINT;
                }
                let (start, end, cp) = (self.snapshot_end + 1, batch.end, batch.checkpoint_id);
                used += self.write_marker(out, start, end, flags, Some(cp));
                self.snapshot_checkpoint = Some(cp);
                continue;
            }
            used += out.document(
                &this,
                change.op(),
                change.key(),
                change.value(),
                change.meta(),
                false,
            );
            self.last_seqno = seqno;
            self.sent_memory += 1;
            self.pending_pos += 1;
        }
        used
    }
}

/// Where a consumer asks a vbucket's stream to start and end, whichever protocol carries the
/// request (DCP's STREAM_REQ on the memcached port, Greenstack's DCP STREAM REQUEST).
#[derive(Debug, Clone, Copy)]
pub struct StartAt {
    pub start_seqno: u64,
    pub end_seqno: u64,
    pub vbucket_uuid: u64,
    pub snap_start_seqno: u64,
    pub snap_end_seqno: u64,
    /// Start at the high seqno, whatever the rest says.
    pub from_latest: bool,
    /// End at the high seqno of the moment.
    pub to_latest: bool,
    pub ignore_purged_tombstones: bool,
}

/// Why a stream cannot start where it was asked to.
#[derive(Debug, PartialEq, Eq)]
pub enum StartRefused {
    /// The consumer's history diverged from the vbucket's: it goes back to this seqno.
    Rollback(u64),
    /// A start past the end, outside its snapshot, or past the high seqno.
    OutOfRange(String),
}

impl StartAt {
    /// The stream's `[start, end]` on a vbucket at `pos`, by DCP's rules (the rollback rule,
    /// docs/replication.md).
    pub fn resolve(&self, pos: &StreamPosition) -> std::result::Result<(u64, u64), StartRefused> {
        let (mut start, mut end) = (self.start_seqno, self.end_seqno);
        let (mut snap_start, mut snap_end) = (self.snap_start_seqno, self.snap_end_seqno);
        if self.from_latest {
            start = pos.high_seqno;
            snap_start = start;
            snap_end = start;
        }
        if self.to_latest {
            end = pos.high_seqno;
        }
        if start > end {
            return Err(StartRefused::OutOfRange(format!(
                "start seqno {start} is past end seqno {end}"
            )));
        }
        if !(snap_start <= start && start <= snap_end) {
            return Err(StartRefused::OutOfRange(format!(
                "start seqno {start} is outside the snapshot [{snap_start}, {snap_end}]"
            )));
        }
        if !self.from_latest {
            let at = ResumePoint {
                start_seqno: start,
                vbucket_uuid: self.vbucket_uuid,
                snap_start_seqno: snap_start,
                snap_end_seqno: snap_end,
            };
            if let Some(seqno) = rollback_point(
                &pos.failover,
                pos.high_seqno,
                pos.purge_seqno,
                at,
                self.ignore_purged_tombstones,
            ) {
                return Err(StartRefused::Rollback(seqno));
            }
        }
        if start > pos.high_seqno {
            return Err(StartRefused::OutOfRange(format!(
                "start seqno {start} is past the high seqno {}",
                pos.high_seqno
            )));
        }
        Ok((start, end))
    }
}

/// What a sink needs to know of the stream a message belongs to.
#[derive(Clone, Copy)]
pub struct StreamView {
    pub vbucket: u16,
    pub opaque: u32,
    pub encoding: Encoding,
}

#[cfg(test)]
mod tests;
