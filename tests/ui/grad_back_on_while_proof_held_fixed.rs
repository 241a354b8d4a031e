//! Twin of grad_back_on_while_proof_held.rs: the guard ends after the in-place forward.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{NoGrad, Result};

pub fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let guard = NoGrad::new();
    let y = block.forward_owned(x, Some(&context), &guard)?;
    drop(guard);
    assert!(!y.requires_grad());
    Ok(())
}
