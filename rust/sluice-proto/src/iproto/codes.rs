//! The numbers of iproto: request types, header and body keys, iterator types and the error
//! codes of Tarantool 2.6 (src/box/iproto_constants.h, src/box/errcode.h; the code/name pairs
//! are those `box.error` lists in shared/reference/tarantool-captures/errcodes_2.6.txt).

// Request types (header key 0x00). An answer carries OK or `TYPE_ERROR | code`.
pub const OK: u32 = 0;
pub const SELECT: u32 = 1;
pub const INSERT: u32 = 2;
pub const REPLACE: u32 = 3;
pub const UPDATE: u32 = 4;
pub const DELETE: u32 = 5;
pub const CALL_16: u32 = 6;
pub const AUTH: u32 = 7;
pub const EVAL: u32 = 8;
pub const UPSERT: u32 = 9;
pub const CALL: u32 = 10;
pub const EXECUTE: u32 = 11;
pub const NOP: u32 = 12;
pub const PREPARE: u32 = 13;
pub const PING: u32 = 64;
pub const JOIN: u32 = 65;
pub const SUBSCRIBE: u32 = 66;
pub const VOTE: u32 = 68;
pub const FETCH_SNAPSHOT: u32 = 69;
/// IPROTO_ID, added in Tarantool 2.10 (2.6 answers it with ER_UNKNOWN_REQUEST_TYPE).
pub const ID: u32 = 73;
/// An error answer's type is this bit or'ed with the error code.
pub const TYPE_ERROR: u32 = 0x8000;

// Header keys.
pub const KEY_REQUEST_TYPE: u8 = 0x00;
pub const KEY_SYNC: u8 = 0x01;
pub const KEY_REPLICA_ID: u8 = 0x02;
pub const KEY_LSN: u8 = 0x03;
pub const KEY_TIMESTAMP: u8 = 0x04;
pub const KEY_SCHEMA_VERSION: u8 = 0x05;
pub const KEY_SERVER_VERSION: u8 = 0x06;
pub const KEY_GROUP_ID: u8 = 0x07;
pub const KEY_TSN: u8 = 0x08;
pub const KEY_FLAGS: u8 = 0x09;
/// Streams (2.10); an unused unsigned key to 2.6.
pub const KEY_STREAM_ID: u8 = 0x0a;

// Body keys.
pub const KEY_SPACE_ID: u8 = 0x10;
pub const KEY_INDEX_ID: u8 = 0x11;
pub const KEY_LIMIT: u8 = 0x12;
pub const KEY_OFFSET: u8 = 0x13;
pub const KEY_ITERATOR: u8 = 0x14;
pub const KEY_INDEX_BASE: u8 = 0x15;
pub const KEY_KEY: u8 = 0x20;
pub const KEY_TUPLE: u8 = 0x21;
pub const KEY_FUNCTION_NAME: u8 = 0x22;
pub const KEY_USER_NAME: u8 = 0x23;
pub const KEY_INSTANCE_UUID: u8 = 0x24;
pub const KEY_CLUSTER_UUID: u8 = 0x25;
pub const KEY_VCLOCK: u8 = 0x26;
pub const KEY_EXPR: u8 = 0x27;
pub const KEY_OPS: u8 = 0x28;
pub const KEY_BALLOT: u8 = 0x29;
pub const KEY_TUPLE_META: u8 = 0x2a;
pub const KEY_OPTIONS: u8 = 0x2b;
pub const KEY_DATA: u8 = 0x30;
pub const KEY_ERROR_24: u8 = 0x31;
pub const KEY_METADATA: u8 = 0x32;
pub const KEY_SQL_TEXT: u8 = 0x40;
/// SUBSCRIBE as an anonymous replica (no slot in the upstream's `_cluster`).
pub const KEY_REPLICA_ANON: u8 = 0x50;
pub const KEY_SQL_BIND: u8 = 0x41;
pub const KEY_SQL_INFO: u8 = 0x42;
pub const KEY_STMT_ID: u8 = 0x43;
pub const KEY_ERROR: u8 = 0x52;
/// The first key Tarantool 2.6 does not know: a header naming one is refused.
pub const KEY_MAX_2_6: u8 = 0x53;
/// sluice's own header keys, between the nodes of a cluster: a request a node forwards to the
/// owner of its key carries the user it runs as (honoured only from a login with the
/// `replication` permission), and a read one node fans out names the vbuckets the node that
/// answers is to read (each active there, as the asking node's map says, else it fails).
pub const KEY_SLUICE_FORWARDED_FOR: u8 = 0x70;
pub const KEY_SLUICE_PART: u8 = 0x71;
/// IPROTO_ID's body (2.10).
pub const KEY_VERSION: u8 = 0x54;
pub const KEY_FEATURES: u8 = 0x55;

// Keys of one entry of the extended error (0x52 -> 0x00 ERROR_STACK -> [entry]).
pub const KEY_ERROR_STACK: u8 = 0x00;
pub const ERROR_TYPE: u8 = 0x00;
pub const ERROR_FILE: u8 = 0x01;
pub const ERROR_LINE: u8 = 0x02;
pub const ERROR_MESSAGE: u8 = 0x03;
pub const ERROR_ERRNO: u8 = 0x04;
pub const ERROR_CODE: u8 = 0x05;
pub const ERROR_FIELDS: u8 = 0x06;

