//! The KV front in-process: frames in through `KvSession::handle`, reply bytes out, over an
//! engine in a temporary directory and no socket (the server and its other fronts not built).

use std::collections::HashMap;
use std::sync::Arc;

use sluice_proto::mcbp::{self, feature, magic, opcode as op, status, HeaderFields};

use super::{Flow, KvContext, KvSession};
use crate::auth::{Credentials, User, Users, READ};

// pbkdf2-sha256 of "secret", 1000 rounds (the hash auth's tests check independently).
const HASH: &str = "pbkdf2-sha256:1000:30313233343536373839616263646566:b622961f2e0500609613c827e86b4a85ac43d8e79e0145165c54ffa7569a365f";

fn context(dir: &std::path::Path, users: Users) -> Arc<KvContext> {
    Arc::new(KvContext::scratch(dir, users).expect("engine"))
}

fn request(opcode: u8, opaque: u32, extras: &[u8], key: &[u8], value: &[u8]) -> Vec<u8> {
    let h = HeaderFields {
        magic: magic::REQUEST,
        opcode,
        opaque,
        ..Default::default()
    };
    let mut out = Vec::new();
    mcbp::write_frame(&mut out, &h, &[], extras, key, value).expect("fits");
    out
}

/// A response as (opcode, status, opaque, value).
type Answer = (u8, u16, u32, Vec<u8>);

/// Every response frame in `out`.
fn responses(out: &[u8]) -> Vec<Answer> {
    let mut rest = out;
    let mut all = Vec::new();
    while let Some(n) = mcbp::frame_len(rest, usize::MAX).expect("well framed") {
        let r = mcbp::parse_response(&rest[..n]).expect("a response");
        all.push((r.opcode, r.status, r.opaque, r.value.to_vec()));
        rest = &rest[n..];
    }
    assert!(rest.is_empty(), "a partial frame left over");
    all
}

fn run(session: &mut KvSession, frame: &[u8]) -> (Vec<Answer>, bool) {
    let mut out = Vec::new();
    let flow = session.handle(frame, &mut out);
    (responses(&out), matches!(flow, Flow::Continue))
}

#[test]
fn set_then_get_reads_back_and_a_quiet_miss_is_silent() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = KvSession::new(context(dir.path(), Users::default()));
    let extras = [0u8; 8]; // flags 0, expiry 0
    let (r, _) = run(&mut s, &request(op::SET, 1, &extras, b"k", b"hello"));
    assert_eq!(r, vec![(op::SET, status::SUCCESS, 1, vec![])]);
    let (r, _) = run(&mut s, &request(op::GET, 2, &[], b"k", &[]));
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].1, r[0].2, r[0].3.as_slice()),
        (status::SUCCESS, 2, &b"hello"[..])
    );
    let (r, _) = run(&mut s, &request(op::GETQ, 3, &[], b"missing", &[]));
    assert!(r.is_empty(), "GETQ of a missing key answers nothing: {r:?}");
    let (r, _) = run(&mut s, &request(op::GET, 4, &[], b"missing", &[]));
    assert_eq!((r[0].1, r[0].2), (status::KEY_ENOENT, 4));
}

#[test]
fn a_frame_whose_sections_overrun_its_body_gets_einval_with_its_opaque() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = KvSession::new(context(dir.path(), Users::default()));
    let mut frame = request(op::GET, 9, &[], b"key", &[]);
    frame[3] = 200; // key length past the 3-byte body
    let (r, more) = run(&mut s, &frame);
    assert_eq!((r[0].0, r[0].1, r[0].2), (op::GET, status::EINVAL, 9));
    assert!(
        more,
        "the connection goes on: the frame was framed by its body length"
    );
}

#[test]
fn stream_requests_are_handed_on_unanswered() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = KvSession::new(context(dir.path(), Users::default()));
    for opcode in [
        sluice_proto::dcp::opcode::OPEN,
        sluice_proto::tap::opcode::CONNECT,
    ] {
        let mut out = Vec::new();
        let flow = s.handle(&request(opcode, 5, &[0; 8], b"name", &[]), &mut out);
        assert!(matches!(flow, Flow::OpenStream), "opcode {opcode:#x}");
        assert!(
            out.is_empty(),
            "the stream front answers it, not the KV front"
        );
        // On a connection that streams already, the same request is refused.
        let flow = s.handle_streaming(&request(opcode, 6, &[0; 8], b"name", &[]), &mut out);
        assert!(matches!(flow, Flow::Continue));
        let refused = (
            opcode,
            status::EINVAL,
            6,
            b"this connection is open already".to_vec(),
        );
        assert_eq!(responses(&out), vec![refused]);
    }
}

#[test]
fn users_log_in_with_sasl_plain_and_get_only_their_permissions() {
    let dir = tempfile::tempdir().unwrap();
    let mut credentials = Credentials::default();
    credentials.add("password_hash", HASH).unwrap();
    let users = Users::new(vec![User {
        name: "reader".into(),
        credentials,
        buckets: HashMap::from([("default".into(), READ)]),
        topics: Vec::new(),
    }]);
    let mut s = KvSession::new(context(dir.path(), users));
    let (r, _) = run(&mut s, &request(op::GET, 1, &[], b"k", &[]));
    assert_eq!(r[0].1, status::AUTH_ERROR, "nothing before login");
    let (r, _) = run(
        &mut s,
        &request(op::SASL_AUTH, 2, &[], b"PLAIN", b"\0reader\0wrong"),
    );
    assert_eq!(r[0].1, status::AUTH_ERROR);
    assert!(!s.authenticated());
    let (r, _) = run(
        &mut s,
        &request(op::SASL_AUTH, 3, &[], b"PLAIN", b"\0reader\0secret"),
    );
    assert_eq!(
        (r[0].1, r[0].3.as_slice()),
        (status::SUCCESS, &b"Authenticated"[..])
    );
    let (r, _) = run(&mut s, &request(op::GET, 4, &[], b"k", &[]));
    assert_eq!(r[0].1, status::KEY_ENOENT, "read is allowed");
    let (r, _) = run(&mut s, &request(op::SET, 5, &[0; 8], b"k", b"v"));
    assert_eq!(r[0].1, status::EACCESS, "write is not");
    assert!(String::from_utf8_lossy(&r[0].3).contains("lacks that permission"));
}

#[test]
fn with_xerror_an_error_is_a_json_context() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = KvSession::new(context(dir.path(), Users::default()));
    let hello = feature::XERROR.to_be_bytes();
    let (r, _) = run(&mut s, &request(op::HELLO, 1, &[], b"test", &hello));
    assert_eq!(r[0].3, hello.to_vec(), "XERROR is enabled");
    let (r, _) = run(&mut s, &request(0xEE, 2, &[], &[], &[]));
    assert_eq!(r[0].1, status::UNKNOWN_COMMAND);
    assert_eq!(
        String::from_utf8_lossy(&r[0].3),
        r#"{"error":{"context":"unknown command 0xee"}}"#
    );
}
