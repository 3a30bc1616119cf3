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
        Fields::each(payload, |key, value| {
            fields.entries.push((key, value));
            Ok(())
        })?;
        Ok(fields)
    }

    /// Reads a payload map once, in order, handing `each` every key and its raw value, with
    /// the checks `parse` makes: a map (an empty payload is an empty one), at most
    /// `MAX_FIELDS` fields, no key twice, nothing after it. For requests read on hot paths,
    /// which take the fields they know as they go instead of looking each up by name.
    pub fn each(
        payload: &'a [u8],
        mut each: impl FnMut(&'a [u8], &'a [u8]) -> Result<(), PayloadError>,
    ) -> Result<(), PayloadError> {
        if payload.is_empty() {
            return Ok(());
        }
        let bad = |e: msgpack::DecodeError| err(format!("the payload is not a msgpack map: {e}"));
        let mut r = Reader::new(payload);
        let n = r.read_map_len().map_err(bad)?;
        if n > MAX_FIELDS {
            return Err(err(format!(
                "a payload of {n} fields: at most {MAX_FIELDS} are read"
            )));
        }
        let mut keys: SmallVec<[&[u8]; INLINE_FIELDS]> = SmallVec::new();
        for _ in 0..n {
            let key = r.read_str().map_err(bad)?;
            if keys.contains(&key) {
                return Err(err(format!(
                    "field '{}' is given twice",
                    String::from_utf8_lossy(key)
                )));
            }
            keys.push(key);
            let value = r.read_raw_value(MAX_DEPTH).map_err(bad)?;
            each(key, value)?;
        }
        if !r.is_empty() {
            return Err(err("bytes after the payload's map".into()));
        }
        Ok(())
    }

    /// The raw value of field `name`, if given.
    fn raw(&self, name: &str) -> Option<Raw<'a>> {
        self.entries
            .iter()
            .find(|(k, _)| *k == name.as_bytes())
            .map(|&(_, raw)| Raw(raw))
    }

    /// A string or binary field (document ids may be either).
    pub fn bytes(&self, name: &str) -> Result<Option<&'a [u8]>, PayloadError> {
        self.raw(name).map_or(Ok(None), |r| r.bytes(name))
    }

    pub fn str(&self, name: &str) -> Result<Option<&'a str>, PayloadError> {
        self.raw(name).map_or(Ok(None), |r| r.str(name))
    }

    pub fn uint(&self, name: &str) -> Result<Option<u64>, PayloadError> {
        self.raw(name).map_or(Ok(None), |r| r.uint(name))
    }

    /// An unsigned integer field that must fit `max`.
    pub fn uint_max(&self, name: &str, max: u64) -> Result<Option<u64>, PayloadError> {
        self.raw(name).map_or(Ok(None), |r| r.uint_max(name, max))
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, PayloadError> {
        self.raw(name).map_or(Ok(None), |r| r.bool(name))
    }

    /// A field that must be there.
    pub fn required<T>(
        &self,
        name: &str,
        get: impl Fn(&Self, &str) -> Result<Option<T>, PayloadError>,
    ) -> Result<T, PayloadError> {
        get(self, name)?.ok_or_else(|| missing(name))
    }
}

fn missing(name: &str) -> PayloadError {
    err(format!("field '{name}' is missing"))
}

/// A field's value as its raw msgpack, decoded as the type asked for (nil reads as not given);
/// `name` is the field's, for the errors.
#[derive(Debug, Clone, Copy)]
struct Raw<'a>(&'a [u8]);

impl<'a> Raw<'a> {
    fn typed<T>(
        self,
        name: &str,
        expected: &str,
        pick: impl Fn(Value<'a>) -> Option<T>,
    ) -> Result<Option<T>, PayloadError> {
        match Reader::new(self.0)
            .read_value()
            .map_err(|e| err(format!("field '{name}': {e}")))?
        {
            Value::Nil => Ok(None),
            v => pick(v)
                .map(Some)
                .ok_or_else(|| err(format!("field '{name}' must be {expected}"))),
        }
    }

    fn bytes(self, name: &str) -> Result<Option<&'a [u8]>, PayloadError> {
        self.typed(name, "a string or binary", |v| match v {
            Value::Str(b) | Value::Bin(b) => Some(b),
            _ => None,
        })
    }

    fn str(self, name: &str) -> Result<Option<&'a str>, PayloadError> {
        self.typed(name, "a UTF-8 string", |v| match v {
            Value::Str(b) => std::str::from_utf8(b).ok(),
            _ => None,
        })
    }

    fn uint(self, name: &str) -> Result<Option<u64>, PayloadError> {
        self.typed(name, "an unsigned integer", |v| match v {
            Value::UInt(n) => Some(n),
            _ => None,
        })
    }

    fn uint_max(self, name: &str, max: u64) -> Result<Option<u64>, PayloadError> {
        match self.uint(name)? {
            Some(n) if n > max => Err(err(format!("field '{name}' is at most {max}, not {n}"))),
            v => Ok(v),
        }
    }

    fn bool(self, name: &str) -> Result<Option<bool>, PayloadError> {
        self.typed(name, "true or false", |v| match v {
            Value::Bool(b) => Some(b),
            _ => None,
        })
    }
}

