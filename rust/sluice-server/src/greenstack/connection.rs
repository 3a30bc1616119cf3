//! One Greenstack connection as the driver runs it: its session, and what else wakes it
//! (requests finishing on their tasks, the changes its DCP streams wait for, map changes and
//! failed logins told as notices), settled into the output before each send.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use sluice_core::bucket::Bucket;
use sluice_proto::greenstack::{self as gs, Check};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::dcp::DcpProducer;
use super::GreenstackContext;
use crate::armed;
use crate::driver::{Conn, End, Flow, Frame as DriverFrame, Out};

use super::session::*;

/// The connection's waits besides its requests: the changes its DCP streams wait for, failed
/// logins (told to an admin), map changes, and what they produced for the next send.
struct Waits {
    failed_logins: armed::Armed<
        tokio::sync::broadcast::Receiver<super::FailedLogin>,
        Result<super::FailedLogin, tokio::sync::broadcast::error::RecvError>,
    >,
    map_changes: armed::Armed<watch::Receiver<i64>, Result<i64, ()>>,
    /// The selected bucket's change count read before the DCP streams last filled the output:
    /// a change after it wakes the connection.
    changes: Option<(Arc<Bucket>, u64)>,
    /// The streams filled the output: send it and fill again.
    streamed_more: bool,
    /// Replies and notices produced by a wake, for the next send.
    woken: Vec<u8>,
    /// A request's task failed: the connection closes.
    failed: bool,
}

/// One Greenstack connection: its session and its waits.
pub(super) struct Connection {
    s: Session,
    waits: Waits,
    warm: Option<WarmStart>,
    /// Users were configured when it connected: until it logs in, it may have few requests
    /// in flight.
    login_required: bool,
}

impl crate::driver::Session for Connection {
    const FLUSH_AT: usize = FLUSH_AT;

    fn check(&mut self, buf: &[u8], max_frame: usize) -> crate::driver::Check {
        use crate::driver::{Check as Driver, Fault};
        match gs::check(buf, max_frame) {
            Ok(Check::Complete(n)) => Driver::Frame(n),
            Ok(Check::Incomplete(need)) => Driver::Need(need),
            Err(e) => Driver::Bad(Fault::new(matches!(e, gs::DecodeError::TooLarge { .. }), e)),
        }
    }

    /// A request goes to its lane (read in place; copied only if it has to wait for it).
    async fn handle(&mut self, frame: &mut DriverFrame<'_>, out: &mut Out) -> Flow {
        match self.s.take(frame.bytes(), &mut out.acked.buf) {
            Ok(()) => Flow::Continue,
            Err(e) => {
                self.s.ctx.port.io.protocol_error(
                    "greenstack",
                    format_args!("closing Greenstack connection from {}: {e}", self.s.peer),
                );
                Flow::Close
            }
        }
    }

    fn owed_lsn(&self) -> u64 {
        self.s.owed_lsn
    }

    fn logged_in(&self) -> bool {
        self.s.user.is_some()
    }

    /// A connection taken during warm-up is told warm-up is done.
    fn greet(&mut self, out: &mut Out) {
        if let Some(w) = self.warm.take() {
            self.s.hello = w.hello;
            self.s.next_opaque = w.next_opaque;
            self.s.notice(&mut out.acked.buf, "warmup_done", 1, |m| {
                m.uint("warmup_ms", w.warmup.as_millis() as u64);
            });
        }
    }

    /// While the connection has room for more requests in flight (fewer before login).
    fn reading(&self) -> bool {
        let max = match self.login_required && self.s.user.is_none() {
            true => MAX_IN_FLIGHT_PRELOGIN,
            false => MAX_IN_FLIGHT,
        };
        self.s.in_flight < max
    }

    /// Requests under way or streams open: the client may be silent.
    fn waiting(&self) -> bool {
        !self.s.tasks.is_empty() || self.s.dcp.as_ref().is_some_and(DcpProducer::has_streams)
    }

    /// Always: notices (map changes, failed logins) may come whatever the connection does.
    fn wakes(&self) -> bool {
        true
    }

