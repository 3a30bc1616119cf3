//! What a connection has to send, in order: replies written into a buffer, and stored bytes
//! (a TANK consume's bundles) shared from their segments as they are, so that a consume of a
//! megabyte copies nothing in user space. On a plain connection the stored bytes go from their
//! segment file with `sendfile` (the kernel hands page-cache pages to the socket; a NIC that
//! gathers sends them without a copy at all), the replies between them with vectored writes
//! marked `MSG_MORE` so that a header and its bundles leave in the same packets. A TLS
//! connection encrypts them from the segment's mapping.

use std::collections::VecDeque;
use std::fs::File;
use std::io::IoSlice;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use bytes::{Buf, Bytes};
use sluice_core::partition_log::SharedChunk;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpStream;

use crate::tls::MaybeTls;

/// Stored pieces shorter than this are copied into the buffer: below it a copy costs less than
/// another piece of the write.
const SHARED_FROM: usize = 16 << 10;

/// Pieces a `writev` or `sendmsg` takes at most (Linux's UIO_MAXIOV is 1,024).
const MAX_IOV: usize = 64;

#[derive(Default)]
pub struct Outbox {
    /// Written since the last shared piece; what the small answers are written into.
    pub buf: Vec<u8>,
    /// What goes before `buf`, in order; never an empty piece.
    pieces: VecDeque<Piece>,
    /// Bytes in `pieces`.
    queued: usize,
}

/// Bytes to send, and where they lie in a file if they are a file's.
struct Piece {
    bytes: Bytes,
    file: Option<(Arc<File>, u64)>,
}

impl Piece {
    fn advance(&mut self, n: usize) {
        self.bytes.advance(n);
        if let Some((_, at)) = &mut self.file {
            *at += n as u64;
        }
    }
}

impl Outbox {
    pub fn len(&self) -> usize {
        self.queued + self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends stored bytes (bundles), shared rather than copied when they are large.
    pub fn shared(&mut self, chunk: SharedChunk) {
        if chunk.bytes.len() < SHARED_FROM {
            self.buf.extend_from_slice(&chunk.bytes);
            return;
        }
        self.seal();
        self.queued += chunk.bytes.len();
        self.pieces.push_back(Piece {
            bytes: chunk.bytes,
            file: chunk.file,
        });
    }

    /// Moves what the buffer holds into a piece of its own (a copy: it is small, and the
    /// buffer keeps its room).
    fn seal(&mut self) {
        if !self.buf.is_empty() {
            self.queued += self.buf.len();
            self.pieces.push_back(Piece {
                bytes: Bytes::copy_from_slice(&self.buf),
                file: None,
            });
            self.buf.clear();
        }
    }

    /// Appends everything unsent to `out`, in order, and empties the outbox: what a connection
    /// handed to another owner still has to send.
    pub fn drain_into(&mut self, out: &mut Vec<u8>) {
        for piece in self.pieces.drain(..) {
            out.extend_from_slice(&piece.bytes);
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
        let r = match socket {
            MaybeTls::Plain(tcp) => self.send_plain(tcp).await,
            MaybeTls::Tls(_) => socket.write_all_buf(&mut Pieces(self)).await,
        };
        self.clear();
        r?;
        socket.flush().await
    }

    /// Sends the pieces on a plain connection: file pieces with `sendfile`, the others
    /// gathered into one `sendmsg`, marked `MSG_MORE` when a file piece follows.
    async fn send_plain(&mut self, tcp: &TcpStream) -> std::io::Result<()> {
        while let Some(front) = self.pieces.front() {
            let sent = if let Some((file, at)) = &front.file {
                let (file, at, len) = (Arc::clone(file), *at, front.bytes.len());
                match tcp
                    .async_io(Interest::WRITABLE, || send_file(tcp, &file, at, len))
                    .await
                {
                    Ok(n) => n,
                    // A file system that cannot send from its files: the bytes are sent from
                    // the mapping instead.
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
                        ) =>
                    {
                        self.pieces.front_mut().expect("the front piece").file = None;
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            } else {
                tcp.async_io(Interest::WRITABLE, || self.send_memory(tcp))
                    .await?
            };
            if sent == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            Pieces(self).advance(sent);
        }
        Ok(())
    }

    /// One `sendmsg` of the memory pieces at the front, up to the first file piece.
    fn send_memory(&self, tcp: &TcpStream) -> std::io::Result<usize> {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_IOV];
        let mut n = 0;
        let mut more = false;
        for piece in &self.pieces {
            if piece.file.is_some() {
                more = true;
                break;
            }
            if n == MAX_IOV {
                more = true;
                break;
            }
            iov[n] = libc::iovec {
                iov_base: piece.bytes.as_ptr() as *mut libc::c_void,
                iov_len: piece.bytes.len(),
            };
            n += 1;
        }
        // SAFETY: a zeroed msghdr is valid (no name, no control data); `iov` points at `n`
        // iovecs, each into a live piece for its length, for the length of the call.
        let sent = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n as _;
            let flags = libc::MSG_NOSIGNAL | if more { libc::MSG_MORE } else { 0 };
            libc::sendmsg(tcp.as_raw_fd(), &msg, flags)
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(sent as usize)
    }
}

/// One `sendfile` of up to `len` bytes of `file` from `at` to the socket.
fn send_file(tcp: &TcpStream, file: &File, at: u64, len: usize) -> std::io::Result<usize> {
    let mut offset = at as libc::off_t;
    // SAFETY: both descriptors are open for the call (`tcp` and `file` are borrowed); the
    // kernel reads the file from `offset` and moves its own copy of it.
    let sent = unsafe { libc::sendfile(tcp.as_raw_fd(), file.as_raw_fd(), &mut offset, len) };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(sent as usize)
}

/// The pieces as one `Buf`, taken off the front as they are written.
struct Pieces<'a>(&'a mut Outbox);

impl Buf for Pieces<'_> {
    fn remaining(&self) -> usize {
        self.0.queued
    }

