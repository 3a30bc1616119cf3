//! A segment's bytes: reserved once, filled front to back, never moved, and shared with the
//! answers being sent from them.
//!
//! A consume answer carries stored bundles as they are. Sent from here (`share`) instead of
//! copied into the answer, a megabyte answered costs neither a copy nor a fresh megabyte of
//! memory to fault in. An answer still being written when retention drops its segment keeps
//! the bytes it sends alive until it is done.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use bytes::Bytes;

/// The allocation: `cap` bytes from `ptr`.
struct Buffer {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: bytes are written only at or past the filled length, by the one `SegmentBytes` that
// fills the buffer (through `&mut`), and read only below a length it had reached: a shared
// part never sees a byte change.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: rebuilds the empty Vec whose allocation `SegmentBytes::with_capacity` took;
        // u8 needs no drop, so a length of 0 frees it alike.
        unsafe { drop(Vec::from_raw_parts(self.ptr.as_ptr(), 0, self.cap)) }
    }
}

/// The bytes of one segment and how many are filled.
pub(super) struct SegmentBytes {
    buf: Arc<Buffer>,
    len: usize,
}

impl SegmentBytes {
    /// Reserves `cap` bytes; pages not written to are not resident.
    pub(super) fn with_capacity(cap: usize) -> SegmentBytes {
        let mut v = std::mem::ManuallyDrop::new(Vec::<u8>::with_capacity(cap));
        let cap = v.capacity();
        let ptr = NonNull::new(v.as_mut_ptr()).expect("a Vec's pointer is never null");
        SegmentBytes {
            buf: Arc::new(Buffer { ptr, cap }),
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn capacity(&self) -> usize {
        self.buf.cap
    }

    pub(super) fn as_ptr(&self) -> *const u8 {
        self.buf.ptr.as_ptr()
    }

    pub(super) fn as_slice(&self) -> &[u8] {
        // SAFETY: the first `len` bytes were written by `extend_from_slice` and never change.
        unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr(), self.len) }
    }

    /// Appends `bytes`; the caller keeps within the capacity (a full segment rolls over to a
    /// new one first), so going past it is a bug and panics rather than reallocating.
    pub(super) fn extend_from_slice(&mut self, bytes: &[u8]) {
        assert!(
            bytes.len() <= self.buf.cap - self.len,
            "a segment of {} bytes cannot take {} more after {}",
            self.buf.cap,
            bytes.len(),
            self.len
        );
        // SAFETY: within the allocation (checked above), past every byte handed out.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.buf.ptr.as_ptr().add(self.len),
                bytes.len(),
            );
        }
        self.len += bytes.len();
    }

    /// The filled bytes of `range` as a `Bytes` that keeps them alive on its own.
    pub(super) fn share(&self, range: Range<usize>) -> Bytes {
        assert!(range.start <= range.end && range.end <= self.len);
        Bytes::from_owner(Part {
            buf: Arc::clone(&self.buf),
            range,
        })
    }
}

/// Filled bytes of a buffer, held past its segment.
struct Part {
    buf: Arc<Buffer>,
    range: Range<usize>,
}

impl AsRef<[u8]> for Part {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `share` checked the range is within what was filled, which never changes.
        unsafe {
            std::slice::from_raw_parts(
                self.buf.ptr.as_ptr().add(self.range.start),
                self.range.len(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_parts_outlive_the_segment_and_see_no_later_append() {
        let mut s = SegmentBytes::with_capacity(64);
        s.extend_from_slice(b"hello ");
        let part = s.share(0..5);
        s.extend_from_slice(b"world");
        assert_eq!(s.as_slice(), b"hello world");
        let later = s.share(6..11);
        drop(s);
        assert_eq!(&part[..], b"hello");
        assert_eq!(&later[..], b"world");
    }

    #[test]
    #[should_panic(expected = "cannot take")]
    fn appending_past_the_capacity_is_refused() {
        let mut s = SegmentBytes::with_capacity(4);
        s.extend_from_slice(&[0; 5]);
    }
}
