//! The client side of iproto: requests encoded as net.box 2.6 sends them (`ce` + u32 length,
//! header `{0x00 type, 0x01 sync}`, no schema version) and answers decoded into their sync,
//! schema version and OK / DATA / error body. Used by `sluice bench --protocol iproto` and by a
//! node that follows a real Tarantool.
//!
//! A packet is written in place into the caller's buffer (several requests may share it, for
//! pipelining); its length is patched when the body is complete.

use std::fmt;

use super::codes::{self, *};
use super::MAX_DEPTH;
use crate::msgpack::{
    write_array_len, write_bin, write_map_len, write_str, write_str_bytes, write_uint, DecodeError,
    Reader, Value,
};

/// Starts a packet of `request_type`: a 5-byte length placeholder and the header. Returns
/// where the packet starts, for [`finish`].
fn begin(out: &mut Vec<u8>, request_type: u32, sync: u64, body_keys: u32) -> usize {
    let start = begin_without_body(out, request_type, sync);
    write_map_len(out, body_keys);
    start
}

/// Starts a packet with a header only.
fn begin_without_body(out: &mut Vec<u8>, request_type: u32, sync: u64) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0xce, 0, 0, 0, 0]);
    write_map_len(out, 2);
    out.push(KEY_REQUEST_TYPE);
    write_uint(out, request_type as u64);
    out.push(KEY_SYNC);
    write_uint(out, sync);
    start
}

/// Patches the length of the packet that starts at `start`.
fn finish(out: &mut [u8], start: usize) {
    let len = u32::try_from(out.len() - start - 5).expect("a request under 4 GiB");
    out[start + 1..start + 5].copy_from_slice(&len.to_be_bytes());
}

fn key_uint(out: &mut Vec<u8>, key: u8, v: u64) {
    out.push(key);
    write_uint(out, v);
}

fn key_raw(out: &mut Vec<u8>, key: u8, value: &[u8]) {
    out.push(key);
    out.extend_from_slice(value);
}

/// A request relayed to another node: `code` with the original `body` (a MessagePack map, as
/// the client sent it), under this connection's `sync`, naming the user it runs as
/// (`KEY_SLUICE_FORWARDED_FOR`) and, for its part of a read over the cluster, the vbuckets the
/// node is to read, one bit each (`KEY_SLUICE_PART`).
pub fn write_relayed(
    out: &mut Vec<u8>,
    code: u32,
    sync: u64,
    forwarded_for: Option<&str>,
    part: Option<&[u8]>,
    body: &[u8],
) {
    let start = out.len();
    out.extend_from_slice(&[0xce, 0, 0, 0, 0]);
    write_map_len(
        out,
        2 + u32::from(forwarded_for.is_some()) + u32::from(part.is_some()),
    );
    out.push(KEY_REQUEST_TYPE);
    write_uint(out, code as u64);
    out.push(KEY_SYNC);
    write_uint(out, sync);
    if let Some(user) = forwarded_for {
        out.push(KEY_SLUICE_FORWARDED_FOR);
        write_str(out, user);
    }
    if let Some(set) = part {
        out.push(KEY_SLUICE_PART);
        write_bin(out, set);
    }
    out.extend_from_slice(body);
    finish(out, start);
}

/// A reply's response code (0 OK, else 0x8000 | error), sync and body (the bytes after the
/// header), from a packet with its length prefix.
pub fn split_reply(packet: &[u8]) -> Result<(u32, u64, &[u8]), DecodeError> {
    let mut r = Reader::new(packet);
    r.read_uint()?;
    let n = r.read_map_len()?;
    let (mut code, mut sync) = (0u32, 0u64);
    for _ in 0..n {
        match r.read_uint()? {
            k if k == KEY_REQUEST_TYPE as u64 => code = r.read_uint()? as u32,
            k if k == KEY_SYNC as u64 => sync = r.read_uint()?,
            _ => r.skip_value(MAX_DEPTH)?,
        }
    }
    Ok((code, sync, r.rest()))
}

/// PING, with no body (as both connectors send it).
pub fn write_ping(out: &mut Vec<u8>, sync: u64) {
    let start = begin_without_body(out, PING, sync);
    finish(out, start);
}

