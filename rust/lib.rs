//! plusequals: the Stable Diffusion v1 residual block in Rust (tch-rs), and the ownership
//! types that keep `+=` safe. With the `python` feature this crate is also the extension
//! module `plusequals._rust`: the PyO3 glue at the end of this file.

pub mod block;
pub mod error;
pub mod ownership;
pub mod testing;

pub use block::{AddInPlace, Attention, BasicTransformerBlock, BlockConfig};
pub use error::{Error, Result};
pub use ownership::NoGrad;

// ------------------------------------------------------------------------------------------
// PyO3 glue (feature `python`): argument conversion, GIL release, error mapping. Nothing here
// computes; the block lives in `block.rs`.
// ------------------------------------------------------------------------------------------

#[cfg(feature = "python")]
mod glue {
    use std::collections::HashMap;

    use pyo3::exceptions::{PyRuntimeError, PyValueError};
    use pyo3::prelude::*;
    use pyo3_tch::PyTensor;
    use tch::Tensor;

    use crate::ownership::check_donatable;
    use crate::{BasicTransformerBlock, BlockConfig, Error, NoGrad, Result};

    fn to_py(err: Error) -> PyErr {
        match err {
            Error::Torch(e) => PyRuntimeError::new_err(e.to_string()),
            other => PyValueError::new_err(other.to_string()),
        }
    }

    /// Lets Python threads call one block at the same time.
    ///
    /// SAFETY: `tch::Tensor` is `!Sync` because some tch methods mutate through `&self`. The
    /// block's weights are private to this wrapper, and the only methods reached through a
    /// shared reference (`forward`, `forward_owned`) pass them to libtorch ops as read-only
    /// inputs; libtorch reads a tensor from several threads safely (atomic refcounts, no
    /// lazy state on a read). Nothing here hands a weight out or mutates one.
    struct SharedBlock(BasicTransformerBlock);
    unsafe impl Sync for SharedBlock {}

    impl SharedBlock {
        fn get(&self) -> &BasicTransformerBlock {
            &self.0
        }
    }

    /// The Rust `BasicTransformerBlock`. Use it through `plusequals.RustBlock`.
    #[pyclass(name = "Block", module = "plusequals._rust", frozen)]
    struct PyBlock {
        block: SharedBlock,
    }

    #[pymethods]
    impl PyBlock {
        #[new]
        #[pyo3(signature = (weights, *, dim, n_heads, d_head, context_dim=None, gated_ff=true, attention="sdpa"))]
        fn new(
            weights: HashMap<String, PyTensor>,
            dim: i64,
            n_heads: i64,
            d_head: i64,
            context_dim: Option<i64>,
            gated_ff: bool,
            attention: &str,
        ) -> PyResult<Self> {
            let cfg = BlockConfig {
                dim,
                n_heads,
                d_head,
                context_dim,
                gated_ff,
                attention: attention.parse().map_err(to_py)?,
            };
            let weights = weights.into_iter().map(|(k, v)| (k, v.0)).collect();
            let block = BasicTransformerBlock::from_weights(weights, &cfg).map_err(to_py)?;
            Ok(PyBlock { block: SharedBlock(block) })
        }

        /// `op_plus_x` out of place; the GIL is released while libtorch computes.
        #[pyo3(signature = (x, context=None))]
        fn forward(&self, py: Python<'_>, x: PyTensor, context: Option<PyTensor>) -> PyResult<PyTensor> {
            let (x, context) = (x.0, context.map(|c| c.0));
            let block = &self.block;
            py.allow_threads(move || block.get().forward(&x, context.as_ref())).map(PyTensor).map_err(to_py)
        }

        /// In-place residuals with grad off. `donate=false` works on a copy of `x`;
        /// `donate=true` writes into `x`'s own buffer and returns a new handle on it.
        /// The Python wrapper checks grad mode and invalidates the donated handle.
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
            py.allow_threads(move || -> Result<Tensor> {
                let no_grad = NoGrad::new();
                if donate {
                    check_donatable(&x, context.as_ref())?;
                }
                let x = if donate { x } else { copy(&x)? };
                let y = block.get().forward_owned(x, context.as_ref(), &no_grad)?;
                Ok(if donate { y.f_detach()? } else { y })
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
                let _ = (block.get().dim, context);
                x
            }))
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
            py.allow_threads(move || -> Result<Tensor> {
                let no_grad = NoGrad::new();
                let mut y = copy(&x)?;
                for _ in 0..n {
                    y = if owned {
                        let mut fresh = y; // reuse the last output's buffer as the next input
                        fresh.f_copy_(&x)?;
                        block.get().forward_owned(fresh, context.as_ref(), &no_grad)?
                    } else {
                        block.get().forward(&x, context.as_ref())?
                    };
                }
                Ok(y)
            })
            .map(PyTensor)
            .map_err(to_py)
        }
    }

    fn copy(x: &Tensor) -> Result<Tensor> {
        let mut c = x.f_empty_like()?;
        c.f_copy_(x)?;
        Ok(c)
    }

    #[pymodule]
    fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
        // pyo3-tch can only unwrap tensors once torch's Python classes are registered.
        m.py().import("torch")?;
        m.add_class::<PyBlock>()?;
        m.add("TCH_VERSION", "0.24.0")?;
        m.add("RUSTC_VERSION", env!("PLUSEQUALS_RUSTC_VERSION"))?;
        Ok(())
    }
}
