//! Snappy's raw format checked without decompressing it: the declared length, then elements
//! (literals, and copies of 1, 2 or 4-byte offsets) that must stay within the input, copy from
//! bytes already produced, and produce exactly the declared length. What passes decompresses
//! without error (the format has no checksum: a flipped byte in a literal still passes, as it
//! would through a decompressor). It reads each tag once and writes nothing, so a broker can
//! check a produced Snappy bundle at a fraction of the cost of decompressing it.

use super::DecodeError;

fn bad(why: &str) -> DecodeError {
    DecodeError::Snappy(why.to_string())
}

/// Checks `compressed`; returns its uncompressed length, which must be at most `max`.
pub fn check(compressed: &[u8], max: usize) -> Result<usize, DecodeError> {
    // The preamble: the uncompressed length as a little-endian varint of at most 32 bits.
    let mut total: u64 = 0;
    let mut at = 0;
    loop {
        let b = *compressed
            .get(at)
            .ok_or_else(|| bad("the input ends inside its length"))?;
        total |= u64::from(b & 0x7f) << (7 * at);
        at += 1;
        if b & 0x80 == 0 {
            break;
        }
        if at == 5 {
            return Err(bad("its length is longer than 32 bits"));
        }
    }
    if total > u32::MAX as u64 {
        return Err(bad("its length is longer than 32 bits"));
    }
    let total = total as usize;
    if total > max {
        return Err(DecodeError::TooLarge { len: total, max });
    }
    let input = compressed;
    let mut produced = 0usize;
    while at < input.len() {
        let tag = input[at];
        at += 1;
        let (len, offset) = match tag & 0x03 {
            0 => {
                let mut len = (tag >> 2) as usize;
                if len >= 60 {
                    let n = len - 59;
                    let bytes = input
                        .get(at..at + n)
                        .ok_or_else(|| bad("the input ends inside a literal's length"))?;
                    len = bytes
                        .iter()
                        .rev()
                        .fold(0usize, |v, &b| (v << 8) | b as usize);
                    at += n;
                }
                let len = len + 1;
                if input.len() - at < len {
                    return Err(bad("a literal runs past the input"));
                }
                at += len;
                (len, None)
            }
            1 => {
                let low = *input
                    .get(at)
                    .ok_or_else(|| bad("the input ends inside a copy"))?;
                at += 1;
                let len = 4 + ((tag >> 2) & 0x07) as usize;
                (len, Some(((tag as usize >> 5) << 8) | low as usize))
            }
            2 => {
                let b = input
                    .get(at..at + 2)
                    .ok_or_else(|| bad("the input ends inside a copy"))?;
                at += 2;
                (
                    1 + (tag >> 2) as usize,
                    Some(u16::from_le_bytes([b[0], b[1]]) as usize),
                )
            }
            _ => {
                let b = input
                    .get(at..at + 4)
                    .ok_or_else(|| bad("the input ends inside a copy"))?;
                at += 4;
                (
                    1 + (tag >> 2) as usize,
                    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize),
                )
            }
        };
        if let Some(offset) = offset {
            if offset == 0 || offset > produced {
                return Err(bad("a copy reaches before the start of the output"));
            }
        }
        if total - produced < len {
            return Err(bad("the output runs past its declared length"));
        }
        produced += len;
    }
    if produced != total {
        return Err(bad("the output ends before its declared length"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compress(data: &[u8]) -> Vec<u8> {
        snap::raw::Encoder::new().compress_vec(data).unwrap()
    }

    #[test]
    fn what_snap_writes_passes_with_its_length() {
        let mut data = Vec::new();
        for i in 0..20_000u32 {
            data.extend_from_slice(format!("message {} {}", i % 97, i).as_bytes());
        }
        // Long literals (random-ish bytes), short and long copies.
        data.extend((0..70_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
        for input in [&data[..], b"", b"a", &[7u8; 100_000][..]] {
            let c = compress(input);
            assert_eq!(check(&c, 1 << 30), Ok(input.len()));
        }
    }

    #[test]
    fn damage_is_found_where_a_decompressor_would_fail() {
        let data: Vec<u8> = (0..5000u32)
            .flat_map(|i| format!("k{} ", i % 50).into_bytes())
            .collect();
        let c = compress(&data);
        for cut in [1, c.len() / 3, c.len() - 1] {
            let short = &c[..cut];
            let ours = check(short, 1 << 30);
            let theirs = snap::raw::Decoder::new().decompress_vec(short);
            assert!(ours.is_err() && theirs.is_err(), "cut at {cut}");
        }
        // Every single-byte change: we refuse at least what the decompressor refuses.
        for i in 0..c.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut d = c.clone();
                d[i] ^= flip;
                if snap::raw::Decoder::new().decompress_vec(&d).is_err() {
                    assert!(check(&d, 1 << 30).is_err(), "byte {i} ^ {flip:#x}");
                }
            }
        }
        assert!(matches!(
            check(&c, 10),
            Err(DecodeError::TooLarge { max: 10, .. })
        ));
        assert!(check(&[0xff, 0xff, 0xff, 0xff, 0xff, 0x01], 1 << 30).is_err());
    }
}
