//! The Python class `plusequals._rust.Block`: argument conversion, GIL release, and the calls.

use std::collections::HashMap;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3_tch::PyTensor;
use tch::Tensor;

use super::donation::{check_dispatch_modes, check_donation, donate_into};
use super::errors::to_py;
use super::twins::{masks_of, SharedBlock, Twins};
use super::watch::{check_watch, PyWatch};
use crate::attention_extras::AttentionExtras;
use crate::block::deep_copy;
use crate::cpp::CppBlock;
use crate::ownership::Caller;
use crate::{BasicTransformerBlock, BlockConfig, LoraSpec, NoGrad, ProcessorSpec, Result};

/// What the weights alone do not tell a block, and which twin computes: `_rust.Block`'s second
/// argument, with the fields of `plusequals.twin.config.BlockConfig` (Python's one list of them),
/// taken by name here and only here. A configuration Rust refuses raises `ValueError`.
#[pyclass(name = "Config", module = "plusequals._rust", frozen)]
pub(super) struct PyConfig {
    config: BlockConfig,
    cpp: bool,
}

#[pymethods]
impl PyConfig {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (*, dim, n_heads, d_head, context_dim=None, gated_ff=true, attention="sdpa", language="rust", lora=Vec::new(), ip_adapter=Vec::new(), processors=Vec::new()))]
    fn new(
        dim: i64,
        n_heads: i64,
        d_head: i64,
        context_dim: Option<i64>,
        gated_ff: bool,
        attention: &str,
        language: &str,
        lora: Vec<(String, i64, f64, bool, bool)>,
        ip_adapter: Vec<f64>,
        processors: Vec<(String, String, Vec<String>)>,
    ) -> PyResult<Self> {
        let cpp = match language {
            "rust" => false,
            "cpp" => true,
            other => return Err(PyValueError::new_err(format!("language must be 'rust' or 'cpp', got {other:?}"))),
        };
        let lora = lora
            .into_iter()
            .map(|(linear, rank, scaling, bias, dora)| LoraSpec { linear, rank, scaling, bias, dora })
            .collect();
        let processors =
            processors.into_iter().map(|(kind, attn, flags)| ProcessorSpec { kind, attn, flags }).collect();
        let attention = attention.parse().map_err(to_py)?;
        let config =
            BlockConfig { dim, n_heads, d_head, context_dim, gated_ff, attention, lora, ip_adapter, processors };
        Ok(PyConfig { config, cpp })
    }

    /// The CompVis keys of the weights a block of this configuration takes (the same in either
    /// language), in the order the custom ops take them: `BlockConfig::weight_keys`, the one list
    /// of them (`plusequals.twin.config` reads it).
    fn weight_keys(&self) -> PyResult<Vec<String>> {
        self.config.weight_keys().map_err(to_py)
    }

    /// Why the C++ twin cannot compute a block of this configuration, or None: `CppBlock::refusal`,
    /// the one place of it (`plusequals.twin.build` raises it before building).
    fn cpp_refusal(&self) -> PyResult<Option<String>> {
        CppBlock::refusal(&self.config).map_err(to_py)
    }
}

/// The Rust `BasicTransformerBlock` (or, with `language="cpp"`, its C++ twin). Use it through
/// `plusequals.RustBlock` / `plusequals.CppBlock`.
#[pyclass(name = "Block", module = "plusequals._rust", frozen)]
pub(super) struct PyBlock {
    block: SharedBlock,
}

#[pymethods]
impl PyBlock {
    #[new]
    fn new(weights: HashMap<String, PyTensor>, config: PyRef<'_, PyConfig>) -> PyResult<Self> {
        let cfg = &config.config;
        let mut weights: Vec<(String, Tensor)> = weights.into_iter().map(|(k, v)| (k, v.0)).collect();
        weights.sort_by(|a, b| a.0.cmp(&b.0));
        // The C++ block gets its own handles on the same weights (no copies).
        let cpp = if config.cpp { Some(CppBlock::from_weights(&weights, cfg).map_err(to_py)?) } else { None };
        let rust = BasicTransformerBlock::from_weights(weights.into_iter().collect(), cfg).map_err(to_py)?;
        Ok(PyBlock { block: SharedBlock(Twins { rust, cpp }) })
    }

    /// `op_plus_x` out of place; the GIL is released while libtorch computes. `watch`: see
    /// [`PyWatch`]; the masks and IP-Adapter's image embeddings (`ip_adapter`): see `crate::attention_extras`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, context=None, watch=None, attention_mask=None, encoder_attention_mask=None, ip_adapter=Vec::new()))]
    pub(super) fn forward(
        &self,
        py: Python<'_>,
        x: PyTensor,
        context: Option<PyTensor>,
        watch: Option<Bound<'_, PyWatch>>,
        attention_mask: Option<PyTensor>,
        encoder_attention_mask: Option<PyTensor>,
        ip_adapter: Vec<PyTensor>,
    ) -> PyResult<PyTensor> {
        check_watch(py, watch.as_ref())?;
        let (x, context) = (x.0, context.map(|c| c.0));
        let masks = [attention_mask.map(|m| m.0), encoder_attention_mask.map(|m| m.0)];
        let images: Vec<Tensor> = ip_adapter.into_iter().map(|t| t.0).collect();
        let block = &self.block;
        py.allow_threads(move || {
            let extras = AttentionExtras { ip_adapter: &images, ..masks_of(&masks) };
            block.get().forward(&x, context.as_ref(), extras)
        })
        .map(PyTensor)
        .map_err(to_py)
    }

    /// In-place residuals with grad off. `donate=false` works on a copy of `x`;
    /// `donate=true` moves `x`'s buffer into the call, as a transaction: see [`donate`].
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, context=None, donate=false, watch=None, attention_mask=None, encoder_attention_mask=None))]
    pub(super) fn forward_owned(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        context: Option<PyTensor>,
        donate: bool,
        watch: Option<Bound<'_, PyWatch>>,
        attention_mask: Option<PyTensor>,
        encoder_attention_mask: Option<PyTensor>,
    ) -> PyResult<PyTensor> {
        check_watch(py, watch.as_ref())?;
        let tensor = x.extract::<PyTensor>().map_err(|e| PyTypeError::new_err(format!("argument 'x': {e}")))?.0;
        let context = context.map(|c| c.0);
        let masks = [attention_mask.map(|m| m.0), encoder_attention_mask.map(|m| m.0)];
        check_dispatch_modes(py).map_err(to_py)?;
        let block = &self.block;
        if donate {
            return donate_into(py, block, x, tensor, (context, masks)).map(PyTensor);
        }
        py.allow_threads(move || -> Result<Tensor> {
            let twins = block.get();
            let no_grad = NoGrad::new();
            let versions = twins.rust.weights_version();
            let args = (context.as_ref(), masks_of(&masks));
            // the inputs' checks before the copy: a copy of a tensor with no dense shape (mkldnn,
            // sparse) fails inside libtorch with an error that names no argument
            twins.rust.check_inputs(&tensor, context.as_ref())?;
            Ok(twins.forward_owned(deep_copy(&tensor)?, args, &no_grad, &Caller::RUST, versions)?)
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
