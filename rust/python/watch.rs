//! The per-call check of a `RustBlock` made from a module: [`PyWatch`].

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyList, PyType};
use pyo3::PyTraverseError;

use super::errors::STALE_BLOCK;

/// A function's state read through `getattr` ([`state_of`]): None is an empty cell.
type State = Vec<Option<Py<PyAny>>>;

/// (object, attribute, what it holds): a field the watch compares ([`field_address`]).
type Holder<'py> = (Bound<'py, PyAny>, String, Bound<'py, PyAny>);

/// What a reading of a module looked at (`plusequals.twin.watch.Watch`), compared in one pass at
/// the start of every call that passes it, under the GIL: each noted value by identity in its
/// dict, each module's exact class, each dict's size, hook dicts empty, and torch's global hook
/// dicts holding the keys they held, and each watched list holding the items it held (PEFT's
/// `merged_adapters`, a list of active adapters), and each Python function the forward's code runs
/// holding the code, defaults and closure-cell contents it held (a function changed in place:
/// `f.__code__ = ...`, `f.__defaults__ = ...`, a cell's `cell_contents` set), each noted class
/// that Python code can change keeping the MRO it had (a `__bases__` reassigned on it or on any of
/// its bases gives it a new `__mro__` tuple), and each holder holding what it held (an instance its
/// `__dict__`, a `functools.partial` its `func`, `args` and `keywords`). A change raises
/// `StaleBlock` before anything else runs.
///
/// Where CPython keeps a dict's version tag (PEP 509, CPython 3.11 to 3.13), the compare has a
/// shortcut: every dict's tag, one integer per dict, as it was at the last full compare that found
/// nothing changed. CPython gives a dict a new tag on every change of its contents, so equal tags
/// prove that every value, size and key noted in those dicts is as it was; a tag that moved only
/// runs the full compare (a value set to itself, a key removed and put back: not a change). A
/// function's state is in no dict: its fields are compared on every call, each a pointer read at an
/// address held since the reading ([`FunctionHead`], checked at run time; through `getattr` where this
/// Python's layout is another). So are a class's MRO (its `tp_mro` field, [`mro_offset`]) and a
/// holder's field ([`field_address`]).
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
    /// Each watched function's settable fields and its cells' contents, and each holder's field
    /// (a heap class's `tp_mro`, an instance's dict, a partial's fields), in place: (the field's
    /// address, the object it held at the reading), compared on every call.
    slots: Vec<(usize, usize)>,
    /// How many of `slots` are functions' (the rest are classes' MROs, instances' dicts and
    /// partials' fields).
    function_slots: usize,
    /// The functions, cells and classes those addresses lie in, and the objects they held: kept
    /// alive, so that no address is reused while watched.
    held: Vec<Py<PyAny>>,
    /// Where an object's layout is unknown: (object, attribute, what it held), compared through
    /// `getattr` (a class's `__mro__`, an instance's `__dict__`, a `functools.partial`'s `func`,
    /// `args`, `keywords`).
    attrs: Vec<(Py<PyAny>, String, Py<PyAny>)>,
    /// Where the layout is not [`FunctionHead`]'s: each function and its state read through
    /// `getattr` ([`state_of`]), compared the same way, more slowly.
    read: Vec<(Py<PyAny>, State)>,
    /// Every dict above once, with its tag at the last full compare that passed (0: none yet).
    /// Empty where this Python has no version tags.
    tags: Vec<(Py<PyDict>, AtomicU64)>,
}

