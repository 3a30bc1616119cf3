//! One connection's life on the consumer's thread: read frames, answer NOOPs, hand documents
//! to the batch, flush batches to the reader, and end when every stream has.

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sluice_proto::dcp::{
    self, snapshot_flag, stream_end_reason, DcpRequest, DocumentRef, SetVbucketState,
    SnapshotMarker, StreamEnd,
};
use sluice_proto::mcbp::{self, magic, HeaderFields};

use super::flow_control::FlowControl;
use super::{Batch, Command, ConsumerConfig, ConsumerError, Event, EventSender, InlineReader};
use crate::tls::{SyncReader, SyncWriter};

/// A vbucket's stream as the session follows it.
pub(super) struct VbStream {
    pub(super) pos: super::Position,
    /// The producer sent STREAM_END: the position is final.
    pub(super) ended: bool,
    /// The last seqno a range read keeps (`end_seqnos`), u64::MAX for all: looked up once here
    /// rather than per message.
    pub(super) end: u64,
}

/// Largest frame accepted from the producer (a 20 MiB document plus its header and key).
pub(super) const MAX_FRAME_BODY: usize = 21 << 20;
pub(super) const READ_CHUNK: usize = 256 << 10;

/// Bytes of keys and values past which a batch is handed over, whatever its count: a catch-up
/// of large documents must not gather `batch_size` of them in memory at once.
const MAX_BATCH_BYTES: usize = 16 << 20;

/// What was read from the producer and not handled yet. The buffer is zeroed once, when it
/// grows, not on every read: a read of a few bytes costs a few bytes.
#[derive(Default)]
pub(super) struct ReadBuffer {
    buf: Vec<u8>,
    filled: usize,
}

impl ReadBuffer {
    pub(super) fn data(&self) -> &[u8] {
        &self.buf[..self.filled]
    }

    /// One read into the room after the data (at least `READ_CHUNK` of it).
    fn read_from(&mut self, r: &mut impl Read) -> std::io::Result<usize> {
        if self.buf.len() < self.filled + READ_CHUNK {
            self.buf.resize(self.filled + READ_CHUNK, 0);
        }
        let n = r.read(&mut self.buf[self.filled..])?;
        self.filled += n;
        Ok(n)
    }

    /// The first `n` bytes were handled.
    pub(super) fn consume(&mut self, n: usize) {
        self.buf.copy_within(n..self.filled, 0);
        self.filled -= n;
        // A frame larger than the usual room made the buffer grow; give that back.
        if self.filled == 0 && self.buf.len() > 4 * READ_CHUNK {
            self.buf = Vec::new();
        }
    }
}

/// The consumer thread's side of one connection: fields are shared with the `handshake`,
/// `stream` and `flow_control` modules, which add its methods.
pub(super) struct ConsumerSession {
    pub(super) sock: SyncReader,
    pub(super) writer: Arc<Mutex<Option<SyncWriter>>>,
    pub(super) config: ConsumerConfig,
    pub(super) events: EventSender,
    /// Offered each batch before the channel.
    pub(super) inline: Option<InlineReader>,
    pub(super) commands: Receiver<Command>,
    pub(super) inbuf: ReadBuffer,
    /// Looked up once per message: hashed with foldhash, not SipHash.
    pub(super) streams: HashMap<u16, VbStream, foldhash::fast::RandomState>,
    pub(super) batch: Batch,
    pub(super) touched: BTreeSet<u16>,
    /// The vbucket last added to `touched`: a stream's messages come in runs, and most of
    /// them need no look in the set.
    pub(super) last_touched: Option<u16>,
    pub(super) last_message: Instant,
    pub(super) flow: FlowControl,
    /// How long one setup exchange (a request and its whole answer) may take.
    pub(super) setup_timeout: Duration,
}

