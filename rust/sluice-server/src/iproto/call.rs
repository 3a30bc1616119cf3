//! CALL and EVAL: sluice runs no Lua; it answers a documented built-in set (README
//! "Tarantool's iproto"), the calls connectors make and the common introspection ones:
//!
//! - CALL `box.info` and EVAL `return box.info` / `return box.info()`: a map like Tarantool's
//!   (version, id, ro, uuid, package, listen, status, uptime, pid);
//! - CALL `box.session.user`, EVAL `return box.session.user()`: the session's user;
//! - CALL `box.space.NAME:len` / `box.space.NAME:count` / `box.space.NAME.index.INDEX:count`
//!   (args `[]`, `[key]` or `[key, {iterator = ...}]`, as net.box sends `index:count()`), and
//!   EVAL `return box.space.NAME:len()` / `:count()` / `.index.INDEX:count()`: a tuple count;
//! - EVAL `return ...`: the arguments.
//!
//! Any other CALL gets ER_NO_SUCH_PROC naming the procedure, any other EVAL ER_UNSUPPORTED
//! naming the expression.

use sluice_core::engine::Part;
use sluice_core::SelectIterator;
use sluice_proto::iproto::request::Request;
use sluice_proto::iproto::{codes, response};
use sluice_proto::msgpack::{write_bool, write_map_len, write_str, write_uint, Reader, Value};

use super::failure::{Failure, Outcome};
use super::select::{canonical_key, iterator_of};
use super::session::Session;
use crate::auth::READ;

const MAX_DEPTH: usize = 32;

/// What a built-in name asks for.
enum Builtin<'a> {
    Info,
    User,
    /// A space's tuple count (`len`, `count`, `index.primary:count`), with the index named.
    Count {
        space: &'a str,
        index: Option<&'a str>,
    },
}

fn builtin(name: &str) -> Option<Builtin<'_>> {
    match name {
        "box.info" => return Some(Builtin::Info),
        "box.session.user" => return Some(Builtin::User),
        _ => {}
    }
    let rest = name.strip_prefix("box.space.")?;
    let (path, method) = rest.rsplit_once(':')?;
    match path.split_once(".index.") {
        Some((space, index)) if method == "count" || method == "len" => Some(Builtin::Count {
            space,
            index: Some(index),
        }),
        None if method == "len" || method == "count" => Some(Builtin::Count {
            space: path,
            index: None,
        }),
        _ => None,
    }
}

/// Whether a CALL or EVAL asks for a tuple count, which a cluster sums over its nodes.
pub(super) fn is_count(req: &Request<'_>) -> bool {
    let name = match *req {
        Request::Call { name, .. } => String::from_utf8_lossy(name).into_owned(),
        Request::Eval { expr, .. } => {
            let text = String::from_utf8_lossy(expr);
            let body = text.trim().trim_end_matches(';').trim();
            match body
                .strip_prefix("return ")
                .map(str::trim)
                .and_then(|c| c.strip_suffix("()"))
            {
                Some(call) => call.to_string(),
                None => return false,
            }
        }
        _ => return false,
    };
    matches!(builtin(&name), Some(Builtin::Count { .. }))
}

impl Session {
    pub(super) fn call(
        &mut self,
        name: &[u8],
        args: &[u8],
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let text = String::from_utf8_lossy(name);
        let no_such = || {
            Failure::new(
                codes::ER_NO_SUCH_PROC,
                format!("Procedure '{text}' is not defined"),
            )
        };
        let b = builtin(&text).ok_or_else(no_such)?;
        self.run_builtin(b, args, sync, out)
    }

    pub(super) fn eval(
        &mut self,
        expr: &[u8],
        args: &[u8],
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let text = String::from_utf8_lossy(expr);
        let unsupported = || {
            Failure::new(
                codes::ER_UNSUPPORTED,
                format!(
                    "sluice does not support EVAL of '{text}' (it runs no Lua; docs/iproto.md lists the \
                     built-in expressions)"
                ),
            )
        };
        let body = text.trim().trim_end_matches(';').trim();
        let call = body
            .strip_prefix("return ")
            .map(str::trim)
            .ok_or_else(unsupported)?;
        if call == "..." {
            let mut data = response::DataWriter::begin(out, sync, self.ctx.catalog.schema_version);
            let mut r = Reader::new(args);
            let n = r.read_array_len().map_err(|_| unsupported())?;
            for _ in 0..n {
                let v = r.read_raw_value(MAX_DEPTH).map_err(|_| unsupported())?;
                data.push_raw(out, v);
            }
            data.finish(out);
            return Ok(());
        }
        let b = match call {
            "box.info" | "box.info()" => Builtin::Info,
            "box.session.user()" => Builtin::User,
            other => match other.strip_suffix("()").and_then(builtin) {
                Some(b @ Builtin::Count { .. }) => b,
                _ => return Err(unsupported()),
            },
        };
        // The EVAL forms take no arguments of their own.
        self.run_builtin(b, &[0x90], sync, out)
    }

