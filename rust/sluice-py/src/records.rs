//! Rows handed to Python as tuples, plain or of a NamedTuple type (`sluice.tank.Message`,
//! `sluice.Change`), made here and left out of Python's cyclic garbage collector. Such rows
//! hold ints, strs, bytes and None, which make no cycles (CPython untracks plain tuples of
//! atoms itself, but only once a collection has walked them). A batch of 10,000 tracked rows
//! starts about 15 collections that walk them: consuming 1M TANK messages, two thirds of the
//! client's time went to the collector, and most of the rest to the NamedTuple's Python
//! `__new__`, which a row made here does not run.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyTuple, PyType};

/// What rows are made as: plain tuples, or a tuple subclass without `__dict__` or
/// `__weakref__` (a NamedTuple).
pub(crate) struct RecordType<'py> {
    py: Python<'py>,
    ty: Option<Bound<'py, PyType>>,
}

impl<'py> RecordType<'py> {
    /// `ty` None: plain tuples.
    pub(crate) fn new(
        py: Python<'py>,
        ty: Option<Bound<'py, PyType>>,
    ) -> PyResult<RecordType<'py>> {
        if let Some(t) = &ty {
            let plain_tuple = t.is_subclass_of::<PyTuple>()?
                && t.getattr("__dictoffset__")?.extract::<isize>()? == 0
                && t.getattr("__weakrefoffset__")?.extract::<isize>()? == 0;
            if !plain_tuple {
                return Err(PyTypeError::new_err(
                    "a row type must be a tuple subclass without __dict__ or __weakref__",
                ));
            }
        }
        Ok(RecordType { py, ty })
    }

    /// A row of `items`, untracked.
    pub(crate) fn make<const N: usize>(
        &self,
        items: [Bound<'py, PyAny>; N],
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        // SAFETY: a plain tuple comes from PyTuple_New; a subclass's from its allocator, as
        // `tuple.__new__` makes one (checked in `new` to be a tuple subclass with no other
        // slots). Either has N empty items, each set once here while this is the only
        // reference. Its items cannot refer back to it, so untracking it is what CPython does
        // for tuples of atoms; dealloc untracks with the checked call, so it frees as usual.
        unsafe {
            let obj = match &self.ty {
                None => pyo3::ffi::PyTuple_New(N as isize),
                Some(t) => pyo3::ffi::PyType_GenericAlloc(t.as_type_ptr(), N as isize),
            };
            if obj.is_null() {
                return Err(PyErr::fetch(py));
            }
            let obj = Bound::from_owned_ptr(py, obj);
            for (i, item) in items.into_iter().enumerate() {
                if pyo3::ffi::PyTuple_SetItem(obj.as_ptr(), i as isize, item.into_ptr()) != 0 {
                    return Err(PyErr::fetch(py));
                }
            }
            pyo3::ffi::PyObject_GC_UnTrack(obj.as_ptr().cast());
            Ok(obj)
        }
    }
}
