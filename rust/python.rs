//! The PyO3 glue (feature `python`): argument conversion, GIL release, error mapping, and the
//! Python half of a donation. Nothing here computes; the block lives in `block.rs`.

use std::collections::HashMap;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyType};
use pyo3::PyTraverseError;
use pyo3_tch::PyTensor;
use tch::Tensor;

use crate::aliases::Outcome;
use crate::block::deep_copy;
use crate::cpp::CppBlock;
use crate::error::Failure;
use crate::facts::{dispatch_modes, PyObjectPtr};
use crate::ownership::{check_owned_by, Alias, Caller};
use crate::{BasicTransformerBlock, BlockConfig, Error, NoGrad, Result};

pyo3::create_exception!(
    _rust,
    StaleBlock,
    PyValueError,
    "The block is no longer what it was built on: its module changed since it was read (the watch), or a \
     weight's shape, dtype or device changed in place. RustBlock reads the module again and rebuilds."
);

/// `RuntimeError` for what went wrong while computing (libtorch, C++, a racing writer);
/// `StaleBlock` for a block that must be rebuilt; `ValueError` for what was refused.
fn to_py(err: Error) -> PyErr {
    let message = err.to_string();
    match err.root() {
        Error::Torch(_) | Error::Cpp(_) | Error::WeightsChanged | Error::Injected(_) => {
            PyRuntimeError::new_err(message)
        }
        Error::WeightChanged { .. } => StaleBlock::new_err(message),
        _ => PyValueError::new_err(message),
    }
}

/// What a reading of a module looked at (`plusequals.faithful.Watch`), compared in one pass at
/// the start of every call that passes it, under the GIL: each noted value by identity in its
/// dict, each module's exact class, each dict's size, hook dicts empty, and torch's global hook
/// dicts holding the keys they held. A change raises `StaleBlock` before anything else runs.
///
/// It holds the module's own objects (a RustBlock's watch holds the RustBlock), so it takes part
/// in Python's garbage collection (`__traverse__`, `__clear__`) like any container.
#[pyclass(name = "Watch", module = "plusequals._rust")]
struct PyWatch {
    same: Vec<(Py<PyDict>, Py<PyAny>, Py<PyAny>)>,
    classes: Vec<(Py<PyAny>, Py<PyType>)>,
    sizes: Vec<(Py<PyDict>, usize)>,
    empty: Vec<Py<PyDict>>,
    keys: Vec<(Py<PyDict>, Vec<Py<PyAny>>)>,
}

#[pymethods]
impl PyWatch {
    #[new]
    #[pyo3(signature = (same, classes, sizes, empty, keys))]
    fn new(
        same: Vec<(Py<PyDict>, Py<PyAny>, Py<PyAny>)>,
        classes: Vec<(Py<PyAny>, Py<PyType>)>,
        sizes: Vec<(Py<PyDict>, usize)>,
        empty: Vec<Py<PyDict>>,
        keys: Vec<(Py<PyDict>, Vec<Py<PyAny>>)>,
    ) -> Self {
        PyWatch { same, classes, sizes, empty, keys }
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
        Ok(())
    }

    fn __clear__(&mut self) {
        (self.same, self.classes, self.sizes, self.empty, self.keys) = Default::default();
    }

    /// Whether everything is as it was read (stops at the first difference). A cleared watch
    /// (collected with what it watched) holds nothing: it says changed.
    fn unchanged(&self, py: Python<'_>) -> bool {
        if self.classes.is_empty() {
            return false;
        }
        let found = |d: &Py<PyDict>, key: &Py<PyAny>| -> *mut pyo3::ffi::PyObject {
            // SAFETY: both are live objects (held here); the GIL is held; the result is borrowed
            // and only compared by address.
            unsafe { pyo3::ffi::PyDict_GetItemWithError(d.as_ptr(), key.as_ptr()) }
        };
        for (d, key, value) in &self.same {
            if found(d, key) != value.as_ptr() {
                let _lookup_error = PyErr::take(py); // a key whose __eq__ raised: changed
                return false;
            }
        }
        self.classes.iter().all(|(obj, cls)| obj.bind(py).get_type().is(cls.bind(py)))
            && self.sizes.iter().all(|(d, n)| d.bind(py).len() == *n)
            && self.empty.iter().all(|d| d.bind(py).is_empty())
            && self.keys.iter().all(|(d, keys)| {
                let d = d.bind(py);
                d.len() == keys.len() && d.keys().iter().zip(keys).all(|(now, was)| now.is(was))
            })
    }
}

