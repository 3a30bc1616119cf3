//! The memcached binary protocol frame (shared/reference/couchbase-kv/BinaryProtocol.md):
//! a 24-byte header, then framing extras (magic 0x08 / 0x18 only), extras, key and value.
//!
//! `frame_len` is the cheap check a connection runs on its buffer before parsing: it reads the
//! header's body length and says whether a whole frame is there, refusing a body over the limit
//! before anything is allocated. `parse_request` / `parse_response` then borrow the sections from
//! the frame after checking that they fit in the body.

use std::fmt;

pub const HEADER_LEN: usize = 24;

pub mod magic {
    pub const REQUEST: u8 = 0x80;
    pub const RESPONSE: u8 = 0x81;
    /// Request with flexible framing extras: byte 2 is their length, byte 3 the key length.
    pub const ALT_REQUEST: u8 = 0x08;
    /// Response with flexible framing extras.
    pub const ALT_RESPONSE: u8 = 0x18;
    /// Duplex: a request from server to client, and the client's response.
    pub const SERVER_REQUEST: u8 = 0x82;
    pub const SERVER_RESPONSE: u8 = 0x83;
}

pub mod opcode {
    pub const GET: u8 = 0x00;
    pub const SET: u8 = 0x01;
    pub const ADD: u8 = 0x02;
    pub const REPLACE: u8 = 0x03;
    pub const DELETE: u8 = 0x04;
    pub const INCREMENT: u8 = 0x05;
    pub const DECREMENT: u8 = 0x06;
    pub const QUIT: u8 = 0x07;
    pub const FLUSH: u8 = 0x08;
    pub const GETQ: u8 = 0x09;
    pub const NOOP: u8 = 0x0a;
    pub const VERSION: u8 = 0x0b;
    pub const GETK: u8 = 0x0c;
    pub const GETKQ: u8 = 0x0d;
    pub const APPEND: u8 = 0x0e;
    pub const PREPEND: u8 = 0x0f;
    pub const STAT: u8 = 0x10;
    pub const SETQ: u8 = 0x11;
    pub const ADDQ: u8 = 0x12;
    pub const REPLACEQ: u8 = 0x13;
    pub const DELETEQ: u8 = 0x14;
    pub const INCREMENTQ: u8 = 0x15;
    pub const DECREMENTQ: u8 = 0x16;
    pub const QUITQ: u8 = 0x17;
    pub const FLUSHQ: u8 = 0x18;
    pub const APPENDQ: u8 = 0x19;
    pub const PREPENDQ: u8 = 0x1a;
    pub const VERBOSITY: u8 = 0x1b;
    pub const TOUCH: u8 = 0x1c;
    pub const GAT: u8 = 0x1d;
    pub const GATQ: u8 = 0x1e;
    pub const HELLO: u8 = 0x1f;
    pub const SASL_LIST_MECHS: u8 = 0x20;
    pub const SASL_AUTH: u8 = 0x21;
    pub const SASL_STEP: u8 = 0x22;
    pub const SET_VBUCKET: u8 = 0x3d;
    pub const GET_VBUCKET: u8 = 0x3e;
    pub const GET_ALL_VB_SEQNOS: u8 = 0x48;
    pub const GET_REPLICA: u8 = 0x83;
    pub const SELECT_BUCKET: u8 = 0x89;
    pub const GET_LOCKED: u8 = 0x94;
    pub const UNLOCK_KEY: u8 = 0x95;
    pub const GET_FAILOVER_LOG: u8 = 0x96;
    pub const GET_META: u8 = 0xa0;
    pub const GETQ_META: u8 = 0xa1;
    // Sub-document commands (kv_engine `docs/SubDocument.md`).
    pub const SUBDOC_GET: u8 = 0xc5;
    pub const SUBDOC_EXISTS: u8 = 0xc6;
    pub const SUBDOC_DICT_ADD: u8 = 0xc7;
    pub const SUBDOC_DICT_UPSERT: u8 = 0xc8;
    pub const SUBDOC_DELETE: u8 = 0xc9;
    pub const SUBDOC_REPLACE: u8 = 0xca;
    pub const SUBDOC_ARRAY_PUSH_LAST: u8 = 0xcb;
    pub const SUBDOC_ARRAY_PUSH_FIRST: u8 = 0xcc;
    pub const SUBDOC_ARRAY_INSERT: u8 = 0xcd;
    pub const SUBDOC_ARRAY_ADD_UNIQUE: u8 = 0xce;
    pub const SUBDOC_COUNTER: u8 = 0xcf;
    pub const SUBDOC_MULTI_LOOKUP: u8 = 0xd0;
    pub const SUBDOC_MULTI_MUTATION: u8 = 0xd1;
    pub const SUBDOC_GET_COUNT: u8 = 0xd2;
    pub const SUBDOC_REPLACE_BODY_WITH_XATTR: u8 = 0xd3;
    /// Cluster map and collections (Couchbase's bootstrap over the KV port).
    pub const GET_CLUSTER_CONFIG: u8 = 0xb5;
    pub const GET_COLLECTIONS_MANIFEST: u8 = 0xba;
    pub const GET_COLLECTION_ID: u8 = 0xbb;
    pub const RANGE_SCAN_CREATE: u8 = 0xda;
    pub const RANGE_SCAN_CONTINUE: u8 = 0xdb;
    pub const RANGE_SCAN_CANCEL: u8 = 0xdc;
    pub const GET_ERROR_MAP: u8 = 0xfe;

