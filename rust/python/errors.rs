//! The Python exception classes, made once here and re-exported by the package
//! (`plusequals.errors`), and the mapping of each [`Error`] to one of them.
//!
//! Tests and callers match on the class and its fields, not on the message. A class with fields
//! (`OwnershipError`, `UseAfterDonation`) takes them in its constructor after the message, keeps
//! them in `args` (so `pickle` and `copy` rebuild it by calling the class again, as for any
//! exception), and reads them back through read-only properties; `str()` is the message.
//!
//! The classes are made by [`PyErr::new_type`] with their namespace, not as
//! `#[pyclass(extends = PyValueError)]`: PyO3 cannot subclass a native type under `abi3`, which
//! the wheel is built for (one `.so` for CPython 3.11 and up).

use std::ffi::CStr;

use pyo3::call::PyCallArgs;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyCFunction, PyDict, PyString, PyTuple, PyType};

use crate::error::{Alias, Error};

/// One exception class: made on first use (the module's import), then the same class for good.
pub(super) struct Class {
    made: GILOnceCell<Py<PyType>>,
    /// `plusequals.Name`: the class is importable from the package under that name (pickle).
    name: &'static CStr,
    doc: &'static CStr,
    base: Base,
    /// Its constructor's arguments after the message, each read back by a property of that
    /// name: (name, doc). Empty: the base's constructor, and `args == (message,)`.
    fields: &'static [(&'static str, &'static str)],
    /// The constructor (`__init__`) of a class with fields: stores `(message, *fields)` as `args`.
    init: Option<MakeInit>,
}

/// Makes the builtin function a class's `__init__` wraps.
type MakeInit = fn(Python<'_>) -> PyResult<Bound<'_, PyCFunction>>;

enum Base {
    Value,
    Runtime,
    Class(&'static Class),
}

pub(super) static OWNERSHIP_ERROR: Class = Class {
    made: GILOnceCell::new(),
    name: c"plusequals.OwnershipError",
    doc: c"A tensor an in-place entry point would write into, or read while writing, is not the caller's \
           alone: nothing was written. OwnershipError(message, arg, why, count=None, modes=()).",
    base: Base::Value,
    fields: &[
        ("arg", "The argument refused: \"x\" or \"context\"."),
        (
            "why",
            "The kind of second name (\"other_handles\", \"weak_refs\", \"view\", \"dispatch_modes\", ...: \
             rust/error.rs, Alias).",
        ),
        ("count", "How many other handles, weak references or tensors on the storage (None for other kinds)."),
        ("modes", "The active dispatch modes' names (for \"dispatch_modes\"; empty otherwise)."),
    ],
    init: Some(|py| wrap_pyfunction!(ownership_error_init, py)),
};

pub(super) static UNSUPPORTED_BLOCK_ERROR: Class = Class {
    made: GILOnceCell::new(),
    name: c"plusequals.UnsupportedBlockError",
    doc: c"A block, or a call, that the Rust block cannot reproduce exactly (plusequals.twin.faithful).",
    base: Base::Value,
    fields: &[],
    init: None,
};

pub(super) static WEIGHTS_CHANGED: Class = Class {
    made: GILOnceCell::new(),
    name: c"plusequals.WeightsChanged",
    doc: c"A weight was written in place while a forward read it (another thread): the result is discarded.",
    base: Base::Runtime,
    fields: &[],
    init: None,
};

pub(super) static DONATION_CONSUMED: Class = Class {
    made: GILOnceCell::new(),
    name: c"plusequals.DonationConsumed",
    doc: c"A donation failed after its first write into x: x is marked donated, its buffer consumed, the \
           result discarded. The cause is in the message.",
    base: Base::Runtime,
    fields: &[],
    init: None,
};

pub(super) static USE_AFTER_DONATION: Class = Class {
    made: GILOnceCell::new(),
    name: c"plusequals.UseAfterDonation",
    doc: c"A tensor given to forward_owned(..., donate=True) was used afterwards (rustc's E0382, at run \
           time). UseAfterDonation(message, op).",
    base: Base::Class(&DONATION_CONSUMED),
    fields: &[("op", "The operation that used the donated tensor (\"sum\", \"shape (get)\").")],
    init: Some(|py| wrap_pyfunction!(use_after_donation_init, py)),
};

pub(super) static STALE_BLOCK: Class = Class {
    made: GILOnceCell::new(),
    name: c"plusequals.StaleBlock",
    doc: c"The block is no longer what it was built on: its module changed since it was read (the watch), \
           or a weight's shape, dtype or device changed in place. RustBlock reads the module again and \
           rebuilds.",
    base: Base::Value,
    fields: &[],
    init: None,
};

/// Every class, in the order the module adds them.
pub(super) static CLASSES: [&Class; 6] = [
    &OWNERSHIP_ERROR,
    &UNSUPPORTED_BLOCK_ERROR,
    &WEIGHTS_CHANGED,
    &DONATION_CONSUMED,
    &USE_AFTER_DONATION,
    &STALE_BLOCK,
];

impl Class {
    /// The class, made on the first call.
    pub(super) fn get<'py>(&'static self, py: Python<'py>) -> PyResult<Bound<'py, PyType>> {
        self.made.get_or_try_init(py, || self.make(py)).map(|class| class.bind(py).clone())
    }

    /// The name it has in the package (`OwnershipError`).
    pub(super) fn short_name(&self) -> &'static str {
        let name = self.name.to_str().unwrap_or_default();
        name.rsplit('.').next().unwrap_or(name)
    }

    /// The exception `Class(*args)` (the message first, then the fields), to raise; an error
    /// making it (the class, a field's conversion) is raised instead.
    pub(super) fn err<'py>(&'static self, py: Python<'py>, args: impl PyCallArgs<'py>) -> PyErr {
        match self.get(py).and_then(|class| class.call1(args)) {
            Ok(value) => PyErr::from_value(value),
            Err(e) => e,
        }
    }

    fn make(&'static self, py: Python<'_>) -> PyResult<Py<PyType>> {
        let base = match self.base {
            Base::Value => py.get_type::<PyValueError>(),
            Base::Runtime => py.get_type::<PyRuntimeError>(),
            Base::Class(class) => class.get(py)?,
        };
        let namespace = PyDict::new(py);
        if let Some(init) = self.init {
            // A builtin function does not bind to the instance, as a Python function does:
            // functools.partialmethod makes it a method.
            let method = py.import("functools")?.getattr("partialmethod")?;
            namespace.set_item("__init__", method.call1((init(py)?,))?)?;
            namespace.set_item("__str__", method.call1((wrap_pyfunction!(message, py)?,))?)?;
        }
        let property = py.import("builtins")?.getattr("property")?;
        for (i, (name, doc)) in self.fields.iter().enumerate() {
            let get = PyCFunction::new_closure(py, None, None, move |args, _| field(args, i + 1).map(Bound::unbind))?;
            namespace.set_item(name, property.call1((get, py.None(), py.None(), doc))?)?;
        }
        // A second reference for new_type, which lets go of its own before CPython reads the dict.
        let dict = namespace.clone().into_any().unbind();
        PyErr::new_type(py, self.name, Some(self.doc), Some(&base), Some(dict))
    }
}

