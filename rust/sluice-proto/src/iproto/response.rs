//! Answers laid out byte for byte as Tarantool 2.6 writes them: a `ce` + u32 length, the
//! header `83 00 ce<type> 01 cf<sync> 05 ce<schema_version>` (fixed widths, this key order),
//! then the body: `80` for OK, `81 30 dd<count> rows...` for data, or
//! `82 31 <message> 52 {00: [{00 type, 02 line, 01 file, 03 message, 04 errno, 05 code}]}` for
//! an error (see shared/reference/tarantool-captures/SUMMARY.md §1 and §5).

use super::codes::{self, TYPE_ERROR};
use crate::msgpack::{write_array_len, write_map_len, write_str, write_str_bytes, write_uint};

/// Length prefix (5) and header (23) of every answer.
const HEAD_LEN: usize = 5 + 23;

/// Starts a packet: a length placeholder and the header. Returns where the packet starts.
fn begin(out: &mut Vec<u8>, code: u32, sync: u64, schema_version: u32) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0xce, 0, 0, 0, 0, 0x83, 0x00, 0xce]);
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(&[0x01, 0xcf]);
    out.extend_from_slice(&sync.to_be_bytes());
    out.extend_from_slice(&[0x05, 0xce]);
    out.extend_from_slice(&schema_version.to_be_bytes());
    start
}

/// Patches the length of the packet that starts at `start`.
fn finish(out: &mut [u8], start: usize) {
    let len = (out.len() - start - 5) as u32;
    out[start + 1..start + 5].copy_from_slice(&len.to_be_bytes());
}

/// A reply whose body another node wrote (a request forwarded to the owner of its key),
/// answered under this connection's sync and schema version.
pub fn write_relayed(out: &mut Vec<u8>, sync: u64, schema_version: u32, code: u32, body: &[u8]) {
    let start = begin(out, code, sync, schema_version);
    out.extend_from_slice(body);
    finish(out, start);
}

/// OK with an empty body (PING, AUTH).
pub fn write_ok(out: &mut Vec<u8>, sync: u64, schema_version: u32) {
    let start = begin(out, codes::OK, sync, schema_version);
    out.push(0x80);
    finish(out, start);
}

/// An OK answer carrying IPROTO_DATA, written row by row: the array is always `dd` + u32, as
/// Tarantool writes it, so the count is patched at the end.
#[derive(Debug)]
pub struct DataWriter {
    start: usize,
    rows: u32,
}

impl DataWriter {
    pub fn begin(out: &mut Vec<u8>, sync: u64, schema_version: u32) -> DataWriter {
        let start = begin(out, codes::OK, sync, schema_version);
        out.extend_from_slice(&[0x81, codes::KEY_DATA, 0xdd, 0, 0, 0, 0]);
        DataWriter { start, rows: 0 }
    }

    /// Appends one row: `value` is one whole MessagePack value (a tuple, a call's result).
    pub fn push_raw(&mut self, out: &mut Vec<u8>, value: &[u8]) {
        out.extend_from_slice(value);
        self.rows += 1;
    }

    /// Rows pushed so far.
    pub fn rows(&self) -> u32 {
        self.rows
    }

    pub fn finish(self, out: &mut [u8]) {
        let at = self.start + HEAD_LEN + 3;
        out[at..at + 4].copy_from_slice(&self.rows.to_be_bytes());
        finish(out, self.start);
    }
}

/// Where in Tarantool's sources an error was raised: the extended error's FILE and LINE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin<'a> {
    pub file: &'a str,
    pub line: u32,
}

