//! Where each vbucket's stream stands (`Position`), and the session state a reader saves and
//! resumes from (`SessionState`: `sluice tail --state`, `Stream.state()` / `save_state`).
//!
//! The saved form is JSON, version 1, one object per vbucket keyed by its number as a string:
//!
//! ```json
//! {"vbuckets":{"3":{"failover_log":[[18446744073709551615,4],[1,0]],"seqno":9,"snapshot":[5,12]}},"version":1}
//! ```
//!
//! `failover_log` is newest first, each entry `[vbucket uuid, seqno]`; `snapshot` is the
//! `[start, end]` of the snapshot `seqno` belongs to. Whether that snapshot is a backfill is
//! not saved (a resumed stream learns it again from the next marker). Keys come out sorted as
//! strings (`"10"` before `"3"`), as the hand-written encoder of earlier releases wrote them,
//! so files stay byte for byte the same; unknown fields are ignored when reading.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where one vbucket's stream stands: the failover log it follows (newest first), the last
/// seqno seen and the snapshot that seqno belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Position {
    pub failover: Vec<(u64, u64)>,
    pub seqno: u64,
    pub snap_start: u64,
    pub snap_end: u64,
    /// Whether the current snapshot is a disk (backfill) snapshot.
    pub disk: bool,
}

impl Position {
    /// The stream request that resumes here: a snapshot fully seen (or not begun) is a
    /// boundary, so only a partly seen one is sent as a range. The uuid is that of the newest
    /// failover entry the history up to `seqno` belongs to: an entry made at `seqno` itself
    /// (a node's own, after an unclean restart or a promotion with nothing written since) has
    /// none of it, and the producer, which never saw that entry, would find no common history
    /// and roll the stream back to 0; under the entry before it, the producer's rollback rule
    /// finds the point they share. At seqno 0 it asks with no history.
    pub(super) fn resume(&self) -> (u64, u64, u64, u64) {
        let s = self.seqno;
        let uuid = match self.failover.iter().find(|e| e.1 < s) {
            Some(e) => e.0,
            // Nothing yet: no history to share (a producer streams it from the start).
            None if s == 0 => 0,
            None => self.failover.first().map_or(0, |e| e.0),
        };
        if s < self.snap_start || s >= self.snap_end {
            (s, uuid, s, s)
        } else {
            (s, uuid, self.snap_start, self.snap_end)
        }
    }

    /// Rolls back to `seqno`: failover entries past it are dropped (doc: building a simple
    /// client); a rollback to 0 forgets the history, so the next request is "no history".
    pub(super) fn rolled_back(&self, seqno: u64) -> Position {
        if seqno == 0 {
            return Position::default();
        }
        Position {
            failover: self
                .failover
                .iter()
                .copied()
                .filter(|e| e.1 <= seqno)
                .collect(),
            seqno,
            snap_start: seqno,
            snap_end: seqno,
            disk: false,
        }
    }
}

/// Per-vbucket positions: what `sluice tail --state` and `Stream.state()` save and restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionState {
    pub vbuckets: BTreeMap<u16, Position>,
}

/// The one version of the saved form so far.
const VERSION: u64 = 1;

/// The saved form (see the module's doc). Fields in the order they are written: the file is
/// what the earlier encoder, which sorted keys, wrote.
#[derive(Serialize, Deserialize)]
struct SavedState {
    vbuckets: BTreeMap<String, SavedPosition>,
    version: u64,
}

#[derive(Serialize, Deserialize)]
struct SavedPosition {
    failover_log: Vec<(u64, u64)>,
    seqno: u64,
    snapshot: (u64, u64),
}

/// Why a saved session state cannot be used; the texts are what `sluice tail --state` and
/// `Client.stream(state=...)` report.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionStateError {
    #[error("session state: expected \"version\": 1")]
    Version,
    #[error("session state: \"vbuckets\" must be an object")]
    VbucketsNotObject,
    #[error("session state: vbucket key '{0}' is not a number")]
    VbucketKey(String),
    #[error("session state: vbucket {vbucket}: failover_log must be a list")]
    FailoverLogNotList { vbucket: u16 },
    #[error("session state: vbucket {vbucket}: failover entries are [uuid, seqno]")]
    FailoverEntry { vbucket: u16 },
    #[error("session state: vbucket {vbucket}: snapshot must be [start, end]")]
    Snapshot { vbucket: u16 },
    /// `field`: "uuid", "seqno", "snapshot start" or "snapshot end".
    #[error("session state: vbucket {vbucket}: {field} must be an unsigned integer")]
    NotUnsigned { vbucket: u16, field: &'static str },
    /// Refused by the reader but by none of the checks above (kept as the reader said it).
    #[error("session state: {0}")]
    Malformed(String),
}

