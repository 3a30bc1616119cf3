//! What clients send a TANK broker: each request decoded from its frame's payload (borrowing
//! from it) and written as a whole frame, so that a decoded request re-encodes to its bytes.

use super::{finish_frame, msg, put_str8, put_varint, start_frame, DecodeError, Reader};

/// Produce (0x1) or ProduceWithSeqnum (0x5): bundles for partitions of topics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Produce<'a> {
    /// ProduceWithSeqnum: each bundle carries the sequence number of its first message.
    pub with_seqnum: bool,
    pub client_version: u16,
    pub request_id: u32,
    pub client_id: &'a [u8],
    pub required_acks: u8,
    pub ack_timeout: u32,
    pub topics: Vec<ProduceTopic<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProduceTopic<'a> {
    pub name: &'a [u8],
    /// A partition may appear more than once: the answer has an error byte for each entry.
    pub partitions: Vec<ProducePartition<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducePartition<'a> {
    pub partition: u16,
    /// ProduceWithSeqnum only.
    pub base_seq: Option<u64>,
    /// The bundle (`bundle::Bundle::parse`), without its length.
    pub bundle: &'a [u8],
}

/// Consume (0x2), client versions 2 and 3 (3 adds a flags byte after min bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consume<'a> {
    pub client_version: u16,
    pub request_id: u32,
    pub client_id: &'a [u8],
    pub max_wait_ms: u64,
    pub min_bytes: u32,
    /// Version 3's flags byte.
    pub flags: Option<u8>,
    pub topics: Vec<ConsumeTopic<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumeTopic<'a> {
    pub name: &'a [u8],
    pub partitions: Vec<ConsumePartition>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumePartition {
    pub partition: u16,
    /// 0: from the first available message; u64::MAX: from the next one published.
    pub seq: u64,
    /// Whole bundles are sent while they fit in it; the first one is sent whatever its size.
    pub fetch_size: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateTopic<'a> {
    pub request_id: u32,
    pub topic: &'a [u8],
    pub partitions: u16,
    /// The topic's configuration text (TANK's `key=value` lines); empty for the defaults.
    pub config: &'a [u8],
}

/// A request, decoded from one frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Produce(Produce<'a>),
    Consume(Consume<'a>),
    Ping,
    /// Every partition of the topic, or (what TANK's client asks of a leader it was sent to)
    /// those whose ids follow the topic: `partitions` is their u16 LE ids, back to back.
    DiscoverPartitions {
        request_id: u32,
        topic: &'a [u8],
        partitions: &'a [u8],
    },
    /// The brokers of the cluster (TANK's client: `tank-cli topology`).
    DiscoverTopology {
        request_id: u32,
        flags: u8,
    },
    DiscoverTopics {
        request_id: u32,
        flags: u8,
    },
    CreateTopic(CreateTopic<'a>),
    Status {
        request_id: u32,
    },
}

impl<'a> Request<'a> {
    /// Decodes the payload of a frame of message id `id`. Bytes left over are an error, as a
    /// length that points past them is.
    pub fn decode(id: u8, payload: &'a [u8]) -> Result<Request<'a>, DecodeError> {
        let mut r = Reader::new(payload);
        let req = match id {
            msg::PRODUCE | msg::PRODUCE_WITH_SEQNUM => {
                Request::Produce(decode_produce(&mut r, id == msg::PRODUCE_WITH_SEQNUM)?)
            }
            msg::CONSUME => Request::Consume(decode_consume(&mut r)?),
            msg::PING => Request::Ping,
            msg::DISCOVER_PARTITIONS => {
                let request_id = r.u32("a request id")?;
                let topic = r.str8("a topic name")?;
                let n = r.remaining();
                if !n.is_multiple_of(2) {
                    return Err(DecodeError::Invalid(format!(
                        "{n} byte(s) of partition ids after a DiscoverPartitions topic"
                    )));
                }
                Request::DiscoverPartitions {
                    request_id,
                    topic,
                    partitions: r.bytes(n, "partition ids")?,
                }
            }
            msg::DISCOVER_TOPOLOGY => Request::DiscoverTopology {
                request_id: r.u32("a request id")?,
                flags: r.u8("DiscoverTopology flags")?,
            },
            msg::DISCOVER_TOPICS => Request::DiscoverTopics {
                request_id: r.u32("a request id")?,
                flags: r.u8("DiscoverTopics flags")?,
            },
            msg::CREATE_TOPIC => {
                let request_id = r.u32("a request id")?;
                let topic = r.str8("a topic name")?;
                let partitions = r.u16("a partition count")?;
                let n = r.varint_len("a topic's configuration")?;
                Request::CreateTopic(CreateTopic {
                    request_id,
                    topic,
                    partitions,
                    config: r.bytes(n, "a topic's configuration")?,
                })
            }
            msg::STATUS => Request::Status {
                request_id: r.u32("a request id")?,
            },
            other => {
                return Err(DecodeError::Invalid(format!(
                    "message id {other:#04x} is not a request this broker serves"
                )))
            }
        };
        if !r.is_empty() {
            return Err(DecodeError::Invalid(format!(
                "{} byte(s) after the end of a request of message id {id:#04x}",
                r.remaining()
            )));
        }
        Ok(req)
    }

    /// Writes the request as a whole frame.
    pub fn write(&self, out: &mut Vec<u8>) {
        match self {
            Request::Produce(p) => p.write(out),
            Request::Consume(c) => c.write(out),
            Request::Ping => out.extend_from_slice(&super::PING_FRAME),
            Request::DiscoverPartitions {
                request_id,
                topic,
                partitions,
            } => {
                let at = start_frame(out, msg::DISCOVER_PARTITIONS);
                out.extend_from_slice(&request_id.to_le_bytes());
                put_str8(out, topic);
                out.extend_from_slice(partitions);
                finish_frame(out, at);
            }
            Request::DiscoverTopology { request_id, flags } => {
                let at = start_frame(out, msg::DISCOVER_TOPOLOGY);
                out.extend_from_slice(&request_id.to_le_bytes());
                out.push(*flags);
                finish_frame(out, at);
            }
            Request::DiscoverTopics { request_id, flags } => {
                let at = start_frame(out, msg::DISCOVER_TOPICS);
                out.extend_from_slice(&request_id.to_le_bytes());
                out.push(*flags);
                finish_frame(out, at);
            }
            Request::CreateTopic(c) => {
                let at = start_frame(out, msg::CREATE_TOPIC);
                out.extend_from_slice(&c.request_id.to_le_bytes());
                put_str8(out, c.topic);
                out.extend_from_slice(&c.partitions.to_le_bytes());
                put_varint(out, c.config.len() as u64);
                out.extend_from_slice(c.config);
                finish_frame(out, at);
            }
            Request::Status { request_id } => {
                let at = start_frame(out, msg::STATUS);
                out.extend_from_slice(&request_id.to_le_bytes());
                finish_frame(out, at);
            }
        }
    }
}

fn decode_produce<'a>(r: &mut Reader<'a>, with_seqnum: bool) -> Result<Produce<'a>, DecodeError> {
    let client_version = r.u16("a client version")?;
    let request_id = r.u32("a request id")?;
    let client_id = r.str8("a client id")?;
    let required_acks = r.u8("required acks")?;
    let ack_timeout = r.u32("an ack timeout")?;
    let n = r.u8("a topic count")?;
    let mut topics = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let name = r.str8("a topic name")?;
        let m = r.u8("a partition count")?;
        let mut partitions = Vec::with_capacity(m as usize);
        for _ in 0..m {
            let partition = r.u16("a partition id")?;
            let len = r.varint_len("a bundle")?;
            let base_seq = if with_seqnum {
                Some(r.u64("a bundle's base sequence number")?)
            } else {
                None
            };
            partitions.push(ProducePartition {
                partition,
                base_seq,
                bundle: r.bytes(len, "a bundle")?,
            });
        }
        topics.push(ProduceTopic { name, partitions });
    }
    Ok(Produce {
        with_seqnum,
        client_version,
        request_id,
        client_id,
        required_acks,
        ack_timeout,
        topics,
    })
}

