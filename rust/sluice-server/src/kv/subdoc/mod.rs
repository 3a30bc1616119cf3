//! Couchbase's sub-document commands on the wire: single-path lookups and mutations
//! (0xc5-0xcf, 0xd2) and the multi-path MULTI_LOOKUP (0xd0) / MULTI_MUTATION (0xd1), decoded
//! here and run by `ops` on the document parsed as JSON (`path` parses the paths).
//!
//! A mutation is one read-modify-write under the key's vbucket lock (`Engine::write_document`),
//! so it is atomic and checks the client's CAS and any lock like other writes; a failing spec
//! of a multi-mutation changes nothing. Extended attributes (`document`), user and system ones,
//! are kept at the front of the value (datatype XATTR) and reached by paths flagged XATTR; the
//! virtual `$document`, `$vbucket` and `$XTOC` are answered from the item. Macros expand to
//! the write's own CAS, seqno and body CRC32C. The doc flags reach deleted documents
//! (AccessDeleted), create one deleted with its attributes (CreateAsDeleted) and bring one
//! back (ReviveDocument), as Couchbase's transactions use them.

mod document;
mod error;
mod ops;
mod path;

use sluice_core::hlc::now_secs;
use sluice_core::item::{absolute_expiry, ItemMeta};
use sluice_core::{DocumentUpdate, Error, Update};

use crate::kv::Framing;
use sluice_proto::mcbp::subdoc::{
    DOC_ACCESS_DELETED, DOC_ADD, DOC_CREATE_AS_DELETED, DOC_MKDOC, DOC_REVIVE_DOCUMENT, MAX_SPECS,
    PATH_EXPAND_MACROS, PATH_MKDIR_P, PATH_XATTR,
};
use sluice_proto::mcbp::{opcode as op, status, Request};

use super::reply::Reply;
use super::{wrong_vbucket, Flow, KvSession};
use document::{Document, Expanded};
use error::SubdocError;
use ops::Mutation;
use path::Segment;

/// One path command of a request: a single-path command's, or one spec of a multi command.
#[derive(Debug, Clone, Copy)]
struct Spec<'a> {
    opcode: u8,
    flags: u8,
    path: &'a [u8],
    value: &'a [u8],
}

impl Spec<'_> {
    fn xattr(&self) -> bool {
        self.flags & PATH_XATTR != 0
    }
}

/// A decoded request: its specs, doc flags and expiry (mutations only).
struct Command<'a> {
    specs: Vec<Spec<'a>>,
    doc_flags: u8,
    expiry: Option<u32>,
    multi: bool,
    mutation: bool,
}

