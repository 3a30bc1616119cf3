//! What a TANK broker answers: each answer written as a whole frame and decoded from a frame's
//! payload, so that a decoded answer re-encodes to its bytes.

use super::{finish_frame, msg, put_str8, start_frame, DecodeError, Reader};

/// A Produce's error bytes (one per partition entry of the request, in order), as TANK's broker
/// writes them (service_wip.cpp) and its client reads them (client_api_produce.cpp).
pub mod produce_error {
    pub const OK: u8 = 0x00;
    pub const UNKNOWN_PARTITION: u8 = 0x01;
    /// The bundle could not be stored (a full disk, a failing WAL): the client's "System Error".
    pub const IO_FAULT: u8 = 0x02;
    /// In a cluster: the copies a produce's `required acks` asked for did not all hold the
    /// bundle within its `ack timeout` (the leader stored it).
    pub const ACKS_TIMED_OUT: u8 = 0x03;
    /// In a cluster: the partition has fewer copies, or fewer in sync, than `required acks`
    /// asks for (nothing is stored).
    pub const INSUFFICIENT_REPLICAS: u8 = 0x04;
    /// A bundle that does not read, or placed behind the partition's end (TANK: invalid
    /// sequence numbers; the client's "Invalid Request").
    pub const INVALID: u8 = 0x0a;
    /// The broker takes no produce (TANK's read-only mode); once per topic, as UNKNOWN_TOPIC.
    pub const READ_ONLY: u8 = 0xfe;
    pub const UNKNOWN_TOPIC: u8 = 0xff;
}

/// Where another broker listens, as TANK writes it after a redirect (0xfc) and in
/// DiscoverTopology: the IPv4 address's octets in order, then the port, u16 LE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub addr4: [u8; 4],
    pub port: u16,
}

impl Endpoint {
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.addr4);
        out.extend_from_slice(&self.port.to_le_bytes());
    }

    fn decode(r: &mut Reader<'_>) -> Result<Endpoint, DecodeError> {
        let b = r.bytes(4, "an IPv4 address")?;
        Ok(Endpoint {
            addr4: [b[0], b[1], b[2], b[3]],
            port: r.u16("a port")?,
        })
    }
}

impl From<std::net::SocketAddrV4> for Endpoint {
    fn from(a: std::net::SocketAddrV4) -> Endpoint {
        Endpoint {
            addr4: a.ip().octets(),
            port: a.port(),
        }
    }
}

/// What a broker that does not lead a partition answers for it (produce, consume and
/// DiscoverPartitions alike): the leader's endpoint, or that it has none now.
pub mod redirect {
    /// Another broker leads it; its endpoint follows.
    pub const OTHER_LEADER: u8 = 0xfc;
    /// No broker leads it now (TANK's client asks again later).
    pub const NO_LEADER: u8 = 0xfd;
}

/// A consumed partition's `errorOrFlags`.
pub mod consume_flag {
    pub const OK: u8 = 0x00;
    /// The sequence number asked for is past the high-water mark or before the first one kept;
    /// the first available sequence number follows.
    pub const BOUNDARY_CHECK: u8 = 0x01;
    /// The first bundle is sparse and carries its own base sequence number.
    pub const SPARSE_FIRST: u8 = 0xfe;
    pub const UNKNOWN_PARTITION: u8 = 0xff;
}

/// A topic's answer in a Consume answer that names no partition: it is unknown.
pub const UNKNOWN_TOPIC_PARTITION: u16 = 0xffff;

/// CreateTopic's error byte.
pub mod create_error {
    pub const OK: u8 = 0;
    pub const EXISTS: u8 = 1;
    pub const SYSTEM: u8 = 2;
    pub const BAD_CONFIG: u8 = 4;
    pub const READ_ONLY: u8 = 5;
    pub const INVALID: u8 = 10;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProduceAck<'a> {
    pub request_id: u32,
    pub errors: &'a [u8],
}

