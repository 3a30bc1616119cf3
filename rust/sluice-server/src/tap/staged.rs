//! A TAP connection's vbucket streams write into `Staged`: their events, with keys and values
//! copied into one reused buffer, so that a StreamFilter can judge the whole round before
//! anything is encoded. `encode` then writes each event as its TAP message.

use std::collections::BTreeMap;
use std::ops::Range;

use sluice_core::item::{tap_hops, ChangeOp, ItemMeta, DATATYPE_CLIENT_BITS};
use sluice_proto::dcp::snapshot_flag;
use sluice_proto::tap::{message_flag, opaque_code, opcode, TapMessage};

use crate::policy::{action, FilterDecision, FilterDocs, FilterKeys};
use crate::stream::{StreamSink, StreamView};

/// Per-message overhead counted against a round's budget, beyond key and value.
const MESSAGE_COST: usize = 48;

pub enum Event {
    BackfillStart {
        vbucket: u16,
    },
    BackfillEnd {
        vbucket: u16,
    },
    Checkpoint {
        vbucket: u16,
        id: u64,
    },
    Doc {
        vbucket: u16,
        op: ChangeOp,
        meta: ItemMeta,
        key: Range<usize>,
        value: Range<usize>,
        backfill: bool,
    },
    VbucketState {
        vbucket: u16,
        state: u8,
    },
    /// A stream ended (its reason from `stream_end_reason`); nothing is sent for it.
    End {
        vbucket: u16,
        reason: u32,
    },
}

#[derive(Default)]
pub struct Staged {
    pub data: Vec<u8>,
    pub events: Vec<Event>,
    /// Documents among the events, and their values' bytes (what a StreamFilter is told).
    pub docs: usize,
    pub value_bytes: u64,
}

impl Staged {
    pub fn clear(&mut self) {
        self.data.clear();
        self.events.clear();
        self.docs = 0;
        self.value_bytes = 0;
    }

    /// Gives back memory beyond what a round of `bytes` needs (an idle connection).
    pub fn shrink_to(&mut self, bytes: usize) {
        self.data.shrink_to(bytes);
        self.events.shrink_to(bytes / MESSAGE_COST);
    }

    fn copy(&mut self, bytes: &[u8]) -> Range<usize> {
        let start = self.data.len();
        self.data.extend_from_slice(bytes);
        start..self.data.len()
    }
}

impl FilterDocs for Staged {
    fn read_keys(&self, into: &mut FilterKeys) {
        for e in &self.events {
            if let Event::Doc { vbucket, key, .. } = e {
                into.push(&self.data[key.clone()], *vbucket);
            }
        }
    }
}

impl StreamSink for Staged {
    fn marker(
        &mut self,
        s: &StreamView,
        _start: u64,
        _end: u64,
        flags: u32,
        checkpoint: Option<u64>,
    ) -> usize {
        let vbucket = s.vbucket;
        if flags & snapshot_flag::DISK != 0 {
            self.events.push(Event::BackfillStart { vbucket });
        } else if let (true, Some(id)) = (flags & snapshot_flag::CHECKPOINT != 0, checkpoint) {
            self.events.push(Event::Checkpoint { vbucket, id });
        } else {
            return 0;
        }
        MESSAGE_COST
    }

    fn document(
        &mut self,
        s: &StreamView,
        op: ChangeOp,
        key: &[u8],
        value: &[u8],
        meta: &ItemMeta,
        backfill: bool,
    ) -> usize {
        let key = self.copy(key);
        let value = if s.encoding.no_value || op != ChangeOp::Mutation {
            0..0
        } else {
            // TAP knows no extended attributes: a document goes as its body.
            self.copy(sluice_proto::xattr::body(value, meta.datatype))
        };
        let cost = MESSAGE_COST + key.len() + value.len();
        self.docs += 1;
        self.value_bytes += value.len() as u64;
        self.events.push(Event::Doc {
            vbucket: s.vbucket,
            op,
            meta: *meta,
            key,
            value,
            backfill,
        });
        cost
    }

    fn backfill_end(&mut self, s: &StreamView) -> usize {
        self.events.push(Event::BackfillEnd { vbucket: s.vbucket });
        MESSAGE_COST
    }

    fn end(&mut self, s: &StreamView, reason: u32) -> usize {
        self.events.push(Event::End {
            vbucket: s.vbucket,
            reason,
        });
        0
    }

    fn vbucket_state(&mut self, s: &StreamView, state: u8) -> usize {
        self.events.push(Event::VbucketState {
            vbucket: s.vbucket,
            state,
        });
        MESSAGE_COST
    }
}

