//! INSERT, REPLACE, UPDATE, UPSERT and DELETE on a declared space: the tuple checked against
//! the space's format, stored under its encoded primary key. The reply goes out once the
//! WAL holds the write (the connection sends nothing before that); a write whose bucket asks
//! for a durability level waits for it here, as an async wait, before its reply. A node whose
//! vbuckets are replicas (`--replica-of`) answers ER_READONLY.

use sluice_core::{Error, StoreMode, StoreRequest, Update, Written};
use sluice_proto::iproto::{codes, response, tuple, update};

use super::failure::{engine_failure, no_such_index};
use super::failure::{Failure, Outcome};
use super::schema::Space;
use super::select::canonical_key;
use super::session::Session;
use crate::auth::WRITE;

/// The longest encoded primary key: the engine's key limit.
pub const MAX_KEY: usize = 250;

/// The encoded primary key of `tuple`, in the engine's one encoding, once the tuple is checked
/// against the space's format (one pass over it for both).
pub(super) fn key_of(space: &Space, tuple: &[u8]) -> Result<Vec<u8>, Failure> {
    let raw = tuple::check_format_and_extract_key(tuple, &space.format, &space.parts)?;
    let (key, _) = canonical_key(&raw)?;
    check_key_size(&key)?;
    Ok(key)
}

fn check_key_size(key: &[u8]) -> Result<(), Failure> {
    if key.len() > MAX_KEY {
        return Err(Failure::new(
            codes::ER_ILLEGAL_PARAMS,
            format!(
                "Illegal parameters, the encoded primary key is {} bytes; sluice stores keys of at \
                 most {MAX_KEY}",
                key.len()
            ),
        ));
    }
    Ok(())
}

