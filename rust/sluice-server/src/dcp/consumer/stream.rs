//! The consumer's streams: one per vbucket, requested from its saved position, answered with
//! a failover log, a rollback or a refusal.

use sluice_proto::dcp::{
    self, stream_flag, DcpResponse, FailoverLogEntry, StreamRequest, StreamRequestResponse,
};
use sluice_proto::mcbp::{self, opcode as op, status};

use super::frames::encoded;
use super::session::{ConsumerSession, VbStream};
use super::{ConsumerError, Event, Position, RollbackMode, POLL};

fn opaque_of(vb: u16) -> u32 {
    0x5000_0000 | vb as u32
}

impl ConsumerSession {
    /// Follows `vb` from `pos` (its position before the request that follows).
    pub(super) fn track(&mut self, vb: u16, pos: Position) {
        let end = self.config.end_seqnos.get(&vb).copied().unwrap_or(u64::MAX);
        self.streams.insert(
            vb,
            VbStream {
                pos,
                ended: false,
                end,
            },
        );
    }

    /// Requests every stream of the configuration and switches to the streaming read timeout.
    pub(super) fn open_streams(mut self) -> Result<ConsumerSession, ConsumerError> {
        let config = self.config.clone();
        let s = &mut self;
        let vbuckets = match &config.vbuckets {
            Some(v) => v.clone(),
            None => {
                let r = s.call(op::GET_ALL_VB_SEQNOS, &[], &[], &[], "GET_ALL_VB_SEQNOS")?;
                r.chunks_exact(10)
                    .map(|c| u16::from_be_bytes([c[0], c[1]]))
                    .collect()
            }
        };
        for vb in vbuckets {
            let pos = config.state.vbuckets.get(&vb).cloned().unwrap_or_default();
            s.track(vb, pos);
            s.request(vb)?;
        }
        s.sock
            .set_read_timeout(Some(POLL))
            .map_err(ConsumerError::Socket)?;
        Ok(self)
    }

    /// Requests the stream of `vb` from where its position says.
    pub(super) fn request(&mut self, vb: u16) -> Result<(), ConsumerError> {
        let s = self.streams.get_mut(&vb).expect("known vbucket");
        // A stream the producer ended may be asked for again (`Consumer::resume`).
        s.ended = false;
        let (start, uuid, snap_start, snap_end) = s.pos.resume();
        let mut flags = 0;
        let end = self.config.end_seqnos.get(&vb).copied();
        if self.config.to_latest && end.is_none() {
            flags |= stream_flag::TO_LATEST;
        }
        if self.config.takeover {
            flags |= stream_flag::TAKEOVER;
        }
        if self.config.active_only {
            flags |= stream_flag::ACTIVE_VB_ONLY;
        }
        if self.config.from_now && uuid == 0 && start == 0 {
            flags |= stream_flag::FROM_LATEST;
        }
        let req = StreamRequest {
            vbucket: vb,
            flags,
            start_seqno: start,
            end_seqno: end.unwrap_or(u64::MAX),
            vbucket_uuid: uuid,
            snap_start_seqno: snap_start,
            snap_end_seqno: snap_end,
            value: vec![],
        };
        let out = encoded(&req, opaque_of(vb))?;
        self.send(&out).map_err(|e| ConsumerError::StreamRequest {
            vbucket: vb,
            source: Box::new(e),
        })
    }

    /// Takes the producer's answer to a stream request (the opaque names the vbucket).
    pub(super) fn stream_answer(&mut self, r: &mcbp::Response<'_>) -> Result<(), ConsumerError> {
        let vb = (r.opaque & 0xffff) as u16;
        if !self.streams.contains_key(&vb) {
            return Ok(());
        }
        match StreamRequestResponse::decode(r) {
            Ok(StreamRequestResponse::Ok(log)) => {
                let s = self.streams.get_mut(&vb).expect("checked");
                s.pos.failover = log
                    .iter()
                    .map(|e: &FailoverLogEntry| (e.vbucket_uuid, e.seqno))
                    .collect();
                self.touched.insert(vb);
                Ok(())
            }
            Ok(StreamRequestResponse::Rollback(seqno)) => {
                let s = self.streams.get_mut(&vb).expect("checked");
                s.pos = s.pos.rolled_back(seqno);
                let position = s.pos.clone();
                log::info!("DCP vbucket {vb}: the producer asks for a rollback to {seqno}");
                match self.config.rollback {
                    RollbackMode::Resume => {
                        self.batch.rollbacks.push((vb, seqno));
                        self.touched.insert(vb);
                        self.request(vb)
                    }
                    RollbackMode::Ask => {
                        // The reader sees everything before the rollback first.
                        self.untouch(vb);
                        if !self.flush() {
                            return Ok(());
                        }
                        self.events.send(Event::Rollback {
                            vbucket: vb,
                            seqno,
                            position,
                        });
                        Ok(())
                    }
                }
            }
            Err(dcp::DcpError::Status(status::NOT_MY_VBUCKET))
                if self.config.end_refused_streams =>
            {
                log::info!(
                    "DCP consumer '{}': the producer does not serve vbucket {vb} \
                     (NOT_MY_VBUCKET: {}); its stream is over",
                    self.config.name,
                    String::from_utf8_lossy(r.value)
                );
                self.streams.get_mut(&vb).expect("checked").ended = true;
                self.untouch(vb);
                self.batch.refused.push(vb);
                Ok(())
            }
            Err(dcp::DcpError::Status(st)) => Err(ConsumerError::StreamRefused {
                vbucket: vb,
                status: st,
                message: String::from_utf8_lossy(r.value).into_owned(),
            }),
            Err(source) => Err(ConsumerError::BadStreamAnswer {
                vbucket: vb,
                source,
            }),
        }
    }
}
