//! A space's tuples as typed columns for the Spark source (`.option("space", ...)`): one Arrow
//! column per field of the space's format, decoded from the MessagePack tuples of a batch of
//! changes, plus the change's op, vbucket, seqno and CAS. A deletion has no tuple: its primary
//! key's fields come from the key (the MessagePack array of the key's parts), the others are
//! null.
//!
//! Python decides each field's column kind from its Tarantool type (sluice.spark) and builds
//! the pyarrow arrays from these buffers without touching a value.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use sluice_proto::iproto::json::{ext_text, write_json};
use sluice_proto::iproto::{EXT_DECIMAL, MAX_DEPTH};
use sluice_proto::msgpack::{Reader, Value};

use crate::dcp::{bytes_of, RawBatch, Utf8Column, OPS};

/// How a field's values become a column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// int64: integers that fit (an unsigned above 2^63 - 1 is null).
    Long,
    /// float64: floats, integers and decimals.
    Double,
    Boolean,
    /// UTF-8: strings (bytes that are not UTF-8 become U+FFFD), UUIDs and decimals as text.
    Text,
    Binary,
    /// UTF-8 JSON of any value (`sluice_proto::iproto::json`).
    Json,
}

impl Kind {
    fn parse(name: &str) -> Option<Kind> {
        Some(match name {
            "long" => Kind::Long,
            "double" => Kind::Double,
            "boolean" => Kind::Boolean,
            "string" => Kind::Text,
            "binary" => Kind::Binary,
            "json" => Kind::Json,
            _ => return None,
        })
    }
}

/// One column being built: a validity bitmap and, by kind, 8-byte values, value bits, or
/// int32 offsets into bytes.
struct Column {
    kind: Kind,
    rows: usize,
    validity: Vec<u8>,
    fixed: Vec<u8>,
    offsets: Vec<i32>,
    data: Vec<u8>,
    text: String,
}

impl Column {
    fn new(kind: Kind, rows: usize) -> Column {
        let bitmap = rows.div_ceil(8);
        let (fixed, offsets) = match kind {
            Kind::Long | Kind::Double => (Vec::with_capacity(rows * 8), Vec::new()),
            Kind::Boolean => (vec![0; bitmap], Vec::new()),
            Kind::Text | Kind::Binary | Kind::Json => {
                let mut offsets = Vec::with_capacity(rows + 1);
                offsets.push(0);
                (Vec::new(), offsets)
            }
        };
        Column {
            kind,
            rows: 0,
            validity: vec![0; bitmap],
            fixed,
            offsets,
            data: Vec::new(),
            text: String::new(),
        }
    }

    /// The next row's value: `raw` is one MessagePack value, None a missing field.
    fn push(&mut self, raw: Option<&[u8]>) -> Result<(), String> {
        let row = self.rows;
        self.rows += 1;
        let value = match raw {
            Some(raw) => Reader::new(raw).read_value().map_err(|e| e.to_string())?,
            None => Value::Nil,
        };
        let valid = match (self.kind, value) {
            (_, Value::Nil) => false,
            (Kind::Long, Value::UInt(n)) if n <= i64::MAX as u64 => self.put_fixed(n as i64),
            (Kind::Long, Value::Int(n)) => self.put_fixed(n),
            (Kind::Double, v) => match as_f64(v) {
                Some(f) => self.put_fixed(f),
                None => false,
            },
            (Kind::Boolean, Value::Bool(b)) => {
                if b {
                    self.fixed[row / 8] |= 1 << (row % 8);
                }
                true
            }
            (Kind::Text, Value::Str(s)) => self.put_bytes(String::from_utf8_lossy(s).as_bytes()),
            (Kind::Text, Value::Ext(t, data)) => match ext_text(t, data) {
                Some(text) => self.put_bytes(text.as_bytes()),
                None => false,
            },
            (Kind::Binary, Value::Bin(b) | Value::Str(b)) => self.put_bytes(b),
            (Kind::Json, _) => {
                let mut text = std::mem::take(&mut self.text);
                text.clear();
                let raw = raw.unwrap_or_default();
                write_json(&mut Reader::new(raw), &mut text, MAX_DEPTH)
                    .map_err(|e| e.to_string())?;
                let valid = self.put_bytes(text.as_bytes());
                self.text = text;
                valid
            }
            _ => false,
        };
        if valid {
            self.validity[row / 8] |= 1 << (row % 8);
        } else {
            match self.kind {
                Kind::Long | Kind::Double => self.fixed.extend_from_slice(&[0; 8]),
                Kind::Boolean => {}
                Kind::Text | Kind::Binary | Kind::Json => self.offsets.push(self.data.len() as i32),
            }
        }
        Ok(())
    }

    fn put_fixed<T: bytemuck::Pod>(&mut self, v: T) -> bool {
        self.fixed.extend_from_slice(bytemuck::bytes_of(&v));
        true
    }

    fn put_bytes(&mut self, b: &[u8]) -> bool {
        self.data.extend_from_slice(b);
        self.offsets.push(self.data.len() as i32);
        true
    }