/// A request refused as a whole: its status and why.
type Refusal = (u16, &'static str);

fn be16(b: &[u8]) -> usize {
    u16::from_be_bytes([b[0], b[1]]) as usize
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn is_lookup(opcode: u8) -> bool {
    matches!(
        opcode,
        op::GET | op::SUBDOC_GET | op::SUBDOC_EXISTS | op::SUBDOC_GET_COUNT
    )
}

fn mutation_of(opcode: u8) -> Option<Mutation> {
    Some(match opcode {
        op::SUBDOC_DICT_ADD => Mutation::DictAdd,
        op::SUBDOC_DICT_UPSERT => Mutation::DictUpsert,
        op::SUBDOC_DELETE => Mutation::Delete,
        op::SUBDOC_REPLACE => Mutation::Replace,
        op::SUBDOC_ARRAY_PUSH_LAST => Mutation::PushLast,
        op::SUBDOC_ARRAY_PUSH_FIRST => Mutation::PushFirst,
        op::SUBDOC_ARRAY_INSERT => Mutation::Insert,
        op::SUBDOC_ARRAY_ADD_UNIQUE => Mutation::AddUnique,
        op::SUBDOC_COUNTER => Mutation::Counter,
        _ => return None,
    })
}

/// Decodes a request's extras and body into specs, checking every length before using it.
fn decode<'a>(req: &Request<'a>) -> Result<Command<'a>, Refusal> {
    const EINVAL: u16 = status::EINVAL;
    let (specs, doc_flags, expiry, multi, mutation) =
        match req.opcode {
            op::SUBDOC_MULTI_LOOKUP => {
                let doc_flags = match *req.extras {
                    [] => 0,
                    [f] => f,
                    _ => return Err((EINVAL, "MULTI_LOOKUP takes no extras or a doc flags byte")),
                };
                let mut specs = Vec::new();
                let mut rest = req.value;
                while !rest.is_empty() {
                    if rest.len() < 4 {
                        return Err((EINVAL, "a lookup spec is cut short"));
                    }
                    let path_len = be16(&rest[2..4]);
                    let end = 4 + path_len;
                    if rest.len() < end {
                        return Err((EINVAL, "a lookup spec's path runs past the body"));
                    }
                    if specs.len() == MAX_SPECS {
                        return Err((status::SUBDOC_INVALID_COMBO, "more than 16 specs"));
                    }
                    specs.push(Spec {
                        opcode: rest[0],
                        flags: rest[1],
                        path: &rest[4..end],
                        value: &[],
                    });
                    rest = &rest[end..];
                }
                (specs, doc_flags, None, true, false)
            }
            op::SUBDOC_MULTI_MUTATION => {
                let (expiry, doc_flags) =
                    match *req.extras {
                        [] => (None, 0),
                        [f] => (None, f),
                        [a, b, c, d] => (Some(be32(&[a, b, c, d])), 0),
                        [a, b, c, d, f] => (Some(be32(&[a, b, c, d])), f),
                        _ => return Err((
                            EINVAL,
                            "MULTI_MUTATION takes 0, 1, 4 or 5 bytes of extras (expiry, doc flags)",
                        )),
                    };
                let mut specs = Vec::new();
                let mut rest = req.value;
                while !rest.is_empty() {
                    if rest.len() < 8 {
                        return Err((EINVAL, "a mutation spec is cut short"));
                    }
                    let path_len = be16(&rest[2..4]);
                    let value_len = be32(&rest[4..8]) as usize;
                    let end = 8usize
                        .checked_add(path_len)
                        .and_then(|n| n.checked_add(value_len))
                        .filter(|&n| n <= rest.len())
                        .ok_or((EINVAL, "a mutation spec's path or value runs past the body"))?;
                    if specs.len() == MAX_SPECS {
                        return Err((status::SUBDOC_INVALID_COMBO, "more than 16 specs"));
                    }
                    specs.push(Spec {
                        opcode: rest[0],
                        flags: rest[1],
                        path: &rest[8..8 + path_len],
                        value: &rest[8 + path_len..end],
                    });
                    rest = &rest[end..];
                }
                (specs, doc_flags, expiry, true, true)
            }
            single => {
                let mutation = !is_lookup(single);
                let (path_len, flags, expiry, doc_flags) =
                    match *req.extras {
                        [a, b, f] => (be16(&[a, b]), f, None, 0),
                        [a, b, f, d] => (be16(&[a, b]), f, None, d),
                        [a, b, f, e0, e1, e2, e3] if mutation => {
                            (be16(&[a, b]), f, Some(be32(&[e0, e1, e2, e3])), 0)
                        }
                        [a, b, f, e0, e1, e2, e3, d] if mutation => {
                            (be16(&[a, b]), f, Some(be32(&[e0, e1, e2, e3])), d)
                        }
                        _ => return Err((
                            EINVAL,
                            "a sub-document command takes 3 or 4 bytes of extras (7 or 8 with an \
                         expiry for a mutation)",
                        )),
                    };
                if path_len > req.value.len() {
                    return Err((EINVAL, "the path runs past the body"));
                }
                let spec = Spec {
                    opcode: single,
                    flags,
                    path: &req.value[..path_len],
                    value: &req.value[path_len..],
                };
                (vec![spec], doc_flags, expiry, false, mutation)
            }
        };
    let command = Command {
        specs,
        doc_flags,
        expiry,
        multi,
        mutation,
    };
    validate(&command)?;
    Ok(command)
}

