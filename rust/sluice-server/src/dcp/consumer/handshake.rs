//! Setting a connection up: connect (over TLS if configured), authenticate, select the
//! bucket, open the DCP connection and send its controls; and the requests answered before any
//! stream runs (high seqnos, failover logs).

use std::collections::{BTreeSet, HashMap};
use std::net::TcpStream;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sluice_proto::dcp::{self, open_flag};
use sluice_proto::mcbp::{self, magic, opcode as op, status, HeaderFields};

use super::flow_control::FlowControl;
use super::frames::encoded;
use super::session::{ConsumerSession, ReadBuffer, MAX_FRAME_BODY};
use super::{Batch, Command, ConsumerConfig, ConsumerError, EventSender, VbucketPosition};
use crate::tls::SyncWriter;

/// An mcbp request frame (the setup's non-DCP requests).
fn frame(opcode: u8, opaque: u32, extras: &[u8], key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let h = HeaderFields {
        magic: magic::REQUEST,
        opcode,
        opaque,
        ..Default::default()
    };
    let _ = mcbp::write_frame(&mut out, &h, &[], extras, key, value);
    out
}

/// A STAT answer's key and value.
pub(super) type StatPair = (Vec<u8>, Vec<u8>);

/// The opaque of every setup request.
const SETUP_OPAQUE: u32 = 0xfeed;

/// Stats a consumer takes from one STAT answer: a producer's groups hold far fewer.
const MAX_STAT_PAIRS: usize = 100_000;

impl ConsumerSession {
    /// Connects to the producer of `config` and sets the DCP connection up; the writing half
    /// of the socket goes into `shared_socket`, where the reader's thread writes too.
    pub(super) fn connect(
        config: &ConsumerConfig,
        events: EventSender,
        commands: Receiver<Command>,
        shared_socket: &Arc<Mutex<Option<SyncWriter>>>,
    ) -> Result<ConsumerSession, ConsumerError> {
        let mut s = ConsumerSession::log_in(config, events, commands, shared_socket)?;
        s.open_dcp()?;
        Ok(s)
    }

