//! The error map GET_ERROR_MAP (0xfe) answers: every status sluice sends, and those Couchbase's
//! clients meet on the commands sluice is growing (locking, collections, sub-document), each
//! with the attributes that tell a client what to do with a status it does not know (Couchbase's
//! ErrorMap.md: `temp`, `retry-now`, `item-only`, `fetch-config`, ...) and, where retrying is
//! right, how to retry. Clients refuse to bootstrap without a map holding `version`,
//! `revision` and `errors`, keyed by the status in lowercase hex.

/// How a client retries a status (ErrorMap.md's `retry` object, times in milliseconds).
#[derive(Debug, Clone, Copy)]
pub struct Retry {
    /// "constant", "linear" or "exponential".
    pub strategy: &'static str,
    /// The first wait, and the step for linear and exponential.
    pub interval: u32,
    /// Wait this long before the first retry.
    pub after: u32,
    /// The longest single wait.
    pub ceil: u32,
    /// Give up after retrying this long.
    pub max_duration: u32,
}

#[derive(Debug, Clone, Copy)]
pub struct ErrorInfo {
    pub status: u16,
    pub name: &'static str,
    pub desc: &'static str,
    pub attrs: &'static [&'static str],
    pub retry: Option<Retry>,
}

/// The highest error map version served.
pub const VERSION: u16 = 2;
/// Raised whenever an entry changes, so clients can tell maps apart.
pub const REVISION: u16 = 1;

/// A write that another one holds up settles within milliseconds: back off from 10 ms.
const SOON: Retry = Retry {
    strategy: "exponential",
    interval: 10,
    after: 0,
    ceil: 500,
    max_duration: 10_000,
};
/// A temporary failure (a vbucket being handed over, memory being freed, a WAL behind).
const TEMPORARY: Retry = Retry {
    strategy: "exponential",
    interval: 5,
    after: 0,
    ceil: 1_000,
    max_duration: 30_000,
};
/// A vbucket that moved: after fetching the new map, retry at once and often.
const MOVED: Retry = Retry {
    strategy: "constant",
    interval: 100,
    after: 0,
    ceil: 100,
    max_duration: 30_000,
};
/// A lock lasts up to its timeout (15 s by default, 30 s at most).
const LOCK_HELD: Retry = Retry {
    strategy: "linear",
    interval: 100,
    after: 0,
    ceil: 1_000,
    max_duration: 30_000,
};

const fn e(
    status: u16,
    name: &'static str,
    desc: &'static str,
    attrs: &'static [&'static str],
) -> ErrorInfo {
    ErrorInfo {
        status,
        name,
        desc,
        attrs,
        retry: None,
    }
}

const fn r(
    status: u16,
    name: &'static str,
    desc: &'static str,
    attrs: &'static [&'static str],
    retry: Retry,
) -> ErrorInfo {
    ErrorInfo {
        status,
        name,
        desc,
        attrs,
        retry: Some(retry),
    }
}

