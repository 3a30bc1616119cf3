//! Greenstack's bucket and document requests: SELECT_BUCKET, GET, MUTATION (JSON merge patches
//! among them), DELETE and TOUCH, each checked against the user's permissions on the bucket; a
//! write is answered once it meets its durability level.

use std::sync::Arc;

use sluice_core::engine::{MutationResult, StoreMode, StoreRequest, Update};
use sluice_core::Error;
use sluice_proto::greenstack::payload::{self, Fields, MapWriter, Mutation, MutationKind};
use sluice_proto::greenstack::{opcode, status, Frame};

use super::reply::{failure, reply, status_of, write_success, ReplyTo};
use crate::auth::{READ, WRITE};

use super::session::*;

impl Session {
    pub(super) fn select_bucket(&mut self, f: &Frame<'_>, fields: &Fields<'_>) -> Vec<u8> {
        let name = match fields.required("name", Fields::str) {
            Ok(n) => n,
            Err(e) => return failure(f, status::INVALID_ARGUMENTS, &e.to_string()),
        };
        // A bucket the user may not use answers as one that does not exist.
        match self.ctx.port.engine.bucket(name) {
            Ok(b) if self.permissions(name) != 0 => {
                self.bucket = Some(Arc::new(b));
                self.perms.set(None);
                self.admin.set(None);
                reply(f, status::SUCCESS, &[])
            }
            Ok(_) | Err(_) => failure(f, status::NOT_FOUND, &format!("no bucket {name:?}")),
        }
    }

    /// The selected bucket if the user has `need` on it; else the failure to answer.
    pub(super) fn bucket_for(&self, f: &Frame<'_>, need: u8) -> Result<&BucketHandle, Vec<u8>> {
        let Some(b) = &self.bucket else {
            return Err(failure(f, status::INVALID_STATE, "select a bucket first"));
        };
        if self.selected_permissions(b) & need != need {
            return Err(failure(
                f,
                status::NO_ACCESS,
                &format!("the user lacks that permission on bucket {}", b.name()),
            ));
        }
        Ok(b)
    }

    /// GET `{id}`: the reply goes straight into `out` (the read path allocates nothing).
    pub(super) fn get(&mut self, f: &Frame<'_>, out: &mut Vec<u8>) {
        let id = match payload::get_id(f.payload) {
            Ok(id) => id,
            Err(e) => {
                return out.extend_from_slice(&failure(
                    f,
                    status::INVALID_ARGUMENTS,
                    &e.to_string(),
                ))
            }
        };
        let bucket = match self.bucket_for(f, READ) {
            Ok(b) => b,
            Err(reply) => return out.extend_from_slice(&reply),
        };
        let found = self.ctx.port.engine.get_with(bucket, id, |value, meta| {
            write_success(f, out, |p| {
                // The body, as GET answers it.
                let body = sluice_proto::xattr::body(value, meta.datatype);
                let datatype = meta.datatype & !sluice_proto::xattr::DATATYPE_XATTR;
                MapWriter::new(p, 4)
                    .bin("value", body)
                    .uint("flags", meta.flags as u64)
                    .uint("cas", meta.cas)
                    .uint("datatype", datatype as u64);
            })
        });
        match found {
            Ok(Some(())) => {}
            Ok(None) => {
                out.extend_from_slice(&failure(f, status::NOT_FOUND, "no document of that id"))
            }
            Err(e) => out.extend_from_slice(&failure(f, status_of(&e), &e.to_string())),
        }
    }

