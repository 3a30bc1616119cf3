//! The native DCP consumer for Python: `DcpConsumer` runs `sluice_server::dcp::consumer` and
//! hands over its batches as column buffers (one copy into `bytes` per column, nothing per
//! item); `sluice.client` turns them into pyarrow RecordBatches or `Change` tuples. The state
//! it exports is the one after the last batch handed over.

use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyType};

use std::collections::BTreeMap;

use sluice_server::dcp::consumer::{
    self, Batch, ConsumerConfig, Event, MapConsumer, Position, RollbackMode, SessionState,
};

use crate::errors::SluiceError;
use crate::records::RecordType;

/// One batch of documents in columns, with the streams that ended and the rollbacks followed.
#[pyclass(module = "sluice._native", frozen)]
pub struct RawBatch {
    batch: Batch,
}

/// A column's values in native byte order; `Pod` limits it to types whose every byte is
/// initialised (no padding), so viewing them as bytes is sound.
pub(crate) fn bytes_of<'py, T: bytemuck::Pod>(py: Python<'py>, v: &[T]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, bytemuck::cast_slice(v))
}

pub(crate) const OPS: [&str; 3] = ["mutation", "deletion", "expiration"];

/// An Arrow string column being built: int32 offsets and the UTF-8 bytes.
pub(crate) struct Utf8Column {
    offsets: Vec<i32>,
    data: Vec<u8>,
}

impl Utf8Column {
    pub(crate) fn with_capacity(rows: usize, bytes: usize) -> Utf8Column {
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        Utf8Column {
            offsets,
            data: Vec::with_capacity(bytes),
        }
    }

    pub(crate) fn push_str(&mut self, s: &str) {
        self.data.extend_from_slice(s.as_bytes());
        self.offsets.push(self.data.len() as i32);
    }

    pub(crate) fn put(&self, py: Python<'_>, d: &Bound<'_, PyDict>, name: &str) -> PyResult<()> {
        d.set_item(format!("{name}_offsets"), bytes_of(py, &self.offsets))?;
        d.set_item(format!("{name}_data"), PyBytes::new(py, &self.data))
    }
}

/// A value's extended attributes as one JSON object (the attributes' values are JSON already);
/// "{}" for a value without any, or whose attributes do not read.
fn xattrs_json(value: &[u8], datatype: u8) -> String {
    let mut out = String::from("{");
    if datatype & sluice_proto::xattr::DATATYPE_XATTR != 0 {
        if let Ok((attrs, _)) = sluice_proto::xattr::split(value) {
            for (n, (k, v)) in attrs.iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                let key = String::from_utf8_lossy(k);
                out.push_str(&serde_json::to_string(&key).expect("a string serializes"));
                out.push(':');
                out.push_str(&String::from_utf8_lossy(v));
            }
        }
    }
    out.push('}');
    out
}

impl RawBatch {
    pub(crate) fn columns(&self) -> &Batch {
        &self.batch
    }
}

#[pymethods]
impl RawBatch {
    #[getter]
    fn num_rows(&self) -> usize {
        self.batch.len()
    }