/// The chap-sha1 scramble of `password` for a greeting's `salt` (its first 20 bytes count):
/// `sha1(password) XOR sha1(salt[..20] ++ sha1(sha1(password)))`. The hash comes from the
/// caller, so this crate stays free of crypto dependencies.
pub fn chap_sha1_scramble(
    salt: &[u8],
    password: &[u8],
    sha1: impl Fn(&[u8]) -> [u8; 20],
) -> [u8; 20] {
    let s1 = sha1(password);
    let s2 = sha1(&s1);
    let salt = &salt[..salt.len().min(20)];
    let mask = sha1(&[salt, &s2[..]].concat());
    let mut out = [0u8; 20];
    for (o, (a, b)) in out.iter_mut().zip(s1.iter().zip(mask.iter())) {
        *o = a ^ b;
    }
    out
}

/// AUTH with chap-sha1: `{USER_NAME: user, TUPLE: ["chap-sha1", scramble]}`, the scramble as a
/// string as net.box sends it.
pub fn write_auth(out: &mut Vec<u8>, sync: u64, user: &str, scramble: &[u8; 20]) {
    let start = begin(out, AUTH, sync, 2);
    out.push(KEY_USER_NAME);
    write_str(out, user);
    out.push(KEY_TUPLE);
    write_array_len(out, 2);
    write_str(out, "chap-sha1");
    write_str_bytes(out, scramble);
    finish(out, start);
}

/// VOTE (no body): the upstream answers with its ballot (`decode_ballot`).
pub fn write_vote(out: &mut Vec<u8>, sync: u64) {
    let start = begin_without_body(out, VOTE, sync);
    finish(out, start);
}

/// FETCH_SNAPSHOT (an empty body): the upstream answers OK with the vclock of its read view,
/// the read view's rows (INSERTs, the system spaces first), then OK with its vclock at the end.
pub fn write_fetch_snapshot(out: &mut Vec<u8>, sync: u64) {
    let start = begin(out, FETCH_SNAPSHOT, sync, 0);
    finish(out, start);
}

/// SUBSCRIBE: `{INSTANCE_UUID, VCLOCK, REPLICA_ANON}`. The upstream answers OK with its
/// vclock, then sends every row after `vclock`, and heartbeats. A replica that is not
/// anonymous must have JOINed (its uuid is in the upstream's `_cluster`).
pub fn write_subscribe(
    out: &mut Vec<u8>,
    sync: u64,
    instance_uuid: &str,
    vclock: &Vclock,
    anonymous: bool,
) {
    let start = begin(out, SUBSCRIBE, sync, 3);
    out.push(KEY_INSTANCE_UUID);
    write_str(out, instance_uuid);
    out.push(KEY_VCLOCK);
    write_vclock(out, vclock);
    out.push(KEY_REPLICA_ANON);
    out.push(if anonymous { 0xc3 } else { 0xc2 });
    finish(out, start);
}

/// JOIN: `{INSTANCE_UUID, SERVER_VERSION}`, as a replica that registers in the upstream's
/// `_cluster`. The upstream answers OK with the vclock of its read view, the read view's rows,
/// OK with the vclock its final stage ends at, the rows up to there (among them the `_cluster`
/// row that registers this replica), and OK with its vclock.
pub fn write_join(out: &mut Vec<u8>, sync: u64, instance_uuid: &str, version_id: u32) {
    let start = begin(out, JOIN, sync, 2);
    out.push(KEY_INSTANCE_UUID);
    write_str(out, instance_uuid);
    out.push(KEY_SERVER_VERSION);
    write_uint(out, version_id as u64);
    finish(out, start);
}

/// A replica's answer to a heartbeat: OK with its vclock, which the upstream shows as the
/// replica's progress (`box.info.replication[n].downstream`).
pub fn write_vclock_ack(out: &mut Vec<u8>, vclock: &Vclock) {
    let start = out.len();
    out.extend_from_slice(&[0xce, 0, 0, 0, 0]);
    write_map_len(out, 1);
    out.push(KEY_REQUEST_TYPE);
    write_uint(out, OK as u64);
    write_map_len(out, 1);
    out.push(KEY_VCLOCK);
    write_vclock(out, vclock);
    finish(out, start);
}