    /// (validity, values) or (validity, offsets, data), as pyarrow's `Array.from_buffers`
    /// takes them.
    fn buffers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        if self.data.len() > i32::MAX as usize {
            return Err(PyValueError::new_err(format!(
                "a batch holds {} bytes of one field, more than Spark's 2 GiB column: lower the \
                 batch size",
                self.data.len()
            )));
        }
        let validity = PyBytes::new(py, &self.validity);
        match self.kind {
            Kind::Long | Kind::Double | Kind::Boolean => {
                PyTuple::new(py, [validity, PyBytes::new(py, &self.fixed)])
            }
            Kind::Text | Kind::Binary | Kind::Json => PyTuple::new(
                py,
                [
                    validity,
                    bytes_of(py, &self.offsets),
                    PyBytes::new(py, &self.data),
                ],
            ),
        }
    }
}

fn as_f64(v: Value<'_>) -> Option<f64> {
    match v {
        Value::F32(f) => Some(f as f64),
        Value::F64(f) => Some(f),
        Value::UInt(n) => Some(n as f64),
        Value::Int(n) => Some(n as f64),
        Value::Ext(EXT_DECIMAL, data) => ext_text(EXT_DECIMAL, data)?.parse().ok(),
        _ => None,
    }
}

/// The raw MessagePack values of an array's elements, into `out` (cleared first).
fn elements<'a>(bytes: &'a [u8], out: &mut Vec<&'a [u8]>) -> Result<(), String> {
    out.clear();
    let mut r = Reader::new(bytes);
    let n = match r.read_value().map_err(|e| e.to_string())? {
        Value::Array(n) => n,
        _ => return Err("not a MessagePack array".into()),
    };
    for _ in 0..n {
        out.push(r.read_raw_value(MAX_DEPTH).map_err(|e| e.to_string())?);
    }
    if !r.is_empty() {
        return Err(format!("{} bytes after the array", r.rest().len()));
    }
    Ok(())
}

/// The columns of a space's rows in `batch`: `kinds` per field of the format (`long`,
/// `double`, `boolean`, `string`, `binary`, `json`), `primary_key` the key's field numbers.
/// Returns {"num_rows", "fields": [buffers per field], "op_offsets", "op_data", "vbucket",
/// "seqno", "cas"}; a value or key that is not a tuple is a ValueError naming its change.
#[pyfunction]
#[pyo3(signature = (batch, kinds, primary_key, include_deletes))]
pub fn tuple_columns<'py>(
    py: Python<'py>,
    batch: &RawBatch,
    kinds: Vec<String>,
    primary_key: Vec<usize>,
    include_deletes: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let kinds: Vec<Kind> = kinds
        .iter()
        .map(|k| {
            Kind::parse(k).ok_or_else(|| PyValueError::new_err(format!("no column kind {k:?}")))
        })
        .collect::<PyResult<_>>()?;
    if let Some(&bad) = primary_key.iter().find(|&&f| f >= kinds.len()) {
        return Err(PyValueError::new_err(format!(
            "primary key field {bad} is past the format's {} fields",
            kinds.len()
        )));
    }
    let b = batch.columns();
    let rows: Vec<usize> = (0..b.len())
        .filter(|&i| include_deletes || b.op[i] == 0)
        .collect();
    let n = rows.len();
    let mut columns: Vec<Column> = kinds.iter().map(|&k| Column::new(k, n)).collect();
    let mut parts: Vec<&[u8]> = Vec::new();
    let mut fields: Vec<Option<&[u8]>> = vec![None; kinds.len()];
    let (mut vbucket, mut seqno, mut cas) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let mut op = Utf8Column::with_capacity(n, n * 8);
    for &i in &rows {
        let deleted = b.op[i] != 0;
        let bytes = if deleted {
            &b.keys[b.key_offsets[i] as usize..b.key_offsets[i + 1] as usize]
        } else {
            &b.values[b.value_offsets[i] as usize..b.value_offsets[i + 1] as usize]
        };
        elements(bytes, &mut parts).map_err(|e| {
            PyValueError::new_err(format!(
                "vbucket {} seqno {}: the {} is not a tuple ({e}); was it written over iproto?",
                b.vbucket[i],
                b.seqno[i],
                if deleted { "key" } else { "value" },
            ))
        })?;
        fields.iter_mut().for_each(|f| *f = None);
        if deleted {
            for (&field, &part) in primary_key.iter().zip(&parts) {
                fields[field] = Some(part);
            }
        } else {
            for (f, &part) in fields.iter_mut().zip(&parts) {
                *f = Some(part);
            }
        }
        for (column, &field) in columns.iter_mut().zip(&fields) {
            column.push(field).map_err(|e| {
                PyValueError::new_err(format!(
                    "vbucket {} seqno {}: {e}",
                    b.vbucket[i], b.seqno[i]
                ))
            })?;
        }
        vbucket.push(i32::from(b.vbucket[i]));
        seqno.push(b.seqno[i] as i64);
        cas.push(b.cas[i] as i64);
        op.push_str(OPS[b.op[i] as usize]);
    }
    let d = PyDict::new(py);
    d.set_item("num_rows", n)?;
    let out = PyList::empty(py);
    for c in &columns {
        out.append(c.buffers(py)?)?;
    }
    d.set_item("fields", out)?;
    op.put(py, &d, "op")?;
    d.set_item("vbucket", bytes_of(py, &vbucket))?;
    d.set_item("seqno", bytes_of(py, &seqno))?;
    d.set_item("cas", bytes_of(py, &cas))?;
    Ok(d)
}