    /// Column buffers in native byte order: fixed-width columns, and for `key` and `value`
    /// Arrow offsets (int32 / int64) plus data.
    fn buffers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let b = &self.batch;
        let d = PyDict::new(py);
        d.set_item("vbucket", bytes_of(py, &b.vbucket))?;
        d.set_item("seqno", bytes_of(py, &b.seqno))?;
        d.set_item("op", bytes_of(py, &b.op))?;
        d.set_item("cas", bytes_of(py, &b.cas))?;
        d.set_item("rev_seqno", bytes_of(py, &b.rev_seqno))?;
        d.set_item("flags", bytes_of(py, &b.flags))?;
        d.set_item("expiry", bytes_of(py, &b.expiry))?;
        d.set_item("datatype", bytes_of(py, &b.datatype))?;
        d.set_item("key_offsets", bytes_of(py, &b.key_offsets))?;
        d.set_item("keys", PyBytes::new(py, &b.keys))?;
        d.set_item("value_offsets", bytes_of(py, &b.value_offsets))?;
        d.set_item("values", PyBytes::new(py, &b.values))?;
        Ok(d)
    }

    /// The columns of the Spark connector's schema, in native byte order: `vbucket` and
    /// `flags` int32, `seqno`, `expiry`, `cas`, `rev_seqno` int64 (CAS and flags keep their
    /// bits), and `op`, `key` (UTF-8; bytes that are not become U+FFFD) and `value` as Arrow
    /// int32 offsets plus data. Deletions and expirations only with `include_deletes`.
    #[pyo3(signature = (include_deletes, xattrs=false))]
    fn spark_buffers<'py>(
        &self,
        py: Python<'py>,
        include_deletes: bool,
        xattrs: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let b = &self.batch;
        let rows: Vec<usize> = (0..b.len())
            .filter(|&i| include_deletes || b.op[i] == 0)
            .collect();
        let n = rows.len();
        let mut vbucket = Vec::with_capacity(n);
        let mut seqno = Vec::with_capacity(n);
        let mut flags = Vec::with_capacity(n);
        let mut expiry = Vec::with_capacity(n);
        let mut cas = Vec::with_capacity(n);
        let mut rev_seqno = Vec::with_capacity(n);
        let mut op = Utf8Column::with_capacity(n, n * 8);
        let mut key = Utf8Column::with_capacity(n, b.keys.len());
        for &i in &rows {
            vbucket.push(i32::from(b.vbucket[i]));
            seqno.push(b.seqno[i] as i64);
            flags.push(b.flags[i] as i32);
            expiry.push(i64::from(b.expiry[i]));
            cas.push(b.cas[i] as i64);
            rev_seqno.push(b.rev_seqno[i] as i64);
            op.push_str(OPS[b.op[i] as usize]);
            key.push_str(&String::from_utf8_lossy(
                &b.keys[b.key_offsets[i] as usize..b.key_offsets[i + 1] as usize],
            ));
        }
        let d = PyDict::new(py);
        d.set_item("num_rows", n)?;
        d.set_item("vbucket", bytes_of(py, &vbucket))?;
        d.set_item("seqno", bytes_of(py, &seqno))?;
        d.set_item("flags", bytes_of(py, &flags))?;
        d.set_item("expiry", bytes_of(py, &expiry))?;
        d.set_item("cas", bytes_of(py, &cas))?;
        d.set_item("rev_seqno", bytes_of(py, &rev_seqno))?;
        op.put(py, &d, "op")?;
        key.put(py, &d, "key")?;
        // With `xattrs`, a value is its body, and its extended attributes are a column of
        // their own: a JSON object of them ("{}" for none).
        let value_of = |i: usize| {
            let v = &b.values[b.value_offsets[i] as usize..b.value_offsets[i + 1] as usize];
            if xattrs {
                sluice_proto::xattr::body(v, b.datatype[i])
            } else {
                v
            }
        };
        if xattrs {
            let mut attrs = Utf8Column::with_capacity(n, n * 2);
            for &i in &rows {
                let v = &b.values[b.value_offsets[i] as usize..b.value_offsets[i + 1] as usize];
                attrs.push_str(&xattrs_json(v, b.datatype[i]));
            }
            attrs.put(py, &d, "xattrs")?;
        }
        // Values are copied once, straight into the Python bytes object.
        let total: usize = rows.iter().map(|&i| value_of(i).len()).sum();
        if total > i32::MAX as usize {
            return Err(PyValueError::new_err(format!(
                "a batch of {n} rows holds {total} bytes of values, more than Spark's 2 GiB \
                 binary column: lower the batch size"
            )));
        }
        let mut value_offsets = Vec::with_capacity(n + 1);
        value_offsets.push(0i32);
        let values = PyBytes::new_with(py, total, |buf| {
            let mut at = 0;
            for &i in &rows {
                let v = value_of(i);
                buf[at..at + v.len()].copy_from_slice(v);
                at += v.len();
                value_offsets.push(at as i32);
            }
            Ok(())
        })?;
        d.set_item("value_offsets", bytes_of(py, &value_offsets))?;
        d.set_item("value_data", values)?;
        Ok(d)
    }

    /// Rows as tuples: (vbucket, seqno, op, key, value, cas, rev_seqno, flags, expiry, datatype),
    /// or as `row_type` (a NamedTuple of those ten, as `sluice.Change`), made natively
    /// (`records`).
    #[pyo3(signature = (row_type=None))]
    fn rows<'py>(
        &self,
        py: Python<'py>,
        row_type: Option<Bound<'py, PyType>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let rows = RecordType::new(py, row_type)?;
        // One str per op for the whole batch, not one per row.
        let ops = OPS.map(|op| PyString::intern(py, op));
        let b = &self.batch;
        let out = PyList::empty(py);
        for i in 0..b.len() {
            let key = &b.keys[b.key_offsets[i] as usize..b.key_offsets[i + 1] as usize];
            let value = &b.values[b.value_offsets[i] as usize..b.value_offsets[i + 1] as usize];
            let row = rows.make([
                b.vbucket[i].into_pyobject(py)?.into_any(),
                b.seqno[i].into_pyobject(py)?.into_any(),
                ops[b.op[i] as usize].clone().into_any(),
                PyBytes::new(py, key).into_any(),
                PyBytes::new(py, value).into_any(),
                b.cas[i].into_pyobject(py)?.into_any(),
                b.rev_seqno[i].into_pyobject(py)?.into_any(),
                b.flags[i].into_pyobject(py)?.into_any(),
                b.expiry[i].into_pyobject(py)?.into_any(),
                b.datatype[i].into_pyobject(py)?.into_any(),
            ])?;
            out.append(row)?;
        }
        Ok(out)
    }

    /// Streams that ended in this batch: (vbucket, STREAM_END reason).
    #[getter]
    fn ended(&self) -> Vec<(u16, u32)> {
        self.batch.ended.clone()
    }

    /// Rollbacks followed automatically: (vbucket, seqno).
    #[getter]
    fn rollbacks(&self) -> Vec<(u16, u64)> {
        self.batch.rollbacks.clone()
    }
}

