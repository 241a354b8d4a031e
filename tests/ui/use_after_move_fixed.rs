//! Twin of use_after_move.rs: a caller that needs `x` afterwards lends it to `forward`.
use plusequals::testing::{small_block, small_inputs};
use plusequals::Result;

pub fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let before = x.copy();
    let y = block.forward(&x, Some(&context))?;
    let _skip = x.f_add(&y)?;
    assert!(x.equal(&before));
    Ok(())
}
