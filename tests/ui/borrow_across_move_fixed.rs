//! Twin of borrow_across_move.rs: the hook keeps its own copy, then `x` can be given away.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{NoGrad, Result};

pub fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let saved = x.copy();
    let no_grad = NoGrad::new();
    let y = block.forward_owned(x, Some(&context), &no_grad)?;
    assert!(!saved.equal(&y), "the hook's copy is still the block's input");
    assert!(saved.equal(&small_inputs()?.0), "the hook still reads the block's input");
    Ok(())
}