/// Seconds from Python as a setup timeout, kept between 0.1 s and an hour.
fn setup_timeout_of(seconds: f64) -> Duration {
    Duration::from_secs_f64(seconds.clamp(0.1, 3600.0))
}

/// (vbucket, high seqno, failover log as (uuid, seqno) pairs).
type PositionTuple = (u16, u64, Vec<(u64, u64)>);

/// Per vbucket in `state` ("active", "replica", "pending" or "dead"):
/// (vbucket, high seqno, failover log newest first as (uuid, seqno) pairs).
#[pyfunction]
#[pyo3(signature = (address, *, bucket="default", username=None, password=None, state="active",
    timeout=10.0, topic=None))]
#[allow(clippy::too_many_arguments)]
pub fn vbucket_positions(
    py: Python<'_>,
    address: &str,
    bucket: &str,
    username: Option<String>,
    password: Option<String>,
    state: &str,
    timeout: f64,
    topic: Option<String>,
) -> PyResult<Vec<PositionTuple>> {
    let code = sluice_core::vbucket::VbState::parse(state).ok_or_else(|| {
        PyValueError::new_err(format!(
            "state must be active, replica, pending or dead, not '{state}'"
        ))
    })? as u32;
    let config = ConsumerConfig {
        address: address.to_string(),
        bucket: bucket.to_string(),
        topic,
        username,
        password,
        name: format!("sluice:positions:{}", std::process::id()),
        setup_timeout: Some(setup_timeout_of(timeout)),
        ..ConsumerConfig::default()
    };
    let r = py.detach(|| consumer::vbucket_positions(&config, code));
    r.map(|v| {
        v.into_iter()
            .map(|p| (p.vbucket, p.high_seqno, p.failover))
            .collect()
    })
    .map_err(|e| SluiceError::new_err(e.to_string()))
}

/// DCP streams on threads of their own (a connection per node they stream from).
#[pyclass(module = "sluice._native", frozen)]
pub struct DcpConsumer {
    consumer: Mutex<Option<MapConsumer>>,
    /// The state after the last batch handed to Python.
    state: Mutex<SessionState>,
}

fn apply(state: &mut SessionState, positions: &[(u16, Position)]) {
    for (vb, p) in positions {
        state.vbuckets.insert(*vb, p.clone());
    }
}

