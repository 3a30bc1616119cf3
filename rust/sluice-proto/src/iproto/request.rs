//! One iproto request packet decoded as Tarantool 2.6 decodes it (src/box/xrow.c): the header
//! map, then the body map of the request's family, every known key type-checked by MessagePack
//! class, unknown keys stepped over, mandatory fields reported by name. Byte fields borrow the
//! packet; each is one whole value of the right kind, nested at most [`MAX_DEPTH`] deep.

use std::fmt;

use super::codes::{self, ER_INVALID_MSGPACK, ER_MISSING_REQUEST_FIELD, ER_UNKNOWN_REQUEST_TYPE};
use super::{mp_type, MpType, MAX_DEPTH};
use crate::msgpack::{DecodeError, Reader};

/// The header of a request. `schema_version` is what the client sent, if anything: Tarantool
/// checks it against its own on every request when it is present and not 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    pub code: u32,
    pub sync: u64,
    pub schema_version: Option<u64>,
    pub stream_id: Option<u64>,
    /// sluice's KEY_SLUICE_FORWARDED_FOR: where the user name lies in the packet (start, end).
    pub forwarded_for: Option<(u32, u32)>,
    /// sluice's KEY_SLUICE_PART: where the vbuckets to read lie in the packet (start, end).
    pub part: Option<(u32, u32)>,
}

impl Header {
    /// The user a forwarded request runs as, from the packet it was decoded from.
    pub fn forwarded_for<'p>(&self, packet: &'p [u8]) -> Option<&'p [u8]> {
        let (start, end) = self.forwarded_for?;
        packet.get(start as usize..end as usize)
    }

    /// The vbuckets another node asks this one to read, from the packet it was decoded from:
    /// one bit each (see `sluice_core::vbucket::VbSet`).
    pub fn part<'p>(&self, packet: &'p [u8]) -> Option<&'p [u8]> {
        let (start, end) = self.part?;
        packet.get(start as usize..end as usize)
    }
}

/// AUTH's scramble, as far as a decoder can judge it without knowing the user. Tarantool looks
/// the user up first (ER_NO_SUCH_USER), lets `guest` in on an empty tuple when guest has no
/// password, and only then raises ER_INVALID_MSGPACK for a malformed tuple.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scramble<'a> {
    /// `TUPLE []`: a return to guest without a password.
    Empty,
    /// The 20-byte chap-sha1 scramble (net.box sends it as STR, tarantool-python as BIN).
    Chap(&'a [u8; 20]),
    /// The tuple is malformed; the message of the ER_INVALID_MSGPACK to answer with once the
    /// user is known ("Invalid MsgPack - invalid scramble size", ...).
    Invalid(&'static str),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// PING; any body is ignored.
    Ping,
    /// AUTH. `mechanism` is the tuple's first element when it is a string; Tarantool 2.6 does
    /// not check it (only the scramble decides).
    Auth {
        user: &'a [u8],
        mechanism: Option<&'a [u8]>,
        scramble: Scramble<'a>,
    },
    /// SELECT. INDEX_ID, OFFSET and ITERATOR default to 0 (EQ); LIMIT and KEY are mandatory.
    /// `iterator` is not range-checked here (box_select does that).
    Select {
        space_id: u32,
        index_id: u32,
        limit: u32,
        offset: u32,
        iterator: u32,
        key: &'a [u8],
    },
    Insert {
        space_id: u32,
        tuple: &'a [u8],
    },
    Replace {
        space_id: u32,
        tuple: &'a [u8],
    },
    /// UPDATE: the operations travel in TUPLE (0x21). `index_base` is 0 (C) unless the client
    /// sent INDEX_BASE (net.box sends 1).
    Update {
        space_id: u32,
        index_id: u32,
        key: &'a [u8],
        ops: &'a [u8],
        index_base: u32,
    },
    /// UPSERT: the tuple in TUPLE (0x21), the operations in OPS (0x28).
    Upsert {
        space_id: u32,
        tuple: &'a [u8],
        ops: &'a [u8],
        index_base: u32,
    },
    Delete {
        space_id: u32,
        index_id: u32,
        key: &'a [u8],
    },
    /// CALL (10) or, with `call_16`, the 1.6 CALL (6) whose results come back as tuples.
    /// `args` is `[]` when the client sent none.
    Call {
        name: &'a [u8],
        args: &'a [u8],
        call_16: bool,
    },
    Eval {
        expr: &'a [u8],
        args: &'a [u8],
    },
    /// IPROTO_ID (2.10): the client's protocol version and features. Tarantool 2.6 does not
    /// know it and answers ER_UNKNOWN_REQUEST_TYPE; a server that speaks 2.10 answers with
    /// [`super::response::write_id`].
    Id {
        version: u64,
        features: Vec<u64>,
    },
    /// SQL; the body is not looked into.
    Execute,
    Prepare,
    /// NOP (12). Tarantool 2.6's network layer does not route it: it answers
    /// ER_UNKNOWN_REQUEST_TYPE.
    Nop,
    /// Any other type, replication's included: answer
    /// [`RequestError::unknown_request_type`].
    Unknown(u32),
}

/// A request Tarantool refuses before running it. `sync` is None when the header could not be
/// read far enough to find one (answer with sync 0, as Tarantool does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestError {
    pub sync: Option<u64>,
    pub code: u32,
    pub message: String,
}

