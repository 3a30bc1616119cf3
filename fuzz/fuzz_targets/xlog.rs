//! A WAL or snapshot file as recovery opens it: header, blocks, the torn-tail and corruption
//! verdicts, and the records in each block. The bytes are written to a file in /dev/shm.
#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;
use sluice_core::wal::record;
use sluice_core::wal::xlog::{Next, XlogReader};
use sluice_proto::msgpack::Reader;

static FILES: AtomicU64 = AtomicU64::new(0);

fuzz_target!(|data: &[u8]| {
    let path = std::path::PathBuf::from(format!(
        "/dev/shm/sluice-fuzz-{}-{}.xlog",
        std::process::id(),
        FILES.fetch_add(1, Ordering::Relaxed) % 4
    ));
    std::fs::write(&path, data).expect("write the case");
    if let Ok(mut x) = XlogReader::open(&path) {
        for _ in 0..64 {
            match x.next_block() {
                Ok(Next::Block { payload, .. }) => {
                    let mut r = Reader::new(payload);
                    while !r.is_empty() {
                        if record::decode(&mut r).is_err() {
                            break;
                        }
                    }
                }
                Ok(Next::Torn { offset, .. }) | Ok(Next::Corrupt { offset, .. }) => {
                    let _ = x.resync_after(offset);
                }
                _ => break,
            }
        }
    }
    let _ = std::fs::remove_file(&path);
});
