//! Greenstack payloads: msgpack maps keyed by field name (snake_case forms of the names
//! Greenstack's library gave its FlatBuffers fields). A reader takes the map as `Fields` and
//! asks for each field by name and type; a missing required field, a field of another type or
//! a duplicated key is an error naming the field; unknown fields are ignored, so either side
//! may add some. An empty payload reads as an empty map. The schemas are in docs/greenstack.md.

use smallvec::SmallVec;

use crate::msgpack::{self, Reader, Value};

/// How deep a field's value may nest (values sluice reads are flat).
const MAX_DEPTH: usize = 16;
/// The most fields a payload map may have.
pub const MAX_FIELDS: u32 = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadError(pub String);

impl std::fmt::Display for PayloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PayloadError {}

fn err(what: String) -> PayloadError {
    PayloadError(what)
}

/// Fields kept without allocating; a payload with more spills to the heap.
const INLINE_FIELDS: usize = 8;

/// A payload map's fields, each value kept as its raw msgpack and decoded when asked for. (Kept
/// decoded instead, the 24-byte values were copied in overlapping pieces that stalled the
/// stores they were read back from: slower than decoding a scalar again.)
#[derive(Debug, Clone, Default)]
pub struct Fields<'a> {
    entries: SmallVec<[(&'a [u8], &'a [u8]); INLINE_FIELDS]>,
}

impl<'a> Fields<'a> {
    pub fn parse(payload: &'a [u8]) -> Result<Fields<'a>, PayloadError> {
        let mut fields = Fields::default();
        if payload.is_empty() {
            return Ok(fields);
        }
        let bad = |e: msgpack::DecodeError| err(format!("the payload is not a msgpack map: {e}"));
        let mut r = Reader::new(payload);
        let n = r.read_map_len().map_err(bad)?;
        if n > MAX_FIELDS {
            return Err(err(format!(
                "a payload of {n} fields: at most {MAX_FIELDS} are read"
            )));
        }
        for _ in 0..n {
            let key = r.read_str().map_err(bad)?;
            if fields.entries().any(|(k, _)| *k == key) {
                return Err(err(format!(
                    "field '{}' is given twice",
                    String::from_utf8_lossy(key)
                )));
            }
            let value = r.read_raw_value(MAX_DEPTH).map_err(bad)?;
            fields.entries.push((key, value));
        }
        if !r.is_empty() {
            return Err(err("bytes after the payload's map".into()));
        }
        Ok(fields)
    }

    fn entries(&self) -> impl Iterator<Item = &(&'a [u8], &'a [u8])> {
        self.entries.iter()
    }

    fn value(&self, name: &str) -> Result<Option<Value<'a>>, PayloadError> {
        let Some(&(_, raw)) = self.entries().find(|(k, _)| *k == name.as_bytes()) else {
            return Ok(None);
        };
        Reader::new(raw)
            .read_value()
            .map(Some)
            .map_err(|e| err(format!("field '{name}': {e}")))
    }

    fn typed<T>(
        &self,
        name: &str,
        expected: &str,
        pick: impl Fn(Value<'a>) -> Option<T>,
    ) -> Result<Option<T>, PayloadError> {
        match self.value(name)? {
            None | Some(Value::Nil) => Ok(None),
            Some(v) => pick(v)
                .map(Some)
                .ok_or_else(|| err(format!("field '{name}' must be {expected}"))),
        }
    }

    /// A string or binary field (document ids may be either).
    pub fn bytes(&self, name: &str) -> Result<Option<&'a [u8]>, PayloadError> {
        self.typed(name, "a string or binary", |v| match v {
            Value::Str(b) | Value::Bin(b) => Some(b),
            _ => None,
        })
    }

    pub fn str(&self, name: &str) -> Result<Option<&'a str>, PayloadError> {
        self.typed(name, "a UTF-8 string", |v| match v {
            Value::Str(b) => std::str::from_utf8(b).ok(),
            _ => None,
        })
    }

    pub fn uint(&self, name: &str) -> Result<Option<u64>, PayloadError> {
        self.typed(name, "an unsigned integer", |v| match v {
            Value::UInt(n) => Some(n),
            _ => None,
        })
    }

    /// An unsigned integer field that must fit `max`.
    pub fn uint_max(&self, name: &str, max: u64) -> Result<Option<u64>, PayloadError> {
        match self.uint(name)? {
            Some(n) if n > max => Err(err(format!("field '{name}' is at most {max}, not {n}"))),
            v => Ok(v),
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, PayloadError> {
        self.typed(name, "true or false", |v| match v {
            Value::Bool(b) => Some(b),
            _ => None,
        })
    }

    /// A field that must be there.
    pub fn required<T>(
        &self,
        name: &str,
        get: impl Fn(&Self, &str) -> Result<Option<T>, PayloadError>,
    ) -> Result<T, PayloadError> {
        get(self, name)?.ok_or_else(|| err(format!("field '{name}' is missing")))
    }
}

/// Writes a payload map of `n` fields; each `field` call writes a key and its value.
pub struct MapWriter<'o> {
    out: &'o mut Vec<u8>,
}

impl<'o> MapWriter<'o> {
    #[inline]
    pub fn new(out: &'o mut Vec<u8>, n: u32) -> MapWriter<'o> {
        msgpack::write_map_len(out, n);
        MapWriter { out }
    }

    #[inline]
    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        msgpack::write_str(self.out, key);
        msgpack::write_str(self.out, v);
        self
    }

