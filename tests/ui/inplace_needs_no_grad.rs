//! PyTorch: textual inversion trains through `x += ...` with grad mode on, and backward fails
//! with "modified by an inplace operation". In Rust the in-place entry point needs a
//! `&NoGrad`, which only exists while grad mode is off; a training step has none to give.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{BasicTransformerBlock, Result};
use tch::Tensor;

fn training_step(block: &BasicTransformerBlock, x: Tensor, embedding: &Tensor) -> Result<Tensor> {
    block.forward_owned(x, Some(embedding))
}

fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let _y = training_step(&block, x, &context.set_requires_grad(true))?;
    Ok(())
}
