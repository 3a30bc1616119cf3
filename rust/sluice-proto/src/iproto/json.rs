//! Tuples as text for people and for tools that take JSON (`sluice tail --tuples`, the Spark
//! source's columns of `any`, `scalar`, `array` and `map` fields): one MessagePack value as
//! JSON, and Tarantool's UUID and DECIMAL extensions in their usual text forms.
//!
//! JSON has no bytes, so a varbinary, or a string that is not UTF-8, is `{"base64": ...}`;
//! another extension is `{"ext": type, "base64": ...}`; a float that JSON cannot hold (NaN,
//! infinities) is `null`. JSON keys are strings: a map key that is a number, a boolean or nil
//! is its JSON text (`"3"`), any other (bytes, an extension, an array, a map) `"base64:"` and
//! its MessagePack bytes in base64, so that the text stays within a small multiple of the
//! value's size however the keys nest.

use std::fmt::Write as _;

use super::{EXT_DECIMAL, EXT_UUID};
use crate::base64;
use crate::msgpack::{DecodeError, Reader, Value};

/// Appends the next value of `r` to `out` as JSON; arrays and maps nested deeper than
/// `max_depth` are an error, as a truncated or malformed value is.
pub fn write_json(
    r: &mut Reader<'_>,
    out: &mut String,
    max_depth: usize,
) -> Result<(), DecodeError> {
    match r.read_value()? {
        Value::Nil => out.push_str("null"),
        Value::Bool(b) => out.push_str(if b { "true" } else { "false" }),
        Value::UInt(n) => write!(out, "{n}").expect("writing to a String"),
        Value::Int(n) => write!(out, "{n}").expect("writing to a String"),
        Value::F32(f) => write_float(out, f as f64),
        Value::F64(f) => write_float(out, f),
        Value::Str(s) => match std::str::from_utf8(s) {
            Ok(s) => write_string(out, s),
            Err(_) => write_base64(out, s),
        },
        Value::Bin(b) => write_base64(out, b),
        Value::Ext(t, data) => match ext_text(t, data) {
            Some(text) => write_string(out, &text),
            None => {
                write!(
                    out,
                    "{{\"ext\":{t},\"base64\":\"{}\"}}",
                    base64::encode(data)
                )
                .expect("writing to a String");
            }
        },
        Value::Array(n) => {
            let depth = deeper(r, max_depth)?;
            out.push('[');
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                write_json(r, out, depth)?;
            }
            out.push(']');
        }
        Value::Map(n) => {
            let depth = deeper(r, max_depth)?;
            out.push('{');
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                let mut probe = r.clone();
                let key = probe.read_value()?;
                let text = match key {
                    Value::Str(k) => std::str::from_utf8(k).ok(),
                    _ => None,
                };
                if let Some(text) = text {
                    *r = probe;
                    write_string(out, text);
                } else if matches!(
                    key,
                    Value::Nil
                        | Value::Bool(_)
                        | Value::UInt(_)
                        | Value::Int(_)
                        | Value::F32(_)
                        | Value::F64(_)
                ) {
                    let mut scalar = String::new();
                    write_json(r, &mut scalar, depth)?;
                    write_string(out, &scalar);
                } else {
                    let raw = r.read_raw_value(depth)?;
                    write!(out, "\"base64:{}\"", base64::encode(raw)).expect("writing to a String");
                }
                out.push(':');
                write_json(r, out, depth)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

fn deeper(r: &Reader<'_>, max_depth: usize) -> Result<usize, DecodeError> {
    max_depth.checked_sub(1).ok_or(DecodeError::TooDeep {
        offset: r.position(),
        limit: super::MAX_DEPTH,
    })
}

fn write_float(out: &mut String, f: f64) {
    if f.is_finite() {
        // Debug keeps a fraction on whole numbers (1.0, not 1), so the value reads as a float.
        write!(out, "{f:?}").expect("writing to a String");
    } else {
        out.push_str("null");
    }
}

fn write_base64(out: &mut String, bytes: &[u8]) {
    write!(out, "{{\"base64\":\"{}\"}}", base64::encode(bytes)).expect("writing to a String");
}

/// `s` as a JSON string, quoted and escaped.
pub fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                write!(out, "\\u{:04x}", c as u32).expect("writing to a String")
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A UUID or DECIMAL extension as Tarantool prints it; None for other types and for data
/// that is not a well-formed value of the type.
pub fn ext_text(ext_type: i8, data: &[u8]) -> Option<String> {
    match ext_type {
        EXT_UUID => uuid_text(data),
        EXT_DECIMAL => decimal_text(data),
        _ => None,
    }
}

/// 16 bytes as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_text(data: &[u8]) -> Option<String> {
    if data.len() != 16 {
        return None;
    }
    let mut out = String::with_capacity(36);
    for (i, b) in data.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        write!(out, "{b:02x}").expect("writing to a String");
    }
    Some(out)
}