    /// The quiet variants: silent on success (mutations) or on a miss (gets).
    pub fn is_quiet(op: u8) -> bool {
        matches!(
            op,
            GETQ | GETKQ
                | SETQ
                | ADDQ
                | REPLACEQ
                | DELETEQ
                | INCREMENTQ
                | DECREMENTQ
                | QUITQ
                | FLUSHQ
                | APPENDQ
                | PREPENDQ
                | GATQ
        )
    }
}

pub mod status {
    pub const SUCCESS: u16 = 0x0000;
    pub const KEY_ENOENT: u16 = 0x0001;
    pub const KEY_EEXISTS: u16 = 0x0002;
    pub const E2BIG: u16 = 0x0003;
    pub const EINVAL: u16 = 0x0004;
    pub const NOT_STORED: u16 = 0x0005;
    pub const DELTA_BADVAL: u16 = 0x0006;
    pub const NOT_MY_VBUCKET: u16 = 0x0007;
    pub const NO_BUCKET: u16 = 0x0008;
    pub const LOCKED: u16 = 0x0009;
    pub const NOT_LOCKED: u16 = 0x000e;
    pub const AUTH_STALE: u16 = 0x001f;
    pub const AUTH_ERROR: u16 = 0x0020;
    pub const AUTH_CONTINUE: u16 = 0x0021;
    pub const ERANGE: u16 = 0x0022;
    pub const ROLLBACK: u16 = 0x0023;
    pub const EACCESS: u16 = 0x0024;
    pub const UNKNOWN_FRAME_INFO: u16 = 0x0080;
    pub const UNKNOWN_COMMAND: u16 = 0x0081;
    pub const ENOMEM: u16 = 0x0082;
    pub const NOT_SUPPORTED: u16 = 0x0083;
    pub const EINTERNAL: u16 = 0x0084;
    pub const EBUSY: u16 = 0x0085;
    pub const ETMPFAIL: u16 = 0x0086;
    pub const UNKNOWN_COLLECTION: u16 = 0x0088;
    /// A range scan was cancelled while it ran.
    pub const RANGE_SCAN_CANCELLED: u16 = 0x00a5;
    /// A continue stopped at a limit: ask again.
    pub const RANGE_SCAN_MORE: u16 = 0x00a6;
    /// A continue reached the scan's end: the scan is gone.
    pub const RANGE_SCAN_COMPLETE: u16 = 0x00a7;
    /// A range scan's snapshot requirement named another vbucket uuid.
    pub const VBUUID_NOT_EQUAL: u16 = 0x00a8;
    pub const UNKNOWN_SCOPE: u16 = 0x008c;
    pub const DURABILITY_INVALID_LEVEL: u16 = 0x00a0;
    pub const DURABILITY_IMPOSSIBLE: u16 = 0x00a1;
    pub const SYNC_WRITE_IN_PROGRESS: u16 = 0x00a2;
    pub const SYNC_WRITE_AMBIGUOUS: u16 = 0x00a3;
    pub const XATTR_EINVAL: u16 = 0x0087;
    // Sub-document statuses (kv_engine `include/mcbp/protocol/status.h`).
    pub const SUBDOC_PATH_ENOENT: u16 = 0x00c0;
    pub const SUBDOC_PATH_MISMATCH: u16 = 0x00c1;
    pub const SUBDOC_PATH_EINVAL: u16 = 0x00c2;
    pub const SUBDOC_PATH_E2BIG: u16 = 0x00c3;
    pub const SUBDOC_DOC_E2DEEP: u16 = 0x00c4;
    pub const SUBDOC_VALUE_CANTINSERT: u16 = 0x00c5;
    pub const SUBDOC_DOC_NOTJSON: u16 = 0x00c6;
    pub const SUBDOC_NUM_ERANGE: u16 = 0x00c7;
    pub const SUBDOC_DELTA_EINVAL: u16 = 0x00c8;
    pub const SUBDOC_PATH_EEXISTS: u16 = 0x00c9;
    pub const SUBDOC_VALUE_ETOODEEP: u16 = 0x00ca;
    pub const SUBDOC_INVALID_COMBO: u16 = 0x00cb;
    pub const SUBDOC_MULTI_PATH_FAILURE: u16 = 0x00cc;
    pub const SUBDOC_SUCCESS_DELETED: u16 = 0x00cd;
    pub const SUBDOC_XATTR_INVALID_FLAG_COMBO: u16 = 0x00ce;
    pub const SUBDOC_XATTR_INVALID_KEY_COMBO: u16 = 0x00cf;
    pub const SUBDOC_XATTR_UNKNOWN_MACRO: u16 = 0x00d0;
    pub const SUBDOC_XATTR_UNKNOWN_VATTR: u16 = 0x00d1;
    pub const SUBDOC_XATTR_CANT_MODIFY_VATTR: u16 = 0x00d2;
    pub const SUBDOC_MULTI_PATH_FAILURE_DELETED: u16 = 0x00d3;
    pub const SUBDOC_INVALID_XATTR_ORDER: u16 = 0x00d4;
    pub const SUBDOC_CAN_ONLY_REVIVE_DELETED_DOCUMENTS: u16 = 0x00d6;
    pub const SUBDOC_DELETED_DOCUMENT_CANT_HAVE_VALUE: u16 = 0x00d7;
}

