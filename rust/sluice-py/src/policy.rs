//! The Python side of policy plugins: `sluice.policy` runs one thread per installed plugin
//! that takes questions with `Server.policy_next` (the GIL released while it waits) and
//! answers each `PolicyCall`. Questions come as plain dicts. A filter's keys are read only when
//! the plugin asks for them (`filter_keys`), as one bytes object with their ends as packed
//! u32s, so a batch costs a few objects, not one per key.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use sluice_server::policy::{
    Answer, FilterDecision, PolicyHost, PolicyKind, PrefixRule, Question, Reply, RetransmitEvent,
};

pub fn kind_of(name: &str) -> PyResult<PolicyKind> {
    PolicyKind::parse(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown policy {name:?} (ack, retransmit, slow_consumer, filter)"
        ))
    })
}

/// One question from the server to a plugin. Answer it once with `answer`, or `fail` it;
/// a call dropped unanswered is a timeout for the asker.
#[pyclass(module = "sluice._native", frozen)]
pub struct PolicyCall {
    /// Let go of when the call is answered: a filter's batch shares the connection's buffer,
    /// which the connection reuses once no one else holds it.
    question: Mutex<Option<Question>>,
    reply: Reply,
    host: Arc<PolicyHost>,
}

fn answered() -> PyErr {
    PyRuntimeError::new_err("the call was answered: its question is no longer there")
}

/// Numbers packed little-endian into one bytes object (Python reads it with memoryview.cast).
fn le_bytes<const N: usize, T: Copy>(
    py: Python<'_>,
    v: &[T],
    to: impl Fn(T) -> [u8; N],
) -> Py<PyBytes> {
    let mut out = Vec::with_capacity(v.len() * N);
    for x in v {
        out.extend_from_slice(&to(*x));
    }
    PyBytes::new(py, &out).unbind()
}

