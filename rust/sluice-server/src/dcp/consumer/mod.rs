//! A native DCP consumer: one connection to a producer (sluice or Couchbase), streams for
//! chosen vbucket, on a thread of its own that answers NOOPs, acknowledges the flow-control
//! window, follows rollbacks, and hands columnar batches to the reader through a bounded
//! channel (a slow reader stops the acknowledgements, and so the producer), or first to an
//! `InlineReader` that may take it on that thread. Each batch carries the session state after
//! it, so that what the reader has seen is what it resumes from.
//!
//! Here: the reader's end (`Consumer`, its configuration and events; `ConsumerLink` for its
//! commands and writes from any thread) and the one-off
//! connections (`vbucket_positions`, `Probe`). The consumer's thread runs a
//! `session::ConsumerSession`, set up by `handshake`, with its `stream`s and `flow_control`;
//! `saved_state` is what a reader resumes from, `batch` what it is handed. `map_consumer`
//! reads the connections to several nodes as one stream that follows the cluster map.

mod acks;
mod batch;
mod error;
mod flow_control;
mod frames;
mod handshake;
mod map_consumer;
mod saved_state;
mod session;
mod stream;

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use sluice_proto::dcp::{DcpRequest, SeqnoAcknowledged};
use sluice_proto::mcbp;

pub use batch::Batch;
pub use error::ConsumerError;
pub use map_consumer::MapConsumer;
pub use saved_state::{Position, SessionState, SessionStateError};

use crate::policy::PolicyHost;
use crate::tls::SyncWriter;
use session::ConsumerSession;

/// How often the thread looks at its commands while the socket is quiet.
const POLL: Duration = Duration::from_millis(100);

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
    /// Stream this topic's partitions (a sluice producer's control `sluice_topic`) instead of
    /// the bucket's vbuckets; the bucket is still selected, for the login's permissions.
    pub topic: Option<String>,
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
    /// Ask for documents' extended attributes with their values (DCP_OPEN's INCLUDE_XATTRS,
    /// and a deletion's user attributes too): a replica keeps them; other readers get bodies.
    pub include_xattrs: bool,
    /// Ask the producer to end a stream that falls too far behind instead of backfilling it.
    pub cursor_dropping: bool,
    /// A replica's name: the connection does sync replication (controls consumer_name,
    /// enable_sync_writes, persisted_seqno_acks), and the reader sends SEQNO_ACKNOWLEDGED.
    pub replica_name: Option<String>,
    /// Request takeover streams: the producer hands the vbuckets over once caught up.
    pub takeover: bool,
    /// Ask for streams only where the vbucket is active (the producer refuses the others with
    /// NOT_MY_VBUCKET): a reader that follows the cluster map streams from actives only.
    pub active_only: bool,
    /// This node's KV address, told to a sluice producer (control `sluice_kv_address`) so
    /// that its cluster map names this node in the chains it follows or took over.
    pub kv_address: Option<String>,
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
            topic: None,
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
            include_xattrs: false,
            cursor_dropping: false,
            replica_name: None,
            takeover: false,
            active_only: false,
            kv_address: None,
            end_refused_streams: false,
            flow_control: None,
            tls: None,
        }
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
    /// Request the vbucket from this position: again (the reader rolled back to it), or for
    /// the first time on this connection (it moved here).
    ResumeAt(u16, Position),
    Close,
}

/// Where a consumer thread hands its events: a channel, each event tagged with the connection
/// it came from (a `MapConsumer` reads its connections to several nodes from one channel).
#[derive(Clone)]
pub(crate) struct EventSender {
    tx: SyncSender<(u32, Event)>,
    connection: u32,
}

impl EventSender {
    /// False when the reader is gone.
    pub(super) fn send(&self, event: Event) -> bool {
        self.tx.send((self.connection, event)).is_ok()
    }

    /// For a one-off connection, which hands nothing over.
    pub(super) fn unread() -> EventSender {
        EventSender {
            tx: mpsc::sync_channel(1).0,
            connection: 0,
        }
    }
}