impl<'a> ProduceAck<'a> {
    pub fn decode(payload: &'a [u8]) -> Result<ProduceAck<'a>, DecodeError> {
        let mut r = Reader::new(payload);
        Ok(ProduceAck {
            request_id: r.u32("a request id")?,
            errors: r.rest(),
        })
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::PRODUCE);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(self.errors);
        finish_frame(out, at);
    }
}

/// One topic of a Consume answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicAnswer<'a> {
    pub name: &'a [u8],
    pub partitions: PartitionsAnswer,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionsAnswer {
    /// The topic is unknown: `requested` is the count of partitions the request named.
    UnknownTopic {
        requested: u8,
    },
    Known(Vec<PartitionAnswer>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionAnswer {
    /// Bundles from `base_seq` (the first message of the first bundle), `chunk_len` bytes of
    /// them following the headers.
    Data {
        partition: u16,
        base_seq: u64,
        high_water_mark: u64,
        chunk_len: u32,
    },
    /// The first bundle is sparse; its own header says where it starts.
    SparseData {
        partition: u16,
        high_water_mark: u64,
        chunk_len: u32,
    },
    /// The sequence number asked for is out of range.
    BoundaryCheck {
        partition: u16,
        high_water_mark: u64,
        first_available: u64,
    },
    UnknownPartition {
        partition: u16,
    },
    /// Another broker leads the partition: the client asks it.
    OtherLeader {
        partition: u16,
        leader: Endpoint,
    },
    /// No broker leads the partition now.
    NoLeader {
        partition: u16,
    },
}

impl PartitionAnswer {
    pub fn chunk_len(&self) -> u32 {
        match self {
            PartitionAnswer::Data { chunk_len, .. }
            | PartitionAnswer::SparseData { chunk_len, .. } => *chunk_len,
            _ => 0,
        }
    }
}

/// A Consume answer: headers for every topic and partition, then their chunks in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumeAnswer<'a> {
    pub request_id: u32,
    pub topics: Vec<TopicAnswer<'a>>,
}

impl<'a> ConsumeAnswer<'a> {
    /// Writes the frame header and the answer's headers; the caller appends the chunks (the
    /// stored bundles, as they are), `chunk_len` bytes for each partition with data, in order.
    pub fn write_headers(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::CONSUME);
        let header_at = out.len();
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.push(self.topics.len() as u8);
        let mut chunks = 0u64;
        for t in &self.topics {
            put_str8(out, t.name);
            match &t.partitions {
                PartitionsAnswer::UnknownTopic { requested } => {
                    out.push(*requested);
                    out.extend_from_slice(&UNKNOWN_TOPIC_PARTITION.to_le_bytes());
                }
                PartitionsAnswer::Known(parts) => {
                    out.push(parts.len() as u8);
                    for p in parts {
                        write_partition(out, p);
                        chunks += p.chunk_len() as u64;
                    }
                }
            }
        }
        let header_len = (out.len() - header_at - 4) as u32;
        out[header_at..header_at + 4].copy_from_slice(&header_len.to_le_bytes());
        let payload = (out.len() - at - super::HEADER) as u64 + chunks;
        out[at + 1..at + super::HEADER].copy_from_slice(&(payload as u32).to_le_bytes());
    }

    /// Decodes a Consume answer's payload: the answer and the bytes of its chunks, which
    /// `split_chunks` hands out per partition.
    pub fn decode(payload: &'a [u8]) -> Result<(ConsumeAnswer<'a>, &'a [u8]), DecodeError> {
        let mut r = Reader::new(payload);
        let header_len = r.u32("a header length")? as usize;
        let header = r.bytes(header_len, "a consume answer's header")?;
        let chunks = r.rest();
        let mut h = Reader::new(header);
        let request_id = h.u32("a request id")?;
        let n = h.u8("a topic count")?;
        let mut topics = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let name = h.str8("a topic name")?;
            let m = h.u8("a partition count")?;
            let mut peek = h.clone();
            if peek.u16("a partition id")? == UNKNOWN_TOPIC_PARTITION {
                h = peek;
                topics.push(TopicAnswer {
                    name,
                    partitions: PartitionsAnswer::UnknownTopic { requested: m },
                });
                continue;
            }
            let mut parts = Vec::with_capacity(m as usize);
            for _ in 0..m {
                parts.push(decode_partition(&mut h)?);
            }
            topics.push(TopicAnswer {
                name,
                partitions: PartitionsAnswer::Known(parts),
            });
        }
        if !h.is_empty() {
            return Err(DecodeError::Invalid(
                "bytes left in a consume answer's header".into(),
            ));
        }
        let answer = ConsumeAnswer { request_id, topics };
        let total: u64 = answer.partitions().map(|p| p.chunk_len() as u64).sum();
        if total != chunks.len() as u64 {
            return Err(DecodeError::Invalid(format!(
                "a consume answer's chunks are {} bytes, its headers say {total}",
                chunks.len()
            )));
        }
        Ok((answer, chunks))
    }

    pub fn partitions(&self) -> impl Iterator<Item = &PartitionAnswer> {
        self.topics.iter().flat_map(|t| match &t.partitions {
            PartitionsAnswer::Known(p) => p.as_slice(),
            PartitionsAnswer::UnknownTopic { .. } => &[],
        })
    }
}

