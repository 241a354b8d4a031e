//! The lint case: what `tests/ui/mutate_borrowed_input.rs` cannot show. tch's `_out` functions
//! write through a shared borrow, so this compiles with rustc and mutates the caller's `x`
//! (rust/aliases.rs runs it). In this crate, clippy refuses it: clippy.toml lists every tch
//! method that writes through `&Tensor` under `disallowed-methods`. The call carries
//! `#[expect(clippy::disallowed_methods)]`: `make lint`'s clippy run (`--all-targets`, which
//! checks this example, `-D warnings`) fails if clippy stops refusing it (unfulfilled expectation).
use plusequals::testing::{small_block, small_inputs};
use plusequals::{BasicTransformerBlock, Result};
use tch::Tensor;

fn attn1_residual(block: &BasicTransformerBlock, x: &Tensor) -> Result<()> {
    let h = block.attn1.forward(&block.norm1.forward(x)?, None)?;
    #[expect(clippy::disallowed_methods, reason = "the case: f_add_out writes into x through &Tensor")]
    let _same_tensor_as_x = x.f_add_out(x, &h)?;
    Ok(())
}

fn main() -> Result<()> {
    let block = small_block()?;
    let (x, _context) = small_inputs()?;
    attn1_residual(&block, &x)
}