/// Raises `StaleBlock` unless `watch` (when given) finds everything as it was read.
fn check_watch(py: Python<'_>, watch: Option<&Bound<'_, PyWatch>>) -> PyResult<()> {
    match watch {
        Some(w) if !w.try_borrow()?.unchanged(py) => Err(StaleBlock::new_err("the module changed since it was read")),
        _ => Ok(()),
    }
}

/// The block behind the Python class: the Rust twin, and the C++ twin when `language="cpp"`.
/// The Rust block validates the weights and every input for both; the C++ one, when present,
/// computes.
struct Twins {
    rust: BasicTransformerBlock,
    cpp: Option<CppBlock>,
}

impl Twins {
    /// Runs `f`, and discards its result if a weight was written in place meanwhile (the
    /// weights' version counters moved): see `SharedBlock`'s SAFETY note.
    fn guarded<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let before = self.rust.weights_version();
        let out = f()?;
        if self.rust.weights_version() != before {
            return Err(Error::WeightsChanged);
        }
        Ok(out)
    }

    fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.guarded(|| self.forward_unguarded(x, context))
    }

    fn forward_unguarded(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        match &self.cpp {
            None => self.rust.forward(x, context),
            Some(cpp) => {
                self.rust.check_inputs(x, context)?;
                cpp.forward(x, context)
            }
        }
    }

    /// The in-place forward, as a transaction: `Failure::Unwritten` hands `x` back untouched;
    /// a result computed while a weight was written in place (the weights' versions moved since
    /// `versions`, read before `x` was taken) is discarded as `Failure::Consumed`.
    fn forward_owned(
        &self,
        x: Tensor,
        context: Option<&Tensor>,
        no_grad: &NoGrad,
        caller: &Caller,
        versions: i64,
    ) -> Result<Tensor, Failure> {
        let y = match &self.cpp {
            None => self.rust.forward_owned_by(x, context, no_grad, caller)?,
            Some(cpp) => match self.rust.check_inputs(&x, context) {
                Err(e) => return Err(Failure::Unwritten(e, x)),
                Ok(()) => cpp.forward_owned_by(x, context, no_grad, caller)?, // C++ checks no alias: cpp.rs does
            },
        };
        if self.rust.weights_version() != versions {
            return Err(Failure::Consumed(Error::WeightsChanged));
        }
        Ok(y)
    }

    /// `n` forwards without returning to Python (grad off); `owned` reuses the last output's
    /// buffer as the next input, refilled from `x`.
    fn forward_loop(&self, x: &Tensor, context: Option<&Tensor>, n: usize, owned: bool) -> Result<Tensor> {
        self.guarded(|| self.forward_loop_unguarded(x, context, n, owned))
    }

    fn forward_loop_unguarded(&self, x: &Tensor, context: Option<&Tensor>, n: usize, owned: bool) -> Result<Tensor> {
        self.rust.check_inputs(x, context)?;
        if let Some(cpp) = &self.cpp {
            return cpp.forward_loop(x, context, n as i64, owned);
        }
        let no_grad = NoGrad::new();
        let mut y = deep_copy(x)?;
        for _ in 0..n {
            y = if owned {
                let mut fresh = y;
                fresh.f_copy_(x)?;
                self.rust.forward_owned(fresh, context, &no_grad)?
            } else {
                self.rust.forward(x, context)?
            };
        }
        Ok(y)
    }
}