/// Takes a batch on the consumer's own thread as soon as it is whole, instead of the channel:
/// None when it took the batch, Some(batch) to hand it to the reader after all. It saves the
/// reader's wake-up per batch where batches are small and come one by one (a replica under
/// synchronous writes); the reader keeps the big ones, which then overlap with the reading of
/// the next. The consumer hands every batch to it, so it alone decides their order.
pub type InlineReader = Box<dyn FnMut(Box<Batch>) -> Option<Box<Batch>> + Send>;

/// Commands and writes to a consumer's connection, from any thread.
#[derive(Clone)]
pub struct ConsumerLink {
    commands: mpsc::Sender<Command>,
    /// The thread's socket, shut down on drop of the `Consumer` so that a read or write
    /// blocked on a silent producer returns at once.
    socket: Arc<Mutex<Option<SyncWriter>>>,
}

impl ConsumerLink {
    fn new() -> (ConsumerLink, Receiver<Command>) {
        let (commands, crx) = mpsc::channel();
        let link = ConsumerLink {
            commands,
            socket: Arc::new(Mutex::new(None)),
        };
        (link, crx)
    }

    pub fn resume(&self, vbucket: u16) {
        let _ = self.commands.send(Command::Resume(vbucket));
    }

    pub fn resume_at(&self, vbucket: u16, position: Position) {
        let _ = self.commands.send(Command::ResumeAt(vbucket, position));
    }

    /// Writes a whole frame, under the lock the consumer thread's own writes take; false once
    /// the connection is closing.
    fn write_now(&self, frame: &[u8]) -> bool {
        match self.socket.lock().as_mut() {
            Some(w) => w.write_all(frame).is_ok(),
            None => false,
        }
    }

    /// Answers a request of the producer (SET_VBUCKET_STATE).
    pub fn respond(&self, opcode: u8, opaque: u32, st: u16) -> bool {
        let mut out = Vec::new();
        mcbp::write_response(&mut out, opcode, opaque, st, 0, &[]);
        self.write_now(&out)
    }

    /// SEQNO_ACKNOWLEDGED for each (vbucket, seqno held, seqno on disk), written at once in
    /// one send (durable writes wait on them).
    pub fn acknowledge(&self, acks: &[(u16, u64, u64)]) -> bool {
        if acks.is_empty() {
            return true;
        }
        let mut out = Vec::with_capacity(acks.len() * 48);
        for &(vbucket, seqno, persisted) in acks {
            let _ = SeqnoAcknowledged {
                vbucket,
                prepared_seqno: seqno,
                persisted_seqno: Some(persisted),
            }
            .encode(&mut out, 0);
        }
        self.write_now(&out)
    }
}

/// The reader's end: events in, commands out. Dropping it stops the thread.
pub struct Consumer {
    /// None when the events go to a channel the reader owns (`MapConsumer`).
    events: Option<Receiver<(u32, Event)>>,
    link: ConsumerLink,
    thread: Option<JoinHandle<()>>,
}

impl Consumer {
    pub fn start(config: ConsumerConfig) -> Consumer {
        Consumer::start_inline(config, |_| None)
    }

    /// `start`, with the batches offered first to the reader `make` returns (None: none),
    /// which is given the link to the connection.
    pub fn start_inline(
        config: ConsumerConfig,
        make: impl FnOnce(ConsumerLink) -> Option<InlineReader>,
    ) -> Consumer {
        let (tx, rx) = mpsc::sync_channel(4);
        let (link, crx) = ConsumerLink::new();
        let inline = make(link.clone());
        let mut c = Consumer::spawn(config, EventSender { tx, connection: 0 }, link, crx, inline);
        c.events = Some(rx);
        c
    }

    /// Starts the thread, its events going to `tx`. The reader must drop the channel's
    /// receiver before dropping this: a thread waiting for room in a full channel stops only
    /// when the receiver is gone.
    pub(crate) fn start_sending(config: ConsumerConfig, tx: EventSender) -> Consumer {
        let (link, crx) = ConsumerLink::new();
        Consumer::spawn(config, tx, link, crx, None)
    }

