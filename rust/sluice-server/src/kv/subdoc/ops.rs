//! The sub-document operations on a parsed JSON document, apart from the wire: lookups read a
//! `Value`, mutations change one in place (a multi-mutation works on a copy, so a failing spec
//! leaves the stored document alone). Semantics and errors as kv_engine's `docs/SubDocument.md`.

use serde_json::{Map, Value};
use sluice_proto::mcbp::subdoc::MAX_PATH_DEPTH;

pub use super::error::SubdocError;
use super::path::Segment;

type Result<T> = std::result::Result<T, SubdocError>;

/// What a mutation does; the value (where it takes one) is the request's raw bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    DictAdd,
    DictUpsert,
    Delete,
    Replace,
    PushLast,
    PushFirst,
    Insert,
    AddUnique,
    Counter,
}

/// How deep JSON may nest, path plus value, as Couchbase's parser allows.
const MAX_DEPTH: usize = MAX_PATH_DEPTH;

/// The largest document sub-document commands parse. A parsed document takes several times
/// its size in memory (a tree of values, a string per number) and a mutation parses it under
/// its vbucket's lock: bigger ones are refused (E2BIG) rather than let one request hold
/// gigabytes and the vbucket for seconds.
pub const MAX_DOC_BYTES: usize = 2 << 20;

/// Parses a stored document; DOC_NOTJSON when it is not JSON, DOC_E2DEEP when it nests past
/// what the parser allows, E2BIG over MAX_DOC_BYTES.
pub fn parse_doc(body: &[u8]) -> Result<Value> {
    if body.len() > MAX_DOC_BYTES {
        return Err(SubdocError::DocTooBig);
    }
    let doc: Value = serde_json::from_slice(body).map_err(|e| {
        if e.to_string().contains("recursion limit") {
            SubdocError::DocE2deep
        } else {
            SubdocError::DocNotJson
        }
    })?;
    // Couchbase's parser stops at 32 levels; serde_json's own limit (128) bounds `depth`.
    if depth(&doc) > MAX_DEPTH {
        return Err(SubdocError::DocE2deep);
    }
    Ok(doc)
}

impl SubdocError {
    /// Whether the error is the document's (not JSON, too deep, too big, attributes that do
    /// not read, not deleted for a revival, a body for one that stays deleted) rather than
    /// one spec's path: a mutation answers it as its own status, as kv_engine does.
    pub fn is_document_level(self) -> bool {
        matches!(
            self,
            SubdocError::DocNotJson
                | SubdocError::DocE2deep
                | SubdocError::DocTooBig
                | SubdocError::CanOnlyReviveDeleted
                | SubdocError::DeletedCantHaveValue
                | SubdocError::XattrEinval
        )
    }
}

/// The value at `path`.
pub fn find<'a>(doc: &'a Value, path: &[Segment]) -> Result<&'a Value> {
    let mut at = doc;
    for seg in path {
        at = match (seg, at) {
            (Segment::Key(k), Value::Object(m)) => m.get(k).ok_or(SubdocError::PathEnoent)?,
            (Segment::Index(i), Value::Array(a)) => a.get(*i).ok_or(SubdocError::PathEnoent)?,
            (Segment::Last, Value::Array(a)) => a.last().ok_or(SubdocError::PathEnoent)?,
            _ => return Err(SubdocError::PathMismatch),
        };
    }
    Ok(at)
}

/// GET_COUNT: the number of elements or keys at `path`.
pub fn count(doc: &Value, path: &[Segment]) -> Result<usize> {
    match find(doc, path)? {
        Value::Array(a) => Ok(a.len()),
        Value::Object(m) => Ok(m.len()),
        _ => Err(SubdocError::PathMismatch),
    }
}

