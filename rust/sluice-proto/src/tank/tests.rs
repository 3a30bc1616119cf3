use super::bundle::{self, Bundle, NewMessage};
use super::request::Request;
use super::*;

#[test]
fn varints_round_trip_and_overlong_ones_are_refused() {
    for v in [0, 1, 127, 128, 300, 1 << 35, u64::MAX] {
        let mut out = Vec::new();
        put_varint(&mut out, v);
        let mut r = Reader::new(&out);
        assert_eq!(r.varint("v"), Ok(v));
        assert!(r.is_empty());
    }
    // Eleven continuation bytes, or a tenth byte past 64 bits.
    assert_eq!(
        Reader::new(&[0xff; 11]).varint("v"),
        Err(DecodeError::BadVarint)
    );
    let mut past = vec![0xff; 9];
    past.push(0x02);
    assert_eq!(Reader::new(&past).varint("v"), Err(DecodeError::BadVarint));
    assert_eq!(
        Reader::new(&[0x80]).varint("v"),
        Err(DecodeError::Short("v"))
    );
}

#[test]
fn check_waits_for_a_whole_frame_and_refuses_one_over_the_limit() {
    assert_eq!(check(&[1, 2], 100), Ok(Frame::Incomplete(HEADER)));
    assert_eq!(check(&[1, 10, 0, 0, 0, 1], 100), Ok(Frame::Incomplete(15)));
    assert_eq!(
        check(&[1, 0, 0, 0, 1], 100),
        Err(DecodeError::TooLarge {
            len: 1 << 24,
            max: 100
        })
    );
    assert_eq!(
        check(&[3, 0, 0, 0, 0, 9], 100),
        Ok(Frame::Complete {
            id: 3,
            payload: (5, 5)
        })
    );
}

#[test]
fn lengths_and_counts_past_the_payload_are_errors_not_allocations() {
    // A produce whose bundle length points past the payload.
    let mut p = vec![2, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, b't', 1, 0, 0];
    p.extend_from_slice(&[0xff, 0xff, 0xff, 0x7f]);
    assert!(matches!(
        Request::decode(msg::PRODUCE, &p),
        Err(DecodeError::Short(_))
    ));
    // A create-topic whose configuration is longer than what follows.
    let c = [1, 0, 0, 0, 1, b't', 1, 0, 0x90, 0x4e];
    assert!(Request::decode(msg::CREATE_TOPIC, &c).is_err());
    // Bytes after a whole request.
    assert!(Request::decode(msg::STATUS, &[1, 0, 0, 0, 9]).is_err());
    // A bundle claiming a billion messages in a few bytes.
    let mut b = vec![0x00];
    put_varint(&mut b, 1_000_000_000);
    b.extend_from_slice(&[0, 1, 2, 3]);
    assert!(matches!(Bundle::parse(&b), Err(DecodeError::Invalid(_))));
    // An unknown request id.
    assert!(Request::decode(0x42, &[]).is_err());
}

#[test]
fn snappy_bundles_round_trip_and_bad_ones_are_errors() {
    let contents: Vec<Vec<u8>> = (0..40)
        .map(|i| format!("message {i} padding padding").into_bytes())
        .collect();
    let msgs: Vec<NewMessage<'_>> = contents
        .iter()
        .enumerate()
        .map(|(i, c)| NewMessage {
            ts: 1000 + (i as u64 / 10),
            key: (i % 3 == 0).then_some(&b"k"[..]),
            content: c,
        })
        .collect();
    let mut out = Vec::new();
    bundle::write(&mut out, &msgs, bundle::codec::SNAPPY);
    let b = Bundle::parse(&out).unwrap();
    assert_eq!((b.codec, b.count), (bundle::codec::SNAPPY, 40));
    let set = b.messages_bytes(1 << 20).unwrap();
    let read: Vec<_> = b.messages(&set, 500).map(Result::unwrap).collect();
    assert_eq!(read.len(), 40);
    assert_eq!(read[13].seq, 513);
    assert_eq!(read[13].ts, 1001);
    assert_eq!(read[12].key, Some(&b"k"[..]));
    assert_eq!(read[13].key, None);
    assert_eq!(read[39].content, &contents[39][..]);
    // A declared length over the limit is refused before decompressing.
    assert!(matches!(
        b.messages_bytes(16),
        Err(DecodeError::TooLarge { .. })
    ));
    // Damage inside the compressed set.
    let mut bad = out.clone();
    let n = bad.len();
    bad[n - 8..].fill(0xff);
    let b = Bundle::parse(&bad).unwrap();
    assert!(b.messages_bytes(1 << 20).is_err());
}

#[test]
fn a_sparse_bundle_numbers_its_messages_itself() {
    // Flags: 3 messages, sparse; first 100, last 100 + 5 + 1; the middle one 2 after the first.
    let mut b = vec![0x40 | (3 << 2)];
    b.extend_from_slice(&100u64.to_le_bytes());
    put_varint(&mut b, 5);
    for (i, (gap, content)) in [(None, &b"a"[..]), (Some(1), b"b"), (None, b"c")]
        .iter()
        .enumerate()
    {
        b.push(if i == 0 {
            0
        } else {
            bundle::msg_flag::USE_LAST_SPECIFIED_TS
        });
        if let Some(g) = gap {
            put_varint(&mut b, *g);
        }
        if i == 0 {
            b.extend_from_slice(&7u64.to_le_bytes());
        }
        put_varint(&mut b, content.len() as u64);
        b.extend_from_slice(content);
    }
    let parsed = Bundle::parse(&b).unwrap();
    assert_eq!(parsed.sparse, Some((100, 106)));
    let set = parsed.messages_bytes(1 << 20).unwrap();
    let seqs: Vec<u64> = parsed.messages(&set, 0).map(|m| m.unwrap().seq).collect();
    assert_eq!(seqs, [100, 102, 106]);
}

#[test]
fn a_truncated_message_set_ends_the_messages_with_an_error() {
    let msgs = [NewMessage {
        ts: 1,
        key: None,
        content: b"hello",
    }; 3];
    let mut out = Vec::new();
    bundle::write(&mut out, &msgs, bundle::codec::NONE);
    out.truncate(out.len() - 2);
    let b = Bundle::parse(&out).unwrap();
    let set = b.messages_bytes(1 << 20).unwrap();
    let read: Vec<_> = b.messages(&set, 0).collect();
    assert_eq!(read.len(), 3);
    assert!(read[2].is_err());
}