/// Lets Python threads call one block at the same time.
///
/// SAFETY: `tch::Tensor` is `!Sync` because some tch methods mutate through `&self`. The only
/// methods reached through a shared reference (`forward`, `forward_owned`, `forward_loop`) pass
/// the weights to libtorch ops as read-only inputs, and libtorch reads a tensor from several
/// threads safely (atomic refcounts, no lazy state on a read). Nothing here hands a weight out
/// or writes one.
///
/// The weights' storage is *not* private: `RustBlock.from_torch` and the swap share it with the
/// PyTorch module by design, so Python code can write it while Rust reads it. The contract is
/// eager PyTorch's: do not write a module's parameters while another thread runs its forward.
/// What breaking it does here:
/// * An in-place write (an optimizer step, `p.add_()`) moves the weights' version counters, and
///   the forward that overlapped it returns `WeightsChanged` instead of a result computed from
///   torn weights (`Twins::guarded`).
/// * Rebinding a parameter (`p.data = ..`, which `.half()` and `.to()` use) is not detected
///   during the forward. pyo3-tch gives this block a handle on the parameter's own `TensorImpl`
///   (autograd needs that identity for training through Rust), and `set_data` swaps that
///   `TensorImpl`'s storage in place. Done while a kernel reads the weight, it is the same data
///   race as in eager PyTorch, where the old storage may be freed under the kernel. Between
///   calls it is safe: `RustBlock` sees the changed data pointer, dtype or device on its next
///   call and rebuilds (python/plusequals/twin/faithful.py).
struct SharedBlock(Twins);
unsafe impl Sync for SharedBlock {}

impl SharedBlock {
    fn get(&self) -> &Twins {
        &self.0
    }
}

/// The Rust `BasicTransformerBlock` (or, with `language="cpp"`, its C++ twin). Use it through
/// `plusequals.RustBlock` / `plusequals.CppBlock`.
#[pyclass(name = "Block", module = "plusequals._rust", frozen)]
struct PyBlock {
    block: SharedBlock,
}