impl SessionState {
    pub fn to_json(&self) -> Value {
        let saved = SavedState {
            vbuckets: self
                .vbuckets
                .iter()
                .map(|(vb, p)| {
                    let saved = SavedPosition {
                        failover_log: p.failover.clone(),
                        seqno: p.seqno,
                        snapshot: (p.snap_start, p.snap_end),
                    };
                    (vb.to_string(), saved)
                })
                .collect(),
            version: VERSION,
        };
        serde_json::to_value(saved).expect("integers, strings, lists and maps are JSON")
    }

    pub fn from_json(v: &Value) -> Result<SessionState, SessionStateError> {
        let saved = match SavedState::deserialize(v) {
            Ok(saved) if saved.version == VERSION => saved,
            Ok(_) => return Err(SessionStateError::Version),
            Err(e) => {
                return Err(why_unreadable(v)
                    .unwrap_or_else(|| SessionStateError::Malformed(e.to_string())))
            }
        };
        let mut state = SessionState::default();
        for (key, p) in saved.vbuckets {
            let vb: u16 = key
                .parse()
                .map_err(|_| SessionStateError::VbucketKey(key))?;
            let pos = Position {
                failover: p.failover_log,
                seqno: p.seqno,
                snap_start: p.snapshot.0,
                snap_end: p.snapshot.1,
                disk: false,
            };
            state.vbuckets.insert(vb, pos);
        }
        Ok(state)
    }
}

