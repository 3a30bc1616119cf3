//! Greenstack's frames for `sluice.greenstack`'s client, built and read by
//! `sluice_proto::greenstack`, the codec the server uses: Python moves bytes over its socket
//! and never encodes a frame itself.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};
use sluice_proto::greenstack::{FlexEntry, Frame, FrameOut};
use sluice_proto::msgpack::{self, Reader, Value};

/// How deep a payload's arrays and maps may nest, either way.
const MAX_DEPTH: usize = 16;

/// Appends `v` as MessagePack: None, bool, int, float, str, bytes, and lists, tuples and
/// dicts of them.
fn write_value(out: &mut Vec<u8>, v: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "a payload nested deeper than {MAX_DEPTH}"
        )));
    }
    if v.is_none() {
        msgpack::write_nil(out);
    } else if let Ok(b) = v.cast::<PyBool>() {
        msgpack::write_bool(out, b.is_true());
    } else if v.is_instance_of::<PyInt>() {
        match v.extract::<u64>() {
            Ok(u) => msgpack::write_uint(out, u),
            Err(_) => msgpack::write_int(out, v.extract::<i64>()?),
        }
    } else if let Ok(f) = v.cast::<PyFloat>() {
        msgpack::write_f64(out, f.value());
    } else if let Ok(s) = v.cast::<PyString>() {
        msgpack::write_str(out, s.to_str()?);
    } else if let Ok(b) = v.cast::<PyBytes>() {
        msgpack::write_bin(out, b.as_bytes());
    } else if let Ok(b) = v.cast::<PyByteArray>() {
        msgpack::write_bin(out, &b.to_vec());
    } else if let Ok(d) = v.cast::<PyDict>() {
        write_map(out, d, depth + 1)?;
    } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let items: Vec<Bound<'_, PyAny>> = v.try_iter()?.collect::<PyResult<_>>()?;
        msgpack::write_array_len(out, items.len() as u32);
        for item in &items {
            write_value(out, item, depth + 1)?;
        }
    } else {
        return Err(PyTypeError::new_err(format!(
            "a payload value of type {} (None, bool, int, float, str, bytes, list or dict)",
            v.get_type().name()?
        )));
    }
    Ok(())
}

fn write_map(out: &mut Vec<u8>, d: &Bound<'_, PyDict>, depth: usize) -> PyResult<()> {
    msgpack::write_map_len(out, d.len() as u32);
    for (k, v) in d.iter() {
        write_value(out, &k, depth)?;
        write_value(out, &v, depth)?;
    }
    Ok(())
}

/// One frame: a request, or a reply when `status` is given; `flex`: (key, value) entries of
/// the flex header. An empty or absent payload writes no payload bytes.
#[pyfunction]
#[pyo3(signature = (opaque, opcode, payload=None, *, flags=0, status=None, flex=Vec::new()))]
pub(crate) fn greenstack_frame<'py>(
    py: Python<'py>,
    opaque: u32,
    opcode: u16,
    payload: Option<&Bound<'py, PyDict>>,
    flags: u8,
    status: Option<u16>,
    flex: Vec<(u16, Vec<u8>)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut body = Vec::new();
    if let Some(p) = payload.filter(|p| !p.is_empty()) {
        write_map(&mut body, p, 1)?;
    }
    if let Some((key, _)) = flex.iter().find(|(_, v)| v.len() > u16::MAX as usize) {
        return Err(PyValueError::new_err(format!(
            "flex entry {key:#06x}: a value of at most 65535 bytes"
        )));
    }
    let entries: Vec<FlexEntry<'_>> = flex
        .iter()
        .map(|(key, value)| FlexEntry { key: *key, value })
        .collect();
    let mut out = Vec::with_capacity(body.len() + 32);
    FrameOut {
        opaque,
        opcode,
        flags,
        status,
        flex: &entries,
        payload: &body,
    }
    .write(&mut out);
    Ok(PyBytes::new(py, &out))
}

/// Reads one value (arrays and maps whole) as a Python object.
fn read_value<'py>(
    py: Python<'py>,
    r: &mut Reader<'_>,
    depth: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let bad = |e: sluice_proto::msgpack::DecodeError| PyValueError::new_err(e.to_string());
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "a payload nested deeper than {MAX_DEPTH}"
        )));
    }
    Ok(match r.read_value().map_err(bad)? {
        Value::Nil => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
        Value::UInt(u) => u.into_pyobject(py)?.into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::F32(f) => PyFloat::new(py, f64::from(f)).into_any(),
        Value::F64(f) => PyFloat::new(py, f).into_any(),
        Value::Str(s) => match std::str::from_utf8(s) {
            Ok(s) => PyString::new(py, s).into_any(),
            Err(_) => return Err(PyValueError::new_err("a string that is not UTF-8")),
        },
        Value::Bin(b) => PyBytes::new(py, b).into_any(),
        Value::Ext(..) => {
            return Err(PyValueError::new_err(
                "a MessagePack extension value, which Greenstack never sends",
            ))
        }
        Value::Array(n) => {
            let list = PyList::empty(py);
            for _ in 0..n {
                list.append(read_value(py, r, depth + 1)?)?;
            }
            list.into_any()
        }
        Value::Map(n) => {
            let map = PyDict::new(py);
            for _ in 0..n {
                let k = read_value(py, r, depth + 1)?;
                let v = read_value(py, r, depth + 1)?;
                map.set_item(k, v)?;
            }
            map.into_any()
        }
    })
}

/// A frame's body (what follows its length field) as (opaque, opcode, flags, status or None,
/// {flex key: value}, payload dict). ValueError when it is not a Greenstack frame.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn greenstack_decode<'py>(
    py: Python<'py>,
    body: &[u8],
) -> PyResult<(
    u32,
    u16,
    u8,
    Option<u16>,
    Bound<'py, PyDict>,
    Bound<'py, PyDict>,
)> {
    let f = Frame::decode(body).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let flex = PyDict::new(py);
    for entry in f.flex_entries() {
        let entry = entry.map_err(|e| PyValueError::new_err(e.to_string()))?;
        flex.set_item(entry.key, PyBytes::new(py, entry.value))?;
    }
    let payload = if f.payload.is_empty() {
        PyDict::new(py)
    } else {
        let mut r = Reader::new(f.payload);
        let value = read_value(py, &mut r, 1)?;
        if !r.is_empty() {
            return Err(PyValueError::new_err(format!(
                "{} bytes after the payload",
                r.rest().len()
            )));
        }
        value.cast_into::<PyDict>().map_err(|v| {
            PyValueError::new_err(format!(
                "a payload that is not a map but {}",
                v.into_inner()
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?
    };
    Ok((f.opaque, f.opcode, f.flags, f.status, flex, payload))
}
