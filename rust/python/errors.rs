//! The Python exception classes, made here (`create_exception!`) and re-exported by the package
//! (`plusequals.errors`), and the mapping of each [`Error`] to one of them.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::error::{Alias, Error};

// The exception classes, made here and re-exported by the package (plusequals.errors): tests
// and callers match on the class and its attributes, not on the message.
pyo3::create_exception!(
    plusequals,
    OwnershipError,
    PyValueError,
    "A tensor an in-place entry point would write into, or read while writing, is not the caller's \
     alone: nothing was written. `.arg` names the argument (\"x\" or \"context\"), `.why` the kind of \
     second name (\"other_handles\", \"weak_refs\", \"view\", ...: rust/error.rs, Alias), `.count` how many \
     (or None), `.modes` the active dispatch modes' names (for \"dispatch_modes\")."
);
pyo3::create_exception!(
    plusequals,
    UnsupportedBlockError,
    PyValueError,
    "A block, or a call, that the Rust block cannot reproduce exactly (plusequals.twin.faithful)."
);
pyo3::create_exception!(
    plusequals,
    WeightsChanged,
    PyRuntimeError,
    "A weight was written in place while a forward read it (another thread): the result is discarded."
);
pyo3::create_exception!(
    plusequals,
    DonationConsumed,
    PyRuntimeError,
    "A donation failed after its first write into x: x is marked donated, its buffer consumed, the result \
     discarded. The cause is in the message (and __cause__ when it is an exception of its own)."
);
pyo3::create_exception!(
    plusequals,
    StaleBlock,
    PyValueError,
    "The block is no longer what it was built on: its module changed since it was read (the watch), or a \
     weight's shape, dtype or device changed in place. RustBlock reads the module again and rebuilds."
);

/// The Python exception for `err`: `RuntimeError` for what went wrong while computing (libtorch,
/// C++), and the classes above for the rest; `ValueError` for other refusals (bad inputs).
pub(super) fn to_py(err: Error) -> PyErr {
    let message = err.to_string();
    match err.root() {
        Error::NotOwned { arg, why } => ownership_error(message, arg, why),
        Error::WeightsChanged => WeightsChanged::new_err(message),
        Error::WeightChanged { .. } => StaleBlock::new_err(message),
        Error::Torch(_) | Error::Cpp(_) => PyRuntimeError::new_err(message),
        #[cfg(feature = "failpoints")]
        Error::Injected(_) => PyRuntimeError::new_err(message),
        _ => PyValueError::new_err(message),
    }
}

pub(super) fn ownership_error(message: String, arg: &str, why: &Alias) -> PyErr {
    Python::with_gil(|py| {
        let err = OwnershipError::new_err(message);
        let value = err.value(py);
        let modes = match why {
            Alias::DispatchModes(names) => names.clone(),
            _ => Vec::new(),
        };
        let set = [
            value.setattr("arg", arg),
            value.setattr("why", why.kind()),
            value.setattr("count", why.count()),
            value.setattr("modes", modes),
        ];
        set.into_iter().find_map(|r| r.err()).unwrap_or(err)
    })
}
