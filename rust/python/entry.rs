//! RustBlock's hot path: [`PyEntry`], a block bound to the watch of its last reading.

use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyType;
use pyo3::PyTraverseError;
use pyo3_tch::PyTensor;

use super::block::PyBlock;
use super::watch::PyWatch;
use crate::facts::{grad_mode_enabled, python_sees_ops};

/// A block and the watch of its last reading (`RustBlock._entry`), called once per forward: it
/// checks, in that one crossing, what the full path checks in Python (`twin.dispatch.seen_by_python`)
/// (plain tensors, and no dispatch mode, function mode or, under grad mode, saved-tensor hook that
/// would see the ops), then runs the block's own call, which compares the watch first and then
/// checks the weights, the inputs, autocast and, for a donation, ownership. Where Python code
/// could see the call it returns `NotImplemented`, and RustBlock takes its full path.
#[pyclass(name = "Entry", module = "plusequals._rust", frozen)]
pub(super) struct PyEntry {
    block: Py<PyBlock>,
    watch: Option<Py<PyWatch>>,
}

#[pymethods]
impl PyEntry {
    #[new]
    #[pyo3(signature = (block, watch=None))]
    fn new(block: Py<PyBlock>, watch: Option<Py<PyWatch>>) -> Self {
        PyEntry { block, watch }
    }

    /// The block it calls (for the tests: it is the RustBlock's current one).
    #[getter]
    fn block(&self, py: Python<'_>) -> Py<PyBlock> {
        self.block.clone_ref(py)
    }

    /// The watch it passes (for the tests: the RustBlock's last reading's).
    #[getter]
    fn watch(&self, py: Python<'_>) -> Option<Py<PyWatch>> {
        self.watch.as_ref().map(|w| w.clone_ref(py))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.block)?;
        if let Some(w) = &self.watch {
            visit.call(w)?;
        }
        Ok(())
    }

    /// `Block.forward(x, context, watch)`, or `NotImplemented` where Python code could see it.
    #[pyo3(signature = (x, context=None))]
    fn forward(&self, py: Python<'_>, x: &Bound<'_, PyAny>, context: Option<&Bound<'_, PyAny>>) -> PyResult<PyObject> {
        if !plain(py, x, context)? {
            return Ok(py.NotImplemented());
        }
        let context = context.map(|c| c.extract::<PyTensor>()).transpose()?;
        let watch = self.watch.as_ref().map(|w| w.bind(py).clone());
        let y = self.block.get().forward(py, x.extract()?, context, watch, None, None, Vec::new())?;
        Ok(y.into_pyobject(py)?.into_any().unbind())
    }

    /// `Block.forward_owned(x, context, donate, watch)` with grad mode off, or `NotImplemented`
    /// where Python code could see it or grad mode is on (RustBlock then refuses inputs that
    /// require grad, naming the textual-inversion bug).
    #[pyo3(signature = (x, context=None, donate=false))]
    fn forward_owned(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        context: Option<&Bound<'_, PyAny>>,
        donate: bool,
    ) -> PyResult<PyObject> {
        if !plain(py, x, context)? || grad_mode_enabled() {
            return Ok(py.NotImplemented());
        }
        let context = context.map(|c| c.extract::<PyTensor>()).transpose()?;
        let watch = self.watch.as_ref().map(|w| w.bind(py).clone());
        let y = self.block.get().forward_owned(py, x, context, donate, watch, None, None)?;
        Ok(y.into_pyobject(py)?.into_any().unbind())
    }
}

/// `x` a `torch.Tensor` or `nn.Parameter` (exactly), `context` one or None, and no Python code
/// that would see the ops (`crate::facts::python_sees_ops`).
fn plain(py: Python<'_>, x: &Bound<'_, PyAny>, context: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
    static CLASSES: GILOnceCell<(Py<PyType>, Py<PyType>)> = GILOnceCell::new();
    let (tensor, parameter) = CLASSES.get_or_try_init(py, || -> PyResult<_> {
        let torch = py.import("torch")?;
        let tensor = torch.getattr("Tensor")?.downcast_into::<PyType>()?.unbind();
        let parameter = torch.getattr("nn")?.getattr("Parameter")?.downcast_into::<PyType>()?.unbind();
        Ok((tensor, parameter))
    })?;
    let (tensor, parameter) = (tensor.as_ptr().cast::<pyo3::ffi::PyTypeObject>(), parameter.as_ptr().cast());
    let is_plain = |t: &Bound<'_, PyAny>| {
        // SAFETY: `t` is a live object (borrowed for the call); its type pointer is only compared.
        let cls = unsafe { pyo3::ffi::Py_TYPE(t.as_ptr()) };
        cls == tensor || cls == parameter
    };
    Ok(is_plain(x) && context.is_none_or(is_plain) && !python_sees_ops())
}
