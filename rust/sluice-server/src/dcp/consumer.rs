//! A native DCP consumer: one connection to a producer (sluice or Couchbase), streams for
//! chosen vbucket, on a thread of its own that answers NOOPs, acknowledges the flow-control
//! window, follows rollbacks, and hands columnar batches to the reader through a bounded
//! channel (a slow reader stops the acknowledgements, and so the producer). Each batch carries
//! the session state after it, so that what the reader has seen is what it resumes from.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::net::TcpStream;

use crate::tls::{SyncReader, SyncWriter};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_proto::dcp::{
    self, opcode, open_flag, snapshot_flag, stream_end_reason, stream_flag, DcpRequest,
    DcpResponse, DocumentRef, FailoverLogEntry, SeqnoAcknowledged, SetVbucketState, SnapshotMarker,
    StreamEnd, StreamRequest, StreamRequestResponse,
};
use sluice_proto::mcbp::{self, magic, opcode as op, status, HeaderFields};

use crate::policy::{AckStats, Answer, Pending, PolicyHost, PolicyKind, Question};

/// Largest frame accepted from the producer (a 20 MiB document plus its header and key).
const MAX_FRAME_BODY: usize = 21 << 20;
const READ_CHUNK: usize = 256 << 10;
/// The smallest buffer an AckPolicy may set: room for a few ordinary frames.
const MIN_BUFFER_SIZE: u32 = 64 << 10;
/// How often the thread looks at its commands while the socket is quiet.
const POLL: Duration = Duration::from_millis(100);

/// Where one vbucket's stream stands: the failover log it follows (newest first), the last
/// seqno seen and the snapshot that seqno belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Position {
    pub failover: Vec<(u64, u64)>,
    pub seqno: u64,
    pub snap_start: u64,
    pub snap_end: u64,
    /// Whether the current snapshot is a disk (backfill) snapshot.
    pub disk: bool,
}

impl Position {
    /// The stream request that resumes here: a snapshot fully seen (or not begun) is a
    /// boundary, so only a partly seen one is sent as a range.
    fn resume(&self) -> (u64, u64, u64, u64) {
        let uuid = self.failover.first().map_or(0, |e| e.0);
        let s = self.seqno;
        if s < self.snap_start || s >= self.snap_end {
            (s, uuid, s, s)
        } else {
            (s, uuid, self.snap_start, self.snap_end)
        }
    }

    /// Rolls back to `seqno`: failover entries past it are dropped (doc: building a simple
    /// client); a rollback to 0 forgets the history, so the next request is "no history".
    fn rolled_back(&self, seqno: u64) -> Position {
        if seqno == 0 {
            return Position::default();
        }
        Position {
            failover: self
                .failover
                .iter()
                .copied()
                .filter(|e| e.1 <= seqno)
                .collect(),
            seqno,
            snap_start: seqno,
            snap_end: seqno,
            disk: false,
        }
    }
}

/// Per-vbucket positions: what `sluice tail --state` and `Stream.state()` save and restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionState {
    pub vbuckets: BTreeMap<u16, Position>,
}

impl SessionState {
    pub fn to_json(&self) -> Value {
        let vbs: serde_json::Map<String, Value> = self
            .vbuckets
            .iter()
            .map(|(vb, p)| {
                (
                    vb.to_string(),
                    json!({
                        "failover_log": p.failover.iter().map(|e| json!([e.0, e.1])).collect::<Vec<_>>(),
                        "seqno": p.seqno,
                        "snapshot": [p.snap_start, p.snap_end],
                    }),
                )
            })
            .collect();
        json!({"version": 1, "vbuckets": vbs})
    }

    pub fn from_json(v: &Value) -> Result<SessionState, String> {
        let bad = |what: &str| format!("session state: {what}");
        if v.get("version").and_then(Value::as_u64) != Some(1) {
            return Err(bad("expected \"version\": 1"));
        }
        let vbs = v
            .get("vbuckets")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("\"vbuckets\" must be an object"))?;
        let mut state = SessionState::default();
        for (k, p) in vbs {
            let vb: u16 = k
                .parse()
                .map_err(|_| bad(&format!("vbucket key '{k}' is not a number")))?;
            let num = |x: Option<&Value>, what: &str| {
                x.and_then(Value::as_u64).ok_or_else(|| {
                    bad(&format!("vbucket {vb}: {what} must be an unsigned integer"))
                })
            };
            let mut failover = Vec::new();
            for e in p
                .get("failover_log")
                .and_then(Value::as_array)
                .ok_or_else(|| bad(&format!("vbucket {vb}: failover_log must be a list")))?
            {
                let pair = e.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                    bad(&format!("vbucket {vb}: failover entries are [uuid, seqno]"))
                })?;
                failover.push((num(pair.first(), "uuid")?, num(pair.get(1), "seqno")?));
            }
            let snap = p
                .get("snapshot")
                .and_then(Value::as_array)
                .filter(|a| a.len() == 2)
                .ok_or_else(|| bad(&format!("vbucket {vb}: snapshot must be [start, end]")))?;
            let pos = Position {
                failover,
                seqno: num(p.get("seqno"), "seqno")?,
                snap_start: num(snap.first(), "snapshot start")?,
                snap_end: num(snap.get(1), "snapshot end")?,
                disk: false,
            };
            state.vbuckets.insert(vb, pos);
        }
        Ok(state)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RollbackMode {
    /// Hand the rollback to the reader and stop the vbucket until it says resume.
    Ask,
    /// Roll back and request again at once (the batch reports it).
    Resume,
}