/// The container at `path`, creating missing dictionaries on the way when `mkdir`
/// (intermediate array elements are never created).
fn container_mut<'a>(doc: &'a mut Value, path: &[Segment], mkdir: bool) -> Result<&'a mut Value> {
    let mut at = doc;
    for seg in path {
        at = match (seg, at) {
            (Segment::Key(k), Value::Object(m)) => {
                if mkdir && !m.contains_key(k) {
                    m.insert(k.clone(), Value::Object(Map::new()));
                }
                m.get_mut(k).ok_or(SubdocError::PathEnoent)?
            }
            (Segment::Index(i), Value::Array(a)) => a.get_mut(*i).ok_or(SubdocError::PathEnoent)?,
            (Segment::Last, Value::Array(a)) => a.last_mut().ok_or(SubdocError::PathEnoent)?,
            _ => return Err(SubdocError::PathMismatch),
        };
    }
    Ok(at)
}

/// A value to insert: one JSON value, VALUE_CANTINSERT otherwise.
fn one_value(raw: &[u8]) -> Result<Value> {
    serde_json::from_slice(raw).map_err(|_| SubdocError::ValueCantinsert)
}

/// An array command's value: one or more JSON values separated by commas.
fn values(raw: &[u8]) -> Result<Vec<Value>> {
    let mut wrapped = Vec::with_capacity(raw.len() + 2);
    wrapped.push(b'[');
    wrapped.extend_from_slice(raw);
    wrapped.push(b']');
    match serde_json::from_slice(&wrapped) {
        Ok(Value::Array(v)) if !v.is_empty() => Ok(v),
        _ => Err(SubdocError::ValueCantinsert),
    }
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn check_depth(path: &[Segment], inserted: &[Value]) -> Result<()> {
    let deepest = inserted.iter().map(depth).max().unwrap_or(0);
    if path.len() + deepest > MAX_DEPTH {
        return Err(SubdocError::ValueEtoodeep);
    }
    Ok(())
}

fn is_primitive(v: &Value) -> bool {
    !matches!(v, Value::Array(_) | Value::Object(_))
}

/// Applies one mutation to `doc`. Returns the value the command answers with (COUNTER's new
/// number), if any.
pub fn mutate(
    doc: &mut Value,
    op: Mutation,
    path: &[Segment],
    raw: &[u8],
    mkdir: bool,
) -> Result<Option<Vec<u8>>> {
    match op {
        Mutation::DictAdd | Mutation::DictUpsert => {
            let Some((Segment::Key(k), parent)) = path.split_last() else {
                return Err(SubdocError::PathEinval);
            };
            let v = one_value(raw)?;
            check_depth(path, std::slice::from_ref(&v))?;
            let Value::Object(m) = container_mut(doc, parent, mkdir)? else {
                return Err(SubdocError::PathMismatch);
            };
            if op == Mutation::DictAdd && m.contains_key(k) {
                return Err(SubdocError::PathEexists);
            }
            m.insert(k.clone(), v);
            Ok(None)
        }
        Mutation::Delete => {
            let (last, parent) = path.split_last().ok_or(SubdocError::PathEinval)?;
            match (last, container_mut(doc, parent, false)?) {
                (Segment::Key(k), Value::Object(m)) => m
                    .shift_remove(k)
                    .map(|_| None)
                    .ok_or(SubdocError::PathEnoent),
                (Segment::Index(i), Value::Array(a)) if *i < a.len() => {
                    a.remove(*i);
                    Ok(None)
                }
                (Segment::Last, Value::Array(a)) if !a.is_empty() => {
                    a.pop();
                    Ok(None)
                }
                (Segment::Index(_) | Segment::Last, Value::Array(_)) => {
                    Err(SubdocError::PathEnoent)
                }
                _ => Err(SubdocError::PathMismatch),
            }
        }
        Mutation::Replace => {
            if path.is_empty() {
                return Err(SubdocError::PathEinval);
            }
            let v = one_value(raw)?;
            check_depth(path, std::slice::from_ref(&v))?;
            *container_mut(doc, path, false)? = v;
            Ok(None)
        }
        Mutation::PushLast | Mutation::PushFirst | Mutation::AddUnique => {
            let vs = values(raw)?;
            check_depth(path, &vs)?;
            if op == Mutation::AddUnique && (vs.len() != 1 || !is_primitive(&vs[0])) {
                return Err(SubdocError::ValueCantinsert);
            }
            let array = array_mut(doc, path, mkdir)?;
            match op {
                Mutation::PushLast => array.extend(vs),
                Mutation::PushFirst => {
                    array.splice(0..0, vs);
                }
                _ => {
                    if !array.iter().all(is_primitive) {
                        return Err(SubdocError::PathMismatch);
                    }
                    // Couchbase compares the JSON text: "1" is not 1, 1.0 is not 1.
                    let new = vs.into_iter().next().expect("one value");
                    let text = new.to_string();
                    let same_text = |e: &Value| serde_json::to_string(e).is_ok_and(|t| t == text);
                    if array.iter().any(same_text) {
                        return Err(SubdocError::PathEexists);
                    }
                    array.push(new);
                }
            }
            Ok(None)
        }
        Mutation::Insert => {
            let Some((Segment::Index(i), parent)) = path.split_last() else {
                return Err(SubdocError::PathEinval);
            };
            let vs = values(raw)?;
            check_depth(path, &vs)?;
            let Value::Array(a) = container_mut(doc, parent, false)? else {
                return Err(SubdocError::PathMismatch);
            };
            if *i > a.len() {
                return Err(SubdocError::PathEnoent);
            }
            a.splice(*i..*i, vs);
            Ok(None)
        }
        Mutation::Counter => counter(doc, path, raw, mkdir).map(Some),
    }
}

/// The array at `path`; with `mkdir`, a missing one is created (its parent too).
fn array_mut<'a>(doc: &'a mut Value, path: &[Segment], mkdir: bool) -> Result<&'a mut Vec<Value>> {
    let target = match path.split_last() {
        Some((Segment::Key(k), parent)) if mkdir => {
            let Value::Object(m) = container_mut(doc, parent, true)? else {
                return Err(SubdocError::PathMismatch);
            };
            m.entry(k.clone())
                .or_insert_with(|| Value::Array(Vec::new()))
        }
        _ => container_mut(doc, path, false)?,
    };
    match target {
        Value::Array(a) => Ok(a),
        _ => Err(SubdocError::PathMismatch),
    }
}

