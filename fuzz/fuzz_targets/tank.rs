//! TANK: frames, every request and answer, bundles and their message sets (plain and Snappy).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::tank::{self, bundle::Bundle, request::Request, response};

fuzz_target!(|data: &[u8]| {
    let _ = tank::check(data, 1 << 20);
    if let Some((&id, payload)) = data.split_first() {
        let _ = Request::decode(id, payload);
    }
    let _ = response::ProduceAck::decode(data);
    if let Ok((_, chunk)) = response::ConsumeAnswer::decode(data) {
        for b in response::chunk_bundles(chunk) {
            let _ = Bundle::parse(b);
        }
    }
    let _ = response::PartitionsInfo::decode(data);
    let _ = response::TopicsInfo::decode(data);
    let _ = response::CreateTopicAck::decode(data);
    let _ = response::StatusInfo::decode(data);
    if let Ok(b) = Bundle::parse(data) {
        if b.check_set(1 << 20).is_ok() {
            let mut set = Vec::new();
            if b.decompress_into(&mut set, 1 << 20).is_ok() {
                for m in b.messages(&set, 1) {
                    let _ = m;
                }
            }
        }
    }
    let _ = tank::snappy::check(data, 1 << 20);
});