/// Names what makes `v` no saved state, in the order earlier releases checked (the version
/// first, then each vbucket's key, failover log, snapshot and seqno): the reader's own errors
/// say what type it expected but not which vbucket or field.
fn why_unreadable(v: &Value) -> Option<SessionStateError> {
    use SessionStateError as E;
    if v.get("version").and_then(Value::as_u64) != Some(VERSION) {
        return Some(E::Version);
    }
    let Some(vbs) = v.get("vbuckets").and_then(Value::as_object) else {
        return Some(E::VbucketsNotObject);
    };
    for (k, p) in vbs {
        let Ok(vbucket) = k.parse::<u16>() else {
            return Some(E::VbucketKey(k.clone()));
        };
        let unsigned = |x: Option<&Value>, field| match x.and_then(Value::as_u64) {
            Some(_) => None,
            None => Some(E::NotUnsigned { vbucket, field }),
        };
        let pair = |x: &Value| x.as_array().filter(|a| a.len() == 2).cloned();
        let Some(log) = p.get("failover_log").and_then(Value::as_array) else {
            return Some(E::FailoverLogNotList { vbucket });
        };
        for entry in log {
            let Some(entry) = pair(entry) else {
                return Some(E::FailoverEntry { vbucket });
            };
            let bad = unsigned(entry.first(), "uuid").or_else(|| unsigned(entry.get(1), "seqno"));
            if bad.is_some() {
                return bad;
            }
        }
        let Some(snapshot) = p.get("snapshot").and_then(pair) else {
            return Some(E::Snapshot { vbucket });
        };
        let bad = unsigned(p.get("seqno"), "seqno")
            .or_else(|| unsigned(snapshot.first(), "snapshot start"))
            .or_else(|| unsigned(snapshot.get(1), "snapshot end"));
        if bad.is_some() {
            return bad;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn resume_points() {
        let mut p = Position {
            failover: vec![(7, 0)],
            seqno: 10,
            snap_start: 5,
            snap_end: 20,
            disk: false,
        };
        assert_eq!(p.resume(), (10, 7, 5, 20));
        p.seqno = 20;
        assert_eq!(p.resume(), (20, 7, 20, 20));
        // A marker received but none of its items: the previous snapshot was complete.
        p.seqno = 4;
        assert_eq!(p.resume(), (4, 7, 4, 4));
        assert_eq!(Position::default().resume(), (0, 0, 0, 0));
    }

    #[test]
    fn a_node_back_after_a_failover_resumes_from_the_point_it_shares_not_from_zero() {
        use sluice_core::failover::{rollback_point, FailoverEntry, ResumePoint};
        let entry = |uuid, seqno| FailoverEntry { uuid, seqno };
        // Its replica, promoted at 100 when the node was killed, has written 20 more.
        let producer = [entry(3, 100), entry(1, 0)];
        // The node wrote up to 150 before it was killed, and its restart added an entry at 150.
        let back = Position {
            failover: vec![(9, 150), (1, 0)],
            seqno: 150,
            snap_start: 150,
            snap_end: 150,
            disk: false,
        };
        let (start, uuid, snap_start, snap_end) = back.resume();
        assert_eq!(uuid, 1, "the entry its history belongs to");
        let at = ResumePoint {
            start_seqno: start,
            vbucket_uuid: uuid,
            snap_start_seqno: snap_start,
            snap_end_seqno: snap_end,
        };
        assert_eq!(rollback_point(&producer, 120, 0, at, false), Some(100));
        // Had it asked under its restart's entry, nothing would be shared.
        let own = ResumePoint {
            vbucket_uuid: 9,
            ..at
        };
        assert_eq!(rollback_point(&producer, 120, 0, own, false), Some(0));
    }

    #[test]
    fn rollback_drops_later_failover_entries() {
        let p = Position {
            failover: vec![(3, 900), (2, 500), (1, 0)],
            seqno: 1000,
            snap_start: 950,
            snap_end: 1000,
            disk: false,
        };
        let r = p.rolled_back(600);
        assert_eq!(r.failover, vec![(2, 500), (1, 0)]);
        assert_eq!(r.resume(), (600, 2, 600, 600));
        assert_eq!(p.rolled_back(0), Position::default());
    }

    fn two_vbuckets() -> SessionState {
        let mut s = SessionState::default();
        s.vbuckets.insert(
            3,
            Position {
                failover: vec![(u64::MAX, 4), (1, 0)],
                seqno: 9,
                snap_start: 5,
                snap_end: 12,
                disk: false,
            },
        );
        s.vbuckets.insert(10, Position::default());
        s
    }

    /// What the hand-written encoder of earlier releases wrote for `two_vbuckets()`: the state
    /// files users have on disk.
    const EARLIER_FILE: &str = concat!(
        r#"{"vbuckets":{"10":{"failover_log":[],"seqno":0,"snapshot":[0,0]},"#,
        r#""3":{"failover_log":[[18446744073709551615,4],[1,0]],"seqno":9,"snapshot":[5,12]}},"#,
        r#""version":1}"#
    );

    #[test]
    fn state_round_trips_through_json() {
        let s = two_vbuckets();
        let back = SessionState::from_json(&s.to_json()).unwrap();
        assert_eq!(back, s);
        // The text, too, as Python writes it to the file and reads it back.
        let text = s.to_json().to_string();
        let back = SessionState::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn writes_what_earlier_releases_wrote() {
        assert_eq!(two_vbuckets().to_json().to_string(), EARLIER_FILE);
    }

    #[test]
    fn reads_files_of_earlier_releases() {
        let v: Value = serde_json::from_str(EARLIER_FILE).unwrap();
        assert_eq!(SessionState::from_json(&v).unwrap(), two_vbuckets());
        // As Python's json.dumps writes a state it was handed (spaces, its own key order),
        // with a field this release does not know.
        let v: Value = serde_json::from_str(
            r#"{"version": 1, "vbuckets": {"3": {"seqno": 9, "snapshot": [5, 12],
                "failover_log": [[18446744073709551615, 4], [1, 0]], "disk": true},
                "10": {"failover_log": [], "seqno": 0, "snapshot": [0, 0]}}}"#,
        )
        .unwrap();
        assert_eq!(SessionState::from_json(&v).unwrap(), two_vbuckets());
    }

    #[test]
    fn errors_name_the_vbucket_and_field() {
        let err = |v: Value| SessionState::from_json(&v).unwrap_err().to_string();
        let vb = |p: Value| json!({"version": 1, "vbuckets": {"7": p}});
        let good = || json!({"failover_log": [[1, 0]], "seqno": 3, "snapshot": [0, 3]});
        let with = |k: &str, x: Value| {
            let mut p = good();
            p[k] = x;
            vb(p)
        };
        assert_eq!(
            err(json!({"vbuckets": {}})),
            "session state: expected \"version\": 1"
        );
        assert_eq!(
            err(json!({"version": 2, "vbuckets": {}})),
            "session state: expected \"version\": 1"
        );
        assert_eq!(
            err(json!({"version": 1, "vbuckets": []})),
            "session state: \"vbuckets\" must be an object"
        );
        assert_eq!(
            err(json!({"version": 1, "vbuckets": {"x": {}}})),
            "session state: vbucket key 'x' is not a number"
        );
        assert_eq!(
            err(json!({"version": 1, "vbuckets": {"70000": good()}})),
            "session state: vbucket key '70000' is not a number"
        );
        assert_eq!(
            err(with("failover_log", json!({}))),
            "session state: vbucket 7: failover_log must be a list"
        );
        assert_eq!(
            err(with("failover_log", json!([[1, 2, 3]]))),
            "session state: vbucket 7: failover entries are [uuid, seqno]"
        );
        assert_eq!(
            err(with("failover_log", json!([[-1, 0]]))),
            "session state: vbucket 7: uuid must be an unsigned integer"
        );
        assert_eq!(
            err(with("snapshot", json!([1]))),
            "session state: vbucket 7: snapshot must be [start, end]"
        );
        assert_eq!(
            err(with("seqno", json!("3"))),
            "session state: vbucket 7: seqno must be an unsigned integer"
        );
        assert_eq!(
            err(with("snapshot", json!([0, 1.5]))),
            "session state: vbucket 7: snapshot end must be an unsigned integer"
        );
        assert_eq!(
            SessionState::from_json(&vb(good())).unwrap().vbuckets[&7].seqno,
            3
        );
    }
}
