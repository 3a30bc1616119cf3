//! Tarantool's iproto: framing, requests (and their DML bodies, tuples and update operations),
//! responses, xlog metadata.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::iproto::{client, frame, request, tuple, update, xlog};

fuzz_target!(|data: &[u8]| {
    let _ = frame::check(data, 1 << 20);
    let _ = request::decode(data);
    if let Ok(r) = client::decode_response(data) {
        if let client::Body::Data { .. } = r.body {
            for row in r.rows() {
                let _ = row;
            }
        }
    }
    let _ = client::decode_ballot(data);
    let _ = client::body_vclock(data);
    let _ = xlog::parse_meta(data);
    // The first byte splits the rest into a tuple and update operations on it.
    if let Some((&cut, rest)) = data.split_first() {
        let at = (cut as usize).min(rest.len());
        let (t, ops) = rest.split_at(at);
        let _ = tuple::fields(t);
        if let Ok(parsed) = update::parse_ops(ops, 1) {
            // Field names: "a" is the first field, "b" the second.
            let names = |n: &[u8]| match n {
                b"a" => Some(0),
                b"b" => Some(1),
                _ => None,
            };
            let _ = update::apply(t, &parsed, &names);
            let _ = update::apply_upsert(t, &parsed, &names);
        }
    }
});