/// Every entry, by status.
pub const ERRORS: &[ErrorInfo] = &[
    e(0x00, "SUCCESS", "Success", &["success"]),
    e(0x01, "KEY_ENOENT", "Not found", &["item-only"]),
    e(
        0x02,
        "KEY_EEXISTS",
        "The key exists already, or the CAS did not match",
        &["item-only"],
    ),
    e(
        0x03,
        "E2BIG",
        "The value (or the request) is too large",
        &["item-only", "invalid-input"],
    ),
    e(
        0x04,
        "EINVAL",
        "Invalid request",
        &["internal", "invalid-input"],
    ),
    e(0x05, "NOT_STORED", "Not stored", &["internal", "item-only"]),
    e(
        0x06,
        "DELTA_BADVAL",
        "The document is not a number",
        &["item-only", "invalid-input"],
    ),
    r(
        0x07,
        "NOT_MY_VBUCKET",
        "This node does not serve the vbucket; the reply carries the current cluster map",
        &["fetch-config", "invalid-input"],
        MOVED,
    ),
    e(
        0x08,
        "NO_BUCKET",
        "No such bucket, or none selected",
        &["conn-state-invalidated"],
    ),
    r(
        0x09,
        "LOCKED",
        "The document is locked",
        &["item-locked", "item-only", "retry-now"],
        LOCK_HELD,
    ),
    e(
        0x0e,
        "NOT_LOCKED",
        "The document is not locked",
        &["item-only"],
    ),
    e(
        0x1f,
        "AUTH_STALE",
        "Authenticate again",
        &["conn-state-invalidated", "auth"],
    ),
    e(
        0x20,
        "AUTH_ERROR",
        "Authentication failed",
        &["conn-state-invalidated", "auth"],
    ),
    e(
        0x21,
        "AUTH_CONTINUE",
        "Continue the authentication exchange",
        &["special-handling"],
    ),
    e(
        0x22,
        "ERANGE",
        "Invalid range requested",
        &["invalid-input"],
    ),
    e(
        0x23,
        "ROLLBACK",
        "Roll back the stream to the seqno given",
        &["dcp", "special-handling"],
    ),
    e(
        0x24,
        "EACCESS",
        "The user lacks the permission for this command",
        &["support"],
    ),
    e(
        0x80,
        "UNKNOWN_FRAME_INFO",
        "Unknown frame info",
        &["support"],
    ),
    e(0x81, "UNKNOWN_COMMAND", "Unknown command", &["support"]),
    r(
        0x82,
        "ENOMEM",
        "Out of memory for the item; try later",
        &["temp", "retry-later"],
        TEMPORARY,
    ),
    e(
        0x83,
        "NOT_SUPPORTED",
        "Not supported by this server",
        &["support"],
    ),
    e(
        0x84,
        "EINTERNAL",
        "Internal error; reconnect",
        &["internal", "conn-state-invalidated"],
    ),
    r(
        0x85,
        "EBUSY",
        "Busy; try again",
        &["temp", "retry-now"],
        TEMPORARY,
    ),
    r(
        0x86,
        "ETMPFAIL",
        "Temporary failure (a vbucket being handed over, memory being freed); try again",
        &["temp", "retry-now"],
        TEMPORARY,
    ),
    e(
        0x87,
        "XATTR_EINVAL",
        "Invalid extended attribute request (sluice keeps no user extended attributes)",
        &["invalid-input", "item-only"],
    ),
    e(
        0x88,
        "UNKNOWN_COLLECTION",
        "Unknown collection",
        &["invalid-input"],
    ),
    e(0x8c, "UNKNOWN_SCOPE", "Unknown scope", &["invalid-input"]),
    e(
        0xa0,
        "DurabilityInvalidLevel",
        "Invalid durability level",
        &["invalid-input"],
    ),
    e(
        0xa1,
        "DurabilityImpossible",
        "Too few replicas follow the vbucket to meet the durability level",
        &["item-only", "invalid-input"],
    ),
    r(
        0xa2,
        "SyncWriteInProgress",
        "A durable write to the key is in progress",
        &["item-only", "retry-later"],
        SOON,
    ),
    e(
        0xa3,
        "SyncWriteAmbiguous",
        "The durable write did not settle in time: it may or may not be applied",
        &["item-only"],
    ),
    r(
        0xa4,
        "SyncWriteReCommitInProgress",
        "A durable write to the key is being committed again",
        &["item-only", "retry-later"],
        SOON,
    ),
    e(
        0xa5,
        "RangeScanCancelled",
        "The range scan was cancelled",
        &["item-only"],
    ),
    e(
        0xa6,
        "RangeScanMore",
        "The range scan stopped at a limit: continue it for more",
        &["success"],
    ),
    e(
        0xa7,
        "RangeScanComplete",
        "The range scan reached its end",
        &["success"],
    ),
    e(
        0xa8,
        "VbUuidNotEqual",
        "The range scan's snapshot names another vbucket uuid",
        &["invalid-input"],
    ),
    e(
        0xc0,
        "SUBDOC_PATH_ENOENT",
        "Sub-document: path not found",
        &["subdoc", "item-only"],
    ),
    e(
        0xc1,
        "SUBDOC_PATH_MISMATCH",
        "Sub-document: the path and the document disagree on structure",
        &["subdoc", "item-only"],
    ),
    e(
        0xc2,
        "SUBDOC_PATH_EINVAL",
        "Sub-document: invalid path",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xc3,
        "SUBDOC_PATH_E2BIG",
        "Sub-document: path too long",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xc4,
        "SUBDOC_PATH_E2DEEP",
        "Sub-document: path too deep",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xc5,
        "SUBDOC_VALUE_CANTINSERT",
        "Sub-document: the value cannot be inserted",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xc6,
        "SUBDOC_DOC_NOTJSON",
        "Sub-document: the document is not JSON",
        &["subdoc", "item-only"],
    ),
    e(
        0xc7,
        "SUBDOC_NUM_ERANGE",
        "Sub-document: the number is out of range",
        &["subdoc", "item-only"],
    ),
    e(
        0xc8,
        "SUBDOC_DELTA_EINVAL",
        "Sub-document: invalid delta",
        &["subdoc", "item-only"],
    ),
    e(
        0xc9,
        "SUBDOC_PATH_EEXISTS",
        "Sub-document: the path exists already",
        &["subdoc", "item-only"],
    ),
    e(
        0xca,
        "SUBDOC_VALUE_ETOODEEP",
        "Sub-document: the value is (or would make the document) too deep",
        &["subdoc", "invalid-input", "item-only"],
    ),
    e(
        0xcb,
        "SUBDOC_INVALID_COMBO",
        "Sub-document: lookups and mutations in one request",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xcc,
        "SUBDOC_MULTI_PATH_FAILURE",
        "Sub-document: some paths failed; each has its status in the reply",
        &["subdoc", "special-handling"],
    ),
    e(
        0xcd,
        "SUBDOC_SUCCESS_DELETED",
        "Sub-document: success on a deleted document",
        &["item-deleted", "success", "subdoc"],
    ),
    e(
        0xce,
        "SUBDOC_XATTR_INVALID_FLAG_COMBO",
        "Sub-document: invalid combination of flags",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xcf,
        "SUBDOC_XATTR_INVALID_KEY_COMBO",
        "Sub-document: invalid combination of extended attribute keys",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xd0,
        "SUBDOC_XATTR_UNKNOWN_MACRO",
        "Sub-document: unknown macro",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xd1,
        "SUBDOC_XATTR_UNKNOWN_VATTR",
        "Sub-document: unknown virtual attribute",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xd2,
        "SUBDOC_XATTR_CANT_MODIFY_VATTR",
        "Sub-document: virtual attributes cannot be modified",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xd3,
        "SUBDOC_MULTI_PATH_FAILURE_DELETED",
        "Sub-document: some paths failed on a deleted document",
        &["item-deleted", "subdoc", "special-handling"],
    ),
    e(
        0xd4,
        "SUBDOC_INVALID_XATTR_ORDER",
        "Sub-document: extended attribute paths must come first",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xd5,
        "SUBDOC_XATTR_UNKNOWN_VATTR_MACRO",
        "Sub-document: unknown virtual attribute macro",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xd6,
        "SUBDOC_CAN_ONLY_REVIVE_DELETED_DOCUMENTS",
        "Sub-document: only a deleted document can be revived",
        &["subdoc", "invalid-input"],
    ),
    e(
        0xd7,
        "SUBDOC_DELETED_DOCUMENT_CANT_HAVE_VALUE",
        "Sub-document: a deleted document cannot have a body",
        &["subdoc", "invalid-input"],
    ),
];

