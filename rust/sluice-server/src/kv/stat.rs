//! STAT: the default group (memcached's names), vbucket-seqno (Couchbase's) and spaces
//! (the configured iproto spaces a user may read).

use super::reply::Reply;
use super::{KvContext, KvSession};
use sluice_core::bucket::Bucket;
use sluice_proto::mcbp::status;

impl KvSession {
    /// STAT vbucket-seqno (Couchbase's names): per vbucket its uuid, high seqno and purge seqno.
    pub(super) fn stat_vbucket_seqno(&self, reply: &mut Reply<'_>) {
        let b = &self.bucket;
        for v in 0..b.num_vbuckets() {
            let Some(vb) = b.lock_vbucket(v) else {
                continue;
            };
            let uuid = vb.failover.latest().map(|e| e.uuid).unwrap_or(0);
            let rows = [
                (format!("vb_{v}:uuid"), uuid.to_string()),
                (format!("vb_{v}:high_seqno"), vb.high_seqno.to_string()),
                (format!("vb_{v}:abs_high_seqno"), vb.high_seqno.to_string()),
                (format!("vb_{v}:purge_seqno"), vb.purge_seqno.to_string()),
                (
                    format!("vb_{v}:persisted_seqno"),
                    vb.persisted_seqno.to_string(),
                ),
            ];
            drop(vb);
            for (k, val) in rows {
                reply.send(status::SUCCESS, 0, &[], k.as_bytes(), val.as_bytes(), 0);
            }
        }
        reply.send(status::SUCCESS, 0, &[], &[], &[], 0);
    }

    /// STAT spaces: per configured space whose bucket the user may read, `space:NAME` with
    /// the space as JSON (`SpaceConfig::describe`).
    pub(super) fn stat_spaces(&self, reply: &mut Reply<'_>) {
        let users = self.ctx.users.current();
        let user = self.user.as_deref().and_then(|n| users.get(n));
        for space in self.ctx.spaces.iter() {
            let readable = !users.required()
                || user.is_some_and(|u| u.permissions(&space.bucket) & crate::auth::READ != 0);
            if readable {
                let key = format!("space:{}", space.name);
                let value = space.describe().to_string();
                reply.send(status::SUCCESS, 0, &[], key.as_bytes(), value.as_bytes(), 0);
            }
        }
        reply.send(status::SUCCESS, 0, &[], &[], &[], 0);
    }

    /// The default STAT group: one reply per statistic, then an empty one that ends the list.
    pub(super) fn stat(&self, reply: &mut Reply<'_>) {
        match reply.req.key {
            b"" => {}
            b"vbucket-seqno" => return self.stat_vbucket_seqno(reply),
            b"spaces" => return self.stat_spaces(reply),
            _ => {
                reply.error(
                    status::KEY_ENOENT,
                    "STAT groups: the default one, vbucket-seqno and spaces",
                    self.features.xerror,
                );
                return;
            }
        }
        let pairs = general_stats(&self.ctx, &self.bucket);
        for (k, v) in pairs {
            reply.send(status::SUCCESS, 0, &[], k.as_bytes(), v.as_bytes(), 0);
        }
        reply.send(status::SUCCESS, 0, &[], &[], &[], 0);
    }
}

/// The default STAT group, memcached's names where they mean the same: the binary STAT and the
/// text protocol's `stats` both answer with it.
/// The items a bucket holds now, over its vbuckets.
pub fn live_items(b: &Bucket) -> usize {
    (0..b.num_vbuckets())
        .map(|v| {
            b.lock_vbucket(v)
                .map(|vb| vb.store.live_items())
                .unwrap_or(0)
        })
        .sum()
}

/// The process's user and system CPU time, as memcached prints them ("seconds.microseconds").
fn cpu_times() -> (String, String) {
    // SAFETY: getrusage fills the zeroed struct it is given, for this process.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let t = |tv: libc::timeval| format!("{}.{:06}", tv.tv_sec, tv.tv_usec);
    (t(ru.ru_utime), t(ru.ru_stime))
}

