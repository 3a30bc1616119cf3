//! TANK's Produce and Consume for `sluice.tank`'s client: frames built and answers decoded by
//! `sluice_proto::tank`, so that Python only moves bytes over its socket, one call per request
//! or answer (a bundle of messages at a time).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyInt, PyList, PyMemoryView, PyType};

use crate::records::RecordType;

use sluice_proto::tank::bundle::{self, codec, Bundle, NewMessage};
use sluice_proto::tank::request::{
    Consume, ConsumePartition, ConsumeTopic, Produce, ProducePartition, ProduceTopic,
};
use sluice_proto::tank::response::{
    chunk_bundles, ConsumeAnswer, PartitionAnswer, PartitionsAnswer,
};
use sluice_proto::tank::{DecodeError, Reader};

/// The largest message set a consumed Snappy bundle may expand to.
const MAX_SET: usize = 256 << 20;

const CLIENT_ID: &[u8] = b"sluice";

fn topic_name(topic: &str) -> PyResult<&[u8]> {
    if topic.is_empty() || topic.len() > u8::MAX as usize {
        return Err(PyValueError::new_err(format!(
            "a topic name is 1 to 255 bytes, not {}",
            topic.len()
        )));
    }
    Ok(topic.as_bytes())
}

/// A Produce frame (ProduceWithSeqnum when `base_seq` is given) of one bundle holding
/// `messages` stamped `ts_ms`, Snappy-compressed if `snappy`. Each message is its content
/// (bytes, bytearray or memoryview) or a (key or None, content) pair; bytes are read where
/// they are, not copied per message. `required_acks` and `ack_timeout_ms` are TANK's (0 and
/// 0, as TANK's client sends: every copy in sync, within 8 s; a broker on its own ignores them).
#[pyfunction]
#[pyo3(signature = (request_id, topic, partition, messages, *, ts_ms, snappy=false, base_seq=None, required_acks=0, ack_timeout_ms=0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tank_produce_frame<'py>(
    py: Python<'py>,
    request_id: u32,
    topic: &str,
    partition: u16,
    messages: &Bound<'py, PyAny>,
    ts_ms: u64,
    snappy: bool,
    base_seq: Option<u64>,
    required_acks: u8,
    ack_timeout_ms: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let name = topic_name(topic)?;
    let mut held: Vec<(Option<Bound<'py, PyBytes>>, Bound<'py, PyBytes>)> = Vec::new();
    for m in messages.try_iter()? {
        held.push(key_and_content(&m?)?);
    }
    if held.is_empty() {
        return Err(PyValueError::new_err("a bundle holds one message or more"));
    }
    let new: Vec<NewMessage<'_>> = held
        .iter()
        .map(|(k, c)| NewMessage {
            ts: ts_ms,
            key: k.as_ref().map(|k| k.as_bytes()),
            content: c.as_bytes(),
        })
        .collect();
    if let Some(k) = new
        .iter()
        .find_map(|m| m.key.filter(|k| k.len() > u8::MAX as usize))
    {
        return Err(PyValueError::new_err(format!(
            "a message key is at most 255 bytes, not {}",
            k.len()
        )));
    }
    if base_seq == Some(0) {
        return Err(PyValueError::new_err(
            "sequence numbers start at 1: seq=0 places nothing",
        ));
    }
    let mut b = Vec::new();
    bundle::write(
        &mut b,
        &new,
        if snappy { codec::SNAPPY } else { codec::NONE },
    );
    let mut out = Vec::with_capacity(b.len() + 64);
    Produce {
        with_seqnum: base_seq.is_some(),
        client_version: 2,
        request_id,
        client_id: CLIENT_ID,
        required_acks,
        ack_timeout: ack_timeout_ms,
        topics: vec![ProduceTopic {
            name,
            partitions: vec![ProducePartition {
                partition,
                base_seq,
                bundle: &b,
            }],
        }],
    }
    .write(&mut out);
    Ok(PyBytes::new(py, &out))
}

