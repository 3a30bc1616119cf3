//! A wait on a channel kept registered across the rounds of a connection's loop.
//!
//! `tokio::select!` over `rx.changed()` or `rx.recv()` makes a new wait each round: polling it
//! puts a waiter on the channel's list and dropping it (when another branch wins) takes it off
//! again, each under the channel's lock. An unpipelined connection goes round once per request,
//! and three such waits were a few percent of its CPU. An `Armed` wait owns its receiver and
//! stays on the list until the channel speaks; only then is a new one made.

use std::future::Future;
use std::pin::Pin;

type Wait<R, O> = Pin<Box<dyn Future<Output = (R, O)> + Send>>;

pub struct Armed<R, O> {
    /// None once disarmed: the wait never ends.
    wait: Option<Wait<R, O>>,
    arm: fn(R) -> Wait<R, O>,
}

impl<R, O> Armed<R, O> {
    /// A wait on `rx`: `arm` makes the future that takes the receiver, waits and hands it back
    /// with what it got.
    pub fn new(rx: R, arm: fn(R) -> Wait<R, O>) -> Armed<R, O> {
        Armed {
            wait: Some(arm(rx)),
            arm,
        }
    }

    /// What the channel says next. Cancel-safe: a call dropped before it ends leaves the wait
    /// registered for the next call.
    pub async fn next(&mut self) -> O {
        let Some(wait) = self.wait.as_mut() else {
            return std::future::pending().await;
        };
        let (rx, got) = wait.await;
        self.wait = Some((self.arm)(rx));
        got
    }

    /// Never ends again (the channel closed: its every wait would end at once).
    pub fn disarm(&mut self) {
        self.wait = None;
    }
}

/// A wait for a change of a watch channel's value.
pub fn watch_changes<T: Clone + Send + Sync + 'static>(
    rx: tokio::sync::watch::Receiver<T>,
) -> Armed<tokio::sync::watch::Receiver<T>, Result<T, ()>> {
    Armed::new(rx, |mut rx| {
        Box::pin(async move {
            let got = match rx.changed().await {
                Ok(()) => Ok(rx.borrow_and_update().clone()),
                Err(_) => Err(()),
            };
            (rx, got)
        })
    })
}

/// A wait for the next message of a broadcast channel.
pub fn broadcasts<T: Clone + Send + 'static>(
    rx: tokio::sync::broadcast::Receiver<T>,
) -> Armed<tokio::sync::broadcast::Receiver<T>, Result<T, tokio::sync::broadcast::error::RecvError>>
{
    Armed::new(rx, |mut rx| {
        Box::pin(async move {
            let got = rx.recv().await;
            (rx, got)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_wait_dropped_by_select_still_sees_the_change() {
        let (tx, rx) = tokio::sync::watch::channel(0u32);
        let mut changes = watch_changes(rx);
        // A round lost to another branch: the wait stays registered.
        tokio::select! {
            _ = changes.next() => panic!("nothing changed yet"),
            () = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
        tx.send(7).unwrap();
        assert_eq!(changes.next().await, Ok(7));
        tx.send(8).unwrap();
        assert_eq!(changes.next().await, Ok(8));
        drop(tx);
        assert_eq!(changes.next().await, Err(()));
        changes.disarm();
        let pending = tokio::time::timeout(Duration::from_millis(10), changes.next()).await;
        assert!(pending.is_err(), "a disarmed wait never ends");
    }

    #[tokio::test]
    async fn broadcasts_come_in_order() {
        let (tx, rx) = tokio::sync::broadcast::channel(4);
        let mut told = broadcasts(rx);
        tx.send("a").unwrap();
        tx.send("b").unwrap();
        assert_eq!(told.next().await, Ok("a"));
        assert_eq!(told.next().await, Ok("b"));
    }
}
