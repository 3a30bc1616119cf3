//! Couchbase's key-to-vbucket mapping, so that vbucket-aware clients and sluice agree.

/// `((crc32(key) >> 16) & 0x7fff) % num_vbuckets`, crc32 as in zlib.
pub fn vbucket_of(key: &[u8], num_vbuckets: u16) -> u16 {
    let crc = crc32fast::hash(key);
    (((crc >> 16) & 0x7fff) % num_vbuckets as u32) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_zlib_crc32_mapping() {
        // zlib.crc32(b"hello") == 0x3610a686 -> (0x3610 & 0x7fff) = 13840
        assert_eq!(crc32fast::hash(b"hello"), 0x3610_a686);
        assert_eq!(vbucket_of(b"hello", 1024), (13840 % 1024) as u16);
        assert_eq!(vbucket_of(b"hello", 64), (13840 % 64) as u16);
    }
}
