use super::*;

/// A frame built byte by byte, as seed 001's tables lay it out.
fn by_hand(opaque: u32, opcode: u16, flags: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&opaque.to_be_bytes());
    body.extend_from_slice(&opcode.to_be_bytes());
    body.extend_from_slice(flags);
    body.extend_from_slice(rest);
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(&body);
    f
}

#[test]
fn the_smallest_request_and_response_are_11_and_13_bytes() {
    let req = by_hand(7, opcode::HELLO, &[0], &[]);
    assert_eq!(req.len(), 11);
    assert_eq!(check(&req, 1 << 20), Ok(Check::Complete(11)));
    let f = Frame::decode(&req[4..]).unwrap();
    assert_eq!(
        (f.opaque, f.opcode, f.status, f.payload),
        (7, 1, None, &b""[..])
    );
    let resp = by_hand(
        7,
        opcode::HELLO,
        &[flag::RESPONSE],
        &status::UNKNOWN_COMMAND.to_be_bytes(),
    );
    assert_eq!(resp.len(), 13);
    let f = Frame::decode(&resp[4..]).unwrap();
    assert!(f.is_response());
    assert_eq!(f.status, Some(status::UNKNOWN_COMMAND));
}

#[test]
fn what_is_written_is_the_bytes_by_hand_and_reads_back() {
    let lane = FlexEntry {
        key: flex_key::LANE_ID,
        value: b"lane-1",
    };
    let vb = FlexEntry {
        key: flex_key::VBUCKET_ID,
        value: &[0x00, 0x2a],
    };
    let mut out = Vec::new();
    FrameOut {
        opaque: 0x0102_0304,
        opcode: opcode::GET,
        flags: flag::FENCE | flag::QUIET,
        status: Some(status::NOT_FOUND),
        flex: &[lane, vb],
        payload: b"\x81\xa2id\xa3key",
    }
    .write(&mut out);
    let mut rest = status::NOT_FOUND.to_be_bytes().to_vec();
    rest.extend_from_slice(&16u32.to_be_bytes());
    rest.extend_from_slice(&[0, 0, 0, 6]);
    rest.extend_from_slice(b"lane-1");
    rest.extend_from_slice(&[0, 7, 0, 2, 0, 0x2a]);
    rest.extend_from_slice(b"\x81\xa2id\xa3key");
    let flags = flag::RESPONSE | flag::FLEX | flag::FENCE | flag::QUIET;
    assert_eq!(out, by_hand(0x0102_0304, opcode::GET, &[flags], &rest));
    let f = Frame::decode(&out[4..]).unwrap();
    assert!(f.has(flag::FENCE) && f.has(flag::QUIET) && !f.has(flag::MORE));
    assert_eq!(
        f.flex_entries().collect::<Result<Vec<_>, _>>(),
        Ok(vec![lane, vb])
    );
    assert_eq!(f.flex_value(flex_key::VBUCKET_ID), Some(&[0x00, 0x2a][..]));
    assert_eq!(f.flex_value(flex_key::TXID), None);
    assert_eq!(f.payload, b"\x81\xa2id\xa3key");
}

#[test]
fn lengths_are_checked_before_anything_is_buffered() {
    assert_eq!(check(&[0, 0], 100), Ok(Check::Incomplete(4)));
    let big = 0x7fff_ffffu32.to_be_bytes();
    assert_eq!(
        check(&big, 1 << 20),
        Err(DecodeError::TooLarge {
            len: 0x7fff_ffff,
            max: 1 << 20
        })
    );
    assert!(matches!(
        check(&[0, 0, 0, 6], 100),
        Err(DecodeError::Invalid(_))
    ));
    let f = by_hand(1, 2, &[0], b"abc");
    assert_eq!(check(&f[..9], 100), Ok(Check::Incomplete(f.len())));
}

#[test]
fn bad_flags_and_flex_headers_are_errors() {
    // Unassigned bits 5 and 6.
    for bits in [0x20, 0x40] {
        assert!(matches!(
            Frame::decode(&by_hand(1, 1, &[bits], &[])[4..]),
            Err(DecodeError::Invalid(_))
        ));
    }
    // A next flag byte announced and missing; present but with a bit set; all zero is taken.
    assert_eq!(
        Frame::decode(&by_hand(1, 1, &[flag::NEXT_BYTE], &[])[4..]),
        Err(DecodeError::Short("a flag byte its previous one announces"))
    );
    assert!(matches!(
        Frame::decode(&by_hand(1, 1, &[flag::NEXT_BYTE, 0x01], &[])[4..]),
        Err(DecodeError::Invalid(_))
    ));
    let f = by_hand(1, 1, &[flag::NEXT_BYTE, 0], b"p");
    assert_eq!(Frame::decode(&f[4..]).unwrap().payload, b"p");
    let many = [flag::NEXT_BYTE; 5];
    assert!(matches!(
        Frame::decode(&by_hand(1, 1, &many, &[0])[4..]),
        Err(DecodeError::Invalid(_))
    ));
    // A response without its status.
    assert_eq!(
        Frame::decode(&by_hand(1, 1, &[flag::RESPONSE], &[0])[4..]),
        Err(DecodeError::Short("its status"))
    );
    // A flex header longer than the frame, an entry past its header, a fixed width broken.
    let flex = |header: &[u8]| {
        let mut rest = (header.len() as u32).to_be_bytes().to_vec();
        rest.extend_from_slice(header);
        let f = by_hand(1, 1, &[flag::FLEX], &rest);
        Frame::decode(&f[4..]).map(|d| {
            d.flex_entries()
                .map(|e| e.map(|e| (e.key, e.value.to_vec())))
                .collect::<Vec<_>>()
        })
    };
    let mut long = 100u32.to_be_bytes().to_vec();
    long.extend_from_slice(&[0, 0, 0, 0]);
    assert_eq!(
        Frame::decode(&by_hand(1, 1, &[flag::FLEX], &long)[4..]),
        Err(DecodeError::Short("its flex header"))
    );
    assert_eq!(
        flex(&[0, 0, 0, 9, b'x']),
        Err(DecodeError::Short("a flex header entry's value"))
    );
    assert_eq!(
        flex(&[0, 0, 0]),
        Err(DecodeError::Short("a flex header entry's key and length"))
    );
    assert!(matches!(
        flex(&[0, 5, 0, 2, 1, 2]),
        Err(DecodeError::Invalid(_))
    ));
    // An unknown key is carried, not refused.
    assert_eq!(
        flex(&[0x12, 0x34, 0, 1, 9]),
        Ok(vec![Ok((0x1234, vec![9]))])
    );
}