/// `OwnershipError.__init__`.
#[pyfunction]
#[pyo3(name = "__init__")]
#[pyo3(signature = (exc, message, arg, why, count=None, modes=Vec::new()))]
#[pyo3(text_signature = "(self, message, arg, why, count=None, modes=())")]
fn ownership_error_init(
    exc: &Bound<'_, PyAny>,
    message: String,
    arg: String,
    why: String,
    count: Option<i64>,
    modes: Vec<String>,
) -> PyResult<()> {
    exc.setattr("args", (message, arg, why, count, modes))
}

/// `UseAfterDonation.__init__`.
#[pyfunction]
#[pyo3(name = "__init__")]
#[pyo3(text_signature = "(self, message, op)")]
fn use_after_donation_init(exc: &Bound<'_, PyAny>, message: String, op: String) -> PyResult<()> {
    exc.setattr("args", (message, op))
}

/// `__str__` of a class with fields: the message (`args[0]`), as a one-argument exception's.
#[pyfunction]
#[pyo3(name = "__str__")]
fn message<'py>(exc: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let args = exc.getattr("args")?;
    match args.get_item(0) {
        Ok(message) => message.str(),
        Err(_) => Ok(PyString::new(exc.py(), "")),
    }
}

/// A field's property: `args[i]` of the exception the property is read on (None if `args` is
/// shorter: someone assigned it).
fn field<'py>(args: &Bound<'py, PyTuple>, i: usize) -> PyResult<Bound<'py, PyAny>> {
    let exc = args.get_item(0)?;
    let py = exc.py();
    Ok(exc.getattr("args")?.get_item(i).unwrap_or_else(|_| py.None().into_bound(py)))
}

/// The Python exception for `err`: `RuntimeError` for what went wrong while computing (libtorch,
/// C++), and the classes above for the rest; `ValueError` for other refusals (bad inputs).
pub(super) fn to_py(err: Error) -> PyErr {
    let message = err.to_string();
    Python::with_gil(|py| match err.root() {
        Error::NotOwned { arg, why } => {
            let modes = match why {
                Alias::DispatchModes(names) => names.clone(),
                _ => Vec::new(),
            };
            OWNERSHIP_ERROR.err(py, (message, arg, why.kind(), why.count(), modes))
        }
        Error::WeightsChanged => WEIGHTS_CHANGED.err(py, (message,)),
        Error::WeightChanged { .. } => STALE_BLOCK.err(py, (message,)),
        Error::Torch(_) | Error::Cpp(_) => PyRuntimeError::new_err(message),
        #[cfg(feature = "failpoints")]
        Error::Injected(_) => PyRuntimeError::new_err(message),
        _ => PyValueError::new_err(message),
    })
}