/// Sub-document flags: per path (a spec's or a single command's) and per document.
pub mod subdoc {
    pub const PATH_MKDIR_P: u8 = 0x01;
    pub const PATH_XATTR: u8 = 0x04;
    pub const PATH_EXPAND_MACROS: u8 = 0x10;
    pub const DOC_MKDOC: u8 = 0x01;
    pub const DOC_ADD: u8 = 0x02;
    pub const DOC_ACCESS_DELETED: u8 = 0x04;
    pub const DOC_CREATE_AS_DELETED: u8 = 0x08;
    pub const DOC_REVIVE_DOCUMENT: u8 = 0x10;
    /// Couchbase's limits: path bytes, path components, specs of one multi command.
    pub const MAX_PATH_LEN: usize = 1024;
    pub const MAX_PATH_DEPTH: usize = 32;
    pub const MAX_SPECS: usize = 16;
}

/// HELLO feature codes (kv_engine `feature.h`).
pub mod feature {
    pub const TCP_NODELAY: u16 = 0x03;
    pub const MUTATION_SEQNO: u16 = 0x04;
    pub const XERROR: u16 = 0x07;
    pub const SELECT_BUCKET: u16 = 0x08;
    pub const SNAPPY: u16 = 0x0a;
    pub const JSON: u16 = 0x0b;
    pub const DUPLEX: u16 = 0x0c;
    /// With DUPLEX: the server pushes a new cluster map (server request 0x01) when it changes.
    pub const CLUSTERMAP_CHANGE_NOTIFICATION: u16 = 0x0d;
    /// Replies may come in another order than their requests (a durable write's after the
    /// replies of the requests behind it).
    pub const UNORDERED_EXECUTION: u16 = 0x0e;
    pub const ALT_REQUEST_SUPPORT: u16 = 0x10;
    pub const SYNC_REPLICATION: u16 = 0x11;
    /// Keys carry an unsigned LEB128 collection id before the document key.
    pub const COLLECTIONS: u16 = 0x12;
    /// Mutations may carry the PreserveTTL frame info (id 5).
    pub const PRESERVE_TTL: u16 = 0x14;
    /// Values may start with extended attributes (datatype XATTR), and sub-document paths
    /// may name them.
    pub const XATTR: u16 = 0x06;
    /// The virtual extended attributes `$document`, `$vbucket` and `$XTOC`.
    pub const VATTR: u16 = 0x15;
    /// Sub-document mutations may create a document deleted (doc flag CreateAsDeleted).
    pub const SUBDOC_CREATE_AS_DELETED: u16 = 0x17;
}

/// Opcodes of the server's requests (magic 0x82), a separate space from the client's.
pub mod server_opcode {
    pub const CLUSTERMAP_CHANGE_NOTIFICATION: u8 = 0x01;
}

/// Whether a request of this opcode may carry a durability requirement: the mutations of a
/// document (as Couchbase's servers take them, and TOUCH/GAT, whose new expiry sluice makes
/// durable alike). Any other command refuses one with EINVAL rather than ignore it.
pub fn supports_durability(op: u8) -> bool {
    use opcode::*;
    matches!(
        op,
        SET | SETQ
            | ADD
            | ADDQ
            | REPLACE
            | REPLACEQ
            | DELETE
            | DELETEQ
            | INCREMENT
            | INCREMENTQ
            | DECREMENT
            | DECREMENTQ
            | APPEND
            | APPENDQ
            | PREPEND
            | PREPENDQ
            | TOUCH
            | GAT
            | GATQ
            | SUBDOC_DICT_ADD
            ..=SUBDOC_COUNTER | SUBDOC_MULTI_MUTATION | SUBDOC_REPLACE_BODY_WITH_XATTR
    )
}

