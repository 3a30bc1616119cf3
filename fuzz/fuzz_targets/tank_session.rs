//! The TANK front whole: any bytes sent on a loopback connection to one session
//! (`front::serve_accepted`, as the server runs it) over one engine without a WAL, the client's
//! side then shut for writing and the replies read. CreateTopic, Produce and ProduceWithSeqnum
//! with their bundles, Consume with long-poll and min-bytes, discovery and Status all see what
//! libFuzzer makes of them; topics created by earlier cases stay. A session must end within 10 s
//! of its connection closing, a long-poll included (`Loopback::exchange`).
#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use sluice_fuzz::Loopback;
use sluice_server::driver::Port;
use sluice_server::front::serve_accepted;
use sluice_server::tank::TankContext;

fn front() -> &'static (Loopback, Arc<TankContext>) {
    static FRONT: OnceLock<(Loopback, Arc<TankContext>)> = OnceLock::new();
    FRONT.get_or_init(|| {
        let kv = sluice_fuzz::kv_context("tank");
        let ctx = Arc::new(TankContext {
            port: Port::scratch(
                "tank",
                "TANK connection",
                kv.engine.clone(),
                kv.users.clone(),
            ),
            stats: Default::default(),
            started_unix: 0,
            // A node on its own: every partition led here.
            clustermap: Arc::new(sluice_server::clustermap::ClusterMap::new(
                "127.0.0.1:11210".parse().unwrap(),
                None,
            )),
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