/// The place Tarantool 2.6 raises each code from on the paths sluice mirrors (as recorded in
/// the captures), so answers match Tarantool's byte for byte; iproto.cc for the rest.
pub fn origin(code: u32, message: &[u8]) -> Origin<'static> {
    let (file, line) = match code {
        codes::ER_INVALID_MSGPACK => match message {
            b"Invalid MsgPack - packet length" => ("./src/box/iproto.cc", 826),
            b"Invalid MsgPack - packet header" => ("./src/box/xrow.c", 142),
            m if m.starts_with(b"Invalid MsgPack - auth") || m.ends_with(b"scramble size") => {
                ("./src/box/authentication.cc", 88)
            }
            _ => ("./src/box/xrow.c", 715),
        },
        codes::ER_TUPLE_FOUND => ("./src/box/memtx_tree.c", 577),
        codes::ER_KEY_PART_TYPE => ("./src/box/key_def.h", 532),
        codes::ER_FIELD_TYPE => ("./src/box/tuple_format.c", 1193),
        codes::ER_KEY_PART_COUNT => ("./src/box/index.cc", 116),
        codes::ER_PROC_LUA => ("./src/lua/utils.c", 1005),
        codes::ER_NO_SUCH_PROC => ("./src/box/lua/call.c", 116),
        codes::ER_NO_SUCH_INDEX_ID => ("./src/box/space.h", 335),
        codes::ER_NO_SUCH_SPACE => ("./src/box/schema.h", 84),
        codes::ER_FIELD_MISSING => ("./src/box/tuple_format.c", 1048),
        codes::ER_ACCESS_DENIED => ("./src/box/space.c", 91),
        codes::ER_NO_SUCH_USER => ("./src/box/user.cc", 539),
        codes::ER_PASSWORD_MISMATCH => ("./src/box/authentication.cc", 96),
        codes::ER_UNKNOWN_REQUEST_TYPE => ("./src/box/iproto.cc", 1313),
        codes::ER_MISSING_REQUEST_FIELD => ("./src/box/xrow.c", 782),
        codes::ER_WRONG_SCHEMA_VERSION => ("./src/box/iproto.cc", 1411),
        codes::ER_READONLY => ("./src/box/box.cc", 152),
        _ => ("./src/box/iproto.cc", 1),
    };
    Origin { file, line }
}

/// AccessDeniedError's FIELDS (0x06).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccessDenied<'a> {
    /// "Read", "Write", "Execute", ...
    pub access_type: &'a str,
    /// "space", "function", "universe", ...
    pub object_type: &'a str,
    pub object_name: &'a str,
}

/// One error as the extended error map carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorEntry<'a> {
    pub code: u32,
    pub message: &'a [u8],
    /// "ClientError", "AccessDeniedError", "LuajitError".
    pub error_type: &'a str,
    pub origin: Origin<'a>,
    pub fields: Option<AccessDenied<'a>>,
}

/// An error answer with the type and origin Tarantool gives `code`.
pub fn write_error(out: &mut Vec<u8>, sync: u64, schema_version: u32, code: u32, message: &str) {
    write_error_bytes(out, sync, schema_version, code, message.as_bytes());
}

/// ER_ACCESS_DENIED: "`access` access to `object_type` 'name' is denied for user 'user'",
/// with the FIELDS net.box and tarantool-python show.
pub fn write_access_denied(
    out: &mut Vec<u8>,
    sync: u64,
    schema_version: u32,
    denied: AccessDenied<'_>,
    user: &str,
) {
    let message = format!(
        "{} access to {} '{}' is denied for user '{}'",
        denied.access_type, denied.object_type, denied.object_name, user
    );
    // Data access is checked in space.c, execute access in session.cc.
    let origin = if denied.object_type == "space" {
        Origin {
            file: "./src/box/space.c",
            line: 91,
        }
    } else {
        Origin {
            file: "./src/box/session.cc",
            line: 332,
        }
    };
    write_error_entry(
        out,
        sync,
        schema_version,
        &ErrorEntry {
            code: codes::ER_ACCESS_DENIED,
            message: message.as_bytes(),
            error_type: "AccessDeniedError",
            origin,
            fields: Some(denied),
        },
    );
}

/// An error answer with every part of the extended error given.
pub fn write_error_entry(out: &mut Vec<u8>, sync: u64, schema_version: u32, e: &ErrorEntry<'_>) {
    let start = begin(out, TYPE_ERROR | e.code, sync, schema_version);
    out.extend_from_slice(&[0x82, codes::KEY_ERROR_24]);
    write_str_bytes(out, e.message);
    out.extend_from_slice(&[codes::KEY_ERROR, 0x81, codes::KEY_ERROR_STACK, 0x91]);
    write_map_len(out, if e.fields.is_some() { 7 } else { 6 });
    out.push(codes::ERROR_TYPE);
    write_str(out, e.error_type);
    out.push(codes::ERROR_LINE);
    write_uint(out, e.origin.line as u64);
    out.push(codes::ERROR_FILE);
    write_str(out, e.origin.file);
    out.push(codes::ERROR_MESSAGE);
    write_str_bytes(out, e.message);
    out.push(codes::ERROR_ERRNO);
    write_uint(out, 0);
    out.push(codes::ERROR_CODE);
    write_uint(out, e.code as u64);
    if let Some(f) = e.fields {
        out.push(codes::ERROR_FIELDS);
        write_map_len(out, 3);
        for (k, v) in [
            ("object_type", f.object_type),
            ("object_name", f.object_name),
            ("access_type", f.access_type),
        ] {
            write_str(out, k);
            write_str(out, v);
        }
    }
    finish(out, start);
}