impl RequestError {
    fn invalid(sync: Option<u64>, what: &str) -> Self {
        RequestError {
            sync,
            code: ER_INVALID_MSGPACK,
            message: format!("Invalid MsgPack - {what}"),
        }
    }

    fn missing(sync: u64, field: &str) -> Self {
        RequestError {
            sync: Some(sync),
            code: ER_MISSING_REQUEST_FIELD,
            message: format!("Missing mandatory field '{field}' in request"),
        }
    }

    /// ER_UNKNOWN_REQUEST_TYPE for a type this server does not serve.
    pub fn unknown_request_type(sync: u64, code: u32) -> Self {
        RequestError {
            sync: Some(sync),
            code: ER_UNKNOWN_REQUEST_TYPE,
            message: format!("Unknown request type {code}"),
        }
    }
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code {})", self.message, self.code)
    }
}

impl std::error::Error for RequestError {}

/// The type Tarantool 2.6 requires of a header key's value (iproto_key_type); keys it lists
/// with no type must hold nil. `None` for keys it refuses outright (0x53 and above).
fn header_key_type(key: u64) -> Option<MpType> {
    Some(match key {
        0x04 => MpType::Double,
        0x00..=0x1f => MpType::UInt,
        0x20 | 0x21 | 0x28 => MpType::Array,
        0x22..=0x25 | 0x27 => MpType::Str,
        0x26 | 0x29..=0x2b => MpType::Map,
        0x2c..=0x52 => MpType::Nil,
        0x70 => MpType::Str,
        0x71 => MpType::Bin,
        _ => return None,
    })
}

/// Body keys a DML body reads (IPROTO_DML_BODY_BMAP), with their types. Tarantool spots them by
/// the key's first byte, so any other key, or one written in a wider encoding, is skipped.
fn dml_key_type(first: u8) -> Option<MpType> {
    match first {
        0x10..=0x15 => Some(MpType::UInt),
        0x20 | 0x21 | 0x28 => Some(MpType::Array),
        0x2a => Some(MpType::Map),
        _ => None,
    }
}

/// The body of a packet [`decode`] accepted: the bytes after its header (empty for none).
pub fn body_of(packet: &[u8]) -> &[u8] {
    let mut r = Reader::new(packet);
    match r.read_uint().and_then(|_| r.skip_value(MAX_DEPTH)) {
        Ok(()) => r.rest(),
        Err(_) => &[],
    }
}

