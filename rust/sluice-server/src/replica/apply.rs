//! Applying what the active streams: one connection's state, shared by the stream
//! connection's thread (small batches, applied as they come) and the replicator's thread (big
//! batches, rollbacks, and the acknowledgements of persistence as the disk catches up).

use super::*;

/// Batches of at most this many changes are applied on the stream connection's thread when
/// nothing handed to the replicator's thread is waiting. Synchronous writes come in batches of
/// one to a few hundred (16 connections x 32 pipelined majority SETs: 64 here gave 192-206k/s
/// and a p99 of 4.7-5.5 ms, 512 gave 204-238k/s and 4.5-5.2 ms in four alternating pairs).
/// Catch-up and bursts come in thousands and go to the replicator's thread, where applying
/// overlaps with reading the next.
pub(super) const INLINE_MAX_CHANGES: usize = 512;

/// One connection's replication state, shared by the stream connection's thread (small
/// batches, applied as they come) and the replicator's thread (big batches, rollbacks, and
/// the acknowledgements of persistence as the disk catches up).
pub(super) struct ReplicaSession {
    pub(super) engine: Arc<Engine>,
    pub(super) bucket: Arc<Bucket>,
    pub(super) link: ConsumerLink,
    pub(super) stats: Arc<ReplicaStats>,
    /// Per vbucket: the snapshot being received and the acknowledgements sent.
    pub(super) snapshots: BTreeMap<u16, Snap>,
    /// Vbuckets whose acknowledgement may move: changes arrived, or some held are not on
    /// disk yet. Only these are looked at after each event.
    pub(super) due: BTreeSet<u16>,
    /// The vbuckets followed are a cluster map's: a refused stream is asked for again (the
    /// map says the active has it), not given up as moved away.
    pub(super) by_map: bool,
    /// Why a batch applied on the stream connection's thread failed: the replicator's thread
    /// ends the connection with it.
    pub(super) failed: Option<ReplicationError>,
    /// The WAL record of the last change applied.
    pub(super) last_lsn: u64,
    /// When this session last asked the WAL for a sync (see `acknowledge`).
    pub(super) sync_asked: Option<Instant>,
    /// Set by the replicator's thread when it stops following this connection.
    pub(super) ended: bool,
}

/// The stream connection's thread offers each batch here first. It is applied at once when
/// it is small, everything handed over before it is applied, and the replicator's thread is
/// not busy with the session; else it is handed over (counted in `handed` until applied).
/// Only while some vbucket's acknowledgement is due does the replicator's thread wait in
/// short polls (`run`): a batch that makes one due from none is handed over, which wakes it.
pub(super) fn take_inline(
    session: &Mutex<ReplicaSession>,
    handed: &AtomicUsize,
    b: Box<Batch>,
) -> Option<Box<Batch>> {
    if b.len() <= INLINE_MAX_CHANGES && handed.load(Ordering::Acquire) == 0 {
        if let Some(mut s) = session.try_lock() {
            if s.ended || s.failed.is_some() {
                // Nothing more is applied on this connection: after a failed batch, another
                // would leave a gap. The next connection resumes from what is held.
                return None;
            }
            if !s.due.is_empty() {
                match s.follow_batch(&b) {
                    Ok(()) => {
                        s.acknowledge();
                        // After the acknowledgement, which majority writes wait for; the
                        // persistence acknowledgements follow the disk as before.
                        s.engine.wal().lead(s.last_lsn);
                    }
                    Err(e) => s.failed = Some(e),
                }
                return None;
            }
        }
    }
    handed.fetch_add(1, Ordering::AcqRel);
    Some(b)
}

