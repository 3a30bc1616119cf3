//! A document as sub-document commands see it: its extended attributes, as one JSON object by
//! key (so that a path's first component names the attribute and the rest goes inside it, with
//! the same operations as a body's), and its body, parsed only when a spec needs it. Read from
//! a stored value and written back as one (`sluice_proto::xattr`).

use serde_json::{Map, Value};
use sluice_core::Landing;
use sluice_proto::xattr::{self, DATATYPE_XATTR, MAX_KEY};

use super::ops;
use super::SubdocError;

/// The datatype bit of a JSON body.
const JSON: u8 = 0x01;

/// The most bytes a document's extended attributes may take (kv_engine's limit for system
/// ones; sluice holds user ones to it too, apart from the body's own limit).
pub(super) const MAX_XATTR_BYTES: usize = 1 << 20;

pub(super) struct Document {
    /// Always an object: attribute key to value.
    pub attrs: Value,
    body: Vec<u8>,
    /// The body parsed, once a spec needed it; after a change, what is written.
    parsed: Option<Value>,
    body_json: bool,
    pub body_changed: bool,
}

impl Document {
    /// A stored value and its datatype.
    pub fn read(value: &[u8], datatype: u8) -> Result<Document, SubdocError> {
        let (pairs, body) = if datatype & DATATYPE_XATTR != 0 {
            let (pairs, body) = xattr::split(value).map_err(|_| SubdocError::XattrEinval)?;
            if value.len() - body.len() > MAX_XATTR_BYTES {
                return Err(SubdocError::DocTooBig);
            }
            (pairs, body)
        } else {
            (Vec::new(), value)
        };
        let mut attrs = Map::new();
        for (k, v) in pairs {
            let k = std::str::from_utf8(k).map_err(|_| SubdocError::XattrEinval)?;
            check_key(k)?;
            let v = serde_json::from_slice(v).map_err(|_| SubdocError::XattrEinval)?;
            attrs.insert(k.to_string(), v);
        }
        Ok(Document {
            attrs: Value::Object(attrs),
            body: body.to_vec(),
            parsed: None,
            body_json: datatype & JSON != 0,
            body_changed: false,
        })
    }

    /// A new document of `body` (a JSON value) and no attributes.
    pub fn new(body: Value) -> Document {
        Document {
            attrs: Value::Object(Map::new()),
            body: Vec::new(),
            parsed: Some(body),
            body_json: true,
            body_changed: true,
        }
    }

    /// A new deleted document: no body, no attributes yet.
    pub fn deleted() -> Document {
        Document {
            attrs: Value::Object(Map::new()),
            body: Vec::new(),
            parsed: None,
            body_json: false,
            body_changed: false,
        }
    }

    /// The body parsed as JSON, to read or change (a change is written).
    pub fn body_mut(&mut self) -> Result<&mut Value, SubdocError> {
        if self.parsed.is_none() {
            self.parsed = Some(ops::parse_doc(&self.body)?);
        }
        self.body_changed = true;
        Ok(self.parsed.as_mut().expect("parsed above"))
    }

    /// The body parsed as JSON, to read.
    pub fn body_value(&mut self) -> Result<&Value, SubdocError> {
        if self.parsed.is_none() {
            self.parsed = Some(ops::parse_doc(&self.body)?);
        }
        Ok(self.parsed.as_ref().expect("parsed above"))
    }

    /// Replaces the body with `raw` bytes (a whole-document SET, REPLACE_BODY_WITH_XATTR).
    pub fn set_body(&mut self, raw: Vec<u8>) {
        self.body_json = serde_json::from_slice::<serde::de::IgnoredAny>(&raw).is_ok();
        self.body = raw;
        self.parsed = None;
        self.body_changed = true;
    }