/// A string or binary value (what `Raw::bytes` takes) read directly, for the plain readings;
/// None for anything else, nil included, which the general readings tell apart.
fn plain_bytes<'a>(r: &mut Reader<'a>) -> Option<&'a [u8]> {
    match r.peek_marker()? {
        0xa0..=0xbf | 0xd9..=0xdb => r.read_str().ok(),
        0xc4..=0xc6 => r.read_bin().ok(),
        _ => None,
    }
}

/// GET's request `{id}`, read once (a hot path).
pub fn get_id(payload: &[u8]) -> Result<&[u8], PayloadError> {
    // The form nearly every GET takes, a map of "id" alone, read without the general walk
    // (anything else, faults included, goes the general way, which tells them).
    if let [0x81, 0xa2, b'i', b'd', value @ ..] = payload {
        let mut r = Reader::new(value);
        if let Some(id) = plain_bytes(&mut r).filter(|_| r.is_empty()) {
            return Ok(id);
        }
    }
    let mut id = None;
    Fields::each(payload, |key, value| {
        if key == b"id" {
            id = Some(Raw(value));
        }
        Ok(())
    })?;
    id.map_or(Ok(None), |r| r.bytes("id"))?
        .ok_or_else(|| missing("id"))
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
    /// The well-formed request as nearly every client sends it, read in one go: a map of at
    /// most 15 fields it knows, each once and of its type (no nil), nothing after it. Anything
    /// else is None and is read the general way, which tells the faults.
    fn read_plain(payload: &'a [u8]) -> Option<Mutation<'a>> {
        let mut r = Reader::new(payload);
        let n = match r.peek_marker()? {
            m @ 0x80..=0x8f => (m & 0x0f) as usize,
            _ => return None,
        };
        r.read_map_len().ok()?;
        let mut m = Mutation {
            kind: MutationKind::Set,
            id: &[],
            value: &[],
            flags: 0,
            expiration: 0,
            cas: 0,
            datatype: 0,
            durability: None,
        };
        let (mut seen, mut kind) = (0u8, None);
        for _ in 0..n {
            let key = r.read_str().ok()?;
            let bit = match key {
                b"type" => {
                    kind = MutationKind::from_code(r.read_uint().ok()?);
                    kind?;
                    1
                }
                b"id" => {
                    m.id = plain_bytes(&mut r)?;
                    2
                }
                b"value" => {
                    m.value = plain_bytes(&mut r)?;
                    4
                }
                b"flags" => {
                    m.flags = u32::try_from(r.read_uint().ok()?).ok()?;
                    8
                }
                b"expiration" => {
                    m.expiration = u32::try_from(r.read_uint().ok()?).ok()?;
                    16
                }
                b"cas" => {
                    m.cas = r.read_uint().ok()?;
                    32
                }
                b"datatype" => {
                    m.datatype = u8::try_from(r.read_uint().ok()?).ok().filter(|&d| d <= 1)?;
                    64
                }
                b"durability" => {
                    m.durability = Some(std::str::from_utf8(r.read_str().ok()?).ok()?);
                    128
                }
                _ => return None,
            };
            if seen & bit != 0 {
                return None;
            }
            seen |= bit;
        }
        // Type and id are required.
        if seen & 3 != 3 || !r.is_empty() {
            return None;
        }
        m.kind = kind?;
        Some(m)
    }

    /// The request from its payload, read once (MUTATION is a hot path): the plain way when it
    /// is well formed, else the general way.
    pub fn parse(payload: &'a [u8]) -> Result<Mutation<'a>, PayloadError> {
        match Mutation::read_plain(payload) {
            Some(m) => Ok(m),
            None => Mutation::read_general(payload),
        }
    }

    /// Each field it knows is taken as the map is read, then decoded in a fixed order, so that
    /// a request with several faults gets the same error whichever order its fields came in.
    fn read_general(payload: &'a [u8]) -> Result<Mutation<'a>, PayloadError> {
        let mut raw = [None::<Raw<'a>>; 8];
        Fields::each(payload, |key, value| {
            let i = match key {
                b"type" => 0,
                b"id" => 1,
                b"value" => 2,
                b"flags" => 3,
                b"expiration" => 4,
                b"cas" => 5,
                b"datatype" => 6,
                b"durability" => 7,
                _ => return Ok(()),
            };
            raw[i] = Some(Raw(value));
            Ok(())
        })?;
        let [ty, id, value, flags, expiration, cas, datatype, durability] = raw;
        let code = ty
            .map_or(Ok(None), |r| r.uint("type"))?
            .ok_or_else(|| missing("type"))?;
        let kind = MutationKind::from_code(code).ok_or_else(|| {
            err(format!(
                "field 'type': no mutation {code} (0 add .. 5 patch)"
            ))
        })?;
        let u32_max = u32::MAX as u64;
        Ok(Mutation {
            kind,
            id: id
                .map_or(Ok(None), |r| r.bytes("id"))?
                .ok_or_else(|| missing("id"))?,
            value: value
                .map_or(Ok(None), |r| r.bytes("value"))?
                .unwrap_or_default(),
            flags: flags
                .map_or(Ok(None), |r| r.uint_max("flags", u32_max))?
                .unwrap_or(0) as u32,
            expiration: expiration
                .map_or(Ok(None), |r| r.uint_max("expiration", u32_max))?
                .unwrap_or(0) as u32,
            cas: cas.map_or(Ok(None), |r| r.uint("cas"))?.unwrap_or(0),
            datatype: datatype
                .map_or(Ok(None), |r| r.uint_max("datatype", 1))?
                .unwrap_or(0) as u8,
            durability: durability.map_or(Ok(None), |r| r.str("durability"))?,
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
    fn a_mutation_reads_the_same_whatever_its_fields_order_and_faults_come_in_a_fixed_order() {
        let forward = map(
            |m| {
                m.uint("type", 2)
                    .bin("id", b"k")
                    .bin("value", b"v")
                    .uint("flags", 7)
                    .uint("expiration", 30)
                    .uint("cas", 9)
                    .str("durability", "majority");
            },
            7,
        );
        let backward = map(
            |m| {
                m.str("durability", "majority")
                    .uint("cas", 9)
                    .uint("expiration", 30)
                    .uint("flags", 7)
                    .bin("value", b"v")
                    .bin("id", b"k")
                    .uint("type", 2);
            },
            7,
        );
        let m = Mutation::parse(&forward).unwrap();
        assert_eq!(Mutation::parse(&backward).unwrap(), m);
        // Both are read the plain way, which reads as the general one does.
        assert_eq!(Mutation::read_plain(&backward), Some(m.clone()));
        assert_eq!(Mutation::read_general(&forward), Ok(m.clone()));
        let want = Mutation {
            kind: MutationKind::Replace,
            id: b"k",
            value: b"v",
            flags: 7,
            expiration: 30,
            cas: 9,
            datatype: 0,
            durability: Some("majority"),
        };
        assert_eq!(m, want);
        // Two faults: the type's is told first, whichever field came first.
        let two = map(
            |m| {
                m.str("flags", "x").str("type", "set");
            },
            2,
        );
        assert!(Mutation::parse(&two).unwrap_err().0.contains("'type'"));
        let twice = map(
            |m| {
                m.uint("type", 1).bin("id", b"a").bin("id", b"b");
            },
            3,
        );
        assert!(Mutation::parse(&twice)
            .unwrap_err()
            .0
            .contains("given twice"));
    }

    proptest::proptest! {
        /// Whatever the plain reading accepts, the general one reads the same.
        #[test]
        fn the_plain_reading_agrees_with_the_general_one(
            fields in proptest::collection::vec((0usize..10, 0usize..6, 0u64..300), 0..7)
        ) {
            const KEYS: [&str; 10] = [
                "type", "id", "value", "flags", "expiration", "cas", "datatype", "durability",
                "other", "id",
            ];
            let mut p = Vec::new();
            let mut w = MapWriter::new(&mut p, fields.len() as u32);
            for &(k, kind, n) in &fields {
                match kind {
                    0 => w.uint(KEYS[k], n % 7),
                    1 => w.uint(KEYS[k], n << 30),
                    2 => w.bin(KEYS[k], b"xy"),
                    3 => w.str(KEYS[k], "majority"),
                    4 => w.strs(KEYS[k], ["a"].into_iter()),
                    _ => {
                        msgpack::write_str(w.out, KEYS[k]);
                        msgpack::write_nil(w.out);
                        &mut w
                    }
                };
            }
            if let Some(m) = Mutation::read_plain(&p) {
                proptest::prop_assert_eq!(Mutation::read_general(&p), Ok(m));
            }
        }
    }

    #[test]
    fn a_get_reads_its_id_and_ignores_other_fields() {
        let p = map(
            |m| {
                m.str("lane_hint", "x").bin("id", b"doc");
            },
            2,
        );
        assert_eq!(get_id(&p), Ok(&b"doc"[..]));
        // "id" alone, as binary or string, and the same with faults.
        let alone = map(
            |m| {
                m.bin("id", b"doc");
            },
            1,
        );
        assert_eq!(get_id(&alone), Ok(&b"doc"[..]));
        let as_str = map(
            |m| {
                m.str("id", "doc");
            },
            1,
        );
        assert_eq!(get_id(&as_str), Ok(&b"doc"[..]));
        let mut trailing = alone.clone();
        trailing.push(0xc0);
        assert!(get_id(&trailing).unwrap_err().0.contains("bytes after"));
        let number = map(
            |m| {
                m.uint("id", 7);
            },
            1,
        );
        assert!(get_id(&number)
            .unwrap_err()
            .0
            .contains("must be a string or binary"));
        assert!(get_id(&alone[..alone.len() - 1])
            .unwrap_err()
            .0
            .contains("truncated"));
        assert!(get_id(&map(|_| {}, 0))
            .unwrap_err()
            .0
            .contains("'id' is missing"));
        assert!(get_id(b"\x91\x01")
            .unwrap_err()
            .0
            .contains("not a msgpack map"));
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