/// The replicator's thread: follows until stopped (None) or the connection fails
/// (Some(reason)). On the way out it marks the session ended under its lock, so that nothing
/// is applied on the reader's thread afterwards either.
pub(super) fn run(
    session: &Mutex<ReplicaSession>,
    handed: &AtomicUsize,
    consumer: &Consumer,
    stop: &AtomicBool,
) -> Option<ReplicationError> {
    while !stop.load(Ordering::Acquire) {
        let wait = {
            let mut s = session.lock();
            if let Some(e) = s.failed.take() {
                s.ended = true;
                return Some(e);
            }
            // Short waits while acknowledgements of persistence are still due.
            if s.due.is_empty() {
                Duration::from_millis(100)
            } else {
                Duration::from_millis(2)
            }
        };
        let event = consumer.next_event(wait);
        let mut s = session.lock();
        let why = match event {
            None => None,
            Some(Event::Batch(b)) => {
                let r = s.follow_batch(&b);
                handed.fetch_sub(1, Ordering::AcqRel);
                r.err()
            }
            Some(Event::VbucketState { opaque, .. }) => {
                // Only takeover streams hand vbuckets over; this connection asked for none.
                s.link
                    .respond(dcp::opcode::SET_VBUCKET_STATE, opaque, status::EINVAL);
                None
            }
            Some(Event::Rollback { vbucket, seqno, .. }) => {
                s.stats.connected.store(true, Ordering::Release);
                s.rollback(consumer, Some(handed), vbucket, seqno).err()
            }
            Some(Event::Finished) => Some(ReplicationError::EveryStreamEnded),
            Some(Event::Failed(e)) => Some(ReplicationError::Connection(e)),
        };
        if let Some(why) = why {
            s.ended = true;
            return Some(why);
        }
        s.acknowledge();
    }
    session.lock().ended = true;
    None
}

#[derive(Default)]
pub(super) struct Snap {
    pub(super) seqno: u64,
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) acked: u64,
    pub(super) acked_persisted: u64,
    /// (seqno, WAL LSN) marks of what was applied and is not yet synced, oldest first: the
    /// seqno is on disk once the WAL is synced through the LSN. At most `UNSYNCED_MARKS`; a
    /// newer mark replaces the newest when full, which only acknowledges later what it covers.
    pub(super) unsynced: VecDeque<(u64, u64)>,
}

/// Marks kept per vbucket while its WAL records wait for a sync.
pub(super) const UNSYNCED_MARKS: usize = 4;

/// How often a replica asks its WAL for a sync while it owes acknowledgements of persistence
/// (write mode; in fsync mode every batch is synced anyway).
pub(super) const SYNC_EVERY: Duration = Duration::from_millis(10);

impl Snap {
    /// Notes that everything up to `seqno` is held in WAL records up to `lsn`.
    pub(super) fn applied(&mut self, seqno: u64, lsn: u64) {
        if self.unsynced.len() >= UNSYNCED_MARKS {
            self.unsynced.pop_back();
        }
        self.unsynced.push_back((seqno, lsn));
    }

    /// The highest seqno whose records the WAL has synced (through `synced_lsn`), dropping
    /// the marks that covers.
    pub(super) fn on_disk(&mut self, synced_lsn: u64) -> u64 {
        let mut on_disk = 0;
        while let Some(&(seqno, lsn)) = self.unsynced.front() {
            if lsn > synced_lsn {
                break;
            }
            on_disk = seqno;
            self.unsynced.pop_front();
        }
        on_disk
    }

    /// Everything up to here is held consistently: the end of the current snapshot when it
    /// is whole, else the end of the one before it.
    pub(super) fn consistent(&self) -> u64 {
        if self.seqno >= self.end {
            self.end.max(self.seqno)
        } else {
            self.start.saturating_sub(1)
        }
    }
}

impl ReplicaSession {
    /// Applies a batch of the replication stream and follows the streams it ended or that
    /// were refused; Err when the connection must start over.
    pub(super) fn follow_batch(&mut self, b: &Batch) -> Result<(), ReplicationError> {
        self.stats.connected.store(true, Ordering::Release);
        self.apply(b)?;
        for &vb in &b.refused {
            if self.by_map {
                return Err(ReplicationError::Refused(vb));
            }
            self.given_away(vb)?;
        }
        for &(vb, reason) in &b.ended {
            if reason != stream_end_reason::STATE_CHANGED {
                return Err(ReplicationError::StreamEnded {
                    vbucket: vb,
                    reason,
                });
            }
            // The active's vbucket went pending (a takeover under way: the new stream follows
            // it through) or dead (given away: the new request is refused, see `given_away`).
            log::info!(
                "replication of bucket {:?}: the active's vbucket {vb} changed state; \
                 asking for its stream again",
                self.bucket.name()
            );
            self.link.resume(vb);
        }
        Ok(())
    }