/// Whether a request may carry the PreserveTTL frame info: the writes that store a document
/// with an expiry of their own (a delete or touch has nothing to preserve it over).
pub fn supports_preserve_ttl(op: u8) -> bool {
    use opcode::*;
    supports_durability(op) && !matches!(op, DELETE | DELETEQ | TOUCH | GAT | GATQ)
}

/// Whether the key of a request is a document's (and, with Collections, carries the collection
/// id before it): the KV reads and writes, and Couchbase's locking (0x94, 0x95), GET_META
/// (0xa0, 0xa1) and sub-document (0xc5..=0xd2) commands. Other keys are names (HELLO's agent, a SASL
/// mechanism, a bucket, a stat group) and stay as they are.
pub fn carries_document_key(op: u8) -> bool {
    use opcode::*;
    matches!(
        op,
        GET | SET
            | ADD
            | REPLACE
            | DELETE
            | INCREMENT
            | DECREMENT
            | GETQ
            | GETK
            | GETKQ
            | APPEND
            | PREPEND
            | SETQ
            | ADDQ
            | REPLACEQ
            | DELETEQ
            | INCREMENTQ
            | DECREMENTQ
            | APPENDQ
            | PREPENDQ
            | TOUCH
            | GAT
            | GATQ
            | GET_REPLICA
            | GET_LOCKED
            | UNLOCK_KEY
            | GET_META
            | GETQ_META
            | SUBDOC_GET..=SUBDOC_GET_COUNT // single path and multi path
    )
}

/// The longest unsigned LEB128 encoding of a 32-bit collection id.
const MAX_LEB128_U32: usize = 5;

/// Splits a collection-aware key into its collection id (unsigned LEB128, at most 5 bytes,
/// at most 32 bits) and the document key after it.
pub fn split_collection_id(key: &[u8]) -> Result<(u32, &[u8]), FrameError> {
    let mut id: u64 = 0;
    for (i, &b) in key.iter().take(MAX_LEB128_U32).enumerate() {
        id |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return u32::try_from(id)
                .map(|id| (id, &key[i + 1..]))
                .map_err(|_| FrameError::Malformed("collection id over 32 bits"));
        }
    }
    Err(FrameError::Malformed(if key.len() < MAX_LEB128_U32 {
        "key ends inside its collection id (LEB128)"
    } else {
        "collection id (LEB128) longer than 5 bytes"
    }))
}

/// Appends `id` as unsigned LEB128 (a collection-aware key's prefix).
pub fn write_collection_id(out: &mut Vec<u8>, id: u32) {
    write_leb128(out, id as u64);
}

/// Appends `n` as unsigned LEB128: seven bits a byte, the lowest first, the top bit set on
/// every byte but the last (collection ids, range scans' key and value lengths).
pub fn write_leb128(out: &mut Vec<u8>, mut n: u64) {
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The first byte is not a magic this side accepts.
    BadMagic(u8),
    /// The body is larger than the connection allows; nothing of it was read.
    TooBig { body: usize, max: usize },
    /// Section lengths that do not add up; the connection should answer EINVAL.
    Malformed(&'static str),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadMagic(m) => write!(f, "bad magic 0x{m:02x}"),
            FrameError::TooBig { body, max } => {
                write!(f, "body of {body} bytes exceeds the limit of {max}")
            }
            FrameError::Malformed(why) => write!(f, "malformed frame: {why}"),
        }
    }
}

impl std::error::Error for FrameError {}

fn is_magic(m: u8) -> bool {
    matches!(
        m,
        magic::REQUEST
            | magic::RESPONSE
            | magic::ALT_REQUEST
            | magic::ALT_RESPONSE
            | magic::SERVER_REQUEST
            | magic::SERVER_RESPONSE
    )
}

/// How long the frame at the start of `buf` is, once it is all there: `Ok(None)` asks for more
/// bytes. Refuses an unknown magic or a body over `max_body` from the header alone.
pub fn frame_len(buf: &[u8], max_body: usize) -> Result<Option<usize>, FrameError> {
    if buf.is_empty() {
        return Ok(None);
    }
    if !is_magic(buf[0]) {
        return Err(FrameError::BadMagic(buf[0]));
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let body = u32::from_be_bytes(buf[8..12].try_into().expect("4 bytes")) as usize;
    if body > max_body {
        return Err(FrameError::TooBig {
            body,
            max: max_body,
        });
    }
    let total = HEADER_LEN + body;
    Ok(if buf.len() >= total {
        Some(total)
    } else {
        None
    })
}

/// A request, borrowing its sections from the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    pub magic: u8,
    pub opcode: u8,
    pub datatype: u8,
    pub vbucket: u16,
    pub opaque: u32,
    pub cas: u64,
    pub framing: &'a [u8],
    pub extras: &'a [u8],
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// A response, borrowing its sections from the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response<'a> {
    pub magic: u8,
    pub opcode: u8,
    pub datatype: u8,
    pub status: u16,
    pub opaque: u32,
    pub cas: u64,
    pub framing: &'a [u8],
    pub extras: &'a [u8],
    pub key: &'a [u8],
    pub value: &'a [u8],
}