/// A Consume frame for partitions of a topic, each `(partition, seq, fetch_size)` (seq 0: the
/// first available; 2**64-1: the next produced), waiting up to `max_wait_ms` for `min_bytes`.
#[pyfunction]
#[pyo3(signature = (request_id, topic, partitions, *, max_wait_ms, min_bytes))]
pub(crate) fn tank_consume_frame<'py>(
    py: Python<'py>,
    request_id: u32,
    topic: &str,
    partitions: Vec<(u16, u64, u32)>,
    max_wait_ms: u64,
    min_bytes: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    if partitions.is_empty() || partitions.len() > u8::MAX as usize {
        return Err(PyValueError::new_err(
            "a Consume asks for 1 to 255 partitions of a topic",
        ));
    }
    let mut out = Vec::with_capacity(64);
    Consume {
        client_version: 2,
        request_id,
        client_id: CLIENT_ID,
        max_wait_ms,
        min_bytes,
        flags: None,
        topics: vec![ConsumeTopic {
            name: topic_name(topic)?,
            partitions: partitions
                .iter()
                .map(|&(partition, seq, fetch_size)| ConsumePartition {
                    partition,
                    seq,
                    fetch_size,
                })
                .collect(),
        }],
    }
    .write(&mut out);
    Ok(PyBytes::new(py, &out))
}

fn bad(e: DecodeError) -> PyErr {
    PyValueError::new_err(format!("a bad Consume answer: {e}"))
}

/// One partition's result: `(partition, kind, high_water_mark, first, messages, next_seq,
/// needed)`.
type Fetched<'py> = (u16, &'static str, u64, u64, Bound<'py, PyList>, u64, usize);

/// Decodes the answer (payload) to a Consume of one topic's partitions from `seqs` (in the
/// order asked): per partition `(partition, kind, high_water_mark, first, messages, next_seq,
/// needed)`. `kind` is "data", "boundary" (the seq asked for is out of range; `first` is where
/// the partition starts), "unknown_topic", "unknown_partition", "other_leader" (another broker
/// leads it: `high_water_mark` is its IPv4 address as a big-endian number, `first` its port)
/// or "no_leader"; for "data", `first` is the
/// chunk's base sequence number (the first available when nothing came). `messages` are
/// (seq, ts, key or None, content) from the seq asked for on; `next_seq` is where to ask next.
/// `needed` is nonzero when no whole bundle fitted the fetch size: the size of the first one,
/// to ask again with. Each message is made a `message` (`sluice.tank.Message`, a NamedTuple
/// of those four).
/// Checks a topic's settings text as the broker will (`key=value` lines: `log.segment.bytes`,
/// `log.retention.bytes`, ...): a ConfigError names the line and the reason, which TANK's
/// CreateTopic answer (one error byte) cannot carry.
#[pyfunction]
pub(crate) fn check_topic_settings(text: &str) -> PyResult<()> {
    sluice_core::partition_log::LogConfig::from_text(text)
        .map(|_| ())
        .map_err(|why| crate::errors::ConfigError::new_err(format!("topic settings: {why}")))
}

#[pyfunction]
pub(crate) fn tank_consume_answer<'py>(
    py: Python<'py>,
    payload: &[u8],
    seqs: Vec<(u16, u64)>,
    message: Bound<'py, PyType>,
) -> PyResult<Vec<Fetched<'py>>> {
    let message = RecordType::new(py, Some(message))?;
    let (answer, mut chunks) = ConsumeAnswer::decode(payload).map_err(bad)?;
    let parts = match answer.topics.first().map(|t| &t.partitions) {
        Some(PartitionsAnswer::Known(parts)) => parts,
        None => return Err(PyValueError::new_err("a Consume answer without a topic")),
        Some(PartitionsAnswer::UnknownTopic { .. }) => {
            return Ok(seqs
                .iter()
                .map(|&(p, seq)| (p, "unknown_topic", 0, 0, PyList::empty(py), seq, 0))
                .collect())
        }
    };
    let mut out = Vec::with_capacity(parts.len());
    let mut set = Vec::new();
    for part in parts {
        let (chunk, rest) = chunks.split_at(part.chunk_len() as usize);
        chunks = rest;
        let partition = match *part {
            PartitionAnswer::Data { partition, .. }
            | PartitionAnswer::SparseData { partition, .. }
            | PartitionAnswer::BoundaryCheck { partition, .. }
            | PartitionAnswer::UnknownPartition { partition }
            | PartitionAnswer::OtherLeader { partition, .. }
            | PartitionAnswer::NoLeader { partition } => partition,
        };
        let seq = seqs
            .iter()
            .find(|&&(p, _)| p == partition)
            .map(|&(_, s)| s)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "a Consume answer for partition {partition}, not asked for"
                ))
            })?;
        out.push(partition_result(py, part, chunk, seq, &mut set, &message)?);
    }
    Ok(out)
}