    pub(super) fn apply(&mut self, b: &Batch) -> Result<(), ReplicationError> {
        let now = now_nanos();
        let mut i = 0;
        while i < b.len() {
            let vb = b.vbucket[i];
            let mut j = i;
            while j < b.len() && b.vbucket[j] == vb {
                j += 1;
            }
            let rows = (i..j).map(|r| {
                let key = &b.keys[b.key_offsets[r] as usize..b.key_offsets[r + 1] as usize];
                let value = &b.values[b.value_offsets[r] as usize..b.value_offsets[r + 1] as usize];
                let op = match b.op[r] {
                    0 => ChangeOp::Mutation,
                    1 => ChangeOp::Deletion,
                    _ => ChangeOp::Expiration,
                };
                let meta = ItemMeta {
                    cas: b.cas[r],
                    rev_seqno: b.rev_seqno[r],
                    by_seqno: b.seqno[r],
                    flags: b.flags[r],
                    expiry: b.expiry[r],
                    datatype: b.datatype[r],
                    deleted: false, // the engine sets it from the op
                };
                (op, key, value, meta)
            });
            self.last_lsn = self
                .engine
                .apply_replicated(&self.bucket, vb, rows)
                .map_err(|source| ReplicationError::Apply {
                    vbucket: vb,
                    source,
                })?;
            let newest_cas = b.cas[i..j].iter().copied().max().unwrap_or(0);
            let delay_ms = now.saturating_sub(newest_cas) as f64 / 1e6;
            self.stats.observe_delay(delay_ms);
            self.stats.vbuckets.lock().entry(vb).or_default().lag_ms = delay_ms;
            i = j;
        }
        self.stats
            .items
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        for (vb, pos) in &b.positions {
            let log: Vec<FailoverEntry> = pos
                .failover
                .iter()
                .map(|&(uuid, seqno)| FailoverEntry { uuid, seqno })
                .collect();
            if !log.is_empty() {
                self.engine
                    .adopt_failover_log(&self.bucket, *vb, &log)
                    .map_err(|source| ReplicationError::Vbucket {
                        vbucket: *vb,
                        source,
                    })?;
            }
            let s = self.snapshots.entry(*vb).or_default();
            self.due.insert(*vb);
            s.seqno = pos.seqno;
            s.start = pos.snap_start;
            s.end = pos.snap_end;
            // The batch's last record is at or past every record of this vbucket in it.
            s.applied(pos.seqno, self.last_lsn);
            let mut lags = self.stats.vbuckets.lock();
            let l = lags.entry(*vb).or_default();
            l.active_seqno = l.active_seqno.max(pos.snap_end);
            l.applied_seqno = pos.seqno;
        }
        Ok(())
    }

    /// The active refused the stream of `vb` (NOT_MY_VBUCKET): it gave the vbucket away or
    /// never had it. The copy here goes dead (kept on disk, as the active's is, and refused to
    /// readers and writers) and is no longer followed, here or after a restart.
    pub(super) fn given_away(&mut self, vb: u16) -> Result<(), ReplicationError> {
        self.engine
            .set_vbucket_state(&self.bucket, vb, VbState::Dead)
            .map_err(|source| ReplicationError::Vbucket {
                vbucket: vb,
                source,
            })?;
        self.snapshots.remove(&vb);
        self.due.remove(&vb);
        self.stats.vbuckets.lock().remove(&vb);
        log::warn!(
            "replication of bucket {:?}: the active no longer serves vbucket {vb} \
             (moved away); it is dead here and no longer followed",
            self.bucket.name()
        );
        Ok(())
    }

