//! WAL records as recovery reads them from a block: a damaged file gives an error, never a
//! panic or an allocation its bytes size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::wal::record;
use sluice_proto::msgpack::Reader;

fuzz_target!(|data: &[u8]| {
    let mut r = Reader::new(data);
    while !r.is_empty() {
        if record::decode(&mut r).is_err() {
            break;
        }
    }
});