/// The checks of a whole request: opcodes its kind allows, flags, their combinations and
/// order (extended attributes first).
fn validate(c: &Command<'_>) -> Result<(), Refusal> {
    const EINVAL: u16 = status::EINVAL;
    if c.specs.is_empty() {
        return Err((status::SUBDOC_INVALID_COMBO, "no specs"));
    }
    let known =
        DOC_MKDOC | DOC_ADD | DOC_ACCESS_DELETED | DOC_CREATE_AS_DELETED | DOC_REVIVE_DOCUMENT;
    if c.doc_flags & !known != 0 {
        return Err((EINVAL, "unknown doc flags"));
    }
    if c.doc_flags & (DOC_CREATE_AS_DELETED | DOC_REVIVE_DOCUMENT) != 0 && !c.mutation {
        return Err((
            EINVAL,
            "CreateAsDeleted and ReviveDocument are for mutations",
        ));
    }
    if c.doc_flags & DOC_REVIVE_DOCUMENT != 0
        && (c.doc_flags & DOC_ACCESS_DELETED == 0 || c.doc_flags & DOC_CREATE_AS_DELETED != 0)
    {
        return Err((
            EINVAL,
            "ReviveDocument needs AccessDeleted and excludes CreateAsDeleted",
        ));
    }
    if c.doc_flags & (DOC_MKDOC | DOC_ADD) == DOC_MKDOC | DOC_ADD {
        return Err((EINVAL, "the MKDOC and ADD doc flags exclude each other"));
    }
    if !c.mutation && c.doc_flags & (DOC_MKDOC | DOC_ADD) != 0 {
        return Err((EINVAL, "MKDOC and ADD are for mutations"));
    }
    let mut body_seen = false;
    for s in &c.specs {
        let allowed = if !c.mutation {
            // Whole-document GET (0x00) only inside a multi-lookup.
            is_lookup(s.opcode) && (c.multi || s.opcode != op::GET)
        } else if c.multi {
            mutation_of(s.opcode).is_some()
                || matches!(
                    s.opcode,
                    op::SET | op::DELETE | op::SUBDOC_REPLACE_BODY_WITH_XATTR
                )
        } else {
            mutation_of(s.opcode).is_some() || s.opcode == op::SUBDOC_REPLACE_BODY_WITH_XATTR
        };
        if !allowed {
            return Err((
                status::SUBDOC_INVALID_COMBO,
                "a spec's command does not belong in this request",
            ));
        }
        if s.flags & !(PATH_MKDIR_P | PATH_XATTR | PATH_EXPAND_MACROS) != 0 {
            return Err((EINVAL, "unknown path flags"));
        }
        if s.flags & PATH_EXPAND_MACROS != 0 && !s.xattr() {
            return Err((
                status::SUBDOC_XATTR_INVALID_FLAG_COMBO,
                "EXPAND_MACROS is for extended attribute paths",
            ));
        }
        if !c.mutation && s.flags & PATH_MKDIR_P != 0 {
            return Err((EINVAL, "MKDIR_P is for mutations"));
        }
        if matches!(s.opcode, op::GET | op::SET | op::DELETE) && !s.path.is_empty() {
            return Err((EINVAL, "a whole-document command takes an empty path"));
        }
        if s.xattr() && body_seen {
            return Err((
                status::SUBDOC_INVALID_XATTR_ORDER,
                "extended attribute specs come before the document's",
            ));
        }
        body_seen |= !s.xattr();
        if s.opcode == op::SUBDOC_REPLACE_BODY_WITH_XATTR && !s.xattr() {
            return Err((
                status::EINVAL,
                "REPLACE_BODY_WITH_XATTR takes an extended attribute's path",
            ));
        }
        if c.mutation && s.opcode == op::DELETE && c.specs.len() > 1 {
            return Err((
                status::NOT_SUPPORTED,
                "a whole-document delete is supported as the only spec",
            ));
        }
    }
    Ok(())
}

