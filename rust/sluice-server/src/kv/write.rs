//! The write commands: SET, ADD, REPLACE, DELETE, INCR, DECR, APPEND, PREPEND, TOUCH, GAT,
//! FLUSH and a TAP feed's messages. Each write is answered once the WAL holds it, or held
//! until its durability level is met (`Flow::Hold`).

use std::sync::Arc;

use super::reply::{error_frame, status_for, HeldReply, Reply};
use super::{wrong_vbucket, Flow, Framing, KvSession};
use sluice_core::bucket::Bucket;
use sluice_core::{Error, MutationResult, Requirement, StoreMode, StoreRequest, Written};
use sluice_proto::mcbp::{self, opcode as op, status, Request};

impl KvSession {
    /// Answers a write: at once when the WAL writing it is all its level asks (the connection
    /// waits for that before it sends), held until it settles otherwise. `ok` writes the
    /// success reply; a quiet command's success has none.
    pub(super) fn answer_write<T: Send + Sync + 'static>(
        &mut self,
        bucket: &Arc<Bucket>,
        w: Written<T>,
        reply: &mut Reply<'_>,
        quiet: bool,
        ok: impl FnOnce(&Self, &mut Reply<'_>, &T),
    ) -> Flow {
        self.owed_lsn = self.owed_lsn.max(w.lsn());
        if !w.needs_settling() {
            if !quiet {
                ok(self, reply, &w.value);
            }
            return Flow::Continue;
        }
        let mut done = Vec::new();
        if !quiet {
            ok(
                self,
                &mut Reply {
                    out: &mut done,
                    req: reply.req,
                    map: reply.map,
                },
                &w.value,
            );
        }
        let (opcode, opaque, xerror) = (reply.req.opcode, reply.req.opaque, self.features.xerror);
        let engine = self.ctx.engine.clone();
        let bucket = bucket.clone();
        let map = self.map_source();
        Flow::Hold(HeldReply(Box::pin(async move {
            let timeout = engine.settle_timeout(&bucket, &w);
            let timer = tokio::time::sleep(timeout);
            match engine.settled(&bucket, w, timer).await {
                Ok(_) => done,
                Err(e) => {
                    let mut out = Vec::new();
                    error_frame(
                        &mut out,
                        opcode,
                        opaque,
                        status_for(&e, xerror),
                        &e.to_string(),
                        xerror,
                        &*map,
                    );
                    out
                }
            }
        })))
    }

    pub(super) fn seqno_extras(&self, m: &MutationResult) -> Vec<u8> {
        if !self.features.mutation_seqno {
            return Vec::new();
        }
        let mut x = Vec::with_capacity(16);
        x.extend_from_slice(&m.vbucket_uuid.to_be_bytes());
        x.extend_from_slice(&m.seqno.to_be_bytes());
        x
    }

    pub(super) fn mutation_reply(&self, reply: &mut Reply<'_>, m: &MutationResult) {
        let extras = self.seqno_extras(m);
        reply.send(status::SUCCESS, m.cas, &extras, &[], &[], 0);
    }

    /// SET, ADD, REPLACE and their quiet forms.
    pub(super) fn store(
        &mut self,
        req: &Request<'_>,
        framing: Framing,
        reply: &mut Reply<'_>,
    ) -> Flow {
        let quiet = op::is_quiet(req.opcode);
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        let Some((flags, expiry)) = mcbp::store_extras(req.extras) else {
            einval!(reply, xerror, "SET, ADD and REPLACE take 8 bytes of extras")
        };
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        let mode = match req.opcode {
            op::SET | op::SETQ => StoreMode::Set,
            op::ADD | op::ADDQ => StoreMode::Add,
            _ => StoreMode::Replace,
        };
        if mode == StoreMode::Add && req.cas != 0 {
            einval!(reply, xerror, "ADD takes no CAS");
        }
        if req.datatype & sluice_proto::xattr::DATATYPE_XATTR != 0
            && !super::subdoc::xattrs_readable(req.value)
        {
            einval!(
                reply,
                xerror,
                "the datatype says the value starts with extended attributes, which do not read \
                 (keys of 1 to 15 bytes, JSON values, 1 MiB at most)"
            );
        }
        let r = StoreRequest {
            key: req.key,
            value: req.value,
            flags,
            expiry,
            datatype: req.datatype & sluice_core::item::DATATYPE_CLIENT_BITS,
            cas: req.cas,
            mode,
            durability: framing.durability,
            preserve_expiry: framing.preserve_ttl,
        };
        match engine.write_store(&bucket, &r) {
            Ok(w) => self.answer_write(&bucket, w, reply, quiet, |s, r, m| s.mutation_reply(r, m)),
            // memcached: ADD on an existing key and REPLACE of a missing one are NOT_STORED
            // only in the text protocol; the binary protocol says EEXISTS / ENOENT.
            Err(e) => fail!(reply, xerror, e),
        }
    }