#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub address: String,
    pub bucket: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub name: String,
    /// None: every active vbucket.
    pub vbuckets: Option<Vec<u16>>,
    /// Where vbuckets without a saved position start: the beginning or now.
    pub from_now: bool,
    /// End each stream at the high seqno it had when requested.
    pub to_latest: bool,
    /// Streams that end at a given seqno (a range read), whatever `to_latest` says; documents
    /// past it (the rest of its snapshot) are not handed over.
    pub end_seqnos: BTreeMap<u16, u64>,
    /// How long connecting and each setup answer may take; None: twice the NOOP interval,
    /// 5 to 30 s.
    pub setup_timeout: Option<Duration>,
    pub state: SessionState,
    pub rollback: RollbackMode,
    pub batch_size: usize,
    pub buffer_size: u32,
    pub noop_interval: u32,
    pub include_values: bool,
    /// Ask the producer to end a stream that falls too far behind instead of backfilling it.
    pub cursor_dropping: bool,
    /// A replica's name: the connection does sync replication (controls consumer_name,
    /// enable_sync_writes, persisted_seqno_acks), and the reader sends SEQNO_ACKNOWLEDGED.
    pub replica_name: Option<String>,
    /// Request takeover streams: the producer hands the vbuckets over once caught up.
    pub takeover: bool,
    /// A stream request refused with NOT_MY_VBUCKET (the vbucket is dead there or not there)
    /// ends that vbucket's stream, reported in `Batch::refused`, and the other streams go on;
    /// otherwise any refusal fails the connection.
    pub end_refused_streams: bool,
    /// Where an AckPolicy plugin may resize the flow control (buffer size, acknowledgement
    /// interval) after each buffer acknowledgement.
    pub flow_control: Option<Arc<PolicyHost>>,
    /// Connect over TLS (the producer's certificate is verified; the host of `address` is the
    /// name it must carry).
    pub tls: Option<crate::tls::ClientTls>,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            address: "127.0.0.1:11210".into(),
            bucket: "default".into(),
            username: None,
            password: None,
            name: "sluice:consumer".into(),
            vbuckets: None,
            from_now: false,
            to_latest: false,
            end_seqnos: BTreeMap::new(),
            setup_timeout: None,
            state: SessionState::default(),
            rollback: RollbackMode::Ask,
            batch_size: 8192,
            buffer_size: 16 << 20,
            noop_interval: 20,
            include_values: true,
            cursor_dropping: false,
            replica_name: None,
            takeover: false,
            end_refused_streams: false,
            flow_control: None,
            tls: None,
        }
    }
}

/// Documents in columns (Arrow's layout: offsets then bytes), and the state after them.
#[derive(Debug, Default)]
pub struct Batch {
    pub vbucket: Vec<u16>,
    pub seqno: Vec<u64>,
    /// 0 mutation, 1 deletion, 2 expiration.
    pub op: Vec<u8>,
    pub cas: Vec<u64>,
    pub rev_seqno: Vec<u64>,
    pub flags: Vec<u32>,
    pub expiry: Vec<u32>,
    pub datatype: Vec<u8>,
    pub key_offsets: Vec<i32>,
    pub keys: Vec<u8>,
    pub value_offsets: Vec<i64>,
    pub values: Vec<u8>,
    /// Positions after this batch of the vbuckets it touched.
    pub positions: Vec<(u16, Position)>,
    /// Streams that ended, with the STREAM_END reason.
    pub ended: Vec<(u16, u32)>,
    /// Stream requests refused with NOT_MY_VBUCKET (`ConsumerConfig::end_refused_streams`):
    /// those streams are over.
    pub refused: Vec<u16>,
    /// Rollbacks followed automatically (RollbackMode::Resume): vbucket and seqno.
    pub rollbacks: Vec<(u16, u64)>,
}

