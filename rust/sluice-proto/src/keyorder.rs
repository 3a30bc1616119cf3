//! The order of iproto primary keys: a key is the MessagePack array of its parts, and keys sort
//! as Tarantool's TREE index sorts scalar parts: nil < false < true < numbers (unsigned, signed
//! and floating point compared by value across types, NaN below every other number, as
//! Tarantool's `mp_compare_double` puts it) < strings (bytewise, a prefix first) < binary <
//! anything else (arrays, maps, extensions) by its raw bytes. Keys compare part by part; a key
//! that is a prefix of the other sorts first.
//!
//! Keys come from the network and from replicas, so malformed ones must not panic: they sort
//! after every well-formed key, among themselves by raw bytes. A key is well-formed when it is
//! exactly one array (nothing after it) whose parts are whole values nested at most
//! [`MAX_PART_DEPTH`] deep.

use std::cmp::Ordering;

use crate::msgpack::{Reader, Value};

/// Nesting allowed inside one key part (an array or map used as a part).
pub const MAX_PART_DEPTH: usize = 16;

#[derive(Debug, Clone, Copy)]
enum Num {
    U(u64),
    /// Negative only (the reader yields non-negative signed integers as unsigned).
    I(i64),
    F(f64),
}

#[derive(Debug, Clone, Copy)]
enum Part<'a> {
    Nil,
    Bool(bool),
    Num(Num),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// Arrays, maps and extensions, compared by their encoding.
    Other(&'a [u8]),
}

impl Part<'_> {
    fn class(&self) -> u8 {
        match self {
            Part::Nil => 0,
            Part::Bool(_) => 1,
            Part::Num(_) => 2,
            Part::Str(_) => 3,
            Part::Bin(_) => 4,
            Part::Other(_) => 5,
        }
    }
}

/// Reads one part; also returns whether its encoding is the shortest one for its value (see
/// [`exact_parts`]).
fn read_part<'a>(r: &mut Reader<'a>) -> Option<(Part<'a>, bool)> {
    let before = r.rest();
    let mut look = r.clone();
    let v = look.read_value().ok()?;
    let part = match v {
        Value::Array(_) | Value::Map(_) => {
            return Some((Part::Other(r.read_raw_value(MAX_PART_DEPTH).ok()?), true));
        }
        Value::Nil => Part::Nil,
        Value::Bool(b) => Part::Bool(b),
        Value::UInt(u) => Part::Num(Num::U(u)),
        Value::Int(i) => Part::Num(Num::I(i)),
        Value::F32(f) => Part::Num(Num::F(f as f64)),
        Value::F64(f) => Part::Num(Num::F(f)),
        Value::Str(s) => Part::Str(s),
        Value::Bin(b) => Part::Bin(b),
        Value::Ext(..) => Part::Other(&before[..before.len() - look.rest().len()]),
    };
    let used = before.len() - look.rest().len();
    *r = look;
    let shortest = match part {
        Part::Num(Num::U(u)) => used == uint_len(u),
        Part::Num(Num::I(i)) => used == int_len(i),
        Part::Num(Num::F(_)) => false,
        Part::Str(s) => used == s.len() + str_header_len(s.len()),
        Part::Bin(b) => used == b.len() + bin_header_len(b.len()),
        _ => true,
    };
    Some((part, shortest))
}

fn uint_len(u: u64) -> usize {
    match u {
        0..=0x7f => 1,
        0x80..=0xff => 2,
        0x100..=0xffff => 3,
        0x1_0000..=0xffff_ffff => 5,
        _ => 9,
    }
}

fn int_len(i: i64) -> usize {
    if i >= -32 {
        1
    } else if i >= i8::MIN as i64 {
        2
    } else if i >= i16::MIN as i64 {
        3
    } else if i >= i32::MIN as i64 {
        5
    } else {
        9
    }
}

fn str_header_len(n: usize) -> usize {
    match n {
        0..=31 => 1,
        32..=0xff => 2,
        0x100..=0xffff => 3,
        _ => 5,
    }
}