/// Decodes one packet as [`super::frame::check`] delimited it (length prefix included).
pub fn decode(packet: &[u8]) -> Result<(Header, Request<'_>), RequestError> {
    let mut r = Reader::new(packet);
    // The frame check already accepted the prefix; a packet handed over without one is
    // refused the same way.
    r.read_uint()
        .map_err(|_| RequestError::invalid(None, "packet length"))?;
    let header = decode_header(&mut r)?;
    let sync = header.sync;
    let dml = matches!(
        header.code,
        codes::SELECT
            | codes::INSERT
            | codes::REPLACE
            | codes::UPDATE
            | codes::DELETE
            | codes::UPSERT
    );
    let body = if r.is_empty() {
        None
    } else if header.code == codes::NOP {
        // A NOP carries no body: the bytes after its header are left over.
        return Err(RequestError::invalid(Some(sync), "packet body"));
    } else if dml {
        // Checked as it is decoded (every value stepped over or read, nothing after the map):
        // the requests every load sends walk their body once.
        Some(r.rest())
    } else {
        let body = r
            .read_raw_value(MAX_DEPTH)
            .map_err(|_| RequestError::invalid(Some(sync), "packet body"))?;
        if !r.is_empty() {
            return Err(RequestError::invalid(Some(sync), "packet body"));
        }
        Some(body)
    };
    let request = match header.code {
        codes::PING => Request::Ping,
        codes::SELECT
        | codes::INSERT
        | codes::REPLACE
        | codes::UPDATE
        | codes::DELETE
        | codes::UPSERT => decode_dml(header.code, sync, body)?,
        codes::CALL | codes::CALL_16 | codes::EVAL => decode_call(header.code, sync, body)?,
        codes::AUTH => decode_auth(sync, body)?,
        codes::ID => decode_id(sync, body)?,
        codes::EXECUTE => Request::Execute,
        codes::PREPARE => Request::Prepare,
        codes::NOP => Request::Nop,
        other => Request::Unknown(other),
    };
    Ok((header, request))
}

/// The body of a row of Tarantool's WAL or replication stream that records a write (INSERT,
/// REPLACE, UPDATE, UPSERT or DELETE), decoded as that request; None for other row types.
pub fn decode_dml_body(code: u32, body: &[u8]) -> Option<Result<Request<'_>, RequestError>> {
    let dml = matches!(
        code,
        codes::INSERT | codes::REPLACE | codes::UPDATE | codes::DELETE | codes::UPSERT
    );
    (dml && !body.is_empty()).then(|| decode_dml(code, 0, Some(body)))
}

fn decode_header(r: &mut Reader<'_>) -> Result<Header, RequestError> {
    let mut header = Header::default();
    let mut seen_sync = false;
    let bad = |seen_sync: bool, sync: u64| {
        RequestError::invalid(seen_sync.then_some(sync), "packet header")
    };
    let header_at = r.position();
    let raw = r.read_raw_value(MAX_DEPTH).map_err(|_| bad(false, 0))?;
    let mut h = Reader::new(raw);
    if mp_type(raw[0]) != MpType::Map {
        return Err(bad(false, 0));
    }
    let n = h.read_map_len().map_err(|_| bad(false, 0))?;
    for _ in 0..n {
        let key = h.read_uint().map_err(|_| bad(seen_sync, header.sync))?;
        let value_type = h.peek_marker().map(mp_type);
        if header_key_type(key).is_none() || header_key_type(key) != value_type {
            return Err(bad(seen_sync, header.sync));
        }
        match key {
            0x00 => header.code = h.read_uint().map_err(|_| bad(seen_sync, 0))? as u32,
            0x01 => {
                header.sync = h.read_uint().map_err(|_| bad(seen_sync, 0))?;
                seen_sync = true;
            }
            0x05 => {
                header.schema_version =
                    Some(h.read_uint().map_err(|_| bad(seen_sync, header.sync))?)
            }
            0x0a => {
                header.stream_id = Some(h.read_uint().map_err(|_| bad(seen_sync, header.sync))?)
            }
            0x70 => {
                let name = h.read_str().map_err(|_| bad(seen_sync, header.sync))?;
                let end = (header_at + h.position()) as u32;
                header.forwarded_for = Some((end - name.len() as u32, end));
            }
            0x71 => {
                let set = h.read_bin().map_err(|_| bad(seen_sync, header.sync))?;
                let end = (header_at + h.position()) as u32;
                header.part = Some((end - set.len() as u32, end));
            }
            _ => h
                .skip_value(MAX_DEPTH)
                .map_err(|_| bad(seen_sync, header.sync))?,
        }
    }
    Ok(header)
}

/// What a DML body may carry.
#[derive(Default)]
struct Dml<'a> {
    space_id: Option<u32>,
    index_id: u32,
    limit: Option<u32>,
    offset: u32,
    iterator: u32,
    index_base: u32,
    key: Option<&'a [u8]>,
    tuple: Option<&'a [u8]>,
    ops: Option<&'a [u8]>,
}

