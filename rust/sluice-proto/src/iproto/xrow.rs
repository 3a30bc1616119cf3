//! Rows as Tarantool stores them in its `.xlog` and `.snap` files and streams them to replicas
//! (JOIN, SUBSCRIBE): a header map (request type, replica id, LSN, timestamp, transaction id,
//! flags) and a body map (space id, tuple, key, operations).
//!
//! `Row::write_json` prints a row as Tarantool's `xlog` Lua module reads it:
//! `{"HEADER": {"type": "INSERT", "lsn": .., ...}, "BODY": {"space_id": .., "tuple": [..]}}`,
//! with the module's key names, so `sluice wal-dump` and Tarantool agree on what a file holds.

use std::fmt::Write as _;

use super::json::{write_json, write_string};
use super::MAX_DEPTH;
use crate::msgpack::{DecodeError, Reader, Value};

/// The FLAGS bits of a row's header.
pub const FLAG_COMMIT: u64 = 1;
pub const FLAG_WAIT_SYNC: u64 = 2;
pub const FLAG_WAIT_ACK: u64 = 4;

/// A row's header: what Tarantool 2.6 writes (other keys are stepped over).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowHeader {
    pub kind: u32,
    pub sync: Option<u64>,
    pub replica_id: Option<u32>,
    pub lsn: Option<u64>,
    pub timestamp: Option<f64>,
    pub schema_version: Option<u64>,
    pub group_id: Option<u32>,
    /// The transaction's id (the LSN of its first row; stored as the distance to it); absent
    /// on single-row transactions.
    pub tsn: Option<u64>,
    pub flags: Option<u64>,
}

impl RowHeader {
    /// Whether the row ends its transaction: flagged so, or a row of a single-row transaction
    /// (which carries no transaction id).
    pub fn is_commit(&self) -> bool {
        self.tsn.is_none() || self.flags.is_some_and(|f| f & FLAG_COMMIT != 0)
    }
}

/// One row: its header and its body (a whole MessagePack map, None when the row has none).
#[derive(Debug, Clone, PartialEq)]
pub struct Row<'a> {
    pub header: RowHeader,
    pub body: Option<&'a [u8]>,
}

/// Reads the next row of `r`: a header map, then a body map unless the input ends there or the
/// row is a NOP, which has none (in a file the next row's header follows it, as Tarantool's
/// own reader assumes). Every value is checked before it is used; nesting beyond `MAX_DEPTH`
/// is refused.
pub fn decode_row<'a>(r: &mut Reader<'a>) -> Result<Row<'a>, DecodeError> {
    let header = decode_header(r)?;
    let body = if r.is_empty() || header.kind == super::codes::NOP {
        None
    } else {
        let at = r.position();
        let raw = r.read_raw_value(MAX_DEPTH)?;
        if raw.first().is_none_or(|&m| !is_map(m)) {
            return Err(DecodeError::UnexpectedMarker {
                offset: at,
                marker: raw.first().copied().unwrap_or(0),
                expected: "row body map",
            });
        }
        Some(raw)
    };
    Ok(Row { header, body })
}

fn is_map(marker: u8) -> bool {
    matches!(marker, 0x80..=0x8f | 0xde | 0xdf)
}

fn decode_header(r: &mut Reader<'_>) -> Result<RowHeader, DecodeError> {
    let mut h = RowHeader::default();
    let n = r.read_map_len()?;
    for _ in 0..n {
        let key = r.read_uint()?;
        match key {
            0x00 => h.kind = narrow(r, "request type")?,
            0x01 => h.sync = Some(r.read_uint()?),
            0x02 => h.replica_id = Some(narrow(r, "replica id")?),
            0x03 => h.lsn = Some(r.read_uint()?),
            0x04 => {
                let at = r.position();
                h.timestamp = Some(match r.read_value()? {
                    Value::F64(f) => f,
                    Value::F32(f) => f64::from(f),
                    Value::UInt(n) => n as f64,
                    Value::Int(n) => n as f64,
                    _ => {
                        return Err(DecodeError::UnexpectedMarker {
                            offset: at,
                            marker: 0,
                            expected: "timestamp (a number)",
                        })
                    }
                })
            }
            0x05 => h.schema_version = Some(r.read_uint()?),
            0x07 => h.group_id = Some(narrow(r, "group id")?),
            0x08 => h.tsn = Some(r.read_uint()?),
            0x09 => h.flags = Some(r.read_uint()?),
            _ => r.skip_value(MAX_DEPTH)?,
        }
    }
    // The wire and the files carry a row's distance from its transaction's first row.
    if let (Some(distance), Some(lsn)) = (h.tsn, h.lsn) {
        h.tsn = Some(
            lsn.checked_sub(distance)
                .ok_or(DecodeError::UnexpectedMarker {
                    offset: r.position(),
                    marker: 0,
                    expected: "transaction id at or below the row's LSN",
                })?,
        );
    }
    Ok(h)
}

