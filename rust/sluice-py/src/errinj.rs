//! The fault injection points (`sluice_core::errinj`) for tests and `sluice serve`'s
//! `SLUICE_ERRINJ`: one table per process.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Sets the injection point `name` to `value` (0: off). ValueError names the points there are.
#[pyfunction]
pub(crate) fn errinj_set(name: &str, value: i64) -> PyResult<()> {
    sluice_core::errinj::set(name, value).map_err(PyValueError::new_err)
}

/// Sets the points `spec` names (`NAME=VALUE,...`, as `SLUICE_ERRINJ` holds them) and lets the
/// admin endpoint's `POST /errinj` change them from now on.
#[pyfunction]
pub(crate) fn errinj_enable(spec: &str) -> PyResult<()> {
    sluice_core::errinj::set_all(spec).map_err(PyValueError::new_err)?;
    sluice_core::errinj::enable();
    Ok(())
}

/// Every injection point and its value now.
#[pyfunction]
pub(crate) fn errinj_values() -> std::collections::BTreeMap<&'static str, i64> {
    sluice_core::errinj::values().into_iter().collect()
}