#[pymethods]
impl DcpConsumer {
    #[new]
    #[pyo3(signature = (address, *, bucket="default", username=None, password=None,
        name="sluice:consumer", vbuckets=None, from_now=false, to_latest=false, end_seqnos=None,
        state=None,
        rollback="ask", batch_size=8192, buffer_size=16777216, noop_interval=20,
        include_values=true, include_xattrs=false, cursor_dropping=false, setup_timeout=None,
        topic=None, follow_moves=true, move_timeout=60.0, cafile=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        address: &str,
        bucket: &str,
        username: Option<String>,
        password: Option<String>,
        name: &str,
        vbuckets: Option<Vec<u16>>,
        from_now: bool,
        to_latest: bool,
        end_seqnos: Option<BTreeMap<u16, u64>>,
        state: Option<&str>,
        rollback: &str,
        batch_size: usize,
        buffer_size: u32,
        noop_interval: u32,
        include_values: bool,
        include_xattrs: bool,
        cursor_dropping: bool,
        setup_timeout: Option<f64>,
        topic: Option<String>,
        follow_moves: bool,
        move_timeout: f64,
        cafile: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        // A TLS port's certificate must chain to these CAs.
        let tls = cafile
            .map(|ca| sluice_server::tls::ClientTls::trusting("cafile", &ca))
            .transpose()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let state = match state {
            None => SessionState::default(),
            Some(s) => {
                let v: serde_json::Value = serde_json::from_str(s).map_err(|e| {
                    PyValueError::new_err(format!("session state is not JSON: {e}"))
                })?;
                SessionState::from_json(&v).map_err(|e| PyValueError::new_err(e.to_string()))?
            }
        };
        let rollback = match rollback {
            "ask" => RollbackMode::Ask,
            "resume" => RollbackMode::Resume,
            other => {
                return Err(PyValueError::new_err(format!(
                    "rollback must be 'ask' or 'resume', not '{other}'"
                )))
            }
        };
        if batch_size == 0 {
            return Err(PyValueError::new_err("batch_size must be at least 1"));
        }
        if name.is_empty() || name.len() > 200 {
            return Err(PyValueError::new_err("name must be 1 to 200 bytes"));
        }
        let config = ConsumerConfig {
            address: address.to_string(),
            bucket: bucket.to_string(),
            topic,
            username,
            password,
            name: name.to_string(),
            vbuckets,
            from_now,
            to_latest,
            end_seqnos: end_seqnos.unwrap_or_default(),
            setup_timeout: setup_timeout.map(setup_timeout_of),
            state: state.clone(),
            rollback,
            batch_size,
            buffer_size,
            noop_interval,
            include_values,
            include_xattrs,
            cursor_dropping,
            replica_name: None,
            takeover: false,
            active_only: false,
            kv_address: None,
            end_refused_streams: false,
            flow_control: None,
            tls,
        };
        if !(move_timeout.is_finite() && move_timeout > 0.0) {
            return Err(PyValueError::new_err(
                "move_timeout must be a positive number of seconds",
            ));
        }
        let move_timeout = Duration::from_secs_f64(move_timeout.min(365.0 * 86400.0));
        let consumer = py.detach(|| MapConsumer::start(config, follow_moves, move_timeout));
        Ok(DcpConsumer {
            consumer: Mutex::new(Some(consumer)),
            state: Mutex::new(state),
        })
    }

    /// The next event, waiting up to `timeout` seconds (None on timeout):
    /// ("batch", RawBatch), ("rollback", vbucket, seqno) or ("finished",).
    /// Raises SluiceError when the connection fails.
    fn next_event(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Py<PyAny>>> {
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        let event = py.detach(|| {
            let mut guard = self.consumer.lock();
            guard.as_mut().map(|c| c.next_event(timeout))
        });
        let Some(event) = event else {
            return Ok(Some(("finished",).into_pyobject(py)?.into_any().unbind()));
        };
        Ok(match event {
            None => None,
            Some(Event::Batch(batch)) => {
                apply(&mut self.state.lock(), &batch.positions);
                let b = Py::new(py, RawBatch { batch: *batch })?;
                Some(("batch", b).into_pyobject(py)?.into_any().unbind())
            }
            Some(Event::Rollback {
                vbucket,
                seqno,
                position,
            }) => {
                apply(&mut self.state.lock(), &[(vbucket, position)]);
                Some(
                    ("rollback", vbucket, seqno)
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                )
            }
            // MapConsumer refuses hand-overs itself: this reader asks for no takeover streams.
            Some(Event::VbucketState { .. }) => None,
            Some(Event::Finished) => {
                self.consumer.lock().take();
                Some(("finished",).into_pyobject(py)?.into_any().unbind())
            }
            Some(Event::Failed(why)) => {
                self.consumer.lock().take();
                return Err(SluiceError::new_err(why));
            }
        })
    }

    /// Requests a vbucket's stream again after a rollback the reader has handled.
    fn resume(&self, vbucket: u16) {
        if let Some(c) = self.consumer.lock().as_ref() {
            c.resume(vbucket);
        }
    }

    /// The session state after the last batch handed over, as JSON.
    fn state_json(&self) -> String {
        self.state.lock().to_json().to_string()
    }

    /// Per vbucket: (seqno, snapshot start, snapshot end, whether the snapshot is a backfill).
    fn positions(&self) -> Vec<(u16, u64, u64, u64, bool)> {
        self.state
            .lock()
            .vbuckets
            .iter()
            .map(|(vb, p)| (*vb, p.seqno, p.snap_start, p.snap_end, p.disk))
            .collect()
    }

    /// Closes the connection and stops the thread.
    fn close(&self, py: Python<'_>) {
        let c = self.consumer.lock().take();
        py.detach(move || drop(c));
    }
}