pub fn general_stats(ctx: &KvContext, bucket: &Bucket) -> Vec<(&'static str, String)> {
    use std::sync::atomic::Ordering::Relaxed;
    let e = &ctx.engine;
    let s = &ctx.stats;
    let b = bucket;
    let items = live_items(b);
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed).to_string();
    let (user, system) = cpu_times();
    let threads = tokio::runtime::Handle::try_current()
        .map_or(1, |h| h.metrics().num_workers())
        .to_string();
    vec![
        ("pid", std::process::id().to_string()),
        ("uptime", ctx.started.elapsed().as_secs().to_string()),
        ("time", sluice_core::hlc::now_secs().to_string()),
        ("version", env!("CARGO_PKG_VERSION").to_string()),
        ("pointer_size", (usize::BITS).to_string()),
        ("rusage_user", user),
        ("rusage_system", system),
        ("threads", threads),
        ("accepting_conns", "1".to_string()),
        (
            "connection_structures",
            s.curr_connections.load(Relaxed).to_string(),
        ),
        (
            "curr_connections",
            s.curr_connections.load(Relaxed).to_string(),
        ),
        (
            "total_connections",
            s.connections_total.load(Relaxed).to_string(),
        ),
        (
            "rejected_connections",
            s.connections_rejected.load(Relaxed).to_string(),
        ),
        ("bytes_read", s.bytes_in.load(Relaxed).to_string()),
        ("bytes_written", s.bytes_out.load(Relaxed).to_string()),
        ("curr_items", items.to_string()),
        ("bytes", b.mem_used().to_string()),
        ("limit_maxbytes", b.config.memory_quota.to_string()),
        ("cmd_get", b.stats.gets.load(Relaxed).to_string()),
        ("get_misses", b.stats.get_misses.load(Relaxed).to_string()),
        (
            "get_hits",
            (b.stats.gets.load(Relaxed)
                - b.stats
                    .get_misses
                    .load(Relaxed)
                    .min(b.stats.gets.load(Relaxed)))
            .to_string(),
        ),
        ("cmd_set", b.stats.sets.load(Relaxed).to_string()),
        (
            "cmd_touch",
            (b.stats.touch_hits.load(Relaxed) + b.stats.touch_misses.load(Relaxed)).to_string(),
        ),
        ("cmd_flush", n(&b.stats.flushes)),
        ("get_expired", n(&b.stats.expired_on_access)),
        ("delete_hits", b.stats.deletes.load(Relaxed).to_string()),
        ("delete_misses", n(&b.stats.delete_misses)),
        ("incr_hits", n(&b.stats.incr_hits)),
        ("incr_misses", n(&b.stats.incr_misses)),
        ("decr_hits", n(&b.stats.decr_hits)),
        ("decr_misses", n(&b.stats.decr_misses)),
        ("cas_hits", n(&b.stats.cas_hits)),
        ("cas_misses", n(&b.stats.cas_misses)),
        ("cas_badval", n(&b.stats.cas_badval)),
        ("touch_hits", n(&b.stats.touch_hits)),
        ("touch_misses", n(&b.stats.touch_misses)),
        ("auth_cmds", n(&s.auth_cmds)),
        ("auth_errors", n(&s.auth_errors)),
        ("total_items", n(&b.stats.sets)),
        (
            "expired_unfetched",
            b.stats.expired_by_pager.load(Relaxed).to_string(),
        ),
        ("evictions", b.stats.evictions.load(Relaxed).to_string()),
        (
            "ep_tmp_failures",
            b.stats.tmp_failures.load(Relaxed).to_string(),
        ),
        ("ep_wal_synced_lsn", e.wal().synced_lsn().to_string()),
        ("ep_num_vbuckets", b.num_vbuckets().to_string()),
    ]
}
