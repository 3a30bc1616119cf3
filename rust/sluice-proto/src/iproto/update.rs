//! UPDATE and UPSERT operations as Tarantool 2.6 parses and applies them
//! (src/box/xrow_update.c, xrow_update_field.c, xrow_update_array.c):
//! `=` set, `!` insert, `#` delete, `+ -` arithmetic, `& | ^` bitwise, `:` splice. Field numbers
//! are 0- or 1-based as the request's INDEX_BASE says, negative ones count from the end, and a
//! field may be named (resolved from the space format by the caller). Nested JSON paths and
//! decimal arithmetic are not supported.

use std::borrow::Cow;

use super::codes;
use super::tuple::{fields, FieldDef, FieldType, TupleError};
use super::{mp_type, MpType, MAX_DEPTH};
use crate::msgpack::{write_f64, write_int, write_str_bytes, write_uint, Reader, Value};

/// The most operations one request may carry (BOX_UPDATE_OP_CNT_MAX).
pub const MAX_OPS: u32 = 4000;

/// Which field an operation targets, as the client gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldRef<'a> {
    /// 0-based when non-negative (INDEX_BASE already taken off); negative counts from the end
    /// (-1 is the last field).
    No(i32),
    /// A field name (or `[N]`, 1-based), resolved against the space format when applied.
    Name(&'a [u8]),
}

/// A number as an arithmetic operation reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    /// Any MessagePack integer (the sum of two fits i128 whatever they are).
    Int(i128),
    Float(f32),
    Double(f64),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OpArg<'a> {
    /// `=` and `!`: the new field, one whole MessagePack value.
    Value(&'a [u8]),
    /// `+` and `-`.
    Number(Number),
    /// `&`, `|`, `^`.
    Bits(u64),
    /// `:`: `offset` with INDEX_BASE taken off when non-negative, `cut` bytes replaced by
    /// `paste`.
    Splice {
        offset: i32,
        cut: i32,
        paste: &'a [u8],
    },
    /// `#`: how many fields to delete (never 0).
    Delete(u32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateOp<'a> {
    /// `b'='`, `b'+'`, ...
    pub opcode: u8,
    pub field: FieldRef<'a>,
    pub arg: OpArg<'a>,
}

fn illegal(what: &str) -> TupleError {
    TupleError::new(
        codes::ER_ILLEGAL_PARAMS,
        format!("Illegal parameters, {what}"),
    )
}

/// How Tarantool names a field in an operation's error: 'name', a 1-based number, or the
/// negative number as given.
fn field_str(field: FieldRef<'_>) -> String {
    match field {
        FieldRef::Name(n) => format!("'{}'", String::from_utf8_lossy(n)),
        FieldRef::No(n) if n >= 0 => (n + 1).to_string(),
        FieldRef::No(n) => n.to_string(),
    }
}

fn arg_type(opcode: u8, field: FieldRef<'_>, expected: &str) -> TupleError {
    TupleError::new(
        codes::ER_UPDATE_ARG_TYPE,
        format!(
            "Argument type in operation '{}' on field {} does not match field type: expected {}",
            opcode as char,
            field_str(field),
            expected
        ),
    )
}

fn field_error(field: FieldRef<'_>, reason: &str) -> TupleError {
    TupleError::new(
        codes::ER_UPDATE_FIELD,
        format!("Field {} UPDATE error: {}", field_str(field), reason),
    )
}

fn splice_bound(field: FieldRef<'_>) -> TupleError {
    TupleError::new(
        codes::ER_UPDATE_SPLICE,
        format!(
            "SPLICE error on field {}: offset is out of bound",
            field_str(field)
        ),
    )
}

fn no_such_field(field: FieldRef<'_>) -> TupleError {
    match field {
        FieldRef::Name(_) => TupleError::new(
            codes::ER_NO_SUCH_FIELD_NAME,
            format!("Field '{}' was not found in the tuple", field_str(field)),
        ),
        FieldRef::No(n) => TupleError::new(
            codes::ER_NO_SUCH_FIELD_NO,
            format!(
                "Field {} was not found in the tuple",
                if n >= 0 { n + 1 } else { n }
            ),
        ),
    }
}

/// An int32 (mp_read_int32): any integer marker holding a value in range.
fn read_i32(r: &mut Reader<'_>) -> Option<i32> {
    match r.read_value().ok()? {
        Value::UInt(v) => i32::try_from(v).ok(),
        Value::Int(v) => i32::try_from(v).ok(),
        _ => None,
    }
}

/// A number as `+`/`-` take it, by MessagePack class; None for anything else.
fn read_number(r: &mut Reader<'_>) -> Option<Number> {
    Some(match r.read_value().ok()? {
        Value::UInt(v) => Number::Int(v as i128),
        Value::Int(v) => Number::Int(v as i128),
        Value::F32(v) => Number::Float(v),
        Value::F64(v) => Number::Double(v),
        _ => return None,
    })
}

/// Parses an operation list (`[[op, field, args...], ...]`), checking each operation's name,
/// arity and argument types, with Tarantool's messages.
pub fn parse_ops(ops: &[u8], index_base: u32) -> Result<Vec<UpdateOp<'_>>, TupleError> {
    let index_base = index_base.min(i32::MAX as u32) as i32;
    let mut r = Reader::new(ops);
    if ops.first().map(|&m| mp_type(m)) != Some(MpType::Array) {
        return Err(illegal(
            "update operations must be an array {{op,..}, {op,..}}",
        ));
    }
    let unpack = |_| illegal("can't unpack update operations");
    let count = r.read_array_len().map_err(unpack)?;
    if count > MAX_OPS {
        return Err(illegal("too many operations for update"));
    }
    // Every operation takes at least two bytes of input.
    let mut out = Vec::with_capacity((count as usize).min(ops.len() / 2));
    for op_num in 1..=count {
        out.push(parse_op(&mut r, op_num, index_base)?);
    }
    if !r.is_empty() {
        return Err(illegal("can't unpack update operations"));
    }
    Ok(out)
}

