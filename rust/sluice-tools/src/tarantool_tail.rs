//! `sluice tarantool-tail`: a real Tarantool followed as an anonymous replica
//! (`sluice_server::upstream`), its rows written as JSON lines as `sluice wal-dump` prints the
//! rows of Tarantool's files: optionally its snapshot first, then every change as it happens.

use std::io::Write;
use std::time::Duration;

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
        rt.block_on(async {
            let mut up = Upstream::connect(&self.upstream).await?;
            let ballot = up.ballot().await?;
            let mut from = ballot.map(|b| b.vclock).unwrap_or_default();
            let mut stopped = false;
            if self.snapshot {
                from = up
                    .fetch_snapshot(|row| {
                        if !stopped {
                            stopped = matches!(printer.row(row, false)?, Next::Stop);
                        }
                        Ok(())
                    })
                    .await?;
                printer.flush();
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
            up.subscribe(&random_uuid(), from, self.idle, |row| {
                printer.row(row, true)
            })
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
fn random_uuid() -> String {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the system's randomness");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    sluice_proto::iproto::json::uuid_text(&b).expect("16 bytes")
}