fn body_reader<'a>(sync: u64, body: &'a [u8]) -> Result<(Reader<'a>, u32), RequestError> {
    let mut r = Reader::new(body);
    if mp_type(body[0]) != MpType::Map {
        return Err(RequestError::invalid(Some(sync), "packet body"));
    }
    let n = r
        .read_map_len()
        .map_err(|_| RequestError::invalid(Some(sync), "packet body"))?;
    Ok((r, n))
}

fn decode_dml<'a>(
    code: u32,
    sync: u64,
    body: Option<&'a [u8]>,
) -> Result<Request<'a>, RequestError> {
    let mut d = Dml::default();
    if let Some(body) = body {
        let bad = |_: DecodeError| RequestError::invalid(Some(sync), "packet body");
        let (mut r, n) = body_reader(sync, body)?;
        for _ in 0..n {
            let first = r.peek_marker().unwrap_or(0xc1);
            // The body map is a level of nesting itself.
            let Some(expected) = dml_key_type(first) else {
                r.skip_value(MAX_DEPTH - 1).map_err(bad)?;
                r.skip_value(MAX_DEPTH - 1).map_err(bad)?;
                continue;
            };
            r.read_uint().map_err(bad)?;
            let value = r.read_raw_value(MAX_DEPTH - 1).map_err(bad)?;
            if mp_type(value[0]) != expected {
                return Err(RequestError::invalid(Some(sync), "packet body"));
            }
            // Tarantool keeps these in 32-bit fields.
            let uint = || Reader::new(value).read_uint().map(|v| v as u32);
            match first {
                0x10 => d.space_id = Some(uint().map_err(bad)?),
                0x11 => d.index_id = uint().map_err(bad)?,
                0x12 => d.limit = Some(uint().map_err(bad)?),
                0x13 => d.offset = uint().map_err(bad)?,
                0x14 => d.iterator = uint().map_err(bad)?,
                0x15 => d.index_base = uint().map_err(bad)?,
                0x20 => d.key = Some(value),
                0x21 => d.tuple = Some(value),
                0x28 => d.ops = Some(value),
                _ => {} // TUPLE_META: checked, unused
            }
        }
        if !r.is_empty() {
            return Err(RequestError::invalid(Some(sync), "packet body"));
        }
    }
    // The mandatory fields of each type, lowest key first: Tarantool names the lowest missing.
    let missing = |field: &str| RequestError::missing(sync, field);
    let space_id = d.space_id.ok_or_else(|| missing("space id"))?;
    Ok(match code {
        codes::SELECT => Request::Select {
            space_id,
            index_id: d.index_id,
            limit: d.limit.ok_or_else(|| missing("limit"))?,
            offset: d.offset,
            iterator: d.iterator,
            key: d.key.ok_or_else(|| missing("key"))?,
        },
        codes::INSERT => Request::Insert {
            space_id,
            tuple: d.tuple.ok_or_else(|| missing("tuple"))?,
        },
        codes::REPLACE => Request::Replace {
            space_id,
            tuple: d.tuple.ok_or_else(|| missing("tuple"))?,
        },
        codes::UPDATE => Request::Update {
            space_id,
            index_id: d.index_id,
            key: d.key.ok_or_else(|| missing("key"))?,
            ops: d.tuple.ok_or_else(|| missing("tuple"))?,
            index_base: d.index_base,
        },
        codes::DELETE => Request::Delete {
            space_id,
            index_id: d.index_id,
            key: d.key.ok_or_else(|| missing("key"))?,
        },
        _ => Request::Upsert {
            space_id,
            tuple: d.tuple.ok_or_else(|| missing("tuple"))?,
            ops: d.ops.ok_or_else(|| missing("operations"))?,
            index_base: d.index_base,
        },
    })
}

