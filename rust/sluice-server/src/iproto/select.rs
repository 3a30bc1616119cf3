//! SELECT: a declared space's primary index through the engine's ordered index (iterators EQ,
//! REQ, ALL, LT, LE, GE, GT on full and partial keys, OFFSET and LIMIT), or a system view.
//! A replica node serves reads too.

use sluice_core::engine::Part;
use sluice_core::SelectIterator;
use sluice_proto::iproto::{codes, response, tuple};
use sluice_proto::msgpack::{
    write_array_len, write_bin, write_bool, write_f64, write_int, write_nil, write_str_bytes,
    write_uint, Reader, Value,
};

use super::failure::{no_such_index, Failure, Outcome};
use super::schema::View;
use super::session::Session;
use crate::auth::{READ, WRITE};

/// Nesting depth allowed inside a key part.
const MAX_DEPTH: usize = 32;

/// The iterator of an ITERATOR number; the bitset and spatial ones a TREE index has not.
pub(super) fn iterator_of(n: u32) -> Option<SelectIterator> {
    Some(match n {
        0 => SelectIterator::Eq,
        1 => SelectIterator::Req,
        2 => SelectIterator::All,
        3 => SelectIterator::Lt,
        4 => SelectIterator::Le,
        5 => SelectIterator::Ge,
        6 => SelectIterator::Gt,
        _ => return None,
    })
}

/// A key (a MessagePack array) in the one encoding the engine stores: integers and lengths
/// in their shortest form, a float that holds an integer as that integer (Tarantool's
/// number index finds 1 and 1.0 alike). Returns it with its part count.
pub(super) fn canonical_key(key: &[u8]) -> Result<(Vec<u8>, usize), Failure> {
    let bad = || Failure::new(codes::ER_INVALID_MSGPACK, "Invalid MsgPack - packet body");
    let mut r = Reader::new(key);
    let n = r.read_array_len().map_err(|_| bad())?;
    let mut out = Vec::with_capacity(key.len());
    write_array_len(&mut out, n);
    for _ in 0..n {
        let start = r.position();
        let mut probe = r.clone();
        match probe.read_value().map_err(|_| bad())? {
            Value::Nil => write_nil(&mut out),
            Value::Bool(b) => write_bool(&mut out, b),
            Value::UInt(u) => write_uint(&mut out, u),
            Value::Int(i) => write_int(&mut out, i),
            Value::F32(f) => write_float(&mut out, f64::from(f)),
            Value::F64(f) => write_float(&mut out, f),
            Value::Str(s) => write_str_bytes(&mut out, s),
            Value::Bin(b) => write_bin(&mut out, b),
            Value::Array(_) | Value::Map(_) | Value::Ext(..) => {
                r.skip_value(MAX_DEPTH).map_err(|_| bad())?;
                out.extend_from_slice(&key[start..r.position()]);
                continue;
            }
        }
        r = probe;
    }
    Ok((out, n as usize))
}

