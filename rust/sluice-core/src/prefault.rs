//! Faults in memory that is about to be written, on a thread of its own.
//!
//! A topic segment reserves its bytes up front and appends fill them front to back; every
//! 4 KiB page they reach the first time is a page fault, taken by the connection thread while
//! a producer waits for its answer: a quarter of the CPU a 100 KB produce cost. The segment
//! asks for the pages just ahead of its end instead, and this thread takes those faults
//! (`MADV_POPULATE_WRITE`) while the producer is busy sending the next bundle. (Transparent
//! huge pages were tried: on a virtual machine that hands free 2 MiB blocks back to its host,
//! zeroing each new huge page on first touch often cost more than the small faults saved.)
//!
//! Only a hint: when the thread is behind, requests are dropped and the appends take their
//! own faults. Populating changes no byte of memory, so a range freed meanwhile comes to no
//! harm (the call fails, or faults in pages its new owner would have).

use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::OnceLock;

/// Ranges waiting for the thread; past this many, requests are dropped.
const QUEUED: usize = 16;

static REQUESTS: OnceLock<Option<SyncSender<(usize, usize)>>> = OnceLock::new();

/// Asks for the pages of `len` bytes from `addr` to be faulted in, soon, by another thread.
pub(crate) fn ahead(addr: *const u8, len: usize) {
    let requests = REQUESTS.get_or_init(|| {
        let (tx, rx) = sync_channel::<(usize, usize)>(QUEUED);
        std::thread::Builder::new()
            .name("sluice-prefault".into())
            .spawn(move || {
                for (addr, len) in rx {
                    // SAFETY: a hint about address space; populating writes no byte, and a
                    // range no longer mapped makes the call fail, which is ignored.
                    unsafe {
                        libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE);
                    }
                }
            })
            .ok()
            .map(|_| tx)
    });
    if let Some(tx) = requests {
        let _ = tx.try_send((addr as usize, len));
    }
}
