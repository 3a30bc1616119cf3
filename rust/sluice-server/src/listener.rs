//! The accept loop of every listener (KV, TLS KV, iproto, TANK, Greenstack): each connection
//! under the server's connection limit (one limit for all of them), a task per connection on
//! one of the I/O threads, and on the stop signal no new connections while the open ones
//! finish what they hold.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{oneshot, watch, Semaphore};

use crate::stats::ConnectionStats;

/// The I/O threads, each running its own event loop (memcached's worker threads): a connection
/// stays on the thread it was given, so a request is read, executed and answered by one thread
/// without waking another. On a shared work-stealing runtime each readiness event could wake a
/// second thread, which cost about a tenth of the throughput of a few unpipelined connections.
/// A connection's tasks (DCP streams, durable-write waits) run on its thread too.
pub struct IoLoops {
    handles: Vec<Handle>,
    next: AtomicUsize,
    /// Dropping a sender lets its thread return; joined on drop.
    threads: Vec<(oneshot::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl IoLoops {
    pub fn start(count: usize) -> std::io::Result<IoLoops> {
        let mut handles = Vec::new();
        let mut threads = Vec::new();
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let (quit, quit_rx) = oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("sluice-io-{i}"))
                .spawn(move || {
                    // Every write a connection makes is waited for before its reply.
                    sluice_core::wal::writer::replies_wait_here();
                    runtime.block_on(async {
                        let _ = quit_rx.await;
                    });
                    // Connections were given their grace by the accept loops already.
                    runtime.shutdown_timeout(Duration::from_millis(100));
                })?;
            threads.push((quit, thread));
        }
        Ok(IoLoops {
            handles,
            next: AtomicUsize::new(0),
            threads,
        })
    }

    /// The thread for the next connection, in turn.
    pub fn next(&self) -> &Handle {
        &self.handles[self.next.fetch_add(1, Relaxed) % self.handles.len()]
    }
}

impl Drop for IoLoops {
    fn drop(&mut self) {
        for (quit, thread) in self.threads.drain(..) {
            drop(quit);
            let _ = thread.join();
        }
    }
}

/// Runs one connection's session with `gauge` counting it while it runs (a front's open
/// connections).
pub async fn counted(gauge: &AtomicU64, session: impl Future<Output = ()>) {
    gauge.fetch_add(1, Relaxed);
    session.await;
    gauge.fetch_sub(1, Relaxed);
}

/// Accepts connections on `listener` until the stop signal, refusing those over `limit`
/// (counted in `io`), and runs `session` for each on one of `loops`; `kind` names the front
/// in log lines.
pub async fn serve<F, Fut>(
    listener: TcpListener,
    kind: &'static str,
    io: Arc<ConnectionStats>,
    mut stop: watch::Receiver<bool>,
    limit: Arc<Semaphore>,
    loops: Arc<IoLoops>,
    session: F,
) where
    F: Fn(TcpStream, SocketAddr, watch::Receiver<bool>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let session = Arc::new(session);
    let mut tasks = tokio::task::JoinSet::new();
    let max = limit.available_permits();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => {
                let (socket, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        log::warn!("{kind} accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    // Over the limit: close at once rather than queue without bound.
                    io.connections_rejected.fetch_add(1, Relaxed);
                    log::warn!("refusing {kind} connection from {peer}: max_connections ({max}) reached");
                    continue;
                };
                let _ = socket.set_nodelay(true);
                // The socket moves to its thread's event loop: registered there, not here.
                let socket = match socket.into_std() {
                    Ok(s) => s,
                    Err(e) => {
                        log::info!("{kind} connection from {peer} lost on accept: {e}");
                        continue;
                    }
                };
                let (session, stop) = (session.clone(), stop.clone());
                tasks.spawn_on(async move {
                    match TcpStream::from_std(socket) {
                        Ok(socket) => session(socket, peer, stop).await,
                        Err(e) => log::info!("{kind} connection from {peer} lost on accept: {e}"),
                    }
                    drop(permit);
                }, loops.next());
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::IoLoops;

    #[test]
    fn connections_are_dealt_to_the_threads_in_turn_and_stay_there() {
        let loops = IoLoops::start(2).unwrap();
        let mut names = Vec::new();
        for _ in 0..4 {
            let (tx, rx) = std::sync::mpsc::channel();
            loops.next().spawn(async move {
                let first = std::thread::current().name().map(str::to_owned);
                // A task that yields resumes on the thread it started on.
                tokio::task::yield_now().await;
                let second = std::thread::current().name().map(str::to_owned);
                tx.send((first, second)).unwrap();
            });
            let (first, second) = rx.recv().unwrap();
            assert_eq!(first, second);
            names.push(first.unwrap());
        }
        assert_eq!(
            names,
            ["sluice-io-0", "sluice-io-1", "sluice-io-0", "sluice-io-1"]
        );
        // Dropping them stops and joins every thread (a hang here fails the test by timeout).
        drop(loops);
    }
}