fn bin_header_len(n: usize) -> usize {
    match n {
        0..=0xff => 2,
        0x100..=0xffff => 3,
        _ => 5,
    }
}

/// The key's parts as a reader positioned after the array header, with their count, when the
/// whole key is well-formed.
fn parts(key: &[u8]) -> Option<(Reader<'_>, u32)> {
    let mut r = Reader::new(key);
    let n = match r.read_value().ok()? {
        Value::Array(n) => n,
        _ => return None,
    };
    let start = r.clone();
    // Every part takes at least one byte: a count above the bytes left is malformed.
    if n as usize > r.rest().len() {
        return None;
    }
    for _ in 0..n {
        read_part(&mut r)?;
    }
    if !r.is_empty() {
        return None;
    }
    Some((start, n))
}

/// Number of parts of a well-formed key, None for a malformed one.
pub fn part_count(key: &[u8]) -> Option<u32> {
    parts(key).map(|(_, n)| n)
}

/// Some(number of parts) when `key` is well-formed and encoded the one shortest way (array
/// header, integers, string and binary lengths) with no floating point part: for such keys,
/// equal in [`compare_keys`] means equal bytes, so a hash lookup of the bytes finds every key
/// equal to it among keys that are exact too.
pub fn exact_parts(key: &[u8]) -> Option<u32> {
    let mut r = Reader::new(key);
    let n = match r.read_value().ok()? {
        Value::Array(n) => n,
        _ => return None,
    };
    let header = match n {
        0..=15 => 1,
        16..=0xffff => 3,
        _ => 5,
    };
    if key.len() - r.rest().len() != header {
        return None;
    }
    for _ in 0..n {
        if !read_part(&mut r)?.1 {
            return None;
        }
    }
    r.is_empty().then_some(n)
}

fn compare_num(a: Num, b: Num) -> Ordering {
    match (a, b) {
        (Num::U(x), Num::U(y)) => x.cmp(&y),
        (Num::I(x), Num::I(y)) => x.cmp(&y),
        (Num::I(_), Num::U(_)) => Ordering::Less,
        (Num::U(_), Num::I(_)) => Ordering::Greater,
        (Num::F(x), Num::F(y)) => match (x.is_nan(), y.is_nan()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (false, false) => x.partial_cmp(&y).expect("not NaN"),
        },
        (Num::F(x), Num::U(y)) => compare_float_uint(x, y),
        (Num::U(x), Num::F(y)) => compare_float_uint(y, x).reverse(),
        (Num::F(x), Num::I(y)) => compare_float_neg(x, y),
        (Num::I(x), Num::F(y)) => compare_float_neg(y, x).reverse(),
    }
}

/// A float against an unsigned integer, exactly (no rounding of the integer to a float).
fn compare_float_uint(f: f64, u: u64) -> Ordering {
    if f.is_nan() || f < 0.0 {
        return Ordering::Less;
    }
    if f >= 18_446_744_073_709_551_616.0 {
        return Ordering::Greater;
    }
    let t = f.trunc();
    // t is an integer in [0, 2^64): the conversion is exact.
    (t as u64).cmp(&u).then(if f > t {
        Ordering::Greater
    } else {
        Ordering::Equal
    })
}

/// A float against a negative integer, exactly.
fn compare_float_neg(f: f64, i: i64) -> Ordering {
    if f.is_nan() || f < -9_223_372_036_854_775_808.0 {
        return Ordering::Less;
    }
    if f >= 0.0 {
        return Ordering::Greater;
    }
    let t = f.trunc();
    // t is an integer in [-2^63, 0): the conversion is exact.
    (t as i64).cmp(&i).then(if f < t {
        Ordering::Less
    } else {
        Ordering::Equal
    })
}

