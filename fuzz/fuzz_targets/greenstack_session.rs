//! The Greenstack front whole: any bytes sent on a loopback connection to one session
//! (`front::serve_accepted`, as the server runs it) over one engine without a WAL, the client's
//! side then shut for writing and the replies read. Lanes, fences, priority, quiet, HELLO,
//! SASL, bucket selection, mutations (JSON merge patches among them), GET_ALL_VB_SEQNOS and
//! DCP over Greenstack all see what libFuzzer makes of them. A session must end within 10 s of
//! its connection closing (`Loopback::exchange`).
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use sluice_fuzz::Loopback;
use sluice_server::driver::Port;
use sluice_server::front::serve_accepted;
use sluice_server::greenstack::GreenstackContext;
use sluice_server::throttle::LoginThrottle;

fn front() -> &'static (Loopback, Arc<GreenstackContext>) {
    static FRONT: OnceLock<(Loopback, Arc<GreenstackContext>)> = OnceLock::new();
    FRONT.get_or_init(|| {
        let kv = sluice_fuzz::kv_context("greenstack");
        let ctx = Arc::new(GreenstackContext {
            port: Port::scratch(
                "greenstack",
                "Greenstack connection",
                kv.engine.clone(),
                kv.users.clone(),
            ),
            stats: Default::default(),
            throttle: Arc::new(LoginThrottle::default()),
            failed_logins: Default::default(),
            clustermap: kv.clustermap.clone(),
        });
        (Loopback::default(), ctx)
    })
}

fuzz_target!(|data: &[u8]| {
    let (lb, ctx) = front();
    lb.exchange(data, |socket, peer, stop| {
        serve_accepted(ctx.clone(), socket.into(), peer, stop)
    });
});
