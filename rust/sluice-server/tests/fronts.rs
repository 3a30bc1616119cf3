//! Every front in-process, over loopback sockets to a real `Server`: each answers on its own
//! port, and a front that exists only here (a line echo) is registered through the public
//! registry, with no change to the server's files, and gets the driver's bounds like the others.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use sluice_server::driver::{self, Check, Conn, Fault, Flow, Frame, Out, Port, Session};
use sluice_server::front::{Declaration, Front, Registration, Shared};
use sluice_server::server::FRONTS;
use sluice_server::Server;

mod common;

/// The test-only front: each line is answered with itself; lines longer than the frame limit
/// close the connection. It has no login: on a node with users its connections are anonymous,
/// so the pre-login bounds hold them.
struct Echo {
    port: Arc<Port>,
}

static ECHO: Registration = Registration {
    declaration: Declaration {
        name: "echo",
        title: "echo",
        listen_key: "echo_listen",
        default_listen: "",
        tls_listen_key: "echo_tls_listen",
        default_tls_listen: "",
        doc: "A line echo, for the tests.",
        login: false,
        kind: "echo",
        noun: "echo connection",
        kv_port: false,
    },
    max_frame: |max_body| max_body,
    build: |_shared: &Shared<'_>, port| Ok(Arc::new(Echo { port })),
};

struct EchoSession {
    served: bool,
}

impl Session for EchoSession {
    fn check(&mut self, buf: &[u8], max_frame: usize) -> Check {
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) if i < max_frame => Check::Frame(i + 1),
            Some(_) => Check::Bad(Fault::new(true, "a line over the frame limit")),
            None if buf.len() >= max_frame => {
                Check::Bad(Fault::new(true, "a line over the frame limit"))
            }
            None => Check::Need(buf.len() + 1),
        }
    }

    async fn handle(&mut self, frame: &mut Frame<'_>, out: &mut Out) -> Flow {
        out.now.extend_from_slice(frame.bytes());
        Flow::Continue
    }

    fn owed_lsn(&self) -> u64 {
        0
    }

    fn logged_in(&self) -> bool {
        self.served
    }
}

impl Front for Echo {
    fn serve(
        self: Arc<Self>,
        mut conn: Conn,
    ) -> Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            let served = !self.port.users.current().required();
            driver::run(&mut conn, &mut EchoSession { served }).await;
        })
    }

    fn port(&self) -> Arc<Port> {
        self.port.clone()
    }
}

struct Node {
    server: Server,
    _dir: tempfile::TempDir,
}

impl Node {
    fn front(&self, name: &str) -> SocketAddr {
        self.server
            .fronts()
            .iter()
            .find(|r| r.declaration.name == name)
            .and_then(|r| r.addr)
            .unwrap_or_else(|| panic!("{name} listens"))
    }

    fn connect(&self, name: &str) -> TcpStream {
        let s = TcpStream::connect(self.front(name)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }
}

/// A node with every built-in front and the echo front on loopback ports; `extra`: more
/// settings (JSON members).
fn start(extra: &str) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let engine = common::engine(dir.path());
    let json = format!(
        r#"{{"io_threads": 1, "listeners": {{"listen": "127.0.0.1:0",
            "iproto_listen": "127.0.0.1:0", "tank_listen": "127.0.0.1:0",
            "greenstack_listen": "127.0.0.1:0", "echo_listen": "127.0.0.1:0"}}{extra}}}"#
    );
    let config = common::config(&json);
    let mut fronts: Vec<&'static Registration> = FRONTS.to_vec();
    fronts.push(&ECHO);
    let server = Server::start_with(
        Arc::new(engine),
        config,
        Default::default(),
        Vec::new(),
        &fronts,
    )
    .unwrap();
    Node { server, _dir: dir }
}