/// Tarantool's DECIMAL: a MessagePack integer scale, then packed BCD digits whose last nibble
/// is the sign (0xb and 0xd negative, 0xa, 0xc, 0xe and 0xf positive). The value is the
/// digits times ten to the minus scale: `-12.50`, `1E+3` reads `1000`.
pub fn decimal_text(data: &[u8]) -> Option<String> {
    let mut r = Reader::new(data);
    let scale = match r.read_value().ok()? {
        Value::UInt(n) => i64::try_from(n).ok()?,
        Value::Int(n) => n,
        _ => return None,
    };
    let bcd = r.rest();
    let (&last, _) = bcd.split_last()?;
    let negative = match last & 0x0f {
        0x0b | 0x0d => true,
        0x0a | 0x0c | 0x0e | 0x0f => false,
        _ => return None,
    };
    let mut digits = String::with_capacity(bcd.len() * 2);
    for (i, &b) in bcd.iter().enumerate() {
        let high = b >> 4;
        if high > 9 {
            return None;
        }
        digits.push((b'0' + high) as char);
        if i + 1 < bcd.len() {
            let low = b & 0x0f;
            if low > 9 {
                return None;
            }
            digits.push((b'0' + low) as char);
        }
    }
    let digits = digits.trim_start_matches('0');
    // Tarantool keeps at most 38 digits, so its scales stay within that many places; a larger
    // one is not a decimal it wrote (and would make a few bytes print as a long run of zeros).
    if scale.unsigned_abs() > 38 {
        return None;
    }
    let mut out = String::new();
    if negative && !digits.is_empty() {
        out.push('-');
    }
    if scale <= 0 {
        if digits.is_empty() {
            out.push('0');
        } else {
            out.push_str(digits);
            out.extend(std::iter::repeat_n('0', scale.unsigned_abs() as usize));
        }
    } else {
        let scale = scale as usize;
        let padded = format!("{digits:0>width$}", width = scale + 1);
        let (whole, fraction) = padded.split_at(padded.len() - scale);
        out.push_str(whole);
        out.push('.');
        out.push_str(fraction);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iproto::MAX_DEPTH;

    fn json(bytes: &[u8]) -> String {
        let mut out = String::new();
        write_json(&mut Reader::new(bytes), &mut out, MAX_DEPTH).unwrap();
        out
    }

    #[test]
    fn tuples_read_as_json() {
        // [1, -2, "a\"b", 1.5, nil, true, bin "\x00\xff", {"k": [2]}, {3: 4}]
        let tuple = b"\x99\x01\xfe\xa3a\"b\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\xc0\xc3\xc4\x02\x00\xff\x81\xa1k\x91\x02\x81\x03\x04";
        assert_eq!(
            json(tuple),
            r#"[1,-2,"a\"b",1.5,null,true,{"base64":"AP8="},{"k":[2]},{"3":4}]"#
        );
        // {[1]: {[2]: 3}}: container keys as their bytes, however deep.
        assert_eq!(
            json(b"\x81\x91\x01\x81\x91\x02\x03"),
            r#"{"base64:kQE=":{"base64:kQI=":3}}"#
        );
        assert_eq!(json(b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00"), "null", "NaN");
        assert_eq!(json(b"\xcb\x40\x00\x00\x00\x00\x00\x00\x00"), "2.0");
        assert_eq!(json(b"\xa2\x01\n"), r#""\u0001\n""#);
        assert_eq!(
            json(b"\xa1\xff"),
            r#"{"base64":"/w=="}"#,
            "a string that is not UTF-8"
        );
        assert_eq!(json(b"\xd4\x05\x07"), r#"{"ext":5,"base64":"Bw=="}"#);
    }

    #[test]
    fn hostile_values_are_errors() {
        let mut out = String::new();
        assert!(write_json(&mut Reader::new(b"\x92\x01"), &mut out, MAX_DEPTH).is_err());
        let deep = vec![0x91u8; MAX_DEPTH + 2];
        assert!(matches!(
            write_json(&mut Reader::new(&deep), &mut String::new(), MAX_DEPTH),
            Err(DecodeError::TooDeep { .. })
        ));
        assert!(write_json(
            &mut Reader::new(b"\xdd\xff\xff\xff\xff"),
            &mut String::new(),
            MAX_DEPTH
        )
        .is_err());
    }

    #[test]
    fn uuids_and_decimals_read_as_tarantool_prints_them() {
        let uuid: Vec<u8> = (0u8..16).map(|i| i * 17).collect();
        let mut packed = vec![0xd8, EXT_UUID as u8];
        packed.extend_from_slice(&uuid);
        assert_eq!(json(&packed), r#""00112233-4455-6677-8899-aabbccddeeff""#);
        assert_eq!(uuid_text(&uuid[..15]), None);
        // Tarantool 2.6: msgpack.encode(decimal.new('-12.50')) = d6 01 02 01 25 0d
        assert_eq!(decimal_text(b"\x02\x01\x25\x0d").as_deref(), Some("-12.50"));
        assert_eq!(decimal_text(b"\x00\x1c").as_deref(), Some("1"));
        assert_eq!(decimal_text(b"\x00\x0c").as_deref(), Some("0"));
        assert_eq!(decimal_text(b"\x03\x5c").as_deref(), Some("0.005"));
        assert_eq!(
            decimal_text(b"\xfe\x1c").as_deref(),
            Some("100"),
            "scale -2"
        );
        assert_eq!(
            decimal_text(b"\x00\x1a\x0c"),
            None,
            "a digit nibble above 9"
        );
        assert_eq!(decimal_text(b"\x00\x11"), None, "no sign nibble");
        assert_eq!(decimal_text(b"\x00"), None);
        assert_eq!(json(b"\xd6\x01\x02\x01\x25\x0d"), r#""-12.50""#);
    }
}
