//! A donation from Python, as a transaction: [`donate_into`].

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use tch::Tensor;

use super::errors::{to_py, DONATION_CONSUMED};
use super::twins::{masks_of, SharedBlock};
use crate::error::{Alias, Failure};
use crate::facts::{dispatch_modes, move_out, tensor_facts, Memory, PyObjectPtr};
use crate::ownership::{check_owned_by, Caller};
use crate::{BasicTransformerBlock, Error, NoGrad, Result};

/// A donation, as a transaction, in four steps; the first two hold the GIL, so no Python
/// thread can make an alias between the check and the move.
///
/// 1. Every check that can refuse: first whether `x`'s class can become a donated one
///    (`plusequals.donated.donated_class`; making it runs Python code, the class's
///    `__init_subclass__`, so it comes before the counts), whether `x` carries a forward-mode AD
///    tangent ([`check_tangent`]), then ([`check_donation`]) the block's checks of `x`,
///    `context` and the weights, libtorch's ownership counts (two handles are the caller's: the
///    Python object's and this call's), weak references (libtorch's, and Python's weakrefs to
///    the storage object). From here to the move no Python code runs.
/// 2. Mark and move: `x.__class__` becomes the donated class by `object.__setattr__` itself
///    ([`set_class`]; any later use raises), the buffer moves to a fresh handle, and the Python
///    object lets go of it (`set_()`).
/// 3. The in-place forward on the moved buffer, the GIL released.
/// 4. A failure before the first write puts the buffer back into `x` (same storage, shape,
///    strides, dtype and bytes) and its class back, then raises. A failure after it leaves `x`
///    marked donated and says that its buffer was consumed. Never an unmarked empty tensor.
pub(super) fn donate_into(
    py: Python<'_>,
    block: &SharedBlock,
    x: &Bound<'_, PyAny>,
    mut tensor: Tensor,
    (context, masks): (Option<Tensor>, [Option<Tensor>; 2]),
) -> PyResult<Tensor> {
    let twins = block.get();
    // Python code runs here and not after the check: making the donated class runs the user's
    // `__init_subclass__`, whose weakrefs to x's storage the check then counts.
    let donated = donated_class(py, x)?;
    let original = x.get_type();
    check_tangent(py, x, &tensor)
        .and_then(|()| check_donation(py, &twins.rust, &tensor, context.as_ref()))
        .and_then(|()| twins.rust.check_masks(&tensor, context.as_ref(), masks_of(&masks)))
        .map_err(|e| to_py(Error::Donation(Box::new(e))))?;
    let versions = twins.rust.weights_version();
    set_class(x, &donated)?;
    let moved = match move_out(&tensor) {
        Some(owned) => Ok(owned),
        None => tensor.f_detach().and_then(|owned| tensor.f_set_().map(|_python_object| owned)),
    };
    let owned = match moved {
        Ok(owned) => owned,
        Err(e) => {
            set_class(x, &original)?;
            return Err(to_py(Error::Donation(Box::new(e.into()))));
        }
    };
    let result = py.allow_threads(move || {
        let no_grad = NoGrad::new();
        // Python's weakrefs to the storage object were counted in step 1, and no Python name
        // reaches the buffer since the move, so none can have been made.
        let none = |_: PyObjectPtr| 0;
        let caller = Caller { handles: 1, python_weakrefs: Some(&none) };
        block.get().forward_owned(owned, (context.as_ref(), masks_of(&masks)), &no_grad, &caller, versions)
    });
    match result {
        Ok(y) => Ok(y),
        Err(Failure::Unwritten(e, buffer)) => {
            let _same_as_x = tensor.f_set_source_tensor_(&buffer).map_err(|restore| {
                PyRuntimeError::new_err(format!("{e}; and putting x's buffer back failed: {restore}"))
            })?;
            drop(buffer);
            set_class(x, &original)?;
            Err(to_py(Error::Donation(Box::new(e))))
        }
        Err(Failure::Consumed(e)) => Err(DONATION_CONSUMED.err(
            py,
            (format!(
                "x was donated and its buffer consumed: the in-place forward had already written into it when this \
                 happened: {e}. The result was discarded, and x is marked donated (its old values are partly \
                 overwritten)"
            ),),
        )),
    }
}

