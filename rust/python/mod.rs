//! The PyO3 glue (feature `python`): the extension module `plusequals._rust`. Nothing here
//! computes; the blocks live in `block.rs` and `cpp.rs`, the ownership rule in `ownership.rs`.
//!
//! * `errors`: the exception classes, and [`Error`](crate::Error) mapped to them;
//! * `watch`: the per-call check of a block made from a module;
//! * `twins`: the Rust and C++ blocks behind the class, shareable between Python threads;
//! * `block`: the class `Block` (argument conversion, GIL release);
//! * `entry`: `Entry`, a block bound to its watch: RustBlock's hot path;
//! * `donation`: a donation from Python, as a transaction;
//! * `tools`: what the demo and the tests call besides the block.

use pyo3::prelude::*;

mod block;
mod donation;
mod entry;
mod errors;
mod tools;
mod twins;
mod watch;

use block::{PyBlock, PyConfig};
use entry::PyEntry;
use errors::CLASSES;
#[cfg(feature = "failpoints")]
use tools::_fail_next_forward_owned_at;
use tools::{alias_routes, cpp_gallery, tensor_facts};
use watch::PyWatch;

#[pymodule]
fn _rust(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // pyo3-tch can only unwrap tensors once torch's Python classes are registered.
    m.py().import("torch")?;
    m.add_class::<PyBlock>()?;
    m.add_class::<PyConfig>()?;
    m.add_class::<PyWatch>()?;
    m.add_class::<PyEntry>()?;
    for class in CLASSES {
        m.add(class.short_name(), class.get(m.py())?)?;
    }
    m.add_function(wrap_pyfunction!(alias_routes, m)?)?;
    m.add_function(wrap_pyfunction!(cpp_gallery, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_facts, m)?)?;
    // The transaction tests' fault injection: only in the test build (feature `failpoints`).
    #[cfg(feature = "failpoints")]
    m.add_function(wrap_pyfunction!(_fail_next_forward_owned_at, m)?)?;
    m.add("TCH_VERSION", env!("PLUSEQUALS_TCH_VERSION"))?; // Cargo.toml's pin (build.rs)
    m.add("RUSTC_VERSION", env!("PLUSEQUALS_RUSTC_VERSION"))?;
    Ok(())
}
