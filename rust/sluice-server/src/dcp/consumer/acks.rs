//! The session's side of DCP flow control: BUFFER_ACKNOWLEDGEMENT sent when one is due, and an
//! AckPolicy plugin asked about the step and the buffer between acknowledgements.

use std::time::Instant;

use sluice_proto::dcp;

use super::frames::encoded;
use super::session::ConsumerSession;
use super::ConsumerError;
use crate::policy::{AckStats, Answer, PolicyKind, Question};

impl ConsumerSession {
    /// Sends BUFFER_ACKNOWLEDGEMENT when one is due (`FlowControl::due`), after taking in the
    /// AckPolicy's answer to the previous one.
    pub(super) fn acknowledge(&mut self, force: bool) -> Result<(), ConsumerError> {
        self.take_advice()?;
        if let Some(bytes) = self.flow.due(force) {
            self.send(&encoded(&dcp::BufferAcknowledgement { bytes }, 0)?)?;
            self.flow.acknowledged(bytes);
            self.ask_advice();
        }
        Ok(())
    }

    /// Puts the acknowledgement to the AckPolicy plugin, if one is installed and no question
    /// is out already; the answer is taken on a later round (`take_advice`).
    fn ask_advice(&mut self) {
        let Some(host) = &self.config.flow_control else {
            return;
        };
        if self.flow.advice.is_some() || !host.installed(PolicyKind::Ack) {
            return;
        }
        let f = &mut self.flow;
        let stats = AckStats {
            protocol: "dcp",
            connection: self.config.name.clone(),
            rtt: std::mem::replace(&mut f.last_ack, Instant::now())
                .elapsed()
                .as_secs_f64(),
            unacked: f.unacked as u64,
            acked_total: f.acked_total,
            sent_total: f.received_total,
            interval: f.ack_bytes.min(u32::MAX as usize) as u32,
            window: f.buffer_size,
        };
        f.advice = Some(host.pose(PolicyKind::Ack, Question::Ack(stats)));
    }

    /// Applies the AckPolicy's answer once it is in: a new buffer size goes to the producer
    /// as the control `connection_buffer_size`.
    fn take_advice(&mut self) -> Result<(), ConsumerError> {
        let (Some(host), Some(p)) = (&self.config.flow_control, &self.flow.advice) else {
            return Ok(());
        };
        let Some(answer) = p.try_answer(host) else {
            return Ok(());
        };
        self.flow.advice = None;
        let Answer::Ack { interval, window } = answer else {
            return Ok(());
        };
        if let Some(window) = self.flow.advised(interval, window) {
            log::info!(
                "DCP consumer '{}': the AckPolicy sets the buffer to {window} bytes, \
                 acknowledged every {} bytes",
                self.config.name,
                self.flow.ack_bytes
            );
            let control = dcp::Control {
                key: b"connection_buffer_size".to_vec(),
                value: window.to_string().into_bytes(),
            };
            self.send(&encoded(&control, 0)?)?;
        }
        Ok(())
    }
}
