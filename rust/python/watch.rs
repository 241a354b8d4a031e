//! The per-call check of a `RustBlock` made from a module: [`PyWatch`].

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyList, PyType};
use pyo3::PyTraverseError;

use super::errors::StaleBlock;

/// What a reading of a module looked at (`plusequals.twin.watch.Watch`), compared in one pass at
/// the start of every call that passes it, under the GIL: each noted value by identity in its
/// dict, each module's exact class, each dict's size, hook dicts empty, and torch's global hook
/// dicts holding the keys they held, and each watched list holding the items it held (PEFT's
/// `merged_adapters`, a list of active adapters). A change raises `StaleBlock` before anything else runs.
///
/// Where CPython keeps a dict's version tag (PEP 509, CPython 3.11 to 3.13), the compare has a
/// shortcut: every dict's tag, one integer per dict, as it was at the last full compare that found
/// nothing changed. CPython gives a dict a new tag on every change of its contents, so equal tags
/// prove that every value, size and key noted in those dicts is as it was; a tag that moved only
/// runs the full compare (a value set to itself, a key removed and put back: not a change).
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
    /// Every dict above once, with its tag at the last full compare that passed (0: none yet).
    /// Empty where this Python has no version tags.
    tags: Vec<(Py<PyDict>, AtomicU64)>,
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
        py: Python<'_>,
    ) -> Self {
        let mut dicts: Vec<&Py<PyDict>> = same.iter().map(|(d, _, _)| d).collect();
        dicts.extend(sizes.iter().map(|(d, _)| d).chain(&empty).chain(keys.iter().map(|(d, _)| d)));
        dicts.sort_by_key(|d| d.as_ptr());
        dicts.dedup_by_key(|d| d.as_ptr());
        let tags = if version_tags(py) {
            dicts.into_iter().map(|d| (d.clone_ref(py), AtomicU64::new(0))).collect()
        } else {
            Vec::new()
        };
        PyWatch { same, classes, sizes, empty, keys, lists, tags }
    }

    /// How many dicts the version-tag shortcut covers (0 where this Python has no tags).
    #[getter]
    fn tagged(&self) -> usize {
        self.tags.len()
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
        for (d, _) in &self.tags {
            visit.call(d)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        (self.same, self.classes, self.sizes, self.empty, self.keys, self.lists) = Default::default();
        self.tags = Vec::new();
    }

    /// Whether everything is as it was read (stops at the first difference). A cleared watch
    /// (collected with what it watched) holds nothing: it says changed.
    ///
    /// It runs on every call, so it works on the objects' addresses (no reference counts
    /// touched, no wrappers made): a type pointer per module, the lists' items, and then either
    /// one version tag per dict, or (a tag moved, or no tags) the full compare: a dict lookup per
    /// noted value, a size per dict, the global hooks' keys.
    fn unchanged(&self, py: Python<'_>) -> bool {
        if self.classes.is_empty() {
            return false;
        }
        // SAFETY: every pointer is a live object held by this watch; the GIL is held.
        let type_of = |obj: &Py<PyAny>| unsafe { pyo3::ffi::Py_TYPE(obj.as_ptr()) };
        let same_classes = self.classes.iter().all(|(obj, cls)| type_of(obj) == cls.as_ptr().cast());
        let same_lists = self.lists.iter().all(|(l, items)| {
            let l = l.bind(py);
            l.len() == items.len() && l.iter().zip(items).all(|(now, was)| now.is(was))
        });
        if !(same_classes && same_lists) {
            return false;
        }
        if !self.tags.is_empty() && self.tags.iter().all(|(d, was)| tag(d) == was.load(Ordering::Relaxed)) {
            return true;
        }
        // Read before the compare: a change made while it runs (a key's __eq__ may run Python
        // code) leaves a newer tag, and the next call compares in full again.
        let now: Vec<u64> = self.tags.iter().map(|(d, _)| tag(d)).collect();
        let unchanged = self.contents_unchanged(py);
        if unchanged {
            self.tags.iter().zip(now).for_each(|((_, was), now)| was.store(now, Ordering::Relaxed));
        }
        unchanged
    }
}

