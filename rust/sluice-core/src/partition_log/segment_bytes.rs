//! A segment's bytes: reserved once, filled front to back, never moved, and shared with the
//! answers being sent from them.
//!
//! A consume answer carries stored bundles as they are. Sent from here (`share`) instead of
//! copied into the answer, a megabyte answered costs neither a copy nor a fresh megabyte of
//! memory to fault in. An answer still being written when retention drops its segment keeps
//! the bytes it sends alive until it is done.
//!
//! A topic's segments live in files (`in_file`): appended with `pwrite`, read through a
//! read-only shared mapping of the file. Their bytes are the page cache's, not the process's
//! anonymous memory: a partition retains what the disk holds, and the kernel keeps in memory
//! what is read. A write that does not fit on the disk is an error, not a fault: the mapping is
//! never written through, and never read past what was written. Segments of logs without a
//! directory (tests) are plain memory.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

/// The bytes: `cap` bytes from `ptr`, of an allocation or of a file's mapping.
struct Buffer {
    ptr: NonNull<u8>,
    cap: usize,
    /// Whether `ptr` is a file's mapping (else an allocation).
    mapped: bool,
}

// SAFETY: bytes are written only at or past the filled length, by the one `SegmentBytes` that
// fills the buffer (through `&mut`), and read only below a length it had reached: a shared
// part never sees a byte change.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: unmaps the mapping `SegmentBytes::mapping` made, of this length; nothing
            // borrows it any more (every `Part` holds the `Arc` this is dropped from).
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.cap);
            }
        } else {
            // SAFETY: rebuilds the empty Vec whose allocation `SegmentBytes::with_capacity`
            // took; u8 needs no drop, so a length of 0 frees it alike.
            unsafe { drop(Vec::from_raw_parts(self.ptr.as_ptr(), 0, self.cap)) }
        }
    }
}

/// The bytes of one segment and how many are filled.
pub(super) struct SegmentBytes {
    buf: Arc<Buffer>,
    len: usize,
    /// The file appends are written to, while the segment takes them (a mapping stays valid
    /// once its file is closed: a sealed segment keeps no descriptor open).
    file: Option<Arc<File>>,
    /// Its file's path, if it has one.
    path: Option<PathBuf>,
    /// A sealed segment's file opened again for reading, while answers sent from it hold it
    /// (`file_for_send`).
    reader: Mutex<Weak<File>>,
}

impl SegmentBytes {
    /// Reserves `cap` bytes; pages not written to are not resident.
    pub(super) fn with_capacity(cap: usize) -> SegmentBytes {
        let mut v = std::mem::ManuallyDrop::new(Vec::<u8>::with_capacity(cap));
        let cap = v.capacity();
        let ptr = NonNull::new(v.as_mut_ptr()).expect("a Vec's pointer is never null");
        SegmentBytes {
            buf: Arc::new(Buffer {
                ptr,
                cap,
                mapped: false,
            }),
            len: 0,
            file: None,
            path: None,
            reader: Mutex::new(Weak::new()),
        }
    }