/// SELECT's iterator types (box.index.EQ ...), as IPROTO_ITERATOR carries them.
pub mod iterator {
    pub const EQ: u32 = 0;
    pub const REQ: u32 = 1;
    pub const ALL: u32 = 2;
    pub const LT: u32 = 3;
    pub const LE: u32 = 4;
    pub const GE: u32 = 5;
    pub const GT: u32 = 6;
    pub const BITS_ALL_SET: u32 = 7;
    pub const BITS_ANY_SET: u32 = 8;
    pub const BITS_ALL_NOT_SET: u32 = 9;
    pub const OVERLAPS: u32 = 10;
    pub const NEIGHBOR: u32 = 11;
}

// Error codes sluice answers with (errcode.h of 2.6; the comment is Tarantool's text format).
/// "Illegal parameters, %s"
pub const ER_ILLEGAL_PARAMS: u32 = 1;
/// "Duplicate key exists in unique index '%s' in space '%s'"
pub const ER_TUPLE_FOUND: u32 = 3;
/// "Tuple doesn't exist in index '%s' in space '%s'"
pub const ER_TUPLE_NOT_FOUND: u32 = 4;
/// "%s does not support %s"
pub const ER_UNSUPPORTED: u32 = 5;
/// "Can't modify data because this instance is in read-only mode."
pub const ER_READONLY: u32 = 7;
/// "Supplied key type of part %u does not match index part type: expected %s"
pub const ER_KEY_PART_TYPE: u32 = 18;
/// "Invalid key part count in an exact match (expected %u, got %u)"
pub const ER_EXACT_MATCH: u32 = 19;
/// "Invalid MsgPack - %s"
pub const ER_INVALID_MSGPACK: u32 = 20;
/// "Tuple/Key must be MsgPack array"
pub const ER_TUPLE_NOT_ARRAY: u32 = 22;
/// "Tuple field %s type does not match one required by operation: expected %s"
pub const ER_FIELD_TYPE: u32 = 23;
/// "SPLICE error on field %s: %s"
pub const ER_UPDATE_SPLICE: u32 = 25;
/// "Argument type in operation '%c' on field %s does not match field type: expected %s"
pub const ER_UPDATE_ARG_TYPE: u32 = 26;
/// "Unknown UPDATE operation #%d: %s"
pub const ER_UNKNOWN_UPDATE_OP: u32 = 28;
/// "Field %s UPDATE error: %s"
pub const ER_UPDATE_FIELD: u32 = 29;
/// "Invalid key part count (expected [0..%u], got %u)"
pub const ER_KEY_PART_COUNT: u32 = 31;
/// "%s" (a Lua error)
pub const ER_PROC_LUA: u32 = 32;
/// "Procedure '%.*s' is not defined"
pub const ER_NO_SUCH_PROC: u32 = 33;
/// "No index #%u is defined in space '%s'"
pub const ER_NO_SUCH_INDEX_ID: u32 = 35;
/// "Space '%s' does not exist"
pub const ER_NO_SUCH_SPACE: u32 = 36;
/// "Field %d was not found in the tuple"
pub const ER_NO_SUCH_FIELD_NO: u32 = 37;
/// "Tuple field count %u does not match space field count %u"
pub const ER_EXACT_FIELD_COUNT: u32 = 38;
/// "Tuple field %s required by space format is missing"
pub const ER_FIELD_MISSING: u32 = 39;
/// "%s access to %s '%s' is denied for user '%s'"
pub const ER_ACCESS_DENIED: u32 = 42;
/// "User '%s' is not found"
pub const ER_NO_SUCH_USER: u32 = 45;
/// "Incorrect password supplied for user '%s'"
pub const ER_PASSWORD_MISMATCH: u32 = 47;
/// "Unknown request type %u"
pub const ER_UNKNOWN_REQUEST_TYPE: u32 = 48;
/// "Missing mandatory field '%s' in request"
pub const ER_MISSING_REQUEST_FIELD: u32 = 69;
/// "Unknown iterator type '%s'"
pub const ER_ITERATOR_TYPE: u32 = 72;
/// "Attempt to modify a tuple field which is part of index '%s' in space '%s'"
pub const ER_CANT_UPDATE_PRIMARY_KEY: u32 = 94;
/// "Integer overflow when performing '%c' operation on field %s"
pub const ER_UPDATE_INTEGER_OVERFLOW: u32 = 95;
/// "Wrong schema version, current: %d, in request: %u" (2.6 swaps the two values)
pub const ER_WRONG_SCHEMA_VERSION: u32 = 109;
/// "Index '%s' (%s) of space '%s' (%s) does not support %s"
pub const ER_UNSUPPORTED_INDEX_FEATURE: u32 = 112;
/// "Field '%s' was not found in the tuple"
pub const ER_NO_SUCH_FIELD_NAME: u32 = 201;

/// The error class Tarantool reports for a code in the extended error (0x52): what
/// `box.error` shows as `type`.
pub fn error_type(code: u32) -> &'static str {
    match code {
        ER_ACCESS_DENIED => "AccessDeniedError",
        ER_PROC_LUA => "LuajitError",
        _ => "ClientError",
    }
}
