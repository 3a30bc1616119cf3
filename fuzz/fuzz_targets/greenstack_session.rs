//! The Greenstack front whole: any bytes sent on a loopback connection to one session
//! (`serve_connection`, as the listener runs it) over one engine without a WAL, the client's
//! side then shut for writing and the replies read to the end. Lanes, fences, priority, quiet,
//! HELLO, SASL, bucket selection, mutations (JSON merge patches among them), GET_ALL_VB_SEQNOS
//! and DCP over Greenstack all see what libFuzzer makes of them. The replies are read for at
//! most 5 s; a session must end within 10 s of its connection closing.
#![no_main]

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sluice_server::greenstack::{serve_connection, GreenstackContext};
use sluice_server::limits::{LoginLimits, PreLogin};
use sluice_server::login::LoginThrottle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

struct Front {
    rt: tokio::runtime::Runtime,
    listener: TcpListener,
    addr: SocketAddr,
    ctx: Arc<GreenstackContext>,
    stop: watch::Receiver<bool>,
    _stopper: watch::Sender<bool>,
}

fn front() -> &'static Front {
    static FRONT: OnceLock<Front> = OnceLock::new();
    FRONT.get_or_init(|| {
        let kv = sluice_fuzz::kv_context("greenstack");
        let ctx = Arc::new(GreenstackContext {
            engine: kv.engine.clone(),
            users: kv.users.clone(),
            io: Default::default(),
            stats: Default::default(),
            throttle: Arc::new(LoginThrottle::default()),
            prelogin: Arc::new(PreLogin::new(LoginLimits::default())),
            max_frame: 1 << 20,
            idle_timeout: Duration::ZERO,
            failed_logins: Default::default(),
            clustermap: kv.clustermap.clone(),
        });
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
        Front {
            rt,
            listener,
            addr,
            ctx,
            stop,
            _stopper: stopper,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = front();
    f.rt.block_on(async {
        let mut client = TcpStream::connect(f.addr).await.expect("connect");
        let (server, peer) = f.listener.accept().await.expect("accept");
        let session = tokio::spawn(serve_connection(
            server,
            peer,
            f.ctx.clone(),
            f.stop.clone(),
        ));
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
});
