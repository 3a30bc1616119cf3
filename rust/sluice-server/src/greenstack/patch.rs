//! MUTATION's patch: a JSON merge patch (RFC 7386) applied to a JSON document. An object in
//! the patch merges key by key (null removes a key), anything else replaces what it patches.
//! Key order is kept (new keys go last); numbers keep their text.

use serde_json::{Map, Value};

/// How deep a patch or document may nest: past it, the patch is refused (the merge recurses).
const MAX_DEPTH: usize = 64;

/// `patch` applied to `doc`; Err says which of the two is not JSON, or that it nests too deep.
pub fn apply(doc: &[u8], patch: &[u8]) -> Result<Vec<u8>, String> {
    let mut target: Value = serde_json::from_slice(doc)
        .map_err(|e| format!("the document is not JSON ({e}): only a JSON document is patched"))?;
    let patch: Value =
        serde_json::from_slice(patch).map_err(|e| format!("the patch is not JSON: {e}"))?;
    if depth(&patch) > MAX_DEPTH {
        return Err(format!("the patch nests deeper than {MAX_DEPTH} levels"));
    }
    merge(&mut target, patch);
    Ok(serde_json::to_vec(&target).expect("a JSON value serializes"))
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn merge(target: &mut Value, patch: Value) {
    let Value::Object(patch) = patch else {
        *target = patch;
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let fields = target.as_object_mut().expect("made an object above");
    for (k, v) in patch {
        if v.is_null() {
            fields.shift_remove(&k);
        } else {
            merge(fields.entry(k).or_insert(Value::Null), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patched(doc: &str, patch: &str) -> String {
        String::from_utf8(apply(doc.as_bytes(), patch.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn rfc_7386s_examples() {
        // Appendix A of RFC 7386, in order.
        let cases = [
            (r#"{"a":"b"}"#, r#"{"a":"c"}"#, r#"{"a":"c"}"#),
            (r#"{"a":"b"}"#, r#"{"b":"c"}"#, r#"{"a":"b","b":"c"}"#),
            (r#"{"a":"b"}"#, r#"{"a":null}"#, r#"{}"#),
            (r#"{"a":"b","b":"c"}"#, r#"{"a":null}"#, r#"{"b":"c"}"#),
            (r#"{"a":["b"]}"#, r#"{"a":"c"}"#, r#"{"a":"c"}"#),
            (r#"{"a":"c"}"#, r#"{"a":["b"]}"#, r#"{"a":["b"]}"#),
            (
                r#"{"a":{"b":"c"}}"#,
                r#"{"a":{"b":"d","c":null}}"#,
                r#"{"a":{"b":"d"}}"#,
            ),
            (r#"{"a":[{"b":"c"}]}"#, r#"{"a":[1]}"#, r#"{"a":[1]}"#),
            (r#"["a","b"]"#, r#"["c","d"]"#, r#"["c","d"]"#),
            (r#"{"a":"b"}"#, r#"["c"]"#, r#"["c"]"#),
            (r#"{"a":"foo"}"#, "null", "null"),
            (r#"{"a":"foo"}"#, r#""bar""#, r#""bar""#),
            (r#"{"e":null}"#, r#"{"a":1}"#, r#"{"e":null,"a":1}"#),
            (r#"[1,2]"#, r#"{"a":"b","c":null}"#, r#"{"a":"b"}"#),
            (
                r#"{}"#,
                r#"{"a":{"bb":{"ccc":null}}}"#,
                r#"{"a":{"bb":{}}}"#,
            ),
        ];
        for (doc, patch, want) in cases {
            assert_eq!(patched(doc, patch), want, "{doc} + {patch}");
        }
        // Numbers keep their text.
        assert_eq!(
            patched(r#"{"n":1.50}"#, r#"{"m":2}"#),
            r#"{"n":1.50,"m":2}"#
        );
    }

    #[test]
    fn what_is_not_json_is_refused() {
        assert!(apply(b"plain text", b"{}")
            .unwrap_err()
            .contains("the document is not JSON"));
        assert!(apply(b"{}", b"{oops")
            .unwrap_err()
            .contains("the patch is not JSON"));
        let deep = "[".repeat(100) + &"]".repeat(100);
        assert!(apply(b"{}", deep.as_bytes()).is_err());
    }
}