/// COUNTER: adds a signed 64-bit delta to the integer at `path` (created as the delta when
/// missing and its parent exists). Returns the new number's text.
fn counter(doc: &mut Value, path: &[Segment], raw: &[u8], mkdir: bool) -> Result<Vec<u8>> {
    let delta: i64 = std::str::from_utf8(raw)
        .ok()
        .filter(|t| is_integer_text(t))
        .and_then(|t| t.parse().ok())
        .filter(|d| *d != 0)
        .ok_or(SubdocError::DeltaEinval)?;
    let Some((last, parent)) = path.split_last() else {
        return Err(SubdocError::PathEinval);
    };
    let container = container_mut(doc, parent, mkdir)?;
    let slot = match (last, container) {
        (Segment::Key(k), Value::Object(m)) => m.entry(k.clone()).or_insert(Value::from(0)),
        (Segment::Index(i), Value::Array(a)) => a.get_mut(*i).ok_or(SubdocError::PathEnoent)?,
        (Segment::Last, Value::Array(a)) => a.last_mut().ok_or(SubdocError::PathEnoent)?,
        _ => return Err(SubdocError::PathMismatch),
    };
    let Value::Number(n) = slot else {
        return Err(SubdocError::PathMismatch);
    };
    let text = n.to_string();
    if !is_integer_text(&text) {
        return Err(SubdocError::PathMismatch);
    }
    let current: i64 = text.parse().map_err(|_| SubdocError::NumErange)?;
    // kv_engine answers an overflow with VALUE_CANTINSERT.
    let new = current
        .checked_add(delta)
        .ok_or(SubdocError::ValueCantinsert)?;
    *slot = Value::from(new);
    Ok(new.to_string().into_bytes())
}