#[pymethods]
impl PyWatch {
    #[new]
    /// `functions`: Python functions watched in place; `holders`: (object, attribute, what it
    /// holds) for an instance's `__dict__` and a `functools.partial`'s `func`, `args` and
    /// `keywords`, watched in place; `direct=False` reads them through `getattr` even where the
    /// layout is known (for the tests).
    #[pyo3(signature = (same, classes, sizes, empty, keys, lists=Vec::new(), functions=Vec::new(), holders=Vec::new(), direct=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        same: Vec<(Py<PyDict>, Py<PyAny>, Py<PyAny>)>,
        classes: Vec<(Py<PyAny>, Py<PyType>)>,
        sizes: Vec<(Py<PyDict>, usize)>,
        empty: Vec<Py<PyDict>>,
        keys: Vec<(Py<PyDict>, Vec<Py<PyAny>>)>,
        lists: Vec<(Py<PyList>, Vec<Py<PyAny>>)>,
        functions: Vec<Bound<'_, PyAny>>,
        holders: Vec<Holder<'_>>,
        direct: bool,
        py: Python<'_>,
    ) -> PyResult<Self> {
        let mut dicts: Vec<&Py<PyDict>> = same.iter().map(|(d, _, _)| d).collect();
        dicts.extend(sizes.iter().map(|(d, _)| d).chain(&empty).chain(keys.iter().map(|(d, _)| d)));
        dicts.sort_by_key(|d| d.as_ptr());
        dicts.dedup_by_key(|d| d.as_ptr());
        let tags = if version_tags(py) {
            dicts.into_iter().map(|d| (d.clone_ref(py), AtomicU64::new(0))).collect()
        } else {
            Vec::new()
        };
        let (mut slots, mut held, mut read) = (Vec::new(), Vec::new(), Vec::new());
        let layout = if direct { function_type(py) } else { None };
        for f in functions {
            match layout {
                Some(t) if f.get_type().is(t) => in_place(&f, &mut slots, &mut held)?,
                _ => read.push((f.clone().unbind(), state_of(&f)?)),
            }
        }
        let function_slots = slots.len();
        let mut attrs = Vec::new();
        for (obj, name, value) in mro_holders(py, &classes)?.into_iter().chain(holders) {
            match field_address(&obj, &name, &value).filter(|_| direct) {
                // SAFETY: a pointer field of `obj` (checked to hold `value`), held below.
                Some(at) => unsafe { hold_slot(py, at, &mut slots, &mut held) },
                None => attrs.push((obj.clone().unbind(), name, value.unbind())),
            }
            held.push(obj.unbind());
        }
        slots.sort_unstable(); // in address order: the per-call reads walk memory one way
        Ok(PyWatch { same, classes, sizes, empty, keys, lists, slots, function_slots, held, attrs, read, tags })
    }

    /// How many function fields and cells are compared in place, and how many functions through
    /// `getattr`.
    #[getter]
    fn functions(&self) -> (usize, usize) {
        (self.function_slots, self.read.len())
    }

    /// How many other fields (classes' MROs, instances' dicts, partials' fields) are compared in
    /// place, and how many through `getattr`.
    #[getter]
    fn fields(&self) -> (usize, usize) {
        (self.slots.len() - self.function_slots, self.attrs.len())
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
        for obj in &self.held {
            visit.call(obj)?;
        }
        for (f, state) in &self.read {
            visit.call(f)?;
            for value in state.iter().flatten() {
                visit.call(value)?;
            }
        }
        for (obj, _, value) in &self.attrs {
            visit.call(obj)?;
            visit.call(value)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        (self.same, self.classes, self.sizes, self.empty, self.keys, self.lists) = Default::default();
        self.slots = Vec::new(); // before what they point into
        (self.held, self.read, self.attrs, self.tags) = Default::default();
    }

    /// Whether everything is as it was read (stops at the first difference). A cleared watch
    /// (collected with what it watched) holds nothing: it says changed.
    ///
    /// It runs on every call, so it works on the objects' addresses (no reference counts
    /// touched, no wrappers made): a type pointer per module, a pointer per function field and
    /// cell, the lists' items, and then either one version tag per dict, or (a tag moved, or no
    /// tags) the full compare: a dict lookup per noted value, a size per dict, the global hooks' keys.
    fn unchanged(&self, py: Python<'_>) -> bool {
        if self.classes.is_empty() {
            return false;
        }
        // SAFETY: every pointer is a live object held by this watch; the GIL is held; each slot's
        // address is a pointer field of a function or cell held in `held` (see `in_place`).
        let type_of = |obj: &Py<PyAny>| unsafe { pyo3::ffi::Py_TYPE(obj.as_ptr()) };
        let same_classes = self.classes.iter().all(|(obj, cls)| type_of(obj) == cls.as_ptr().cast());
        // Branch-free: every slot is read whatever the others hold (no early exit to predict).
        let moved = self.slots.iter().fold(0, |acc, &(at, was)| acc | (unsafe { *(at as *const usize) } ^ was));
        let same_functions = moved == 0
            && self.read.iter().all(|(f, was)| same_state(f.bind(py), was))
            && self
                .attrs
                .iter()
                .all(|(obj, name, was)| obj.bind(py).getattr(name.as_str()).is_ok_and(|now| now.is(was)));
        let same_lists = self.lists.iter().all(|(l, items)| {
            let l = l.bind(py);
            l.len() == items.len() && l.iter().zip(items).all(|(now, was)| now.is(was))
        });
        if !(same_classes && same_functions && same_lists) {
            return false;
        }
        let tags_moved = self.tags.iter().fold(0, |acc, (d, was)| acc | (tag(d) ^ was.load(Ordering::Relaxed)));
        if !self.tags.is_empty() && tags_moved == 0 {
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

/// The head of CPython's `PyFunctionObject` from 3.11 to 3.14 (`Include/cpython/funcobject.h`,
/// default builds): the object header and `COMMON_FIELDS(func_)`.
#[repr(C)]
struct FunctionHead {
    ob_refcnt: isize,
    ob_type: *mut pyo3::ffi::PyTypeObject,
    globals: *mut pyo3::ffi::PyObject,
    builtins: *mut pyo3::ffi::PyObject,
    name: *mut pyo3::ffi::PyObject,
    qualname: *mut pyo3::ffi::PyObject,
    code: *mut pyo3::ffi::PyObject,
    defaults: *mut pyo3::ffi::PyObject,
    kwdefaults: *mut pyo3::ffi::PyObject,
    closure: *mut pyo3::ffi::PyObject,
}

/// CPython's `PyCellObject`: the object header and the contents (NULL: empty).
#[repr(C)]
struct CellHead {
    ob_refcnt: isize,
    ob_type: *mut pyo3::ffi::PyTypeObject,
    contents: *mut pyo3::ffi::PyObject,
}

/// Adds the pointer field at `at` to `slots`, with what it holds now, held in `held` (NULL: none).
///
/// # Safety
/// `at` is a pointer field of a live object that `held` holds (or will hold) while `slots` is read.
unsafe fn hold_slot(
    py: Python<'_>,
    at: *const *mut pyo3::ffi::PyObject,
    slots: &mut Vec<(usize, usize)>,
    held: &mut Vec<Py<PyAny>>,
) {
    // SAFETY: the caller's: `at` is a pointer field of a live object, read under the GIL.
    let was = unsafe { *at };
    if !was.is_null() {
        // SAFETY: a live object the field holds a reference to; we take one of our own.
        held.push(unsafe { Py::from_borrowed_ptr(py, was) });
    }
    slots.push((at as usize, was as usize));
}

/// Each heap class of `classes` once, as a holder of its `__mro__` (a static type's bases cannot
/// be reassigned).
fn mro_holders<'py>(py: Python<'py>, classes: &[(Py<PyAny>, Py<PyType>)]) -> PyResult<Vec<Holder<'py>>> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (_, cls) in classes {
        let cls = cls.bind(py);
        // SAFETY: a live type object, under the GIL.
        let heap = unsafe { pyo3::ffi::PyType_GetFlags(cls.as_ptr().cast()) } & pyo3::ffi::Py_TPFLAGS_HEAPTYPE != 0;
        if heap && seen.insert(cls.as_ptr()) {
            out.push((cls.clone().into_any(), "__mro__".to_owned(), cls.getattr("__mro__")?));
        }
    }
    Ok(out)
}

