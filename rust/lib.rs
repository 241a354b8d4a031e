//! plusequals: the Stable Diffusion v1 residual block in Rust (tch-rs), and the ownership
//! types that keep `+=` safe. With the `python` feature this crate is also the extension
//! module `plusequals._rust` (`python.rs`).

pub mod aliases;
pub mod block;
pub mod cpp;
pub mod error;
pub mod ownership;
pub mod testing;

/// The extension module `plusequals._rust` (feature `python`, built by maturin).
#[cfg(feature = "python")]
mod python;

pub use block::{AddInPlace, Attention, BasicTransformerBlock, BlockConfig};
pub use error::{Error, Result};
pub use ownership::NoGrad;
