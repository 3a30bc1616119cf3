//! Requests routed in a cluster (see `crate::router`): a request for one key whose vbucket is
//! active on another node goes there and its answer comes back under the client's SYNC; a
//! SELECT that is not a point read gathers every node's part and merges them.
//!
//! On the node a request is forwarded to, it runs as the user the forwarding node names
//! (`KEY_SLUICE_FORWARDED_FOR`), which a login with the `replication` permission on the
//! space's bucket may do (the nodes' replication login); it is never forwarded again.

use std::time::{Duration, Instant};

use sluice_proto::iproto::request::{self, Header, Request};
use sluice_proto::iproto::{client, codes, response};
use sluice_proto::keyorder::compare_keys;
use sluice_proto::msgpack::Reader;

use super::failure::{Failure, Outcome};
use super::forwarded::Waiting;
use super::more_codes::ER_SYSTEM;
use super::schema::Space;
use super::select::{canonical_key, iterator_of};
use super::session::{Session, SpaceHandle};
use super::write::key_of;
use crate::auth::READ;
use crate::router::iproto_link::{Replier, Reply};
use crate::router::Routes;
use sluice_core::engine::Part;
use sluice_core::vbucket::VbState;
use sluice_core::SelectIterator;

/// How long a node routed to may take to answer.
const ROUTED_TIMEOUT: Duration = Duration::from_secs(10);

/// What a request needs of the cluster.
enum Route {
    /// It runs here.
    Here,
    /// One key, active elsewhere: forwarded; a write's answer waits behind earlier writes'.
    Forward {
        space: SpaceHandle,
        vbucket: u16,
        write: bool,
    },
    /// A SELECT over every vbucket.
    FanOut { space: SpaceHandle },
    /// A tuple count (CALL or EVAL of `len`, `count`): every node's part, summed.
    Count,
}

impl Session {
    /// Routes `req` if this node is in a cluster and the request is not its own to answer:
    /// true when it was taken care of here (answered, or sent on with its answer to come).
    pub(super) async fn route(
        &mut self,
        packet: &[u8],
        header: &Header,
        req: &Request<'_>,
        out: &mut Vec<u8>,
    ) -> bool {
        if header.forwarded_for.is_some() || header.part.is_some() {
            return false;
        }
        let Some(routes) = self.ctx.clustermap.router.routes() else {
            return false;
        };
        let sync = header.sync;
        let outcome = match self.route_of(req) {
            Route::Here => return false,
            Route::Forward {
                space,
                vbucket,
                write,
            } => {
                let Some(addr) = routes.elsewhere(vbucket).and_then(|n| n.iproto) else {
                    return false;
                };
                self.forward(addr, header.code, packet, sync, write, &space)
                    .await
            }
            Route::FanOut { space } => {
                let Request::Select {
                    limit,
                    offset,
                    iterator,
                    key,
                    ..
                } = *req
                else {
                    return false;
                };
                self.fan_out(&routes, &space, iterator, key, limit, offset, sync, out)
                    .await
            }
            Route::Count => {
                self.count_everywhere(&routes, packet, header, req, out)
                    .await
            }
        };
        if let Err(f) = outcome {
            self.fail(out, sync, f);
        }
        true
    }