    fn chunk(&self) -> &[u8] {
        self.0.pieces.front().map_or(&[], |p| &p.bytes[..])
    }

    fn advance(&mut self, mut n: usize) {
        let o = &mut *self.0;
        o.queued -= n;
        while n > 0 {
            let front = o.pieces.front_mut().expect("advanced within what remains");
            if n < front.bytes.len() {
                front.advance(n);
                return;
            }
            n -= front.bytes.len();
            o.pieces.pop_front();
        }
    }

    fn chunks_vectored<'b>(&'b self, dst: &mut [IoSlice<'b>]) -> usize {
        let mut n = 0;
        for (slot, piece) in dst.iter_mut().zip(&self.0.pieces) {
            *slot = IoSlice::new(&piece.bytes);
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(v: Vec<u8>) -> SharedChunk {
        SharedChunk {
            bytes: Bytes::from(v),
            file: None,
        }
    }

    #[test]
    fn pieces_come_out_in_order_however_they_are_advanced() {
        let mut o = Outbox::default();
        o.buf.extend_from_slice(b"head1");
        o.shared(memory(vec![b'a'; SHARED_FROM]));
        o.buf.extend_from_slice(b"head2");
        o.shared(memory(b"small".to_vec()));
        o.shared(memory(vec![b'b'; SHARED_FROM + 1]));
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
        o.shared(memory(vec![b'a'; SHARED_FROM]));
        o.buf.extend_from_slice(b"tail");
        let mut out = b"first".to_vec();
        o.drain_into(&mut out);
        let mut want = b"firsthead".to_vec();
        want.extend(vec![b'a'; SHARED_FROM]);
        want.extend_from_slice(b"tail");
        assert_eq!(out, want);
        assert!(o.is_empty());
    }

    #[tokio::test]
    async fn a_plain_connection_gets_file_pieces_and_replies_in_order() {
        use std::io::Write;
        use tokio::io::AsyncReadExt;

        // A file whose middle is sent from the file (the mapping's bytes would be the same
        // ones; here they are not, to show which were sent).
        let mut f = tempfile::tempfile().unwrap();
        let content: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&content).unwrap();
        let file = Arc::new(f);
        let piece = |from: usize, len: usize| SharedChunk {
            bytes: Bytes::from(vec![b'?'; len]),
            file: Some((Arc::clone(&file), from as u64)),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let mut socket = MaybeTls::Plain(listener.accept().await.unwrap().0);

        let mut o = Outbox::default();
        let mut want = Vec::new();
        for (i, (from, len)) in [(0, 20_000), (1_000, 150_000), (180_000, 20_000)]
            .into_iter()
            .enumerate()
        {
            let head = format!("head{i}");
            o.buf.extend_from_slice(head.as_bytes());
            want.extend_from_slice(head.as_bytes());
            o.shared(piece(from, len));
            want.extend_from_slice(&content[from..from + len]);
        }
        o.buf.extend_from_slice(b"tail");
        want.extend_from_slice(b"tail");
        let total = want.len();
        let reader = tokio::spawn(async move {
            let mut got = vec![0; total];
            client.read_exact(&mut got).await.unwrap();
            got
        });
        let out = AtomicU64::new(0);
        o.write_to(&mut socket, &out, 1024).await.unwrap();
        assert!(o.is_empty());
        assert_eq!(out.load(Relaxed), total as u64);
        let got = reader.await.unwrap();
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            first.is_none(),
            "the bytes differ from {first:?}: {:?}",
            &got[first.unwrap()..first.unwrap() + 20]
        );
    }
}