/// Whether a value a client stores with the XATTR datatype starts with extended attributes
/// that sub-document commands can read: keys of 1 to 15 bytes of UTF-8, values JSON, within
/// their size limit.
pub(in crate::kv) fn xattrs_readable(value: &[u8]) -> bool {
    Document::read(value, sluice_proto::xattr::DATATYPE_XATTR).is_ok()
}

/// The virtual extended attributes Couchbase computes from an item's metadata.
fn virtual_xattr(
    name: &str,
    m: &ItemMeta,
    doc: &mut Document,
    deleted: bool,
    vbucket_uuid: u64,
) -> Result<serde_json::Value, SubdocError> {
    use serde_json::json;
    Ok(match name {
        "$document" => {
            let mut datatype = vec![if m.datatype & 0x01 != 0 {
                "json"
            } else {
                "raw"
            }];
            if m.datatype & 0x02 != 0 {
                datatype.push("snappy");
            }
            if m.datatype & sluice_proto::xattr::DATATYPE_XATTR != 0 {
                datatype.push("xattr");
            }
            let body = doc.body();
            json!({
                "CAS": format!("0x{:016x}", m.cas),
                "vbucket_uuid": format!("0x{vbucket_uuid:016x}"),
                "seqno": format!("0x{:016x}", m.by_seqno),
                "revid": m.rev_seqno.to_string(),
                "exptime": if deleted { 0 } else { m.expiry },
                "value_bytes": body.len(),
                "value_crc32c": document::crc_text(body),
                "flags": m.flags,
                "deleted": deleted,
                "last_modified": (m.cas / 1_000_000_000).to_string(),
                "datatype": datatype,
            })
        }
        "$vbucket" => json!({"HLC": {"now": now_secs().to_string(), "mode": "real"}}),
        "$XTOC" => json!(doc.attr_keys()),
        _ => return Err(SubdocError::UnknownVattr),
    })
}

