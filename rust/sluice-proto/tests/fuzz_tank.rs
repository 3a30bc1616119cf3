//! TANK's decoders on arbitrary bytes: an error or a value, never a panic, and never an
//! allocation larger than a small multiple of the input (the limits given).

use proptest::prelude::*;
use sluice_proto::tank::bundle::Bundle;
use sluice_proto::tank::request::Request;
use sluice_proto::tank::response::{chunk_bundles, ConsumeAnswer, PartitionsInfo, TopicsInfo};
use sluice_proto::tank::{check, msg};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn requests(id in 0u8..16, body in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = check(&body, 1 << 16);
        if let Ok(req) = Request::decode(id, &body) {
            let mut out = Vec::new();
            req.write(&mut out);
            // The same request again (its bytes may differ: a varint need not be minimal).
            prop_assert_eq!(Request::decode(id, &out[5..]), Ok(req));
        }
    }

    #[test]
    fn answers(body in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = ConsumeAnswer::decode(&body);
        let _ = PartitionsInfo::decode(&body);
        let _ = TopicsInfo::decode(&body);
        for b in chunk_bundles(&body) {
            let _ = Bundle::parse(b);
        }
    }

    #[test]
    fn bundles(body in proptest::collection::vec(any::<u8>(), 0..300), snappy in any::<bool>()) {
        let mut b = body.clone();
        if snappy && !b.is_empty() {
            b[0] = (b[0] & !0x83) | 0x01;
        }
        if let Ok(parsed) = Bundle::parse(&b) {
            if let Ok(set) = parsed.messages_bytes(4096) {
                for m in parsed.messages(&set, 0) {
                    if m.is_err() {
                        break;
                    }
                }
            }
        }
    }
}

#[test]
fn the_request_ids_decoded_are_the_ones_served() {
    for id in [msg::RELOAD_CONF, msg::CONSUME_PEER, msg::DISCOVER_TOPOLOGY] {
        assert!(Request::decode(id, &[]).is_err());
    }
}
