//! `sluice tarantool-tail`: a real Tarantool followed as an anonymous replica
//! (`sluice_server::upstream`), its rows written as JSON lines as `sluice wal-dump` prints the
//! rows of Tarantool's files: optionally its snapshot first, then every change as it happens.
//! With a state file it resumes where it stopped: the vclock of the last row written is saved
//! after each row (`{"vclock": {"1": 37}}`, written to a temporary file and renamed over it).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use sluice_proto::iproto::client::Vclock;
use sluice_proto::iproto::xrow::Row;
use sluice_server::upstream::{Next, Upstream, UpstreamConfig, UpstreamError};

/// What to follow and how long.
pub struct Tail {
    pub upstream: UpstreamConfig,
    /// The rows of the upstream's snapshot first, then the changes after it; otherwise the
    /// changes from now on (from the vclock in its ballot).
    pub snapshot: bool,
    /// Stop after this many rows (0: never).
    pub max_rows: u64,
    /// How long to wait for a row or a heartbeat before giving up.
    pub idle: Duration,
    /// Where to resume from and save the position; when it exists, `snapshot` is not fetched.
    pub state: Option<PathBuf>,
}

fn state_error(path: &std::path::Path, why: impl std::fmt::Display) -> UpstreamError {
    UpstreamError::Io(std::io::Error::other(format!(
        "state file {}: {why}",
        path.display()
    )))
}

/// The vclock a state file holds; None when there is no file yet.
fn load_state(path: &std::path::Path) -> Result<Option<Vclock>, UpstreamError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(state_error(path, e)),
    };
    let doc: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| state_error(path, format!("not JSON: {e}")))?;
    let bad = || state_error(path, r#"expected {"vclock": {"ID": LSN, ...}}"#);
    let mut vclock = Vclock::new();
    for (id, lsn) in doc
        .get("vclock")
        .and_then(|v| v.as_object())
        .ok_or_else(bad)?
    {
        let id: u32 = id.parse().map_err(|_| bad())?;
        let lsn = lsn.as_u64().ok_or_else(bad)?;
        if id >= 32 {
            return Err(bad());
        }
        vclock.insert(id, lsn);
    }
    Ok(Some(vclock))
}

fn save_state(path: &std::path::Path, vclock: &Vclock) -> Result<(), UpstreamError> {
    let doc = serde_json::json!({
        "vclock": vclock.iter().map(|(id, lsn)| (id.to_string(), serde_json::Value::from(*lsn))).collect::<serde_json::Map<_, _>>()
    });
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{doc}\n"))
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| state_error(path, e))
}

impl Tail {
    /// Follows until `max_rows` are out, the output is closed (`| head`), or an error; returns
    /// how many rows were written.
    pub fn run(&self, out: &mut impl Write) -> Result<u64, UpstreamError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let mut printer = Printer {
            out,
            text: String::new(),
            written: 0,
            max_rows: self.max_rows,
        };
        let saved = match &self.state {
            Some(path) => load_state(path)?,
            None => None,
        };
        rt.block_on(async {
            let mut up = Upstream::connect(&self.upstream).await?;
            let ballot = up.ballot().await?;
            if let (Some(ours), Some(b)) = (&saved, &ballot) {
                // The rows after our position are gone from the upstream's WAL once its oldest
                // kept vclock passed it: SUBSCRIBE would miss them.
                if let Some((id, lsn)) = b.collected_after(ours) {
                    return Err(UpstreamError::Protocol(format!(
                        "the Tarantool no longer holds the rows after the saved position \
                         {ours:?} (its WAL starts after LSN {lsn} of replica {id}): start \
                         again from its snapshot (--snapshot, without the state file)"
                    )));
                }
            }
            let mut from = ballot.map(|b| b.vclock).unwrap_or_default();
            let mut stopped = false;
            if let Some(ours) = &saved {
                from = ours.clone();
            } else if self.snapshot {
                from = up
                    .fetch_snapshot(|row| {
                        if !stopped {
                            stopped = matches!(printer.row(row, false)?, Next::Stop);
                        }
                        Ok(Next::Continue)
                    })
                    .await?;
                printer.flush();
                // A snapshot cut short by --max is not a position to resume from.
                if let (false, Some(path)) = (stopped, &self.state) {
                    save_state(path, &from)?;
                }
            }
            if stopped {
                return Ok(());
            }
            log::info!(
                "following {} (Tarantool {}, instance {}) from vclock {from:?}",
                self.upstream.address,
                up.version,
                up.instance_uuid
            );
            let mut position = from.clone();
            up.subscribe(
                &random_uuid()?,
                true,
                from,
                self.idle,
                |row| {
                    let Some(row) = row else {
                        return Ok(Next::Continue);
                    };
                    let before = printer.written;
                    let next = printer.row(row, true)?;
                    // Saved once the row is out: a row written but not saved (a kill between the
                    // two) is written again on resume, never skipped.
                    if let (true, Some(path), Some(id), Some(lsn)) = (
                        printer.written > before,
                        &self.state,
                        row.header.replica_id,
                        row.header.lsn,
                    ) {
                        position.insert(id, lsn);
                        save_state(path, &position)?;
                    }
                    Ok(next)
                },
                Vclock::clone,
            )
            .await
            .map(|_| ())
        })?;
        printer.flush();
        Ok(printer.written)
    }
}

/// Rows out as JSON lines.
struct Printer<'a, W: Write> {
    out: &'a mut W,
    text: String,
    written: u64,
    max_rows: u64,
}

impl<W: Write> Printer<'_, W> {
    /// Writes a row; Stop once `max_rows` are out or the reader went away (`| head`).
    fn row(&mut self, row: &Row<'_>, flush: bool) -> Result<Next, UpstreamError> {
        self.text.clear();
        row.write_json(&mut self.text)
            .map_err(|e| UpstreamError::Protocol(e.to_string()))?;
        let wrote = writeln!(self.out, "{}", self.text).and_then(|_| {
            if flush {
                self.out.flush()
            } else {
                Ok(())
            }
        });
        if wrote.is_err() {
            return Ok(Next::Stop);
        }
        self.written += 1;
        let full = self.max_rows != 0 && self.written >= self.max_rows;
        Ok(if full { Next::Stop } else { Next::Continue })
    }

    fn flush(&mut self) {
        let _ = self.out.flush();
    }
}

/// A random (version 4) UUID: this reader's name as a replica, new per run.
fn random_uuid() -> Result<String, UpstreamError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)
        .map_err(|e| UpstreamError::Io(std::io::Error::other(format!("no randomness: {e}"))))?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    Ok(sluice_proto::iproto::json::uuid_text(&b).expect("16 bytes"))
}
