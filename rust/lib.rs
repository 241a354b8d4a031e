//! plusequals: the Stable Diffusion v1 residual block in Rust (tch-rs), and the ownership
//! types that keep `+=` safe. With the `python` feature this crate is also the extension
//! module `plusequals._rust` (`python/`).
//!
//! No panic may cross into Python: outside tests, the crate denies `unwrap`, `expect` and
//! `panic!`, and clippy.toml forbids every tch call that panics on a libtorch error (the crate
//! uses the `f_` forms and `facts.rs` instead).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
// A function is capped by how tangled it is, not by its lines: clippy.toml's
// `cognitive-complexity-threshold` (make lint's -D warnings turns this warning into a failure).
#![warn(clippy::cognitive_complexity)]

pub mod attention_extras;
pub mod block;
pub mod cpp;
pub mod error;
pub mod facts;
pub mod ip_adapter;
pub mod linear;
pub mod ownership;
pub mod processor;
pub mod weights;

// Test support, not API: the alias routes (run by tests/alias_routes.rs and, through the
// extension, by the demo), fault injection for the transaction tests, and the small seeded blocks
// the tests, the compile-fail twins and the demo share. Public because those callers are other
// crates (integration tests, trybuild's) and the extension; hidden from the documentation.
#[doc(hidden)]
pub mod aliases;
#[doc(hidden)]
pub mod failpoint;
#[doc(hidden)]
pub mod testing;

/// The extension module `plusequals._rust` (feature `python`, built by maturin).
#[cfg(feature = "python")]
mod python;

pub use attention_extras::AttentionExtras;
pub use block::{AddInPlace, Attention, BasicTransformerBlock, BlockConfig, LoraSpec, ProcessorSpec};
pub use error::{Error, Failure, Result};
pub use ownership::NoGrad;
