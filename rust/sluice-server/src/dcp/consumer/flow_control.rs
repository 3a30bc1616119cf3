//! DCP flow control on the consumer's side: count what the producer sent, acknowledge it in
//! steps (BUFFER_ACKNOWLEDGEMENT), and let an AckPolicy plugin resize the buffer and the step.

use std::time::Instant;

use crate::policy::Pending;

/// The smallest buffer an AckPolicy may set: room for a few ordinary frames.
const MIN_BUFFER_SIZE: u32 = 64 << 10;

/// The consumer's side of DCP flow control: the buffer the producer may fill, and how many
/// received bytes are acknowledged at once (a fifth of the buffer unless an AckPolicy says).
pub(super) struct FlowControl {
    /// 0: no flow control (nothing is acknowledged).
    pub(super) buffer_size: u32,
    pub(super) ack_bytes: usize,
    /// Received (headers included) and not acknowledged yet.
    pub(super) unacked: usize,
    pub(super) received_total: u64,
    pub(super) acked_total: u64,
    pub(super) last_ack: Instant,
    /// The AckPolicy's answer to the last acknowledgement, not in yet.
    pub(super) advice: Option<Pending>,
}

impl FlowControl {
    pub(super) fn new(buffer_size: u32) -> FlowControl {
        FlowControl {
            buffer_size,
            ack_bytes: (buffer_size as usize / 5).max(1),
            unacked: 0,
            received_total: 0,
            acked_total: 0,
            last_ack: Instant::now(),
            advice: None,
        }
    }

    /// A frame of `len` bytes that counts against the buffer came in (all but NOOPs and
    /// answers).
    pub(super) fn received(&mut self, len: usize) {
        self.unacked += len;
        self.received_total += len as u64;
    }

    /// How many bytes to acknowledge now, if any: once a step's worth has come in, or whatever
    /// has when `force`d (the socket went quiet: the producer may be waiting for room).
    pub(super) fn due(&self, force: bool) -> Option<u32> {
        let ready = force || self.unacked >= self.ack_bytes;
        (self.buffer_size > 0 && self.unacked > 0 && ready)
            .then(|| self.unacked.min(u32::MAX as usize) as u32)
    }

    pub(super) fn acknowledged(&mut self, bytes: u32) {
        self.unacked -= bytes as usize;
        self.acked_total += bytes as u64;
    }

    /// Takes an AckPolicy's answer: the step, at most the buffer, and the buffer, at least
    /// `MIN_BUFFER_SIZE`. Some(size): the buffer changed and the producer must be told.
    pub(super) fn advised(&mut self, interval: u32, window: u32) -> Option<u32> {
        let window = window.max(MIN_BUFFER_SIZE);
        self.ack_bytes = (interval as usize).clamp(1, window as usize);
        if window != self.buffer_size && self.buffer_size > 0 {
            self.buffer_size = window;
            Some(window)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::frames::encoded;
    use super::*;
    use sluice_proto::dcp;

    #[test]
    fn acknowledges_a_fifth_of_the_buffer_at_a_time() {
        let mut f = FlowControl::new(1000);
        assert_eq!(
            f.due(true),
            None,
            "nothing received, nothing to acknowledge"
        );
        f.received(150);
        assert_eq!(f.due(false), None, "below the step of 200 bytes");
        assert_eq!(
            f.due(true),
            Some(150),
            "a quiet socket acknowledges what came"
        );
        f.received(60);
        assert_eq!(f.due(false), Some(210));
        f.acknowledged(210);
        assert_eq!(f.due(true), None);
        f.received(199);
        assert_eq!(f.due(false), None);
        f.received(1);
        assert_eq!(f.due(false), Some(200));
        f.acknowledged(200);
        assert_eq!((f.received_total, f.acked_total, f.unacked), (410, 410, 0));
    }

    #[test]
    fn no_buffer_no_acknowledgements() {
        let mut f = FlowControl::new(0);
        f.received(1 << 20);
        assert_eq!(f.due(true), None);
        // A buffer smaller than five bytes still acknowledges in steps of at least one.
        let mut f = FlowControl::new(4);
        f.received(1);
        assert_eq!(f.due(false), Some(1));
    }

    #[test]
    fn ack_policy_resizes_within_bounds() {
        let mut f = FlowControl::new(16 << 20);
        // A step larger than the buffer is the buffer; the producer hears of the new size.
        assert_eq!(f.advised(u32::MAX, 128 << 10), Some(128 << 10));
        assert_eq!((f.buffer_size, f.ack_bytes), (128 << 10, 128 << 10));
        // Too small a buffer is raised to the minimum; a step of 0 is 1.
        assert_eq!(f.advised(0, 1), Some(MIN_BUFFER_SIZE));
        assert_eq!((f.buffer_size, f.ack_bytes), (MIN_BUFFER_SIZE, 1));
        // The same size again changes the step only.
        assert_eq!(f.advised(500, MIN_BUFFER_SIZE), None);
        assert_eq!(f.ack_bytes, 500);
        f.received(499);
        assert_eq!(f.due(false), None);
        f.received(1);
        assert_eq!(f.due(false), Some(500));
        // Without flow control the buffer stays off whatever the policy says.
        let mut off = FlowControl::new(0);
        assert_eq!(off.advised(100, 1 << 20), None);
        assert_eq!(off.buffer_size, 0);
    }

    #[test]
    fn acknowledgement_frame() {
        // BUFFER_ACKNOWLEDGEMENT as the consumer has always sent it: a request header with
        // opaque and vbucket 0, the byte count as 4 bytes of extras.
        let frame = encoded(&dcp::BufferAcknowledgement { bytes: 0x0102_03d2 }, 0).unwrap();
        let mut want = vec![0x80, 0x5d, 0, 0, 4, 0, 0, 0, 0, 0, 0, 4];
        want.extend_from_slice(&[0; 12]); // opaque, cas
        want.extend_from_slice(&[0x01, 0x02, 0x03, 0xd2]);
        assert_eq!(frame, want);
    }
}