/// Whether this Python's layouts were checked (CPython 3.11 to 3.14): the probes below run only there.
fn layouts_known(py: Python<'_>) -> bool {
    let version = py.version_info();
    ((3, 11)..(3, 15)).contains(&(version.major, version.minor))
}

/// Where a type object keeps its `tp_mro` on this Python (a byte offset), found once on classes
/// made here: the one pointer field of a heap type that is its `__mro__`, and is its new
/// `__mro__` after its `__bases__` is reassigned. None where no such field is found, or on a
/// Python whose layout was not checked.
fn mro_offset(py: Python<'_>) -> Option<usize> {
    static OFFSET: GILOnceCell<Option<usize>> = GILOnceCell::new();
    *OFFSET.get_or_init(py, || layouts_known(py).then(|| probe_mro_offset(py).ok().flatten()).flatten())
}

fn probe_mro_offset(py: Python<'_>) -> PyResult<Option<usize>> {
    let globals = PyDict::new(py);
    py.run(c"class A: pass\nclass B: pass\nclass C(A): pass\n", Some(&globals), None)?;
    let (Some(b), Some(c)) = (globals.get_item("B")?, globals.get_item("C")?) else {
        return Ok(None);
    };
    let word = words_of(&c)?; // a heap type: CPython's PyHeapTypeObject
    let before = c.getattr("__mro__")?; // held: its address cannot be reused by the new one
    let Some(i) = the_word_holding(&word, &before) else {
        return Ok(None);
    };
    c.setattr("__bases__", (b,))?;
    let after = c.getattr("__mro__")?;
    let moved = !after.is(&before) && word(i) == Some(after.as_ptr() as usize);
    Ok(moved.then_some(i * size_of::<usize>()))
}

