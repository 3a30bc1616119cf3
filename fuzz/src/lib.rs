//! What the targets that drive a whole front share.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sluice_server::auth::Users;
use sluice_server::kv::KvContext;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The memcached front's context over one engine (no WAL) in /dev/shm, made on first use and
/// kept for every case of the run: state from earlier cases (items, locks, topics) stays, as
/// on a long-lived server.
pub fn kv_context(target: &str) -> Arc<KvContext> {
    static CTX: OnceLock<Arc<KvContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let dir = PathBuf::from(format!(
            "/dev/shm/sluice-fuzz-{target}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Arc::new(KvContext::scratch(&dir, Users::default()).expect("engine"))
    })
    .clone()
}

/// A loopback listener and the runtime its sessions run on (one worker thread).
pub struct Loopback {
    rt: tokio::runtime::Runtime,
    listener: TcpListener,
    addr: SocketAddr,
    stop: watch::Receiver<bool>,
    _stopper: watch::Sender<bool>,
}

impl Default for Loopback {
    fn default() -> Loopback {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let listener = rt
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .expect("a loopback port");
        let addr = listener.local_addr().expect("its address");
        let (stopper, stop) = watch::channel(false);
        Loopback {
            rt,
            listener,
            addr,
            stop,
            _stopper: stopper,
        }
    }
}

impl Loopback {
    /// Sends `data` on a new connection to one session that `serve` runs, shuts the client's
    /// side for writing and reads the replies for at most 5 s. The session must end within
    /// 10 s of the connection closing.
    pub fn exchange<Fut>(
        &self,
        data: &[u8],
        serve: impl FnOnce(TcpStream, SocketAddr, watch::Receiver<bool>) -> Fut,
    ) where
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.rt.block_on(async {
            let mut client = TcpStream::connect(self.addr).await.expect("connect");
            let (server, peer) = self.listener.accept().await.expect("accept");
            let session = tokio::spawn(serve(server, peer, self.stop.clone()));
            let _ = client.write_all(data).await;
            let _ = client.shutdown().await;
            let mut buf = vec![0u8; 64 << 10];
            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                while matches!(client.read(&mut buf).await, Ok(n) if n > 0) {}
            })
            .await;
            drop(client);
            let ended = tokio::time::timeout(Duration::from_secs(10), session).await;
            assert!(
                ended.is_ok(),
                "the session outlived its closed connection by 10 s"
            );
        });
    }
}