struct Sections<'a> {
    framing: &'a [u8],
    extras: &'a [u8],
    key: &'a [u8],
    value: &'a [u8],
}

/// Splits a whole frame into its sections after checking that their lengths fit the body.
fn sections(frame: &[u8], flex: bool) -> Result<Sections<'_>, FrameError> {
    if frame.len() < HEADER_LEN {
        return Err(FrameError::Malformed("shorter than a header"));
    }
    let (framing_len, key_len) = if flex {
        (frame[2] as usize, frame[3] as usize)
    } else {
        (0, u16::from_be_bytes([frame[2], frame[3]]) as usize)
    };
    let extras_len = frame[4] as usize;
    let body = u32::from_be_bytes(frame[8..12].try_into().expect("4 bytes")) as usize;
    if frame.len() != HEADER_LEN + body {
        return Err(FrameError::Malformed(
            "frame length differs from the header's body length",
        ));
    }
    if framing_len + extras_len + key_len > body {
        return Err(FrameError::Malformed(
            "framing extras, extras and key exceed the body length",
        ));
    }
    let b = &frame[HEADER_LEN..];
    let (framing, rest) = b.split_at(framing_len);
    let (extras, rest) = rest.split_at(extras_len);
    let (key, value) = rest.split_at(key_len);
    Ok(Sections {
        framing,
        extras,
        key,
        value,
    })
}

/// The header fields after the magic: opcode, datatype, vbucket-or-status, opaque, CAS.
fn fixed(frame: &[u8]) -> (u8, u8, u16, u32, u64) {
    (
        frame[1],
        frame[5],
        u16::from_be_bytes([frame[6], frame[7]]),
        u32::from_be_bytes(frame[12..16].try_into().expect("4 bytes")),
        u64::from_be_bytes(frame[16..24].try_into().expect("8 bytes")),
    )
}

/// Checks the magic against the two this side accepts (plain, flexible) and splits the frame.
fn split(frame: &[u8], plain: [u8; 2], flex: u8) -> Result<(u8, Sections<'_>), FrameError> {
    let m = *frame.first().ok_or(FrameError::Malformed("empty frame"))?;
    let is_flex = match m {
        _ if plain.contains(&m) => false,
        _ if m == flex => true,
        other => return Err(FrameError::BadMagic(other)),
    };
    Ok((m, sections(frame, is_flex)?))
}

pub fn parse_request(frame: &[u8]) -> Result<Request<'_>, FrameError> {
    let (magic, s) = split(
        frame,
        [magic::REQUEST, magic::SERVER_REQUEST],
        magic::ALT_REQUEST,
    )?;
    let (opcode, datatype, vbucket, opaque, cas) = fixed(frame);
    Ok(Request {
        magic,
        opcode,
        datatype,
        vbucket,
        opaque,
        cas,
        framing: s.framing,
        extras: s.extras,
        key: s.key,
        value: s.value,
    })
}

pub fn parse_response(frame: &[u8]) -> Result<Response<'_>, FrameError> {
    let (magic, s) = split(
        frame,
        [magic::RESPONSE, magic::SERVER_RESPONSE],
        magic::ALT_RESPONSE,
    )?;
    let (opcode, datatype, status, opaque, cas) = fixed(frame);
    Ok(Response {
        magic,
        opcode,
        datatype,
        status,
        opaque,
        cas,
        framing: s.framing,
        extras: s.extras,
        key: s.key,
        value: s.value,
    })
}

/// The fixed fields of a frame to write; `word` is the vbucket of a request or the status of a
/// response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeaderFields {
    pub magic: u8,
    pub opcode: u8,
    pub datatype: u8,
    pub word: u16,
    pub opaque: u32,
    pub cas: u64,
}