    /// Connects, authenticates and selects the bucket: a connection for plain requests.
    pub(super) fn log_in(
        config: &ConsumerConfig,
        events: EventSender,
        commands: Receiver<Command>,
        shared_socket: &Arc<Mutex<Option<SyncWriter>>>,
    ) -> Result<ConsumerSession, ConsumerError> {
        let addr = std::net::ToSocketAddrs::to_socket_addrs(&config.address)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| ConsumerError::Resolve {
                address: config.address.clone(),
            })?;
        // Setup answers come at once from a live producer; a silent one fails the setup.
        let setup_timeout = config
            .setup_timeout
            .unwrap_or_else(|| Duration::from_secs((2 * config.noop_interval as u64).clamp(5, 30)));
        let sock = TcpStream::connect_timeout(&addr, setup_timeout.min(Duration::from_secs(10)))
            .map_err(|source| ConsumerError::Connect {
                address: config.address.clone(),
                source,
            })?;
        let _ = sock.set_nodelay(true);
        sock.set_read_timeout(Some(setup_timeout))
            .map_err(ConsumerError::Socket)?;
        let (sock, writer) =
            crate::tls::connect_client(sock, &config.address, config.tls.as_ref())?;
        *shared_socket.lock() = Some(writer);
        let mut s = ConsumerSession {
            sock,
            writer: shared_socket.clone(),
            config: config.clone(),
            events,
            inline: None,
            commands,
            inbuf: ReadBuffer::default(),
            streams: HashMap::default(),
            batch: Batch::new(),
            touched: BTreeSet::new(),
            last_touched: None,
            last_message: Instant::now(),
            flow: FlowControl::new(config.buffer_size),
            setup_timeout,
        };
        s.sock
            .set_read_timeout(Some(setup_timeout))
            .map_err(ConsumerError::Socket)?;
        if let (Some(user), Some(pass)) = (&config.username, &config.password) {
            let mut plain = vec![0u8];
            plain.extend_from_slice(user.as_bytes());
            plain.push(0);
            plain.extend_from_slice(pass.as_bytes());
            s.call(op::SASL_AUTH, &[], b"PLAIN", &plain, "authentication")?;
        }
        s.call(
            op::SELECT_BUCKET,
            &[],
            config.bucket.as_bytes(),
            &[],
            "SELECT_BUCKET",
        )?;
        Ok(s)
    }

    /// DCP_OPEN as a producer's consumer, and the controls the configuration asks for.
    fn open_dcp(&mut self) -> Result<(), ConsumerError> {
        let config = self.config.clone();
        let s = self;
        let mut flags = open_flag::PRODUCER | open_flag::INCLUDE_DELETE_TIMES;
        if !config.include_values {
            flags |= open_flag::NO_VALUE;
        }
        if config.include_xattrs {
            flags |= open_flag::INCLUDE_XATTRS | open_flag::INCLUDE_DELETED_USER_XATTRS;
        }
        let open = dcp::OpenConnection {
            name: config.name.as_bytes().to_vec(),
            flags,
            reserved: 0,
            value: Vec::new(),
        };
        s.call_frame(
            dcp::opcode::OPEN,
            &encoded(&open, SETUP_OPAQUE)?,
            "DCP_OPEN",
        )?;
        let mut controls = Vec::new();
        if let Some(topic) = &config.topic {
            controls.push(("sluice_topic", topic.clone()));
        }
        controls.extend([
            ("connection_buffer_size", config.buffer_size.to_string()),
            ("enable_expiry_opcode", "true".into()),
        ]);
        if config.noop_interval > 0 {
            controls.push(("enable_noop", "true".into()));
            controls.push(("set_noop_interval", config.noop_interval.to_string()));
        }
        if config.cursor_dropping {
            controls.push(("supports_cursor_dropping", "true".into()));
        }
        if let Some(name) = &config.replica_name {
            controls.push(("consumer_name", name.clone()));
            controls.push(("enable_sync_writes", "true".into()));
            controls.push(("persisted_seqno_acks", "true".into()));
        }
        for (k, v) in controls {
            let control = dcp::Control {
                key: k.as_bytes().to_vec(),
                value: v.into_bytes(),
            };
            s.call_frame(dcp::opcode::CONTROL, &encoded(&control, SETUP_OPAQUE)?, k)?;
        }
        if let Some(address) = &config.kv_address {
            // Only a sluice producer knows this control; another refuses it, and streams the
            // same (its cluster map, if any, does not come from here).
            let control = dcp::Control {
                key: b"sluice_kv_address".to_vec(),
                value: address.clone().into_bytes(),
            };
            let frame = encoded(&control, SETUP_OPAQUE)?;
            if let Err(e) = s.call_frame(dcp::opcode::CONTROL, &frame, "sluice_kv_address") {
                log::debug!("the producer does not take this node's KV address: {e}");
            }
        }
        Ok(())
    }

    /// The vbuckets in `state` (a `VbucketState` code) and their high seqnos.
    pub(super) fn high_seqnos(&mut self, state: u32) -> Result<Vec<(u16, u64)>, ConsumerError> {
        let r = self.call(
            op::GET_ALL_VB_SEQNOS,
            &state.to_be_bytes(),
            &[],
            &[],
            "GET_ALL_VB_SEQNOS",
        )?;
        Ok(r.chunks_exact(10)
            .map(|c| {
                let vbucket = u16::from_be_bytes([c[0], c[1]]);
                (
                    vbucket,
                    u64::from_be_bytes(c[2..10].try_into().expect("8 bytes")),
                )
            })
            .collect())
    }

    /// The vbuckets in `state` (a `VbucketState` code): their high seqnos and failover logs,
    /// the logs asked for all at once (one round trip, not one per vbucket).
    pub(super) fn vbucket_positions(
        &mut self,
        state: u32,
    ) -> Result<Vec<VbucketPosition>, ConsumerError> {
        let seqnos = self.high_seqnos(state)?;
        let mut reqs = Vec::with_capacity(seqnos.len() * 24);
        for &(vbucket, _) in &seqnos {
            reqs.extend_from_slice(&encoded(&dcp::GetFailoverLog { vbucket }, SETUP_OPAQUE)?);
        }
        self.send(&reqs)
            .map_err(|e| ConsumerError::during("GET_FAILOVER_LOG", e))?;
        let mut out = Vec::with_capacity(seqnos.len());
        for (vbucket, high_seqno) in seqnos {
            let what = format!("GET_FAILOVER_LOG of vbucket {vbucket}");
            let v = self.answer(dcp::opcode::GET_FAILOVER_LOG, &what)?;
            let failover = dcp::decode_failover_log(&v)
                .map_err(|source| ConsumerError::FailoverLog { vbucket, source })?
                .into_iter()
                .map(|e| (e.vbucket_uuid, e.seqno))
                .collect();
            out.push(VbucketPosition {
                vbucket,
                high_seqno,
                failover,
            });
        }
        Ok(out)
    }

    /// A setup request answered before any stream runs; returns the reply's value.
    pub(super) fn call(
        &mut self,
        opcode: u8,
        extras: &[u8],
        key: &[u8],
        value: &[u8],
        what: &str,
    ) -> Result<Vec<u8>, ConsumerError> {
        let req = frame(opcode, SETUP_OPAQUE, extras, key, value);
        self.call_frame(opcode, &req, what)
    }

    /// STAT `group`: its (key, value) pairs, up to the answer's empty-keyed end (within the
    /// setup timeout, and `MAX_STAT_PAIRS` of them).
    pub(super) fn stats(&mut self, group: &str) -> Result<Vec<StatPair>, ConsumerError> {
        let what = format!("STAT {group}");
        let req = frame(op::STAT, SETUP_OPAQUE, &[], group.as_bytes(), &[]);
        self.send(&req)
            .map_err(|e| ConsumerError::during(&what, e))?;
        let mut out = Vec::new();
        let deadline = Instant::now() + self.setup_timeout;
        loop {
            if out.len() >= MAX_STAT_PAIRS {
                return Err(ConsumerError::during(
                    &what,
                    ConsumerError::BadAnswer(format!("more than {MAX_STAT_PAIRS} stats")),
                ));
            }
            let f = self
                .next_frame_by(deadline)
                .map_err(|e| ConsumerError::during(&what, e))?;
            let r = mcbp::parse_response(&f)
                .map_err(|e| ConsumerError::during(&what, ConsumerError::Frame(e)))?;
            if r.opcode != op::STAT {
                continue;
            }
            if r.status != status::SUCCESS {
                return Err(ConsumerError::Refused {
                    what,
                    status: r.status,
                    message: String::from_utf8_lossy(r.value).into_owned(),
                });
            }
            if r.key.is_empty() {
                return Ok(out);
            }
            out.push((r.key.to_vec(), r.value.to_vec()));
        }
    }

    /// Sends one encoded request and waits for its answer (by opcode): its value on success.
    fn call_frame(&mut self, opcode: u8, req: &[u8], what: &str) -> Result<Vec<u8>, ConsumerError> {
        self.send(req).map_err(|e| ConsumerError::during(what, e))?;
        self.answer(opcode, what)
    }

    /// The next answer to an `opcode` request sent earlier; its value when it succeeded.
    fn answer(&mut self, opcode: u8, what: &str) -> Result<Vec<u8>, ConsumerError> {
        let deadline = Instant::now() + self.setup_timeout;
        loop {
            let f = self
                .next_frame_by(deadline)
                .map_err(|e| ConsumerError::during(what, e))?;
            let r = mcbp::parse_response(&f)
                .map_err(|e| ConsumerError::during(what, ConsumerError::Frame(e)))?;
            if r.opcode != opcode {
                continue;
            }
            if r.status != status::SUCCESS {
                return Err(ConsumerError::Refused {
                    what: what.to_string(),
                    status: r.status,
                    message: String::from_utf8_lossy(r.value).into_owned(),
                });
            }
            return Ok(r.value.to_vec());
        }
    }

    /// The next frame, if one arrives by `deadline`: a producer that trickles frames which
    /// are not the answer does not hold the setup past it.
    fn next_frame_by(&mut self, deadline: Instant) -> Result<Vec<u8>, ConsumerError> {
        if Instant::now() > deadline {
            return Err(ConsumerError::NoAnswer);
        }
        self.next_frame_blocking()
    }

    fn next_frame_blocking(&mut self) -> Result<Vec<u8>, ConsumerError> {
        loop {
            if let Some(n) =
                mcbp::frame_len(self.inbuf.data(), MAX_FRAME_BODY).map_err(ConsumerError::Frame)?
            {
                let f = self.inbuf.data()[..n].to_vec();
                self.inbuf.consume(n);
                return Ok(f);
            }
            // Setup reads wait `setup_timeout` each: nothing in that time is a dead producer.
            if self.read_more().map_err(ConsumerError::Socket)? == 0 {
                return Err(ConsumerError::NoAnswer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::sync::mpsc;

    use sluice_proto::dcp::DcpRequest;

    use super::*;

    /// A producer on a real socket that hands each request to `reply` (which writes its
    /// answer, if any) and hands back every frame it received once the consumer hangs up.
    fn producer_replying(
        reply: impl Fn(&mcbp::Request<'_>, &mut TcpStream) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<Vec<Vec<u8>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let thread = std::thread::spawn(move || {
            let (mut sock, _) = listener.accept().unwrap();
            let mut frames = Vec::new();
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                while let Some(n) = mcbp::frame_len(&buf, 1 << 20).unwrap() {
                    let frame: Vec<u8> = buf.drain(..n).collect();
                    reply(&mcbp::parse_request(&frame).unwrap(), &mut sock);
                    frames.push(frame);
                }
                match sock.read(&mut chunk) {
                    Ok(0) | Err(_) => return frames,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
        });
        (address, thread)
    }

    /// A producer that answers each request with `answer(request)` (status, value).
    fn fake_producer(
        answer: impl Fn(&mcbp::Request<'_>) -> (u16, Vec<u8>) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<Vec<Vec<u8>>>) {
        producer_replying(move |req, sock| {
            let (st, value) = answer(req);
            let _ = sock.write_all(&response(req.opcode, req.opaque, st, &value));
        })
    }

    /// A response frame of a status and a value.
    fn response(opcode: u8, opaque: u32, st: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        mcbp::write_response(&mut out, opcode, opaque, st, 0, value);
        out
    }

    fn session(config: &ConsumerConfig) -> Result<ConsumerSession, ConsumerError> {
        let (_ctx, crx) = mpsc::channel();
        let socket = Arc::new(Mutex::new(None));
        ConsumerSession::connect(config, EventSender::unread(), crx, &socket)
    }

    fn hang_up(s: ConsumerSession) {
        let _ = s.sock.shutdown(std::net::Shutdown::Both);
    }

    fn request(opcode: u8, key: &[u8], value: &[u8]) -> Vec<u8> {
        let h = HeaderFields {
            magic: magic::REQUEST,
            opcode,
            opaque: 0xfeed,
            ..Default::default()
        };
        let mut out = Vec::new();
        mcbp::write_frame(&mut out, &h, &[], &[], key, value).unwrap();
        out
    }

    fn control(key: &str, value: &str) -> Vec<u8> {
        let c = dcp::Control {
            key: key.into(),
            value: value.into(),
        };
        let mut out = Vec::new();
        c.encode(&mut out, 0xfeed).unwrap();
        out
    }

    #[test]
    fn setup_frames_are_the_protocol_encoders() {
        let (address, producer) = fake_producer(|_| (status::SUCCESS, Vec::new()));
        let config = ConsumerConfig {
            address,
            bucket: "beer".into(),
            username: Some("ada".into()),
            password: Some("secret".into()),
            name: "sluice:test".into(),
            buffer_size: 1000,
            noop_interval: 7,
            include_values: false,
            cursor_dropping: true,
            replica_name: Some("replica-1".into()),
            ..ConsumerConfig::default()
        };
        hang_up(session(&config).unwrap());
        let frames = producer.join().unwrap();

        let mut open = Vec::new();
        dcp::OpenConnection {
            name: b"sluice:test".to_vec(),
            flags: open_flag::PRODUCER | open_flag::INCLUDE_DELETE_TIMES | open_flag::NO_VALUE,
            reserved: 0,
            value: Vec::new(),
        }
        .encode(&mut open, 0xfeed)
        .unwrap();
        let want = vec![
            request(op::SASL_AUTH, b"PLAIN", b"\0ada\0secret"),
            request(op::SELECT_BUCKET, b"beer", b""),
            open,
            control("connection_buffer_size", "1000"),
            control("enable_expiry_opcode", "true"),
            control("enable_noop", "true"),
            control("set_noop_interval", "7"),
            control("supports_cursor_dropping", "true"),
            control("consumer_name", "replica-1"),
            control("enable_sync_writes", "true"),
            control("persisted_seqno_acks", "true"),
        ];
        assert_eq!(frames, want);
    }

    #[test]
    fn plain_setup_sends_no_credentials_or_optional_controls() {
        let (address, producer) = fake_producer(|_| (status::SUCCESS, Vec::new()));
        let config = ConsumerConfig {
            address,
            noop_interval: 0,
            ..ConsumerConfig::default()
        };
        hang_up(session(&config).unwrap());
        let frames = producer.join().unwrap();
        let opcodes: Vec<u8> = frames.iter().map(|f| f[1]).collect();
        assert_eq!(
            opcodes,
            [
                op::SELECT_BUCKET,
                dcp::opcode::OPEN,
                dcp::opcode::CONTROL,
                dcp::opcode::CONTROL
            ]
        );
        assert_eq!(frames[3], control("enable_expiry_opcode", "true"));
    }

    #[test]
    fn a_refused_setup_request_says_which_and_why() {
        let (address, producer) = fake_producer(|req| match req.opcode {
            op::SELECT_BUCKET => (status::KEY_ENOENT, b"no bucket 'beer'".to_vec()),
            _ => (status::SUCCESS, Vec::new()),
        });
        let config = ConsumerConfig {
            address,
            bucket: "beer".into(),
            ..ConsumerConfig::default()
        };
        let err = session(&config).err().expect("refused");
        assert!(matches!(
            &err,
            ConsumerError::Refused { status: 1, what, .. } if what == "SELECT_BUCKET"
        ));
        assert_eq!(
            err.to_string(),
            "SELECT_BUCKET refused with status 0x01: no bucket 'beer'"
        );
        producer.join().unwrap();
    }

    #[test]
    fn a_producer_that_hangs_up_fails_the_request_it_got() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let producer = std::thread::spawn(move || {
            let (mut sock, _) = listener.accept().unwrap();
            let mut head = [0u8; 24];
            sock.read_exact(&mut head).unwrap();
            let body_len = u32::from_be_bytes(head[8..12].try_into().unwrap());
            let mut body = vec![0u8; body_len as usize];
            // All of it: closing with bytes unread would reset the connection instead.
            sock.read_exact(&mut body).unwrap();
            // Gone without an answer.
        });
        let err = session(&ConsumerConfig {
            address,
            ..ConsumerConfig::default()
        })
        .err()
        .expect("no answer");
        producer.join().unwrap();
        assert_eq!(
            err.to_string(),
            "SELECT_BUCKET: the producer closed the connection"
        );
    }

    #[test]
    fn vbucket_positions_asks_for_seqnos_then_failover_logs() {
        let (address, producer) = fake_producer(|req| match req.opcode {
            op::GET_ALL_VB_SEQNOS => {
                let mut v = Vec::new();
                for (vb, seqno) in [(3u16, 40u64), (9, 0)] {
                    v.extend_from_slice(&vb.to_be_bytes());
                    v.extend_from_slice(&seqno.to_be_bytes());
                }
                (status::SUCCESS, v)
            }
            dcp::opcode::GET_FAILOVER_LOG if req.vbucket == 3 => {
                let mut v = Vec::new();
                for (uuid, seqno) in [(77u64, 20u64), (5, 0)] {
                    v.extend_from_slice(&uuid.to_be_bytes());
                    v.extend_from_slice(&seqno.to_be_bytes());
                }
                (status::SUCCESS, v)
            }
            // A log of 15 bytes: not whole entries.
            dcp::opcode::GET_FAILOVER_LOG => (status::SUCCESS, vec![0; 15]),
            _ => (status::SUCCESS, Vec::new()),
        });
        let config = ConsumerConfig {
            address,
            ..ConsumerConfig::default()
        };
        let mut s = session(&config).unwrap();
        let err = s.vbucket_positions(1).unwrap_err();
        assert!(matches!(err, ConsumerError::FailoverLog { vbucket: 9, .. }));
        assert!(
            err.to_string()
                .starts_with("GET_FAILOVER_LOG of vbucket 9: "),
            "{err}"
        );
        hang_up(s);
        let frames = producer.join().unwrap();
        let mut state_active = request(op::GET_ALL_VB_SEQNOS, b"", b"");
        // Extras: the state asked for (1: active).
        state_active[4] = 4;
        state_active[11] = 4;
        state_active.extend_from_slice(&1u32.to_be_bytes());
        let mut failover_log = Vec::new();
        dcp::GetFailoverLog { vbucket: 3 }
            .encode(&mut failover_log, 0xfeed)
            .unwrap();
        assert_eq!(frames[frames.len() - 3], state_active);
        assert_eq!(frames[frames.len() - 2], failover_log);
    }

    /// A producer that answers setup requests with success and a STAT with `stat(socket)`.
    fn stat_producer(
        stat: impl Fn(&mut TcpStream) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<Vec<Vec<u8>>>) {
        producer_replying(move |req, sock| {
            if req.opcode == op::STAT {
                stat(sock);
            } else {
                let ok = response(req.opcode, req.opaque, status::SUCCESS, b"");
                let _ = sock.write_all(&ok);
            }
        })
    }

    /// A setup of `beer` at `address` whose exchanges may take `setup_timeout` each.
    fn setup_at(address: String, setup_timeout: Duration) -> ConsumerConfig {
        ConsumerConfig {
            address,
            bucket: "beer".into(),
            setup_timeout: Some(setup_timeout),
            ..ConsumerConfig::default()
        }
    }

    #[test]
    fn a_stat_answer_without_end_is_refused_past_its_bound() {
        let (address, producer) = stat_producer(|sock| {
            // One stat: its name in the key, its value in the value.
            let h = HeaderFields {
                magic: magic::RESPONSE,
                opcode: op::STAT,
                opaque: SETUP_OPAQUE,
                ..Default::default()
            };
            let mut pair = Vec::new();
            mcbp::write_frame(&mut pair, &h, &[], &[], b"key", b"value").unwrap();
            let all: Vec<u8> = pair.repeat(MAX_STAT_PAIRS + 1);
            let _ = sock.write_all(&all);
        });
        let mut s = session(&setup_at(address, Duration::from_secs(10))).unwrap();
        let e = s.stats("topics").unwrap_err();
        assert!(e.to_string().contains("more than 100000 stats"), "{e}");
        hang_up(s);
        producer.join().unwrap();
    }

    #[test]
    fn a_setup_answer_trickled_past_its_deadline_is_no_answer() {
        // Frames that are not the answer, one every 50 ms: each read gets something, so only
        // a deadline for the whole exchange ends the wait.
        let (address, producer) = stat_producer(|sock| {
            for _ in 0..200 {
                let noop = response(op::NOOP, SETUP_OPAQUE, status::SUCCESS, b"");
                if sock.write_all(&noop).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let mut s = session(&setup_at(address, Duration::from_millis(500))).unwrap();
        let started = Instant::now();
        let e = s.stats("topics").unwrap_err();
        assert!(e.to_string().contains("no answer"), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        hang_up(s);
        producer.join().unwrap();
    }
}
