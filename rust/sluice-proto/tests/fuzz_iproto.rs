//! Fuzzing the iproto decoders with arbitrary and mutated input: none may panic, and none may
//! allocate more than a small multiple of its input (so a hostile length or nesting in a packet
//! cannot make the server reserve memory it was not sent). Allocation is measured per thread by
//! a counting allocator; proptest runs each case on the test's own thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use proptest::prelude::*;
use sluice_proto::base64;
use sluice_proto::iproto::tuple::{
    check_format, check_format_and_extract_key, extract_key, FieldDef, FieldType, KeyPart,
};
use sluice_proto::iproto::{frame, json, request, update, xlog, xrow, MAX_DEPTH, MAX_PACKET_SIZE};
use sluice_proto::msgpack::{write_array_len, write_int, write_str, Reader};

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|live| {
            live.set(live.get() + layout.size() as isize);
            let _ = PEAK.try_with(|peak| peak.set(peak.get().max(live.get())));
        });
        System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|live| live.set(live.get() - layout.size() as isize));
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `f` and returns the most memory it held at once beyond what was live before.
fn peak_of(f: impl FnOnce()) -> usize {
    let base = LIVE.with(|l| l.get());
    PEAK.with(|p| p.set(base));
    f();
    (PEAK.with(|p| p.get()) - base).max(0) as usize
}

/// What any decoder may hold for an input of `len` bytes: a few machine words per input byte
/// (one slot per field or operation, each at least a byte) plus small fixed costs (messages,
/// the depth stack of at most MAX_DEPTH entries).
fn bound(len: usize) -> usize {
    64 * len + 64 * 1024
}

/// Packets the captures recorded: each client's PING, AUTH, SELECT, UPDATE, UPSERT, CALL, ID.
const PACKETS: &[&str] = &[
    "0783004001000500",
    "ce0000002c82010100078223a36170702192a9636861702d73686131b4ea9aa922b050404ad6fa96db03a6af361733a2b6",
    "1a830001010005008610cd01191100130012ceffffffff14022090",
    "ce0000001882011200048510cd020011001501219193a12b0301209104",
    "1d830009010005008410cd02001100219305a365766521289193a12b0201",
    "1183000a010005008222a361646421920203",
    "ce0000000e8200490166825403559400010203",
];

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A captured packet with some bytes replaced, inserted or cut off.
fn mutated_packet() -> impl Strategy<Value = Vec<u8>> {
    (
        0..PACKETS.len(),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(i, edits, cut)| {
            let mut p = unhex(PACKETS[i]);
            for (at, byte) in edits {
                let at = at.index(p.len());
                p[at] = byte;
            }
            p.truncate(cut.index(p.len() + 1).max(1));
            p
        })
}

/// An operation list of plausible shapes: real opcodes (and a few wrong ones), field numbers
/// around a small tuple's bounds, and arguments of every kind.
fn plausible_ops() -> impl Strategy<Value = Vec<u8>> {
    let op = (
        prop::sample::select(vec!["=", "!", "#", "+", "-", "&", "|", "^", ":", "?"]),
        -6i64..8,
        prop::sample::select(vec![0i64, 1, -1, 3, 255, i64::MAX, i64::MIN, 1 << 40]),
        any::<bool>(),
        -8i64..8,
    );
    prop::collection::vec(op, 0..8).prop_map(|ops| {
        let mut out = Vec::new();
        write_array_len(&mut out, ops.len() as u32);
        for (name, field, arg, as_str, offset) in ops {
            let splice = name == ":";
            write_array_len(&mut out, if splice { 5 } else { 3 });
            write_str(&mut out, name);
            write_int(&mut out, field);
            if splice {
                write_int(&mut out, offset);
                write_int(&mut out, arg.clamp(-8, 8));
                write_str(&mut out, "xy");
            } else if as_str {
                write_str(&mut out, "s");
            } else {
                write_int(&mut out, arg);
            }
        }
        out
    })
}