impl Batch {
    fn new() -> Batch {
        Batch {
            key_offsets: vec![0],
            value_offsets: vec![0],
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.seqno.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqno.is_empty()
    }

    fn push(&mut self, d: &DocumentRef<'_>) {
        self.vbucket.push(d.vbucket);
        self.seqno.push(d.by_seqno);
        self.op.push(match d.opcode {
            opcode::MUTATION => 0,
            opcode::DELETION => 1,
            _ => 2,
        });
        self.cas.push(d.cas);
        self.rev_seqno.push(d.rev_seqno);
        self.flags.push(d.flags);
        self.expiry.push(if d.opcode == opcode::MUTATION {
            d.expiration
        } else {
            d.delete_time
        });
        self.datatype.push(d.datatype);
        self.keys.extend_from_slice(d.key);
        self.key_offsets.push(self.keys.len() as i32);
        self.values.extend_from_slice(d.value);
        self.value_offsets.push(self.values.len() as i64);
    }
}

#[derive(Debug)]
pub enum Event {
    Batch(Box<Batch>),
    /// The producer asked for a rollback (RollbackMode::Ask): the position to continue from
    /// once the reader has rolled its data back; the vbucket waits for `Command::Resume`.
    Rollback {
        vbucket: u16,
        seqno: u64,
        position: Position,
    },
    /// The producer hands the vbucket over (a takeover stream): the reader sets the state and
    /// answers with `Consumer::respond` (SET_VBUCKET_STATE, this opaque).
    VbucketState {
        vbucket: u16,
        state: u8,
        opaque: u32,
    },
    /// Every stream ended.
    Finished,
    Failed(String),
}

pub enum Command {
    Resume(u16),
    /// Request the vbucket again from this position (the reader rolled back to it).
    ResumeAt(u16, Position),
    Close,
}

/// The reader's end: events in, commands out. Dropping it stops the thread.
pub struct Consumer {
    events: Option<Receiver<Event>>,
    commands: mpsc::Sender<Command>,
    thread: Option<JoinHandle<()>>,
    /// The thread's socket, shut down on drop so that a read or write blocked on a silent
    /// producer returns at once.
    socket: Arc<Mutex<Option<SyncWriter>>>,
}

impl Consumer {
    pub fn start(config: ConsumerConfig) -> Consumer {
        let (tx, rx) = mpsc::sync_channel(4);
        let (ctx, crx) = mpsc::channel();
        let socket = Arc::new(Mutex::new(None));
        let shared_socket = socket.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-dcp-consumer".into())
            .spawn(move || {
                let session = ConsumerSession::connect(&config, tx.clone(), crx, &shared_socket)
                    .and_then(ConsumerSession::open_streams);
                let ev = match session {
                    Ok(mut s) => match s.run() {
                        Ok(()) => Event::Finished,
                        Err(e) => Event::Failed(e),
                    },
                    Err(e) => Event::Failed(e),
                };
                let _ = tx.send(ev);
            })
            .expect("spawn a thread");
        Consumer {
            events: Some(rx),
            commands: ctx,
            thread: Some(thread),
            socket,
        }
    }

    /// Waits for the next event, up to `timeout`; None on timeout.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        match self.events.as_ref()?.recv_timeout(timeout) {
            Ok(e) => Some(e),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Event::Finished),
        }
    }

    pub fn resume(&self, vbucket: u16) {
        let _ = self.commands.send(Command::Resume(vbucket));
    }

    pub fn resume_at(&self, vbucket: u16, position: Position) {
        let _ = self.commands.send(Command::ResumeAt(vbucket, position));
    }

    /// Writes a whole frame from the reader's thread, under the lock the consumer thread's
    /// own writes take; false once the connection is closing.
    fn write_now(&self, frame: &[u8]) -> bool {
        match self.socket.lock().as_mut() {
            Some(w) => w.write_all(frame).is_ok(),
            None => false,
        }
    }

    /// Answers a request of the producer (SET_VBUCKET_STATE) from the reader's thread.
    pub fn respond(&self, opcode: u8, opaque: u32, st: u16) -> bool {
        let mut out = Vec::new();
        let h = HeaderFields {
            magic: magic::RESPONSE,
            opcode,
            word: st,
            opaque,
            ..Default::default()
        };
        let _ = mcbp::write_frame(&mut out, &h, &[], &[], &[], &[]);
        self.write_now(&out)
    }

    /// SEQNO_ACKNOWLEDGED, written at once from the reader's thread (durable writes wait on
    /// it), under the same lock as the consumer thread's own writes.
    pub fn acknowledge(&self, vbucket: u16, seqno: u64, persisted: u64) -> bool {
        let mut out = Vec::new();
        let _ = SeqnoAcknowledged {
            vbucket,
            prepared_seqno: seqno,
            persisted_seqno: Some(persisted),
        }
        .encode(&mut out, 0);
        self.write_now(&out)
    }
}

/// Where a vbucket of the producer stands: what a reader plans its ranges from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VbucketPosition {
    pub vbucket: u16,
    pub high_seqno: u64,
    /// Newest entry first: (uuid, seqno).
    pub failover: Vec<(u64, u64)>,
}

/// Asks the producer of `config` (address, bucket, credentials) for the high seqno and the
/// failover log of every vbucket in `state` (1 active, 2 replica, 3 pending, 4 dead), on a
/// connection of its own that is closed afterwards.
pub fn vbucket_positions(
    config: &ConsumerConfig,
    state: u32,
) -> Result<Vec<VbucketPosition>, String> {
    let (tx, _rx) = mpsc::sync_channel(1);
    let (_ctx, crx) = mpsc::channel();
    let socket = Arc::new(Mutex::new(None));
    let mut s = ConsumerSession::connect(config, tx, crx, &socket)?;
    let r = s.vbucket_positions(state);
    let _ = s.sock.shutdown(std::net::Shutdown::Both);
    r
}

