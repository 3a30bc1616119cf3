//! Couchbase's sub-document path syntax (N1QL's): `a.b[2].c`, dictionary keys separated by
//! dots, array indexes in brackets right after what they index, `[-1]` for the last element,
//! backquotes around a key holding `.`, `[` or `]` (two backquotes for one), and the empty path
//! for the whole document. Limits as Couchbase: 1024 bytes, 32 components.

use sluice_proto::mcbp::subdoc::{MAX_PATH_DEPTH, MAX_PATH_LEN};

use super::error::SubdocError;

/// One component of a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Key(String),
    /// An array index; `Last` is `[-1]`.
    Index(usize),
    Last,
}

/// Parses a path; PATH_EINVAL when it does not parse, PATH_E2BIG past the limits.
pub fn parse(path: &[u8]) -> Result<Vec<Segment>, SubdocError> {
    if path.len() > MAX_PATH_LEN {
        return Err(SubdocError::PathE2big);
    }
    let text = std::str::from_utf8(path).map_err(|_| SubdocError::PathEinval)?;
    let mut segments = Vec::new();
    let mut rest = text;
    // Whether the next component must be a key: at the start and after a dot.
    let mut want_key = true;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('[') {
            let close = after.find(']').ok_or(SubdocError::PathEinval)?;
            segments.push(index(&after[..close])?);
            rest = &after[close + 1..];
            want_key = false;
        } else if !want_key {
            // After a key or an index only a dot or another index may follow.
            rest = rest.strip_prefix('.').ok_or(SubdocError::PathEinval)?;
            if rest.is_empty() {
                return Err(SubdocError::PathEinval);
            }
            want_key = true;
        } else if let Some(after) = rest.strip_prefix('`') {
            let (key, used) = backquoted(after)?;
            segments.push(Segment::Key(key));
            rest = &after[used..];
            want_key = false;
        } else {
            let end = rest.find(['.', '[', ']', '`']).unwrap_or(rest.len());
            if end == 0 {
                return Err(SubdocError::PathEinval);
            }
            segments.push(Segment::Key(unescape(&rest[..end])?));
            rest = &rest[end..];
            want_key = false;
        }
        if segments.len() > MAX_PATH_DEPTH {
            return Err(SubdocError::PathE2big);
        }
    }
    if want_key && !text.is_empty() {
        return Err(SubdocError::PathEinval);
    }
    Ok(segments)
}

fn index(digits: &str) -> Result<Segment, SubdocError> {
    if digits == "-1" {
        return Ok(Segment::Last);
    }
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SubdocError::PathEinval);
    }
    digits
        .parse()
        .map(Segment::Index)
        .map_err(|_| SubdocError::PathEinval)
}

/// A backquoted key after its opening backquote: the key and the bytes used, closing
/// backquote included.
fn backquoted(after: &str) -> Result<(String, usize), SubdocError> {
    let mut key = String::new();
    let mut chars = after.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c != '`' {
            key.push(c);
        } else if chars.peek().map(|&(_, c)| c) == Some('`') {
            chars.next();
            key.push('`');
        } else {
            return Ok((unescape(&key)?, i + 1));
        }
    }
    Err(SubdocError::PathEinval)
}

/// Keys are written as they appear inside a JSON string: `\"` and the other JSON escapes
/// stand for what they escape.
fn unescape(raw: &str) -> Result<String, SubdocError> {
    if !raw.contains('\\') {
        return Ok(raw.to_string());
    }
    serde_json::from_str(&format!("\"{raw}\"")).map_err(|_| SubdocError::PathEinval)
}

#[cfg(test)]
mod tests {
    use super::Segment::{Index, Key, Last};
    use super::*;

    fn key(k: &str) -> Segment {
        Key(k.to_string())
    }

    #[test]
    fn dotted_keys_indexes_and_the_last_element() {
        assert_eq!(parse(b"").unwrap(), vec![]);
        assert_eq!(parse(b"a").unwrap(), vec![key("a")]);
        assert_eq!(
            parse(b"a.b[2].c").unwrap(),
            vec![key("a"), key("b"), Index(2), key("c")]
        );
        assert_eq!(
            parse(b"pDistributors[-1].dAdded[-1]").unwrap(),
            vec![key("pDistributors"), Last, key("dAdded"), Last]
        );
        assert_eq!(parse(b"[0][1]").unwrap(), vec![Index(0), Index(1)]);
    }

    #[test]
    fn backquotes_escape_path_characters_and_double_for_a_backquote() {
        assert_eq!(
            parse(b"`dot.ted.field`.subfield").unwrap(),
            vec![key("dot.ted.field"), key("subfield")]
        );
        assert_eq!(parse(b"`back``tick`").unwrap(), vec![key("back`tick")]);
        assert_eq!(parse(b"`a[0]`[1]").unwrap(), vec![key("a[0]"), Index(1)]);
        assert_eq!(parse(br#"quo\"te"#).unwrap(), vec![key("quo\"te")]);
    }

    #[test]
    fn malformed_paths_are_einval() {
        for bad in [
            &b"a..b"[..],
            b".a",
            b"a.",
            b"a[",
            b"a[x]",
            b"a[-2]",
            b"a[]",
            b"a]",
            b"`open",
            b"a`b`",
            b"a[0]b",
            b"\xff",
        ] {
            assert_eq!(
                parse(bad),
                Err(SubdocError::PathEinval),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn paths_past_couchbase_limits_are_e2big() {
        let deep = vec!["a"; MAX_PATH_DEPTH + 1].join(".");
        assert_eq!(parse(deep.as_bytes()), Err(SubdocError::PathE2big));
        let just = vec!["a"; MAX_PATH_DEPTH].join(".");
        assert_eq!(parse(just.as_bytes()).unwrap().len(), MAX_PATH_DEPTH);
        let long = "x".repeat(MAX_PATH_LEN + 1);
        assert_eq!(parse(long.as_bytes()), Err(SubdocError::PathE2big));
    }
}