    /// Where `req` runs. A request this node cannot judge (a bad key, an unknown space) runs
    /// here and gets the answer it gets on a node on its own.
    fn route_of(&self, req: &Request<'_>) -> Route {
        let (space_id, key, write) = match *req {
            Request::Select {
                space_id,
                index_id: 0,
                iterator,
                key,
                ..
            } => {
                let Some(space) = self.spaces.get(&space_id) else {
                    return Route::Here;
                };
                let Ok((canon, parts)) = canonical_key(key) else {
                    return Route::Here;
                };
                let point = matches!(
                    iterator_of(iterator),
                    Some(SelectIterator::Eq | SelectIterator::Req)
                ) && parts == space.parts.len();
                if !point {
                    return Route::FanOut {
                        space: space.clone(),
                    };
                }
                (space_id, canon, false)
            }
            Request::Insert { space_id, tuple }
            | Request::Replace { space_id, tuple }
            | Request::Upsert {
                space_id, tuple, ..
            } => {
                let Some(space) = self.spaces.get(&space_id) else {
                    return Route::Here;
                };
                let Ok(key) = key_of(space, tuple) else {
                    return Route::Here;
                };
                (space_id, key, true)
            }
            Request::Update {
                space_id,
                index_id: 0,
                key,
                ..
            }
            | Request::Delete {
                space_id,
                index_id: 0,
                key,
            } => {
                let Ok((canon, _)) = canonical_key(key) else {
                    return Route::Here;
                };
                (space_id, canon, true)
            }
            Request::Call { .. } | Request::Eval { .. } if super::call::is_count(req) => {
                return Route::Count
            }
            _ => return Route::Here,
        };
        let Some(space) = self.spaces.get(&space_id) else {
            return Route::Here;
        };
        let vbucket = space.bucket.vbucket_of(&key);
        let engine = &self.ctx.port.engine;
        if engine.vbucket_state(&space.bucket, vbucket) == Some(VbState::Active) {
            return Route::Here;
        }
        Route::Forward {
            space: space.clone(),
            vbucket,
            write,
        }
    }

    /// The user the node routed to runs the request as: this session's, or guest.
    fn routed_user(&self) -> String {
        self.user_name().to_string()
    }

    /// Sends the request on to the node at `addr`; its answer is written when it comes
    /// (`answer_forwarded`), and the connection goes on meanwhile.
    async fn forward(
        &mut self,
        addr: std::net::SocketAddr,
        code: u32,
        packet: &[u8],
        sync: u64,
        write: bool,
        space: &Space,
    ) -> Outcome {
        let ctx = self.ctx.clone();
        let router = &ctx.clustermap.router;
        router
            .stats
            .iproto_forwarded
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let user = self.routed_user();
        let body = request::body_of(packet).to_vec();
        let tag = self.forwarded.next_tag;
        self.forwarded.next_tag += 1;
        let reply = Replier::Tagged(self.forwarded.tx.clone(), tag);
        router
            .iproto(addr)
            .send(code, Some(&user), None, body, reply)
            .await
            .map_err(|why| unreachable(router, &space.name, &why))?;
        self.forwarded.waiting.insert(
            tag,
            Waiting {
                sync,
                write,
                space: space.name.clone(),
                given_up_at: Instant::now() + ROUTED_TIMEOUT,
            },
        );
        Ok(())
    }

    /// Writes the answers of forwarded requests that came (a write's into `acks`, behind the
    /// writes before it), and fails those that waited too long.
    pub(super) fn answer_forwarded(&mut self, out: &mut Vec<u8>, acks: &mut Vec<u8>) {
        let f = &mut self.forwarded;
        while let Ok(got) = f.rx.try_recv() {
            f.arrived.push(got);
        }
        let now = Instant::now();
        let late: Vec<u64> = f
            .waiting
            .iter()
            .filter(|(_, w)| w.given_up_at <= now)
            .map(|(&tag, _)| tag)
            .collect();
        let mut done: Vec<(Waiting, Result<Reply, String>)> = std::mem::take(&mut f.arrived)
            .into_iter()
            .filter_map(|(tag, r)| f.waiting.remove(&tag).map(|w| (w, r)))
            .collect();
        for tag in late {
            if let Some(w) = f.waiting.remove(&tag) {
                let why = format!("no answer within {ROUTED_TIMEOUT:?}");
                done.push((w, Err(why)));
            }
        }
        let version = self.ctx.catalog.schema_version;
        for (w, r) in done {
            match r {
                Ok(reply) => {
                    let dest = if w.write { &mut *acks } else { &mut *out };
                    response::write_relayed(dest, w.sync, version, reply.code, &reply.body);
                }
                Err(why) => {
                    let f = unreachable(&self.ctx.clustermap.router, &w.space, &why);
                    self.fail(out, w.sync, f);
                }
            }
        }
    }

