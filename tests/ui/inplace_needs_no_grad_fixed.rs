//! Twin of inplace_needs_no_grad.rs: training uses the out-of-place `forward`, and the
//! gradient reaches the learnable embedding.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{BasicTransformerBlock, Result};
use tch::{Kind, Tensor};

fn training_step(block: &BasicTransformerBlock, x: &Tensor, embedding: &Tensor) -> Result<Tensor> {
    block.forward(x, Some(embedding))
}

pub fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let embedding = context.set_requires_grad(true);
    let loss = training_step(&block, &x, &embedding)?.f_square()?.f_mean(Kind::Float)?;
    loss.f_backward()?;
    assert!(embedding.grad().defined());
    Ok(())
}