fn write_partition(out: &mut Vec<u8>, p: &PartitionAnswer) {
    match *p {
        PartitionAnswer::Data {
            partition,
            base_seq,
            high_water_mark,
            chunk_len,
        } => {
            out.extend_from_slice(&partition.to_le_bytes());
            out.push(consume_flag::OK);
            out.extend_from_slice(&base_seq.to_le_bytes());
            out.extend_from_slice(&high_water_mark.to_le_bytes());
            out.extend_from_slice(&chunk_len.to_le_bytes());
        }
        PartitionAnswer::SparseData {
            partition,
            high_water_mark,
            chunk_len,
        } => {
            out.extend_from_slice(&partition.to_le_bytes());
            out.push(consume_flag::SPARSE_FIRST);
            out.extend_from_slice(&high_water_mark.to_le_bytes());
            out.extend_from_slice(&chunk_len.to_le_bytes());
        }
        PartitionAnswer::BoundaryCheck {
            partition,
            high_water_mark,
            first_available,
        } => {
            out.extend_from_slice(&partition.to_le_bytes());
            out.push(consume_flag::BOUNDARY_CHECK);
            out.extend_from_slice(&0u64.to_le_bytes());
            out.extend_from_slice(&high_water_mark.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
            out.extend_from_slice(&first_available.to_le_bytes());
        }
        PartitionAnswer::UnknownPartition { partition } => {
            out.extend_from_slice(&partition.to_le_bytes());
            out.push(consume_flag::UNKNOWN_PARTITION);
        }
        PartitionAnswer::OtherLeader { partition, leader } => {
            out.extend_from_slice(&partition.to_le_bytes());
            out.push(redirect::OTHER_LEADER);
            leader.write(out);
        }
        PartitionAnswer::NoLeader { partition } => {
            out.extend_from_slice(&partition.to_le_bytes());
            out.push(redirect::NO_LEADER);
        }
    }
}

fn decode_partition(h: &mut Reader<'_>) -> Result<PartitionAnswer, DecodeError> {
    let partition = h.u16("a partition id")?;
    let flags = h.u8("a partition's errorOrFlags")?;
    Ok(match flags {
        consume_flag::UNKNOWN_PARTITION => PartitionAnswer::UnknownPartition { partition },
        redirect::OTHER_LEADER => PartitionAnswer::OtherLeader {
            partition,
            leader: Endpoint::decode(h)?,
        },
        redirect::NO_LEADER => PartitionAnswer::NoLeader { partition },
        consume_flag::SPARSE_FIRST => PartitionAnswer::SparseData {
            partition,
            high_water_mark: h.u64("a high-water mark")?,
            chunk_len: h.u32("a chunk length")?,
        },
        consume_flag::BOUNDARY_CHECK => {
            let _base = h.u64("a base sequence number")?;
            let high_water_mark = h.u64("a high-water mark")?;
            let _chunk = h.u32("a chunk length")?;
            PartitionAnswer::BoundaryCheck {
                partition,
                high_water_mark,
                first_available: h.u64("the first available sequence number")?,
            }
        }
        consume_flag::OK => PartitionAnswer::Data {
            partition,
            base_seq: h.u64("a base sequence number")?,
            high_water_mark: h.u64("a high-water mark")?,
            chunk_len: h.u32("a chunk length")?,
        },
        other => {
            return Err(DecodeError::Invalid(format!(
                "a partition's errorOrFlags {other:#04x} is not one TANK sends"
            )))
        }
    })
}

/// The whole bundles of a chunk, each without its length. A last bundle cut short by the fetch
/// size is left out, as TANK's clients skip it (they ask again from its first message).
pub fn chunk_bundles(chunk: &[u8]) -> Vec<&[u8]> {
    let mut r = Reader::new(chunk);
    let mut out = Vec::new();
    while let Ok(len) = r.varint_len("a bundle") {
        match r.bytes(len, "a bundle") {
            Ok(b) => out.push(b),
            Err(_) => break,
        }
    }
    out
}

/// Whether a chunk's first bundle is sparse (it numbers its own messages, so a Consume answer
/// gives no base sequence number for it).
pub fn first_bundle_is_sparse(chunk: &[u8]) -> bool {
    let mut r = Reader::new(chunk);
    r.varint_len("a bundle")
        .and_then(|_| r.u8("a bundle's flags"))
        .is_ok_and(|flags| flags & super::bundle::SPARSE != 0)
}

/// DiscoverPartitions' answer: per partition its first available sequence number and its
/// high-water mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionsInfo<'a> {
    pub request_id: u32,
    pub topic: &'a [u8],
    pub partitions: Vec<PartitionInfo>,
}