#[pymethods]
impl PolicyCall {
    /// "ack", "retransmit", "slow_consumer" or "filter".
    #[getter]
    fn kind(&self) -> &'static str {
        self.reply.kind.name()
    }

    /// The question as a dict (keys depend on the kind; see sluice.policy).
    fn question<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let question = self.question.lock();
        match question.as_ref().ok_or_else(answered)? {
            Question::Ack(a) => {
                d.set_item("protocol", a.protocol)?;
                d.set_item("connection", &a.connection)?;
                d.set_item("rtt", a.rtt)?;
                d.set_item("unacked", a.unacked)?;
                d.set_item("acked_total", a.acked_total)?;
                d.set_item("sent_total", a.sent_total)?;
                d.set_item("interval", a.interval)?;
                d.set_item("window", a.window)?;
            }
            Question::Retransmit(RetransmitEvent::Disconnected {
                connection,
                unacked,
            }) => {
                d.set_item("event", "disconnected")?;
                d.set_item("connection", connection)?;
                d.set_item("unacked", unacked)?;
            }
            Question::Retransmit(RetransmitEvent::TempFail {
                connection,
                status,
                attempt,
            }) => {
                d.set_item("event", "temp_fail")?;
                d.set_item("connection", connection)?;
                d.set_item("status", status)?;
                d.set_item("attempt", attempt)?;
            }
            Question::SlowConsumer {
                over_by,
                candidates,
            } => {
                d.set_item("over_by", over_by)?;
                let list = PyList::empty(py);
                for c in candidates {
                    let e = PyDict::new(py);
                    e.set_item("id", c.id)?;
                    e.set_item("name", &c.name)?;
                    e.set_item("bucket", c.bucket)?;
                    e.set_item("vbucket", c.vbucket)?;
                    e.set_item("seqno", c.seqno)?;
                    e.set_item("pinned_bytes", c.pinned_bytes)?;
                    list.append(e)?;
                }
                d.set_item("candidates", list)?;
            }
            Question::Filter(b) => {
                d.set_item("connection", &b.connection)?;
                d.set_item("docs", b.docs)?;
                d.set_item("value_bytes", b.value_bytes)?;
            }
        }
        Ok(d)
    }

    /// A filter question's keys: (keys, their ends as packed u32s, vbuckets as packed u16s).
    fn filter_keys<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyBytes>, Py<PyBytes>, Py<PyBytes>)> {
        let question = self.question.lock();
        let Some(Question::Filter(b)) = question.as_ref() else {
            return Err(match question.as_ref() {
                None => answered(),
                Some(_) => PyValueError::new_err("not a filter question"),
            });
        };
        let k = b.keys();
        Ok((
            PyBytes::new(py, &k.keys),
            le_bytes(py, &k.ends, u32::to_le_bytes),
            le_bytes(py, &k.vbuckets, u16::to_le_bytes),
        ))
    }

    /// Seconds since the question was asked.
    #[getter]
    fn age(&self) -> f64 {
        self.reply.posted.elapsed().as_secs_f64()
    }

    /// The plugin's decision, in the form its kind takes:
    /// ack: (interval, window); retransmit: (seconds, resend); slow_consumer: [cursor ids];
    /// filter: an action for all (int), one action per key (bytes), or
    /// ("prefixes", [drop prefixes], [strip prefixes]). None: the native default.
    fn answer(&self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = match self.reply.kind {
            _ if value.is_none() => Answer::Default,
            PolicyKind::Ack => {
                let (interval, window): (u32, u32) = value.extract()?;
                if interval == 0 || window == 0 {
                    return Err(PyValueError::new_err(
                        "interval and window must be at least 1",
                    ));
                }
                Answer::Ack { interval, window }
            }
            PolicyKind::Retransmit => {
                let (seconds, resend): (f64, bool) = value.extract()?;
                if !(seconds.is_finite() && seconds >= 0.0) {
                    return Err(PyValueError::new_err("seconds must be finite and >= 0"));
                }
                Answer::Retransmit { seconds, resend }
            }
            PolicyKind::SlowConsumer => Answer::Drop(value.extract()?),
            PolicyKind::Filter => Answer::Filter(filter_decision(value)?),
        };
        self.question.lock().take();
        self.reply.answer(a);
        Ok(())
    }

    /// The plugin raised: counted, and the asker gets the native default.
    fn fail(&self) {
        self.question.lock().take();
        self.host.count_error(self.reply.kind);
        self.reply.answer(Answer::Default);
    }
}

fn filter_decision(value: &Bound<'_, PyAny>) -> PyResult<FilterDecision> {
    if let Ok(a) = value.extract::<u8>() {
        return check_action(a).map(FilterDecision::All);
    }
    if let Ok(b) = value.cast::<PyBytes>() {
        let v = b.as_bytes().to_vec();
        for a in &v {
            check_action(*a)?;
        }
        return Ok(FilterDecision::Each(v));
    }
    if let Ok((tag, drop, strip)) = value.extract::<(String, Vec<Vec<u8>>, Vec<Vec<u8>>)>() {
        if tag == "prefixes" {
            return Ok(FilterDecision::Prefixes(PrefixRule::new(drop, strip)));
        }
    }
    Err(PyValueError::new_err(
        "a filter answers None, an action (0 keep, 1 drop, 2 strip value), bytes of actions, \
         or (\"prefixes\", drop, strip)",
    ))
}

fn check_action(a: u8) -> PyResult<u8> {
    if a <= 2 {
        Ok(a)
    } else {
        Err(PyValueError::new_err(format!(
            "filter action {a} is not 0 (keep), 1 (drop) or 2 (strip value)"
        )))
    }
}

/// The next question for plugin `kind`, waiting up to `wait` seconds with the GIL released.
pub fn next_call(
    py: Python<'_>,
    host: &Arc<PolicyHost>,
    kind: PolicyKind,
    wait: f64,
) -> Option<PolicyCall> {
    let wait = Duration::from_secs_f64(wait.clamp(0.0, 60.0));
    let h = host.clone();
    py.detach(move || h.next_call(kind, wait))
        .map(|call| PolicyCall {
            question: Mutex::new(Some(call.question)),
            reply: call.reply,
            host: host.clone(),
        })
}