impl KvSession {
    /// Every sub-document command.
    pub(in crate::kv) fn subdoc(
        &mut self,
        req: &Request<'_>,
        framing: Framing,
        reply: &mut Reply<'_>,
    ) -> Flow {
        let xerror = self.features.xerror;
        let command = match decode(req) {
            Ok(c) => c,
            Err((st, why)) => {
                reply.error(st, why, xerror);
                return Flow::Continue;
            }
        };
        if wrong_vbucket(req, &self.bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        if command.mutation {
            self.subdoc_mutate(req, &command, framing, reply)
        } else {
            self.subdoc_lookup(req, &command, reply)
        }
    }

    fn subdoc_lookup(&mut self, req: &Request<'_>, c: &Command<'_>, reply: &mut Reply<'_>) -> Flow {
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        let (item, deleted) = match engine.get(&bucket, req.key) {
            Ok(Some(it)) => (it, false),
            Ok(None) if c.doc_flags & DOC_ACCESS_DELETED != 0 => {
                // A tombstone, with the extended attributes it kept (a document that expired
                // was made one by the read above).
                match engine.get_tombstone(&bucket, req.key) {
                    Ok(Some(it)) => (it, true),
                    Ok(None) => fail!(reply, xerror, Error::NotFound),
                    Err(e) => fail!(reply, xerror, e),
                }
            }
            Ok(None) => fail!(reply, xerror, Error::NotFound),
            Err(e) => fail!(reply, xerror, e),
        };
        let mut doc = match Document::read(item.value(), item.meta.datatype) {
            Ok(d) => d,
            Err(e) => {
                reply.error(e.status(), e.message(), xerror);
                return Flow::Continue;
            }
        };
        let uuid = engine
            .vbucket_uuid(&bucket, bucket.vbucket_of(req.key))
            .unwrap_or(0);
        let mut results: Vec<Result<Vec<u8>, SubdocError>> = Vec::with_capacity(c.specs.len());
        for s in &c.specs {
            let r = (|| -> Result<Vec<u8>, SubdocError> {
                if s.opcode == op::GET {
                    // A deleted document's body, or an empty one, is no document to read.
                    let body = doc.body();
                    if body.is_empty() {
                        return Err(SubdocError::PathEnoent);
                    }
                    return Ok(body.to_vec());
                }
                let path = path::parse(s.path)?;
                let target;
                let (found, rest): (&serde_json::Value, &[Segment]) = if s.xattr() {
                    let Some((Segment::Key(name), rest)) = path.split_first() else {
                        return Err(SubdocError::PathEinval);
                    };
                    if name.starts_with('$') {
                        target = virtual_xattr(name, &item.meta, &mut doc, deleted, uuid)?;
                        (&target, rest)
                    } else {
                        (&doc.attrs, &path[..])
                    }
                } else {
                    if path.is_empty() && s.opcode != op::SUBDOC_GET_COUNT {
                        return Err(SubdocError::PathEinval);
                    }
                    (doc.body_value()?, &path[..])
                };
                match s.opcode {
                    op::SUBDOC_GET => Ok(serde_json::to_vec(ops::find(found, rest)?)
                        .expect("a JSON value serializes")),
                    op::SUBDOC_EXISTS => ops::find(found, rest).map(|_| Vec::new()),
                    _ => ops::count(found, rest).map(|n| n.to_string().into_bytes()),
                }
            })();
            results.push(r);
        }
        let cas = item.meta.cas;
        if !c.multi {
            match results.pop().expect("one spec") {
                Err(e) => reply.error(e.status(), e.message(), xerror),
                Ok(value) => {
                    let st = if deleted {
                        status::SUBDOC_SUCCESS_DELETED
                    } else {
                        status::SUCCESS
                    };
                    let datatype = if req.opcode == op::SUBDOC_GET {
                        self.datatype(0x01)
                    } else {
                        0
                    };
                    reply.send(st, cas, &[], &[], &value, datatype);
                }
            }
            return Flow::Continue;
        }
        let all_ok = results.iter().all(|r| r.is_ok());
        let st = match (all_ok, deleted) {
            (true, false) => status::SUCCESS,
            (true, true) => status::SUBDOC_SUCCESS_DELETED,
            (false, false) => status::SUBDOC_MULTI_PATH_FAILURE,
            (false, true) => status::SUBDOC_MULTI_PATH_FAILURE_DELETED,
        };
        let mut body = Vec::new();
        for r in &results {
            let (st, value) = match r {
                Ok(v) => (status::SUCCESS, v.as_slice()),
                Err(e) => (e.status(), &[][..]),
            };
            body.extend_from_slice(&st.to_be_bytes());
            body.extend_from_slice(&(value.len() as u32).to_be_bytes());
            body.extend_from_slice(value);
        }
        reply.send(st, cas, &[], &[], &body, 0);
        Flow::Continue
    }

    fn subdoc_mutate(
        &mut self,
        req: &Request<'_>,
        c: &Command<'_>,
        framing: Framing,
        reply: &mut Reply<'_>,
    ) -> Flow {
        let durability = framing.durability;
        let xerror = self.features.xerror;
        let engine = self.ctx.engine.clone();
        let bucket = self.bucket.clone();
        let flag = |f: u8| c.doc_flags & f != 0;
        let (mkdoc, add) = (flag(DOC_MKDOC), flag(DOC_ADD));
        let (access_deleted, create_deleted, revive) = (
            flag(DOC_ACCESS_DELETED),
            flag(DOC_CREATE_AS_DELETED),
            flag(DOC_REVIVE_DOCUMENT),
        );
        if add && req.cas != 0 {
            einval!(reply, xerror, "the ADD doc flag takes no CAS");
        }
        if c.specs[0].opcode == op::DELETE {
            // The whole document, alone (see `validate`).
            return match engine.write_delete(&bucket, req.key, req.cas, durability) {
                Ok(w) => {
                    self.answer_write(&bucket, w, reply, false, |s, r, m| s.mutation_reply(r, m))
                }
                Err(e) => fail!(reply, xerror, e),
            };
        }
        // Paths parse before the document is read; a bad one fails its spec.
        let mut paths = Vec::with_capacity(c.specs.len());
        for (i, s) in c.specs.iter().enumerate() {
            match path::parse(s.path) {
                Ok(p) => paths.push(p),
                Err(e) => return self.spec_failed(reply, c.multi, i, e),
            }
        }
        let now = now_secs();
        let mut failed: Option<(usize, SubdocError)> = None;
        let mut values: Vec<(usize, Vec<u8>)> = Vec::new();
        let written = engine.write_document(
            &bucket,
            req.key,
            req.cas,
            durability,
            access_deleted,
            |cur, landing| {
                let abort = |failed: &mut Option<(usize, SubdocError)>, i, e| {
                    *failed = Some((i, e));
                    Err(Error::InvalidArgument("a sub-document spec failed".into()))
                };
                let was_deleted = cur.is_some_and(|it| it.meta.deleted);
                let (mut doc, flags, deleted) =
                    match cur {
                        Some(_) if add => return Err(Error::Exists),
                        Some(_) if revive && !was_deleted => {
                            return abort(&mut failed, 0, SubdocError::CanOnlyReviveDeleted);
                        }
                        Some(it) => match Document::read(it.value(), it.meta.datatype) {
                            Ok(d) => (d, it.meta.flags, was_deleted && !revive),
                            Err(e) => return abort(&mut failed, 0, e),
                        },
                        None if revive => return Err(Error::NotFound),
                        None if create_deleted => (Document::deleted(), 0, true),
                        None if mkdoc || add => {
                            let first = c.specs.iter().zip(&paths).find(|(s, _)| !s.xattr()).map(
                                |(s, p)| (mutation_of(s.opcode).unwrap_or(Mutation::DictUpsert), p),
                            );
                            let body = match first {
                                Some((m, p)) => ops::empty_doc_for(m, p),
                                None => serde_json::json!({}),
                            };
                            (Document::new(body), 0, false)
                        }
                        None => return Err(Error::NotFound),
                    };
                // PreserveTTL: an existing document keeps its expiry.
                let kept = cur
                    .filter(|it| framing.preserve_ttl && !it.meta.deleted)
                    .map(|it| it.meta.expiry);
                let mut crc_paths: Vec<&[Segment]> = Vec::new();
                for (i, (s, p)) in c.specs.iter().zip(&paths).enumerate() {
                    let r = if s.xattr() {
                        match p.first() {
                            Some(Segment::Key(name)) if name.starts_with('$') => {
                                if matches!(name.as_str(), "$document" | "$vbucket" | "$XTOC") {
                                    Err(SubdocError::CantModifyVattr)
                                } else {
                                    Err(SubdocError::UnknownVattr)
                                }
                            }
                            Some(Segment::Key(name)) => document::check_key(name).and_then(|()| {
                                if s.opcode == op::SUBDOC_REPLACE_BODY_WITH_XATTR {
                                    let v = ops::find(&doc.attrs, p)?;
                                    let raw = serde_json::to_vec(v).expect("JSON serializes");
                                    doc.set_body(raw);
                                    return Ok(None);
                                }
                                let m = mutation_of(s.opcode).expect("validated");
                                let mkdir = s.flags & PATH_MKDIR_P != 0;
                                let value = if s.flags & PATH_EXPAND_MACROS != 0 {
                                    match document::expand(s.value, landing)? {
                                        Expanded::Value(v) => v,
                                        // Written where a dictionary key names it, once the
                                        // body is final; an array position cannot be named
                                        // again afterwards.
                                        Expanded::BodyCrc => {
                                            let keyed = matches!(p.last(), Some(Segment::Key(_)));
                                            let sets = matches!(
                                                m,
                                                Mutation::DictAdd
                                                    | Mutation::DictUpsert
                                                    | Mutation::Replace
                                            );
                                            if !(keyed && sets) {
                                                return Err(SubdocError::XattrEinval);
                                            }
                                            crc_paths.push(p);
                                            b"null".to_vec()
                                        }
                                    }
                                } else {
                                    s.value.to_vec()
                                };
                                ops::mutate(&mut doc.attrs, m, p, &value, mkdir)
                            }),
                            _ => Err(SubdocError::PathEinval),
                        }
                    } else if s.opcode == op::SET {
                        doc.set_body(s.value.to_vec());
                        Ok(None)
                    } else if deleted {
                        // A document that stays deleted has no body to change.
                        Err(SubdocError::DeletedCantHaveValue)
                    } else {
                        let m = mutation_of(s.opcode).expect("validated");
                        let mkdir = s.flags & PATH_MKDIR_P != 0 || mkdoc || add;
                        doc.body_mut()
                            .and_then(|body| ops::mutate(body, m, p, s.value, mkdir))
                    };
                    match r {
                        Ok(Some(v)) => values.push((i, v)),
                        Ok(None) => {}
                        Err(e) => return abort(&mut failed, i, e),
                    }
                }
                if !crc_paths.is_empty() {
                    let crc = serde_json::to_vec(&document::crc_text(doc.body()))
                        .expect("a string serializes");
                    for p in crc_paths {
                        // A later spec may have removed it: then there is nothing to fill.
                        let _ = ops::mutate(&mut doc.attrs, Mutation::Replace, p, &crc, false);
                    }
                }
                if deleted && doc.body_changed && !doc.body().is_empty() {
                    return abort(&mut failed, 0, SubdocError::DeletedCantHaveValue);
                }
                let (value, datatype) = doc.write();
                if datatype & sluice_proto::xattr::DATATYPE_XATTR != 0
                    && sluice_proto::xattr::split(&value)
                        .is_ok_and(|(_, body)| value.len() - body.len() > document::MAX_XATTR_BYTES)
                {
                    return abort(&mut failed, 0, SubdocError::DocTooBig);
                }
                Ok(DocumentUpdate {
                    update: Update {
                        value,
                        flags,
                        // As Couchbase's: a mutation that gives no expiry leaves the document
                        // none.
                        expiry: kept
                            .unwrap_or_else(|| c.expiry.map_or(0, |e| absolute_expiry(e, now))),
                        datatype,
                    },
                    deleted,
                })
            },
        );
        if let Some((i, e)) = failed {
            if e.is_document_level() {
                reply.error(e.status(), e.message(), self.features.xerror);
                return Flow::Continue;
            }
            return self.spec_failed(reply, c.multi, i, e);
        }
        let multi = c.multi;
        match written {
            Ok(w) => self.answer_write(&bucket.clone(), w, reply, false, move |s, r, (m, it)| {
                let extras = s.seqno_extras(m);
                let st = if it.meta.deleted {
                    status::SUBDOC_SUCCESS_DELETED
                } else {
                    status::SUCCESS
                };
                let mut body = Vec::new();
                if multi {
                    for (i, v) in &values {
                        body.push(*i as u8);
                        body.extend_from_slice(&status::SUCCESS.to_be_bytes());
                        body.extend_from_slice(&(v.len() as u32).to_be_bytes());
                        body.extend_from_slice(v);
                    }
                    r.send(st, m.cas, &extras, &[], &body, 0);
                } else {
                    let value = values.first().map(|(_, v)| v.as_slice()).unwrap_or(&[]);
                    let datatype = if value.is_empty() {
                        0
                    } else {
                        s.datatype(0x01)
                    };
                    r.send(st, m.cas, &extras, &[], value, datatype);
                }
            }),
            Err(e) => fail!(reply, xerror, e),
        }
    }

    /// A spec that failed: a single command answers with its status; a multi-mutation with
    /// SUBDOC_MULTI_PATH_FAILURE and the failing spec's index and status.
    fn spec_failed(
        &self,
        reply: &mut Reply<'_>,
        multi: bool,
        index: usize,
        e: SubdocError,
    ) -> Flow {
        if multi {
            let mut body = vec![index as u8];
            body.extend_from_slice(&e.status().to_be_bytes());
            reply.send(status::SUBDOC_MULTI_PATH_FAILURE, 0, &[], &[], &body, 0);
        } else {
            reply.error(e.status(), e.message(), self.features.xerror);
        }
        Flow::Continue
    }
}