/// One partition of a DiscoverPartitions answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionInfo {
    /// Its first available sequence number and its high-water mark.
    Range { first: u64, high_water_mark: u64 },
    /// Another broker leads it (two u64 of all ones, 0xfc, the endpoint).
    OtherLeader(Endpoint),
    /// No broker leads it now (two u64 of all ones, 0xfd).
    NoLeader,
}

impl<'a> PartitionsInfo<'a> {
    pub fn write(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::DISCOVER_PARTITIONS);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        put_str8(out, self.topic);
        out.extend_from_slice(&(self.partitions.len() as u16).to_le_bytes());
        for p in &self.partitions {
            match p {
                PartitionInfo::Range {
                    first,
                    high_water_mark,
                } => {
                    out.extend_from_slice(&first.to_le_bytes());
                    out.extend_from_slice(&high_water_mark.to_le_bytes());
                }
                PartitionInfo::OtherLeader(leader) => {
                    out.extend_from_slice(&[0xff; 16]);
                    out.push(redirect::OTHER_LEADER);
                    leader.write(out);
                }
                PartitionInfo::NoLeader => {
                    out.extend_from_slice(&[0xff; 16]);
                    out.push(redirect::NO_LEADER);
                }
            }
        }
        finish_frame(out, at);
    }

    pub fn decode(payload: &'a [u8]) -> Result<PartitionsInfo<'a>, DecodeError> {
        let mut r = Reader::new(payload);
        let request_id = r.u32("a request id")?;
        let topic = r.str8("a topic name")?;
        let n = r.u16("a partition count")? as usize;
        if n > r.remaining() / 16 {
            return Err(DecodeError::Short("a partition list"));
        }
        let mut partitions = Vec::with_capacity(n);
        for _ in 0..n {
            let first = r.u64("a first sequence number")?;
            let high_water_mark = r.u64("a high-water mark")?;
            partitions.push(if (first, high_water_mark) != (u64::MAX, u64::MAX) {
                PartitionInfo::Range {
                    first,
                    high_water_mark,
                }
            } else {
                match r.u8("a partition's redirect")? {
                    redirect::OTHER_LEADER => PartitionInfo::OtherLeader(Endpoint::decode(&mut r)?),
                    redirect::NO_LEADER => PartitionInfo::NoLeader,
                    other => {
                        return Err(DecodeError::Invalid(format!(
                            "a partition's redirect {other:#04x} is not one TANK sends"
                        )))
                    }
                }
            });
        }
        Ok(PartitionsInfo {
            request_id,
            topic,
            partitions,
        })
    }
}

