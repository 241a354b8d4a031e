//! The per-call check of a `RustBlock` made from a module: [`PyWatch`].

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyType};
use pyo3::PyTraverseError;

use super::errors::StaleBlock;

/// What a reading of a module looked at (`plusequals.twin.watch.Watch`), compared in one pass at
/// the start of every call that passes it, under the GIL: each noted value by identity in its
/// dict, each module's exact class, each dict's size, hook dicts empty, and torch's global hook
/// dicts holding the keys they held, and each watched list holding the items it held (PEFT's
/// `merged_adapters`, a list of active adapters). A change raises `StaleBlock` before anything else runs.
///
/// It holds the module's own objects (a RustBlock's watch holds the RustBlock), so it takes part
/// in Python's garbage collection (`__traverse__`, `__clear__`) like any container.
#[pyclass(name = "Watch", module = "plusequals._rust")]
pub(super) struct PyWatch {
    same: Vec<(Py<PyDict>, Py<PyAny>, Py<PyAny>)>,
    classes: Vec<(Py<PyAny>, Py<PyType>)>,
    sizes: Vec<(Py<PyDict>, usize)>,
    empty: Vec<Py<PyDict>>,
    keys: Vec<(Py<PyDict>, Vec<Py<PyAny>>)>,
    lists: Vec<(Py<PyList>, Vec<Py<PyAny>>)>,
}

#[pymethods]
impl PyWatch {
    #[new]
    #[pyo3(signature = (same, classes, sizes, empty, keys, lists=Vec::new()))]
    fn new(
        same: Vec<(Py<PyDict>, Py<PyAny>, Py<PyAny>)>,
        classes: Vec<(Py<PyAny>, Py<PyType>)>,
        sizes: Vec<(Py<PyDict>, usize)>,
        empty: Vec<Py<PyDict>>,
        keys: Vec<(Py<PyDict>, Vec<Py<PyAny>>)>,
        lists: Vec<(Py<PyList>, Vec<Py<PyAny>>)>,
    ) -> Self {
        PyWatch { same, classes, sizes, empty, keys, lists }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for (d, key, value) in &self.same {
            visit.call(d)?;
            visit.call(key)?;
            visit.call(value)?;
        }
        for (obj, cls) in &self.classes {
            visit.call(obj)?;
            visit.call(cls)?;
        }
        for (d, _) in &self.sizes {
            visit.call(d)?;
        }
        for d in &self.empty {
            visit.call(d)?;
        }
        for (d, keys) in &self.keys {
            visit.call(d)?;
            for key in keys {
                visit.call(key)?;
            }
        }
        for (l, items) in &self.lists {
            visit.call(l)?;
            for item in items {
                visit.call(item)?;
            }
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        (self.same, self.classes, self.sizes, self.empty, self.keys, self.lists) = Default::default();
    }

    /// Whether everything is as it was read (stops at the first difference). A cleared watch
    /// (collected with what it watched) holds nothing: it says changed.
    ///
    /// It runs on every call, so it works on the objects' addresses (no reference counts
    /// touched, no wrappers made): a dict lookup per noted value, a type pointer per module, a
    /// size per dict.
    fn unchanged(&self, py: Python<'_>) -> bool {
        if self.classes.is_empty() {
            return false;
        }
        use pyo3::ffi;
        // SAFETY: every pointer is a live object held by this watch; the GIL is held; the lookup's
        // result is borrowed and only compared by address.
        let found = |d: &Py<PyDict>, key: &Py<PyAny>| unsafe { ffi::PyDict_GetItemWithError(d.as_ptr(), key.as_ptr()) };
        let size = |d: &Py<PyDict>| unsafe { ffi::PyDict_Size(d.as_ptr()) };
        let type_of = |obj: &Py<PyAny>| unsafe { ffi::Py_TYPE(obj.as_ptr()) };
        for (d, key, value) in &self.same {
            if found(d, key) != value.as_ptr() {
                let _lookup_error = PyErr::take(py); // a key whose __eq__ raised: changed
                return false;
            }
        }
        self.classes.iter().all(|(obj, cls)| type_of(obj) == cls.as_ptr().cast())
            && self.sizes.iter().all(|(d, n)| usize::try_from(size(d)) == Ok(*n))
            && self.empty.iter().all(|d| size(d) == 0)
            && self.keys.iter().all(|(d, keys)| {
                usize::try_from(size(d)) == Ok(keys.len())
                    && (keys.is_empty() || d.bind(py).iter().zip(keys).all(|((now, _), was)| now.is(was)))
            })
            && self.lists.iter().all(|(l, items)| {
                let l = l.bind(py);
                l.len() == items.len() && l.iter().zip(items).all(|(now, was)| now.is(was))
            })
    }
}

/// Raises `StaleBlock` unless `watch` (when given) finds everything as it was read.
pub(super) fn check_watch(py: Python<'_>, watch: Option<&Bound<'_, PyWatch>>) -> PyResult<()> {
    match watch {
        Some(w) if !w.try_borrow()?.unchanged(py) => Err(StaleBlock::new_err("the module changed since it was read")),
        _ => Ok(()),
    }
}