/// A vclock: per replica id (below 32), the LSN of its last row.
pub type Vclock = std::collections::BTreeMap<u32, u64>;

pub fn write_vclock(out: &mut Vec<u8>, vclock: &Vclock) {
    write_map_len(out, vclock.len() as u32);
    for (&id, &lsn) in vclock {
        write_uint(out, id as u64);
        write_uint(out, lsn);
    }
}

/// A vclock map; ids must be below 32 (Tarantool's VCLOCK_MAX).
pub fn read_vclock(r: &mut Reader<'_>) -> Result<Vclock, ResponseError> {
    let n = r.read_map_len()?;
    let mut out = Vclock::new();
    for _ in 0..n {
        let id = r.read_uint()?;
        let lsn = r.read_uint()?;
        if id >= 32 {
            return Err(ResponseError(format!(
                "vclock component {id}: ids are below 32"
            )));
        }
        out.insert(id as u32, lsn);
    }
    Ok(out)
}

/// The vclock under key 0x26 of a body map (an OK of FETCH_SNAPSHOT, JOIN or SUBSCRIBE).
pub fn body_vclock(body: &[u8]) -> Result<Option<Vclock>, ResponseError> {
    let mut r = Reader::new(body);
    for _ in 0..r.read_map_len()? {
        if r.read_uint()? == KEY_VCLOCK as u64 {
            return read_vclock(&mut r).map(Some);
        }
        r.skip_value(MAX_DEPTH)?;
    }
    Ok(None)
}

/// What an upstream says of itself in its ballot (VOTE's answer, key 0x29).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ballot {
    pub is_ro: bool,
    /// Its vclock now.
    pub vclock: Vclock,
    /// The oldest vclock its WAL still holds: a replica behind it cannot SUBSCRIBE, it must
    /// fetch the snapshot again.
    pub gc_vclock: Vclock,
}

impl Ballot {
    /// Whether the upstream still holds every row after `ours`: None if so, else the
    /// component (replica id, LSN) of its oldest kept vclock that passed ours.
    pub fn collected_after(&self, ours: &Vclock) -> Option<(u32, u64)> {
        self.gc_vclock
            .iter()
            .find(|(id, lsn)| ours.get(id).copied().unwrap_or(0) < **lsn)
            .map(|(id, lsn)| (*id, *lsn))
    }
}

pub fn decode_ballot(body: &[u8]) -> Result<Ballot, ResponseError> {
    let mut r = Reader::new(body);
    let mut ballot = None;
    for _ in 0..r.read_map_len()? {
        if r.read_uint()? != KEY_BALLOT as u64 {
            r.skip_value(MAX_DEPTH)?;
            continue;
        }
        let mut b = Ballot::default();
        for _ in 0..r.read_map_len()? {
            match r.read_uint()? {
                // IS_RO (4), and IS_RO_CFG (1) where an older one sends only that.
                1 | 4 => b.is_ro |= matches!(r.read_value()?, Value::Bool(true)),
                2 => b.vclock = read_vclock(&mut r)?,
                3 => b.gc_vclock = read_vclock(&mut r)?,
                _ => r.skip_value(MAX_DEPTH)?,
            }
        }
        ballot = Some(b);
    }
    ballot.ok_or_else(|| ResponseError("no ballot in VOTE's answer".into()))
}

/// A SELECT's parameters; `key` is the encoded MessagePack array of key parts.
#[derive(Debug, Clone, Copy)]
pub struct Select<'a> {
    pub space_id: u32,
    pub index_id: u32,
    pub iterator: u32,
    pub offset: u32,
    pub limit: u32,
    pub key: &'a [u8],
}