/// `x.__class__ = cls` by `object.__setattr__` itself: no Python code runs (a subclass's
/// `__setattr__` would, between the check and the move).
fn set_class(x: &Bound<'_, PyAny>, cls: &Bound<'_, PyAny>) -> PyResult<()> {
    let name = pyo3::intern!(x.py(), "__class__");
    // SAFETY: live objects borrowed for the call, the GIL held; object's generic setattr of
    // `__class__` checks the layouts and runs no Python code for a class made by `donated_class`.
    let rc = unsafe { pyo3::ffi::PyObject_GenericSetAttr(x.as_ptr(), name.as_ptr(), cls.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(PyErr::fetch(x.py()))
    }
}

/// Refuses a dual tensor (forward-mode AD): the move gives up the handle that holds its
/// tangent. Tangents exist only inside `forward_ad.dual_level()` (leaving it frees them), so
/// outside one this reads one module attribute. A functorch wrapper (`jvp` makes dual tensors
/// too) is left to the ownership check, which names functorch.
fn check_tangent(py: Python<'_>, x: &Bound<'_, PyAny>, tensor: &Tensor) -> Result<()> {
    if matches!(tensor_facts(tensor), Memory::Functorch) {
        return Ok(());
    }
    static FORWARD_AD: GILOnceCell<PyObject> = GILOnceCell::new();
    let dual = || -> PyResult<bool> {
        let fwad =
            FORWARD_AD.get_or_try_init(py, || py.import("torch.autograd.forward_ad").map(|m| m.into_any().unbind()))?;
        let fwad = fwad.bind(py);
        if fwad.getattr(pyo3::intern!(py, "_current_level"))?.extract::<i64>()? < 0 {
            return Ok(false);
        }
        Ok(!fwad.call_method1(pyo3::intern!(py, "unpack_dual"), (x,))?.getattr(pyo3::intern!(py, "tangent"))?.is_none())
    };
    match dual() {
        Ok(false) => Ok(()),
        _ => Err(Error::NotOwned { arg: "x", why: Alias::Tangent }),
    }
}

/// Everything a donation checks before it moves `x` (step 1 of [`donate_into`]).
pub(super) fn check_donation(
    py: Python<'_>,
    block: &BasicTransformerBlock,
    x: &Tensor,
    context: Option<&Tensor>,
) -> Result<()> {
    let _no_grad = NoGrad::new(); // the caller's grad mode is not the forward's: see forward_owned
    block.check_inputs(x, context)?;
    let weakrefs = |obj: PyObjectPtr| python_weakrefs(py, obj);
    check_owned_by(x, context, &Caller { handles: 2, python_weakrefs: Some(&weakrefs) })
}

/// Refuses, naming the modes, while a TorchDispatchMode is active: the mode would see the
/// in-place ops' tensors, `x` among them, and could keep them (`RustBlock` routes such calls
/// through its custom op instead, which the mode sees as one op).
pub(super) fn check_dispatch_modes(py: Python<'_>) -> Result<()> {
    if dispatch_modes() == 0 {
        return Ok(());
    }
    let names = mode_names(py).unwrap_or_default();
    Err(Error::NotOwned { arg: "x", why: Alias::DispatchModes(names) })
}

pub(super) fn mode_names(py: Python<'_>) -> PyResult<Vec<String>> {
    let stack = py.import("torch.utils._python_dispatch")?.call_method0("_get_current_dispatch_mode_stack")?;
    stack.try_iter()?.map(|mode| Ok(mode?.get_type().qualname()?.to_string())).collect()
}

/// The number of Python weakrefs to the object at `obj` (1 if Python cannot say: counted).
pub(super) fn python_weakrefs(py: Python<'_>, obj: PyObjectPtr) -> i64 {
    static COUNT: GILOnceCell<PyObject> = GILOnceCell::new();
    let count = || -> PyResult<i64> {
        let f = COUNT.get_or_try_init(py, || py.import("weakref")?.getattr("getweakrefcount").map(Bound::unbind))?;
        // SAFETY: `obj` is the live Python object of a storage that `x` keeps alive; the GIL is held.
        let obj = unsafe { Bound::from_borrowed_ptr(py, obj.cast()) };
        f.bind(py).call1((obj,))?.extract()
    };
    count().unwrap_or(1)
}

/// The class `x` becomes when donated (`plusequals.donated.donated_class(type(x))`), or the
/// `TypeError` that says why its class cannot become one, before anything moves.
/// For a plain `torch.Tensor`, the usual donation, the answer is `DonatedTensor`, looked up once.
pub(super) fn donated_class<'py>(py: Python<'py>, x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    static DONATED: GILOnceCell<(PyObject, PyObject, PyObject)> = GILOnceCell::new();
    let (f, tensor, plain) = DONATED.get_or_try_init(py, || -> PyResult<_> {
        let f = py.import("plusequals.twin.donated")?.getattr("donated_class")?;
        let tensor = py.import("torch")?.getattr("Tensor")?;
        let plain = f.call1((&tensor,))?;
        Ok((f.unbind(), tensor.unbind(), plain.unbind()))
    })?;
    let cls = x.get_type();
    if cls.is(tensor) {
        return Ok(plain.bind(py).clone());
    }
    f.bind(py).call1((cls,))
}
