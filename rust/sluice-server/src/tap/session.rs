//! Named TAP sessions: the streams, cursors and unacknowledged messages of a TAP client, kept
//! for a grace period after its connection drops so that a reconnect under the same name gets
//! every unacknowledged message again and then carries on (seed 000: "resumable at the
//! server's discretion"). REGISTERED_CLIENT sessions too expire after their grace period. At
//! most `tap.max_sessions` names are in use, live or parked, per server; what each holds
//! unacknowledged is bounded by the ACK window (`tap.ack_window`, `tap.max_unacked_bytes`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sluice_proto::mcbp::HEADER_LEN;
use sluice_proto::tap::{message_flag, OPAQUE_AT, TAP_FLAGS_AT};
use tokio::sync::watch;

use super::TapContext;

/// (bucket id, client name)
pub type SessionKey = (u16, Vec<u8>);

/// One message sent and not yet acknowledged.
struct Sent {
    seq: u32,
    start: usize,
    len: usize,
    at: Instant,
    /// False once re-queued by a temporary failure.
    live: bool,
}

/// The messages sent since the last ACK that covered them, as sent (the bytes are kept in one
/// buffer, compacted as ACKs free its front).
#[derive(Default)]
pub struct Unacked {
    bytes: Vec<u8>,
    head: usize,
    sent: VecDeque<Sent>,
    live: usize,
}

impl Unacked {
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Bytes kept for the messages not yet acknowledged.
    pub fn held_bytes(&self) -> usize {
        self.bytes.len() - self.head
    }

    /// Keeps message `seq`, sent `at`.
    pub fn push(&mut self, seq: u32, message: &[u8], at: Instant) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(message);
        self.sent.push_back(Sent {
            seq,
            start,
            len: message.len(),
            at,
            live: true,
        });
        self.live += 1;
    }

    /// An ACK of `seq` acknowledges it and everything sent before it. Returns how long ago
    /// `seq` was sent, or None for a sequence number not outstanding.
    pub fn ack(&mut self, seq: u32) -> Option<Duration> {
        let pos = self.sent.iter().position(|s| s.seq == seq)?;
        let at = self.sent[pos].at;
        for s in self.sent.drain(..=pos) {
            if s.live {
                self.live -= 1;
            }
            self.head = s.start + s.len;
        }
        if self.sent.is_empty() {
            self.bytes.clear();
            self.head = 0;
        } else if self.head > (1 << 20) && self.head * 2 > self.bytes.len() {
            self.bytes.drain(..self.head);
            for s in &mut self.sent {
                s.start -= self.head;
            }
            self.head = 0;
        }
        Some(at.elapsed())
    }

    /// Takes message `seq` out to be sent again (a temporary failure); None if not outstanding.
    pub fn take(&mut self, seq: u32) -> Option<Vec<u8>> {
        let s = self.sent.iter_mut().find(|s| s.seq == seq && s.live)?;
        s.live = false;
        self.live -= 1;
        Some(self.bytes[s.start..s.start + s.len].to_vec())
    }

    /// Every live message, oldest first, to be sent again after a reconnect.
    pub fn drain_all(&mut self) -> Vec<Vec<u8>> {
        let out = self
            .sent
            .iter()
            .filter(|s| s.live)
            .map(|s| self.bytes[s.start..s.start + s.len].to_vec())
            .collect();
        *self = Unacked::default();
        out
    }
}

/// Rewrites a sent message's sequence number and ACK flag for sending it again.
pub fn restamp(message: &mut [u8], seq: u32, ack: bool) {
    message[OPAQUE_AT..OPAQUE_AT + 4].copy_from_slice(&seq.to_be_bytes());
    if message.len() >= HEADER_LEN + 4 {
        let mut flags = u16::from_be_bytes([message[TAP_FLAGS_AT], message[TAP_FLAGS_AT + 1]]);
        if ack {
            flags |= message_flag::ACK;
        } else {
            flags &= !message_flag::ACK;
        }
        message[TAP_FLAGS_AT..TAP_FLAGS_AT + 2].copy_from_slice(&flags.to_be_bytes());
    }
}

enum Entry<S> {
    /// A connection serves the session; the sender tells it another took its name.
    Live {
        token: u64,
        replaced: watch::Sender<bool>,
    },
    Parked {
        token: u64,
        session: Box<S>,
    },
}

/// The TAP names in use, live or parked, per bucket.
pub struct Sessions<S> {
    entries: Mutex<HashMap<SessionKey, Entry<S>>>,
    next: AtomicU64,
    /// Names in use at most; a new name past it is refused.
    max: usize,
}

/// A new name was refused: this many are in use.
#[derive(Debug)]
pub struct Full(pub usize);

impl<S> Sessions<S> {
    pub fn new(max: usize) -> Sessions<S> {
        Sessions {
            entries: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            max,
        }
    }
}