    /// Rolls back `vb` and the others asked for with it: the answers to a session's stream
    /// requests come together, and the rollbacks share one snapshot. Batches of other
    /// vbuckets arriving meanwhile are applied.
    pub(super) fn rollback(
        &mut self,
        consumer: &Consumer,
        handed: Option<&AtomicUsize>,
        vb: u16,
        seqno: u64,
    ) -> Result<(), ReplicationError> {
        let mut asked = vec![(vb, seqno)];
        let until = Instant::now() + Duration::from_millis(100);
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            match consumer.next_event(left) {
                None => break,
                Some(Event::Rollback { vbucket, seqno, .. }) => asked.push((vbucket, seqno)),
                Some(Event::Batch(b)) => {
                    let r = self.follow_batch(&b);
                    if let Some(h) = handed {
                        h.fetch_sub(1, Ordering::AcqRel);
                    }
                    r?
                }
                Some(Event::VbucketState { opaque, .. }) => {
                    self.link
                        .respond(dcp::opcode::SET_VBUCKET_STATE, opaque, status::EINVAL);
                }
                Some(Event::Finished) => return Err(ReplicationError::EveryStreamEnded),
                Some(Event::Failed(e)) => return Err(ReplicationError::Connection(e)),
            }
        }
        let at = self
            .engine
            .rollback_vbuckets(&self.bucket, &asked)
            .map_err(|source| ReplicationError::Rollback {
                vbuckets: asked.clone(),
                source,
            })?;
        self.stats
            .rollbacks
            .fetch_add(asked.len() as u64, Ordering::Relaxed);
        for (&(vb, _), at) in asked.iter().zip(at) {
            let p = self
                .engine
                .stream_position(&self.bucket, vb)
                .ok_or(ReplicationError::Vanished(vb))?;
            let mut snap = Snap {
                seqno: at,
                start: at,
                end: at,
                ..Default::default()
            };
            // What it was rolled back to is on disk once the WAL is synced as it stands.
            snap.applied(at, self.engine.wal().last_lsn());
            self.snapshots.insert(vb, snap);
            self.due.insert(vb);
            self.link.resume_at(vb, resume_point(&p));
        }
        Ok(())
    }

    /// Tells the active how far each vbucket is held, and on disk, when that moved. On disk
    /// means synced (what `persist_to_majority` promises survives a power loss here too):
    /// while some of what is held is not, the WAL is asked for a sync through the newest
    /// record applied, one sync serving every vbucket and batch that asked meanwhile.
    pub(super) fn acknowledge(&mut self) {
        if self.due.is_empty() {
            return;
        }
        let wal = self.engine.wal();
        let synced_lsn = wal.synced_lsn();
        let mut lags = self.stats.vbuckets.lock();
        let mut acks = Vec::new();
        let mut sync_through = 0;
        self.due.retain(|vb| {
            let Some(s) = self.snapshots.get_mut(vb) else {
                return false;
            };
            let held = s.consistent();
            let on_disk = held.min(s.acked_persisted.max(s.on_disk(synced_lsn)));
            if let Some(&(_, lsn)) = s.unsynced.back() {
                sync_through = sync_through.max(lsn);
            }
            if held > s.acked || on_disk > s.acked_persisted {
                s.acked = s.acked.max(held);
                s.acked_persisted = s.acked_persisted.max(on_disk);
                acks.push((*vb, s.acked, s.acked_persisted));
                let l = lags.entry(*vb).or_default();
                l.acked_seqno = s.acked;
                l.acked_persisted = s.acked_persisted;
            }
            // Kept while what it holds is not all on disk (nor acknowledged as such).
            s.acked_persisted < held
        });
        drop(lags);
        self.link.acknowledge(&acks);
        // At most one sync per SYNC_EVERY: a write-mode replica under a steady stream would
        // otherwise sync after every batch (500 times a second, a third of its WAL thread's
        // time, measured), for acknowledgements only persist_to_majority writes wait for.
        if sync_through > synced_lsn && self.sync_asked.is_none_or(|t| t.elapsed() >= SYNC_EVERY) {
            wal.ask_sync(sync_through);
            self.sync_asked = Some(Instant::now());
        }
    }
}
