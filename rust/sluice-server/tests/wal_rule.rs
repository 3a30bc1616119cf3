//! The rule the connection driver keeps for every front: a reply that acknowledges a write
//! leaves only once the WAL holds the write, and a reply that acknowledges none does not wait
//! for it. Shown on a real server in-process with the WAL writer slowed down by a fault
//! injection point (`errinj::WAL_WRITE_DELAY_MS`); the injection table is the process's, so
//! this file holds one test.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_core::errinj;
use sluice_server::Server;

mod common;

fn request(opcode: u8, opaque: u32, extras: &[u8], key: &[u8], value: &[u8]) -> Vec<u8> {
    let body = extras.len() + key.len() + value.len();
    let mut f = vec![0x80, opcode];
    f.extend_from_slice(&(key.len() as u16).to_be_bytes());
    f.push(extras.len() as u8);
    f.extend_from_slice(&[0, 0, 0]);
    f.extend_from_slice(&(body as u32).to_be_bytes());
    f.extend_from_slice(&opaque.to_be_bytes());
    f.extend_from_slice(&[0; 8]);
    f.extend_from_slice(extras);
    f.extend_from_slice(key);
    f.extend_from_slice(value);
    f
}

fn set(opaque: u32, key: &[u8]) -> Vec<u8> {
    request(0x01, opaque, &[0; 8], key, b"v")
}

fn get(opaque: u32, key: &[u8]) -> Vec<u8> {
    request(0x00, opaque, &[], key, &[])
}

/// Reads one response: (opaque, status).
fn response(s: &mut TcpStream) -> (u32, u16) {
    let mut head = [0u8; 24];
    s.read_exact(&mut head).unwrap();
    let body = u32::from_be_bytes(head[8..12].try_into().unwrap()) as usize;
    let mut rest = vec![0u8; body];
    s.read_exact(&mut rest).unwrap();
    (
        u32::from_be_bytes(head[12..16].try_into().unwrap()),
        u16::from_be_bytes(head[6..8].try_into().unwrap()),
    )
}

#[test]
fn a_write_is_answered_once_the_wal_holds_it_and_a_read_meanwhile_is_not_held_up() {
    let dir = tempfile::tempdir().unwrap();
    let engine = common::engine(dir.path());
    let config = common::config(r#"{"listeners": {"listen": "127.0.0.1:0"}, "io_threads": 2}"#);
    let server = Server::start(Arc::new(engine), config).unwrap();
    let connect = || {
        let s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    };
    let (mut writer, mut reader) = (connect(), connect());
    writer.write_all(&set(1, b"present")).unwrap();
    assert_eq!(response(&mut writer), (1, 0));

    errinj::WAL_WRITE_DELAY_MS.set(1500);
    let sent = Instant::now();
    // The write, then on the same connection a read: memcached answers in request order, so
    // the read's reply waits behind the write's.
    let mut pipelined = set(2, b"slow");
    pipelined.extend_from_slice(&get(3, b"present"));
    writer.write_all(&pipelined).unwrap();
    // Meanwhile another connection reads: nothing it is told acknowledges a write.
    std::thread::sleep(Duration::from_millis(100));
    reader.write_all(&get(4, b"present")).unwrap();
    assert_eq!(response(&mut reader), (4, 0));
    let read_at = sent.elapsed();
    assert_eq!(response(&mut writer), (2, 0));
    let written_at = sent.elapsed();
    assert_eq!(response(&mut writer), (3, 0));
    errinj::WAL_WRITE_DELAY_MS.set(0);
    assert!(
        read_at < written_at,
        "the other connection's read ({read_at:?}) came after the write's reply ({written_at:?})"
    );
    assert!(
        written_at >= Duration::from_millis(1400),
        "the write was answered after {written_at:?}, before the WAL could hold it"
    );
    assert!(server.local_addr().port() > 0);
}
