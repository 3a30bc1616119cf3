//! A topic partition's log fed hostile bundles, as a producer sends them: each is checked and
//! appended when the check passes, in small segments with retention by bytes, then read back
//! from every sequence number with small fetch sizes. Whatever was stored must read back as
//! whole bundles that parse, with sequence numbers that only rise.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::partition_log::{LogConfig, PartitionLog, Read};
use sluice_proto::tank::bundle::Bundle;
use sluice_proto::tank::response::chunk_bundles;

fuzz_target!(|data: &[u8]| {
    let config = LogConfig {
        segment_bytes: 512,
        index_interval: 64,
        retention_bytes: Some(2048),
        ..LogConfig::default()
    };
    let mut log = PartitionLog::new(config);
    // Bundles are u16-length-prefixed pieces of the input.
    let mut rest = data;
    let mut now = 1;
    while rest.len() >= 2 {
        let n = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        let bundle = &rest[2..2 + n];
        rest = &rest[2 + n..];
        if let Ok(c) = PartitionLog::check(bundle) {
            let _ = log.append(bundle, &c, now);
            log.enforce_retention(now);
        }
        now += 1;
    }
    let (first, end) = (log.first_available(), log.next_seq());
    assert!(first <= end);
    for seq in [0, first, first + 1, end.saturating_sub(1), end, u64::MAX] {
        for fetch in [1u32, 100, 4096] {
            if let Read::Chunk {
                base_seq, bundles, ..
            } = log.read(seq, fetch)
            {
                assert!(
                    base_seq >= first && base_seq < end,
                    "{base_seq} outside {first}..{end}"
                );
                let bytes = bundles.share();
                for b in chunk_bundles(&bytes) {
                    Bundle::parse(b).expect("a stored bundle parses");
                }
            }
        }
    }
});