/// A small tuple of mixed fields.
fn plausible_tuple() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            any::<i64>().prop_map(|v| {
                let mut b = Vec::new();
                write_int(&mut b, v);
                b
            }),
            "[a-z]{0,6}".prop_map(|s| {
                let mut b = Vec::new();
                write_str(&mut b, &s);
                b
            }),
            Just(vec![0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0]),
            Just(vec![0xc0]),
        ],
        0..6,
    )
    .prop_map(|fields| {
        let mut out = Vec::new();
        write_array_len(&mut out, fields.len() as u32);
        fields.iter().for_each(|f| out.extend_from_slice(f));
        out
    })
}

fn format() -> Vec<FieldDef> {
    [
        FieldType::Unsigned,
        FieldType::String,
        FieldType::Number,
        FieldType::Double,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, field_type)| FieldDef {
        name: format!("f{i}"),
        field_type,
        is_nullable: i > 1,
    })
    .collect()
}

fn check_frame_and_request(bytes: &[u8]) {
    let held = peak_of(|| {
        let _ = frame::check(bytes, MAX_PACKET_SIZE);
        let _ = request::decode(bytes);
    });
    assert!(
        held <= bound(bytes.len()),
        "{held} bytes held for {} of input",
        bytes.len()
    );
}

fn check_update(tuple: &[u8], ops: &[u8], index_base: u32) {
    let fmt = format();
    let held = peak_of(|| {
        if let Ok(parsed) = update::parse_ops(ops, index_base) {
            let _ = update::apply(tuple, &parsed, &|name| (name == b"f1").then_some(1));
            let _ = update::apply_upsert_in_format(tuple, &parsed, &fmt);
        }
        let _ = check_format(tuple, &fmt);
        let _ = extract_key(
            tuple,
            &[KeyPart {
                field_no: 0,
                field_type: FieldType::Unsigned,
            }],
        );
    });
    let len = tuple.len() + ops.len();
    assert!(held <= bound(len), "{held} bytes held for {len} of input");
}

/// A write's one pass over its tuple answers as the format check and then the key would: the
/// same key, or the same first error.
fn check_one_pass_agrees(tuple: &[u8]) -> Result<(), TestCaseError> {
    let fmt = format();
    for parts in [
        vec![KeyPart {
            field_no: 0,
            field_type: FieldType::Unsigned,
        }],
        vec![
            KeyPart {
                field_no: 3,
                field_type: FieldType::Double,
            },
            KeyPart {
                field_no: 1,
                field_type: FieldType::String,
            },
        ],
        vec![KeyPart {
            field_no: 9,
            field_type: FieldType::Scalar,
        }],
    ] {
        let in_turn = check_format(tuple, &fmt).and_then(|()| extract_key(tuple, &parts));
        prop_assert_eq!(check_format_and_extract_key(tuple, &fmt, &parts), in_turn);
    }
    Ok(())
}