pub fn write_select(out: &mut Vec<u8>, sync: u64, s: &Select<'_>) {
    let start = begin(out, SELECT, sync, 6);
    key_uint(out, KEY_SPACE_ID, s.space_id as u64);
    key_uint(out, KEY_INDEX_ID, s.index_id as u64);
    key_uint(out, KEY_ITERATOR, s.iterator as u64);
    key_uint(out, KEY_OFFSET, s.offset as u64);
    key_uint(out, KEY_LIMIT, s.limit as u64);
    key_raw(out, KEY_KEY, s.key);
    finish(out, start);
}

fn write_space_tuple(out: &mut Vec<u8>, request_type: u32, sync: u64, space_id: u32, tuple: &[u8]) {
    let start = begin(out, request_type, sync, 2);
    key_uint(out, KEY_SPACE_ID, space_id as u64);
    key_raw(out, KEY_TUPLE, tuple);
    finish(out, start);
}

/// INSERT of `tuple` (an encoded MessagePack array).
pub fn write_insert(out: &mut Vec<u8>, sync: u64, space_id: u32, tuple: &[u8]) {
    write_space_tuple(out, INSERT, sync, space_id, tuple);
}

/// REPLACE of `tuple` (an encoded MessagePack array).
pub fn write_replace(out: &mut Vec<u8>, sync: u64, space_id: u32, tuple: &[u8]) {
    write_space_tuple(out, REPLACE, sync, space_id, tuple);
}

/// DELETE by `key` (an encoded MessagePack array of key parts).
pub fn write_delete(out: &mut Vec<u8>, sync: u64, space_id: u32, index_id: u32, key: &[u8]) {
    let start = begin(out, DELETE, sync, 3);
    key_uint(out, KEY_SPACE_ID, space_id as u64);
    key_uint(out, KEY_INDEX_ID, index_id as u64);
    key_raw(out, KEY_KEY, key);
    finish(out, start);
}

/// UPDATE of the tuple at `key` by `ops` (an encoded array of operations, field numbers
/// counted from `index_base`: 0 as tarantool-python, 1 as net.box).
pub fn write_update(
    out: &mut Vec<u8>,
    sync: u64,
    space_id: u32,
    index_id: u32,
    key: &[u8],
    ops: &[u8],
    index_base: u32,
) {
    let start = begin(out, UPDATE, sync, 5);
    key_uint(out, KEY_SPACE_ID, space_id as u64);
    key_uint(out, KEY_INDEX_ID, index_id as u64);
    key_uint(out, KEY_INDEX_BASE, index_base as u64);
    key_raw(out, KEY_KEY, key);
    key_raw(out, KEY_TUPLE, ops);
    finish(out, start);
}

/// UPSERT: `tuple` when its key is new, else `ops` (as in [`write_update`]).
pub fn write_upsert(
    out: &mut Vec<u8>,
    sync: u64,
    space_id: u32,
    tuple: &[u8],
    ops: &[u8],
    index_base: u32,
) {
    let start = begin(out, UPSERT, sync, 4);
    key_uint(out, KEY_SPACE_ID, space_id as u64);
    key_uint(out, KEY_INDEX_BASE, index_base as u64);
    key_raw(out, KEY_TUPLE, tuple);
    key_raw(out, KEY_OPS, ops);
    finish(out, start);
}

/// CALL (type 10) of the function `name` with `args` (an encoded array).
pub fn write_call(out: &mut Vec<u8>, sync: u64, name: &str, args: &[u8]) {
    let start = begin(out, CALL, sync, 2);
    out.push(KEY_FUNCTION_NAME);
    write_str(out, name);
    key_raw(out, KEY_TUPLE, args);
    finish(out, start);
}

/// EVAL of the Lua `expr` with `args` (an encoded array).
pub fn write_eval(out: &mut Vec<u8>, sync: u64, expr: &str, args: &[u8]) {
    let start = begin(out, EVAL, sync, 2);
    out.push(KEY_EXPR);
    write_str(out, expr);
    key_raw(out, KEY_TUPLE, args);
    finish(out, start);
}

