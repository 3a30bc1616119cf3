//! The read commands: GET and its forms, and GET_ALL_VB_SEQNOS (shared with DCP connections).

use super::reply::Reply;
use super::{wrong_vbucket, Flow, KvSession};
use sluice_core::bucket::Bucket;
use sluice_core::item::ItemMeta;
use sluice_core::Error;
use sluice_proto::mcbp::{opcode as op, status, Request};

/// GET_ALL_VB_SEQNOS's value, for the kv session and DCP connections alike: (u16 vbucket,
/// u64 high seqno) for each vbucket in the state the extras name (4 bytes: 1 active .. 4 dead),
/// the active ones without extras. Err: the EINVAL message.
/// The vbucket state GET_ALL_VB_SEQNOS asks for: none (active) or 4 bytes of state code.
pub fn wanted_state(extras: &[u8]) -> Result<sluice_core::vbucket::VbState, &'static str> {
    use sluice_core::vbucket::VbState;
    match *extras {
        [] => Ok(VbState::Active),
        [a, b, c, d] => VbState::from_code(u32::from_be_bytes([a, b, c, d]))
            .ok_or("no such vbucket state (1 active, 2 replica, 3 pending, 4 dead)"),
        _ => Err("GET_ALL_VB_SEQNOS takes no extras or a 4-byte state"),
    }
}

pub fn all_vb_seqnos(
    engine: &sluice_core::Engine,
    bucket: &Bucket,
    extras: &[u8],
) -> Result<Vec<u8>, &'static str> {
    let wanted = wanted_state(extras)?;
    let mut value = Vec::new();
    for (vb, high) in engine.high_seqnos(bucket).into_iter().enumerate() {
        if engine.vbucket_state(bucket, vb as u16) == Some(wanted) {
            value.extend_from_slice(&(vb as u16).to_be_bytes());
            value.extend_from_slice(&high.to_be_bytes());
        }
    }
    Ok(value)
}

impl KvSession {
    /// Reads: GET, GETK, their quiet forms and GET_REPLICA.
    pub(super) fn get(&mut self, req: &Request<'_>, reply: &mut Reply<'_>) -> Flow {
        let quiet = op::is_quiet(req.opcode);
        let xerror = self.features.xerror;
        let engine = &self.ctx.engine;
        let bucket = self.bucket.clone();
        if !req.extras.is_empty() || !req.value.is_empty() {
            einval!(reply, xerror, "GET takes a key only");
        }
        if wrong_vbucket(req, &bucket) {
            fail!(reply, xerror, Error::NotMyVbucket(req.vbucket));
        }
        let key = if matches!(req.opcode, op::GETK | op::GETKQ | op::GET_REPLICA) {
            req.key
        } else {
            &[]
        };
        let session = &*self;
        // Written from where the item is stored (a replica's read copies it out first).
        let mut send = |value: &[u8], meta: &ItemMeta| {
            let datatype = session.datatype(meta.datatype);
            let value = sluice_proto::xattr::body(value, meta.datatype);
            reply.send(
                status::SUCCESS,
                meta.cas,
                &meta.flags.to_be_bytes(),
                key,
                value,
                datatype,
            );
        };
        let found = if req.opcode == op::GET_REPLICA {
            engine
                .get_replica(&bucket, req.key)
                .map(|found| found.map(|it| send(it.value(), &it.meta)))
        } else {
            engine.get_with(&bucket, req.key, send)
        };
        match found {
            Ok(Some(())) => {}
            Ok(None) if quiet => {}
            Ok(None) => {
                let key = if req.opcode == op::GETK { req.key } else { &[] };
                reply.send(status::KEY_ENOENT, 0, &[], key, b"Not found", 0);
            }
            Err(e) => fail!(reply, xerror, e),
        }
        Flow::Continue
    }
}