/// A connection's hold on its name.
pub struct Claim {
    pub key: SessionKey,
    pub token: u64,
    pub replaced: watch::Receiver<bool>,
}

/// What claiming a name found.
pub enum Found<S> {
    Nothing,
    Parked(Box<S>),
}

impl<S: Send + 'static> Sessions<S> {
    /// Takes the name for a new connection: a live holder is told to stop (and gets `wait` to
    /// park its session); a parked session is handed over.
    /// A name not in use is refused (`Full`) when `max` are.
    pub async fn claim(&self, key: SessionKey, wait: Duration) -> Result<(Claim, Found<S>), Full> {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + wait;
        loop {
            let (tx, rx) = watch::channel(false);
            {
                let mut entries = self.entries.lock();
                if !entries.contains_key(&key) && entries.len() >= self.max {
                    return Err(Full(entries.len()));
                }
                let live = matches!(entries.get(&key), Some(Entry::Live { .. }));
                if !live || Instant::now() >= deadline {
                    let old = entries.insert(
                        key.clone(),
                        Entry::Live {
                            token,
                            replaced: tx,
                        },
                    );
                    let found = match old {
                        Some(Entry::Parked { session, .. }) => Found::Parked(session),
                        Some(Entry::Live { replaced, .. }) => {
                            let _ = replaced.send(true);
                            Found::Nothing
                        }
                        None => Found::Nothing,
                    };
                    let claim = Claim {
                        key,
                        token,
                        replaced: rx,
                    };
                    return Ok((claim, found));
                }
                if let Some(Entry::Live { replaced, .. }) = entries.get(&key) {
                    let _ = replaced.send(true);
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The connection ends: its session is parked under the name (if the claim still holds it)
    /// until `grace` passes. Returns the session back when the claim was lost, for the caller
    /// to close.
    pub fn park(
        self: &Arc<Self>,
        claim: &Claim,
        session: Box<S>,
        grace: Duration,
        expire: impl FnOnce(Box<S>) + Send + 'static,
    ) -> Option<Box<S>> {
        let mut entries = self.entries.lock();
        match entries.get(&claim.key) {
            Some(Entry::Live { token, .. }) if *token == claim.token => {}
            // A newer connection took the name without waiting for this one.
            _ => return Some(session),
        }
        entries.insert(
            claim.key.clone(),
            Entry::Parked {
                token: claim.token,
                session,
            },
        );
        drop(entries);
        let this = self.clone();
        let (key, token) = (claim.key.clone(), claim.token);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            let mut entries = this.entries.lock();
            if matches!(entries.get(&key), Some(Entry::Parked { token: t, .. }) if *t == token) {
                if let Some(Entry::Parked { session, .. }) = entries.remove(&key) {
                    drop(entries);
                    expire(session);
                }
            }
        });
        None
    }

    /// The connection ends without parking: frees the name if it still holds it.
    pub fn release(&self, claim: &Claim) {
        let mut entries = self.entries.lock();
        if matches!(entries.get(&claim.key), Some(Entry::Live { token, .. }) if *token == claim.token)
        {
            entries.remove(&claim.key);
        }
    }

    pub fn parked(&self) -> usize {
        self.entries
            .lock()
            .values()
            .filter(|e| matches!(e, Entry::Parked { .. }))
            .count()
    }

    /// Every parked session (the server is stopping).
    pub fn take_parked(&self) -> Vec<Box<S>> {
        let mut entries = self.entries.lock();
        let keys: Vec<SessionKey> = entries
            .iter()
            .filter(|(_, e)| matches!(e, Entry::Parked { .. }))
            .map(|(k, _)| k.clone())
            .collect();
        keys.into_iter()
            .filter_map(|k| match entries.remove(&k) {
                Some(Entry::Parked { session, .. }) => Some(session),
                _ => None,
            })
            .collect()
    }
}

/// Used by the server to close what parked sessions hold when it stops.
pub fn close_parked(ctx: &TapContext) {
    for mut s in ctx.sessions.take_parked() {
        s.close(&ctx.engine);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_covers_everything_before_it() {
        let mut u = Unacked::default();
        for seq in 1..=5u32 {
            u.push(seq, &[seq as u8; 30], Instant::now());
        }
        assert_eq!(u.len(), 5);
        assert_eq!(u.held_bytes(), 150);
        assert!(u.ack(3).is_some());
        assert_eq!(u.held_bytes(), 60);
        assert_eq!(u.len(), 2);
        assert!(u.ack(3).is_none(), "already acknowledged");
        let again = u.take(5).unwrap();
        assert_eq!(again, vec![5u8; 30]);
        assert_eq!(u.len(), 1);
        assert_eq!(u.drain_all(), vec![vec![4u8; 30]]);
        assert!(u.is_empty());
    }
}