/// What an answer carries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Body<'a> {
    /// OK with no data (PING, AUTH).
    Ok,
    /// OK with IPROTO_DATA: `count` values, encoded one after the other in `rows`.
    Data { count: u32, rows: &'a [u8] },
    /// An error: the code (the type without 0x8000) and its message (IPROTO_ERROR_24).
    Error { code: u32, message: &'a [u8] },
}

/// One decoded answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Response<'a> {
    pub sync: u64,
    pub schema_version: Option<u64>,
    pub body: Body<'a>,
}

impl<'a> Response<'a> {
    /// The DATA values one by one (nothing for OK or an error).
    pub fn rows(&self) -> Rows<'a> {
        match self.body {
            Body::Data { count, rows } => Rows {
                reader: Reader::new(rows),
                left: count,
            },
            _ => Rows {
                reader: Reader::new(&[]),
                left: 0,
            },
        }
    }
}

/// The values of a DATA answer, each as its encoded bytes.
pub struct Rows<'a> {
    reader: Reader<'a>,
    left: u32,
}

impl<'a> Iterator for Rows<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // decode_response checked every row, so this cannot fail.
        self.reader.read_raw_value(MAX_DEPTH).ok()
    }
}

/// An answer that is not iproto as a server writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseError(pub String);

impl fmt::Display for ResponseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad iproto answer: {}", self.0)
    }
}

impl std::error::Error for ResponseError {}

impl From<DecodeError> for ResponseError {
    fn from(e: DecodeError) -> Self {
        ResponseError(e.to_string())
    }
}

/// Decodes one answer: `packet` is what [`super::frame::check`] delimited, length prefix
/// included. Every DATA row is checked to be one whole value (nesting up to
/// [`MAX_DEPTH`]); unknown body keys (SQL metadata, the extended error) are stepped over.
pub fn decode_response(packet: &[u8]) -> Result<Response<'_>, ResponseError> {
    let mut r = Reader::new(packet);
    let len = r.read_uint()?;
    if len != r.rest().len() as u64 {
        return Err(ResponseError(format!(
            "the length prefix says {len} bytes, the packet has {}",
            r.rest().len()
        )));
    }
    let mut code = None;
    let mut sync = 0;
    let mut schema_version = None;
    for _ in 0..r.read_map_len()? {
        match r.read_uint()? {
            k if k == KEY_REQUEST_TYPE as u64 => code = Some(r.read_uint()?),
            k if k == KEY_SYNC as u64 => sync = r.read_uint()?,
            k if k == KEY_SCHEMA_VERSION as u64 => schema_version = Some(r.read_uint()?),
            _ => r.skip_value(MAX_DEPTH)?,
        }
    }
    let code = code.ok_or_else(|| ResponseError("no response code in the header".into()))?;
    let code = u32::try_from(code).map_err(|_| ResponseError(format!("response code {code}")))?;
    let mut data = None;
    let mut message: &[u8] = b"";
    if !r.is_empty() {
        for _ in 0..r.read_map_len()? {
            let key = r.read_uint()?;
            if key == KEY_DATA as u64 {
                let count = r.read_array_len()?;
                let start = r.position();
                for _ in 0..count {
                    r.skip_value(MAX_DEPTH)?;
                }
                data = Some((count, &packet[start..r.position()]));
            } else if key == KEY_ERROR_24 as u64 {
                message = r.read_str()?;
            } else {
                r.skip_value(MAX_DEPTH)?;
            }
        }
    }
    if !r.is_empty() {
        return Err(ResponseError("bytes after the body".into()));
    }
    let body = if code & codes::TYPE_ERROR != 0 {
        Body::Error {
            code: code & !codes::TYPE_ERROR,
            message,
        }
    } else if code != OK {
        return Err(ResponseError(format!("response type {code}")));
    } else {
        match data {
            Some((count, rows)) => Body::Data { count, rows },
            None => Body::Ok,
        }
    };
    Ok(Response {
        sync,
        schema_version,
        body,
    })
}