/// A connection of its own to the producer that asks for the high seqnos of its vbuckets
/// (GET_ALL_VB_SEQNOS): what a replica measures its lag against. Its answers come at once even
/// while the stream connection is backlogged, which is when the lag matters.
pub struct SeqnoProbe {
    config: ConsumerConfig,
    session: Option<ConsumerSession>,
    socket: Arc<Mutex<Option<SyncWriter>>>,
}

impl SeqnoProbe {
    /// `config`: address, bucket, credentials, name and setup timeout of the probe connection.
    pub fn new(config: ConsumerConfig) -> SeqnoProbe {
        SeqnoProbe {
            config,
            session: None,
            socket: Arc::new(Mutex::new(None)),
        }
    }

    /// The high seqno of every vbucket the producer streams (active, replica or pending
    /// there), connecting first if need be. An error drops the connection; the next call
    /// connects again.
    pub fn high_seqnos(&mut self) -> Result<BTreeMap<u16, u64>, String> {
        let mut session = match self.session.take() {
            Some(s) => s,
            None => {
                let (tx, _rx) = mpsc::sync_channel(1);
                let (_ctx, crx) = mpsc::channel();
                ConsumerSession::connect(&self.config, tx, crx, &self.socket)?
            }
        };
        let mut out = BTreeMap::new();
        for state in [1, 2, 3] {
            out.extend(session.high_seqnos(state)?);
        }
        self.session = Some(session);
        Ok(out)
    }

    /// Shuts the connection down from another thread: a call waiting on it returns at once.
    pub fn interrupter(&self) -> impl Fn() + Send + Sync + 'static {
        let socket = self.socket.clone();
        move || {
            if let Some(s) = socket.lock().as_ref() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Close);
        if let Some(s) = self.socket.lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // A thread waiting for room in the channel sees the reader gone and stops.
        self.events.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct VbStream {
    pos: Position,
    /// The producer sent STREAM_END: the position is final.
    ended: bool,
}

struct ConsumerSession {
    sock: SyncReader,
    writer: Arc<Mutex<Option<SyncWriter>>>,
    config: ConsumerConfig,
    events: SyncSender<Event>,
    commands: Receiver<Command>,
    inbuf: Vec<u8>,
    streams: HashMap<u16, VbStream>,
    batch: Batch,
    touched: BTreeSet<u16>,
    unacked: usize,
    last_message: Instant,
    flow: FlowControl,
}

/// The consumer's side of DCP flow control: the buffer the producer may fill, and how many
/// received bytes are acknowledged at once (a fifth of the buffer unless an AckPolicy says).
struct FlowControl {
    buffer_size: u32,
    ack_bytes: usize,
    received_total: u64,
    acked_total: u64,
    last_ack: Instant,
    /// The AckPolicy's answer to the last acknowledgement, not in yet.
    advice: Option<Pending>,
}

impl FlowControl {
    fn new(buffer_size: u32) -> FlowControl {
        FlowControl {
            buffer_size,
            ack_bytes: (buffer_size as usize / 5).max(1),
            received_total: 0,
            acked_total: 0,
            last_ack: Instant::now(),
            advice: None,
        }
    }
}

fn frame(
    opcode: u8,
    opaque: u32,
    vbucket: u16,
    extras: &[u8],
    key: &[u8],
    value: &[u8],
) -> Vec<u8> {
    let mut out = Vec::new();
    let h = HeaderFields {
        magic: magic::REQUEST,
        opcode,
        word: vbucket,
        opaque,
        ..Default::default()
    };
    let _ = mcbp::write_frame(&mut out, &h, &[], extras, key, value);
    out
}

/// A typed DCP request as its frame.
fn encoded(r: &impl dcp::DcpRequest, opaque: u32) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    r.encode(&mut out, opaque).map_err(|e| e.to_string())?;
    Ok(out)
}

fn opaque_of(vb: u16) -> u32 {
    0x5000_0000 | vb as u32
}

