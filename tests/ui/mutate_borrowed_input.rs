//! PyTorch: `x += self.attn1(self.norm1(x))` inside `_forward(self, x)`, where `x` is the
//! caller's tensor (the "speedup from switch to +=" commit). In Rust the out-of-place `forward`
//! only borrows `x`, and tch's in-place methods (`f_add_`, and this crate's `add_in_place`) take
//! `&mut self`: rustc refuses them on a `&Tensor` (E0596). What rustc does not refuse: tch's
//! `_out` functions write through `&Tensor` too (`x.f_add_out(x, &h)` compiles and mutates
//! `x`, tests/alias_routes.rs); clippy refuses those in this crate (tests/lint/).
use plusequals::testing::{small_block, small_inputs};
use plusequals::{AddInPlace, BasicTransformerBlock, Result};
use tch::Tensor;

fn attn1_residual(block: &BasicTransformerBlock, x: &Tensor) -> Result<()> {
    x.add_in_place(&block.attn1.forward(&block.norm1.forward(x)?, None)?)?;
    Ok(())
}

fn main() -> Result<()> {
    let block = small_block()?;
    let (x, _context) = small_inputs()?;
    attn1_residual(&block, &x)
}