    fn spawn(
        config: ConsumerConfig,
        tx: EventSender,
        link: ConsumerLink,
        crx: Receiver<Command>,
        inline: Option<InlineReader>,
    ) -> Consumer {
        let shared_socket = link.socket.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-dcp-consumer".into())
            .spawn(move || {
                let session = ConsumerSession::connect(&config, tx.clone(), crx, &shared_socket)
                    .and_then(|mut s| {
                        // Before the streams open: their first positions come in a batch.
                        s.inline = inline;
                        s.open_streams()
                    });
                let ev = match session {
                    Ok(mut s) => match s.run() {
                        Ok(()) => Event::Finished,
                        Err(e) => Event::Failed(e.to_string()),
                    },
                    Err(e) => Event::Failed(e.to_string()),
                };
                tx.send(ev);
            })
            .expect("spawn a thread");
        Consumer {
            events: None,
            link,
            thread: Some(thread),
        }
    }

    /// Waits for the next event, up to `timeout`; None on timeout.
    pub fn next_event(&self, timeout: Duration) -> Option<Event> {
        match self.events.as_ref()?.recv_timeout(timeout) {
            Ok((_, e)) => Some(e),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Event::Finished),
        }
    }

    /// Commands and writes to the connection, from the reader's thread or any other.
    pub fn link(&self) -> &ConsumerLink {
        &self.link
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
) -> Result<Vec<VbucketPosition>, ConsumerError> {
    let (_ctx, crx) = mpsc::channel();
    let socket = Arc::new(Mutex::new(None));
    let mut s = ConsumerSession::connect(config, EventSender::unread(), crx, &socket)?;
    let r = s.vbucket_positions(state);
    let _ = s.sock.shutdown(std::net::Shutdown::Both);
    r
}

/// A topic a sluice producer streams (`STAT topics` on a DCP connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicInfo {
    pub name: String,
    pub partitions: u16,
    /// Its configuration text, as it was created with.
    pub settings: String,
}

/// A connection of its own to the producer for questions answered at once, kept open between
/// them: the high seqnos of its vbuckets (GET_ALL_VB_SEQNOS), what a replica measures its lag
/// against, which come even while the stream connection is backlogged, when the lag matters;
/// and its topics (STAT topics), which a replica's topic follower asks for every second.
pub struct Probe {
    config: ConsumerConfig,
    session: Option<ConsumerSession>,
    socket: Arc<Mutex<Option<SyncWriter>>>,
}

impl Probe {
    /// `config`: address, bucket, credentials, name and setup timeout of the probe connection.
    pub fn new(config: ConsumerConfig) -> Probe {
        Probe {
            config,
            session: None,
            socket: Arc::new(Mutex::new(None)),
        }
    }

    /// The high seqno of every vbucket the producer streams (active, replica or pending
    /// there), connecting first if need be. An error drops the connection; the next call
    /// connects again.
    pub fn high_seqnos(&mut self) -> Result<BTreeMap<u16, u64>, ConsumerError> {
        let mut session = self.session()?;
        let mut out = BTreeMap::new();
        for state in [1, 2, 3] {
            out.extend(session.high_seqnos(state)?);
        }
        self.session = Some(session);
        Ok(out)
    }

    /// The producer's topics, connecting first if need be. An error drops the connection; the
    /// next call connects again.
    pub fn topics(&mut self) -> Result<Vec<TopicInfo>, ConsumerError> {
        let mut session = self.session()?;
        let stats = session.stats("topics")?;
        self.session = Some(session);
        stats
            .into_iter()
            .map(|(name, value)| {
                let value = String::from_utf8_lossy(&value).into_owned();
                let (count, settings) = value.split_once('\n').unwrap_or((&value, ""));
                Ok(TopicInfo {
                    name: String::from_utf8(name).map_err(|_| {
                        ConsumerError::BadAnswer("STAT topics: a topic name is not UTF-8".into())
                    })?,
                    partitions: count.parse().map_err(|_| {
                        ConsumerError::BadAnswer(format!("STAT topics: {count:?} is not a count"))
                    })?,
                    settings: settings.to_string(),
                })
            })
            .collect()
    }

    /// The connection kept, or a new one.
    fn session(&mut self) -> Result<ConsumerSession, ConsumerError> {
        match self.session.take() {
            Some(s) => Ok(s),
            None => {
                let (_ctx, crx) = mpsc::channel();
                ConsumerSession::connect(&self.config, EventSender::unread(), crx, &self.socket)
            }
        }
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
        let _ = self.link.commands.send(Command::Close);
        if let Some(s) = self.link.socket.lock().take() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // A thread waiting for room in the channel sees the reader gone and stops.
        self.events.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