    /// The body as it will be written.
    pub fn body(&mut self) -> &[u8] {
        if self.body_changed {
            if let Some(v) = self.parsed.take() {
                self.body = serde_json::to_vec(&v).expect("a JSON value serializes");
                self.body_json = true;
            }
        }
        &self.body
    }

    /// The attributes' keys, in order.
    pub fn attr_keys(&self) -> Vec<String> {
        self.attrs
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// The value to store and its datatype (JSON and XATTR bits).
    pub fn write(mut self) -> (Vec<u8>, u8) {
        self.body();
        let attrs: Vec<(String, Vec<u8>)> = match self.attrs {
            Value::Object(m) => m
                .into_iter()
                .map(|(k, v)| (k, serde_json::to_vec(&v).expect("a JSON value serializes")))
                .collect(),
            _ => Vec::new(),
        };
        let mut datatype = if self.body_json && !self.body.is_empty() {
            JSON
        } else {
            0
        };
        if !attrs.is_empty() {
            datatype |= DATATYPE_XATTR;
        }
        (xattr::join(&attrs, &self.body), datatype)
    }
}

/// An extended attribute's key (a path's first component) as sub-document mutations accept it.
pub(super) fn check_key(key: &str) -> Result<(), SubdocError> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(SubdocError::XattrEinval);
    }
    Ok(())
}

/// What an EXPAND_MACROS value becomes.
pub(super) enum Expanded {
    Value(Vec<u8>),
    /// `${Mutation.value_crc32c}`: the CRC32C of the body written, known once every spec ran.
    BodyCrc,
}

/// Expands a macro (the whole value, a JSON string) as kv_engine does: `${Mutation.CAS}` to
/// the new CAS in network byte order and `${Mutation.seqno}` to the new seqno, each as
/// "0x%016x"; `${Mutation.value_crc32c}` to the body's CRC32C as "0x%08x". A value that is no
/// macro goes as it is.
pub(super) fn expand(raw: &[u8], landing: Landing) -> Result<Expanded, SubdocError> {
    Ok(match raw.trim_ascii() {
        br#""${Mutation.CAS}""# => {
            Expanded::Value(format!("\"0x{:016x}\"", landing.cas.swap_bytes()).into_bytes())
        }
        br#""${Mutation.seqno}""# => {
            Expanded::Value(format!("\"0x{:016x}\"", landing.seqno).into_bytes())
        }
        br#""${Mutation.value_crc32c}""# => Expanded::BodyCrc,
        v if v.starts_with(b"\"${") => return Err(SubdocError::UnknownMacro),
        _ => Expanded::Value(raw.to_vec()),
    })
}

/// The body's CRC32C as `$document.value_crc32c` and `${Mutation.value_crc32c}` give it.
pub(super) fn crc_text(body: &[u8]) -> String {
    format!("0x{:08x}", crc32c::crc32c(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_and_body_round_trip_and_macros_expand_as_kv_engine_does() {
        let mut d = Document::new(serde_json::json!({"a": 1}));
        d.attrs
            .as_object_mut()
            .unwrap()
            .insert("txn".into(), serde_json::json!({"id": "x"}));
        let (value, datatype) = d.write();
        assert_eq!(datatype, DATATYPE_XATTR | JSON);
        let mut again = Document::read(&value, datatype).unwrap();
        assert_eq!(again.attr_keys(), ["txn"]);
        assert_eq!(again.body(), br#"{"a":1}"#);
        let landing = Landing {
            cas: 0x155C_D21D_A758_0000,
            seqno: 7,
        };
        let Expanded::Value(cas) = expand(br#""${Mutation.CAS}""#, landing).unwrap() else {
            panic!()
        };
        assert_eq!(cas, br#""0x000058a71dd25c15""#);
        assert!(matches!(
            expand(br#""${Mutation.nothing}""#, landing),
            Err(SubdocError::UnknownMacro)
        ));
        assert!(check_key("a_key_of_16bytes").is_err() && check_key("txn").is_ok());
    }
}
