//! A batch of documents in columns, as the consumer hands them to its reader.

use sluice_proto::dcp::{opcode, DocumentRef};

use super::Position;

/// Documents in columns (Arrow's layout: offsets then bytes), and the state after them.
#[derive(Debug, Default)]
pub struct Batch {
    pub vbucket: Vec<u16>,
    pub seqno: Vec<u64>,
    /// 0 mutation, 1 deletion, 2 expiration.
    pub op: Vec<u8>,
    pub cas: Vec<u64>,
    pub rev_seqno: Vec<u64>,
    pub flags: Vec<u32>,
    pub expiry: Vec<u32>,
    pub datatype: Vec<u8>,
    pub key_offsets: Vec<i32>,
    pub keys: Vec<u8>,
    pub value_offsets: Vec<i64>,
    pub values: Vec<u8>,
    /// Positions after this batch of the vbuckets it touched.
    pub positions: Vec<(u16, Position)>,
    /// Streams that ended, with the STREAM_END reason.
    pub ended: Vec<(u16, u32)>,
    /// Stream requests refused with NOT_MY_VBUCKET (`ConsumerConfig::end_refused_streams`):
    /// those streams are over.
    pub refused: Vec<u16>,
    /// Rollbacks followed automatically (RollbackMode::Resume): vbucket and seqno.
    pub rollbacks: Vec<(u16, u64)>,
}

impl Batch {
    pub(super) fn new() -> Batch {
        Batch {
            key_offsets: vec![0],
            value_offsets: vec![0],
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.seqno.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqno.is_empty()
    }

    /// Bytes of keys and values held.
    pub fn data_bytes(&self) -> usize {
        self.keys.len() + self.values.len()
    }

    pub(super) fn push(&mut self, d: &DocumentRef<'_>) {
        self.vbucket.push(d.vbucket);
        self.seqno.push(d.by_seqno);
        self.op.push(match d.opcode {
            opcode::MUTATION => 0,
            opcode::DELETION => 1,
            _ => 2,
        });
        self.cas.push(d.cas);
        self.rev_seqno.push(d.rev_seqno);
        self.flags.push(d.flags);
        self.expiry.push(if d.opcode == opcode::MUTATION {
            d.expiration
        } else {
            d.delete_time
        });
        self.datatype.push(d.datatype);
        self.keys.extend_from_slice(d.key);
        self.key_offsets.push(self.keys.len() as i32);
        self.values.extend_from_slice(d.value);
        self.value_offsets.push(self.values.len() as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_go_into_columns() {
        let doc = |opcode, key: &'static [u8], value: &'static [u8], by_seqno| DocumentRef {
            opcode,
            vbucket: 5,
            key,
            value,
            by_seqno,
            rev_seqno: 1,
            cas: 9,
            datatype: 0,
            flags: 3,
            expiration: 100,
            delete_time: 200,
        };
        let mut b = Batch::new();
        assert!(b.is_empty());
        b.push(&doc(opcode::MUTATION, b"ab", b"xyz", 1));
        b.push(&doc(opcode::DELETION, b"c", b"", 2));
        b.push(&doc(opcode::EXPIRATION, b"de", b"", 3));
        assert_eq!(b.len(), 3);
        assert_eq!(b.op, [0, 1, 2]);
        assert_eq!(b.seqno, [1, 2, 3]);
        // A mutation's expiry is its TTL; a deletion's or expiration's, when it happened.
        assert_eq!(b.expiry, [100, 200, 200]);
        assert_eq!(
            (b.key_offsets.as_slice(), b.keys.as_slice()),
            (&[0, 2, 3, 5][..], &b"abcde"[..])
        );
        assert_eq!(b.value_offsets, [0, 3, 3, 3]);
        assert_eq!(b.values, b"xyz");
    }
}