#[pymethods]
impl PyBlock {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (weights, *, dim, n_heads, d_head, context_dim=None, gated_ff=true, attention="sdpa", language="rust"))]
    fn new(
        weights: HashMap<String, PyTensor>,
        dim: i64,
        n_heads: i64,
        d_head: i64,
        context_dim: Option<i64>,
        gated_ff: bool,
        attention: &str,
        language: &str,
    ) -> PyResult<Self> {
        let cfg =
            BlockConfig { dim, n_heads, d_head, context_dim, gated_ff, attention: attention.parse().map_err(to_py)? };
        let mut weights: Vec<(String, Tensor)> = weights.into_iter().map(|(k, v)| (k, v.0)).collect();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        let cpp = match language {
            "rust" => None,
            // The C++ block gets its own handles on the same weights (no copies).
            "cpp" => Some(CppBlock::from_weights(&weights, &cfg).map_err(to_py)?),
            other => return Err(PyValueError::new_err(format!("language must be 'rust' or 'cpp', got {other:?}"))),
        };
        let rust = BasicTransformerBlock::from_weights(weights.into_iter().collect(), &cfg).map_err(to_py)?;
        Ok(PyBlock { block: SharedBlock(Twins { rust, cpp }) })
    }

    /// `op_plus_x` out of place; the GIL is released while libtorch computes. `watch`: see
    /// [`PyWatch`].
    #[pyo3(signature = (x, context=None, watch=None))]
    fn forward(
        &self,
        py: Python<'_>,
        x: PyTensor,
        context: Option<PyTensor>,
        watch: Option<Bound<'_, PyWatch>>,
    ) -> PyResult<PyTensor> {
        check_watch(py, watch.as_ref())?;
        let (x, context) = (x.0, context.map(|c| c.0));
        let block = &self.block;
        py.allow_threads(move || block.get().forward(&x, context.as_ref())).map(PyTensor).map_err(to_py)
    }

    /// In-place residuals with grad off. `donate=false` works on a copy of `x`;
    /// `donate=true` moves `x`'s buffer into the call, as a transaction: see [`donate`].
    #[pyo3(signature = (x, context=None, donate=false, watch=None))]
    fn forward_owned(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        context: Option<PyTensor>,
        donate: bool,
        watch: Option<Bound<'_, PyWatch>>,
    ) -> PyResult<PyTensor> {
        check_watch(py, watch.as_ref())?;
        let tensor = x.extract::<PyTensor>().map_err(|e| PyTypeError::new_err(format!("argument 'x': {e}")))?.0;
        let context = context.map(|c| c.0);
        check_dispatch_modes(py).map_err(to_py)?;
        let block = &self.block;
        if donate {
            return donate_into(py, block, x, tensor, context).map(PyTensor);
        }
        py.allow_threads(move || -> Result<Tensor> {
            let twins = block.get();
            let no_grad = NoGrad::new();
            let versions = twins.rust.weights_version();
            Ok(twins.forward_owned(deep_copy(&tensor)?, context.as_ref(), &no_grad, &Caller::RUST, versions)?)
        })
        .map(PyTensor)
        .map_err(to_py)
    }

    /// Everything `forward` does at the boundary (unwrap the tensors, release and retake
    /// the GIL, wrap a tensor back) and no libtorch op: the binding's own per-call cost.
    #[pyo3(signature = (x, context=None))]
    fn echo(&self, py: Python<'_>, x: PyTensor, context: Option<PyTensor>) -> PyTensor {
        let (x, context) = (x.0, context.map(|c| c.0));
        let block = &self.block;
        PyTensor(py.allow_threads(move || {
            let _ = (block.get().rust.dim, context);
            x
        }))
    }

    /// The checks a donation runs before it moves `x` (dispatch modes, shapes, dtype, device,
    /// the weights, and libtorch's ownership counts with Python's weakrefs: [`donate`] without
    /// the move), raising what it would raise. For the report: their cost per call is this minus
    /// `echo`.
    #[pyo3(signature = (x, context=None))]
    fn donation_check(&self, py: Python<'_>, x: PyTensor, context: Option<PyTensor>) -> PyResult<()> {
        check_dispatch_modes(py).map_err(to_py)?;
        check_donation(py, &self.block.get().rust, &x, context.as_deref()).map_err(to_py)
    }

    /// `n` calls of `forward` (or of `forward_owned` on a copy made once) without
    /// returning to Python: libtorch's cost alone, for the benchmark.
    #[pyo3(signature = (x, context=None, n=1, owned=false, watch=None))]
    fn forward_loop(
        &self,
        py: Python<'_>,
        x: PyTensor,
        context: Option<PyTensor>,
        n: usize,
        owned: bool,
        watch: Option<Bound<'_, PyWatch>>,
    ) -> PyResult<PyTensor> {
        check_watch(py, watch.as_ref())?;
        let (x, context) = (x.0, context.map(|c| c.0));
        let block = &self.block;
        py.allow_threads(move || block.get().forward_loop(&x, context.as_ref(), n, owned)).map(PyTensor).map_err(to_py)
    }
}

/// A donation, as a transaction, in four steps; the first two hold the GIL, so no Python
/// thread can make an alias between the check and the move.
///
/// 1. Every check that can refuse ([`check_donation`]): the block's checks of `x`, `context`
///    and the weights, libtorch's ownership counts (two handles are the caller's: the Python
///    object's and this call's), weak references (libtorch's, and Python's weakrefs to the
///    storage object), and whether `x`'s class can become a donated one
///    (`plusequals.donated.donated_class`).
/// 2. Mark and move: `x.__class__` becomes the donated class (any later use raises), the buffer
///    moves to a fresh handle, and the Python object lets go of it (`set_()`).
/// 3. The in-place forward on the moved buffer, the GIL released.
/// 4. A failure before the first write puts the buffer back into `x` (same storage, shape,
///    strides, dtype and bytes) and its class back, then raises. A failure after it leaves `x`
///    marked donated and says that its buffer was consumed. Never an unmarked empty tensor.
fn donate_into(
    py: Python<'_>,
    block: &SharedBlock,
    x: &Bound<'_, PyAny>,
    mut tensor: Tensor,
    context: Option<Tensor>,
) -> PyResult<Tensor> {
    let twins = block.get();
    check_donation(py, &twins.rust, &tensor, context.as_ref()).map_err(|e| to_py(Error::Donation(Box::new(e))))?;
    let donated = donated_class(py, x)?;
    let original = x.get_type();
    let versions = twins.rust.weights_version();
    x.setattr("__class__", &donated)?;
    let moved = tensor.f_detach().and_then(|owned| tensor.f_set_().map(|_python_object| owned));
    let owned = match moved {
        Ok(owned) => owned,
        Err(e) => {
            x.setattr("__class__", &original)?;
            return Err(to_py(Error::Donation(Box::new(e.into()))));
        }
    };
    let result = py.allow_threads(move || {
        let no_grad = NoGrad::new();
        // Python's weakrefs to the storage object were counted in step 1, and no Python name
        // reaches the buffer since the move, so none can have been made.
        let none = |_: PyObjectPtr| 0;
        let caller = Caller { handles: 1, python_weakrefs: Some(&none) };
        block.get().forward_owned(owned, context.as_ref(), &no_grad, &caller, versions)
    });
    match result {
        Ok(y) => Ok(y),
        Err(Failure::Unwritten(e, buffer)) => {
            let _same_as_x = tensor.f_set_source_tensor_(&buffer).map_err(|restore| {
                PyRuntimeError::new_err(format!("{e}; and putting x's buffer back failed: {restore}"))
            })?;
            drop(buffer);
            x.setattr("__class__", &original)?;
            Err(to_py(Error::Donation(Box::new(e))))
        }
        Err(Failure::Consumed(e)) => Err(PyRuntimeError::new_err(format!(
            "x was donated and its buffer consumed: the in-place forward had already written into it when this \
             happened: {e}. The result was discarded, and x is marked donated (its old values are partly overwritten)"
        ))),
    }
}