/// The answer to IPROTO_ID (Tarantool 2.10): `{0x54 VERSION: version, 0x55 FEATURES: [...]}`.
pub fn write_id(out: &mut Vec<u8>, sync: u64, schema_version: u32, version: u64, features: &[u64]) {
    let start = begin(out, codes::OK, sync, schema_version);
    write_map_len(out, 2);
    out.push(codes::KEY_VERSION);
    write_uint(out, version);
    out.push(codes::KEY_FEATURES);
    write_array_len(out, features.len() as u32);
    for f in features {
        write_uint(out, *f);
    }
    finish(out, start);
}

/// [`write_error`] for a message held as bytes (a Lua error may carry any), written as given.
pub fn write_error_bytes(
    out: &mut Vec<u8>,
    sync: u64,
    schema_version: u32,
    code: u32,
    message: &[u8],
) {
    write_error_entry(
        out,
        sync,
        schema_version,
        &ErrorEntry {
            code,
            message,
            error_type: codes::error_type(code),
            origin: origin(code, message),
            fields: None,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iproto::unhex;

    #[test]
    fn ok_as_tarantool_writes_it() {
        let mut out = Vec::new();
        write_ok(&mut out, 100, 86);
        assert_eq!(
            out,
            unhex("ce000000188300ce0000000001cf000000000000006405ce0000005680")
        );
        // A large sync is echoed as u64, and answers append to what is buffered.
        write_ok(&mut out, 1 << 40, 86);
        assert_eq!(
            out[29..],
            unhex("ce000000188300ce0000000001cf000001000000000005ce0000005680")
        );
    }

    #[test]
    fn data_as_tarantool_writes_it() {
        let mut out = vec![0xaa];
        let mut rows = DataWriter::begin(&mut out, 104, 86);
        rows.push_raw(&mut out, &unhex("9301a5416c6963651e"));
        assert_eq!(rows.rows(), 1);
        rows.finish(&mut out);
        assert_eq!(
            out[1..],
            unhex("ce000000278300ce0000000001cf000000000000006805ce000000568130dd000000019301a5416c6963651e")
        );
        // No rows: still a 32-bit array (SELECT with LIMIT 0).
        let mut out = Vec::new();
        DataWriter::begin(&mut out, 112, 86).finish(&mut out);
        assert_eq!(
            out,
            unhex("ce0000001e8300ce0000000001cf000000000000007005ce000000568130dd00000000")
        );
    }

    #[test]
    fn errors_as_tarantool_writes_them() {
        let cases: &[(u64, u32, u32, &str, &str)] = &[
            (102, 86, 48, "Unknown request type 73", "ce000000798300ce0000803001cf000000000000006605ce000000568231b7556e6b6e6f776e20726571756573742074797065203733528100918600ab436c69656e744572726f7202cd052101b32e2f7372632f626f782f6970726f746f2e636303b7556e6b6e6f776e2072657175657374207479706520373304000530"),
            (0, 80, 3, "Duplicate key exists in unique index 'primary' in space 'users'", "ce000000ce8300ce0000800301cf000000000000000005ce000000508231d93f4475706c6963617465206b65792065786973747320696e20756e6971756520696e64657820277072696d6172792720696e20737061636520277573657273275281009186 00ab436c69656e744572726f7202cd024101b62e2f7372632f626f782f6d656d74785f747265652e6303d93f4475706c6963617465206b65792065786973747320696e20756e6971756520696e64657820277072696d6172792720696e2073706163652027757365727327040005 03"),
            (1, 92, 47, "Incorrect password supplied for user 'app'", "ce000000a78300ce0000802f01cf000000000000000105ce0000005c8231d92a496e636f72726563742070617373776f726420737570706c69656420666f722075736572202761707027528100918600ab436c69656e744572726f72026001bb2e2f7372632f626f782f61757468656e7469636174696f6e2e636303d92a496e636f72726563742070617373776f726420737570706c69656420666f7220757365722027617070270400052f"),
            (1, 92, 20, "Invalid MsgPack - invalid scramble size", "ce000000a18300ce0000801401cf000000000000000105ce0000005c8231d927496e76616c6964204d73675061636b202d20696e76616c696420736372616d626c652073697a65528100918600ab436c69656e744572726f72025801bb2e2f7372632f626f782f61757468656e7469636174696f6e2e636303d927496e76616c6964204d73675061636b202d20696e76616c696420736372616d626c652073697a6504000514"),
            (0, 92, 20, "Invalid MsgPack - packet header", "ce000000858300ce0000801401cf000000000000000005ce0000005c8231bf496e76616c6964204d73675061636b202d207061636b657420686561646572528100918600ab436c69656e744572726f7202cc8e01b02e2f7372632f626f782f78726f772e6303bf496e76616c6964204d73675061636b202d207061636b65742068656164657204000514"),
            (8, 92, 20, "Invalid MsgPack - packet body", "ce000000828300ce0000801401cf000000000000000805ce0000005c8231bd496e76616c6964204d73675061636b202d207061636b657420626f6479528100918600ab436c69656e744572726f7202cd02cb01b02e2f7372632f626f782f78726f772e6303bd496e76616c6964204d73675061636b202d207061636b657420626f647904000514"),
            (0, 92, 20, "Invalid MsgPack - packet length", "ce000000898300ce0000801401cf000000000000000005ce0000005c8231bf496e76616c6964204d73675061636b202d207061636b6574206c656e677468528100918600ab436c69656e744572726f7202cd033a01b32e2f7372632f626f782f6970726f746f2e636303bf496e76616c6964204d73675061636b202d207061636b6574206c656e67746804000514"),
            (1, 92, 45, "User 'nobody' is not found", "ce0000007d8300ce0000802d01cf000000000000000105ce0000005c8231ba5573657220276e6f626f647927206973206e6f7420666f756e64528100918600ab436c69656e744572726f7202cd021b01b12e2f7372632f626f782f757365722e636303ba5573657220276e6f626f647927206973206e6f7420666f756e640400052d"),
        ];
        for (sync, schema, code, message, hex) in cases {
            let mut out = Vec::new();
            write_error(&mut out, *sync, *schema, *code, message);
            assert_eq!(out, unhex(hex), "{message}");
        }
    }

    #[test]
    fn access_denied_carries_its_fields() {
        let mut out = Vec::new();
        let denied = AccessDenied {
            access_type: "Read",
            object_type: "space",
            object_name: "users",
        };
        write_access_denied(&mut out, 0, 82, denied, "guest");
        assert_eq!(out, unhex("ce000000f48300ce0000802a01cf000000000000000005ce000000528231d937526561642061636365737320746f20737061636520277573657273272069732064656e69656420666f7220757365722027677565737427528100918700b141636365737344656e6965644572726f72025b01b12e2f7372632f626f782f73706163652e6303d937526561642061636365737320746f20737061636520277573657273272069732064656e69656420666f72207573657220276775657374270400052a0683ab6f626a6563745f74797065a57370616365ab6f626a6563745f6e616d65a57573657273ab6163636573735f74797065a452656164"));
        let mut out = Vec::new();
        let denied = AccessDenied {
            access_type: "Execute",
            object_type: "function",
            object_name: "add",
        };
        write_access_denied(&mut out, 0, 82, denied, "guest");
        assert_eq!(out, unhex("ce000001058300ce0000802a01cf000000000000000005ce000000528231d93b457865637574652061636365737320746f2066756e6374696f6e2027616464272069732064656e69656420666f7220757365722027677565737427528100918700b141636365737344656e6965644572726f7202cd014c01b42e2f7372632f626f782f73657373696f6e2e636303d93b457865637574652061636365737320746f2066756e6374696f6e2027616464272069732064656e69656420666f72207573657220276775657374270400052a0683ab6f626a6563745f74797065a866756e6374696f6eab6f626a6563745f6e616d65a3616464ab6163636573735f74797065a745786563757465"));
    }

    #[test]
    fn a_lua_error_is_a_luajit_error_and_keeps_its_bytes() {
        let mut out = Vec::new();
        write_error(&mut out, 0, 80, 32, "eval:1: boom");
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("LuajitError") && text.contains("./src/lua/utils.c"));
        let mut out = Vec::new();
        write_error_bytes(&mut out, 0, 80, 32, b"bad \xff byte");
        let message: &[u8] = b"bad \xff byte";
        let copies = out.windows(message.len()).filter(|w| *w == message).count();
        assert_eq!(copies, 2, "ERROR_24 and the stack's MESSAGE");
    }

    #[test]
    fn id_answer() {
        let mut out = Vec::new();
        write_id(&mut out, 7, 80, 3, &[0, 1, 2, 3]);
        assert_eq!(
            out,
            unhex("ce000000208300ce0000000001cf000000000000000705ce00000050825403559400010203")
        );
    }
}
