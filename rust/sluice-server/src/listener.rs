//! The accept loop of every listener (KV, TLS KV, iproto, TANK): each connection under the
//! server's connection limit (one limit for all of them), a task per connection, and on the
//! stop signal no new connections while the open ones finish what they hold.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

use crate::stats::ConnectionStats;

/// Accepts connections on `listener` until the stop signal, refusing those over `limit`
/// (counted in `io`), and runs `session` for each; `kind` names the front in log lines.
pub async fn serve<F, Fut>(
    listener: TcpListener,
    kind: &'static str,
    io: Arc<ConnectionStats>,
    mut stop: watch::Receiver<bool>,
    limit: Arc<Semaphore>,
    session: F,
) where
    F: Fn(TcpStream, SocketAddr, watch::Receiver<bool>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
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
                let run = session(socket, peer, stop.clone());
                tasks.spawn(async move {
                    run.await;
                    drop(permit);
                });
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
}