fn compare_part(a: &Part<'_>, b: &Part<'_>) -> Ordering {
    match (a, b) {
        (Part::Nil, Part::Nil) => Ordering::Equal,
        (Part::Bool(x), Part::Bool(y)) => x.cmp(y),
        (Part::Num(x), Part::Num(y)) => compare_num(*x, *y),
        (Part::Str(x), Part::Str(y)) | (Part::Bin(x), Part::Bin(y)) => x.cmp(y),
        (Part::Other(x), Part::Other(y)) => x.cmp(y),
        _ => a.class().cmp(&b.class()),
    }
}

/// Compares the first `n` parts of two well-formed keys' part readers; then the shorter key
/// (fewer than `n` parts in common) first.
fn compare_parts(
    mut ra: Reader<'_>,
    na: u32,
    mut rb: Reader<'_>,
    nb: u32,
    n: u32,
) -> Option<Ordering> {
    for _ in 0..na.min(nb).min(n) {
        let (pa, _) = read_part(&mut ra)?;
        let (pb, _) = read_part(&mut rb)?;
        match compare_part(&pa, &pb) {
            Ordering::Equal => {}
            other => return Some(other),
        }
    }
    Some(na.min(n).cmp(&nb.min(n)))
}

/// Orders two keys (MessagePack arrays of key parts) as described in the module doc.
pub fn compare_keys(a: &[u8], b: &[u8]) -> Ordering {
    compare_first(a, b, u32::MAX)
}

/// Compares `key`'s first n parts with `prefix`, n being the number of parts of `prefix`:
/// Equal when `key` starts with parts equal to all of `prefix`'s, Less when `key` has fewer
/// parts and those equal the start of `prefix`'s. The keys a prefix matches are contiguous in
/// [`compare_keys`] order. Malformed keys and prefixes order as in `compare_keys`.
pub fn compare_prefix(key: &[u8], prefix: &[u8]) -> Ordering {
    match part_count(prefix) {
        Some(n) => compare_first(key, prefix, n),
        None => compare_keys(key, prefix),
    }
}