    #[inline]
    pub fn bin(&mut self, key: &str, v: &[u8]) -> &mut Self {
        msgpack::write_str(self.out, key);
        msgpack::write_bin(self.out, v);
        self
    }

    #[inline]
    pub fn uint(&mut self, key: &str, v: u64) -> &mut Self {
        msgpack::write_str(self.out, key);
        msgpack::write_uint(self.out, v);
        self
    }

    pub fn strs<'s>(&mut self, key: &str, v: impl ExactSizeIterator<Item = &'s str>) -> &mut Self {
        msgpack::write_str(self.out, key);
        msgpack::write_array_len(self.out, v.len() as u32);
        for s in v {
            msgpack::write_str(self.out, s);
        }
        self
    }
}

/// MUTATION's subcommands (the library's numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MutationKind {
    Add = 0,
    Set = 1,
    Replace = 2,
    Append = 3,
    Prepend = 4,
    Patch = 5,
}

impl MutationKind {
    pub fn from_code(n: u64) -> Option<MutationKind> {
        Some(match n {
            0 => MutationKind::Add,
            1 => MutationKind::Set,
            2 => MutationKind::Replace,
            3 => MutationKind::Append,
            4 => MutationKind::Prepend,
            5 => MutationKind::Patch,
            _ => return None,
        })
    }
}

/// A MUTATION request: `{type, id, value, flags?, expiration?, cas?, datatype?, durability?}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mutation<'a> {
    pub kind: MutationKind,
    pub id: &'a [u8],
    pub value: &'a [u8],
    pub flags: u32,
    /// Seconds, as memcached takes an expiry (relative up to 30 days, else a Unix time).
    pub expiration: u32,
    pub cas: u64,
    /// 1 when the value is JSON.
    pub datatype: u8,
    /// "majority", "majority_and_persist_active" or "persist_to_majority".
    pub durability: Option<&'a str>,
}

impl<'a> Mutation<'a> {
    pub fn parse(payload: &'a [u8]) -> Result<Mutation<'a>, PayloadError> {
        Mutation::from_fields(&Fields::parse(payload)?)
    }

    /// The request from its payload's fields, already read.
    pub fn from_fields(f: &Fields<'a>) -> Result<Mutation<'a>, PayloadError> {
        let code = f.required("type", Fields::uint)?;
        let kind = MutationKind::from_code(code).ok_or_else(|| {
            err(format!(
                "field 'type': no mutation {code} (0 add .. 5 patch)"
            ))
        })?;
        Ok(Mutation {
            kind,
            id: f.required("id", Fields::bytes)?,
            value: f.bytes("value")?.unwrap_or_default(),
            flags: f.uint_max("flags", u32::MAX as u64)?.unwrap_or(0) as u32,
            expiration: f.uint_max("expiration", u32::MAX as u64)?.unwrap_or(0) as u32,
            cas: f.uint("cas")?.unwrap_or(0),
            datatype: f.uint_max("datatype", 1)?.unwrap_or(0) as u8,
            durability: f.str("durability")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(build: impl FnOnce(&mut MapWriter<'_>), n: u32) -> Vec<u8> {
        let mut out = Vec::new();
        build(&mut MapWriter::new(&mut out, n));
        out
    }

    #[test]
    fn a_mutation_reads_with_its_defaults() {
        let p = map(
            |m| {
                m.uint("type", 1)
                    .str("id", "doc")
                    .bin("value", b"{}")
                    .uint("datatype", 1)
                    .str("unknown_field", "ignored");
            },
            5,
        );
        assert_eq!(
            Mutation::parse(&p),
            Ok(Mutation {
                kind: MutationKind::Set,
                id: b"doc",
                value: b"{}",
                flags: 0,
                expiration: 0,
                cas: 0,
                datatype: 1,
                durability: None,
            })
        );
    }

    #[test]
    fn bad_payloads_name_the_field() {
        let no_id = map(
            |m| {
                m.uint("type", 1);
            },
            1,
        );
        assert_eq!(
            Mutation::parse(&no_id),
            Err(PayloadError("field 'id' is missing".into()))
        );
        let bad_type = map(
            |m| {
                m.uint("type", 9).str("id", "x");
            },
            2,
        );
        assert!(Mutation::parse(&bad_type)
            .unwrap_err()
            .0
            .contains("no mutation 9"));
        let wrong = map(
            |m| {
                m.str("type", "set").str("id", "x");
            },
            2,
        );
        assert_eq!(
            Mutation::parse(&wrong),
            Err(PayloadError(
                "field 'type' must be an unsigned integer".into()
            ))
        );
        let twice = map(
            |m| {
                m.str("id", "a").str("id", "b");
            },
            2,
        );
        assert!(Fields::parse(&twice).unwrap_err().0.contains("given twice"));
        let flags = map(
            |m| {
                m.uint("type", 1).str("id", "x").uint("flags", 1 << 40);
            },
            3,
        );
        assert!(Mutation::parse(&flags).unwrap_err().0.contains("at most"));
        assert!(Fields::parse(b"\x91\x01")
            .unwrap_err()
            .0
            .contains("not a msgpack map"));
        assert!(Fields::parse(&[0xdf, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(Fields::parse(b"").unwrap().str("x").unwrap().is_none());
    }
}