fn narrow(r: &mut Reader<'_>, what: &'static str) -> Result<u32, DecodeError> {
    let at = r.position();
    let n = r.read_uint()?;
    u32::try_from(n).map_err(|_| DecodeError::UnexpectedMarker {
        offset: at,
        marker: 0xcf,
        expected: what,
    })
}

/// A request type's name as Tarantool's `xlog` module prints it.
pub fn type_name(kind: u32) -> Option<&'static str> {
    Some(match kind {
        0 => "OK",
        1 => "SELECT",
        2 => "INSERT",
        3 => "REPLACE",
        4 => "UPDATE",
        5 => "DELETE",
        6 => "CALL_16",
        7 => "AUTH",
        8 => "EVAL",
        9 => "UPSERT",
        10 => "CALL",
        11 => "EXECUTE",
        12 => "NOP",
        13 => "PREPARE",
        30 => "RAFT",
        31 => "RAFT_PROMOTE",
        32 => "RAFT_DEMOTE",
        40 => "RAFT_CONFIRM",
        41 => "RAFT_ROLLBACK",
        64 => "PING",
        65 => "JOIN",
        66 => "SUBSCRIBE",
        67 => "VOTE_DEPRECATED",
        68 => "VOTE",
        69 => "FETCH_SNAPSHOT",
        70 => "REGISTER",
        _ => return None,
    })
}

/// A body key's name as Tarantool 2.6's `xlog` module prints it (iproto_key_strs).
pub fn body_key_name(key: u64) -> Option<&'static str> {
    Some(match key {
        0x10 => "space_id",
        0x11 => "index_id",
        0x12 => "limit",
        0x13 => "offset",
        0x14 => "iterator",
        0x15 => "index_base",
        0x20 => "key",
        0x21 => "tuple",
        0x22 => "function_name",
        0x23 => "user_name",
        0x24 => "instance_uuid",
        0x25 => "cluster_uuid",
        0x26 => "vclock",
        0x27 => "expression",
        0x28 => "operations",
        0x29 => "ballot",
        0x2a => "tuple_meta",
        0x2b => "options",
        0x30 => "data",
        0x31 => "error",
        0x52 => "error",
        0x53 => "term",
        _ => return None,
    })
}

