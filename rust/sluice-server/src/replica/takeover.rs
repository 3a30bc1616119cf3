//! Moving one vbucket to this node with a takeover stream.

use super::*;

/// What a vbucket move reports.
#[derive(Debug, Clone)]
pub struct TakeoverReport {
    pub vbucket: u16,
    pub items: u64,
    pub seconds: f64,
    /// From the source's SET_VBUCKET_STATE pending to this node's vbucket going active: the
    /// time writes to the vbucket were refused (temporary failure) on both nodes.
    pub writes_paused_ms: f64,
    pub high_seqno: u64,
}

/// Moves vbucket `vb` of `bucket` from the node at `source` to this one with a takeover
/// stream: this node's copy (dead, replica, or active and never written) catches up as a
/// replica, goes pending when the source does, and active when the source hands over; the
/// source then goes dead.
pub fn take_over(
    engine: &Arc<Engine>,
    bucket: &Arc<Bucket>,
    vb: u16,
    source: &ReplicaConfig,
    timeout: Duration,
    clustermap: &ClusterMap,
) -> Result<TakeoverReport, ReplicationError> {
    let pos = engine
        .stream_position(bucket, vb)
        .ok_or_else(|| ReplicationError::NoVbucket {
            vbucket: vb,
            bucket: bucket.name().to_string(),
        })?;
    if pos.state == VbState::Active && pos.high_seqno > 0 {
        return Err(ReplicationError::ActiveWithData {
            vbucket: vb,
            high_seqno: pos.high_seqno,
        });
    }
    clustermap.arriving(bucket.name(), vb);
    let result = match pos.state {
        VbState::Active | VbState::Dead => engine
            .set_vbucket_state(bucket, vb, VbState::Replica)
            .map_err(ReplicationError::from),
        VbState::Replica | VbState::Pending => Ok(()),
    }
    .and_then(|()| take_over_stream(engine, bucket, vb, source, timeout, clustermap));
    if result.is_err() {
        clustermap.not_arriving(bucket.name(), vb);
        clustermap.refresh(engine);
    }
    result
}

/// The takeover stream of `take_over`, once this node's copy is a replica.
pub(super) fn take_over_stream(
    engine: &Arc<Engine>,
    bucket: &Arc<Bucket>,
    vb: u16,
    source: &ReplicaConfig,
    timeout: Duration,
    clustermap: &ClusterMap,
) -> Result<TakeoverReport, ReplicationError> {
    let (_, state) = own_state(engine, bucket, Some(&[vb]));
    let started = Instant::now();
    let consumer = Consumer::start(ConsumerConfig {
        address: source.active.clone(),
        bucket: bucket.name().to_string(),
        username: source.username.clone(),
        password: source.password.clone(),
        name: format!("takeover:{}:{}:{vb}", engine.instance(), bucket.name()),
        tls: source.tls.clone(),
        vbuckets: Some(vec![vb]),
        state,
        rollback: RollbackMode::Ask,
        batch_size: 4096,
        noop_interval: source.noop_interval,
        takeover: true,
        include_xattrs: true,
        kv_address: Some(clustermap.kv_address()),
        ..ConsumerConfig::default()
    });
    let mut session = ReplicaSession {
        engine: engine.clone(),
        bucket: bucket.clone(),
        link: consumer.link().clone(),
        stats: Arc::new(ReplicaStats::default()),
        snapshots: BTreeMap::new(),
        due: BTreeSet::new(),
        by_map: false,
        failed: None,
        last_lsn: 0,
        sync_asked: None,
        ended: false,
    };

    let mut paused_at = None;
    let mut active_after = None;
    let deadline = started + timeout;
    while Instant::now() < deadline {
        match consumer.next_event(Duration::from_millis(100)) {
            None => {}
            Some(Event::Batch(b)) => {
                session.apply(&b)?;
                if let Some((_, reason)) = b.ended.first() {
                    if active_after.is_some() {
                        break;
                    }
                    return Err(ReplicationError::TakeoverEnded(*reason));
                }
            }
            Some(Event::Rollback { vbucket, seqno, .. }) => {
                session.rollback(&consumer, None, vbucket, seqno)?
            }
            Some(Event::VbucketState {
                state: st, opaque, ..
            }) => {
                let (to, answer) = match st {
                    vbucket_state::PENDING => (VbState::Pending, status::SUCCESS),
                    vbucket_state::ACTIVE => (VbState::Active, status::SUCCESS),
                    _ => (VbState::Replica, status::EINVAL),
                };
                if answer == status::SUCCESS {
                    engine.set_vbucket_state(bucket, vb, to)?;
                    if to == VbState::Pending {
                        paused_at = Some(Instant::now());
                    } else {
                        active_after = Some(
                            paused_at.map_or(0.0, |p: Instant| p.elapsed().as_secs_f64() * 1000.0),
                        );
                    }
                }
                consumer
                    .link()
                    .respond(dcp::opcode::SET_VBUCKET_STATE, opaque, answer);
            }
            Some(Event::Finished) => break,
            Some(Event::Failed(e)) if active_after.is_none() => {
                return Err(ReplicationError::Connection(e))
            }
            Some(Event::Failed(_)) => break,
        }
    }
    let Some(writes_paused_ms) = active_after else {
        return Err(ReplicationError::NotHandedOver {
            vbucket: vb,
            timeout,
        });
    };
    let high_seqno = engine
        .stream_position(bucket, vb)
        .map_or(0, |p| p.high_seqno);
    clustermap.arrived(bucket.name(), vb);
    clustermap.refresh(engine);
    log::info!(
        "vbucket {vb} of bucket {:?} taken over from {}: {} changes in {:.2} s, writes paused {writes_paused_ms:.1} ms",
        bucket.name(),
        source.active,
        session.stats.items.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
    Ok(TakeoverReport {
        vbucket: vb,
        items: session.stats.items.load(Ordering::Relaxed),
        seconds: started.elapsed().as_secs_f64(),
        writes_paused_ms,
        high_seqno,
    })
}