    /// A SELECT over every vbucket: this node's active part and every other node's, merged in
    /// the iterator's order, then OFFSET and LIMIT applied once. Each node reads the vbuckets
    /// this node's map says are active there, and fails when one is not (a node that has not
    /// applied the same map); any part that fails fails it.
    #[allow(clippy::too_many_arguments)]
    async fn fan_out(
        &mut self,
        routes: &Routes,
        space: &Space,
        iterator: u32,
        key: &[u8],
        limit: u32,
        offset: u32,
        sync: u64,
        out: &mut Vec<u8>,
    ) -> Outcome {
        self.require(space, READ)?;
        let Some(it) = iterator_of(iterator) else {
            // The local path words the refusal.
            return Err(Failure::new(
                codes::ER_UNSUPPORTED_INDEX_FEATURE,
                format!(
                    "Index 'primary' (TREE) of space '{}' (memtx) does not support requested \
                     iterator type",
                    space.name
                ),
            ));
        };
        sluice_proto::iproto::tuple::check_key(key, &space.parts, false)?;
        let (canon, _) = canonical_key(key)?;
        let router = &self.ctx.clustermap.router;
        router
            .stats
            .iproto_fanned_out
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(vb) = routes.without_active(space.bucket.num_vbuckets()) {
            let why = format!("vbucket {vb} has no active node");
            return Err(unreachable(router, &space.name, &why));
        }
        let wanted = offset.saturating_add(limit);
        // The other nodes' parts are asked for first, then this node's is read meanwhile.
        let mut body = Vec::new();
        client::write_select(
            &mut body,
            0,
            &client::Select {
                space_id: space.id,
                index_id: 0,
                iterator,
                offset: 0,
                limit: wanted,
                key,
            },
        );
        let body = request::body_of(&body).to_vec();
        let user = self.routed_user();
        let (mine, others) = routes.parts();
        let mut asked = Vec::new();
        for (node, set) in others {
            let Some(addr) = node.iproto else {
                return Err(unreachable(
                    router,
                    &space.name,
                    "a node of the cluster has no iproto listener",
                ));
            };
            let link = router.iproto(addr);
            let body = body.clone();
            let user = user.clone();
            let part = set.to_bytes(space.bucket.num_vbuckets());
            asked.push(tokio::spawn(async move {
                link.call(codes::SELECT, Some(&user), Some(part), body, ROUTED_TIMEOUT)
                    .await
            }));
        }
        let engine = &self.ctx.port.engine;
        let here = engine
            .select_from(&space.bucket, it, &canon, 0, wanted, Part::Exactly(mine))
            .map_err(|e| super::failure::read_failure(e, &space.name))?;
        let mut rows: Vec<(Vec<u8>, Vec<u8>)> = here
            .iter()
            .map(|i| (i.key().to_vec(), i.value().to_vec()))
            .collect();
        for part in asked {
            let reply = match part.await {
                Ok(Ok(r)) => r,
                Ok(Err(why)) => return Err(unreachable(router, &space.name, &why)),
                Err(e) => return Err(unreachable(router, &space.name, &e.to_string())),
            };
            if reply.code != codes::OK {
                // The other node's refusal (access denied, say) is the answer.
                let version = self.ctx.catalog.schema_version;
                response::write_relayed(out, sync, version, reply.code, &reply.body);
                return Ok(());
            }
            for tuple in data_rows(&reply.body)? {
                rows.push((key_of(space, tuple)?, tuple.to_vec()));
            }
        }
        let descending = matches!(
            it,
            SelectIterator::Req | SelectIterator::Lt | SelectIterator::Le
        );
        rows.sort_by(|a, b| {
            let o = compare_keys(&a.0, &b.0).then_with(|| a.0.cmp(&b.0));
            if descending {
                o.reverse()
            } else {
                o
            }
        });
        let mut data = response::DataWriter::begin(out, sync, self.ctx.catalog.schema_version);
        for (_, tuple) in rows.iter().skip(offset as usize).take(limit as usize) {
            data.push_raw(out, tuple);
        }
        data.finish(out);
        Ok(())
    }
}