/// Appends a whole frame. Framing extras switch a request to magic 0x08 and a response to 0x18
/// (whose header holds an 8-bit key length); returns EINVAL-worthy errors for sections too long
/// for their header fields.
pub fn write_frame(
    out: &mut Vec<u8>,
    h: &HeaderFields,
    framing: &[u8],
    extras: &[u8],
    key: &[u8],
    value: &[u8],
) -> Result<(), FrameError> {
    let flex = !framing.is_empty();
    if framing.len() > u8::MAX as usize || extras.len() > u8::MAX as usize {
        return Err(FrameError::Malformed(
            "framing extras or extras longer than 255 bytes",
        ));
    }
    if key.len()
        > if flex {
            u8::MAX as usize
        } else {
            u16::MAX as usize
        }
    {
        return Err(FrameError::Malformed("key too long for the header"));
    }
    let body = framing.len() + extras.len() + key.len() + value.len();
    if body > u32::MAX as usize {
        return Err(FrameError::Malformed("body longer than 4 GiB"));
    }
    let m = match (flex, h.magic) {
        (false, m) => m,
        (true, magic::REQUEST) => magic::ALT_REQUEST,
        (true, magic::RESPONSE) => magic::ALT_RESPONSE,
        (true, m) => m,
    };
    out.reserve(HEADER_LEN + body);
    out.push(m);
    out.push(h.opcode);
    if flex {
        out.push(framing.len() as u8);
        out.push(key.len() as u8);
    } else {
        out.extend_from_slice(&(key.len() as u16).to_be_bytes());
    }
    out.push(extras.len() as u8);
    out.push(h.datatype);
    out.extend_from_slice(&h.word.to_be_bytes());
    out.extend_from_slice(&(body as u32).to_be_bytes());
    out.extend_from_slice(&h.opaque.to_be_bytes());
    out.extend_from_slice(&h.cas.to_be_bytes());
    out.extend_from_slice(framing);
    out.extend_from_slice(extras);
    out.extend_from_slice(key);
    out.extend_from_slice(value);
    Ok(())
}

/// One flexible framing extra (request side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameInfo<'a> {
    Barrier,
    /// Level 1 majority, 2 majority and persist on active, 3 persist to majority; the timeout
    /// in milliseconds when given (0 and 0xffff are reserved: the parser refuses them).
    Durability {
        level: u8,
        timeout_ms: Option<u16>,
    },
    DcpStreamId(u16),
    ImpersonateUser(&'a [u8]),
    PreserveTtl,
    /// An id this parser does not know; the server answers UNKNOWN_FRAME_INFO.
    Unknown {
        id: u16,
        data: &'a [u8],
    },
}

/// Iterates over the framing extras of a request, checking every length before slicing.
pub fn frame_infos(mut b: &[u8]) -> impl Iterator<Item = Result<FrameInfo<'_>, FrameError>> {
    std::iter::from_fn(move || {
        if b.is_empty() {
            return None;
        }
        let r = next_frame_info(&mut b);
        if r.is_err() {
            b = &[];
        }
        Some(r)
    })
}

fn next_frame_info<'a>(b: &mut &'a [u8]) -> Result<FrameInfo<'a>, FrameError> {
    let short = FrameError::Malformed("framing extras end inside a frame info");
    let first = *b.first().ok_or(short.clone())?;
    let mut at = 1;
    let mut id = (first >> 4) as u16;
    let mut len = (first & 0x0f) as usize;
    if id == 15 {
        id = 15 + *b.get(at).ok_or(short.clone())? as u16;
        at += 1;
    }
    if len == 15 {
        len = 15 + *b.get(at).ok_or(short.clone())? as usize;
        at += 1;
    }
    let data = b.get(at..at + len).ok_or(short)?;
    *b = &b[at + len..];
    Ok(match (id, data.len()) {
        (0, 0) => FrameInfo::Barrier,
        (1, 1) => FrameInfo::Durability {
            level: data[0],
            timeout_ms: None,
        },
        (1, 3) => {
            let t = u16::from_be_bytes([data[1], data[2]]);
            if t == 0 || t == 0xffff {
                return Err(FrameError::Malformed(
                    "durability timeout 0 and 0xffff are reserved",
                ));
            }
            FrameInfo::Durability {
                level: data[0],
                timeout_ms: Some(t),
            }
        }
        (2, 2) => FrameInfo::DcpStreamId(u16::from_be_bytes([data[0], data[1]])),
        (4, _) => FrameInfo::ImpersonateUser(data),
        (5, 0) => FrameInfo::PreserveTtl,
        (0 | 1 | 2 | 5, _) => return Err(FrameError::Malformed("frame info of the wrong length")),
        (id, _) => FrameInfo::Unknown { id, data },
    })
}

/// Appends a response of a status and a value only (no extras, key or CAS): the shape of every
/// error reply and of most acknowledgements. Values come from the server itself (messages,
/// small bodies), so they always fit the header.
pub fn write_response(
    out: &mut Vec<u8>,
    opcode: u8,
    opaque: u32,
    status: u16,
    datatype: u8,
    value: &[u8],
) {
    let h = HeaderFields {
        magic: magic::RESPONSE,
        opcode,
        datatype,
        word: status,
        opaque,
        cas: 0,
    };
    let _ = write_frame(out, &h, &[], &[], &[], value);
}

/// Appends one frame info (the encoder for clients and tests).
pub fn write_frame_info(out: &mut Vec<u8>, id: u16, data: &[u8]) {
    let id_nib = if id < 15 { id as u8 } else { 15 };
    let len_nib = if data.len() < 15 {
        data.len() as u8
    } else {
        15
    };
    out.push(id_nib << 4 | len_nib);
    if id >= 15 {
        out.push((id - 15) as u8);
    }
    if data.len() >= 15 {
        out.push((data.len() - 15) as u8);
    }
    out.extend_from_slice(data);
}