/// The address of the pointer field through which `obj.<name>` is `value`, where this Python's
/// layout is known and the field holds `value` now: a class's `__mro__` ([`mro_offset`]), an
/// instance's `__dict__` (a managed dict's pointer three words before the object on 3.11 to 3.14,
/// else at its type's `__dictoffset__`), a `functools.partial`'s `func`, `args` or `keywords`
/// ([`partial_layout`]). None elsewhere.
fn field_address(
    obj: &Bound<'_, PyAny>,
    name: &str,
    value: &Bound<'_, PyAny>,
) -> Option<*const *mut pyo3::ffi::PyObject> {
    let py = obj.py();
    let base = obj.as_ptr().cast::<u8>();
    let offset: isize = match name {
        "__mro__" if obj.is_instance_of::<PyType>() => mro_offset(py)? as isize,
        "__dict__" => {
            const MANAGED_DICT: std::ffi::c_ulong = 1 << 4; // Py_TPFLAGS_MANAGED_DICT (3.11+)

            // SAFETY: a live type object, under the GIL.
            let flags = unsafe { pyo3::ffi::PyType_GetFlags(obj.get_type().as_ptr().cast()) };
            if flags & MANAGED_DICT != 0 {
                layouts_known(py).then_some(-3 * size_of::<usize>() as isize)?
            } else {
                obj.get_type().getattr("__dictoffset__").ok()?.extract::<isize>().ok().filter(|&o| o > 0)?
            }
        }
        "func" | "args" | "keywords" => {
            let (partial, offsets) = partial_layout(py)?;
            if !obj.get_type().is(partial.bind(py)) {
                return None;
            }
            let index = ["func", "args", "keywords"].iter().position(|n| *n == name)?;
            offsets[index] as isize
        }
        _ => return None,
    };
    // SAFETY: a managed dict's pointer lies in the object's pre-header (its type's flag says it
    // has one), the others inside the object (its type's own offsets); read under the GIL.
    let at = unsafe { base.offset(offset) }.cast::<*mut pyo3::ffi::PyObject>();
    // SAFETY: as above.
    (unsafe { *at } == value.as_ptr()).then_some(at)
}

/// `obj`'s pointer-sized words, by index, as numbers (None past its type's `__basicsize__`): what
/// the layout probes compare with addresses.
fn words_of<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<impl Fn(usize) -> Option<usize> + 'a> {
    let n = obj.get_type().getattr("__basicsize__")?.extract::<usize>()? / size_of::<usize>();
    let base = obj.as_ptr().cast::<usize>();
    // SAFETY: a word inside `obj` (i < n, its type's basic size), alive while borrowed, read under
    // the GIL; only compared with addresses.
    Ok(move |i: usize| (i < n).then(|| unsafe { *base.add(i) }))
}

/// The index of the one word past the object header that holds `value`'s address, if exactly one does.
fn the_word_holding(word: &impl Fn(usize) -> Option<usize>, value: &Bound<'_, PyAny>) -> Option<usize> {
    let mut hits = (2..).map_while(|i| word(i).map(|w| (i, w))).filter(|&(_, w)| w == value.as_ptr() as usize);
    let (i, _) = hits.next()?;
    hits.next().is_none().then_some(i)
}