/// DiscoverTopology's answer: the cluster's name and brokers, or (no brokers) a broker on its
/// own, as TANK's broker writes it (`n` = 0xffff).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyInfo<'a> {
    pub request_id: u32,
    /// None: a broker on its own.
    pub cluster: Option<(&'a [u8], Vec<TopologyNode>)>,
}

/// One broker of a cluster: its id, whether it is available, where it listens (if it said),
/// and how many partitions it holds a copy of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopologyNode {
    pub id: u16,
    pub available: bool,
    pub endpoint: Option<Endpoint>,
    pub partitions: u16,
}

/// A topology node's flags: bit 0 an endpoint follows, bit 1 available.
const NODE_HAS_ENDPOINT: u8 = 0x01;
const NODE_AVAILABLE: u8 = 0x02;
/// The node count of a broker on its own.
const STANDALONE: u16 = 0xffff;

impl<'a> TopologyInfo<'a> {
    pub fn write(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::DISCOVER_TOPOLOGY);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        match &self.cluster {
            None => out.extend_from_slice(&STANDALONE.to_le_bytes()),
            Some((name, nodes)) => {
                out.extend_from_slice(&(nodes.len() as u16).to_le_bytes());
                put_str8(out, name);
                for n in nodes {
                    out.extend_from_slice(&n.id.to_le_bytes());
                    let mut flags = 0;
                    if n.endpoint.is_some() {
                        flags |= NODE_HAS_ENDPOINT;
                    }
                    if n.available {
                        flags |= NODE_AVAILABLE;
                    }
                    out.push(flags);
                    if let Some(e) = n.endpoint {
                        e.write(out);
                    }
                    out.extend_from_slice(&n.partitions.to_le_bytes());
                }
            }
        }
        finish_frame(out, at);
    }

    pub fn decode(payload: &'a [u8]) -> Result<TopologyInfo<'a>, DecodeError> {
        let mut r = Reader::new(payload);
        let request_id = r.u32("a request id")?;
        let n = r.u16("a node count")?;
        if n == STANDALONE {
            return Ok(TopologyInfo {
                request_id,
                cluster: None,
            });
        }
        let name = r.str8("a cluster name")?;
        if n as usize > r.remaining() / 5 {
            return Err(DecodeError::Short("a node list"));
        }
        let mut nodes = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let id = r.u16("a node id")?;
            let flags = r.u8("a node's flags")?;
            let endpoint = if flags & NODE_HAS_ENDPOINT != 0 {
                Some(Endpoint::decode(&mut r)?)
            } else {
                None
            };
            nodes.push(TopologyNode {
                id,
                available: flags & NODE_AVAILABLE != 0,
                endpoint,
                partitions: r.u16("a node's partition count")?,
            });
        }
        Ok(TopologyInfo {
            request_id,
            cluster: Some((name, nodes)),
        })
    }
}

/// DiscoverTopics' answer: each topic, whether it is enabled, and its partition count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicsInfo<'a> {
    pub request_id: u32,
    pub cluster_aware: bool,
    /// Name, enabled, partitions, and (cluster-aware: written only then) the replication
    /// factor.
    pub topics: Vec<(&'a [u8], bool, u16, u8)>,
}

