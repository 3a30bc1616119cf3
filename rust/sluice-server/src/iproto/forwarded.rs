//! A connection's requests sent on to the node their key is active on (`route`), whose
//! answers have not come yet.

use std::collections::BTreeMap;
use std::time::Instant;

use tokio::sync::mpsc;

use crate::router::iproto_link::Reply;

/// A connection's requests forwarded to other nodes whose answers have not come yet: the
/// client pipelines, and each answer is written when it comes (iproto answers carry their
/// SYNC), a write's behind the writes before it.
pub struct Forwarded {
    pub(super) tx: mpsc::UnboundedSender<(u64, Result<Reply, String>)>,
    pub(super) rx: mpsc::UnboundedReceiver<(u64, Result<Reply, String>)>,
    pub(super) waiting: BTreeMap<u64, Waiting>,
    pub(super) arrived: Vec<(u64, Result<Reply, String>)>,
    pub(super) next_tag: u64,
}

pub(super) struct Waiting {
    pub(super) sync: u64,
    pub(super) write: bool,
    pub(super) space: String,
    pub(super) given_up_at: Instant,
}

impl Default for Forwarded {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Forwarded {
            tx,
            rx,
            waiting: BTreeMap::new(),
            arrived: Vec::new(),
            next_tag: 0,
        }
    }
}

impl Forwarded {
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Resolves once an answer arrives or the oldest request waited too long. Cancel-safe: an
    /// answer taken is kept for `Session::answer_forwarded`.
    pub async fn wait(&mut self) {
        let Some(until) = self.waiting.values().map(|w| w.given_up_at).min() else {
            return std::future::pending().await;
        };
        tokio::select! {
            got = self.rx.recv() => self.arrived.extend(got),
            _ = tokio::time::sleep_until(until.into()) => {}
        }
    }
}