/// UPDATE's new tuple: the operations applied to the stored one `cur`; the result must still
/// fit the format and keep the primary key `key`.
pub(super) fn updated(
    space: &Space,
    cur: &[u8],
    ops: &[update::UpdateOp<'_>],
    key: &[u8],
) -> Result<Vec<u8>, Failure> {
    let new = update::apply_in_format(cur, ops, &space.format)?;
    if key_of(space, &new)? != key {
        return Err(Failure::new(
            codes::ER_CANT_UPDATE_PRIMARY_KEY,
            format!(
                "Attempt to modify a tuple field which is part of index 'primary' in space '{}'",
                space.name
            ),
        ));
    }
    Ok(new)
}

/// UPSERT's new tuple when the key holds `cur`: the operations applied, those that cannot
/// apply skipped (logged, naming `who` asked), as Tarantool does. A result that no longer fits
/// the format or moves the key keeps the stored tuple, as a failed UPSERT leaves Tarantool's.
/// Malformed operations are an error.
pub(super) fn upserted(
    space: &Space,
    cur: &[u8],
    ops: &[update::UpdateOp<'_>],
    key: &[u8],
    who: &dyn std::fmt::Display,
) -> Result<Vec<u8>, Failure> {
    let (new, skipped) = update::apply_upsert_in_format(cur, ops, &space.format)?;
    for e in skipped {
        log::info!(
            "UPSERT from {who} in space {}: an operation skipped: {}",
            space.name,
            e.message
        );
    }
    let fits = key_of(space, &new).is_ok_and(|k| k == key);
    if fits {
        return Ok(new);
    }
    log::info!(
        "UPSERT from {who} in space {}: the result does not fit the format; the tuple is kept",
        space.name
    );
    Ok(cur.to_vec())
}

/// What UPDATE's closure found wrong, to be answered after the engine call.
enum Refused {
    Missing,
    Tuple(Failure),
}

impl Session {
    /// Waits for a write's durability level when it has one; otherwise the reply waits for
    /// the WAL with the others (`owed_lsn`).
    async fn settle<T>(&mut self, space: &Space, w: Written<T>) -> Result<T, Failure> {
        self.owed_lsn = self.owed_lsn.max(w.lsn());
        if !w.needs_settling() {
            return Ok(w.value);
        }
        let engine = self.ctx.port.engine.clone();
        let timer = tokio::time::sleep(engine.settle_timeout(&space.bucket, &w));
        engine
            .settled(&space.bucket, w, timer)
            .await
            .map_err(|e| engine_failure(e, &space.name))
    }

    fn writable(&self, space_id: u32) -> Result<super::session::SpaceHandle, Failure> {
        let space = self.space(space_id)?;
        self.require(&space, WRITE)?;
        if self.ctx.followed.contains(&space_id) {
            return Err(Failure::new(
                codes::ER_READONLY,
                format!(
                    "Can't modify data on a read-only instance - space '{}' follows a Tarantool \
                     ([tarantool_upstream])",
                    space.name
                ),
            ));
        }
        Ok(space)
    }

    /// INSERT (`add`: ER_TUPLE_FOUND when the key exists) or REPLACE.
    pub(super) async fn store(
        &mut self,
        space_id: u32,
        tuple: &[u8],
        add: bool,
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let space = self.writable(space_id)?;
        let key = key_of(&space, tuple)?;
        let r = StoreRequest {
            mode: if add { StoreMode::Add } else { StoreMode::Set },
            ..StoreRequest::set(&key, tuple)
        };
        let w = self
            .ctx
            .port
            .engine
            .write_store(&space.bucket, &r)
            .map_err(|e| engine_failure(e, &space.name))?;
        self.settle(&space, w).await?;
        self.reply_tuples(out, sync, &[tuple]);
        Ok(())
    }

    pub(super) fn reply_tuples(&self, out: &mut Vec<u8>, sync: u64, tuples: &[&[u8]]) {
        let mut data = response::DataWriter::begin(out, sync, self.ctx.catalog.schema_version);
        for t in tuples {
            data.push_raw(out, t);
        }
        data.finish(out);
    }

    /// A point request's key: the whole primary key (ER_EXACT_MATCH otherwise).
    fn exact_key(&self, space: &Space, index_id: u32, key: &[u8]) -> Result<Vec<u8>, Failure> {
        if index_id != 0 {
            return Err(no_such_index(index_id, &space.name));
        }
        tuple::check_key(key, &space.parts, true)?;
        let (key, _) = canonical_key(key)?;
        check_key_size(&key)?;
        Ok(key)
    }

    /// UPDATE: the operations applied to the stored tuple under its vbucket's lock; the new
    /// tuple must still fit the format and keep its primary key. A missing key: `DATA []`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn update(
        &mut self,
        space_id: u32,
        index_id: u32,
        key: &[u8],
        ops: &[u8],
        index_base: u32,
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let space = self.writable(space_id)?;
        let key = self.exact_key(&space, index_id, key)?;
        let ops = update::parse_ops(ops, index_base)?;
        let mut refused = None;
        let written = self
            .ctx
            .port
            .engine
            .write_update(&space.bucket, &key, 0, None, |cur| {
                let Some(cur) = cur else {
                    refused = Some(Refused::Missing);
                    return Err(Error::NotFound);
                };
                let checked = updated(&space, cur.value(), &ops, &key);
                match checked {
                    Ok(value) => Ok(Update {
                        value,
                        flags: 0,
                        expiry: 0,
                        datatype: 0,
                    }),
                    Err(f) => {
                        refused = Some(Refused::Tuple(f));
                        Err(Error::NotStored)
                    }
                }
            });
        let w = match (written, refused) {
            (Ok(w), _) => w,
            (Err(_), Some(Refused::Missing)) => {
                self.reply_tuples(out, sync, &[]);
                return Ok(());
            }
            (Err(_), Some(Refused::Tuple(f))) => return Err(f),
            (Err(e), None) => return Err(engine_failure(e, &space.name)),
        };
        let (_, item) = self.settle(&space, w).await?;
        self.reply_tuples(out, sync, &[item.value()]);
        Ok(())
    }

    /// UPSERT: the tuple inserted when its key is missing, else the operations applied; an
    /// operation that cannot apply is skipped (logged), as Tarantool does. Always `DATA []`.
    pub(super) async fn upsert(
        &mut self,
        space_id: u32,
        tuple: &[u8],
        ops: &[u8],
        index_base: u32,
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let space = self.writable(space_id)?;
        let key = key_of(&space, tuple)?;
        let ops = update::parse_ops(ops, index_base)?;
        let peer = self.peer;
        let mut refused = None;
        let written = self
            .ctx
            .port
            .engine
            .write_update(&space.bucket, &key, 0, None, |cur| {
                let value = match cur {
                    None => tuple.to_vec(),
                    Some(cur) => match upserted(&space, cur.value(), &ops, &key, &peer) {
                        Ok(new) => new,
                        Err(f) => {
                            refused = Some(f);
                            return Err(Error::NotStored);
                        }
                    },
                };
                Ok(Update {
                    value,
                    flags: 0,
                    expiry: 0,
                    datatype: 0,
                })
            });
        let w = match (written, refused) {
            (Ok(w), _) => w,
            (Err(_), Some(f)) => return Err(f),
            (Err(e), None) => return Err(engine_failure(e, &space.name)),
        };
        self.settle(&space, w).await?;
        self.reply_tuples(out, sync, &[]);
        Ok(())
    }

    /// DELETE: answers with the deleted tuple, or `DATA []` when the key is missing.
    pub(super) async fn delete(
        &mut self,
        space_id: u32,
        index_id: u32,
        key: &[u8],
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let space = self.writable(space_id)?;
        let key = self.exact_key(&space, index_id, key)?;
        let w = self
            .ctx
            .port
            .engine
            .write_take(&space.bucket, &key, None)
            .map_err(|e| engine_failure(e, &space.name))?;
        match self.settle(&space, w).await? {
            Some((_, item)) => self.reply_tuples(out, sync, &[item.value()]),
            None => self.reply_tuples(out, sync, &[]),
        }
        Ok(())
    }
}