impl<'a> TopicsInfo<'a> {
    pub fn write(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::DISCOVER_TOPICS);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.extend_from_slice(&(self.topics.len() as u32).to_le_bytes());
        out.push(self.cluster_aware as u8);
        for (name, enabled, partitions, rf) in &self.topics {
            put_str8(out, name);
            out.push(*enabled as u8);
            out.extend_from_slice(&partitions.to_le_bytes());
            if self.cluster_aware {
                out.push(*rf);
            }
        }
        finish_frame(out, at);
    }

    pub fn decode(payload: &'a [u8]) -> Result<TopicsInfo<'a>, DecodeError> {
        let mut r = Reader::new(payload);
        let request_id = r.u32("a request id")?;
        let n = r.u32("a topic count")? as usize;
        let cluster_aware = r.u8("cluster awareness")? != 0;
        if n > r.remaining() / 4 {
            return Err(DecodeError::Short("a topic list"));
        }
        let mut topics = Vec::with_capacity(n);
        for _ in 0..n {
            topics.push((
                r.str8("a topic name")?,
                r.u8("a topic's enabled flag")? != 0,
                r.u16("a partition count")?,
                if cluster_aware {
                    r.u8("a replication factor")?
                } else {
                    0
                },
            ));
        }
        Ok(TopicsInfo {
            request_id,
            cluster_aware,
            topics,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateTopicAck<'a> {
    pub request_id: u32,
    pub topic: &'a [u8],
    pub error: u8,
}

impl<'a> CreateTopicAck<'a> {
    pub fn write(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::CREATE_TOPIC);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        put_str8(out, self.topic);
        out.push(self.error);
        finish_frame(out, at);
    }

    pub fn decode(payload: &'a [u8]) -> Result<CreateTopicAck<'a>, DecodeError> {
        let mut r = Reader::new(payload);
        Ok(CreateTopicAck {
            request_id: r.u32("a request id")?,
            topic: r.str8("a topic name")?,
            error: r.u8("an error")?,
        })
    }
}

/// Status' answer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusInfo {
    pub request_id: u32,
    pub global_flags: u8,
    /// A cluster-aware broker's cluster: its name and how many of its nodes are available.
    pub cluster: Option<(Vec<u8>, u32)>,
    pub topics: u32,
    pub partitions: u32,
    pub open_partitions: u32,
    pub open_partitions_time: u32,
    /// Seconds since the epoch.
    pub startup_ts: u32,
    /// TANK's version number (major × 100 + minor).
    pub version: u32,
}

impl StatusInfo {
    pub fn write(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::STATUS);
        out.extend_from_slice(&self.request_id.to_le_bytes());
        out.push(self.global_flags);
        out.push(self.cluster.is_some() as u8);
        out.extend_from_slice(&self.topics.to_le_bytes());
        out.extend_from_slice(&self.partitions.to_le_bytes());
        if let Some((name, available)) = &self.cluster {
            out.push(0); // cluster flags
            put_str8(out, name);
            out.extend_from_slice(&available.to_le_bytes());
        }
        for v in [
            self.open_partitions,
            self.open_partitions_time,
            self.startup_ts,
            self.version,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        finish_frame(out, at);
    }

    pub fn decode(payload: &[u8]) -> Result<StatusInfo, DecodeError> {
        let mut r = Reader::new(payload);
        let request_id = r.u32("a request id")?;
        let global_flags = r.u8("global flags")?;
        let cluster_aware = r.u8("cluster awareness")? != 0;
        let topics = r.u32("a topic count")?;
        let partitions = r.u32("a partition count")?;
        let cluster = if cluster_aware {
            let _flags = r.u8("cluster flags")?;
            let name = r.str8("a cluster name")?.to_vec();
            Some((name, r.u32("an available node count")?))
        } else {
            None
        };
        Ok(StatusInfo {
            request_id,
            global_flags,
            cluster,
            topics,
            partitions,
            open_partitions: r.u32("an open partition count")?,
            open_partitions_time: r.u32("an open partitions time")?,
            startup_ts: r.u32("a start-up time")?,
            version: r.u32("a version")?,
        })
    }
}
