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

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// A clustered broker's answers, as TANK's client parses them (client_api_produce.cpp,
/// client_api_consume.cpp, client_api_discover_topology.cpp and
/// client_api_discover_partitions.cpp): no recording has them (every one is of a broker on its
/// own), so the bytes are laid out from the client's parser.
#[test]
fn cluster_answers_are_laid_out_as_tanks_client_reads_them() {
    use sluice_proto::tank::response::{
        redirect, Endpoint, PartitionInfo, TopologyInfo, TopologyNode,
    };
    let leader = Endpoint {
        addr4: [10, 0, 0, 2],
        port: 11011,
    };
    // Produce: partition 0 led at 10.0.0.2:11011, partition 1 led by nobody.
    let mut errors = vec![redirect::OTHER_LEADER];
    leader.write(&mut errors);
    errors.push(redirect::NO_LEADER);
    let mut out = Vec::new();
    ProduceAck {
        request_id: 1,
        errors: &errors,
    }
    .write(&mut out);
    assert_eq!(out, hex("01 0c000000 01000000 fc 0a000002 032b fd"));

    // Consume: the redirect entry carries the endpoint and nothing after it.
    let mut out = Vec::new();
    ConsumeAnswer {
        request_id: 1,
        topics: vec![sluice_proto::tank::response::TopicAnswer {
            name: b"wire",
            partitions: PartitionsAnswer::Known(vec![PartitionAnswer::OtherLeader {
                partition: 0,
                leader,
            }]),
        }],
    }
    .write_headers(&mut out);
    assert_eq!(
        out,
        hex("02 18000000 14000000 01000000 01 04 77697265 01 0000 fc 0a000002 032b")
    );
    let (back, _) = ConsumeAnswer::decode(&out[5..]).unwrap();
    assert_eq!(
        back.topics[0].partitions,
        PartitionsAnswer::Known(vec![PartitionAnswer::OtherLeader {
            partition: 0,
            leader
        }])
    );

    // DiscoverTopology: a broker on its own, then a cluster of two.
    let mut out = Vec::new();
    TopologyInfo {
        request_id: 1,
        cluster: None,
    }
    .write(&mut out);
    assert_eq!(out, hex("0c 06000000 01000000 ffff"));
    let cluster = TopologyInfo {
        request_id: 1,
        cluster: Some((
            b"c1",
            vec![
                TopologyNode {
                    id: 1,
                    available: true,
                    endpoint: Some(Endpoint {
                        addr4: [10, 0, 0, 1],
                        port: 11011,
                    }),
                    partitions: 4,
                },
                TopologyNode {
                    id: 2,
                    available: true,
                    endpoint: None,
                    partitions: 0,
                },
            ],
        )),
    };
    let mut out = Vec::new();
    cluster.write(&mut out);
    assert_eq!(
        out,
        hex("0c 19000000 01000000 0200 02 6331 0100 03 0a000001 032b 0400 0200 02 0000")
    );
    assert_eq!(TopologyInfo::decode(&out[5..]).unwrap(), cluster);

    // DiscoverPartitions: a partition here, one led elsewhere, one led by nobody.
    let info = PartitionsInfo {
        request_id: 1,
        topic: b"t",
        partitions: vec![
            PartitionInfo::Range {
                first: 1,
                high_water_mark: 9,
            },
            PartitionInfo::OtherLeader(leader),
            PartitionInfo::NoLeader,
        ],
    };
    let mut out = Vec::new();
    info.write(&mut out);
    let mut want = hex("06 00000000 01000000 01 74 0300 0100000000000000 0900000000000000");
    want.extend([0xff; 16]);
    want.extend(hex("fc 0a000002 032b"));
    want.extend([0xff; 16]);
    want.push(0xfd);
    let len = (want.len() - 5) as u32;
    want[1..5].copy_from_slice(&len.to_le_bytes());
    assert_eq!(out, want);
    assert_eq!(PartitionsInfo::decode(&out[5..]).unwrap(), info);

    // Status and DiscoverTopics of a cluster-aware broker (service_api.cpp): the cluster's
    // flags, name and available nodes after the partition count; each topic's replication
    // factor after its partition count.
    let status = StatusInfo {
        request_id: 1,
        cluster: Some((b"c1".to_vec(), 3)),
        topics: 2,
        partitions: 6,
        open_partitions: 6,
        version: 400,
        ..StatusInfo::default()
    };
    let mut out = Vec::new();
    status.write(&mut out);
    assert_eq!(
        out,
        hex("0a 26000000 01000000 00 01 02000000 06000000 00 02 6331 03000000 06000000 00000000 00000000 90010000")
    );
    assert_eq!(StatusInfo::decode(&out[5..]).unwrap(), status);
    let topics = TopicsInfo {
        request_id: 1,
        cluster_aware: true,
        topics: vec![(b"t", true, 6, 1)],
    };
    let mut out = Vec::new();
    topics.write(&mut out);
    assert_eq!(
        out,
        hex("0b 0f000000 01000000 01000000 01 01 74 01 0600 01")
    );
    assert_eq!(TopicsInfo::decode(&out[5..]).unwrap(), topics);

    // What the client asks a leader it was sent to: the topic, then bare partition ids.
    let req = hex("06 0a000000 01000000 01 74 0300 0500");
    let (id, body) = payload(&req);
    match Request::decode(id, body).unwrap() {
        Request::DiscoverPartitions { partitions, .. } => assert_eq!(partitions, [3, 0, 5, 0]),
        other => panic!("{other:?}"),
    }
}
