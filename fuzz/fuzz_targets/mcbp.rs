//! The memcached binary protocol's framing and what is read out of a frame: frame infos,
//! DCP documents and failover logs, TAP messages, the extras of stores and arithmetic, and a
//! value's extended attributes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::{dcp, mcbp, tap, xattr};

fuzz_target!(|data: &[u8]| {
    let _ = mcbp::frame_len(data, 1 << 20);
    if let Ok(req) = mcbp::parse_request(data) {
        for info in mcbp::frame_infos(req.framing) {
            if info.is_err() {
                break;
            }
        }
        let _ = dcp::DocumentRef::decode(&req);
        let _ = tap::TapConnect::decode(&req);
        let _ = mcbp::split_collection_id(req.key);
        let _ = mcbp::store_extras(req.extras);
        let _ = mcbp::arithmetic_extras(req.extras);
        let _ = mcbp::expiry_extras(req.extras);
        let _ = dcp::decode_failover_log(req.value);
        let _ = xattr::split(req.value);
        let _ = xattr::with_system_attrs(req.value, req.key);
    }
    let _ = mcbp::parse_response(data);
    let _ = tap::TapMessage::decode(data);
});