fn is_integer_text(t: &str) -> bool {
    let digits = t.strip_prefix('-').unwrap_or(t);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// The empty document a MKDOC mutation starts from: an array when the first command pushes
/// to the root, a dictionary otherwise.
pub fn empty_doc_for(op: Mutation, path: &[Segment]) -> Value {
    let root_array = matches!(
        (op, path.first()),
        (
            Mutation::PushLast | Mutation::PushFirst | Mutation::AddUnique,
            None
        ) | (_, Some(Segment::Index(_) | Segment::Last))
    );
    if root_array {
        Value::Array(Vec::new())
    } else {
        Value::Object(Map::new())
    }
}

#[cfg(test)]
mod tests {
    use super::super::path::parse;
    use super::*;

    fn doc(text: &str) -> Value {
        parse_doc(text.as_bytes()).unwrap()
    }

    fn apply(d: &str, op: Mutation, path: &str, value: &str, mkdir: bool) -> Result<String> {
        let mut v = doc(d);
        mutate(
            &mut v,
            op,
            &parse(path.as_bytes())?,
            value.as_bytes(),
            mkdir,
        )?;
        Ok(v.to_string())
    }

    fn get(d: &str, path: &str) -> Result<String> {
        let v = doc(d);
        find(&v, &parse(path.as_bytes())?).map(|v| v.to_string())
    }

    const PRODUCT: &str = r#"{"type":"product","pDetails":{"audience":"children"},
        "pDistributors":[{"dName":"A","dAdded":["Feb",36,2025]},{"dName":"B","dAdded":["May",72,1492]}],
        "dot.ted.field":{"subfield":1},"back`tick":2}"#;

    #[test]
    fn lookups_follow_paths_and_report_enoent_and_mismatch() {
        assert_eq!(get(PRODUCT, "type").unwrap(), r#""product""#);
        assert_eq!(get(PRODUCT, "pDistributors[1].dAdded[2]").unwrap(), "1492");
        assert_eq!(
            get(PRODUCT, "pDistributors[-1].dAdded[-1]").unwrap(),
            "1492"
        );
        assert_eq!(get(PRODUCT, "`dot.ted.field`.subfield").unwrap(), "1");
        assert_eq!(get(PRODUCT, "`back``tick`").unwrap(), "2");
        assert_eq!(get(PRODUCT, "missing"), Err(SubdocError::PathEnoent));
        assert_eq!(
            get(PRODUCT, "pDistributors[5]"),
            Err(SubdocError::PathEnoent)
        );
        assert_eq!(
            get(PRODUCT, "pDistributors.count"),
            Err(SubdocError::PathMismatch)
        );
        assert_eq!(
            get(PRODUCT, "type.category"),
            Err(SubdocError::PathMismatch)
        );
        let v = doc(PRODUCT);
        assert_eq!(count(&v, &parse(b"pDistributors").unwrap()), Ok(2));
        assert_eq!(count(&v, &[]), Ok(5));
        assert_eq!(
            count(&v, &parse(b"type").unwrap()),
            Err(SubdocError::PathMismatch)
        );
    }

    #[test]
    fn documents_that_are_not_json_or_too_deep_are_refused() {
        assert_eq!(parse_doc(b"not json"), Err(SubdocError::DocNotJson));
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert_eq!(parse_doc(deep.as_bytes()), Err(SubdocError::DocE2deep));
    }

    #[test]
    fn dictionary_add_and_upsert_keep_field_order() {
        let d = r#"{"b":1,"a":{}}"#;
        assert_eq!(
            apply(d, Mutation::DictAdd, "c", "true", false).unwrap(),
            r#"{"b":1,"a":{},"c":true}"#
        );
        assert_eq!(
            apply(d, Mutation::DictAdd, "b", "2", false),
            Err(SubdocError::PathEexists)
        );
        assert_eq!(
            apply(d, Mutation::DictUpsert, "b", "2", false).unwrap(),
            r#"{"b":2,"a":{}}"#
        );
        assert_eq!(
            apply(d, Mutation::DictUpsert, "x.y", "2", false),
            Err(SubdocError::PathEnoent)
        );
        assert_eq!(
            apply(d, Mutation::DictUpsert, "x.y", "2", true).unwrap(),
            r#"{"b":1,"a":{},"x":{"y":2}}"#
        );
        assert_eq!(
            apply(d, Mutation::DictUpsert, "b.c", "2", true),
            Err(SubdocError::PathMismatch)
        );
        assert_eq!(
            apply(d, Mutation::DictAdd, "a[0]", "1", false),
            Err(SubdocError::PathEinval)
        );
        assert_eq!(
            apply(d, Mutation::DictAdd, "c", "{bad", false),
            Err(SubdocError::ValueCantinsert)
        );
        assert_eq!(
            apply(d, Mutation::DictAdd, "", "1", false),
            Err(SubdocError::PathEinval)
        );
    }

    #[test]
    fn delete_and_replace() {
        let d = r#"{"a":1,"b":[1,2,3],"c":3}"#;
        assert_eq!(
            apply(d, Mutation::Delete, "a", "", false).unwrap(),
            r#"{"b":[1,2,3],"c":3}"#
        );
        assert_eq!(
            apply(d, Mutation::Delete, "b[0]", "", false).unwrap(),
            r#"{"a":1,"b":[2,3],"c":3}"#
        );
        assert_eq!(
            apply(d, Mutation::Delete, "b[-1]", "", false).unwrap(),
            r#"{"a":1,"b":[1,2],"c":3}"#
        );
        assert_eq!(
            apply(d, Mutation::Delete, "b[3]", "", false),
            Err(SubdocError::PathEnoent)
        );
        assert_eq!(
            apply(d, Mutation::Delete, "zz", "", false),
            Err(SubdocError::PathEnoent)
        );
        assert_eq!(
            apply(d, Mutation::Replace, "b[1]", r#""two""#, false).unwrap(),
            r#"{"a":1,"b":[1,"two",3],"c":3}"#
        );
        assert_eq!(
            apply(d, Mutation::Replace, "zz", "1", false),
            Err(SubdocError::PathEnoent)
        );
    }

    #[test]
    fn array_pushes_inserts_and_unique_adds() {
        let d = r#"{"a":[1,2],"o":{}}"#;
        assert_eq!(
            apply(d, Mutation::PushLast, "a", "3,4", false).unwrap(),
            r#"{"a":[1,2,3,4],"o":{}}"#
        );
        assert_eq!(
            apply(d, Mutation::PushFirst, "a", "0", false).unwrap(),
            r#"{"a":[0,1,2],"o":{}}"#
        );
        assert_eq!(
            apply(d, Mutation::PushLast, "o", "0", false),
            Err(SubdocError::PathMismatch)
        );
        assert_eq!(
            apply(d, Mutation::PushLast, "n", "0", false),
            Err(SubdocError::PathEnoent)
        );
        assert_eq!(
            apply(d, Mutation::PushLast, "n", "0", true).unwrap(),
            r#"{"a":[1,2],"o":{},"n":[0]}"#
        );
        assert_eq!(
            apply(d, Mutation::Insert, "a[1]", r#""x""#, false).unwrap(),
            r#"{"a":[1,"x",2],"o":{}}"#
        );
        assert_eq!(
            apply(d, Mutation::Insert, "a[2]", "9", false).unwrap(),
            r#"{"a":[1,2,9],"o":{}}"#
        );
        assert_eq!(
            apply(d, Mutation::Insert, "a[3]", "9", false),
            Err(SubdocError::PathEnoent)
        );
        assert_eq!(
            apply(d, Mutation::Insert, "a[-1]", "9", false),
            Err(SubdocError::PathEinval)
        );
        assert_eq!(
            apply(d, Mutation::Insert, "a", "9", false),
            Err(SubdocError::PathEinval)
        );
        assert_eq!(
            apply(d, Mutation::AddUnique, "a", "3", false).unwrap(),
            r#"{"a":[1,2,3],"o":{}}"#
        );
        assert_eq!(
            apply(d, Mutation::AddUnique, "a", "2", false),
            Err(SubdocError::PathEexists)
        );
        assert_eq!(
            apply(d, Mutation::AddUnique, "a", r#""2""#, false).unwrap(),
            r#"{"a":[1,2,"2"],"o":{}}"#
        );
        assert_eq!(
            apply(d, Mutation::AddUnique, "a", "[1]", false),
            Err(SubdocError::ValueCantinsert)
        );
        assert_eq!(
            apply(r#"{"a":[[1]]}"#, Mutation::AddUnique, "a", "1", false),
            Err(SubdocError::PathMismatch)
        );
        assert_eq!(
            apply("[1]", Mutation::PushLast, "", "2", false).unwrap(),
            "[1,2]"
        );
    }

    #[test]
    fn counters_add_signed_deltas_within_64_bits() {
        let d = r#"{"n":5,"f":1.5,"s":"x","big":99999999999999999999}"#;
        let mut v = doc(d);
        let got = mutate(
            &mut v,
            Mutation::Counter,
            &parse(b"n").unwrap(),
            b"-7",
            false,
        );
        assert_eq!(got, Ok(Some(b"-2".to_vec())));
        let got = mutate(
            &mut v,
            Mutation::Counter,
            &parse(b"new").unwrap(),
            b"3",
            false,
        );
        assert_eq!(got, Ok(Some(b"3".to_vec())));
        for (path, delta, err) in [
            ("n", "0", SubdocError::DeltaEinval),
            ("n", "1.5", SubdocError::DeltaEinval),
            ("n", "x", SubdocError::DeltaEinval),
            ("f", "1", SubdocError::PathMismatch),
            ("s", "1", SubdocError::PathMismatch),
            ("big", "1", SubdocError::NumErange),
            ("a.b", "1", SubdocError::PathEnoent),
        ] {
            let got = mutate(
                &mut v,
                Mutation::Counter,
                &parse(path.as_bytes()).unwrap(),
                delta.as_bytes(),
                false,
            );
            assert_eq!(got, Err(err), "{path} {delta}");
        }
        let mut m = doc(r#"{"n":9223372036854775807}"#);
        let got = mutate(
            &mut m,
            Mutation::Counter,
            &parse(b"n").unwrap(),
            b"1",
            false,
        );
        assert_eq!(got, Err(SubdocError::ValueCantinsert));
    }

    #[test]
    fn other_numbers_keep_their_text_through_a_mutation() {
        let out = apply(
            r#"{"x":1.10,"y":12345678901234567890123}"#,
            Mutation::DictUpsert,
            "z",
            "1",
            false,
        );
        assert_eq!(
            out.unwrap(),
            r#"{"x":1.10,"y":12345678901234567890123,"z":1}"#
        );
    }

    #[test]
    fn values_too_deep_for_their_path_are_refused() {
        let deep = format!("{}{}", "[".repeat(31), "]".repeat(31));
        assert_eq!(
            apply("{}", Mutation::DictUpsert, "a.b", &deep, true),
            Err(SubdocError::ValueEtoodeep)
        );
    }

    #[test]
    fn mkdoc_starts_from_the_root_the_first_command_needs() {
        assert_eq!(empty_doc_for(Mutation::PushLast, &[]), Value::Array(vec![]));
        let p = parse(b"a").unwrap();
        assert_eq!(
            empty_doc_for(Mutation::PushLast, &p),
            Value::Object(Map::new())
        );
    }
}