/// Whether `value` is a MessagePack array (a tuple), and its element count.
pub fn array_len(value: &[u8]) -> Option<u32> {
    match Reader::new(value).read_value() {
        Ok(Value::Array(n)) => Some(n),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::{frame, request, response};
    use super::*;
    use crate::iproto::unhex;

    #[test]
    fn requests_are_what_netbox_sends() {
        // 05_netbox_auth.txt: SELECT of _vspace, sync 2 (net.box orders the body differently;
        // the server's decoder is the judge of equivalence).
        let mut out = Vec::new();
        write_select(
            &mut out,
            2,
            &Select {
                space_id: 281,
                index_id: 0,
                iterator: iterator::ALL,
                offset: 0,
                limit: u32::MAX,
                key: &[0x90],
            },
        );
        assert_eq!(frame::check(&out, 1 << 20), Ok(Some(out.len())));
        let (h, req) = request::decode(&out).unwrap();
        assert_eq!((h.code, h.sync, h.schema_version), (SELECT, 2, None));
        match req {
            request::Request::Select {
                space_id,
                index_id,
                limit,
                offset,
                iterator,
                key,
            } => {
                assert_eq!((space_id, index_id, limit, offset), (281, 0, u32::MAX, 0));
                assert_eq!((iterator, key), (iterator::ALL, &[0x90][..]));
            }
            other => panic!("{other:?}"),
        }
        // PING with no body, as both connectors send it (header keys in type, sync order).
        out.clear();
        write_ping(&mut out, 5);
        assert_eq!(out, unhex("ce00000005 82 00 40 01 05"));
    }

    #[test]
    fn every_request_decodes_on_the_server_side() {
        let tuple = unhex("93 01 a3 616461 1e"); // [1, "ada", 30]
        let key = unhex("91 01");
        let ops = unhex("91 93 a1 2b 03 01"); // [["+", 3, 1]]
        let mut out = Vec::new();
        write_insert(&mut out, 1, 512, &tuple);
        write_replace(&mut out, 2, 512, &tuple);
        write_delete(&mut out, 3, 512, 0, &key);
        write_update(&mut out, 4, 512, 0, &key, &ops, 1);
        write_upsert(&mut out, 5, 512, &tuple, &ops, 1);
        write_call(&mut out, 6, "box.info", &[0x90]);
        write_eval(&mut out, 7, "return 1", &[0x90]);
        write_auth(&mut out, 8, "app", &[7; 20]);
        let mut at = 0;
        let mut kinds = Vec::new();
        while at < out.len() {
            let n = frame::check(&out[at..], 1 << 20).unwrap().unwrap();
            let (h, req) = request::decode(&out[at..at + n]).unwrap();
            let ok = match req {
                request::Request::Insert { space_id, tuple: t }
                | request::Request::Replace { space_id, tuple: t } => space_id == 512 && t == tuple,
                request::Request::Delete { key: k, .. } => k == key,
                request::Request::Update {
                    key: k,
                    ops: o,
                    index_base,
                    ..
                } => k == key && o == ops && index_base == 1,
                request::Request::Upsert {
                    tuple: t, ops: o, ..
                } => t == tuple && o == ops,
                request::Request::Call { name, .. } => name == b"box.info",
                request::Request::Eval { expr, .. } => expr == b"return 1",
                request::Request::Auth { user, .. } => user == b"app",
                _ => false,
            };
            assert!(ok, "{req:?}");
            kinds.push((h.sync, h.code));
            at += n;
        }
        let codes: Vec<u32> = kinds.iter().map(|k| k.1).collect();
        assert_eq!(
            codes,
            [INSERT, REPLACE, DELETE, UPDATE, UPSERT, CALL, EVAL, AUTH]
        );
        assert_eq!(
            kinds.iter().map(|k| k.0).collect::<Vec<_>>(),
            (1..=8).collect::<Vec<_>>()
        );
    }

    #[test]
    fn answers_decode_as_written() {
        let mut out = Vec::new();
        response::write_ok(&mut out, 9, 80);
        let r = decode_response(&out).unwrap();
        assert_eq!((r.sync, r.schema_version, r.body), (9, Some(80), Body::Ok));

        out.clear();
        let mut w = response::DataWriter::begin(&mut out, 10, 80);
        w.push_raw(&mut out, &unhex("93 01 a3 616461 1e"));
        w.push_raw(&mut out, &unhex("92 02 a3 626f62"));
        w.finish(&mut out);
        let r = decode_response(&out).unwrap();
        assert_eq!(r.sync, 10);
        let rows: Vec<&[u8]> = r.rows().collect();
        assert_eq!(
            rows,
            [
                &unhex("93 01 a3 616461 1e")[..],
                &unhex("92 02 a3 626f62")[..]
            ]
        );
        assert_eq!(array_len(rows[0]), Some(3));

        out.clear();
        let msg = "Duplicate key exists in unique index 'primary' in space 'users'";
        response::write_error(&mut out, 11, 80, ER_TUPLE_FOUND, msg);
        let r = decode_response(&out).unwrap();
        assert_eq!(
            r.body,
            Body::Error {
                code: ER_TUPLE_FOUND,
                message: msg.as_bytes()
            }
        );
        assert_eq!(r.rows().count(), 0);
    }

    #[test]
    fn a_captured_answer_decodes() {
        // 05_netbox_auth.txt: the OK to AUTH, sync 1, schema version 82.
        let ok = unhex("ce00000018 8300ce00000000 01cf0000000000000001 05ce00000052 80");
        let r = decode_response(&ok).unwrap();
        assert_eq!((r.sync, r.schema_version, r.body), (1, Some(82), Body::Ok));
    }

    #[test]
    fn bad_answers_are_errors_not_panics() {
        let mut good = Vec::new();
        let mut w = response::DataWriter::begin(&mut good, 1, 1);
        w.push_raw(&mut good, &unhex("93 01 a3 616461 1e"));
        w.finish(&mut good);
        for cut in 0..good.len() {
            assert!(decode_response(&good[..cut]).is_err(), "cut at {cut}");
        }
        // A DATA array announcing more rows than the packet holds.
        let mut lying = good.clone();
        let at = lying.iter().position(|&b| b == 0xdd).unwrap();
        lying[at + 1..at + 5].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_response(&lying).is_err());
        // No response code; a type that is neither OK nor an error.
        assert!(decode_response(&unhex("03 81 01 01")).is_err());
        assert!(decode_response(&unhex("05 81 00 cd 0100 80")).is_err());
    }

    #[test]
    fn chap_sha1_matches_the_captured_exchange() {
        // A toy hash keeps this test free of crypto; the scramble's shape is what is checked:
        // s1 XOR h(salt[..20] ++ h(s1)), with the salt cut to 20 bytes.
        let h = |d: &[u8]| {
            let mut o = [0u8; 20];
            for (i, b) in d.iter().enumerate() {
                o[i % 20] = o[i % 20].wrapping_mul(31).wrapping_add(*b);
            }
            o
        };
        let salt = [3u8; 32];
        let got = chap_sha1_scramble(&salt, b"secret", h);
        let s1 = h(b"secret");
        let mask = h(&[&salt[..20], &h(&s1)[..]].concat());
        let want: Vec<u8> = s1.iter().zip(mask).map(|(a, b)| a ^ b).collect();
        assert_eq!(&got[..], &want[..]);
        assert_eq!(got, chap_sha1_scramble(&salt[..20], b"secret", h));
    }
}

#[cfg(test)]
mod relay_tests {
    use super::*;

    #[test]
    fn a_relayed_select_decodes_as_sent() {
        let mut sel = Vec::new();
        write_select(
            &mut sel,
            0,
            &Select {
                space_id: 512,
                index_id: 0,
                iterator: 2,
                offset: 0,
                limit: u32::MAX,
                key: &[0x90],
            },
        );
        let body = crate::iproto::request::body_of(&sel).to_vec();
        let mut out = Vec::new();
        write_relayed(&mut out, SELECT, 7, Some("app"), Some(&[0b101, 1]), &body);
        let (h, r) = crate::iproto::request::decode(&out).unwrap();
        assert_eq!(h.part(&out), Some(&[0b101, 1][..]));
        assert_eq!(h.forwarded_for(&out), Some(&b"app"[..]));
        assert!(
            matches!(
                r,
                crate::iproto::request::Request::Select {
                    limit: u32::MAX,
                    ..
                }
            ),
            "{r:?}"
        );
    }
}