    fn run_builtin(
        &mut self,
        b: Builtin<'_>,
        args: &[u8],
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let mut value = Vec::new();
        match b {
            Builtin::Info => self.info(&mut value),
            Builtin::User => write_str(&mut value, self.user_name()),
            Builtin::Count { space, index } => {
                let n = self.count(space, index, args)?;
                write_uint(&mut value, n);
            }
        }
        let mut data = response::DataWriter::begin(out, sync, self.ctx.catalog.schema_version);
        data.push_raw(out, &value);
        data.finish(out);
        Ok(())
    }

    fn info(&self, o: &mut Vec<u8>) {
        let ctx = &self.ctx;
        let ro = ctx.port.engine.config().replica;
        write_map_len(o, 9);
        write_str(o, "version");
        write_str(
            o,
            &format!(
                "{} (sluice {})",
                super::TARANTOOL_VERSION,
                env!("CARGO_PKG_VERSION")
            ),
        );
        write_str(o, "id");
        write_uint(o, 1);
        write_str(o, "ro");
        write_bool(o, ro);
        write_str(o, "uuid");
        write_str(o, &ctx.instance_uuid);
        write_str(o, "package");
        write_str(o, "sluice");
        write_str(o, "listen");
        write_str(o, &ctx.listen.map(|a| a.to_string()).unwrap_or_default());
        write_str(o, "status");
        write_str(o, "running");
        write_str(o, "uptime");
        write_uint(o, ctx.started.elapsed().as_secs());
        write_str(o, "pid");
        write_uint(o, u64::from(std::process::id()));
    }

    /// A space's tuples, all or those an iterator from a key reaches (`[key, {iterator}]`).
    fn count(&self, space: &str, index: Option<&str>, args: &[u8]) -> Result<u64, Failure> {
        let procedure = || {
            Failure::new(
                codes::ER_NO_SUCH_PROC,
                format!("Procedure 'box.space.{space}' is not defined"),
            )
        };
        let s = self
            .ctx
            .catalog
            .space_by_name(space)
            .cloned()
            .ok_or_else(procedure)?;
        if let Some(index) = index {
            if index != "primary" && index != "0" {
                return Err(Failure::new(
                    super::more_codes::ER_NO_SUCH_INDEX_NAME,
                    format!("No index '{index}' is defined in space '{space}'"),
                ));
            }
        }
        self.require(&s, READ)?;
        let bad = || {
            Failure::new(
                codes::ER_ILLEGAL_PARAMS,
                "Illegal parameters, usage: count([key], [{iterator = ...}])",
            )
        };
        let mut r = Reader::new(args);
        let n = r.read_array_len().map_err(|_| bad())?;
        let mut key = vec![0x90];
        let mut iterator = if n == 0 {
            SelectIterator::All
        } else {
            SelectIterator::Eq
        };
        if n >= 1 {
            let raw = r.read_raw_value(MAX_DEPTH).map_err(|_| bad())?;
            // A scalar key is a one-part key, as in Lua.
            key = if matches!(raw.first(), Some(0x90..=0x9f | 0xdc | 0xdd)) {
                raw.to_vec()
            } else {
                [&[0x91][..], raw].concat()
            };
        }
        if n >= 2 {
            let m = r.read_map_len().map_err(|_| bad())?;
            for _ in 0..m {
                let k = r.read_value().map_err(|_| bad())?;
                let v = r.read_value().map_err(|_| bad())?;
                if k == Value::Str(b"iterator") {
                    iterator = match v {
                        Value::UInt(u) => iterator_of(u as u32),
                        Value::Str(s) => iterator_named(s),
                        _ => None,
                    }
                    .ok_or_else(bad)?;
                }
            }
        }
        let (key, _) = canonical_key(&key)?;
        // In a cluster, this node's part: the nodes' parts are summed (see `route`).
        let part = match self.part {
            Some(set) => Part::Exactly(set),
            None if self.ctx.clustermap.router.routes().is_some() => Part::Active,
            None => Part::Held,
        };
        self.ctx
            .port
            .engine
            .count_from(&s.bucket, iterator, &key, part)
            .map_err(|e| super::failure::read_failure(e, &s.name))
    }
}

fn iterator_named(s: &[u8]) -> Option<SelectIterator> {
    Some(match s {
        b"EQ" => SelectIterator::Eq,
        b"REQ" => SelectIterator::Req,
        b"ALL" => SelectIterator::All,
        b"LT" => SelectIterator::Lt,
        b"LE" => SelectIterator::Le,
        b"GE" => SelectIterator::Ge,
        b"GT" => SelectIterator::Gt,
        _ => return None,
    })
}
