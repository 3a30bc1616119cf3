//! Couchbase's item commands beside plain GET: GET_META (what an SDK's `exists` asks),
//! GET_LOCKED and UNLOCK_KEY (pessimistic locking; the engine keeps the locks).

use super::reply::Reply;
use super::{wrong_vbucket, Flow, KvSession};
use sluice_core::Error;
use sluice_proto::mcbp::{opcode as op, status, Request};

/// GET_META's reply flag for a deleted item (kv_engine's GET_META_ITEM_DELETED_FLAG).
const DELETED: u32 = 0x01;

impl KvSession {
    /// GET_META and GETQ_META: extras of 0 bytes or a version byte (1; 2 adds the datatype to
    /// the reply). The reply's extras: deleted (u32), flags (u32), expiry (u32, a tombstone's
    /// delete time), revision seqno (u64) [, datatype (u8)]; the CAS in the header. A tombstone
    /// answers with deleted 1, as Couchbase does (an SDK's `exists` says false); a key unknown
    /// here is KEY_ENOENT (GETQ_META: nothing).
    pub(super) fn get_meta(&mut self, req: &Request<'_>, reply: &mut Reply<'_>) -> Flow {
        let xerror = self.features.xerror;
        let bucket = self.bucket.clone();
        let with_datatype = match *req.extras {
            [] | [1] => false,
            [2] => true,
            _ => einval!(
                reply,
                xerror,
                "GET_META takes no extras or a version byte (1 or 2)"
            ),
        };
        if !req.value.is_empty() {
            einval!(reply, xerror, "GET_META takes no value");
        }
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        match self.ctx.engine.metadata(&bucket, req.key) {
            Ok(Some(m)) => {
                let mut extras = Vec::with_capacity(21);
                let deleted = if m.deleted { DELETED } else { 0 };
                extras.extend_from_slice(&deleted.to_be_bytes());
                extras.extend_from_slice(&m.flags.to_be_bytes());
                extras.extend_from_slice(&m.expiry.to_be_bytes());
                extras.extend_from_slice(&m.rev_seqno.to_be_bytes());
                if with_datatype {
                    extras.push(m.datatype & sluice_core::item::DATATYPE_CLIENT_BITS);
                }
                reply.send(status::SUCCESS, m.cas, &extras, &[], &[], 0);
            }
            Ok(None) if req.opcode == op::GETQ_META => {}
            Ok(None) => fail!(reply, xerror, Error::NotFound),
            Err(e) => fail!(reply, xerror, e),
        }
        Flow::Continue
    }

    /// GET_LOCKED: extras of 0 bytes or the lock time (u32 seconds; 0 or over 30 means 15, as
    /// Couchbase). Answers like GET, with the lock's CAS; a key locked already is LOCKED
    /// (TMPFAIL without XERROR).
    pub(super) fn get_locked(&mut self, req: &Request<'_>, reply: &mut Reply<'_>) -> Flow {
        let xerror = self.features.xerror;
        let bucket = self.bucket.clone();
        let secs = match *req.extras {
            [] => 0,
            [a, b, c, d] => u32::from_be_bytes([a, b, c, d]),
            _ => einval!(
                reply,
                xerror,
                "GET_LOCKED takes no extras or 4 bytes (lock time)"
            ),
        };
        if !req.value.is_empty() {
            einval!(reply, xerror, "GET_LOCKED takes no value");
        }
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        match self.ctx.engine.get_locked(&bucket, req.key, secs) {
            Ok(it) => reply.send(
                status::SUCCESS,
                it.meta.cas,
                &it.meta.flags.to_be_bytes(),
                &[],
                it.body(),
                self.datatype(it.meta.datatype),
            ),
            Err(e) => fail!(reply, xerror, e),
        }
        Flow::Continue
    }

    /// UNLOCK_KEY: the key and the lock's CAS. A key not locked is NOT_LOCKED, another CAS
    /// LOCKED (both TMPFAIL without XERROR, as Couchbase).
    pub(super) fn unlock(&mut self, req: &Request<'_>, reply: &mut Reply<'_>) -> Flow {
        let xerror = self.features.xerror;
        let bucket = self.bucket.clone();
        if !req.extras.is_empty() || !req.value.is_empty() {
            einval!(reply, xerror, "UNLOCK_KEY takes a key and a CAS only");
        }
        if req.cas == 0 {
            einval!(reply, xerror, "UNLOCK_KEY needs the lock's CAS");
        }
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        match self.ctx.engine.unlock(&bucket, req.key, req.cas) {
            Ok(()) => reply.ok(),
            Err(e) => fail!(reply, xerror, e),
        }
        Flow::Continue
    }
}