/// `functools.partial` and where it keeps `func`, `args` and `keywords` (byte offsets), found once
/// on a partial made here: the one word of each that is its value, and is the new one after
/// `__setstate__`. None where not found, or on a Python whose layout was not checked.
fn partial_layout(py: Python<'_>) -> Option<&(Py<PyType>, [usize; 3])> {
    static LAYOUT: GILOnceCell<Option<(Py<PyType>, [usize; 3])>> = GILOnceCell::new();
    LAYOUT.get_or_init(py, || layouts_known(py).then(|| probe_partial_layout(py).ok().flatten()).flatten()).as_ref()
}

fn probe_partial_layout(py: Python<'_>) -> PyResult<Option<(Py<PyType>, [usize; 3])>> {
    let globals = PyDict::new(py);
    let code = c"import functools\np = functools.partial(len, [1], a=2)\nq = (max, (3, 4), {'b': 5}, None)\n";
    py.run(code, Some(&globals), None)?;
    let (Some(p), Some(q)) = (globals.get_item("p")?, globals.get_item("q")?) else {
        return Ok(None);
    };
    let partial = py.import("functools")?.getattr("partial")?.downcast_into::<PyType>()?;
    if !p.get_type().is(&partial) {
        return Ok(None); // the Python implementation: no fields of its own
    }
    let word = words_of(&p)?;
    let names = ["func", "args", "keywords"];
    let before: Vec<Bound<'_, PyAny>> = names.iter().map(|n| p.getattr(*n)).collect::<PyResult<_>>()?; // held
    let mut found = [0usize; 3];
    for (slot, value) in found.iter_mut().zip(&before) {
        let Some(i) = the_word_holding(&word, value) else {
            return Ok(None);
        };
        *slot = i;
    }
    p.call_method1("__setstate__", (q,))?;
    for (&i, name) in found.iter().zip(names) {
        if word(i) != Some(p.getattr(name)?.as_ptr() as usize) {
            return Ok(None);
        }
    }
    Ok(Some((partial.unbind(), found.map(|i| i * size_of::<usize>()))))
}

/// Adds `f`'s settable fields (`__code__`, `__defaults__`, `__kwdefaults__`) and its cells'
/// contents to `slots`, holding `f`, its cells and what each held in `held` (only called with a
/// function of [`function_type`]'s, whose layout was checked).
fn in_place(f: &Bound<'_, PyAny>, slots: &mut Vec<(usize, usize)>, held: &mut Vec<Py<PyAny>>) -> PyResult<()> {
    let py = f.py();
    // SAFETY: `at` is a pointer field of a live function or cell (held below), read under the GIL.
    let mut slot =
        |at: *const *mut pyo3::ffi::PyObject, held: &mut Vec<Py<PyAny>>| unsafe { hold_slot(py, at, slots, held) };
    let head = f.as_ptr().cast::<FunctionHead>();
    // SAFETY: `f` is a function (checked by the caller), whose layout `function_type` checked.
    unsafe {
        slot(std::ptr::addr_of!((*head).code), held);
        slot(std::ptr::addr_of!((*head).defaults), held);
        slot(std::ptr::addr_of!((*head).kwdefaults), held);
    }
    let closure = f.getattr("__closure__")?;
    if !closure.is_none() {
        for cell in closure.try_iter()? {
            let cell = cell?;
            // SAFETY: a cell of the closure (a tuple of cells, read-only on the function).
            slot(unsafe { std::ptr::addr_of!((*cell.as_ptr().cast::<CellHead>()).contents) }, held);
            held.push(cell.unbind());
        }
    }
    held.push(f.clone().unbind());
    Ok(())
}

/// `f`'s state through `getattr`: `__code__`, `__defaults__`, `__kwdefaults__`, then each closure
/// cell's contents (None: empty).
fn state_of(f: &Bound<'_, PyAny>) -> PyResult<State> {
    let mut state = Vec::new();
    for name in ["__code__", "__defaults__", "__kwdefaults__"] {
        state.push(Some(f.getattr(name)?.unbind()));
    }
    let closure = f.getattr("__closure__")?;
    if !closure.is_none() {
        for cell in closure.try_iter()? {
            state.push(cell?.getattr("cell_contents").ok().map(Bound::unbind));
        }
    }
    Ok(state)
}

