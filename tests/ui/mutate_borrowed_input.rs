//! PyTorch: `x += self.attn1(self.norm1(x))` inside `_forward(self, x)`, where `x` is the
//! caller's tensor (the "speedup from switch to +=" commit). In Rust the out-of-place
//! `forward` only borrows `x`, and nothing can write through a shared borrow.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{AddInPlace, BasicTransformerBlock, Result};
use tch::Tensor;

fn attn1_residual(block: &BasicTransformerBlock, x: &Tensor) -> Result<()> {
    x.add_in_place(&block.attn1.forward(&block.norm1.forward(x)?, None)?)?;
    Ok(())
}

fn main() -> Result<()> {
    let block = small_block()?;
    let (x, _context) = small_inputs();
    attn1_residual(&block, &x)
}
