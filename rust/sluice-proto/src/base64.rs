//! RFC 4648 base64 with padding, without a dependency: HTTP Basic credentials on the admin
//! endpoint, base64 keys of memcached's meta commands (`b`), SCRAM's salts, proofs and
//! signatures, the iproto greeting's salt, and bytes in the JSON of tuples.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// `bytes` as standard base64 with its padding.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let n = group
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= group.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

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

    #[test]
    fn encodes_what_it_decodes() {
        assert_eq!(encode(b"ada:secret"), "YWRhOnNlY3JldA==");
        assert_eq!(encode(b"ada:s"), "YWRhOnM=");
        assert_eq!(encode(b"n,,"), "biws");
        assert_eq!(encode(b""), "");
        for len in 0..40u8 {
            let bytes: Vec<u8> = (0..len).map(|i| i.wrapping_mul(97) ^ 0xa5).collect();
            assert_eq!(decode(encode(&bytes).as_bytes()).unwrap(), bytes);
        }
    }
}
