//! Greenstack's frame and flex decoders on arbitrary bytes: an error or a frame, never a panic;
//! a frame decoded writes back to one that decodes the same; payload maps read or refused.

use proptest::prelude::*;
use sluice_proto::greenstack::payload::{Fields, Mutation};
use sluice_proto::greenstack::{check, flag, Check, FlexEntry, Frame, FrameOut};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn frames(body in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut framed = (body.len() as u32).to_be_bytes().to_vec();
        framed.extend_from_slice(&body);
        let _ = check(&framed, 1 << 16);
        let _ = check(&body, 1 << 16);
        if let Ok(f) = Frame::decode(&body) {
            let entries: Vec<FlexEntry<'_>> = f.flex_entries().map(|e| e.unwrap()).collect();
            let mut out = Vec::new();
            FrameOut {
                opaque: f.opaque,
                opcode: f.opcode,
                flags: f.flags,
                status: f.status,
                flex: &entries,
                payload: f.payload,
            }
            .write(&mut out);
            prop_assert_eq!(check(&out, 1 << 16), Ok(Check::Complete(out.len())));
            let again = Frame::decode(&out[4..]).unwrap();
            prop_assert_eq!(
                (again.opaque, again.opcode, again.status, again.payload),
                (f.opaque, f.opcode, f.status, f.payload)
            );
            // Extra flag bytes (all zero) are not written back; an empty flex header neither.
            let keep = flag::FENCE | flag::MORE | flag::QUIET | flag::RESPONSE;
            prop_assert_eq!(again.flags & keep, f.flags & keep);
            prop_assert_eq!(again.flex_entries().map(|e| e.unwrap()).collect::<Vec<_>>(), entries);
        }
    }

    #[test]
    fn payloads(body in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(f) = Fields::parse(&body) {
            for name in ["id", "type", "value", "flags"] {
                let _ = (f.bytes(name), f.str(name), f.uint(name), f.bool(name));
            }
        }
        let _ = Mutation::parse(&body);
    }
}
