//! TANK's decoders on arbitrary bytes: an error or a value, never a panic, and never an
//! allocation larger than a small multiple of the input (the limits given).

use proptest::prelude::*;
use sluice_proto::tank::bundle::Bundle;
use sluice_proto::tank::request::Request;
use sluice_proto::tank::response::{chunk_bundles, ConsumeAnswer, PartitionsInfo, TopicsInfo};
use sluice_proto::tank::{check, msg, snappy};

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
            let _ = parsed.check_set(4096);
            if let Ok(set) = parsed.messages_bytes(4096) {
                for m in parsed.messages(&set, 0) {
                    if m.is_err() {
                        break;
                    }
                }
            }
        }
    }

    /// What the Snappy check passes decompresses, to the length it gave: arbitrary bytes, and
    /// Snappy that a byte of was changed.
    #[test]
    fn snappy_checks_agree_with_decompressing(
        data in proptest::collection::vec(0u8..4, 0..2000),
        at in any::<usize>(),
        flip in 1u8..=255,
        raw in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut c = snap::raw::Encoder::new().compress_vec(&data).unwrap();
        prop_assert_eq!(snappy::check(&c, 1 << 20), Ok(data.len()));
        let i = at % c.len();
        c[i] ^= flip;
        for input in [&c[..], &raw[..]] {
            if let Ok(len) = snappy::check(input, 1 << 20) {
                let out = snap::raw::Decoder::new().decompress_vec(input);
                prop_assert_eq!(out.map(|o| o.len()).ok(), Some(len));
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
