//! Twin of mutate_borrowed_input.rs: `x = self.attn1(self.norm1(x)) + x` (the CompVis line).
use plusequals::testing::{small_block, small_inputs};
use plusequals::{BasicTransformerBlock, Result};
use tch::Tensor;

fn attn1_residual(block: &BasicTransformerBlock, x: &Tensor) -> Result<Tensor> {
    Ok(block.attn1.forward(&block.norm1.forward(x)?, None)?.f_add(x)?)
}

pub fn main() -> Result<()> {
    let block = small_block()?;
    let (x, _context) = small_inputs()?;
    let before = x.copy();
    let _y = attn1_residual(&block, &x)?;
    assert!(x.equal(&before), "the caller's x is unchanged");
    Ok(())
}