/// How a connection's TAP messages are written.
#[derive(Debug, Clone, Copy)]
pub struct TapEncoding {
    pub keys_only: bool,
    pub checkpoints: bool,
    /// Backfilled items with a CAS (nanoseconds) below this are left out (BACKFILL's time).
    pub backfill_cutoff_ns: u64,
    /// Hops an item written on this node is sent with.
    pub ttl: u8,
}

/// What encoding one event gave.
pub enum Encoded {
    /// A message was appended (flags may still be patched in by the caller).
    Message,
    /// Left out: filtered, before the backfill's time, or out of hops.
    Skipped(Skip),
    Nothing,
}

pub enum Skip {
    Filtered,
    BeforeBackfillTime,
    OutOfHops,
}

/// Encodes one event (document `doc_index` among the round's documents) into `out`; one
/// event may give two messages (a checkpoint's start ends the one before). `open_checkpoints`
/// holds each vbucket's checkpoint the client saw start.
pub fn encode(
    staged: &Staged,
    event: &Event,
    doc_index: usize,
    decision: Option<&FilterDecision>,
    enc: &TapEncoding,
    open_checkpoints: &mut BTreeMap<u16, u64>,
    out: &mut Vec<u8>,
) -> Encoded {
    let code_bytes;
    let mut m = TapMessage::default();
    match event {
        Event::BackfillStart { vbucket } | Event::BackfillEnd { vbucket } => {
            let code = if matches!(event, Event::BackfillStart { .. }) {
                opaque_code::INITIAL_VBUCKET_STREAM
            } else {
                opaque_code::CLOSE_BACKFILL
            };
            code_bytes = code.to_be_bytes();
            m.opcode = opcode::OPAQUE;
            m.vbucket = *vbucket;
            m.engine_specific = &code_bytes;
            m.ttl = enc.ttl;
        }
        Event::Checkpoint { vbucket, id } => {
            if !enc.checkpoints {
                return Encoded::Nothing;
            }
            if let Some(prev) = open_checkpoints.insert(*vbucket, *id) {
                let prev = prev.to_be_bytes();
                TapMessage {
                    opcode: opcode::CHECKPOINT_END,
                    vbucket: *vbucket,
                    ttl: enc.ttl,
                    value: &prev,
                    ..Default::default()
                }
                .encode(out);
            }
            let idb = id.to_be_bytes();
            TapMessage {
                opcode: opcode::CHECKPOINT_START,
                vbucket: *vbucket,
                ttl: enc.ttl,
                value: &idb,
                ..Default::default()
            }
            .encode(out);
            return Encoded::Message;
        }
        Event::VbucketState { vbucket, state } => {
            code_bytes = (*state as u32).to_be_bytes();
            TapMessage {
                opcode: opcode::VBUCKET_SET,
                vbucket: *vbucket,
                ttl: enc.ttl,
                tap_flags: message_flag::ACK,
                engine_specific: &code_bytes,
                ..Default::default()
            }
            .encode(out);
            return Encoded::Message;
        }
        Event::End { .. } => return Encoded::Nothing,
        Event::Doc {
            vbucket,
            op,
            meta,
            key,
            value,
            backfill,
        } => {
            if *backfill && meta.cas < enc.backfill_cutoff_ns {
                return Encoded::Skipped(Skip::BeforeBackfillTime);
            }
            let hops = tap_hops(meta.datatype);
            let ttl = if hops == 0 { enc.ttl } else { hops - 1 };
            if hops != 0 && ttl == 0 {
                return Encoded::Skipped(Skip::OutOfHops);
            }
            let key = &staged.data[key.clone()];
            let act = decision.map_or(action::KEEP, |d| d.action(doc_index, key));
            if act == action::DROP {
                return Encoded::Skipped(Skip::Filtered);
            }
            m.vbucket = *vbucket;
            m.key = key;
            m.cas = meta.cas;
            m.ttl = ttl;
            m.datatype =
                meta.datatype & DATATYPE_CLIENT_BITS & !sluice_proto::xattr::DATATYPE_XATTR;
            if *op == ChangeOp::Mutation {
                m.opcode = opcode::MUTATION;
                m.item_flags = meta.flags;
                m.expiry = meta.expiry;
                if enc.keys_only || act == action::STRIP_VALUE {
                    m.tap_flags = message_flag::NO_VALUE;
                    m.datatype = 0;
                } else {
                    m.value = &staged.data[value.clone()];
                }
            } else {
                m.opcode = opcode::DELETE;
            }
        }
    }
    m.encode(out);
    Encoded::Message
}