impl Produce<'_> {
    pub fn write(&self, out: &mut Vec<u8>) {
        let id = if self.with_seqnum {
            msg::PRODUCE_WITH_SEQNUM
        } else {
            msg::PRODUCE
        };
        let at = start_frame(out, id);
        out.extend_from_slice(&self.client_version.to_le_bytes());
        out.extend_from_slice(&self.request_id.to_le_bytes());
        put_str8(out, self.client_id);
        out.push(self.required_acks);
        out.extend_from_slice(&self.ack_timeout.to_le_bytes());
        out.push(self.topics.len() as u8);
        for t in &self.topics {
            put_str8(out, t.name);
            out.push(t.partitions.len() as u8);
            for p in &t.partitions {
                out.extend_from_slice(&p.partition.to_le_bytes());
                put_varint(out, p.bundle.len() as u64);
                if let Some(base) = p.base_seq {
                    out.extend_from_slice(&base.to_le_bytes());
                }
                out.extend_from_slice(p.bundle);
            }
        }
        finish_frame(out, at);
    }

    /// How many error bytes the answer holds: one per partition entry.
    pub fn entries(&self) -> usize {
        self.topics.iter().map(|t| t.partitions.len()).sum()
    }
}

fn decode_consume<'a>(r: &mut Reader<'a>) -> Result<Consume<'a>, DecodeError> {
    let client_version = r.u16("a client version")?;
    let request_id = r.u32("a request id")?;
    let client_id = r.str8("a client id")?;
    let max_wait_ms = r.u64("a max wait")?;
    let min_bytes = r.u32("min bytes")?;
    let flags = if client_version >= 3 {
        Some(r.u8("consume flags")?)
    } else {
        None
    };
    let n = r.u8("a topic count")?;
    let mut topics = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let name = r.str8("a topic name")?;
        let m = r.u8("a partition count")?;
        let mut partitions = Vec::with_capacity(m as usize);
        for _ in 0..m {
            partitions.push(ConsumePartition {
                partition: r.u16("a partition id")?,
                seq: r.u64("a sequence number")?,
                fetch_size: r.u32("a fetch size")?,
            });
        }
        topics.push(ConsumeTopic { name, partitions });
    }
    Ok(Consume {
        client_version,
        request_id,
        client_id,
        max_wait_ms,
        min_bytes,
        flags,
        topics,
    })
}

impl Consume<'_> {
    pub fn write(&self, out: &mut Vec<u8>) {
        let at = start_frame(out, msg::CONSUME);
        out.extend_from_slice(&self.client_version.to_le_bytes());
        out.extend_from_slice(&self.request_id.to_le_bytes());
        put_str8(out, self.client_id);
        out.extend_from_slice(&self.max_wait_ms.to_le_bytes());
        out.extend_from_slice(&self.min_bytes.to_le_bytes());
        if let Some(f) = self.flags {
            out.push(f);
        }
        out.push(self.topics.len() as u8);
        for t in &self.topics {
            put_str8(out, t.name);
            out.push(t.partitions.len() as u8);
            for p in &t.partitions {
                out.extend_from_slice(&p.partition.to_le_bytes());
                out.extend_from_slice(&p.seq.to_le_bytes());
                out.extend_from_slice(&p.fetch_size.to_le_bytes());
            }
        }
        finish_frame(out, at);
    }
}
