//! A DCP producer in-process: a connection handed over after DCP_OPEN, as the server's
//! connection does, over a real loopback socket; the consumer's side speaks through
//! sluice_proto's typed DCP messages. No server, no other front.

use std::sync::Arc;
use std::time::Duration;

use sluice_core::wal::WalMode;
use sluice_core::{BucketConfig, Engine, EngineConfig, StoreRequest};
use sluice_proto::dcp::{
    opcode, DcpRequest, DcpResponse, Mutation, SnapshotMarker, StreamRequest, StreamRequestResponse,
};
use sluice_proto::mcbp::{self, status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::producer::{DcpContext, OpenProducer};
use crate::kv::{Handoff, KvContext, KvSession};

fn engine(dir: &std::path::Path) -> Arc<Engine> {
    let mut b = BucketConfig::named("default");
    b.num_vbuckets = 1;
    Arc::new(
        Engine::open(EngineConfig {
            data_dir: dir.to_path_buf(),
            wal_mode: WalMode::None,
            snapshot_interval: Duration::ZERO,
            buckets: vec![b],
            ..Default::default()
        })
        .expect("engine"),
    )
}

/// Reads one whole frame.
async fn frame(sock: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Vec<u8> {
    loop {
        if let Some(n) = mcbp::frame_len(buf, 1 << 20).expect("well framed") {
            return buf.drain(..n).collect();
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), sock.read(&mut chunk))
            .await
            .expect("the producer answers within 10 s")
            .expect("read");
        assert!(n > 0, "the producer closed the connection");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn a_handed_over_connection_streams_a_vbucket_from_seqno_zero() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine(dir.path());
    let bucket = engine.bucket("default").unwrap();
    for key in ["a", "b", "c"] {
        engine
            .store(&bucket, &StoreRequest::set(key.as_bytes(), b"v"))
            .unwrap();
    }
    let kv = Arc::new(KvContext {
        engine: engine.clone(),
        users: Default::default(),
        stats: Default::default(),
        started: std::time::Instant::now(),
        tap_applied: Default::default(),
        clustermap: Arc::new(crate::clustermap::ClusterMap::new(
            "127.0.0.1:11210".parse().unwrap(),
            None,
        )),
        spaces: Arc::from([]),
        range_scans: Default::default(),
    });
    let dcp = Arc::new(DcpContext {
        engine: engine.clone(),
        io: kv.stats.clone(),
        names: Default::default(),
        stats: Default::default(),
        policies: Default::default(),
        max_body: 1 << 20,
        clustermap: kv.clustermap.clone(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (socket, peer) = listener.accept().await.unwrap();
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let conn = Handoff {
            socket: socket.into(),
            inbuf: Default::default(),
            out: Vec::new(),
            session: KvSession::new(kv.clone()),
            peer,
            stop,
        };
        let open = OpenProducer {
            name: b"test".to_vec(),
            flags: sluice_proto::dcp::open_flag::PRODUCER,
        };
        let producer = tokio::spawn(super::producer::run(conn, open, dcp.clone()));

        let mut req = Vec::new();
        StreamRequest {
            vbucket: 0,
            flags: 0,
            start_seqno: 0,
            end_seqno: u64::MAX,
            vbucket_uuid: 0,
            snap_start_seqno: 0,
            snap_end_seqno: 0,
            value: Vec::new(),
        }
        .encode(&mut req, 7)
        .unwrap();
        client.write_all(&req).await.unwrap();
        let mut buf = Vec::new();
        let answer = frame(&mut client, &mut buf).await;
        let r = mcbp::parse_response(&answer).unwrap();
        assert_eq!(
            (r.opcode, r.status, r.opaque),
            (opcode::STREAM_REQ, status::SUCCESS, 7)
        );
        match StreamRequestResponse::decode_frame(&answer).unwrap() {
            StreamRequestResponse::Ok(log) => assert!(!log.is_empty(), "with the failover log"),
            other => panic!("a rollback from an empty consumer: {other:?}"),
        }
        let marker = SnapshotMarker::decode_frame(&frame(&mut client, &mut buf).await).unwrap();
        assert_eq!((marker.start_seqno, marker.end_seqno), (1, 3));
        let mut got = Vec::new();
        for _ in 0..3 {
            let m = Mutation::decode_frame(&frame(&mut client, &mut buf).await).unwrap();
            got.push((m.by_seqno, String::from_utf8(m.key).unwrap()));
        }
        assert_eq!(got, [(1, "a".into()), (2, "b".into()), (3, "c".into())]);
        assert_eq!(
            dcp.stats.streams.load(std::sync::atomic::Ordering::Relaxed),
            1
        );

        let _ = stop_tx.send(true);
        tokio::time::timeout(Duration::from_secs(10), producer)
            .await
            .expect("the producer stops on the stop signal")
            .unwrap();
        assert_eq!(
            dcp.stats
                .connections
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    });
}