impl Session {
    /// A count over every vbucket: this node's part (its active vbuckets: `call::count` reads
    /// those only in a cluster) and every other node's, asked with the same request.
    async fn count_everywhere(
        &mut self,
        routes: &Routes,
        packet: &[u8],
        header: &Header,
        req: &Request<'_>,
        out: &mut Vec<u8>,
    ) -> Outcome {
        let ctx = self.ctx.clone();
        let router = &ctx.clustermap.router;
        router
            .stats
            .iproto_fanned_out
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let num_vbuckets = self
            .spaces
            .values()
            .map(|s| s.bucket.num_vbuckets())
            .max()
            .unwrap_or(0);
        if let Some(vb) = routes.without_active(num_vbuckets) {
            return Err(unreachable(
                router,
                "",
                &format!("vbucket {vb} has no active node"),
            ));
        }
        let user = self.routed_user();
        let body = request::body_of(packet).to_vec();
        let (mine, others) = routes.parts();
        let mut asked = Vec::new();
        for (node, set) in others {
            let Some(addr) = node.iproto else {
                return Err(unreachable(
                    router,
                    "",
                    "a node of the cluster has no iproto listener",
                ));
            };
            let link = router.iproto(addr);
            let (body, user) = (body.clone(), user.clone());
            let code = header.code;
            let part = set.to_bytes(num_vbuckets);
            asked.push(tokio::spawn(async move {
                link.call(code, Some(&user), Some(part), body, ROUTED_TIMEOUT)
                    .await
            }));
        }
        let mut here = Vec::new();
        // This node's part is counted as the others' are: the vbuckets the map gives it.
        self.part = Some(mine);
        let local = match *req {
            Request::Call { name, args, .. } => Some(self.call(name, args, 0, &mut here)),
            Request::Eval { expr, args } => Some(self.eval(expr, args, 0, &mut here)),
            _ => None,
        };
        self.part = None;
        let Some(local) = local else {
            return Ok(());
        };
        local?;
        let (_, _, body) = client::split_reply(&here).map_err(|_| unreadable())?;
        let mut total = single_count(body)?;
        for part in asked {
            let reply = match part.await {
                Ok(Ok(r)) => r,
                Ok(Err(why)) => return Err(unreachable(router, "", &why)),
                Err(e) => return Err(unreachable(router, "", &e.to_string())),
            };
            if reply.code != codes::OK {
                let version = self.ctx.catalog.schema_version;
                response::write_relayed(out, header.sync, version, reply.code, &reply.body);
                return Ok(());
            }
            total += single_count(&reply.body)?;
        }
        let mut value = Vec::new();
        sluice_proto::msgpack::write_uint(&mut value, total);
        let mut data =
            response::DataWriter::begin(out, header.sync, self.ctx.catalog.schema_version);
        data.push_raw(out, &value);
        data.finish(out);
        Ok(())
    }
}

fn unreadable() -> Failure {
    Failure::new(ER_SYSTEM, "a node of the cluster answered unreadably")
}

/// The one unsigned integer of a count's reply body `{DATA: [n]}`.
fn single_count(body: &[u8]) -> Result<u64, Failure> {
    let rows = data_rows(body)?;
    let [n] = rows[..] else {
        return Err(unreadable());
    };
    Reader::new(n).read_uint().map_err(|_| unreadable())
}

/// The tuples of a reply's body `{DATA: [tuple, ...]}`.
fn data_rows(body: &[u8]) -> Result<Vec<&[u8]>, Failure> {
    let bad = || {
        Failure::new(
            ER_SYSTEM,
            "a node of the cluster answered a SELECT unreadably",
        )
    };
    let mut r = Reader::new(body);
    let n = r.read_map_len().map_err(|_| bad())?;
    for _ in 0..n {
        let k = r.read_uint().map_err(|_| bad())?;
        if k != codes::KEY_DATA as u64 {
            r.skip_value(64).map_err(|_| bad())?;
            continue;
        }
        let rows = r.read_array_len().map_err(|_| bad())?;
        let mut out = Vec::with_capacity(rows as usize);
        for _ in 0..rows {
            out.push(r.read_raw_value(64).map_err(|_| bad())?);
        }
        return Ok(out);
    }
    Ok(Vec::new())
}

/// The error a client gets when the node its request needed did not answer.
fn unreachable(router: &crate::router::Router, space: &str, why: &str) -> Failure {
    router
        .stats
        .failed
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Failure::new(
        ER_SYSTEM,
        format!(
            "space '{space}': the node of the cluster this request needs did not answer ({why}); \
             nothing is returned rather than a part of the answer"
        ),
    )
}