fn parse_op<'a>(
    r: &mut Reader<'a>,
    op_num: u32,
    index_base: i32,
) -> Result<UpdateOp<'a>, TupleError> {
    let unpack = |_| illegal("can't unpack update operations");
    if r.peek_marker().map(mp_type) != Some(MpType::Array) {
        return Err(illegal("update operation must be an array {op,..}"));
    }
    let arg_count = r.read_array_len().map_err(unpack)?;
    if arg_count < 1 {
        return Err(illegal(
            "update operation must be an array {op,..}, got empty array",
        ));
    }
    if r.peek_marker().map(mp_type) != Some(MpType::Str) {
        return Err(illegal("update operation name must be a string"));
    }
    let name = r.read_str().map_err(unpack)?;
    let unknown = |what: String| {
        TupleError::new(
            codes::ER_UNKNOWN_UPDATE_OP,
            format!("Unknown UPDATE operation #{op_num}: {what}"),
        )
    };
    let expected_args = match name {
        b"=" | b"!" | b"+" | b"-" | b"&" | b"|" | b"^" | b"#" => 3,
        b":" => 5,
        _ => return Err(unknown(format!("\"{}\"", String::from_utf8_lossy(name)))),
    };
    let opcode = name[0];
    if arg_count != expected_args {
        return Err(unknown(format!(
            "wrong number of arguments, expected {expected_args}, got {arg_count}"
        )));
    }
    let field = match r.peek_marker().map(mp_type) {
        Some(MpType::UInt | MpType::Int) => {
            let n = read_i32(r).ok_or_else(|| arg_type(opcode, FieldRef::No(0), "an integer"))?;
            if n >= index_base {
                FieldRef::No(n - index_base)
            } else if n < 0 {
                FieldRef::No(n)
            } else {
                return Err(TupleError::new(
                    codes::ER_NO_SUCH_FIELD_NO,
                    format!("Field {n} was not found in the tuple"),
                ));
            }
        }
        Some(MpType::Str) => FieldRef::Name(r.read_str().map_err(unpack)?),
        _ => return Err(illegal("field id must be a number or a string")),
    };
    let arg = match opcode {
        b'=' | b'!' => OpArg::Value(r.read_raw_value(MAX_DEPTH - 2).map_err(unpack)?),
        b'+' | b'-' => {
            OpArg::Number(read_number(r).ok_or_else(|| arg_type(opcode, field, "a number"))?)
        }
        b'&' | b'|' | b'^' => match r.peek_marker().map(mp_type) {
            Some(MpType::UInt) => OpArg::Bits(r.read_uint().map_err(unpack)?),
            _ => return Err(arg_type(opcode, field, "a positive integer")),
        },
        b'#' => match r.peek_marker().map(mp_type) {
            // Tarantool keeps the count in 32 bits.
            Some(MpType::UInt) => match r.read_uint().map_err(unpack)? as u32 {
                0 => return Err(field_error(field, "cannot delete 0 fields")),
                n => OpArg::Delete(n),
            },
            _ => return Err(arg_type(opcode, field, "a positive integer")),
        },
        _ => {
            let mut offset = read_i32(r).ok_or_else(|| arg_type(opcode, field, "an integer"))?;
            if offset >= 0 {
                if offset < index_base {
                    return Err(splice_bound(field));
                }
                offset -= index_base;
            }
            let cut = read_i32(r).ok_or_else(|| arg_type(opcode, field, "an integer"))?;
            if r.peek_marker().map(mp_type) != Some(MpType::Str) {
                return Err(arg_type(opcode, field, "a string"));
            }
            let paste = r.read_str().map_err(unpack)?;
            OpArg::Splice { offset, cut, paste }
        }
    };
    Ok(UpdateOp { opcode, field, arg })
}