impl ConsumerSession {
    /// Reads what the socket has; Ok(0) is a timeout (nothing arrived), an error a closed or
    /// broken connection. A read the kernel interrupted is read again: Linux ends a read with a
    /// timeout with EINTR when the process was stopped and resumed (SIGSTOP and SIGCONT: a
    /// debugger, a cgroup freeze), signal handler or not, and the connection is as good as before.
    pub(super) fn read_more(&mut self) -> std::io::Result<usize> {
        loop {
            return match self.inbuf.read_from(&mut self.sock) {
                Ok(0) => Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the producer closed the connection",
                )),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    Ok(0)
                }
                Err(e) => Err(e),
            };
        }
    }

    /// Writes whole frames under the writer's lock: the reader may write too (acknowledgements).
    pub(super) fn send(&mut self, bytes: &[u8]) -> Result<(), ConsumerError> {
        match self.writer.lock().as_mut() {
            Some(w) => w.write_all(bytes).map_err(ConsumerError::Write),
            None => Err(ConsumerError::Closing),
        }
    }

    /// Notes that `vb`'s position moved, for the next batch.
    fn touch(&mut self, vb: u16) {
        if self.last_touched != Some(vb) {
            self.touched.insert(vb);
            self.last_touched = Some(vb);
        }
    }

    /// Leaves `vb`'s position out of the next batch. `last_touched` goes too: the next
    /// `touch` of `vb` must put it back.
    pub(super) fn untouch(&mut self, vb: u16) {
        self.touched.remove(&vb);
        if self.last_touched == Some(vb) {
            self.last_touched = None;
        }
    }

    /// Hands the batch (with the positions it moved) to the reader; false when the reader is gone.
    pub(super) fn flush(&mut self) -> bool {
        if self.batch.is_empty()
            && self.touched.is_empty()
            && self.batch.ended.is_empty()
            && self.batch.refused.is_empty()
            && self.batch.rollbacks.is_empty()
        {
            return true;
        }
        let mut b = std::mem::replace(&mut self.batch, Batch::new());
        self.last_touched = None;
        b.positions = std::mem::take(&mut self.touched)
            .into_iter()
            .filter_map(|vb| self.streams.get(&vb).map(|s| (vb, s.pos.clone())))
            .collect();
        let mut b = Box::new(b);
        if let Some(take) = &mut self.inline {
            match take(b) {
                None => return true,
                Some(back) => b = back,
            }
        }
        self.events.send(Event::Batch(b))
    }

    pub(super) fn run(&mut self) -> Result<(), ConsumerError> {
        let dead_after = Duration::from_secs(2 * self.config.noop_interval as u64);
        loop {
            loop {
                match self.commands.try_recv() {
                    Ok(Command::Resume(vb)) => {
                        if self.streams.contains_key(&vb) {
                            self.request(vb)?;
                        }
                    }
                    Ok(Command::ResumeAt(vb, pos)) => {
                        self.track(vb, pos);
                        self.request(vb)?;
                    }
                    Ok(Command::Close) | Err(TryRecvError::Disconnected) => return Ok(()),
                    Err(TryRecvError::Empty) => break,
                }
            }
            if self.streams.values().all(|s| s.ended) {
                self.flush();
                return Ok(());
            }
            let n = self.read_more().map_err(ConsumerError::ConnectionLost)?;
            if n > 0 {
                self.last_message = Instant::now();
            } else if self.config.noop_interval > 0 && self.last_message.elapsed() > dead_after {
                return Err(ConsumerError::Silent(dead_after));
            }
            let mut consumed = 0;
            while let Some(len) = mcbp::frame_len(&self.inbuf.data()[consumed..], MAX_FRAME_BODY)
                .map_err(ConsumerError::BadFrame)?
            {
                let range = consumed..consumed + len;
                consumed += len;
                let frame = std::mem::take(&mut self.inbuf);
                let r = self.handle(&frame.data()[range]);
                self.inbuf = frame;
                r?;
                let full = self.batch.len() >= self.config.batch_size
                    || self.batch.data_bytes() >= MAX_BATCH_BYTES;
                if full && !self.flush() {
                    return Ok(());
                }
            }
            self.inbuf.consume(consumed);
            // A short read means the producer has nothing more queued right now.
            if n < READ_CHUNK && !self.flush() {
                return Ok(());
            }
            self.acknowledge(n == 0)?;
        }
    }

    fn handle(&mut self, f: &[u8]) -> Result<(), ConsumerError> {
        if f[0] == magic::RESPONSE {
            let r = mcbp::parse_response(f).map_err(ConsumerError::Frame)?;
            if r.opcode == dcp::opcode::STREAM_REQ {
                return self.stream_answer(&r);
            }
            return Ok(());
        }
        let req = mcbp::parse_request(f).map_err(ConsumerError::BadMessage)?;
        if req.opcode == dcp::opcode::NOOP {
            let mut out = Vec::new();
            let h = HeaderFields {
                magic: magic::RESPONSE,
                opcode: dcp::opcode::NOOP,
                opaque: req.opaque,
                ..Default::default()
            };
            let _ = mcbp::write_frame(&mut out, &h, &[], &[], &[], &[]);
            return self.send(&out);
        }
        self.flow.received(f.len());
        let vb = req.vbucket;
        match req.opcode {
            dcp::opcode::MUTATION | dcp::opcode::DELETION | dcp::opcode::EXPIRATION => {
                let d = DocumentRef::decode(&req).map_err(ConsumerError::BadDocument)?;
                let Some(s) = self.streams.get_mut(&vb).filter(|s| !s.ended) else {
                    return Ok(());
                };
                if d.by_seqno <= s.pos.seqno || d.by_seqno > s.pos.snap_end {
                    return Err(ConsumerError::OutOfOrder {
                        vbucket: vb,
                        seqno: d.by_seqno,
                        last: s.pos.seqno,
                        snap_end: s.pos.snap_end,
                    });
                }
                s.pos.seqno = d.by_seqno;
                // The producer ends a stream at the end of the snapshot holding its end seqno;
                // a range read keeps only what lies in the range.
                let past_end = d.by_seqno > s.end;
                self.touch(vb);
                if past_end {
                    return Ok(());
                }
                self.batch.push(&d);
            }
            dcp::opcode::SNAPSHOT_MARKER => {
                let m = SnapshotMarker::decode(&req).map_err(ConsumerError::BadMarker)?;
                if let Some(s) = self.streams.get_mut(&vb) {
                    s.pos.snap_start = m.start_seqno;
                    s.pos.snap_end = m.end_seqno;
                    s.pos.disk = m.flags & snapshot_flag::DISK != 0;
                    self.touch(vb);
                }
            }
            dcp::opcode::SET_VBUCKET_STATE => {
                let m = SetVbucketState::decode(&req).map_err(ConsumerError::BadSetVbucketState)?;
                // The reader applies everything before the hand-over first.
                if !self.flush() {
                    return Ok(());
                }
                self.events.send(Event::VbucketState {
                    vbucket: vb,
                    state: m.state,
                    opaque: req.opaque,
                });
            }
            dcp::opcode::STREAM_END => {
                let e = StreamEnd::decode(&req).map_err(ConsumerError::BadStreamEnd)?;
                if e.reason == stream_end_reason::ROLLBACK && self.streams.contains_key(&vb) {
                    // The producer cut the history this stream served. Asking again from where
                    // we stand brings the rollback it decides, handled as any other.
                    log::info!("DCP stream of vbucket {vb} ended by a rollback; asking again");
                    return self.request(vb);
                }
                if let Some(s) = self.streams.get_mut(&vb).filter(|s| !s.ended) {
                    s.ended = true;
                    if e.reason != stream_end_reason::OK && e.reason != stream_end_reason::CLOSED {
                        log::warn!("DCP stream of vbucket {vb} ended with reason {}", e.reason);
                    }
                    self.batch.ended.push((vb, e.reason));
                }
            }
            _ => {} // other producer messages carry nothing a reader keeps
        }
        Ok(())
    }
}
