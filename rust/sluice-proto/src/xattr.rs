//! Extended attributes in a document's value, as Couchbase lays them out (kv_engine's
//! docs/Document.md): with the datatype's XATTR bit set, the value starts with a big-endian
//! u32, the length of the pairs that follow; each pair is a big-endian u32, its length, then
//! the key, a NUL, the value (JSON text) and a NUL. The body follows the pairs. A key starting
//! with `_` is a system attribute (kept by a deletion), one starting with `$` a virtual one
//! (computed, never stored); any other is a user attribute.

/// The datatype bit of a value that starts with extended attributes.
pub const DATATYPE_XATTR: u8 = 0x04;

/// The longest key an attribute may have (kv_engine's limit).
pub const MAX_KEY: usize = 15;

/// A value's attributes, in order, and its body.
pub type Split<'a> = (Vec<(&'a [u8], &'a [u8])>, &'a [u8]);

/// Reads a value that starts with attributes, checking every length against what is there.
pub fn split(value: &[u8]) -> Result<Split<'_>, &'static str> {
    let Some(head) = value.get(..4) else {
        return Err("the attributes' length is cut short");
    };
    let total = u32::from_be_bytes(head.try_into().expect("4 bytes")) as usize;
    let Some(mut pairs) = value.get(4..).and_then(|v| v.get(..total)) else {
        return Err("the attributes run past the value");
    };
    let body = &value[4 + total..];
    let mut out = Vec::new();
    while !pairs.is_empty() {
        let Some(len) = pairs.get(..4) else {
            return Err("an attribute's length is cut short");
        };
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        let Some(pair) = pairs.get(4..).and_then(|p| p.get(..len)) else {
            return Err("an attribute runs past the attributes");
        };
        let Some(nul) = pair.iter().position(|&b| b == 0) else {
            return Err("an attribute's key has no end");
        };
        let (key, rest) = (&pair[..nul], &pair[nul + 1..]);
        let Some((&0, val)) = rest.split_last() else {
            return Err("an attribute's value has no end");
        };
        if key.is_empty() {
            return Err("an attribute has an empty key");
        }
        out.push((key, val));
        pairs = &pairs[4 + len..];
    }
    Ok((out, body))
}

/// The body of a stored value: past its attributes when `datatype` has the XATTR bit (all of
/// it when they do not read).
pub fn body(value: &[u8], datatype: u8) -> &[u8] {
    if datatype & DATATYPE_XATTR == 0 {
        return value;
    }
    split(value).map_or(value, |(_, body)| body)
}

/// A value of these attributes and body; with no attributes, the body alone (the caller
/// clears the XATTR bit).
pub fn join<K: AsRef<[u8]>, V: AsRef<[u8]>>(attrs: &[(K, V)], body: &[u8]) -> Vec<u8> {
    if attrs.is_empty() {
        return body.to_vec();
    }
    let pairs: usize = attrs
        .iter()
        .map(|(k, v)| 4 + k.as_ref().len() + v.as_ref().len() + 2)
        .sum();
    let mut out = Vec::with_capacity(4 + pairs + body.len());
    out.extend_from_slice(&(pairs as u32).to_be_bytes());
    for (k, v) in attrs {
        let (k, v) = (k.as_ref(), v.as_ref());
        out.extend_from_slice(&((k.len() + v.len() + 2) as u32).to_be_bytes());
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out.extend_from_slice(body);
    out
}

/// Whether an attribute of this key is a system one (a deletion keeps those).
pub fn is_system(key: &[u8]) -> bool {
    key.first() == Some(&b'_')
}

/// A value of `value`'s system attributes (a value with the XATTR bit) followed by `body`;
/// None when it has none (or they do not read): the caller stores `body` alone.
pub fn with_system_attrs(value: &[u8], body: &[u8]) -> Option<Vec<u8>> {
    let (attrs, _) = split(value).ok()?;
    let system: Vec<_> = attrs.into_iter().filter(|(k, _)| is_system(k)).collect();
    (!system.is_empty()).then(|| join(&system, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_engines_example_reads_and_is_written_alike() {
        let attrs = [
            (&b"_sync"[..], &br#"{"cas":"deadbeefcafefeed"}"#[..]),
            (&b"meta"[..], &br#"{"author":"trond"}"#[..]),
        ];
        let value = join(&attrs, b"{\"body\":1}");
        assert_eq!(
            value[..4],
            ((4 + 5 + 26 + 2) + (4 + 4 + 18 + 2) as u32).to_be_bytes()
        );
        let (read, body) = split(&value).unwrap();
        assert_eq!(read, attrs.to_vec());
        assert_eq!(body, b"{\"body\":1}");
        assert_eq!(super::body(&value, DATATYPE_XATTR | 1), b"{\"body\":1}");
        assert_eq!(super::body(&value, 1), &value[..]);
        assert_eq!(join::<&[u8], &[u8]>(&[], b"x"), b"x");
        assert!(is_system(b"_sync") && !is_system(b"meta"));
        let kept = with_system_attrs(&value, b"new").unwrap();
        assert_eq!(split(&kept).unwrap(), (attrs[..1].to_vec(), &b"new"[..]));
        assert_eq!(
            with_system_attrs(&join(&[(b"meta", b"1")], b""), b"x"),
            None
        );
    }

    #[test]
    fn cut_or_lying_lengths_are_refused() {
        let value = join(&[(b"k", b"1")], b"body");
        for cut in 0..4 + 4 + 4 {
            assert!(split(&value[..cut]).is_err(), "{cut}");
        }
        let mut long = value.clone();
        long[3] = 200;
        assert!(split(&long).is_err());
        let mut no_nul = value.clone();
        no_nul[9] = b'x';
        assert!(split(&no_nul).is_err());
    }
}