/// A produced message's key (None when it has none) and content: `m` is its content, or a
/// (key or None, content) pair as any two-item sequence.
fn key_and_content<'py>(
    m: &Bound<'py, PyAny>,
) -> PyResult<(Option<Bound<'py, PyBytes>>, Bound<'py, PyBytes>)> {
    if let Some(content) = as_bytes(m)? {
        return Ok((None, content));
    }
    if !m.len().is_ok_and(|n| n == 2) {
        return Err(PyTypeError::new_err(
            "a message is bytes or a (key, content) pair",
        ));
    }
    let (key, content) = (m.get_item(0)?, m.get_item(1)?);
    let key = if key.is_none() {
        None
    } else {
        let key = as_bytes(&key)?;
        Some(key.ok_or_else(|| PyTypeError::new_err("a message key is bytes or None"))?)
    };
    let content =
        as_bytes(&content)?.ok_or_else(|| PyTypeError::new_err("a message's content is bytes"))?;
    Ok((key, content))
}

/// `m` as bytes: itself, or a copy of a bytearray or memoryview; None for anything else.
fn as_bytes<'py>(m: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyBytes>>> {
    if let Ok(b) = m.cast::<PyBytes>() {
        return Ok(Some(b.clone()));
    }
    if m.is_instance_of::<PyByteArray>() || m.is_instance_of::<PyMemoryView>() {
        let b = m.py().get_type::<PyBytes>().call1((m,))?;
        return Ok(Some(b.cast_into::<PyBytes>()?));
    }
    Ok(None)
}

fn partition_result<'py>(
    py: Python<'py>,
    part: &PartitionAnswer,
    chunk: &[u8],
    seq: u64,
    set: &mut Vec<u8>,
    message: &RecordType<'py>,
) -> PyResult<Fetched<'py>> {
    let messages = PyList::empty(py);
    let (partition, base, hwm) = match *part {
        PartitionAnswer::UnknownPartition { partition } => {
            return Ok((partition, "unknown_partition", 0, 0, messages, seq, 0))
        }
        // The leader's IPv4 address (its octets as a big-endian number) and port.
        PartitionAnswer::OtherLeader { partition, leader } => {
            let addr = u32::from_be_bytes(leader.addr4) as u64;
            return Ok((
                partition,
                "other_leader",
                addr,
                leader.port as u64,
                messages,
                seq,
                0,
            ));
        }
        PartitionAnswer::NoLeader { partition } => {
            return Ok((partition, "no_leader", 0, 0, messages, seq, 0))
        }
        PartitionAnswer::BoundaryCheck {
            partition,
            high_water_mark,
            first_available,
        } => {
            return Ok((
                partition,
                "boundary",
                high_water_mark,
                first_available,
                messages,
                seq,
                0,
            ))
        }
        PartitionAnswer::Data {
            partition,
            base_seq,
            high_water_mark,
            ..
        } => (partition, base_seq, high_water_mark),
        // The first bundle numbers its own messages.
        PartitionAnswer::SparseData {
            partition,
            high_water_mark,
            ..
        } => (partition, 0, high_water_mark),
    };
    // 0 and 2**64-1 name no message to skip to.
    let from = if seq == u64::MAX { 0 } else { seq };
    let mut next = base;
    let mut whole = false;
    // Messages of a bundle mostly share its timestamp: one int object serves them.
    let mut last_ts: Option<(u64, Bound<'py, PyInt>)> = None;
    for b in chunk_bundles(chunk) {
        whole = true;
        let parsed = Bundle::parse(b).map_err(bad)?;
        parsed.decompress_into(set, MAX_SET).map_err(bad)?;
        for m in parsed.messages(set, next) {
            let m = m.map_err(bad)?;
            if m.seq >= from {
                let ts = match &last_ts {
                    Some((t, obj)) if *t == m.ts => obj.clone(),
                    _ => {
                        let obj = PyInt::new(py, m.ts);
                        last_ts = Some((m.ts, obj.clone()));
                        obj
                    }
                };
                messages.append(message.make([
                    PyInt::new(py, m.seq).into_any(),
                    ts.into_any(),
                    match m.key {
                        Some(k) => PyBytes::new(py, k).into_any(),
                        None => py.None().into_bound(py),
                    },
                    PyBytes::new(py, m.content).into_any(),
                ])?)?;
            }
            next = m.seq + 1;
        }
    }
    let (next_seq, needed) = if whole {
        (next, 0)
    } else if !chunk.is_empty() {
        // A bundle larger than the fetch size: its varint length and bytes, to ask again.
        let mut r = Reader::new(chunk);
        let len = r.varint_len("a bundle").map_err(bad)?;
        (seq, r.position() + len)
    } else if seq == u64::MAX {
        (hwm + 1, 0)
    } else if seq == 0 {
        (base.max(1), 0)
    } else {
        (seq, 0)
    };
    Ok((partition, "data", hwm, base, messages, next_seq, needed))
}