/// Reads until the peer closes (or 10 s pass); true when it closed.
fn closed(mut s: TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn a_front_registered_outside_the_server_serves_its_port() {
    let node = start("");
    let mut s = node.connect("echo");
    s.write_all(b"hello\nsecond line\n").unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert_eq!(line, "hello\n");
    line.clear();
    r.read_line(&mut line).unwrap();
    assert_eq!(line, "second line\n");
}

#[test]
fn the_test_front_is_held_to_the_prelogin_bounds_on_a_node_with_users() {
    let users = r#", "users": [["ada", {"chap_sha1": "0123456789abcdef0123456789abcdef01234567"}, {"*": ["read"]}, {}]]"#;
    let node = start(users);
    // A short line is answered: a connection that has not logged in may still talk.
    let mut s = node.connect("echo");
    s.write_all(b"hi\n").unwrap();
    let mut got = [0u8; 3];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hi\n");
    // A line over the pre-login frame limit (4 KiB) closes it, however large max_body is.
    s.write_all(&[b'x'; 5000]).unwrap();
    assert!(closed(s), "the connection stayed open");
}

#[test]
fn every_built_in_front_answers_on_its_port() {
    let node = start("");
    // memcached binary: NOOP answered with its opaque.
    let mut kv = node.connect("memcached");
    let mut noop = vec![0x80, 0x0a, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    noop.extend_from_slice(&0xfeedu32.to_be_bytes());
    noop.extend_from_slice(&[0; 8]);
    kv.write_all(&noop).unwrap();
    let mut head = [0u8; 24];
    kv.read_exact(&mut head).unwrap();
    assert_eq!(
        (head[0], head[1], &head[12..16]),
        (0x81, 0x0a, &0xfeedu32.to_be_bytes()[..])
    );
    // memcached text, on the same port: sniffed by its first byte.
    let mut text = node.connect("memcached");
    text.write_all(b"set k 0 0 1\r\nv\r\nget k\r\n").unwrap();
    let mut r = BufReader::new(text);
    let mut lines = Vec::new();
    for _ in 0..4 {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        lines.push(l);
    }
    assert_eq!(lines, ["STORED\r\n", "VALUE k 0 1\r\n", "v\r\n", "END\r\n"]);
    // iproto: the greeting, then a PING answered with code 0 and its sync.
    let mut ip = node.connect("iproto");
    let mut greeting = [0u8; 128];
    ip.read_exact(&mut greeting).unwrap();
    assert!(
        greeting.starts_with(b"Tarantool 2.6.0"),
        "{:?}",
        &greeting[..20]
    );
    // {0x00 (code): 64 (PING), 0x01 (sync): 7}
    ip.write_all(&[0x05, 0x82, 0x00, 0x40, 0x01, 0x07]).unwrap();
    let mut answer = [0u8; 64];
    let n = ip.read(&mut answer).unwrap();
    // The header map as Tarantool writes it: code 0 (uint32), sync 7 (uint64).
    let has = |want: &[u8]| answer[..n].windows(want.len()).any(|w| w == want);
    assert!(has(&[0x00, 0xce, 0, 0, 0, 0]), "{:?}", &answer[..n]);
    assert!(
        has(&[0x01, 0xcf, 0, 0, 0, 0, 0, 0, 0, 7]),
        "{:?}",
        &answer[..n]
    );
    // TANK: the broker's Ping on accept.
    let mut tank = node.connect("tank");
    let mut ping = [0u8; 5];
    tank.read_exact(&mut ping).unwrap();
    assert_eq!(ping, sluice_proto::tank::PING_FRAME);
    // Greenstack: HELLO answered with success and the same opaque.
    let mut gs = node.connect("greenstack");
    let mut hello = Vec::new();
    sluice_proto::greenstack::FrameOut {
        opaque: 9,
        opcode: sluice_proto::greenstack::opcode::HELLO,
        flags: 0,
        status: None,
        flex: &[],
        payload: &[],
    }
    .write(&mut hello);
    gs.write_all(&hello).unwrap();
    let mut len = [0u8; 4];
    gs.read_exact(&mut len).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    gs.read_exact(&mut body).unwrap();
    let mut whole = len.to_vec();
    whole.extend_from_slice(&body);
    let f = sluice_proto::greenstack::Frame::decode(&whole[sluice_proto::greenstack::LENGTH_LEN..])
        .unwrap();
    assert_eq!(
        (f.opaque, f.opcode, f.status),
        (9, sluice_proto::greenstack::opcode::HELLO, Some(0))
    );
}

/// A connection to the front `name` that the front takes as coming from `peer` (a client
/// beyond loopback, which the tests cannot have): served on a runtime of its own.
fn connect_as(node: &Node, name: &str, peer: SocketAddr) -> TcpStream {
    let front = node
        .server
        .fronts()
        .iter()
        .find(|r| r.declaration.name == name)
        .map(|r| r.front.clone())
        .expect("the front runs");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (accepted, _) = listener.accept().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (_stop_tx, stop) = tokio::sync::watch::channel(false);
            accepted.set_nonblocking(true).unwrap();
            let socket = tokio::net::TcpStream::from_std(accepted).unwrap();
            sluice_server::front::serve_accepted(front, socket.into(), peer, stop).await;
        });
    });
    client
}

/// SASL PLAIN for `user`; the reply's status and body.
fn sasl_plain(s: &mut TcpStream, user: &str, password: &str) -> (u16, Vec<u8>) {
    let value = format!("\0{user}\0{password}");
    let mut req = vec![0x80, 0x21];
    req.extend_from_slice(&5u16.to_be_bytes());
    req.extend_from_slice(&[0, 0, 0, 0]);
    req.extend_from_slice(&((5 + value.len()) as u32).to_be_bytes());
    req.extend_from_slice(&[0; 12]);
    req.extend_from_slice(b"PLAIN");
    req.extend_from_slice(value.as_bytes());
    s.write_all(&req).unwrap();
    let mut head = [0u8; 24];
    s.read_exact(&mut head).unwrap();
    let mut body = vec![0u8; u32::from_be_bytes(head[8..12].try_into().unwrap()) as usize];
    s.read_exact(&mut body).unwrap();
    (u16::from_be_bytes([head[6], head[7]]), body)
}

#[test]
fn require_tls_refuses_logins_in_plain_text_from_beyond_loopback() {
    let users = r#", "require_tls": true, "users": [["ada", {"chap_sha1": "0123456789abcdef0123456789abcdef01234567"}, {"*": ["read"]}, {}]]"#;
    let node = start(users);
    let far: SocketAddr = "10.1.2.3:40000".parse().unwrap();
    let (status, body) = sasl_plain(&mut connect_as(&node, "memcached", far), "ada", "pw");
    assert_eq!(status, 0x20);
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("require_tls"), "{body}");
    // From loopback the password is checked (and here, wrong).
    let near: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let (status, body) = sasl_plain(&mut connect_as(&node, "memcached", near), "ada", "pw");
    assert_eq!(status, 0x20);
    assert!(!String::from_utf8_lossy(&body).contains("require_tls"));
}
