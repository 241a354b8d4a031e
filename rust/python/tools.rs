//! What the demo and the tests call besides the block: the alias routes, the C++ gallery,
//! libtorch's facts about a tensor, and fault injection.

use pyo3::prelude::*;
use pyo3_tch::PyTensor;

use super::donation::python_weakrefs;
use super::errors::to_py;
use crate::aliases::Outcome;
use crate::cpp::CppBlock;
use crate::{Error, Result};

/// Runs every Rust alias route (`rust/aliases.rs`) now: `(name, what happened)` pairs.
#[pyfunction]
pub(super) fn alias_routes(py: Python<'_>) -> Vec<(String, String)> {
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
pub(super) fn tensor_facts(py: Python<'_>, t: PyTensor) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
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
/// "after_first_write"; `None` disarms): the transaction tests' fault injection (failpoint.rs,
/// feature `failpoints`: the extension `make build-dev` builds for the tests, not the wheel).
#[cfg(feature = "failpoints")]
#[pyfunction]
#[pyo3(signature = (step))]
pub(super) fn _fail_next_forward_owned_at(step: Option<&str>) -> PyResult<()> {
    use crate::failpoint::{fail_next_at, Step};
    use pyo3::exceptions::PyValueError;
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
pub(super) fn cpp_gallery(py: Python<'_>) -> PyResult<Vec<(String, bool, String)>> {
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
