//! TANK's protocol against bytes recorded from its own broker and tank-cli
//! (tests/data/tank_frames.txt): every frame decodes, and re-encodes to the same bytes; every
//! bundle's messages read as the recording's decoder read them.

use sluice_proto::tank::bundle::{self, Bundle, NewMessage};
use sluice_proto::tank::request::Request;
use sluice_proto::tank::response::{
    chunk_bundles, ConsumeAnswer, CreateTopicAck, PartitionAnswer, PartitionsAnswer,
    PartitionsInfo, ProduceAck, StatusInfo, TopicsInfo,
};
use sluice_proto::tank::{check, msg, Frame};

struct Recorded {
    conn: String,
    from_client: bool,
    bytes: Vec<u8>,
}

fn recorded() -> Vec<Recorded> {
    include_str!("data/tank_frames.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let mut f = l.split(' ');
            let conn = f.next().unwrap().to_string();
            let from_client = f.next().unwrap() == "C>S";
            let hex = f.next().unwrap();
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            Recorded {
                conn,
                from_client,
                bytes,
            }
        })
        .collect()
}

fn payload(frame: &[u8]) -> (u8, &[u8]) {
    match check(frame, 1 << 20).unwrap() {
        Frame::Complete { id, payload } => {
            assert_eq!(payload.1, frame.len(), "one frame per recording line");
            (id, &frame[payload.0..payload.1])
        }
        other => panic!("not a whole frame: {other:?}"),
    }
}

/// A message as read: sequence number, timestamp, key, content.
type Read = (u64, u64, Option<Vec<u8>>, Vec<u8>);

/// Reads every message of a bundle, numbering a plain one from `base`.
fn messages(b: &[u8], base: u64) -> Vec<Read> {
    let bundle = Bundle::parse(b).unwrap();
    let set = bundle.messages_bytes(1 << 20).unwrap();
    bundle
        .messages(&set, base)
        .map(|m| {
            let m = m.unwrap();
            (m.seq, m.ts, m.key.map(<[u8]>::to_vec), m.content.to_vec())
        })
        .collect()
}

/// A plain bundle re-encodes to its bytes; a Snappy one to a bundle of the same messages.
fn reencodes(b: &[u8]) {
    let parsed = Bundle::parse(b).unwrap();
    let read = messages(b, 0);
    let news: Vec<NewMessage<'_>> = read
        .iter()
        .map(|(_, ts, key, content)| NewMessage {
            ts: *ts,
            key: key.as_deref(),
            content,
        })
        .collect();
    let mut out = Vec::new();
    bundle::write(&mut out, &news, parsed.codec);
    if parsed.codec == bundle::codec::NONE {
        assert_eq!(out, b);
    } else {
        assert_eq!(messages(&out, 0), read);
    }
}

#[test]
fn every_client_frame_decodes_and_reencodes_to_its_bytes() {
    let mut kinds = std::collections::BTreeSet::new();
    for r in recorded().iter().filter(|r| r.from_client) {
        let (id, body) = payload(&r.bytes);
        let req = Request::decode(id, body).unwrap_or_else(|e| panic!("{}: {e}", r.conn));
        let mut out = Vec::new();
        req.write(&mut out);
        assert_eq!(out, r.bytes, "{}: {req:?}", r.conn);
        kinds.insert(id);
        if let Request::Produce(p) = &req {
            for part in p.topics.iter().flat_map(|t| &t.partitions) {
                reencodes(part.bundle);
            }
        }
    }
    let want = [
        msg::PRODUCE,
        msg::CONSUME,
        msg::DISCOVER_PARTITIONS,
        msg::CREATE_TOPIC,
        msg::STATUS,
        msg::DISCOVER_TOPICS,
    ];
    assert!(want.iter().all(|k| kinds.contains(k)), "{kinds:?}");
}