proptest! {
    #[test]
    fn one_pass_key_agrees_on_arbitrary_bytes(tuple in prop::collection::vec(any::<u8>(), 0..128)) {
        check_one_pass_agrees(&tuple)?;
    }

    #[test]
    fn one_pass_key_agrees_on_plausible_tuples(tuple in plausible_tuple()) {
        check_one_pass_agrees(&tuple)?;
    }

    #[test]
    fn fuzz_frame_and_request_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_frame_and_request(&bytes);
    }

    #[test]
    fn fuzz_request_mutated_captures(packet in mutated_packet()) {
        check_frame_and_request(&packet);
    }

    #[test]
    fn fuzz_update_arbitrary_bytes(
        tuple in prop::collection::vec(any::<u8>(), 0..128),
        ops in prop::collection::vec(any::<u8>(), 0..256),
        index_base in 0u32..3,
    ) {
        check_update(&tuple, &ops, index_base);
    }

    #[test]
    fn fuzz_update_plausible_operations(
        tuple in plausible_tuple(),
        ops in plausible_ops(),
        index_base in 0u32..2,
    ) {
        check_update(&tuple, &ops, index_base);
    }

    /// Rows of Tarantool's files and replication streams, and the files' block headers and
    /// meta blocks: decoded and printed as JSON without a panic, within the usual bound
    /// (the JSON text itself aside: it is bounded by the input's size times a constant).
    #[test]
    fn fuzz_xrow_and_xlog_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let held = peak_of(|| {
            let mut r = Reader::new(&bytes);
            while !r.is_empty() {
                let Ok(row) = xrow::decode_row(&mut r) else { break };
                let mut text = String::with_capacity(16 * bytes.len() + 64);
                let _ = row.write_json(&mut text);
            }
            let mut fix = [0u8; xlog::FIXHEADER_SIZE];
            let n = bytes.len().min(fix.len());
            fix[..n].copy_from_slice(&bytes[..n]);
            let _ = xlog::decode_fixheader(&fix);
            let _ = xlog::parse_meta(&bytes);
        });
        prop_assert!(held <= 16 * bytes.len() + 64 + bound(bytes.len()));
    }

    /// Any bytes as JSON (tuples printed by tail and the Spark columns) and as Tarantool's
    /// DECIMAL: no panic, and the text within a small multiple of the input, however the
    /// values and map keys nest.
    #[test]
    fn fuzz_json_and_decimal_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut text = String::new();
        let _ = json::write_json(&mut sluice_proto::msgpack::Reader::new(&bytes), &mut text, MAX_DEPTH);
        prop_assert!(text.len() <= 16 * bytes.len() + 64, "{} bytes of JSON for {}", text.len(), bytes.len());
        let _ = json::decimal_text(&bytes);
    }

    /// base64 refuses what is not padded standard base64 without a panic, and reads back what
    /// it writes.
    #[test]
    fn fuzz_base64_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = base64::decode(&bytes);
        prop_assert_eq!(base64::decode(base64::encode(&bytes).as_bytes()), Some(bytes));
    }

    #[test]
    fn fuzz_check_format_arbitrary_bytes(tuple in prop::collection::vec(any::<u8>(), 0..256)) {
        let fmt = format();
        let held = peak_of(|| { let _ = check_format(&tuple, &fmt); });
        prop_assert!(held <= bound(tuple.len()));
    }
}

/// Hostile headers cost nothing up front: a count of 2^32 elements, a string of 4 GiB and a
/// million levels of nesting, each announced in a few bytes.
#[test]
fn fuzz_hostile_lengths_and_nesting_are_cheap() {
    let mut nested = vec![
        0xce, 0x00, 0x0f, 0x42, 0x47, 0x82, 0x00, 0x02, 0x01, 0x01, 0x82, 0x10, 0x01, 0x21,
    ];
    nested.extend(std::iter::repeat_n(0x91, 1_000_000));
    let inputs: Vec<Vec<u8>> = vec![
        unhex(
            "ce0000000b820001010182dd ffffffff"
                .replace(' ', "")
                .as_str(),
        ),
        unhex(
            "ce0000000c82000201018210012 1dbffffffff"
                .replace(' ', "")
                .as_str(),
        ),
        nested.clone(),
    ];
    for input in &inputs {
        check_frame_and_request(input);
        check_update(input, input, 1);
    }
    check_update(&nested[13..], &nested[13..], 0);
    let mut many_ops = vec![0xdd, 0xff, 0xff, 0xff, 0xff];
    many_ops.extend(std::iter::repeat_n(0x90, 64));
    check_update(&[0x90], &many_ops, 0);
}

/// The measure itself: what a closure holds is seen, what it frees is not counted twice.
#[test]
fn fuzz_allocation_measure_sees_what_is_held() {
    let held = peak_of(|| {
        let a = vec![0u8; 100_000];
        drop(a);
        let b = vec![0u8; 10_000];
        std::hint::black_box(&b);
    });
    assert!((100_000..110_000).contains(&held), "{held}");
}