    async fn wake(&mut self) {
        let Connection { s, waits, .. } = self;
        if waits.streamed_more {
            return;
        }
        let can_stream = s.dcp.as_ref().is_some_and(DcpProducer::can_send);
        let changed = async {
            match &waits.changes {
                Some((b, seen)) if can_stream => b.changes.changed(*seen).await,
                _ => std::future::pending().await,
            }
        };
        let admin = s.is_admin_cached();
        let out = &mut waits.woken;
        tokio::select! {
            _ = changed => {}
            rev = waits.map_changes.next() => match rev {
                Ok(rev) => s.map_changed_notice(rev, out),
                // The map lives as long as the server: not before the stop.
                Err(()) => waits.map_changes.disarm(),
            },
            // Only an admin's connection is told; the others let the channel lag behind.
            told = waits.failed_logins.next(), if admin => {
                // Lagged behind a burst: the next one says how many there were. (The sender
                // lives in the context this session holds: it never closes.)
                if let Ok(f) = told {
                    s.failed_login_notice(&f, out);
                }
            }
            Some(done) = s.tasks.join_next() => {
                if s.finish_task(done, out).is_err() {
                    waits.failed = true;
                }
            }
        }
    }

    /// What was read starts, by priority; requests that finished meanwhile answer in the same
    /// write; the DCP streams send what they have. At the stop, the client is told, and the
    /// requests under way finish (nothing new is read).
    async fn settle(&mut self, out: &mut Out, end: Option<End>) -> Flow {
        let Connection { s, waits, .. } = self;
        let buf = &mut out.acked.buf;
        buf.append(&mut waits.woken);
        s.start_queued(buf);
        while let Some(done) = s.tasks.try_join_next() {
            if s.finish_task(done, buf).is_err() {
                return Flow::Close;
            }
        }
        if end == Some(End::Stop) {
            s.shutdown_notice(buf);
            while let Some(done) = s.tasks.join_next().await {
                if s.finish_task(done, buf).is_err() {
                    break;
                }
            }
        }
        // The bucket's change count read first, so that a change after the fill wakes the wait.
        waits.changes = s.dcp.as_ref().map(|d| {
            let b = d.bucket().clone();
            let seen = b.changes.generation();
            (b, seen)
        });
        waits.streamed_more = s.dcp.as_mut().is_some_and(|d| d.fill(buf, FLUSH_AT));
        let counted = std::mem::take(&mut s.counted);
        s.ctx.stats.requests.fetch_add(counted.requests, Relaxed);
        s.ctx
            .stats
            .out_of_order
            .fetch_add(counted.out_of_order, Relaxed);
        match waits.failed {
            true => Flow::Close,
            false => Flow::Continue,
        }
    }
}

/// Runs one connection: `warm`, one taken during warm-up, goes on from what it sent then.
pub(super) async fn run(mut conn: Conn, ctx: Arc<GreenstackContext>, warm: Option<WarmStart>) {
    let s = Session {
        ctx: ctx.clone(),
        next_opaque: 1,
        told_backoff: None,
        told_failed_login: None,
        peer: conn.peer,
        login_deadline: conn.login_deadline(),
        login_needs_tls: conn.login_needs_tls(),
        hello: false,
        user: None,
        scram: None,
        bucket: None,
        perms: Default::default(),
        admin: Default::default(),
        dcp: None,
        root: Lane::default(),
        lanes: HashMap::default(),
        prioritized: 0,
        touched: Vec::new(),
        batch: Vec::new(),
        tasks: JoinSet::new(),
        owed_lsn: 0,
        taken: 0,
        in_flight: 0,
        counted: Counted::default(),
    };
    if let Some(w) = &warm {
        conn.inbuf.extend_from_slice(&w.inbuf);
    }
    let waits = Waits {
        failed_logins: armed::broadcasts(ctx.failed_logins.listen()),
        map_changes: {
            let mut rx = ctx.clustermap.subscribe();
            rx.borrow_and_update();
            armed::watch_changes(rx)
        },
        changes: None,
        streamed_more: false,
        woken: Vec::new(),
        failed: false,
    };
    let login_required = conn.before_login();
    let mut c = Connection {
        s,
        waits,
        warm,
        login_required,
    };
    crate::driver::run(&mut conn, &mut c).await;
}