impl PyWatch {
    /// The full compare of the dicts' contents: every noted value by identity, the sizes, the
    /// hook dicts empty, the global hooks' keys.
    fn contents_unchanged(&self, py: Python<'_>) -> bool {
        use pyo3::ffi;
        // SAFETY: every pointer is a live object held by this watch; the GIL is held; the lookup's
        // result is borrowed and only compared by address.
        let found = |d: &Py<PyDict>, key: &Py<PyAny>| unsafe { ffi::PyDict_GetItemWithError(d.as_ptr(), key.as_ptr()) };
        let size = |d: &Py<PyDict>| unsafe { ffi::PyDict_Size(d.as_ptr()) };
        for (d, key, value) in &self.same {
            if found(d, key) != value.as_ptr() {
                let _lookup_error = PyErr::take(py); // a key whose __eq__ raised: changed
                return false;
            }
        }
        self.sizes.iter().all(|(d, n)| usize::try_from(size(d)) == Ok(*n))
            && self.empty.iter().all(|d| size(d) == 0)
            && self.keys.iter().all(|(d, keys)| {
                usize::try_from(size(d)) == Ok(keys.len())
                    && (keys.is_empty() || d.bind(py).iter().zip(keys).all(|((now, _), was)| now.is(was)))
            })
    }
}

/// The head of CPython's `PyDictObject` from 3.11 to 3.13 (`Include/cpython/dictobject.h`,
/// default builds): the object header, `ma_used`, `ma_version_tag`.
#[repr(C)]
struct DictHead {
    ob_refcnt: isize,
    ob_type: *mut pyo3::ffi::PyTypeObject,
    ma_used: isize,
    ma_version_tag: u64,
}

/// `d`'s version tag (only called where [`version_tags`] said this Python keeps them there).
fn tag(d: &Py<PyDict>) -> u64 {
    // SAFETY: `d` is a live dict (an exact or sub-class instance: the head is the same), held by
    // the watch, read under the GIL; the layout is checked at run time by `version_tags`.
    unsafe { (*d.as_ptr().cast::<DictHead>()).ma_version_tag }
}

/// Whether this Python keeps a dict's version tag where [`DictHead`] says, and gives a dict a
/// new one on every change: CPython 3.11 to 3.13 (3.14 removed the tag), checked once by
/// changing a dict each way the watch relies on and reading `ma_used` against `len`.
fn version_tags(py: Python<'_>) -> bool {
    static WORKS: GILOnceCell<bool> = GILOnceCell::new();
    *WORKS.get_or_init(py, || {
        let version = py.version_info();
        ((3, 11)..(3, 14)).contains(&(version.major, version.minor)) && probe_tags(py).unwrap_or(false)
    })
}

fn probe_tags(py: Python<'_>) -> PyResult<bool> {
    let d = PyDict::new(py);
    let dict = d.clone().unbind();
    // SAFETY: as in `tag`; `ma_used` is only compared with `len`.
    let used = || unsafe { (*dict.as_ptr().cast::<DictHead>()).ma_used };
    let (key, other, one, two) = ("k", "other", py.None(), 2_i64.into_pyobject(py)?.into_any().unbind());
    let mut seen = vec![tag(&dict)];
    let changed = |seen: &mut Vec<u64>| {
        let now = tag(&dict);
        let moved = seen.iter().all(|t| *t != now) && used() == d.len() as isize;
        seen.push(now);
        moved
    };
    d.set_item(key, &one)?;
    let mut all = changed(&mut seen);
    d.set_item(key, &two)?;
    all &= changed(&mut seen);
    d.set_item(other, &one)?;
    all &= changed(&mut seen);
    d.del_item(key)?;
    all &= changed(&mut seen);
    let update = PyDict::new(py);
    update.set_item(key, &one)?;
    d.update(update.as_mapping())?;
    all &= changed(&mut seen);
    d.clear();
    all &= changed(&mut seen);
    Ok(all && seen[0] != 0)
}

/// Raises `StaleBlock` unless `watch` (when given) finds everything as it was read.
pub(super) fn check_watch(py: Python<'_>, watch: Option<&Bound<'_, PyWatch>>) -> PyResult<()> {
    match watch {
        Some(w) if !w.try_borrow()?.unchanged(py) => Err(StaleBlock::new_err("the module changed since it was read")),
        _ => Ok(()),
    }
}