/// The body of CALL, CALL_16, EVAL and AUTH: keys must be unsigned, known ones type-checked,
/// others stepped over. Calls `field(key, value)` for each known key.
fn for_each_field<'a>(
    sync: u64,
    body: Option<&'a [u8]>,
    known: &[(u64, MpType)],
    mut field: impl FnMut(u64, &'a [u8]),
) -> Result<(), RequestError> {
    let Some(body) = body else {
        return Err(RequestError::invalid(Some(sync), "missing request body"));
    };
    let bad = |_: DecodeError| RequestError::invalid(Some(sync), "packet body");
    let (mut r, n) = body_reader(sync, body)?;
    for _ in 0..n {
        let key = r.read_uint().map_err(bad)?;
        let value = r.read_raw_value(MAX_DEPTH).map_err(bad)?;
        if let Some(&(_, expected)) = known.iter().find(|(k, _)| *k == key) {
            if mp_type(value[0]) != expected {
                return Err(RequestError::invalid(Some(sync), "packet body"));
            }
            field(key, value);
        }
    }
    Ok(())
}

/// A string value's payload (the value was type-checked as a string).
fn str_payload(value: &[u8]) -> &[u8] {
    Reader::new(value).read_str().unwrap_or_default()
}

/// An empty argument list, for calls that send none.
const NO_ARGS: &[u8] = &[0x90];

fn decode_call<'a>(
    code: u32,
    sync: u64,
    body: Option<&'a [u8]>,
) -> Result<Request<'a>, RequestError> {
    let (mut name, mut expr, mut args) = (None, None, NO_ARGS);
    let known = [
        (codes::KEY_FUNCTION_NAME as u64, MpType::Str),
        (codes::KEY_EXPR as u64, MpType::Str),
        (codes::KEY_TUPLE as u64, MpType::Array),
    ];
    for_each_field(sync, body, &known, |key, value| match key as u8 {
        codes::KEY_FUNCTION_NAME => name = Some(str_payload(value)),
        codes::KEY_EXPR => expr = Some(str_payload(value)),
        _ => args = value,
    })?;
    if code == codes::EVAL {
        let expr = expr.ok_or_else(|| RequestError::missing(sync, "expression"))?;
        return Ok(Request::Eval { expr, args });
    }
    let name = name.ok_or_else(|| RequestError::missing(sync, "function name"))?;
    Ok(Request::Call {
        name,
        args,
        call_16: code == codes::CALL_16,
    })
}

fn decode_auth<'a>(sync: u64, body: Option<&'a [u8]>) -> Result<Request<'a>, RequestError> {
    let (mut user, mut tuple) = (None, None);
    let known = [
        (codes::KEY_USER_NAME as u64, MpType::Str),
        (codes::KEY_TUPLE as u64, MpType::Array),
    ];
    for_each_field(sync, body, &known, |key, value| match key as u8 {
        codes::KEY_USER_NAME => user = Some(str_payload(value)),
        _ => tuple = Some(value),
    })?;
    let user = user.ok_or_else(|| RequestError::missing(sync, "user name"))?;
    let tuple = tuple.ok_or_else(|| RequestError::missing(sync, "tuple"))?;
    let (mechanism, scramble) = auth_tuple(tuple);
    Ok(Request::Auth {
        user,
        mechanism,
        scramble,
    })
}

/// `[mechanism, scramble]`, judged as src/box/authentication.cc does.
fn auth_tuple(tuple: &[u8]) -> (Option<&[u8]>, Scramble<'_>) {
    let mut r = Reader::new(tuple);
    let parts = r.read_array_len().unwrap_or(0);
    if parts == 0 {
        return (None, Scramble::Empty);
    }
    let mechanism = match r.peek_marker().map(mp_type) {
        Some(MpType::Str) => r.read_str().ok(),
        _ => r.skip_value(MAX_DEPTH).ok().and(None),
    };
    if parts < 2 {
        return (
            mechanism,
            Scramble::Invalid("Invalid MsgPack - authentication request body"),
        );
    }
    let scramble = match r.peek_marker().map(mp_type) {
        Some(MpType::Str) => r.read_str().ok(),
        Some(MpType::Bin) => r.read_bin().ok(),
        _ => None,
    };
    let scramble = match scramble {
        None => Scramble::Invalid("Invalid MsgPack - authentication scramble"),
        Some(s) => match <&[u8; 20]>::try_from(s) {
            Ok(s) => Scramble::Chap(s),
            Err(_) => Scramble::Invalid("Invalid MsgPack - invalid scramble size"),
        },
    };
    (mechanism, scramble)
}