/// Everything a donation checks before it moves `x` (step 1 of [`donate_into`]).
fn check_donation(py: Python<'_>, block: &BasicTransformerBlock, x: &Tensor, context: Option<&Tensor>) -> Result<()> {
    let _no_grad = NoGrad::new(); // the caller's grad mode is not the forward's: see forward_owned
    block.check_inputs(x, context)?;
    let weakrefs = |obj: PyObjectPtr| python_weakrefs(py, obj);
    check_owned_by(x, context, &Caller { handles: 2, python_weakrefs: Some(&weakrefs) })
}

/// Refuses, naming the modes, while a TorchDispatchMode is active: the mode would see the
/// in-place ops' tensors, `x` among them, and could keep them (`RustBlock` routes such calls
/// through its custom op instead, which the mode sees as one op).
fn check_dispatch_modes(py: Python<'_>) -> Result<()> {
    if dispatch_modes() == 0 {
        return Ok(());
    }
    let names = mode_names(py).unwrap_or_default();
    Err(Error::NotOwned { arg: "x", why: Alias::DispatchModes(names) })
}

fn mode_names(py: Python<'_>) -> PyResult<Vec<String>> {
    let stack = py.import("torch.utils._python_dispatch")?.call_method0("_get_current_dispatch_mode_stack")?;
    stack.try_iter()?.map(|mode| Ok(mode?.get_type().qualname()?.to_string())).collect()
}

/// The number of Python weakrefs to the object at `obj` (1 if Python cannot say: counted).
fn python_weakrefs(py: Python<'_>, obj: PyObjectPtr) -> i64 {
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
fn donated_class<'py>(py: Python<'py>, x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    static DONATED_CLASS: GILOnceCell<PyObject> = GILOnceCell::new();
    let f = DONATED_CLASS
        .get_or_try_init(py, || py.import("plusequals.twin.donated")?.getattr("donated_class").map(Bound::unbind))?;
    f.bind(py).call1((x.get_type(),))
}

/// Runs every Rust alias route (`rust/aliases.rs`) now: `(name, what happened)` pairs.
#[pyfunction]
fn alias_routes(py: Python<'_>) -> Vec<(String, String)> {
    py.allow_threads(|| {
        crate::aliases::routes()
            .into_iter()
            .map(|route| {
                let outcome = match (route.run)() {
                    Ok(Outcome::Refused { error: Error::NotOwned { arg, why }, unchanged }) => {
                        let kept = if unchanged { "nothing written" } else { "BUT THE OTHER NAME CHANGED" };
                        format!("refused ({arg}: {}); {kept}", why.label())
                    }
                    Ok(Outcome::Refused { error, .. }) => format!("refused: {error}"),
                    Ok(Outcome::Written) => "written (tch's own API)".to_string(),
                    Ok(Outcome::Untouched) => "NOT REFUSED, and nothing written".to_string(),
                    Err(error) => format!("route failed: {error}"),
                };
                (route.name.to_string(), outcome)
            })
            .collect()
    })
}