    /// DELETE and DELETEQ.
    pub(super) fn delete(
        &mut self,
        req: &Request<'_>,
        durability: Option<Requirement>,
        reply: &mut Reply<'_>,
    ) -> Flow {
        let quiet = op::is_quiet(req.opcode);
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        if !req.extras.is_empty() || !req.value.is_empty() {
            einval!(reply, xerror, "DELETE takes a key only");
        }
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        match engine.write_delete(&bucket, req.key, req.cas, durability) {
            Ok(w) => {
                self.answer_write(&bucket, w, reply, quiet, |s, r, m| {
                    // memcached answers a DELETE with CAS 0 (its conformance checker
                    // insists); Couchbase-aware clients (MUTATION_SEQNO) get the
                    // tombstone's CAS.
                    if s.features.mutation_seqno {
                        s.mutation_reply(r, m)
                    } else {
                        r.ok()
                    }
                })
            }
            Err(e) => fail!(reply, xerror, e),
        }
    }

    /// INCR and DECR and their quiet forms.
    pub(super) fn arithmetic(
        &mut self,
        req: &Request<'_>,
        durability: Option<Requirement>,
        reply: &mut Reply<'_>,
    ) -> Flow {
        let quiet = op::is_quiet(req.opcode);
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        let Some((delta, initial, expiry)) = mcbp::arithmetic_extras(req.extras) else {
            einval!(reply, xerror, "INCR and DECR take 20 bytes of extras")
        };
        if !req.value.is_empty() {
            einval!(reply, xerror, "INCR and DECR take no value");
        }
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        let inc = matches!(req.opcode, op::INCREMENT | op::INCREMENTQ);
        match engine.write_arithmetic(
            &bucket, req.key, delta, initial, expiry, inc, req.cas, durability,
        ) {
            Ok(w) => self.answer_write(&bucket, w, reply, quiet, |s, r, (m, n)| {
                let extras = s.seqno_extras(m);
                r.send(status::SUCCESS, m.cas, &extras, &[], &n.to_be_bytes(), 0);
            }),
            Err(e) => fail!(reply, xerror, e),
        }
    }

    /// APPEND and PREPEND and their quiet forms.
    pub(super) fn concat(
        &mut self,
        req: &Request<'_>,
        durability: Option<Requirement>,
        reply: &mut Reply<'_>,
    ) -> Flow {
        let quiet = op::is_quiet(req.opcode);
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        if !req.extras.is_empty() {
            einval!(reply, xerror, "APPEND and PREPEND take no extras");
        }
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        let at_end = matches!(req.opcode, op::APPEND | op::APPENDQ);
        match engine.write_concat(&bucket, req.key, req.value, at_end, req.cas, durability) {
            Ok(w) => self.answer_write(&bucket, w, reply, quiet, |s, r, m| s.mutation_reply(r, m)),
            Err(e) => fail!(reply, xerror, e),
        }
    }

    /// TOUCH, GAT and GATQ.
    pub(super) fn touch(
        &mut self,
        req: &Request<'_>,
        durability: Option<Requirement>,
        reply: &mut Reply<'_>,
    ) -> Flow {
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        let Some(expiry) = mcbp::expiry_extras(req.extras) else {
            einval!(reply, xerror, "TOUCH and GAT take 4 bytes of extras")
        };
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        match engine.write_touch(&bucket, req.key, expiry, durability) {
            Ok(w) => {
                return self.answer_write(&bucket, w, reply, false, |s, r, (m, it)| {
                    if r.req.opcode == op::TOUCH {
                        r.send(status::SUCCESS, m.cas, &[], &[], &[], 0)
                    } else {
                        r.send(
                            status::SUCCESS,
                            m.cas,
                            &it.meta.flags.to_be_bytes(),
                            &[],
                            it.body(),
                            s.datatype(it.meta.datatype),
                        )
                    }
                })
            }
            Err(Error::NotFound) if req.opcode == op::GATQ => {}
            Err(e) => fail!(reply, xerror, e),
        }
        Flow::Continue
    }

    /// FLUSH and FLUSHQ.
    pub(super) fn flush(&mut self, req: &Request<'_>, reply: &mut Reply<'_>) -> Flow {
        let quiet = op::is_quiet(req.opcode);
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        match req.extras.len() {
            0 => {}
            4 if mcbp::expiry_extras(req.extras) == Some(0) => {}
            4 => {
                reply.error(
                    status::NOT_SUPPORTED,
                    "delayed flush is not supported",
                    xerror,
                );
                return Flow::Continue;
            }
            _ => einval!(reply, xerror, "FLUSH takes no extras or 4 bytes"),
        }
        match engine.write_flush(&bucket) {
            Ok(w) => self.answer_write(&bucket, w, reply, quiet, |_, r, _| r.ok()),
            Err(e) => fail!(reply, xerror, e),
        }
    }
}