/// One field of the tuple being updated; `updated` marks a field an `=`, arithmetic, bitwise
/// or splice operation already changed (a second arithmetic, bitwise or splice one on it is a
/// "double update").
struct Slot<'a> {
    bytes: Cow<'a, [u8]>,
    updated: bool,
}

/// What an update needs to know of the space: field numbers by name, and which fields are
/// `double` (arithmetic results go there as MessagePack doubles, elsewhere as floats when a
/// float holds them exactly).
struct Space<'f> {
    field_no: &'f dyn Fn(&[u8]) -> Option<u32>,
    is_double: &'f dyn Fn(u32) -> bool,
}

/// Applies parsed operations to a tuple, in order; the first failing one fails the update.
/// `field_no` resolves a field name to its 0-based number. The result is not checked against
/// the space format: that and the primary key's immutability are the caller's.
pub fn apply(
    tuple: &[u8],
    ops: &[UpdateOp<'_>],
    field_no: &dyn Fn(&[u8]) -> Option<u32>,
) -> Result<Vec<u8>, TupleError> {
    let space = Space {
        field_no,
        is_double: &|_| false,
    };
    run(tuple, ops, &space, None)
}

/// UPSERT's update of an existing tuple: an operation that fails is skipped (Tarantool logs
/// it), not an error. Returns the new tuple and the errors of the skipped operations. An
/// unknown field name still fails the whole request, as Tarantool finds it while parsing.
pub fn apply_upsert(
    tuple: &[u8],
    ops: &[UpdateOp<'_>],
    field_no: &dyn Fn(&[u8]) -> Option<u32>,
) -> Result<(Vec<u8>, Vec<TupleError>), TupleError> {
    let space = Space {
        field_no,
        is_double: &|_| false,
    };
    let mut skipped = Vec::new();
    let new = run(tuple, ops, &space, Some(&mut skipped))?;
    Ok((new, skipped))
}

/// [`apply`] with names and `double` fields taken from the space format.
pub fn apply_in_format(
    tuple: &[u8],
    ops: &[UpdateOp<'_>],
    format: &[FieldDef],
) -> Result<Vec<u8>, TupleError> {
    with_format(format, |space| run(tuple, ops, space, None))
}

/// [`apply_upsert`] with names and `double` fields taken from the space format.
pub fn apply_upsert_in_format(
    tuple: &[u8],
    ops: &[UpdateOp<'_>],
    format: &[FieldDef],
) -> Result<(Vec<u8>, Vec<TupleError>), TupleError> {
    let mut skipped = Vec::new();
    let new = with_format(format, |space| run(tuple, ops, space, Some(&mut skipped)))?;
    Ok((new, skipped))
}

fn with_format<R>(format: &[FieldDef], f: impl FnOnce(&Space<'_>) -> R) -> R {
    let field_no = |name: &[u8]| {
        format
            .iter()
            .position(|def| def.name.as_bytes() == name)
            .map(|i| i as u32)
    };
    let is_double = |i: u32| {
        format
            .get(i as usize)
            .is_some_and(|def| def.field_type == FieldType::Double)
    };
    f(&Space {
        field_no: &field_no,
        is_double: &is_double,
    })
}

fn run(
    tuple: &[u8],
    ops: &[UpdateOp<'_>],
    space: &Space<'_>,
    mut skipped: Option<&mut Vec<TupleError>>,
) -> Result<Vec<u8>, TupleError> {
    // Names first: Tarantool resolves them while parsing, before any operation runs.
    let resolved: Vec<(i32, FieldRef<'_>)> = ops
        .iter()
        .map(|op| match op.field {
            FieldRef::No(n) => Ok((n, op.field)),
            FieldRef::Name(name) => resolve(name, space).map(|n| (n, op.field)),
        })
        .collect::<Result<_, _>>()?;
    let mut slots: Vec<Slot<'_>> = fields(tuple)?
        .into_iter()
        .map(|bytes| Slot {
            bytes: Cow::Borrowed(bytes),
            updated: false,
        })
        .collect();
    for (op, &(field_no, shown)) in ops.iter().zip(&resolved) {
        match apply_one(&mut slots, op, field_no, shown, space) {
            Ok(()) => {}
            Err(e) => match skipped.as_deref_mut() {
                Some(log) => log.push(e),
                None => return Err(e),
            },
        }
    }
    let mut out = Vec::with_capacity(5 + slots.iter().map(|s| s.bytes.len()).sum::<usize>());
    crate::msgpack::write_array_len(&mut out, slots.len() as u32);
    for slot in &slots {
        out.extend_from_slice(&slot.bytes);
    }
    Ok(out)
}

/// A name from the format, or `[N]` (1-based, as Tarantool's JSON paths count).
fn resolve(name: &[u8], space: &Space<'_>) -> Result<i32, TupleError> {
    if let Some(n) = (space.field_no)(name) {
        return Ok(n.min(i32::MAX as u32) as i32);
    }
    let bracketed = name
        .strip_prefix(b"[")
        .and_then(|n| n.strip_suffix(b"]"))
        .and_then(|n| std::str::from_utf8(n).ok())
        .and_then(|n| n.parse::<i32>().ok())
        .filter(|&n| n >= 1);
    bracketed.map(|n| n - 1).ok_or_else(|| {
        TupleError::new(
            codes::ER_NO_SUCH_FIELD_NAME,
            format!(
                "Field '{}' was not found in the tuple",
                String::from_utf8_lossy(name)
            ),
        )
    })
}

/// The absolute index of `field_no` among `count` fields (xrow_update_op_adjust_field_no).
fn adjust(field_no: i32, count: usize, shown: FieldRef<'_>) -> Result<usize, TupleError> {
    let count = count as i64;
    let n = field_no as i64;
    let shown = match shown {
        FieldRef::No(_) => FieldRef::No(field_no),
        name => name,
    };
    if n >= 0 && n < count {
        Ok(n as usize)
    } else if n < 0 && n + count >= 0 {
        Ok((n + count) as usize)
    } else {
        Err(no_such_field(shown))
    }
}

fn apply_one<'a>(
    slots: &mut Vec<Slot<'a>>,
    op: &UpdateOp<'a>,
    field_no: i32,
    shown: FieldRef<'a>,
    space: &Space<'_>,
) -> Result<(), TupleError> {
    // After the index is found, errors name the field by its absolute 1-based number.
    let at = |i: usize| match shown {
        FieldRef::No(_) => FieldRef::No(i as i32),
        name => name,
    };
    match (op.opcode, op.arg) {
        (b'=', OpArg::Value(v)) => {
            if field_no >= 0 && field_no as usize == slots.len() {
                slots.push(Slot {
                    bytes: Cow::Borrowed(v),
                    updated: false,
                });
            } else {
                let i = adjust(field_no, slots.len(), shown)?;
                slots[i] = Slot {
                    bytes: Cow::Borrowed(v),
                    updated: true,
                };
            }
        }
        (b'!', OpArg::Value(v)) => {
            let i = adjust(field_no, slots.len() + 1, shown)?;
            slots.insert(
                i,
                Slot {
                    bytes: Cow::Borrowed(v),
                    updated: false,
                },
            );
        }
        (b'#', OpArg::Delete(n)) => {
            let i = adjust(field_no, slots.len(), shown)?;
            let end = (i + n as usize).min(slots.len());
            slots.drain(i..end);
        }
        (opcode, arg) => {
            let i = adjust(field_no, slots.len(), shown)?;
            let field = at(i);
            if slots[i].updated {
                return Err(field_error(field, "double update of the same field"));
            }
            let old = &slots[i].bytes;
            let new = match arg {
                OpArg::Number(n) => arith(opcode, old, n, field, (space.is_double)(i as u32))?,
                OpArg::Bits(b) => bits(opcode, old, b, field)?,
                OpArg::Splice { offset, cut, paste } => splice(old, offset, cut, paste, field)?,
                _ => unreachable!("parse_ops pairs each opcode with its argument"),
            };
            slots[i] = Slot {
                bytes: Cow::Owned(new),
                updated: true,
            };
        }
    }
    Ok(())
}

fn arith(
    opcode: u8,
    old: &[u8],
    arg: Number,
    field: FieldRef<'_>,
    field_is_double: bool,
) -> Result<Vec<u8>, TupleError> {
    let current =
        read_number(&mut Reader::new(old)).ok_or_else(|| arg_type(opcode, field, "a number"))?;
    let mut out = Vec::with_capacity(9);
    match (current, arg) {
        (Number::Int(a), Number::Int(b)) => {
            let c = if opcode == b'+' { a + b } else { a - b };
            if c > u64::MAX as i128 || c < i64::MIN as i128 {
                return Err(TupleError::new(
                    codes::ER_UPDATE_INTEGER_OVERFLOW,
                    format!(
                        "Integer overflow when performing '{}' operation on field {}",
                        opcode as char,
                        field_str(field)
                    ),
                ));
            }
            if c >= 0 {
                write_uint(&mut out, c as u64);
            } else {
                write_int(&mut out, c as i64);
            }
        }
        (a, b) => {
            let (a, b) = (as_f64(a), as_f64(b));
            let c = if opcode == b'+' { a + b } else { a - b };
            // The result is stored as a float when a float holds it exactly, unless the field
            // is declared double.
            let narrow = c as f32;
            if !field_is_double
                && (-f32::MAX as f64..=f32::MAX as f64).contains(&c)
                && narrow as f64 == c
            {
                out.push(0xca);
                out.extend_from_slice(&narrow.to_bits().to_be_bytes());
            } else {
                write_f64(&mut out, c);
            }
        }
    }
    Ok(out)
}

fn as_f64(n: Number) -> f64 {
    match n {
        Number::Int(v) => v as f64,
        Number::Float(v) => v as f64,
        Number::Double(v) => v,
    }
}

fn bits(opcode: u8, old: &[u8], arg: u64, field: FieldRef<'_>) -> Result<Vec<u8>, TupleError> {
    let current = match old.first().map(|&m| mp_type(m)) {
        Some(MpType::UInt) => Reader::new(old).read_uint().ok(),
        _ => None,
    }
    .ok_or_else(|| arg_type(opcode, field, "a positive integer"))?;
    let value = match opcode {
        b'&' => current & arg,
        b'|' => current | arg,
        _ => current ^ arg,
    };
    let mut out = Vec::with_capacity(9);
    write_uint(&mut out, value);
    Ok(out)
}

/// `:` on a string field, with Tarantool's clamping: an offset past the end appends, a
/// negative offset counts from the end (-1 is after the last byte), a negative cut leaves that
/// many bytes before the end.
fn splice(
    old: &[u8],
    offset: i32,
    cut: i32,
    paste: &[u8],
    field: FieldRef<'_>,
) -> Result<Vec<u8>, TupleError> {
    let s = match old.first().map(|&m| mp_type(m)) {
        Some(MpType::Str) => Reader::new(old).read_str().ok(),
        _ => None,
    }
    .ok_or_else(|| arg_type(b':', field, "a string"))?;
    let len = s.len() as i64;
    let mut offset = offset as i64;
    if offset < 0 {
        if -offset > len + 1 {
            return Err(splice_bound(field));
        }
        offset += len + 1;
    } else if offset > len {
        offset = len;
    }
    let mut cut = cut as i64;
    if cut < 0 {
        cut = if -cut > len - offset {
            0
        } else {
            cut + len - offset
        };
    } else if cut > len - offset {
        cut = len - offset;
    }
    let (offset, tail) = (offset as usize, (offset + cut) as usize);
    let mut joined = Vec::with_capacity(s.len() + paste.len());
    joined.extend_from_slice(&s[..offset]);
    joined.extend_from_slice(paste);
    joined.extend_from_slice(&s[tail..]);
    let mut out = Vec::with_capacity(joined.len() + 5);
    write_str_bytes(&mut out, &joined);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iproto::tuple::FieldDef;
    use crate::iproto::unhex;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn users() -> Vec<FieldDef> {
        [
            ("id", FieldType::Unsigned),
            ("name", FieldType::String),
            ("age", FieldType::Unsigned),
            ("score", FieldType::Double),
        ]
        .into_iter()
        .map(|(name, field_type)| FieldDef {
            name: name.to_string(),
            field_type,
            is_nullable: true,
        })
        .collect()
    }

    /// Runs an update given as hex; the new tuple as hex, or the error's code and message.
    fn update(tuple: &str, ops: &str, index_base: u32) -> Result<String, (u32, String)> {
        let (tuple, ops) = (unhex(tuple), unhex(ops));
        let parsed = parse_ops(&ops, index_base).map_err(|e| (e.code, e.message))?;
        apply_in_format(&tuple, &parsed, &users())
            .map(|t| hex(&t))
            .map_err(|e| (e.code, e.message))
    }

    fn err(code: u32, message: &str) -> Result<String, (u32, String)> {
        Err((code, message.to_string()))
    }

    /// [2, 'bob', 25]
    const BOB: &str = "9302a3626f6219";

    #[test]
    fn the_updates_of_the_captures() {
        // tarantool-python: 0-based field 2; net.box: INDEX_BASE 1, field 3.
        assert_eq!(update(BOB, "9193a12b0201", 0), Ok("9302a3626f621a".into()));
        assert_eq!(update(BOB, "9193a12d0301", 1), Ok("9302a3626f6218".into()));
        // By name, and the splices of both clients on 'Alice' (cut 'A', paste 'A').
        assert_eq!(
            update(BOB, "9193a13da46e616d65a178", 1),
            Ok("9302a17819".into())
        );
        let alice = "9301a5416c6963651e";
        assert_eq!(update(alice, "9195a13a010001a141", 0), Ok(alice.into()));
        assert_eq!(update(alice, "9195a13a020101a141", 1), Ok(alice.into()));
    }

    #[test]
    fn set_insert_and_delete_by_position() {
        // '=' on field len+1 appends; further out there is no such field.
        assert_eq!(
            update(BOB, "9193a13d03c3", 0),
            Ok("9402a3626f6219c3".into())
        );
        assert_eq!(
            update(BOB, "9193a13d04c3", 0),
            err(37, "Field 5 was not found in the tuple")
        );
        // Negative numbers count from the end; too far back is no field either.
        assert_eq!(update(BOB, "9193a13dff07", 0), Ok("9302a3626f6207".into()));
        assert_eq!(
            update(BOB, "9193a13dfb07", 0),
            err(37, "Field -5 was not found in the tuple")
        );
        // '!' before a field, at the end (len+1 or -1).
        assert_eq!(
            update(BOB, "9193a12100c0", 0),
            Ok("94c002a3626f6219".into())
        );
        assert_eq!(
            update(BOB, "9193a121ffc0", 0),
            Ok("9402a3626f6219c0".into())
        );
        assert_eq!(
            update(BOB, "9193a12104c0", 1),
            Ok("9402a3626f6219c0".into())
        );
        // '#' deletes up to the end; 0 fields is refused.
        assert_eq!(update(BOB, "9193a1230102", 0), Ok("9102".into()));
        assert_eq!(update(BOB, "9193a123020a", 1), Ok("9102".into()));
        assert_eq!(
            update(BOB, "9193a1230100", 0),
            err(29, "Field 2 UPDATE error: cannot delete 0 fields")
        );
        // Field 0 does not exist when fields count from 1.
        assert_eq!(
            update(BOB, "9193a13d0001", 1),
            err(37, "Field 0 was not found in the tuple")
        );
    }

    #[test]
    fn arithmetic_with_tarantools_types_and_overflow() {
        assert_eq!(update(BOB, "9193a12d020a", 0), Ok("9302a3626f620f".into()));
        assert_eq!(update(BOB, "9193a12d021e", 0), Ok("9302a3626f62fb".into()));
        // [2, u64::MAX] + 1
        assert_eq!(
            update("9202cfffffffffffffffff", "9193a12b0101", 0),
            err(
                95,
                "Integer overflow when performing '+' operation on field 2"
            )
        );
        assert_eq!(
            update("91d38000000000000000", "9193a12d0001", 0),
            err(
                95,
                "Integer overflow when performing '-' operation on field 1"
            )
        );
        // Adding a negative to a large unsigned goes through signed range correctly.
        assert_eq!(
            update("91cfffffffffffffffff", "9193a12b00ff", 0),
            Ok("91cffffffffffffffffe".into())
        );
        assert_eq!(
            update(BOB, "9193a12b0101", 0),
            err(26, "Argument type in operation '+' on field 2 does not match field type: expected a number")
        );
        assert_eq!(
            update(BOB, "9193a12b02a131", 0),
            err(26, "Argument type in operation '+' on field 3 does not match field type: expected a number")
        );
        // Floats: stored as float when exact, as double in a double field.
        assert_eq!(
            update(BOB, "9193a12b02cb3fe0000000000000", 0),
            Ok("9302a3626f62ca41cc0000".into())
        );
        assert_eq!(
            update("9402a3626f621901", "9193a12b03cb3fe0000000000000", 0),
            Ok("9402a3626f6219cb3ff8000000000000".into())
        );
    }

    #[test]
    fn bitwise_on_unsigned_only() {
        assert_eq!(update("910c", "9193a1260006", 0), Ok("9104".into()));
        assert_eq!(update("910c", "9193a17c0003", 0), Ok("910f".into()));
        assert_eq!(update("910c", "9193a15e00ff", 0).unwrap_err().0, 26);
        assert_eq!(
            update("91ff", "9193a15e0001", 0),
            err(26, "Argument type in operation '^' on field 1 does not match field type: expected a positive integer")
        );
    }

    #[test]
    fn splice_offsets_as_tarantool_clamps_them() {
        let s = "91a56162636465"; // ['abcde']
        let splice =
            |offset: &str, cut: &str| update(s, &format!("9195a13a00{offset}{cut}a158"), 0);
        assert_eq!(splice("01", "02"), Ok("91a461586465".into()));
        assert_eq!(splice("0a", "02"), Ok("91a6616263646558".into())); // past the end: append
        assert_eq!(splice("ff", "00"), Ok("91a6616263646558".into())); // -1: after the last
        assert_eq!(splice("fe", "05"), Ok("91a56162636458".into())); // cut clamps
        assert_eq!(splice("00", "fe"), Ok("91a3586465".into())); // cut all but 2
        assert_eq!(
            splice("f9", "00"),
            err(25, "SPLICE error on field 1: offset is out of bound")
        );
        // With INDEX_BASE 1 offset 0 is out of bound at once.
        let e = parse_ops(&unhex("9195a13a010000a158"), 1).unwrap_err();
        assert_eq!(e.message, "SPLICE error on field 1: offset is out of bound");
        assert_eq!(
            update(BOB, "9195a13a000000a158", 0),
            err(26, "Argument type in operation ':' on field 1 does not match field type: expected a string")
        );
    }

    #[test]
    fn a_field_takes_one_scalar_update() {
        assert_eq!(
            update(BOB, "9293a12b020193a12b0201", 0),
            err(29, "Field 3 UPDATE error: double update of the same field")
        );
        assert_eq!(update(BOB, "9293a13d020193a12b0201", 0).unwrap_err().0, 29);
        // '=' may follow anything, and an inserted field is fresh.
        assert_eq!(
            update(BOB, "9293a12b020193a13d0207", 0),
            Ok("9302a3626f6207".into())
        );
        assert_eq!(
            update(BOB, "9293a121ff0193a12bff01", 0),
            Ok("9402a3626f621902".into())
        );
    }

    #[test]
    fn malformed_operations() {
        let cases: &[(&str, u32, &str)] = &[
            (
                "01",
                1,
                "Illegal parameters, update operations must be an array {{op,..}, {op,..}}",
            ),
            (
                "9101",
                1,
                "Illegal parameters, update operation must be an array {op,..}",
            ),
            (
                "9190",
                1,
                "Illegal parameters, update operation must be an array {op,..}, got empty array",
            ),
            (
                "919101",
                1,
                "Illegal parameters, update operation name must be a string",
            ),
            (
                "9293a12b020193a1780201",
                28,
                "Unknown UPDATE operation #2: \"x\"",
            ),
            (
                "9194a12b020101",
                28,
                "Unknown UPDATE operation #1: wrong number of arguments, expected 3, got 4",
            ),
            (
                "9193a12bc001",
                1,
                "Illegal parameters, field id must be a number or a string",
            ),
            (
                "9193a12b0201 00",
                1,
                "Illegal parameters, can't unpack update operations",
            ),
        ];
        for (ops, code, message) in cases {
            let e = parse_ops(&unhex(ops), 0).unwrap_err();
            assert_eq!((e.code, e.message.as_str()), (*code, *message), "{ops}");
        }
        let mut many = vec![0xdc, 0x0f, 0xa1];
        many.extend(std::iter::repeat_n([0x93, 0xa1, b'=', 0, 0], 4001).flatten());
        assert_eq!(
            parse_ops(&many, 0).unwrap_err().message,
            "Illegal parameters, too many operations for update"
        );
        // An unknown name fails the whole update, UPSERT's too.
        let ops = unhex("9193a13da36e6f7001");
        let parsed = parse_ops(&ops, 0).unwrap();
        let e = apply_upsert_in_format(&unhex(BOB), &parsed, &users()).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (201, "Field 'nop' was not found in the tuple")
        );
        // `[N]` names a field by its 1-based number.
        let ops = unhex("9193a13da35b335d07");
        let parsed = parse_ops(&ops, 0).unwrap();
        assert_eq!(
            hex(&apply(&unhex(BOB), &parsed, &|_| None).unwrap()),
            "9302a3626f6207"
        );
    }

    #[test]
    fn upsert_skips_an_operation_that_fails() {
        let ops = unhex("9393a12b010193a12b020593a13d0501");
        let parsed = parse_ops(&ops, 0).unwrap();
        let (tuple, skipped) = apply_upsert(&unhex(BOB), &parsed, &|_| None).unwrap();
        assert_eq!(hex(&tuple), "9302a3626f621e");
        let codes: Vec<u32> = skipped.iter().map(|e| e.code).collect();
        assert_eq!(codes, [26, 37]);
        // The same operations fail an UPDATE at the first.
        assert_eq!(apply(&unhex(BOB), &parsed, &|_| None).unwrap_err().code, 26);
    }
}