impl Row<'_> {
    /// The row as one JSON object, as Tarantool's `xlog` module shows it: HEADER with `type`
    /// (by name, or its number), `sync`, `replica_id`, `lsn`, `timestamp`, `schema_version`,
    /// `group_id`, `tsn` and, from the flags, `commit`, `wait_sync`, `wait_ack` when set; BODY
    /// with the body's keys by name (or number) and their values as JSON.
    pub fn write_json(&self, out: &mut String) -> Result<(), DecodeError> {
        let h = &self.header;
        out.push_str("{\"HEADER\":{\"type\":");
        match type_name(h.kind) {
            Some(name) => write_string(out, name),
            None => write!(out, "{}", h.kind).expect("writing to a String"),
        }
        let mut field = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                write!(out, ",\"{name}\":{v}").expect("writing to a String");
            }
        };
        field("sync", h.sync.map(|v| v.to_string()));
        field("replica_id", h.replica_id.map(|v| v.to_string()));
        field("lsn", h.lsn.map(|v| v.to_string()));
        field(
            "timestamp",
            h.timestamp
                .filter(|t| t.is_finite())
                .map(|t| format!("{t:?}")),
        );
        field("schema_version", h.schema_version.map(|v| v.to_string()));
        field("group_id", h.group_id.map(|v| v.to_string()));
        field("tsn", h.tsn.map(|v| v.to_string()));
        let flags = h.flags.unwrap_or(0);
        for (bit, name) in [
            (FLAG_COMMIT, "commit"),
            (FLAG_WAIT_SYNC, "wait_sync"),
            (FLAG_WAIT_ACK, "wait_ack"),
        ] {
            field(name, (flags & bit != 0).then(|| "true".to_string()));
        }
        out.push('}');
        if let Some(body) = self.body {
            out.push_str(",\"BODY\":{");
            let mut r = Reader::new(body);
            let n = r.read_map_len()?;
            for i in 0..n {
                if i > 0 {
                    out.push(',');
                }
                let at = r.position();
                match r.read_value()? {
                    Value::UInt(k) => match body_key_name(k) {
                        Some(name) => write_string(out, name),
                        None => write!(out, "\"{k}\"").expect("writing to a String"),
                    },
                    _ => {
                        return Err(DecodeError::UnexpectedMarker {
                            offset: at,
                            marker: body.get(at).copied().unwrap_or(0),
                            expected: "body key (an unsigned integer)",
                        })
                    }
                }
                out.push(':');
                write_json(&mut r, out, MAX_DEPTH)?;
            }
            out.push('}');
        }
        out.push('}');
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(row: &Row<'_>) -> String {
        let mut out = String::new();
        row.write_json(&mut out).unwrap();
        out
    }

    #[test]
    fn rows_read_as_tarantools_xlog_module_shows_them() {
        // {type: INSERT, replica_id: 1, lsn: 58, timestamp: 1.5, tsn: 58 - 1, flags: COMMIT}
        // {space_id: 512, tuple: [101, "b"]}
        let bytes = b"\x86\x00\x02\x02\x01\x03\x3a\x04\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x08\x01\x09\x01\x82\x10\xcd\x02\x00\x21\x92\x65\xa1b";
        let mut r = Reader::new(bytes);
        let row = decode_row(&mut r).unwrap();
        assert!(r.is_empty());
        assert_eq!(row.header.lsn, Some(58));
        assert!(row.header.is_commit());
        assert_eq!(
            json(&row),
            r#"{"HEADER":{"type":"INSERT","replica_id":1,"lsn":58,"timestamp":1.5,"tsn":57,"commit":true},"BODY":{"space_id":512,"tuple":[101,"b"]}}"#
        );
    }

    #[test]
    fn a_row_of_a_longer_transaction_is_not_its_commit() {
        // The first row of a transaction: tsn 57 - 0.
        let bytes = b"\x83\x00\x02\x03\x39\x08\x00\x80";
        let row = decode_row(&mut Reader::new(bytes)).unwrap();
        assert!(!row.header.is_commit());
        assert_eq!(
            json(&row),
            r#"{"HEADER":{"type":"INSERT","lsn":57,"tsn":57},"BODY":{}}"#
        );
        let past = b"\x83\x00\x02\x03\x01\x08\x02\x80";
        assert!(
            decode_row(&mut Reader::new(past)).is_err(),
            "a transaction before LSN 0"
        );
    }

    #[test]
    fn a_nop_has_no_body_and_the_next_row_follows() {
        // {type: NOP, lsn: 7} then {type: INSERT, lsn: 8} {space_id: 512}
        let bytes = b"\x82\x00\x0c\x03\x07\x82\x00\x02\x03\x08\x81\x10\xcd\x02\x00";
        let mut r = Reader::new(bytes);
        let nop = decode_row(&mut r).unwrap();
        assert_eq!((nop.header.kind, nop.body), (12, None));
        let insert = decode_row(&mut r).unwrap();
        assert_eq!(insert.header.lsn, Some(8));
        assert!(insert.body.is_some() && r.is_empty());
    }

    #[test]
    fn malformed_rows_are_errors() {
        for bad in [
            &b"\x91\x00"[..],                                // a header that is no map
            b"\x81\x00\xa1x",                                // a type that is no integer
            b"\x81\x02\xcf\xff\xff\xff\xff\xff\xff\xff\xff", // a replica id past u32
            b"\x81\x00\x02\x91\x01",                         // a body that is no map
            b"\x82\x00\x02",                                 // truncated
        ] {
            assert!(decode_row(&mut Reader::new(bad)).is_err(), "{bad:?}");
        }
    }
}
