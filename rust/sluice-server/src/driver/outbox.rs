//! What a connection has to send, in order: replies written into a buffer, and stored bytes
//! (a TANK consume's bundles) shared from their segments as they are (one vectored write sends
//! both), so that a consume of a megabyte copies nothing in user space.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bytes::{Buf, Bytes};
use tokio::io::AsyncWriteExt;

use crate::tls::MaybeTls;

/// Stored pieces shorter than this are copied into the buffer: below it a copy costs less than
/// another piece of the write.
const SHARED_FROM: usize = 16 << 10;

#[derive(Default)]
pub struct Outbox {
    /// Written since the last shared piece; what the small answers are written into.
    pub buf: Vec<u8>,
    /// What goes before `buf`, in order; never an empty piece.
    pieces: VecDeque<Bytes>,
    /// Bytes in `pieces`.
    queued: usize,
}

impl Outbox {
    pub fn len(&self) -> usize {
        self.queued + self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends stored bytes (bundles), shared rather than copied when they are large.
    pub fn shared(&mut self, b: Bytes) {
        if b.len() < SHARED_FROM {
            self.buf.extend_from_slice(&b);
            return;
        }
        self.seal();
        self.queued += b.len();
        self.pieces.push_back(b);
    }

    /// Moves what the buffer holds into a piece of its own (a copy: it is small, and the
    /// buffer keeps its room).
    fn seal(&mut self) {
        if !self.buf.is_empty() {
            self.queued += self.buf.len();
            self.pieces.push_back(Bytes::copy_from_slice(&self.buf));
            self.buf.clear();
        }
    }

    /// Appends everything unsent to `out`, in order, and empties the outbox: what a connection
    /// handed to another owner still has to send.
    pub fn drain_into(&mut self, out: &mut Vec<u8>) {
        for piece in self.pieces.drain(..) {
            out.extend_from_slice(&piece);
        }
        out.append(&mut self.buf);
        self.queued = 0;
    }

    /// Drops everything unsent.
    pub fn clear(&mut self) {
        self.buf.clear();
        self.pieces.clear();
        self.queued = 0;
    }

    /// Writes everything out, counted in `bytes_out`; the buffer keeps at most about `keep`
    /// bytes of room.
    pub async fn write_to(
        &mut self,
        socket: &mut MaybeTls,
        bytes_out: &AtomicU64,
        keep: usize,
    ) -> std::io::Result<()> {
        if self.pieces.is_empty() {
            return crate::tls::write_out(socket, &mut self.buf, bytes_out, keep).await;
        }
        self.seal();
        bytes_out.fetch_add(self.queued as u64, Relaxed);
        let r = socket.write_all_buf(&mut Pieces(self)).await;
        self.clear();
        r?;
        socket.flush().await
    }
}

/// The pieces as one `Buf`, taken off the front as they are written.
struct Pieces<'a>(&'a mut Outbox);

impl Buf for Pieces<'_> {
    fn remaining(&self) -> usize {
        self.0.queued
    }

    fn chunk(&self) -> &[u8] {
        self.0.pieces.front().map_or(&[], |b| &b[..])
    }

    fn advance(&mut self, mut n: usize) {
        let o = &mut *self.0;
        o.queued -= n;
        while n > 0 {
            let front = o.pieces.front_mut().expect("advanced within what remains");
            if n < front.len() {
                front.advance(n);
                return;
            }
            n -= front.len();
            o.pieces.pop_front();
        }
    }

    fn chunks_vectored<'b>(&'b self, dst: &mut [IoSlice<'b>]) -> usize {
        let mut n = 0;
        for (slot, piece) in dst.iter_mut().zip(&self.0.pieces) {
            *slot = IoSlice::new(piece);
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_come_out_in_order_however_they_are_advanced() {
        let mut o = Outbox::default();
        o.buf.extend_from_slice(b"head1");
        o.shared(Bytes::from(vec![b'a'; SHARED_FROM]));
        o.buf.extend_from_slice(b"head2");
        o.shared(Bytes::from_static(b"small"));
        o.shared(Bytes::from(vec![b'b'; SHARED_FROM + 1]));
        o.seal();
        let mut want = b"head1".to_vec();
        want.extend(vec![b'a'; SHARED_FROM]);
        want.extend_from_slice(b"head2small");
        want.extend(vec![b'b'; SHARED_FROM + 1]);
        assert_eq!(o.len(), want.len());
        let mut got = Vec::new();
        let mut p = Pieces(&mut o);
        let mut step = 1;
        while p.has_remaining() {
            let mut slices = [IoSlice::new(&[]); 2];
            let n = p.chunks_vectored(&mut slices);
            assert!(n >= 1 && !slices[0].is_empty());
            let take = step.min(slices[0].len());
            got.extend_from_slice(&slices[0][..take]);
            p.advance(take);
            step = step * 3 + 1;
        }
        assert_eq!(got, want);
        assert!(o.is_empty());
    }

    #[test]
    fn what_is_handed_over_keeps_its_order() {
        let mut o = Outbox::default();
        o.buf.extend_from_slice(b"head");
        o.shared(Bytes::from(vec![b'a'; SHARED_FROM]));
        o.buf.extend_from_slice(b"tail");
        let mut out = b"first".to_vec();
        o.drain_into(&mut out);
        let mut want = b"firsthead".to_vec();
        want.extend(vec![b'a'; SHARED_FROM]);
        want.extend_from_slice(b"tail");
        assert_eq!(out, want);
        assert!(o.is_empty());
    }
}
