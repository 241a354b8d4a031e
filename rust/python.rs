//! The PyO3 glue (feature `python`): argument conversion, GIL release, error mapping, and the
//! Python half of a donation. Nothing here computes; the block lives in `block.rs`.

use std::collections::HashMap;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3_tch::PyTensor;
use tch::Tensor;

use crate::aliases::Outcome;
use crate::cpp::CppBlock;
use crate::ownership::{check_owned, check_owned_with_handles};
use crate::{BasicTransformerBlock, BlockConfig, Error, NoGrad, Result};

fn to_py(err: Error) -> PyErr {
    match err {
        Error::Torch(e) => PyRuntimeError::new_err(e.to_string()),
        Error::Cpp(msg) => PyRuntimeError::new_err(msg),
        Error::WeightsChanged => PyRuntimeError::new_err(Error::WeightsChanged.to_string()),
        other => PyValueError::new_err(other.to_string()),
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

    fn forward_owned(&self, x: Tensor, context: Option<&Tensor>, no_grad: &NoGrad) -> Result<Tensor> {
        self.guarded(|| self.forward_owned_unguarded(x, context, no_grad))
    }

    fn forward_owned_unguarded(&self, x: Tensor, context: Option<&Tensor>, no_grad: &NoGrad) -> Result<Tensor> {
        match &self.cpp {
            None => self.rust.forward_owned(x, context, no_grad),
            Some(cpp) => {
                self.rust.check_inputs(&x, context)?;
                check_owned(&x, context)?; // what C++ does not check: rust/ownership.rs
                cpp.forward_owned(x, context)
            }
        }
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
        let mut y = copy(x)?;
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
///   call and rebuilds (python/plusequals/faithful.py).
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

    /// `op_plus_x` out of place; the GIL is released while libtorch computes.
    #[pyo3(signature = (x, context=None))]
    fn forward(&self, py: Python<'_>, x: PyTensor, context: Option<PyTensor>) -> PyResult<PyTensor> {
        let (x, context) = (x.0, context.map(|c| c.0));
        let block = &self.block;
        py.allow_threads(move || block.get().forward(&x, context.as_ref())).map(PyTensor).map_err(to_py)
    }

    /// In-place residuals with grad off. `donate=false` works on a copy of `x`;
    /// `donate=true` moves `x`'s buffer into the call: see [`take_donated`].
    #[pyo3(signature = (x, context=None, donate=false))]
    fn forward_owned(
        &self,
        py: Python<'_>,
        x: PyTensor,
        context: Option<PyTensor>,
        donate: bool,
    ) -> PyResult<PyTensor> {
        let (x, context) = (x.0, context.map(|c| c.0));
        let block = &self.block;
        let x = if donate { take_donated(&block.get().rust, x, context.as_ref()).map_err(to_py)? } else { x };
        py.allow_threads(move || -> Result<Tensor> {
            let no_grad = NoGrad::new();
            let x = if donate { x } else { copy(&x)? };
            let y = block.get().forward_owned(x, context.as_ref(), &no_grad)?;
            Ok(y)
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

    /// The checks a donation runs before it moves `x` (shapes, dtype, device, and libtorch's
    /// ownership counts: `take_donated` without the move), raising what it would raise. For the
    /// report: their cost per call is this minus `echo`.
    #[pyo3(signature = (x, context=None))]
    fn donation_check(&self, x: PyTensor, context: Option<PyTensor>) -> PyResult<()> {
        let _no_grad = NoGrad::new();
        self.block.get().rust.check_inputs(&x, context.as_deref()).map_err(to_py)?;
        check_owned_with_handles(&x, context.as_deref(), 2).map_err(to_py)
    }

    /// `n` calls of `forward` (or of `forward_owned` on a copy made once) without
    /// returning to Python: libtorch's cost alone, for the benchmark.
    #[pyo3(signature = (x, context=None, n=1, owned=false))]
    fn forward_loop(
        &self,
        py: Python<'_>,
        x: PyTensor,
        context: Option<PyTensor>,
        n: usize,
        owned: bool,
    ) -> PyResult<PyTensor> {
        let (x, context) = (x.0, context.map(|c| c.0));
        let block = &self.block;
        py.allow_threads(move || block.get().forward_loop(&x, context.as_ref(), n, owned)).map(PyTensor).map_err(to_py)
    }
}

/// The Python half of a move, done while the GIL is held so that no Python thread can make a
/// new alias between the check and the write.
///
/// `x` arrives with two handles on its `TensorImpl`: the Python object's and this call's. If
/// libtorch's bookkeeping shows nothing else (`check_owned_with_handles(.., 2)`), the buffer
/// moves to a fresh handle and the Python object lets go of it (`set_()`: it becomes an empty
/// tensor), so the returned tensor is the only one that can read the memory the block writes.
/// Everything `forward_owned` checks is checked first, so a refused donation leaves `x` as it
/// was. (An error inside libtorch after the first write, such as running out of memory, leaves
/// `x` consumed, as any donation does.)
fn take_donated(block: &BasicTransformerBlock, mut x: Tensor, context: Option<&Tensor>) -> Result<Tensor> {
    let _no_grad = NoGrad::new(); // the caller's grad mode is not the forward's: see forward_owned
    block.check_inputs(&x, context)?;
    check_owned_with_handles(&x, context, 2)?;
    let owned = x.f_detach()?; // a second TensorImpl on the storage
    let _python_object = x.f_set_()?; // the Python object's TensorImpl drops the storage
    Ok(owned)
}

fn copy(x: &Tensor) -> Result<Tensor> {
    let mut c = x.f_empty_like()?;
    c.f_copy_(x)?;
    Ok(c)
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

/// Runs the C++ bug gallery (`cpp/gallery.cpp`) on the small test block: `(case, whether its bug
/// happened, what it saw)`.
#[pyfunction]
fn cpp_gallery(py: Python<'_>) -> PyResult<Vec<(String, bool, String)>> {
    py.allow_threads(|| -> Result<_> {
        let cfg = crate::testing::small_config(crate::Attention::Sdpa);
        let mut weights: Vec<_> = crate::testing::small_weights(0).into_iter().collect();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        let cpp = CppBlock::from_weights(&weights, &cfg)?;
        let (x, c) = crate::testing::small_inputs();
        cpp.gallery(&x, &c).into_iter().map(|(name, happened, what)| Ok((name, happened?, what))).collect()
    })
    .map_err(to_py)
}

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // pyo3-tch can only unwrap tensors once torch's Python classes are registered.
    m.py().import("torch")?;
    m.add_class::<PyBlock>()?;
    m.add_function(wrap_pyfunction!(alias_routes, m)?)?;
    m.add_function(wrap_pyfunction!(cpp_gallery, m)?)?;
    m.add("TCH_VERSION", "0.24.0")?;
    m.add("RUSTC_VERSION", env!("PLUSEQUALS_RUSTC_VERSION"))?;
    Ok(())
}