fn write_float(out: &mut Vec<u8>, f: f64) {
    if f.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&f) {
        write_uint(out, f as u64);
    } else if f.fract() == 0.0 && (-9_223_372_036_854_775_808.0..0.0).contains(&f) {
        write_int(out, f as i64);
    } else {
        write_f64(out, f);
    }
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn select(
        &mut self,
        space_id: u32,
        index_id: u32,
        limit: u32,
        offset: u32,
        iterator: u32,
        key: &[u8],
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        if self.ctx.catalog.view(space_id).is_some() {
            let catalog = self.ctx.catalog.clone();
            let view = catalog.view(space_id).expect("just found");
            return self.select_view(view, index_id, limit, offset, iterator, key, sync, out);
        }
        let space = self.space(space_id)?;
        if index_id != 0 {
            return Err(no_such_index(index_id, &space.name));
        }
        self.require(&space, READ)?;
        let Some(it) = iterator_of(iterator) else {
            return Err(unsupported_iterator(&space.name));
        };
        tuple::check_key(key, &space.parts, false)?;
        let (key, _) = canonical_key(key)?;
        let version = self.ctx.catalog.schema_version;
        if limit == 0 {
            response::DataWriter::begin(out, sync, version).finish(out);
            return Ok(());
        }
        // The reply is written as the items are read; a failed read takes it back.
        let start = out.len();
        let mut data = response::DataWriter::begin(out, sync, version);
        let engine = &self.ctx.port.engine;
        let read = if let Some(set) = self.part {
            // Another node's fanned-out SELECT: its part, the vbuckets it names.
            engine
                .select_from(&space.bucket, it, &key, offset, limit, Part::Exactly(set))
                .map(|items| {
                    for i in &items {
                        data.push_raw(out, i.value());
                    }
                })
        } else {
            engine.select_values(&space.bucket, it, &key, offset, limit, |value| {
                data.push_raw(out, value)
            })
        };
        if let Err(e) = read {
            out.truncate(start);
            return Err(super::failure::read_failure(e, &space.name));
        }
        data.finish(out);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn select_view(
        &self,
        view: &View,
        index_id: u32,
        limit: u32,
        offset: u32,
        iterator: u32,
        key: &[u8],
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let Some((_, _, parts)) = view.index(index_id) else {
            return Err(no_such_index(index_id, view.name));
        };
        let Some(it) = iterator_of(iterator) else {
            return Err(unsupported_iterator(view.name));
        };
        let (key, n) = canonical_key(key)?;
        if n > parts.len() {
            return Err(Failure::new(
                codes::ER_KEY_PART_COUNT,
                format!(
                    "Invalid key part count (expected [0..{}], got {n})",
                    parts.len()
                ),
            ));
        }
        // A space's rows show to sessions that may read or write it, as in Tarantool's views.
        let visible = |row: &super::schema::ViewRow| match &row.bucket {
            None => true,
            Some(b) => self.permissions(b) & (READ | WRITE) != 0,
        };
        let rows = view.select(parts, it, &key, n, visible);
        let mut data = response::DataWriter::begin(out, sync, self.ctx.catalog.schema_version);
        for row in rows.iter().skip(offset as usize).take(limit as usize) {
            data.push_raw(out, &row.tuple);
        }
        data.finish(out);
        Ok(())
    }

    /// The declared space `id`, or ER_NO_SUCH_SPACE.
    pub(super) fn space(&self, id: u32) -> Result<super::session::SpaceHandle, Failure> {
        match self.spaces.get(&id) {
            Some(s) => Ok(s.clone()),
            None if self.ctx.catalog.view(id).is_some() => Err(Failure::new(
                codes::ER_UNSUPPORTED,
                format!("sluice does not support writes to the system view {id}"),
            )),
            None => Err(Failure::new(
                codes::ER_NO_SUCH_SPACE,
                format!("Space '{id}' does not exist"),
            )),
        }
    }
}

fn unsupported_iterator(space: &str) -> Failure {
    Failure::new(
        codes::ER_UNSUPPORTED_INDEX_FEATURE,
        format!(
            "Index 'primary' (TREE) of space '{space}' (memtx) does not support requested \
             iterator type"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::canonical_key;

    #[test]
    fn keys_take_one_encoding() {
        // [cd 0004, 1.0 as f64, "a"] -> [4, 1, "a"]
        let mut k = vec![0x93, 0xcd, 0x00, 0x04, 0xcb];
        k.extend_from_slice(&1.0f64.to_bits().to_be_bytes());
        k.extend_from_slice(&[0xa1, b'a']);
        assert_eq!(
            canonical_key(&k).unwrap(),
            (vec![0x93, 0x04, 0x01, 0xa1, b'a'], 3)
        );
        assert!(canonical_key(&[0x92, 0x01]).is_err(), "a part missing");
        assert!(canonical_key(&[0x01]).is_err(), "not an array");
    }
}