/// What libtorch's bookkeeping says of `t` (rust/facts.rs): the counts the ownership check
/// reads, by name (`None` for a tensor without dense memory: `kind` says which). For the tests
/// that find libtorch's baselines, and for anyone asking why a donation was refused.
#[pyfunction]
fn tensor_facts(py: Python<'_>, t: PyTensor) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    use crate::facts::Memory;
    let d = pyo3::types::PyDict::new(py);
    let f = match crate::facts::tensor_facts(&t) {
        Memory::Dense(f) => f,
        other => {
            let kind = match other {
                Memory::None => "meta",
                Memory::Functorch => "functorch",
                Memory::PythonSubclass => "python_subclass",
                _ => "no_storage",
            };
            d.set_item("kind", kind)?;
            return Ok(d);
        }
    };
    d.set_item("kind", "dense")?;
    d.set_item("tensor_uses", f.tensor_uses)?;
    d.set_item("tensor_weak_refs", f.tensor_weak_refs)?;
    d.set_item("storage_uses", f.storage_uses)?;
    d.set_item("storage_weak_refs", f.storage_weak_refs)?;
    let object_weakrefs = (!f.storage_pyobject.is_null()).then(|| python_weakrefs(py, f.storage_pyobject));
    d.set_item("storage_object_weakrefs", object_weakrefs)?;
    d.set_item("storage_object_unreachable", f.storage_pyobject_unreachable != 0)?;
    d.set_item("is_view", f.is_view != 0)?;
    d.set_item("is_inference", f.is_inference != 0)?;
    Ok(d)
}

/// Makes the next in-place forward on this thread fail at `step` ("before_first_write",
/// "after_first_write"; `None` disarms): the transaction tests' fault injection (failpoint.rs).
#[pyfunction]
#[pyo3(signature = (step))]
fn _fail_next_forward_owned_at(step: Option<&str>) -> PyResult<()> {
    use crate::failpoint::{fail_next_at, Step};
    let step = match step {
        None => None,
        Some("before_first_write") => Some(Step::BeforeFirstWrite),
        Some("after_first_write") => Some(Step::AfterFirstWrite),
        Some(other) => return Err(PyValueError::new_err(format!("no failpoint {other:?}"))),
    };
    fail_next_at(step);
    Ok(())
}

/// Runs the C++ bug gallery (`cpp/gallery.cpp`) on the small test block: `(case, whether its bug
/// happened, what it saw)`.
#[pyfunction]
fn cpp_gallery(py: Python<'_>) -> PyResult<Vec<(String, bool, String)>> {
    py.allow_threads(|| -> Result<_> {
        let cfg = crate::testing::small_config(crate::Attention::Sdpa);
        let mut weights: Vec<_> = crate::testing::small_weights(0)?.into_iter().collect();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        let cpp = CppBlock::from_weights(&weights, &cfg)?;
        let (x, c) = crate::testing::small_inputs()?;
        cpp.gallery(&x, &c).into_iter().map(|(name, happened, what)| Ok((name, happened?, what))).collect()
    })
    .map_err(to_py)
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // pyo3-tch can only unwrap tensors once torch's Python classes are registered.
    m.py().import("torch")?;
    m.add_class::<PyBlock>()?;
    m.add_class::<PyWatch>()?;
    m.add("StaleBlock", m.py().get_type::<StaleBlock>())?;
    m.add_function(wrap_pyfunction!(alias_routes, m)?)?;
    m.add_function(wrap_pyfunction!(cpp_gallery, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_facts, m)?)?;
    m.add_function(wrap_pyfunction!(_fail_next_forward_owned_at, m)?)?;
    m.add("TCH_VERSION", "0.24.0")?;
    m.add("RUSTC_VERSION", env!("PLUSEQUALS_RUSTC_VERSION"))?;
    Ok(())
}
