//! What engine calls return to Python: the outcome of a mutation and an item as read back.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use sluice_core::item::Item;

/// The result of a mutation (`sluice.Mutation` in Python; named apart from DCP's MUTATION).
#[pyclass(name = "Mutation", module = "sluice._native", frozen, get_all)]
pub(crate) struct MutationInfo {
    cas: u64,
    vbucket: u16,
    seqno: u64,
    lsn: u64,
}

#[pymethods]
impl MutationInfo {
    fn __repr__(&self) -> String {
        format!(
            "Mutation(cas={}, vbucket={}, seqno={}, lsn={})",
            self.cas, self.vbucket, self.seqno, self.lsn
        )
    }
}

/// A stored item as read back.
#[pyclass(module = "sluice._native", frozen, get_all)]
pub(crate) struct ItemView {
    key: Py<PyBytes>,
    value: Py<PyBytes>,
    flags: u32,
    expiry: u32,
    cas: u64,
    rev_seqno: u64,
    seqno: u64,
    datatype: u8,
    deleted: bool,
}

impl ItemView {
    pub(crate) fn from_item(py: Python<'_>, it: &Item) -> ItemView {
        ItemView {
            key: PyBytes::new(py, it.key()).unbind(),
            value: PyBytes::new(py, it.value()).unbind(),
            flags: it.meta.flags,
            expiry: it.meta.expiry,
            cas: it.meta.cas,
            rev_seqno: it.meta.rev_seqno,
            seqno: it.meta.by_seqno,
            datatype: it.meta.datatype & sluice_core::item::DATATYPE_CLIENT_BITS,
            deleted: it.meta.deleted,
        }
    }
}

#[pymethods]
impl ItemView {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ItemView(key={:?}, seqno={}, cas={}, deleted={})",
            self.key.bind(py),
            self.seqno,
            self.cas,
            self.deleted
        )
    }
}

pub(crate) fn mutation(r: sluice_core::MutationResult) -> MutationInfo {
    MutationInfo {
        cas: r.cas,
        vbucket: r.vbucket,
        seqno: r.seqno,
        lsn: r.lsn,
    }
}