impl ConsumerSession {
    fn connect(
        config: &ConsumerConfig,
        events: SyncSender<Event>,
        commands: Receiver<Command>,
        shared_socket: &Arc<Mutex<Option<SyncWriter>>>,
    ) -> Result<ConsumerSession, String> {
        let addr = std::net::ToSocketAddrs::to_socket_addrs(&config.address)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| format!("cannot resolve {}", config.address))?;
        // Setup answers come at once from a live producer; a silent one fails the setup.
        let setup_timeout = config
            .setup_timeout
            .unwrap_or_else(|| Duration::from_secs((2 * config.noop_interval as u64).clamp(5, 30)));
        let sock = TcpStream::connect_timeout(&addr, setup_timeout.min(Duration::from_secs(10)))
            .map_err(|e| format!("cannot connect to {}: {e}", config.address))?;
        let _ = sock.set_nodelay(true);
        sock.set_read_timeout(Some(setup_timeout))
            .map_err(|e| e.to_string())?;
        let (sock, writer) =
            crate::tls::connect_client(sock, &config.address, config.tls.as_ref())?;
        *shared_socket.lock() = Some(writer);
        let mut s = ConsumerSession {
            sock,
            writer: shared_socket.clone(),
            config: config.clone(),
            events,
            commands,
            inbuf: Vec::with_capacity(READ_CHUNK * 2),
            streams: HashMap::new(),
            batch: Batch::new(),
            touched: BTreeSet::new(),
            unacked: 0,
            last_message: Instant::now(),
            flow: FlowControl::new(config.buffer_size),
        };
        s.sock
            .set_read_timeout(Some(setup_timeout))
            .map_err(|e| e.to_string())?;
        if let (Some(user), Some(pass)) = (&config.username, &config.password) {
            let mut plain = vec![0u8];
            plain.extend_from_slice(user.as_bytes());
            plain.push(0);
            plain.extend_from_slice(pass.as_bytes());
            s.call(op::SASL_AUTH, &[], b"PLAIN", &plain, 0, "authentication")?;
        }
        s.call(
            op::SELECT_BUCKET,
            &[],
            config.bucket.as_bytes(),
            &[],
            0,
            "SELECT_BUCKET",
        )?;
        let mut flags = open_flag::PRODUCER | open_flag::INCLUDE_DELETE_TIMES;
        if !config.include_values {
            flags |= open_flag::NO_VALUE;
        }
        let open = dcp::OpenConnection {
            name: config.name.as_bytes().to_vec(),
            flags,
            reserved: 0,
            value: Vec::new(),
        };
        s.call_frame(dcp::opcode::OPEN, &encoded(&open, 0xfeed)?, "DCP_OPEN")?;
        let mut controls = vec![
            ("connection_buffer_size", config.buffer_size.to_string()),
            ("enable_expiry_opcode", "true".into()),
        ];
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
            s.call_frame(dcp::opcode::CONTROL, &encoded(&control, 0xfeed)?, k)?;
        }
        Ok(s)
    }

    /// Requests every stream of the configuration and switches to the streaming read timeout.
    fn open_streams(mut self) -> Result<ConsumerSession, String> {
        let config = self.config.clone();
        let s = &mut self;
        let vbuckets = match &config.vbuckets {
            Some(v) => v.clone(),
            None => {
                let r = s.call(op::GET_ALL_VB_SEQNOS, &[], &[], &[], 0, "GET_ALL_VB_SEQNOS")?;
                r.chunks_exact(10)
                    .map(|c| u16::from_be_bytes([c[0], c[1]]))
                    .collect()
            }
        };
        for vb in vbuckets {
            let pos = config.state.vbuckets.get(&vb).cloned().unwrap_or_default();
            s.streams.insert(vb, VbStream { pos, ended: false });
            s.request(vb)?;
        }
        s.sock
            .set_read_timeout(Some(POLL))
            .map_err(|e| e.to_string())?;
        Ok(self)
    }

    /// The vbuckets in `state` (a `VbucketState` code) and their high seqnos.
    fn high_seqnos(&mut self, state: u32) -> Result<Vec<(u16, u64)>, String> {
        let r = self.call(
            op::GET_ALL_VB_SEQNOS,
            &state.to_be_bytes(),
            &[],
            &[],
            0,
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

    /// The vbuckets in `state` (a `VbucketState` code): their high seqnos and failover logs.
    fn vbucket_positions(&mut self, state: u32) -> Result<Vec<VbucketPosition>, String> {
        let seqnos = self.high_seqnos(state)?;
        let mut out = Vec::with_capacity(seqnos.len());
        for (vbucket, high_seqno) in seqnos {
            let what = format!("GET_FAILOVER_LOG of vbucket {vbucket}");
            let v = self.call(dcp::opcode::GET_FAILOVER_LOG, &[], &[], &[], vbucket, &what)?;
            let failover = dcp::decode_failover_log(&v)
                .map_err(|e| format!("{what}: {e}"))?
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
    fn call(
        &mut self,
        opcode: u8,
        extras: &[u8],
        key: &[u8],
        value: &[u8],
        vbucket: u16,
        what: &str,
    ) -> Result<Vec<u8>, String> {
        self.call_frame(
            opcode,
            &frame(opcode, 0xfeed, vbucket, extras, key, value),
            what,
        )
    }

    /// Sends one encoded request and waits for its answer (by opcode): its value on success.
    fn call_frame(&mut self, opcode: u8, req: &[u8], what: &str) -> Result<Vec<u8>, String> {
        self.send(req).map_err(|e| format!("{what}: {e}"))?;
        loop {
            let f = self
                .next_frame_blocking()
                .map_err(|e| format!("{what}: {e}"))?;
            let r = mcbp::parse_response(&f).map_err(|e| format!("{what}: {e}"))?;
            if r.opcode != opcode {
                continue;
            }
            if r.status != status::SUCCESS {
                return Err(format!(
                    "{what} refused with status {:#04x}: {}",
                    r.status,
                    String::from_utf8_lossy(r.value)
                ));
            }
            return Ok(r.value.to_vec());
        }
    }

    fn next_frame_blocking(&mut self) -> Result<Vec<u8>, String> {
        loop {
            if let Some(n) =
                mcbp::frame_len(&self.inbuf, MAX_FRAME_BODY).map_err(|e| e.to_string())?
            {
                let f = self.inbuf[..n].to_vec();
                self.inbuf.drain(..n);
                return Ok(f);
            }
            // Setup reads wait `setup_timeout` each: nothing in that time is a dead producer.
            if self.read_more().map_err(|e| e.to_string())? == 0 {
                return Err("no answer from the producer in time".into());
            }
        }
    }

    /// Reads what the socket has; Ok(0) is a timeout (nothing arrived), an error a closed or
    /// broken connection.
    fn read_more(&mut self) -> std::io::Result<usize> {
        let len = self.inbuf.len();
        self.inbuf.resize(len + READ_CHUNK, 0);
        let r = self.sock.read(&mut self.inbuf[len..]);
        match r {
            Ok(0) => {
                self.inbuf.truncate(len);
                Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the producer closed the connection",
                ))
            }
            Ok(n) => {
                self.inbuf.truncate(len + n);
                Ok(n)
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                self.inbuf.truncate(len);
                Ok(0)
            }
            Err(e) => {
                self.inbuf.truncate(len);
                Err(e)
            }
        }
    }

    fn request(&mut self, vb: u16) -> Result<(), String> {
        let s = self.streams.get_mut(&vb).expect("known vbucket");
        // A stream the producer ended may be asked for again (`Consumer::resume`).
        s.ended = false;
        let (start, uuid, snap_start, snap_end) = s.pos.resume();
        let mut flags = 0;
        let end = self.config.end_seqnos.get(&vb).copied();
        if self.config.to_latest && end.is_none() {
            flags |= stream_flag::TO_LATEST;
        }
        if self.config.takeover {
            flags |= stream_flag::TAKEOVER;
        }
        if self.config.from_now && uuid == 0 && start == 0 {
            flags |= stream_flag::FROM_LATEST;
        }
        let req = StreamRequest {
            vbucket: vb,
            flags,
            start_seqno: start,
            end_seqno: end.unwrap_or(u64::MAX),
            vbucket_uuid: uuid,
            snap_start_seqno: snap_start,
            snap_end_seqno: snap_end,
            value: vec![],
        };
        let mut out = Vec::new();
        req.encode(&mut out, opaque_of(vb))
            .map_err(|e| e.to_string())?;
        self.send(&out)
            .map_err(|e| format!("stream request for vbucket {vb}: {e}"))?;
        Ok(())
    }

    /// Writes whole frames under the writer's lock: the reader may write too (acknowledgements).
    fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        match self.writer.lock().as_mut() {
            Some(w) => w
                .write_all(bytes)
                .map_err(|e| format!("writing to the producer: {e}")),
            None => Err("the consumer is closing".into()),
        }
    }

    /// Hands the batch (with the positions it moved) to the reader; false when the reader is gone.
    fn flush(&mut self) -> bool {
        if self.batch.is_empty()
            && self.touched.is_empty()
            && self.batch.ended.is_empty()
            && self.batch.refused.is_empty()
            && self.batch.rollbacks.is_empty()
        {
            return true;
        }
        let mut b = std::mem::replace(&mut self.batch, Batch::new());
        b.positions = std::mem::take(&mut self.touched)
            .into_iter()
            .filter_map(|vb| self.streams.get(&vb).map(|s| (vb, s.pos.clone())))
            .collect();
        self.events.send(Event::Batch(Box::new(b))).is_ok()
    }

    fn acknowledge(&mut self, force: bool) -> Result<(), String> {
        self.take_advice()?;
        let threshold = self.flow.ack_bytes;
        if self.flow.buffer_size > 0 && self.unacked > 0 && (force || self.unacked >= threshold) {
            let n = self.unacked.min(u32::MAX as usize) as u32;
            let f = frame(
                dcp::opcode::BUFFER_ACKNOWLEDGEMENT,
                0,
                0,
                &n.to_be_bytes(),
                &[],
                &[],
            );
            self.send(&f)?;
            self.unacked -= n as usize;
            self.flow.acked_total += n as u64;
            self.ask_advice();
        }
        Ok(())
    }

    /// Puts the acknowledgement to the AckPolicy plugin, if one is installed and no question
    /// is out already; the answer is taken on a later round (`take_advice`).
    fn ask_advice(&mut self) {
        let Some(host) = &self.config.flow_control else {
            return;
        };
        if self.flow.advice.is_some() || !host.installed(PolicyKind::Ack) {
            return;
        }
        let f = &mut self.flow;
        let stats = AckStats {
            protocol: "dcp",
            connection: self.config.name.clone(),
            rtt: std::mem::replace(&mut f.last_ack, Instant::now())
                .elapsed()
                .as_secs_f64(),
            unacked: self.unacked as u64,
            acked_total: f.acked_total,
            sent_total: f.received_total,
            interval: f.ack_bytes.min(u32::MAX as usize) as u32,
            window: f.buffer_size,
        };
        f.advice = Some(host.pose(PolicyKind::Ack, Question::Ack(stats)));
    }

    /// Applies the AckPolicy's answer once it is in: a new buffer size goes to the producer
    /// as the control `connection_buffer_size`.
    fn take_advice(&mut self) -> Result<(), String> {
        let (Some(host), Some(p)) = (&self.config.flow_control, &self.flow.advice) else {
            return Ok(());
        };
        let Some(answer) = p.try_answer(host) else {
            return Ok(());
        };
        self.flow.advice = None;
        let Answer::Ack { interval, window } = answer else {
            return Ok(());
        };
        let window = window.max(MIN_BUFFER_SIZE);
        self.flow.ack_bytes = (interval as usize).clamp(1, window as usize);
        if window != self.flow.buffer_size && self.flow.buffer_size > 0 {
            log::info!(
                "DCP consumer '{}': the AckPolicy sets the buffer to {window} bytes, \
                 acknowledged every {} bytes",
                self.config.name,
                self.flow.ack_bytes
            );
            self.flow.buffer_size = window;
            let control = dcp::Control {
                key: b"connection_buffer_size".to_vec(),
                value: window.to_string().into_bytes(),
            };
            self.send(&encoded(&control, 0)?)?;
        }
        Ok(())
    }

    fn run(&mut self) -> Result<(), String> {
        let dead_after = Duration::from_secs(2 * self.config.noop_interval as u64);
        loop {
            loop {
                match self.commands.try_recv() {
                    Ok(Command::Resume(vb)) => {
                        if self.streams.contains_key(&vb) {
                            self.request(vb)?;
                        }
                    }
                    Ok(Command::ResumeAt(vb, pos)) => {
                        if let Some(s) = self.streams.get_mut(&vb) {
                            s.pos = pos;
                            self.request(vb)?;
                        }
                    }
                    Ok(Command::Close) | Err(TryRecvError::Disconnected) => return Ok(()),
                    Err(TryRecvError::Empty) => break,
                }
            }
            if self.streams.values().all(|s| s.ended) {
                self.flush();
                return Ok(());
            }
            let n = self
                .read_more()
                .map_err(|e| format!("DCP connection lost: {e}"))?;
            if n > 0 {
                self.last_message = Instant::now();
            } else if self.config.noop_interval > 0 && self.last_message.elapsed() > dead_after {
                return Err(format!(
                    "no message from the producer for {dead_after:?} (twice the noop interval): \
                     dead connection"
                ));
            }
            let mut consumed = 0;
            while let Some(len) = mcbp::frame_len(&self.inbuf[consumed..], MAX_FRAME_BODY)
                .map_err(|e| format!("bad frame from the producer: {e}"))?
            {
                let range = consumed..consumed + len;
                consumed += len;
                let frame = std::mem::take(&mut self.inbuf);
                let r = self.handle(&frame[range]);
                self.inbuf = frame;
                r?;
                if self.batch.len() >= self.config.batch_size && !self.flush() {
                    return Ok(());
                }
            }
            self.inbuf.drain(..consumed);
            // A short read means the producer has nothing more queued right now.
            if n < READ_CHUNK && !self.flush() {
                return Ok(());
            }
            self.acknowledge(n == 0)?;
        }
    }

    fn handle(&mut self, f: &[u8]) -> Result<(), String> {
        if f[0] == magic::RESPONSE {
            let r = mcbp::parse_response(f).map_err(|e| e.to_string())?;
            if r.opcode == dcp::opcode::STREAM_REQ {
                return self.stream_answer(&r);
            }
            return Ok(());
        }
        let req = mcbp::parse_request(f).map_err(|e| format!("bad message: {e}"))?;
        if req.opcode == dcp::opcode::NOOP {
            let mut out = Vec::new();
            let h = HeaderFields {
                magic: magic::RESPONSE,
                opcode: dcp::opcode::NOOP,
                opaque: req.opaque,
                ..Default::default()
            };
            let _ = mcbp::write_frame(&mut out, &h, &[], &[], &[], &[]);
            return self.send(&out);
        }
        self.unacked += f.len();
        self.flow.received_total += f.len() as u64;
        let vb = req.vbucket;
        match req.opcode {
            dcp::opcode::MUTATION | dcp::opcode::DELETION | dcp::opcode::EXPIRATION => {
                let d = DocumentRef::decode(&req).map_err(|e| format!("bad document: {e}"))?;
                let Some(s) = self.streams.get_mut(&vb).filter(|s| !s.ended) else {
                    return Ok(());
                };
                if d.by_seqno <= s.pos.seqno || d.by_seqno > s.pos.snap_end {
                    return Err(format!(
                        "vbucket {vb}: seqno {} outside the stream's order (last {}, snapshot end {})",
                        d.by_seqno, s.pos.seqno, s.pos.snap_end
                    ));
                }
                s.pos.seqno = d.by_seqno;
                self.touched.insert(vb);
                // The producer ends a stream at the end of the snapshot holding its end seqno;
                // a range read keeps only what lies in the range.
                if self
                    .config
                    .end_seqnos
                    .get(&vb)
                    .is_some_and(|&end| d.by_seqno > end)
                {
                    return Ok(());
                }
                self.batch.push(&d);
            }
            dcp::opcode::SNAPSHOT_MARKER => {
                let m = SnapshotMarker::decode(&req).map_err(|e| format!("bad marker: {e}"))?;
                if let Some(s) = self.streams.get_mut(&vb) {
                    s.pos.snap_start = m.start_seqno;
                    s.pos.snap_end = m.end_seqno;
                    s.pos.disk = m.flags & snapshot_flag::DISK != 0;
                    self.touched.insert(vb);
                }
            }
            dcp::opcode::SET_VBUCKET_STATE => {
                let m = SetVbucketState::decode(&req)
                    .map_err(|e| format!("bad SET_VBUCKET_STATE: {e}"))?;
                // The reader applies everything before the hand-over first.
                if !self.flush() {
                    return Ok(());
                }
                let _ = self.events.send(Event::VbucketState {
                    vbucket: vb,
                    state: m.state,
                    opaque: req.opaque,
                });
            }
            dcp::opcode::STREAM_END => {
                let e = StreamEnd::decode(&req).map_err(|e| format!("bad stream end: {e}"))?;
                if let Some(s) = self.streams.get_mut(&vb).filter(|s| !s.ended) {
                    s.ended = true;
                    if e.reason != stream_end_reason::OK && e.reason != stream_end_reason::CLOSED {
                        log::warn!("DCP stream of vbucket {vb} ended with reason {}", e.reason);
                    }
                    self.batch.ended.push((vb, e.reason));
                }
            }
            _ => {} // other producer messages carry nothing a reader keeps
        }
        Ok(())
    }

    fn stream_answer(&mut self, r: &mcbp::Response<'_>) -> Result<(), String> {
        let vb = (r.opaque & 0xffff) as u16;
        if !self.streams.contains_key(&vb) {
            return Ok(());
        }
        match StreamRequestResponse::decode(r) {
            Ok(StreamRequestResponse::Ok(log)) => {
                let s = self.streams.get_mut(&vb).expect("checked");
                s.pos.failover = log
                    .iter()
                    .map(|e: &FailoverLogEntry| (e.vbucket_uuid, e.seqno))
                    .collect();
                self.touched.insert(vb);
                Ok(())
            }
            Ok(StreamRequestResponse::Rollback(seqno)) => {
                let s = self.streams.get_mut(&vb).expect("checked");
                s.pos = s.pos.rolled_back(seqno);
                let position = s.pos.clone();
                log::info!("DCP vbucket {vb}: the producer asks for a rollback to {seqno}");
                match self.config.rollback {
                    RollbackMode::Resume => {
                        self.batch.rollbacks.push((vb, seqno));
                        self.touched.insert(vb);
                        self.request(vb)
                    }
                    RollbackMode::Ask => {
                        // The reader sees everything before the rollback first.
                        self.touched.remove(&vb);
                        if !self.flush() {
                            return Ok(());
                        }
                        let _ = self.events.send(Event::Rollback {
                            vbucket: vb,
                            seqno,
                            position,
                        });
                        Ok(())
                    }
                }
            }
            Err(dcp::DcpError::Status(status::NOT_MY_VBUCKET))
                if self.config.end_refused_streams =>
            {
                log::info!(
                    "DCP consumer '{}': the producer does not serve vbucket {vb} \
                     (NOT_MY_VBUCKET: {}); its stream is over",
                    self.config.name,
                    String::from_utf8_lossy(r.value)
                );
                self.streams.get_mut(&vb).expect("checked").ended = true;
                self.touched.remove(&vb);
                self.batch.refused.push(vb);
                Ok(())
            }
            Err(dcp::DcpError::Status(st)) => Err(format!(
                "stream request for vbucket {vb} refused with status {st:#04x}: {}",
                String::from_utf8_lossy(r.value)
            )),
            Err(e) => Err(format!("bad stream request answer for vbucket {vb}: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_points() {
        let mut p = Position {
            failover: vec![(7, 0)],
            seqno: 10,
            snap_start: 5,
            snap_end: 20,
            disk: false,
        };
        assert_eq!(p.resume(), (10, 7, 5, 20));
        p.seqno = 20;
        assert_eq!(p.resume(), (20, 7, 20, 20));
        // A marker received but none of its items: the previous snapshot was complete.
        p.seqno = 4;
        assert_eq!(p.resume(), (4, 7, 4, 4));
        assert_eq!(Position::default().resume(), (0, 0, 0, 0));
    }

    #[test]
    fn rollback_drops_later_failover_entries() {
        let p = Position {
            failover: vec![(3, 900), (2, 500), (1, 0)],
            seqno: 1000,
            snap_start: 950,
            snap_end: 1000,
            disk: false,
        };
        let r = p.rolled_back(600);
        assert_eq!(r.failover, vec![(2, 500), (1, 0)]);
        assert_eq!(r.resume(), (600, 2, 600, 600));
        assert_eq!(p.rolled_back(0), Position::default());
    }

    #[test]
    fn state_round_trips_through_json() {
        let mut s = SessionState::default();
        s.vbuckets.insert(
            3,
            Position {
                failover: vec![(u64::MAX, 4), (1, 0)],
                seqno: 9,
                snap_start: 5,
                snap_end: 12,
                disk: false,
            },
        );
        let back = SessionState::from_json(&s.to_json()).unwrap();
        assert_eq!(back, s);
        let err = SessionState::from_json(&json!({"version": 1, "vbuckets": {"x": {}}}));
        assert!(err.unwrap_err().contains("vbucket key 'x'"));
    }
}