/// IPROTO_ID as Tarantool 2.10 reads it: VERSION and FEATURES, other keys ignored.
fn decode_id<'a>(sync: u64, body: Option<&'a [u8]>) -> Result<Request<'a>, RequestError> {
    let bad = || RequestError::invalid(Some(sync), "request body");
    let body = body.ok_or_else(bad)?;
    let (mut version, mut features) = (0, Vec::new());
    let mut r = Reader::new(body);
    let n = r.read_map_len().map_err(|_| bad())?;
    for _ in 0..n {
        let key = r.read_uint().map_err(|_| bad())?;
        let value_type = r.peek_marker().map(mp_type);
        if header_key_type(key).is_some() && header_key_type(key) != value_type {
            return Err(bad());
        }
        match key {
            0x54 => version = r.read_uint().map_err(|_| bad())?,
            0x55 => {
                if value_type != Some(MpType::Array) {
                    return Err(bad());
                }
                let count = r.read_array_len().map_err(|_| bad())?;
                for _ in 0..count {
                    // Each element is at least a byte, so the vector stays within the packet.
                    features.push(r.read_uint().map_err(|_| bad())?);
                }
            }
            _ => r.skip_value(MAX_DEPTH).map_err(|_| bad())?,
        }
    }
    Ok(Request::Id { version, features })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iproto::unhex;

    fn decoded(hex: &str) -> (Header, Request<'static>) {
        let packet: &'static [u8] = Box::leak(unhex(hex).into_boxed_slice());
        decode(packet).unwrap()
    }

    fn refused(hex: &str) -> RequestError {
        decode(&unhex(hex)).unwrap_err()
    }

    #[test]
    fn ping_from_each_client_with_and_without_a_body() {
        // tarantool-python: fixint length, header {type, sync 0, schema_version 0}, no body.
        let (h, r) = decoded("0783004001000500");
        assert_eq!(
            h,
            Header {
                code: 64,
                sync: 0,
                schema_version: Some(0),
                ..Header::default()
            }
        );
        assert_eq!(r, Request::Ping);
        // net.box: ce length, header {sync, type}, no schema version.
        let (h, r) = decoded("ce00000005820105 0040");
        assert_eq!((h.code, h.sync, h.schema_version), (64, 5, None));
        assert_eq!(r, Request::Ping);
        // Raw: an empty body map, and a sync of 2^40.
        let (h, r) = decoded("ce0000000e82004001cf000001000000000080");
        assert_eq!((h.sync, r), (1 << 40, Request::Ping));
    }

    #[test]
    fn auth_scramble_as_bin_and_as_str() {
        // tarantool-python (BIN scramble, 01_py_auth.txt).
        let (h, r) = decoded(
            "ce0000002d82000701018223a36170702192a9636861702d73686131c414a8b96b418f4823185402ae72c65ea17b4680a538",
        );
        assert_eq!(h.sync, 1);
        let Request::Auth {
            user,
            mechanism,
            scramble: Scramble::Chap(s),
        } = r
        else {
            panic!("{r:?}")
        };
        assert_eq!((user, mechanism), (&b"app"[..], Some(&b"chap-sha1"[..])));
        assert_eq!(s[..2], [0xa8, 0xb9]);
        // net.box (STR scramble holding non-UTF-8 bytes, 05_netbox_auth.txt).
        let (_, r) = decoded(
            "ce0000002c82010100078223a36170702192a9636861702d73686131b4ea9aa922b050404ad6fa96db03a6af361733a2b6",
        );
        assert!(matches!(r, Request::Auth { scramble: Scramble::Chap(s), .. } if s[0] == 0xea));
    }

    #[test]
    fn auth_tuples_judged_after_the_user_is_known() {
        let (_, r) = decoded("ce0000000f82000701018223a567756573742190");
        assert_eq!(
            r,
            Request::Auth {
                user: b"guest",
                mechanism: None,
                scramble: Scramble::Empty
            }
        );
        let (_, r) =
            decoded("ce0000001e82000701018223a36170702192a9636861702d73686131c4053132333435");
        assert!(matches!(
            r,
            Request::Auth {
                scramble: Scramble::Invalid("Invalid MsgPack - invalid scramble size"),
                ..
            }
        ));
        // An unknown mechanism is not the decoder's business: 2.6 checks only the scramble.
        let (_, r) = decoded(
            "ce0000002782000701018223a36170702192a3666f6fc4143132333435363738393031323334353637383930",
        );
        assert!(matches!(
            r,
            Request::Auth {
                mechanism: Some(b"foo"),
                scramble: Scramble::Chap(_),
                ..
            }
        ));
        let e = refused("ce0000000b82000701018123a3617070");
        assert_eq!(
            (e.sync, e.code, e.message.as_str()),
            (Some(1), 69, "Missing mandatory field 'tuple' in request")
        );
        let e = refused("ce00000005820007 0101");
        assert_eq!(e.message, "Invalid MsgPack - missing request body");
    }

    #[test]
    fn select_as_each_client_sends_it() {
        let expected = Request::Select {
            space_id: 281,
            index_id: 0,
            limit: u32::MAX,
            offset: 0,
            iterator: 2,
            key: &[0x90],
        };
        // tarantool-python's key order and net.box's.
        let (_, r) = decoded("1a830001010005008610cd01191100130012ceffffffff14022090");
        assert_eq!(r, expected);
        let (h, r) = decoded("ce0000001882010200018610cd011911001402130012ceffffffff2090");
        assert_eq!((h.sync, r), (2, expected));
    }

    #[test]
    fn select_needs_limit_and_key_and_defaults_the_rest() {
        // Only SPACE_ID + LIMIT + KEY (09_raw_protocol.txt, sync 119).
        let (_, r) = decoded("ce0000000f82000101778310cd0200120a209102");
        assert_eq!(
            r,
            Request::Select {
                space_id: 512,
                index_id: 0,
                limit: 10,
                offset: 0,
                iterator: 0,
                key: &[0x91, 0x02]
            }
        );
        // Neither LIMIT nor KEY: the lowest missing key is named.
        let e = refused("ce0000000c820001016e8210cd02001100");
        assert_eq!((e.sync, e.code), (Some(110), 69));
        assert_eq!(e.message, "Missing mandatory field 'limit' in request");
        let e = refused("ce0000000c820001017d8210cd0200120a");
        assert_eq!(e.message, "Missing mandatory field 'key' in request");
        let e = refused("ce0000000a82000101728211002090");
        assert_eq!(e.message, "Missing mandatory field 'space id' in request");
    }

    #[test]
    fn a_field_of_the_wrong_type_is_invalid_msgpack() {
        // ITERATOR as the string 'GE', as tarantool-python 1.3 sends it.
        let e = refused("ce00000013820001017e8410cd0200120a14a2474520 9102");
        assert_eq!((e.sync, e.code), (Some(126), 20));
        assert_eq!(e.message, "Invalid MsgPack - packet body");
        // A non-negative LIMIT written with a signed marker is an MP_INT to Tarantool.
        let e = refused("ce0000000f820001017e8310cd020012d00a2090");
        assert_eq!(e.message, "Invalid MsgPack - packet body");
        // A body that is not a map.
        let e = refused("ce00000009820001010893010203");
        assert_eq!(
            (e.sync, e.message.as_str()),
            (Some(8), "Invalid MsgPack - packet body")
        );
        // Bytes after the body.
        let e = refused("ce0000000782004001018080");
        assert_eq!(e.message, "Invalid MsgPack - packet body");
    }

    #[test]
    fn a_bad_header_is_answered_with_sync_0() {
        let e = refused("ce000000029101");
        assert_eq!(
            (e.sync, e.code, e.message.as_str()),
            (None, 20, "Invalid MsgPack - packet header")
        );
        // A key 2.6 does not know (0x54) and a key of the wrong type.
        assert_eq!(refused("ce000000058200405400").sync, None);
        let e = refused("ce00000006820105 00a140");
        assert_eq!((e.sync, e.code), (Some(5), 20));
        // Truncated inside the header.
        assert_eq!(
            refused("ce0000000282cd").message,
            "Invalid MsgPack - packet header"
        );
    }

    #[test]
    fn writes_as_both_clients_send_them() {
        // net.box UPDATE with INDEX_BASE 1 and KEY after the ops.
        let (_, r) = decoded("ce0000001882011200048510cd020011001501219193a12b0301209104");
        assert_eq!(
            r,
            Request::Update {
                space_id: 512,
                index_id: 0,
                key: &[0x91, 0x04],
                ops: &unhex("9193a12b0301").leak()[..],
                index_base: 1
            }
        );
        // tarantool-python UPSERT: TUPLE and OPS.
        let (_, r) = decoded("1d830009010005008410cd02001100219305a365766521289193a12b0201");
        assert_eq!(
            r,
            Request::Upsert {
                space_id: 512,
                tuple: &unhex("9305a365766521").leak()[..],
                ops: &unhex("9193a12b0201").leak()[..],
                index_base: 0
            }
        );
        let (_, r) = decoded("ce0000001082000201048210cd0200219364a17801");
        assert_eq!(
            r,
            Request::Insert {
                space_id: 512,
                tuple: &unhex("9364a17801").leak()[..]
            }
        );
        let (_, r) = decoded("ce0000000d820003010a8210cd020021910a");
        assert!(matches!(
            r,
            Request::Replace {
                space_id: 512,
                tuple: [0x91, 0x0a]
            }
        ));
        let (_, r) = decoded("ce0000000f820005010a8310cd0200110020910a");
        assert!(matches!(
            r,
            Request::Delete {
                space_id: 512,
                index_id: 0,
                key: [0x91, 0x0a]
            }
        ));
        // UPSERT without OPS names them.
        let e = refused("ce0000000d820009010a8210cd020021910a");
        assert_eq!(e.message, "Missing mandatory field 'operations' in request");
    }

    #[test]
    fn call_eval_and_unknown_keys() {
        let (h, r) = decoded("1183000a010005008222a361646421920203");
        assert_eq!(h.code, codes::CALL);
        assert_eq!(
            r,
            Request::Call {
                name: b"add",
                args: &[0x92, 0x02, 0x03],
                call_16: false
            }
        );
        let (_, r) = decoded("ce00000010820006 01cc82 8222a56d756c7469 2190");
        assert_eq!(
            r,
            Request::Call {
                name: b"multi",
                args: &[0x90],
                call_16: true
            }
        );
        // No args: an empty list; an unknown key (0x50) is stepped over.
        let (_, r) = decoded("ce0000000e820008010a8227a5726574203150c0");
        assert_eq!(
            r,
            Request::Eval {
                expr: b"ret 1",
                args: &[0x90]
            }
        );
        let e = refused("ce0000000a82000801 0a 812190");
        assert_eq!(e.message, "Missing mandatory field 'expression' in request");
        let e = refused("ce0000000a82000a01 0a 812190");
        assert_eq!(
            e.message,
            "Missing mandatory field 'function name' in request"
        );
    }

    #[test]
    fn types_2_6_does_not_serve() {
        let (h, r) = decoded("ce0000000e8200490166825403559400010203");
        assert_eq!(h.sync, 102);
        assert_eq!(
            r,
            Request::Id {
                version: 3,
                features: vec![0, 1, 2, 3]
            }
        );
        let (_, r) = decoded("ce00000006820063016780");
        assert_eq!(r, Request::Unknown(99));
        let e = RequestError::unknown_request_type(103, 99);
        assert_eq!(
            (e.code, e.message.as_str()),
            (48, "Unknown request type 99")
        );
        assert_eq!(decoded("ce0000000482000c0101").1, Request::Nop);
        assert_eq!(
            refused("ce0000000582000c010180").message,
            "Invalid MsgPack - packet body"
        );
    }

    #[test]
    fn nesting_beyond_the_limit_is_refused() {
        let mut packet = vec![0x82, 0x00, 0x02, 0x01, 0x01, 0x82, 0x10, 0x01, 0x21];
        packet.extend(std::iter::repeat_n(0x91, MAX_DEPTH + 1));
        packet.push(0x01);
        let mut framed = vec![0xce];
        framed.extend_from_slice(&(packet.len() as u32).to_be_bytes());
        framed.extend_from_slice(&packet);
        assert_eq!(
            decode(&framed).unwrap_err().message,
            "Invalid MsgPack - packet body"
        );
    }
}
