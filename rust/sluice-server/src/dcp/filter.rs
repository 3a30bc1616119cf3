//! A StreamFilter on a DCP connection. The streams write a round of DCP frames into a staging
//! buffer as usual; the plugin judges the round's documents by key; the frames then go to the
//! output without the dropped documents and with the stripped ones' values cut off. Markers,
//! stream ends and state changes pass untouched, so a consumer sees the same snapshots with
//! gaps in the seqnos, as after deduplication.

use std::sync::Arc;

use sluice_proto::dcp::opcode;
use sluice_proto::mcbp::{self, magic};

use crate::policy::{action, FilterBatch, FilterDecision, FilterDocs, FilterKeys};

/// The frames in `buf`, which holds whole frames the producer encoded.
fn frames(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let n = mcbp::frame_len(&buf[at..], usize::MAX).ok()??;
        let f = &buf[at..at + n];
        at += n;
        Some(f)
    })
}

/// Where a document's key lies in its frame: None for frames that are not documents.
fn key_range(f: &[u8]) -> Option<std::ops::Range<usize>> {
    if !matches!(
        f[1],
        opcode::MUTATION | opcode::DELETION | opcode::EXPIRATION
    ) {
        return None;
    }
    let (framing, key_len) = match f[0] {
        magic::ALT_REQUEST => (f[2] as usize, f[3] as usize),
        _ => (0, u16::from_be_bytes([f[2], f[3]]) as usize),
    };
    let start = mcbp::HEADER_LEN + framing + f[4] as usize;
    (start + key_len <= f.len()).then_some(start..start + key_len)
}

/// A round of staged frames, shared with the StreamFilter's thread while it is judged.
pub struct Round(pub Vec<u8>);

impl Round {
    /// The round as the filter is told of it: its documents and their values' bytes.
    pub fn batch(self: &Arc<Round>, connection: &str) -> FilterBatch {
        let (mut docs, mut value_bytes) = (0, 0);
        for f in frames(&self.0) {
            if let Some(k) = key_range(f) {
                docs += 1;
                value_bytes += (f.len() - k.end) as u64;
            }
        }
        FilterBatch {
            connection: connection.to_string(),
            docs,
            value_bytes,
            source: self.clone(),
        }
    }
}

impl FilterDocs for Round {
    fn read_keys(&self, into: &mut FilterKeys) {
        for f in frames(&self.0) {
            if let Some(k) = key_range(f) {
                into.push(&f[k], u16::from_be_bytes([f[6], f[7]]));
            }
        }
    }
}

/// What applying a decision changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub dropped: u64,
    pub stripped: u64,
    /// Bytes staged but not sent (the consumer will not acknowledge them).
    pub bytes_removed: usize,
}

/// Copies the staged frames to `out` as `decision` says.
pub fn apply(staged: &[u8], decision: &FilterDecision, out: &mut Vec<u8>) -> Applied {
    let mut r = Applied::default();
    let mut doc = 0;
    for f in frames(staged) {
        let Some(k) = key_range(f) else {
            out.extend_from_slice(f);
            continue;
        };
        let act = decision.action(doc, &f[k.clone()]);
        doc += 1;
        match act {
            action::DROP => {
                r.dropped += 1;
                r.bytes_removed += f.len();
            }
            action::STRIP_VALUE if f[1] == opcode::MUTATION && k.end < f.len() => {
                // The same frame up to the key's end: the body shrinks, the datatype is raw.
                let from = out.len();
                out.extend_from_slice(&f[..k.end]);
                let body = (k.end - mcbp::HEADER_LEN) as u32;
                out[from + 5] = 0;
                out[from + 8..from + 12].copy_from_slice(&body.to_be_bytes());
                r.stripped += 1;
                r.bytes_removed += f.len() - k.end;
            }
            _ => out.extend_from_slice(f),
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PrefixRule;
    use sluice_proto::dcp::{DcpRequest, DocumentRef, SnapshotMarker};

    fn doc(out: &mut Vec<u8>, key: &[u8], value: &[u8], seqno: u64) {
        DocumentRef {
            opcode: opcode::MUTATION,
            vbucket: 3,
            key,
            value,
            by_seqno: seqno,
            rev_seqno: 1,
            cas: 9,
            datatype: 1,
            flags: 0,
            expiration: 0,
            delete_time: 0,
        }
        .encode(out, 7, false)
        .unwrap();
    }

    #[test]
    fn drops_and_strips_documents_and_keeps_the_rest() {
        let mut staged = Vec::new();
        SnapshotMarker {
            vbucket: 3,
            start_seqno: 1,
            end_seqno: 3,
            flags: 1,
        }
        .encode(&mut staged, 7)
        .unwrap();
        let marker_len = staged.len();
        doc(&mut staged, b"user:1", b"{\"a\":1}", 1);
        doc(&mut staged, b"tmp:1", b"xxxx", 2);
        doc(&mut staged, b"big:1", b"yyyyyyyy", 3);
        let round = Arc::new(Round(staged.clone()));
        let b = round.batch("c");
        assert_eq!((b.docs, b.value_bytes), (3, 7 + 4 + 8));
        let k = b.keys();
        assert_eq!(k.keys, b"user:1tmp:1big:1");
        assert_eq!(k.ends, vec![6, 11, 16]);
        assert_eq!(k.vbuckets, vec![3, 3, 3]);
        let d = FilterDecision::Prefixes(PrefixRule::new(
            vec![b"tmp:".to_vec()],
            vec![b"big:".to_vec()],
        ));
        let mut out = Vec::new();
        let r = apply(&staged, &d, &mut out);
        assert_eq!((r.dropped, r.stripped), (1, 1));
        assert_eq!(r.bytes_removed, staged.len() - out.len());
        assert_eq!(out[..marker_len], staged[..marker_len]);
        let kept: Vec<&[u8]> = frames(&out).collect();
        assert_eq!(kept.len(), 3);
        let stripped = mcbp::parse_request(kept[2]).unwrap();
        assert_eq!(
            (stripped.key, stripped.value, stripped.datatype),
            (&b"big:1"[..], &b""[..], 0)
        );
        assert_eq!(mcbp::parse_request(kept[1]).unwrap().value, b"{\"a\":1}");
    }
}
