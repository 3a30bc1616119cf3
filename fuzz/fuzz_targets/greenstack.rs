//! Greenstack frames, flex headers and msgpack payloads.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::greenstack::{self as gs, payload};

fuzz_target!(|data: &[u8]| {
    let _ = gs::check(data, 1 << 20);
    if let Ok(f) = gs::Frame::decode(data) {
        for e in f.flex_entries() {
            if e.is_err() {
                break;
            }
        }
        let _ = f.flex_value(gs::flex_key::LANE_ID);
        if let Ok(fields) = payload::Fields::parse(f.payload) {
            let _ = fields.bytes("id");
            let _ = fields.str("name");
            let _ = fields.uint("cas");
            let _ = fields.bool("quiet");
        }
    }
    let _ = payload::Mutation::parse(data);
    let _ = payload::get_id(data);
});