    /// MUTATION: applied now, answered once it meets its durability level.
    pub(super) fn mutation(&mut self, f: &Frame<'_>, out: &mut Vec<u8>) -> Run {
        let m = match Mutation::parse(f.payload) {
            Ok(m) => m,
            Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
        };
        let bucket = match self.bucket_for(f, WRITE) {
            Ok(b) => b,
            Err(reply) => return Run::Now(reply),
        };
        let durability = match durability_of(f, m.durability) {
            Ok(d) => d,
            Err(reply) => return Run::Now(reply),
        };
        let engine = &self.ctx.port.engine;
        let written = match m.kind {
            MutationKind::Add | MutationKind::Set | MutationKind::Replace => {
                let mode = match m.kind {
                    MutationKind::Add => StoreMode::Add,
                    MutationKind::Set => StoreMode::Set,
                    _ => StoreMode::Replace,
                };
                engine.write_store(
                    bucket,
                    &StoreRequest {
                        key: m.id,
                        value: m.value,
                        flags: m.flags,
                        expiry: m.expiration,
                        datatype: m.datatype,
                        cas: m.cas,
                        mode,
                        durability,
                        preserve_expiry: false,
                    },
                )
            }
            MutationKind::Append | MutationKind::Prepend => engine.write_concat(
                bucket,
                m.id,
                m.value,
                m.kind == MutationKind::Append,
                m.cas,
                durability,
            ),
            MutationKind::Patch => engine
                .write_update(bucket, m.id, m.cas, durability, |cur| {
                    let cur = cur.ok_or(Error::NotFound)?;
                    let value = super::patch::apply(cur.value(), m.value)
                        .map_err(Error::InvalidArgument)?;
                    Ok(Update {
                        value,
                        flags: cur.meta.flags,
                        expiry: cur.meta.expiry,
                        datatype: DATATYPE_JSON,
                    })
                })
                .map(|w| w.map(|(r, _)| r)),
        };
        self.answer_write(f, written, out)
    }

    /// DELETE `{id, cas?, durability?}` and TOUCH `{id, expiration, durability?}`.
    pub(super) fn delete_or_touch(
        &mut self,
        f: &Frame<'_>,
        fields: &Fields<'_>,
        out: &mut Vec<u8>,
    ) -> Run {
        let bucket = match self.bucket_for(f, WRITE) {
            Ok(b) => b,
            Err(reply) => return Run::Now(reply),
        };
        let parsed = (|| {
            let id = fields.required("id", Fields::bytes)?;
            let durability = fields.str("durability")?;
            Ok::<_, sluice_proto::greenstack::payload::PayloadError>((id, durability))
        })();
        let (id, durability) = match parsed {
            Ok(x) => x,
            Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
        };
        let durability = match durability_of(f, durability) {
            Ok(d) => d,
            Err(reply) => return Run::Now(reply),
        };
        let engine = &self.ctx.port.engine;
        let written = if f.opcode == opcode::DELETE {
            match fields.uint("cas") {
                Ok(cas) => engine.write_delete(bucket, id, cas.unwrap_or(0), durability),
                Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
            }
        } else {
            match fields.required("expiration", |f, n| f.uint_max(n, u32::MAX as u64)) {
                Ok(exp) => engine
                    .write_touch(bucket, id, exp as u32, durability)
                    .map(|w| w.map(|(r, _)| r)),
                Err(e) => return Run::Now(failure(f, status::INVALID_ARGUMENTS, &e.to_string())),
            }
        };
        self.answer_write(f, written, out)
    }

    /// A write's answer: `{cas, seqno, vbucket_uuid}`, written to `out` now when its level is
    /// none (sent once the WAL has it, `send`), else once it meets its durability level (on a
    /// task of its own); or its failure now.
    pub(super) fn answer_write(
        &mut self,
        f: &Frame<'_>,
        written: sluice_core::Result<sluice_core::engine::Written<MutationResult>>,
        out: &mut Vec<u8>,
    ) -> Run {
        let w = match written {
            Ok(w) => w,
            Err(e) => return Run::Now(failure(f, status_of(&e), &e.to_string())),
        };
        let (cas, seqno, uuid) = (w.value.cas, w.value.seqno, w.value.vbucket_uuid);
        let stored = move |p: &mut Vec<u8>| {
            MapWriter::new(p, 3)
                .uint("cas", cas)
                .uint("seqno", seqno)
                .uint("vbucket_uuid", uuid);
        };
        if !w.needs_settling() {
            self.owed_lsn = self.owed_lsn.max(w.lsn());
            write_success(f, out, stored);
            return Run::Now(Vec::new());
        }
        let to = ReplyTo::of(f);
        let engine = self.ctx.port.engine.clone();
        // The bucket the write was made in: the selected one (cloned only for a write that waits).
        let Some(bucket) = self.bucket.clone() else {
            return Run::Now(failure(f, status::INVALID_STATE, "select a bucket first"));
        };
        Run::Later(Box::pin(async move {
            let timer = tokio::time::sleep(engine.settle_timeout(&bucket, &w));
            match engine.settled(&bucket, w, timer).await {
                Ok(_) => (to.reply_with(status::SUCCESS, 0, stored), Login::None),
                Err(e) => (to.failure(status_of(&e), &e.to_string()), Login::None),
            }
        }))
    }
}
