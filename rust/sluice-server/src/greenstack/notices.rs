//! What a Greenstack connection is told without asking: notices (a request of opcode NOTICE
//! whose answer is dropped): back off when its bucket is above its high watermark, the map
//! changed, the server is stopping, and, to an admin's connection, someone's failed logins.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use sluice_proto::greenstack::payload::MapWriter;

use super::reply::write_notice;
use crate::auth::ADMIN;

use super::session::*;

impl Session {
    /// Sends the client a notice (a request of opcode NOTICE, `{kind, ...}` with the `n`
    /// fields `fields` writes); what it answers is dropped.
    pub(super) fn notice(
        &mut self,
        out: &mut Vec<u8>,
        kind: &str,
        n: u32,
        fields: impl FnOnce(&mut MapWriter<'_>),
    ) {
        write_notice(out, self.next_opaque, kind, n, fields);
        self.next_opaque = self.next_opaque.wrapping_add(1);
        self.ctx.stats.notices.fetch_add(1, Relaxed);
    }

    /// `is_admin`, looked up again only when the users were reloaded or the user changed.
    pub(super) fn is_admin_cached(&self) -> bool {
        let generation = self.ctx.port.users.generation();
        match self.admin.get() {
            Some((g, a)) if g == generation => a,
            _ => {
                let a = self.is_admin();
                self.admin.set(Some((generation, a)));
                a
            }
        }
    }

    /// Whether the connection's user administers the node (the admin permission on some
    /// bucket): the failed logins of others are told to such connections.
    pub(super) fn is_admin(&self) -> bool {
        let users = self.ctx.port.users.current();
        users.required()
            && self
                .user
                .as_deref()
                .and_then(|n| users.get(n))
                .is_some_and(|u| u.buckets.values().any(|p| p & ADMIN != 0))
    }

    /// Someone's login failed: told to an admin's connection, at most once a second (the
    /// count covers the ones between).
    pub(super) fn failed_login_notice(&mut self, f: &super::FailedLogin, out: &mut Vec<u8>) {
        if self
            .told_failed_login
            .is_some_and(|t| t.elapsed() < FAILED_LOGIN_NOTICE_EVERY)
        {
            return;
        }
        self.told_failed_login = Some(Instant::now());
        self.notice(out, "failed_logins", 3, |m| {
            m.uint("last_minute", f.last_minute)
                .str("user", &f.user)
                .str("from", &f.from.to_string());
        });
    }

    /// The vbucket map changed (a failover, a vbucket moved): a connection with a bucket
    /// selected is told, with the bucket's new config (the JSON Couchbase's clients read).
    pub(super) fn map_changed_notice(&mut self, rev: i64, out: &mut Vec<u8>) {
        let Some(b) = self.bucket.clone() else {
            return;
        };
        let (rev, config) = {
            let (r, c) = self.ctx.clustermap.bucket_config(&self.ctx.port.engine, &b);
            (r.max(rev), c)
        };
        self.notice(out, "map_changed", 3, |m| {
            m.str("bucket", b.name())
                .uint("rev", rev.max(0) as u64)
                .str("config", &config);
        });
    }

    /// The server is stopping: requests under way finish, no more are read.
    pub(super) fn shutdown_notice(&mut self, out: &mut Vec<u8>) {
        self.notice(out, "shutdown", 1, |m| {
            m.str(
                "reason",
                "the server is stopping: requests under way finish, no more are read",
            );
        });
    }

    /// After a write: when the bucket is above its high watermark, tells the client to back
    /// off (at most once a second), with a delay that grows as memory nears the quota.
    pub(super) fn maybe_backoff(&mut self, out: &mut Vec<u8>) {
        let Some(b) = &self.bucket else {
            return;
        };
        if !b.above_high_watermark()
            || self
                .told_backoff
                .is_some_and(|t| t.elapsed() < BACKOFF_NOTICE_EVERY)
        {
            return;
        }
        let b = b.clone();
        self.told_backoff = Some(Instant::now());
        let (used, quota) = (b.mem_used() as u64, b.config.memory_quota as u64);
        let delay_ms = if used >= quota { 1000 } else { 100 };
        let high = b.config.high_watermark_bytes() as u64;
        self.notice(out, "backoff", 5, |m| {
            m.str("bucket", b.name())
                .uint("delay_ms", delay_ms)
                .uint("mem_used", used)
                .uint("high_watermark", high)
                .uint("memory_quota", quota);
        });
    }
}
