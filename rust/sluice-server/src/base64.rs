//! RFC 4648 base64 with padding, decoded without a dependency: HTTP Basic credentials on the
//! admin endpoint and base64 keys of memcached's meta commands (`b`).

/// The bytes `s` encodes; None unless it is standard base64 with its padding.
pub fn decode(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let groups = s.len() / 4;
    let mut out = Vec::with_capacity(groups * 3);
    for (i, group) in s.chunks(4).enumerate() {
        let pad = group.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != groups) {
            return None;
        }
        let mut n = 0u32;
        for &c in &group[..4 - pad] {
            n = n << 6 | value(c)?;
        }
        n <<= 6 * pad as u32;
        out.extend_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8][..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_padded_base64_and_refuses_the_rest() {
        assert_eq!(decode(b"YWRhOnNlY3JldA==").unwrap(), b"ada:secret");
        assert_eq!(decode(b"YWRhOnM=").unwrap(), b"ada:s");
        assert_eq!(decode(b"YWRh").unwrap(), b"ada");
        assert_eq!(decode(b"").unwrap(), b"");
        for bad in ["YWR", "YW=h", "Y===", "YWRh!A==", "YQ==YWRh"] {
            assert_eq!(decode(bad.as_bytes()), None, "{bad}");
        }
    }
}