/// Extras of SET / ADD / REPLACE: flags and expiration.
pub fn store_extras(extras: &[u8]) -> Option<(u32, u32)> {
    if extras.len() != 8 {
        return None;
    }
    Some((
        u32::from_be_bytes(extras[0..4].try_into().ok()?),
        u32::from_be_bytes(extras[4..8].try_into().ok()?),
    ))
}

/// Extras of INCREMENT / DECREMENT: delta, initial value, expiration.
pub fn arithmetic_extras(extras: &[u8]) -> Option<(u64, u64, u32)> {
    if extras.len() != 20 {
        return None;
    }
    Some((
        u64::from_be_bytes(extras[0..8].try_into().ok()?),
        u64::from_be_bytes(extras[8..16].try_into().ok()?),
        u32::from_be_bytes(extras[16..20].try_into().ok()?),
    ))
}

/// Extras of TOUCH / GAT / GATQ (and FLUSH's optional one): an expiration.
pub fn expiry_extras(extras: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(extras.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn collection_ids_decode_from_leb128() {
        assert_eq!(split_collection_id(b"\x00doc").unwrap(), (0, &b"doc"[..]));
        assert_eq!(split_collection_id(b"\x08k").unwrap(), (8, &b"k"[..]));
        // Couchbase's example: 0x80 0x01 is 128.
        assert_eq!(split_collection_id(b"\x80\x01k").unwrap(), (128, &b"k"[..]));
        assert_eq!(
            split_collection_id(b"\xff\xff\xff\xff\x0f").unwrap(),
            (u32::MAX, &b""[..])
        );
        assert!(split_collection_id(b"").is_err());
        assert!(split_collection_id(b"\x80").is_err());
        assert!(split_collection_id(b"\xff\xff\xff\xff\x1f").is_err()); // 33 bits
        assert!(split_collection_id(b"\x80\x80\x80\x80\x80\x00").is_err()); // 6 bytes
    }

    proptest! {
        #[test]
        fn collection_ids_round_trip(id: u32, key in proptest::collection::vec(any::<u8>(), 0..20)) {
            let mut k = Vec::new();
            write_collection_id(&mut k, id);
            k.extend_from_slice(&key);
            prop_assert_eq!(split_collection_id(&k).unwrap(), (id, &key[..]));
        }

        #[test]
        fn collection_id_decoding_never_panics(k in proptest::collection::vec(any::<u8>(), 0..8)) {
            let _ = split_collection_id(&k);
        }
    }

    /// BinaryProtocol.md, "0x00 Get" example: the request for "Hello".
    const GET_HELLO: [u8; 29] = [
        0x80, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, b'H', b'e', b'l', b'l', b'o',
    ];

    /// BinaryProtocol.md, "0x02 Add" example: key Hello, value World, flags 0xdeadbeef. Its prose
    /// says "expiry: in two hours" but its bytes (and field table) say 0x00000e10, one hour.
    const ADD_HELLO: [u8; 42] = [
        0x80, 0x02, 0x00, 0x05, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x12, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xde, 0xad, 0xbe, 0xef, 0x00, 0x00,
        0x0e, 0x10, b'H', b'e', b'l', b'l', b'o', b'W', b'o', b'r', b'l', b'd',
    ];

    #[test]
    fn documented_get_request_parses() {
        assert_eq!(frame_len(&GET_HELLO, 1 << 20), Ok(Some(29)));
        assert_eq!(frame_len(&GET_HELLO[..28], 1 << 20), Ok(None));
        let r = parse_request(&GET_HELLO).unwrap();
        assert_eq!(
            (r.opcode, r.key, r.extras, r.value, r.vbucket, r.opaque, r.cas),
            (opcode::GET, &b"Hello"[..], &[][..], &[][..], 0, 0, 0)
        );
    }

    #[test]
    fn documented_add_request_parses_and_reencodes_byte_for_byte() {
        let r = parse_request(&ADD_HELLO).unwrap();
        assert_eq!(r.opcode, opcode::ADD);
        assert_eq!(store_extras(r.extras), Some((0xdead_beef, 3600)));
        assert_eq!((r.key, r.value), (&b"Hello"[..], &b"World"[..]));
        let mut out = Vec::new();
        let h = HeaderFields {
            magic: magic::REQUEST,
            opcode: opcode::ADD,
            ..Default::default()
        };
        write_frame(&mut out, &h, &[], r.extras, r.key, r.value).unwrap();
        assert_eq!(out, ADD_HELLO);
    }

    #[test]
    fn documented_get_response_is_what_we_write() {
        // BinaryProtocol.md "0x00 Get" example response: flags 0xdeadbeef, value "World", CAS 1.
        let expected: [u8; 33] = [
            0x81, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x09, 0x00, 0x00,
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0xde, 0xad, 0xbe, 0xef,
            b'W', b'o', b'r', b'l', b'd',
        ];
        let mut out = Vec::new();
        let h = HeaderFields {
            magic: magic::RESPONSE,
            opcode: opcode::GET,
            cas: 1,
            ..Default::default()
        };
        write_frame(
            &mut out,
            &h,
            &[],
            &0xdead_beef_u32.to_be_bytes(),
            &[],
            b"World",
        )
        .unwrap();
        assert_eq!(out, expected);
        let r = parse_response(&out).unwrap();
        assert_eq!(
            (r.status, r.cas, r.extras, r.value),
            (
                status::SUCCESS,
                1,
                &[0xde, 0xad, 0xbe, 0xef][..],
                &b"World"[..]
            )
        );
    }

    #[test]
    fn limits_and_bad_lengths_are_refused_before_reading_the_body() {
        let mut huge = GET_HELLO;
        huge[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            frame_len(&huge[..24], 20 << 20),
            Err(FrameError::TooBig {
                body: u32::MAX as usize,
                max: 20 << 20
            })
        );
        assert_eq!(frame_len(&[0x42], 100), Err(FrameError::BadMagic(0x42)));
        let mut bad = GET_HELLO;
        bad[3] = 0x06; // key longer than the body
        assert!(matches!(parse_request(&bad), Err(FrameError::Malformed(_))));
    }

    #[test]
    fn durability_frame_info_with_and_without_timeout() {
        let mut f = Vec::new();
        write_frame_info(&mut f, 1, &[0x01]);
        write_frame_info(&mut f, 1, &[0x03, 0x01, 0xf4]);
        write_frame_info(&mut f, 0, &[]);
        let infos: Vec<_> = frame_infos(&f).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            infos,
            vec![
                FrameInfo::Durability {
                    level: 1,
                    timeout_ms: None
                },
                FrameInfo::Durability {
                    level: 3,
                    timeout_ms: Some(500)
                },
                FrameInfo::Barrier
            ]
        );
        // The reserved timeouts and a truncated info are errors, never a panic.
        assert!(frame_infos(&[0x13, 0x01, 0x00, 0x00])
            .next()
            .unwrap()
            .is_err());
        assert!(frame_infos(&[0x13, 0x01]).next().unwrap().is_err());
        // An alt request carries them: magic 0x08, byte 2 their length, byte 3 the key length.
        let mut out = Vec::new();
        let h = HeaderFields {
            magic: magic::REQUEST,
            opcode: opcode::SET,
            opaque: 7,
            ..Default::default()
        };
        write_frame(&mut out, &h, &f, &[0, 0, 0, 0, 0, 0, 0, 0], b"k", b"v").unwrap();
        assert_eq!(
            (out[0], out[2], out[3]),
            (magic::ALT_REQUEST, f.len() as u8, 1)
        );
        let r = parse_request(&out).unwrap();
        assert_eq!(
            (r.framing, r.key, r.value, r.opaque),
            (&f[..], &b"k"[..], &b"v"[..], 7)
        );
    }

    #[test]
    fn escaped_frame_info_ids_and_lengths() {
        let mut f = Vec::new();
        let data = [7u8; 20];
        write_frame_info(&mut f, 20, &data);
        assert_eq!(f[0], 0xff);
        let infos: Vec<_> = frame_infos(&f).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            infos,
            vec![FrameInfo::Unknown {
                id: 20,
                data: &data
            }]
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..200), max in 0usize..300) {
            if let Ok(Some(n)) = frame_len(&buf, max) {
                let _ = parse_request(&buf[..n]);
                let _ = parse_response(&buf[..n]);
            }
            for info in frame_infos(&buf) {
                let _ = info;
            }
        }

        #[test]
        fn written_requests_parse_back(op in any::<u8>(), vb in any::<u16>(), opaque in any::<u32>(), cas in any::<u64>(),
                                       extras in proptest::collection::vec(any::<u8>(), 0..30),
                                       key in proptest::collection::vec(any::<u8>(), 0..250),
                                       value in proptest::collection::vec(any::<u8>(), 0..2000), flex in any::<bool>()) {
            let framing = if flex { vec![0x00] } else { vec![] };
            let mut out = Vec::new();
            let h = HeaderFields { magic: magic::REQUEST, opcode: op, datatype: 1, word: vb, opaque, cas };
            write_frame(&mut out, &h, &framing, &extras, &key, &value).unwrap();
            prop_assert_eq!(frame_len(&out, 1 << 20).unwrap(), Some(out.len()));
            let r = parse_request(&out).unwrap();
            prop_assert_eq!((r.opcode, r.vbucket, r.opaque, r.cas, r.datatype), (op, vb, opaque, cas, 1));
            prop_assert_eq!((r.framing, r.extras, r.key, r.value), (&framing[..], &extras[..], &key[..], &value[..]));
        }
    }
}