    /// A new, empty segment file at `path` (replacing one there) that takes up to `cap` bytes;
    /// the file grows as it is appended to, and only what is written takes disk.
    pub(super) fn in_file(path: &Path, cap: usize) -> io::Result<SegmentBytes> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        SegmentBytes::mapping(file, path, cap, 0)
    }

    /// The segment file at `path` as it is, holding `len` bytes (which recovery read), that
    /// takes up to `cap` bytes.
    pub(super) fn open_file(path: &Path, cap: usize, len: usize) -> io::Result<SegmentBytes> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        SegmentBytes::mapping(file, path, cap.max(len), len)
    }

    fn mapping(file: File, path: &Path, cap: usize, len: usize) -> io::Result<SegmentBytes> {
        let cap = cap.max(1);
        // SAFETY: a new read-only shared mapping of the file, at an address the kernel picks;
        // the file stays open as long as the mapping (`Buffer`). Past the file's end its pages
        // fault, and only bytes below what was written are ever read.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).expect("a mapping is never at null");
        Ok(SegmentBytes {
            buf: Arc::new(Buffer {
                ptr,
                cap,
                mapped: true,
            }),
            len,
            file: Some(Arc::new(file)),
            path: Some(path.to_path_buf()),
            reader: Mutex::new(Weak::new()),
        })
    }

    /// The file to send its bytes from (`sendfile`): the one appends go to, or for a sealed
    /// segment the file opened again for reading, shared by the answers being sent from it and
    /// closed after the last (a partition keeps no descriptor per sealed segment). None for
    /// memory, or when the file cannot be opened (retention deleted it): the mapping serves.
    pub(super) fn file_for_send(&self) -> Option<Arc<File>> {
        if let Some(f) = &self.file {
            return Some(Arc::clone(f));
        }
        let path = self.path.as_ref()?;
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = reader.upgrade() {
            return Some(f);
        }
        let f = Arc::new(File::open(path).ok()?);
        *reader = Arc::downgrade(&f);
        Some(f)
    }

    /// Its file while it takes appends (to be synced with the WAL).
    pub(super) fn file(&self) -> Option<&Arc<File>> {
        self.file.as_ref()
    }

    /// Whether its bytes are a file's.
    pub(super) fn is_file(&self) -> bool {
        self.buf.mapped
    }

    /// The segment takes no more appends: its file is closed (its bytes stay mapped).
    pub(super) fn seal(&mut self) {
        self.file = None;
    }

    /// Whether appends can go to it (memory, or a file not sealed).
    pub(super) fn takes_appends(&self) -> bool {
        !self.buf.mapped || self.file.is_some()
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

    /// Appends `parts` one after the other: to a file in one `pwritev` (a bundle and its
    /// length cost one system call), to memory by copies. The caller keeps within the capacity
    /// (a full segment rolls over to a new one first), so going past it is a bug and panics
    /// rather than reallocating. A file's write that fails (a full disk) leaves the segment as
    /// it was.
    pub(super) fn extend_from_slices(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        assert!(
            total <= self.buf.cap - self.len,
            "a segment of {} bytes cannot take {} more after {}",
            self.buf.cap,
            total,
            self.len
        );
        match &self.file {
            // What the mapping shows once written: the page cache is one.
            Some(f) => write_all_vectored_at(f, parts, self.len as u64)?,
            None if self.buf.mapped => {
                return Err(io::Error::other("a sealed segment takes no more appends"))
            }
            None => {
                let mut at = self.len;
                for p in parts {
                    // SAFETY: within the allocation (checked above), past every byte handed out.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            p.as_ptr(),
                            self.buf.ptr.as_ptr().add(at),
                            p.len(),
                        );
                    }
                    at += p.len();
                }
            }
        }
        self.len += total;
        Ok(())
    }

    /// Forgets what was appended past `len` (an append taken back, a torn tail cut); a file
    /// is cut there too.
    pub(super) fn truncate(&mut self, len: usize) -> io::Result<()> {
        self.len = self.len.min(len);
        match &self.file {
            Some(f) => f.set_len(self.len as u64),
            None => Ok(()),
        }
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

/// Writes every byte of `parts` at `offset`, in as few `pwritev` calls as the kernel allows.
fn write_all_vectored_at(f: &File, parts: &[&[u8]], offset: u64) -> io::Result<()> {
    let mut skip = 0usize;
    let total: usize = parts.iter().map(|p| p.len()).sum();
    while skip < total {
        // The parts from `skip` on, the first one cut.
        let mut iov = Vec::with_capacity(parts.len());
        let mut passed = 0usize;
        for p in parts {
            let end = passed + p.len();
            if end > skip {
                let from = skip.saturating_sub(passed);
                iov.push(libc::iovec {
                    iov_base: p[from..].as_ptr() as *mut libc::c_void,
                    iov_len: p.len() - from,
                });
            }
            passed = end;
        }
        // SAFETY: every iovec points into a live slice of `parts` for its length; the file
        // descriptor is open for as long as `f`.
        let n = unsafe {
            libc::pwritev(
                f.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                (offset + skip as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => skip += n as usize,
            0 => return Err(io::ErrorKind::WriteZero.into()),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
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
        s.extend_from_slices(&[b"hello "]).unwrap();
        let part = s.share(0..5);
        s.extend_from_slices(&[b"wor", b"ld"]).unwrap();
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
        let _ = s.extend_from_slices(&[&[0; 5]]);
    }

    #[test]
    fn a_file_segment_is_read_through_its_mapping_and_outlives_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("1.log");
        let mut s = SegmentBytes::in_file(&path, 1 << 20).unwrap();
        s.extend_from_slices(&[b"hello "]).unwrap();
        let part = s.share(0..5);
        s.extend_from_slices(&[b"wor", b"ld"]).unwrap();
        assert_eq!(s.as_slice(), b"hello world");
        assert_eq!(std::fs::read(&path).unwrap(), b"hello world");
        // Retention unlinks the file while an answer still sends from it.
        std::fs::remove_file(&path).unwrap();
        drop(s);
        assert_eq!(&part[..], b"hello");
    }
}
