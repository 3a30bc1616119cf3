//! A wake-up for readers of a bucket's changes (DCP and TAP streams, replicas): writers bump a
//! generation after queueing changes; a reader that found nothing to read waits for the
//! generation to move. Runtime-agnostic (`std::task::Waker`), and free for writers while no
//! reader waits: one atomic add and one load.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

#[derive(Default)]
pub struct ChangeSignal {
    generation: AtomicU64,
    has_waiters: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl ChangeSignal {
    /// The current generation: take it before looking for changes, then `changed(gen)`.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Called by writers after their changes are readable.
    pub fn notify(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.has_waiters.load(Ordering::SeqCst) {
            let wakers = {
                let mut w = self.wakers.lock();
                self.has_waiters.store(false, Ordering::SeqCst);
                std::mem::take(&mut *w)
            };
            for w in wakers {
                w.wake();
            }
        }
    }

    /// Completes once the generation differs from `seen`.
    pub fn changed(&self, seen: u64) -> Changed<'_> {
        Changed { signal: self, seen }
    }
}

pub struct Changed<'a> {
    signal: &'a ChangeSignal,
    seen: u64,
}

impl Future for Changed<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let s = self.signal;
        if s.generation.load(Ordering::SeqCst) != self.seen {
            return Poll::Ready(());
        }
        {
            let mut w = s.wakers.lock();
            if !w.iter().any(|x| x.will_wake(cx.waker())) {
                w.push(cx.waker().clone());
            }
            s.has_waiters.store(true, Ordering::SeqCst);
        }
        // A writer that bumped the generation before seeing `has_waiters` is caught here.
        if s.generation.load(Ordering::SeqCst) != self.seen {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::task::Wake;

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn wakes_a_waiter_once_the_generation_moves() {
        let s = ChangeSignal::default();
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let g = s.generation();
        let mut f = Box::pin(s.changed(g));
        assert!(f.as_mut().poll(&mut cx).is_pending());
        s.notify();
        assert!(flag.0.load(Ordering::SeqCst));
        assert!(f.as_mut().poll(&mut cx).is_ready());
        // A generation already moved is ready at once.
        assert!(Box::pin(s.changed(g)).as_mut().poll(&mut cx).is_ready());
    }
}