/// The entry of a status, if the map has one.
pub fn lookup(status: u16) -> Option<&'static ErrorInfo> {
    ERRORS.iter().find(|e| e.status == status)
}

/// The map as JSON, in the highest version not above `asked` (1 or 2; both share one layout,
/// version 2 adding attributes version 1 clients skip). None: version 0, which no client asks.
pub fn json(asked: u16) -> Option<String> {
    let version = asked.min(VERSION);
    if version == 0 {
        return None;
    }
    let mut out = format!("{{\"version\":{version},\"revision\":{REVISION},\"errors\":{{");
    for (i, e) in ERRORS.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Names, descriptions and attributes are plain ASCII without quotes or backslashes.
        out.push_str(&format!(
            "\"{:x}\":{{\"name\":\"{}\",\"desc\":\"{}\",\"attrs\":[",
            e.status, e.name, e.desc
        ));
        let attrs: Vec<String> = e.attrs.iter().map(|a| format!("\"{a}\"")).collect();
        out.push_str(&attrs.join(","));
        out.push(']');
        if let Some(r) = e.retry {
            out.push_str(&format!(
                ",\"retry\":{{\"strategy\":\"{}\",\"interval\":{},\"after\":{},\"ceil\":{},\
                 \"max-duration\":{}}}",
                r.strategy, r.interval, r.after, r.ceil, r.max_duration
            ));
        }
        out.push('}');
    }
    out.push_str("}}");
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_unique_sorted_and_plain() {
        for w in ERRORS.windows(2) {
            assert!(
                w[0].status < w[1].status,
                "{:#x} then {:#x}",
                w[0].status,
                w[1].status
            );
        }
        for e in ERRORS {
            for s in [e.name, e.desc].iter().chain(e.attrs) {
                assert!(s.bytes().all(|b| b.is_ascii_graphic() || b == b' '), "{s}");
                assert!(!s.contains('"') && !s.contains('\\'), "{s}");
            }
        }
    }

    #[test]
    fn versions_answer_the_highest_not_above_the_asked() {
        assert!(json(0).is_none());
        assert!(json(1).unwrap().starts_with("{\"version\":1,"));
        assert!(json(2).unwrap().starts_with("{\"version\":2,"));
        assert!(json(9).unwrap().starts_with("{\"version\":2,"));
    }

    #[test]
    fn every_status_sluice_names_is_in_the_map() {
        use crate::mcbp::status::*;
        for s in [
            SUCCESS,
            KEY_ENOENT,
            KEY_EEXISTS,
            E2BIG,
            EINVAL,
            NOT_STORED,
            DELTA_BADVAL,
            NOT_MY_VBUCKET,
            NO_BUCKET,
            AUTH_STALE,
            AUTH_ERROR,
            AUTH_CONTINUE,
            ERANGE,
            ROLLBACK,
            EACCESS,
            UNKNOWN_FRAME_INFO,
            UNKNOWN_COMMAND,
            ENOMEM,
            NOT_SUPPORTED,
            EINTERNAL,
            EBUSY,
            ETMPFAIL,
            XATTR_EINVAL,
            UNKNOWN_COLLECTION,
            UNKNOWN_SCOPE,
            DURABILITY_INVALID_LEVEL,
            DURABILITY_IMPOSSIBLE,
            SYNC_WRITE_IN_PROGRESS,
            SYNC_WRITE_AMBIGUOUS,
            RANGE_SCAN_CANCELLED,
            RANGE_SCAN_MORE,
            RANGE_SCAN_COMPLETE,
            VBUUID_NOT_EQUAL,
        ] {
            assert!(
                lookup(s).is_some(),
                "status {s:#x} is missing from the error map"
            );
        }
    }
}