/// Whether `f`'s state is `was`, object for object (an error reading it: changed).
fn same_state(f: &Bound<'_, PyAny>, was: &[Option<Py<PyAny>>]) -> bool {
    let same = |now: &Option<Py<PyAny>>, was: &Option<Py<PyAny>>| match (now, was) {
        (Some(a), Some(b)) => a.is(b),
        (None, None) => true,
        _ => false,
    };
    match state_of(f) {
        Ok(now) => now.len() == was.len() && now.iter().zip(was).all(|(a, b)| same(a, b)),
        Err(e) => {
            drop(e);
            false
        }
    }
}

/// The type of Python functions, where this Python lays them out as [`FunctionHead`] and cells as
/// [`CellHead`] (checked once, on a function made here, by reading each field against `getattr`
/// and again after setting each one); None elsewhere.
fn function_type(py: Python<'_>) -> Option<&Bound<'_, PyType>> {
    static LAYOUT: GILOnceCell<Option<Py<PyType>>> = GILOnceCell::new();
    LAYOUT
        .get_or_init(py, || layouts_known(py).then(|| probe_function_layout(py).ok().flatten()).flatten())
        .as_ref()
        .map(|t| t.bind(py))
}

fn probe_function_layout(py: Python<'_>) -> PyResult<Option<Py<PyType>>> {
    let globals = PyDict::new(py);
    let code = c"def outer(y):\n    x = object()\n\n    def f(a=1, *, b=2):\n        return x, y\n\n    def g():\n        return y, x\n\n    return f, g\n\n\nf, g = outer(1)\n";
    py.run(code, Some(&globals), None)?;
    let (Some(f), Some(g)) = (globals.get_item("f")?, globals.get_item("g")?) else {
        return Ok(None);
    };
    let head = f.as_ptr().cast::<FunctionHead>();
    let cell = f.getattr("__closure__")?.get_item(0)?;
    let contents = cell.as_ptr().cast::<CellHead>();
    // SAFETY: `f` is a live function and `cell` a live cell, read under the GIL; each field is only
    // compared by address with what `getattr` returns.
    let fields = || unsafe {
        [(*head).globals, (*head).name, (*head).qualname, (*head).code, (*head).defaults, (*head).kwdefaults]
    };
    let attr = |name: &str| f.getattr(name).map(|v| v.as_ptr());
    let expected = || -> PyResult<[*mut pyo3::ffi::PyObject; 6]> {
        Ok([
            attr("__globals__")?,
            attr("__name__")?,
            attr("__qualname__")?,
            attr("__code__")?,
            attr("__defaults__")?,
            attr("__kwdefaults__")?,
        ])
    };
    let closure = f.getattr("__closure__")?;
    // SAFETY: as above.
    let mut ok = fields() == expected()?
        && unsafe { (*head).closure } == closure.as_ptr()
        && unsafe { (*contents).contents } == cell.getattr("cell_contents")?.as_ptr();
    // Each settable field moves where read: set to another value, and to None (NULL).
    f.setattr("__code__", g.getattr("__code__")?)?;
    f.setattr("__defaults__", (2,))?;
    f.setattr("__kwdefaults__", PyDict::new(py))?;
    cell.setattr("cell_contents", 5)?;
    ok &= fields() == expected()? && unsafe { (*contents).contents } == cell.getattr("cell_contents")?.as_ptr();
    f.setattr("__defaults__", py.None())?;
    f.setattr("__kwdefaults__", py.None())?;
    cell.delattr("cell_contents")?;
    // SAFETY: as above.
    ok &= unsafe { (*head).defaults.is_null() && (*head).kwdefaults.is_null() && (*contents).contents.is_null() };
    Ok(ok.then(|| f.get_type().unbind()))
}

/// Raises `StaleBlock` unless `watch` (when given) finds everything as it was read.
pub(super) fn check_watch(py: Python<'_>, watch: Option<&Bound<'_, PyWatch>>) -> PyResult<()> {
    match watch {
        Some(w) if !w.try_borrow()?.unchanged(py) => {
            Err(STALE_BLOCK.err(py, ("the module changed since it was read",)))
        }
        _ => Ok(()),
    }
}