fn compare_first(a: &[u8], b: &[u8], n: u32) -> Ordering {
    match (parts(a), parts(b)) {
        (Some((ra, na)), Some((rb, nb))) => {
            compare_parts(ra, na, rb, nb, n).expect("both keys were checked whole")
        }
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => a.cmp(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msgpack::{
        write_array_len, write_bin, write_bool, write_f64, write_int, write_nil, write_str,
        write_uint,
    };
    use proptest::prelude::*;

    /// A model key part: the value `compare_keys` should see.
    #[derive(Debug, Clone)]
    enum M {
        Nil,
        Bool(bool),
        U(u64),
        I(i64),
        F(f64),
        S(String),
        B(Vec<u8>),
        /// A nested array of unsigned integers (compared by encoding).
        A(Vec<u8>),
    }

    fn encode(parts: &[M]) -> Vec<u8> {
        let mut out = Vec::new();
        write_array_len(&mut out, parts.len() as u32);
        for p in parts {
            match p {
                M::Nil => write_nil(&mut out),
                M::Bool(b) => write_bool(&mut out, *b),
                M::U(u) => write_uint(&mut out, *u),
                M::I(i) => write_int(&mut out, *i),
                M::F(f) => write_f64(&mut out, *f),
                M::S(s) => write_str(&mut out, s),
                M::B(b) => write_bin(&mut out, b),
                M::A(a) => {
                    write_array_len(&mut out, a.len() as u32);
                    for x in a {
                        write_uint(&mut out, *x as u64);
                    }
                }
            }
        }
        out
    }

    /// The model's order: numbers as exact rationals via i128 and f64 pieces.
    fn model_part(a: &M, b: &M) -> Ordering {
        fn class(m: &M) -> u8 {
            match m {
                M::Nil => 0,
                M::Bool(_) => 1,
                M::U(_) | M::I(_) | M::F(_) => 2,
                M::S(_) => 3,
                M::B(_) => 4,
                M::A(_) => 5,
            }
        }
        // Numbers as (integer part, fraction above it) with NaN lowest; the generator keeps
        // floats within i64 so i128 holds every integer part exactly, and a float's fraction
        // (f - floor(f)) is exact too.
        fn num(m: &M) -> (bool, i128, f64) {
            match m {
                M::U(u) => (true, *u as i128, 0.0),
                M::I(i) => (true, *i as i128, 0.0),
                M::F(f) if f.is_nan() => (false, 0, 0.0),
                M::F(f) => {
                    let fl = f.floor();
                    (true, fl as i128, *f - fl)
                }
                _ => unreachable!(),
            }
        }
        match (a, b) {
            (M::Nil, M::Nil) => Ordering::Equal,
            (M::Bool(x), M::Bool(y)) => x.cmp(y),
            (M::S(x), M::S(y)) => x.as_bytes().cmp(y.as_bytes()),
            (M::B(x), M::B(y)) => x.cmp(y),
            (M::A(_), M::A(_)) => {
                encode(std::slice::from_ref(a)).cmp(&encode(std::slice::from_ref(b)))
            }
            _ if class(a) == 2 && class(b) == 2 => {
                let (x, y) = (num(a), num(b));
                (x.0, x.1).cmp(&(y.0, y.1)).then(x.2.total_cmp(&y.2))
            }
            _ => class(a).cmp(&class(b)),
        }
    }

    fn model(a: &[M], b: &[M]) -> Ordering {
        for (x, y) in a.iter().zip(b) {
            match model_part(x, y) {
                Ordering::Equal => {}
                o => return o,
            }
        }
        a.len().cmp(&b.len())
    }

    fn part() -> impl Strategy<Value = M> {
        prop_oneof![
            Just(M::Nil),
            any::<bool>().prop_map(M::Bool),
            (0u64..6).prop_map(M::U),
            any::<u64>().prop_map(M::U),
            (-6i64..0).prop_map(M::I),
            (i64::MIN..0).prop_map(M::I),
            (-6i32..6, prop_oneof![Just(0.0), Just(0.5), Just(0.25)])
                .prop_map(|(i, f)| M::F(i as f64 + f)),
            (-1e18f64..1e18).prop_map(M::F),
            Just(M::F(f64::NAN)),
            "[ab]{0,3}".prop_map(M::S),
            proptest::collection::vec(0u8..3, 0..3).prop_map(M::B),
            proptest::collection::vec(0u8..3, 0..3).prop_map(M::A),
        ]
    }

    fn key() -> impl Strategy<Value = Vec<M>> {
        proptest::collection::vec(part(), 0..4)
    }

    fn k(parts: &[M]) -> Vec<u8> {
        encode(parts)
    }

    #[test]
    fn scalar_classes_in_tarantool_order() {
        let order = [
            k(&[]),
            k(&[M::Nil]),
            k(&[M::Bool(false)]),
            k(&[M::Bool(true)]),
            k(&[M::F(f64::NAN)]),
            k(&[M::F(f64::NEG_INFINITY)]),
            k(&[M::I(i64::MIN)]),
            k(&[M::F(-1.5)]),
            k(&[M::I(-1)]),
            k(&[M::U(0)]),
            k(&[M::F(0.5)]),
            k(&[M::U(1)]),
            k(&[M::U(1), M::Nil]),
            k(&[M::U(u64::MAX)]),
            k(&[M::F(f64::INFINITY)]),
            k(&[M::S(String::new())]),
            k(&[M::S("a".into())]),
            k(&[M::S("ab".into())]),
            k(&[M::S("b".into())]),
            k(&[M::B(vec![])]),
            k(&[M::B(vec![0])]),
            k(&[M::A(vec![])]),
            // Malformed keys last: not an array, trailing bytes, a truncated part.
            vec![],
            vec![0x01],
            vec![0x91, 0x01, 0x01],
            vec![0x91, 0xa2, b'x'],
        ];
        for (i, a) in order.iter().enumerate() {
            for (j, b) in order.iter().enumerate() {
                assert_eq!(compare_keys(a, b), i.cmp(&j), "{a:02x?} vs {b:02x?}");
            }
        }
    }

    #[test]
    fn numbers_compare_by_value_across_encodings() {
        let one = [0x91, 0x01];
        for other in [
            &[0x91, 0xcc, 0x01][..],
            &[0x91, 0xd0, 0x01],
            &[0x91, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0],
            &[0x91, 0xca, 0x3f, 0x80, 0, 0],
            &[0xdc, 0x00, 0x01, 0x01],
        ] {
            assert_eq!(compare_keys(&one, other), Ordering::Equal, "{other:02x?}");
            assert_eq!(exact_parts(other), None, "{other:02x?}");
        }
        assert_eq!(exact_parts(&one), Some(1));
        // 2^64 - 1 against the float nearest it (2^64), and 2^53 + 1 against 2^53.
        let max = k(&[M::U(u64::MAX)]);
        assert_eq!(
            compare_keys(&max, &k(&[M::F(u64::MAX as f64)])),
            Ordering::Less
        );
        let big = k(&[M::U((1 << 53) + 1)]);
        assert_eq!(
            compare_keys(&big, &k(&[M::F((1u64 << 53) as f64)])),
            Ordering::Greater
        );
        assert_eq!(
            compare_keys(&k(&[M::F(-0.0)]), &k(&[M::U(0)])),
            Ordering::Equal
        );
    }

    #[test]
    fn prefixes_match_keys_that_start_with_them() {
        let key = k(&[M::U(1), M::S("a".into())]);
        assert_eq!(compare_prefix(&key, &k(&[M::U(1)])), Ordering::Equal);
        assert_eq!(compare_prefix(&key, &k(&[])), Ordering::Equal);
        assert_eq!(compare_prefix(&key, &key), Ordering::Equal);
        assert_eq!(compare_prefix(&key, &k(&[M::U(2)])), Ordering::Less);
        assert_eq!(compare_prefix(&key, &k(&[M::U(0)])), Ordering::Greater);
        let short = k(&[M::U(1)]);
        assert_eq!(compare_prefix(&short, &key), Ordering::Less);
        assert_eq!(part_count(&key), Some(2));
        assert_eq!(part_count(&[0x92, 0x01]), None);
    }

    proptest! {
        #[test]
        fn agrees_with_the_model(a in key(), b in key()) {
            prop_assert_eq!(compare_keys(&k(&a), &k(&b)), model(&a, &b));
        }

        #[test]
        fn a_total_order_on_samples(a in key(), b in key(), c in key(), junk in proptest::collection::vec(any::<u8>(), 0..8)) {
            let (a, b, c) = (k(&a), k(&b), k(&c));
            for (x, y) in [(&a, &b), (&b, &c), (&a, &c), (&a, &junk), (&junk, &c)] {
                prop_assert_eq!(compare_keys(x, y), compare_keys(y, x).reverse());
            }
            let mut keys = [a, b, c, junk];
            keys.sort_by(|x, y| compare_keys(x, y));
            for i in 0..keys.len() {
                for j in i..keys.len() {
                    prop_assert_ne!(compare_keys(&keys[i], &keys[j]), Ordering::Greater);
                }
            }
        }

        #[test]
        fn prefix_matches_are_contiguous(mut keys in proptest::collection::vec(key(), 1..12), p in key()) {
            let mut keys: Vec<Vec<u8>> = keys.drain(..).map(|x| k(&x)).collect();
            keys.sort_by(|x, y| compare_keys(x, y));
            let p = k(&p);
            let ords: Vec<Ordering> = keys.iter().map(|x| compare_prefix(x, &p)).collect();
            prop_assert!(ords.windows(2).all(|w| w[0] <= w[1]), "{:?}", ords);
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(a in proptest::collection::vec(any::<u8>(), 0..64), b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = compare_keys(&a, &b);
            let _ = compare_prefix(&a, &b);
            let _ = exact_parts(&a);
            let _ = part_count(&a);
        }
    }
}