#[test]
fn every_broker_frame_decodes_and_reencodes_to_its_bytes() {
    for r in recorded().iter().filter(|r| !r.from_client) {
        let (id, body) = payload(&r.bytes);
        let mut out = Vec::new();
        match id {
            msg::PING => {
                assert!(body.is_empty());
                out.extend_from_slice(&sluice_proto::tank::PING_FRAME);
            }
            msg::PRODUCE => ProduceAck::decode(body).unwrap().write(&mut out),
            msg::CONSUME => {
                let (answer, chunks) = ConsumeAnswer::decode(body).unwrap();
                answer.write_headers(&mut out);
                out.extend_from_slice(chunks);
                let mut at = 0;
                for p in answer.partitions() {
                    let chunk = &chunks[at..at + p.chunk_len() as usize];
                    at += chunk.len();
                    let mut base = match p {
                        PartitionAnswer::Data { base_seq, .. } => *base_seq,
                        _ => 0,
                    };
                    for b in chunk_bundles(chunk) {
                        let read = messages(b, base);
                        base += read.len() as u64;
                        reencodes(b);
                    }
                }
            }
            msg::DISCOVER_PARTITIONS => PartitionsInfo::decode(body).unwrap().write(&mut out),
            msg::DISCOVER_TOPICS => TopicsInfo::decode(body).unwrap().write(&mut out),
            msg::CREATE_TOPIC => CreateTopicAck::decode(body).unwrap().write(&mut out),
            msg::STATUS => StatusInfo::decode(body).unwrap().write(&mut out),
            other => panic!("{}: unexpected message id {other:#x}", r.conn),
        }
        assert_eq!(out, r.bytes, "{}", r.conn);
    }
}

fn frames_of(conn: &str, from_client: bool) -> Vec<Vec<u8>> {
    recorded()
        .into_iter()
        .filter(|r| r.conn == conn && r.from_client == from_client)
        .map(|r| r.bytes)
        .collect()
}

#[test]
fn the_recorded_fields_read_as_the_broker_meant_them() {
    // A keyed message, then messages that reuse the last timestamp.
    let produce = &frames_of("conn14", true)[0];
    let (id, body) = payload(produce);
    let Request::Produce(p) = Request::decode(id, body).unwrap() else {
        panic!()
    };
    assert_eq!((p.request_id, p.client_id), (100, &b"py"[..]));
    let read = messages(p.topics[0].partitions[0].bundle, 1);
    assert_eq!(read[0], (1, 1_700_000_000_000, None, b"raw-1".to_vec()));
    assert_eq!(
        read[1],
        (
            2,
            1_700_000_000_000,
            Some(b"rk".to_vec()),
            b"raw-2".to_vec()
        )
    );

    // A version-3 consume carries a flags byte.
    let consumes: Vec<_> = frames_of("conn14", true)
        .into_iter()
        .filter(|f| f[0] == msg::CONSUME)
        .collect();
    let (id, body) = payload(&consumes[1]);
    let Request::Consume(c) = Request::decode(id, body).unwrap() else {
        panic!()
    };
    assert_eq!((c.client_version, c.flags), (3, Some(0)));
    assert_eq!(
        (
            c.topics[0].partitions[0].seq,
            c.topics[0].partitions[0].fetch_size
        ),
        (2, 64)
    );

    // Past the high-water mark: the boundary check with the first available sequence number.
    let answers: Vec<_> = frames_of("conn14", false)
        .into_iter()
        .filter(|f| f[0] == msg::CONSUME)
        .collect();
    let (_, body) = payload(&answers[2]);
    let (a, _) = ConsumeAnswer::decode(body).unwrap();
    assert_eq!(
        a.partitions().next(),
        Some(&PartitionAnswer::BoundaryCheck {
            partition: 0,
            high_water_mark: 28,
            first_available: 1
        })
    );
    // The fetch size is soft: 64 asked, four whole bundles sent (the last one Snappy's 20).
    let (_, body) = payload(&answers[1]);
    let (a, chunks) = ConsumeAnswer::decode(body).unwrap();
    assert_eq!(a.partitions().next().unwrap().chunk_len(), 219);
    let bundles = chunk_bundles(chunks);
    assert_eq!(bundles.len(), 4);
    let snappy = messages(bundles[3], 0);
    assert_eq!(snappy.len(), 20);
    assert!(snappy[19].3.starts_with(b"compressible-message-20-"));

    // An unknown topic: partition id 0xffff and nothing else.
    let unknown = frames_of("conn10", false);
    let (_, body) = payload(&unknown[1]);
    let (a, chunks) = ConsumeAnswer::decode(body).unwrap();
    assert_eq!(
        a.topics[0].partitions,
        PartitionsAnswer::UnknownTopic { requested: 1 }
    );
    assert!(chunks.is_empty());
}
