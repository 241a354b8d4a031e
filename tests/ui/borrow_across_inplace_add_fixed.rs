//! Twin of borrow_across_inplace_add.rs: what keeps `x` is a copy, as in the re-landed
//! PyTorch fix `x += self.attn1(self.norm1(x.clone()))`.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{AddInPlace, Result};

pub fn main() -> Result<()> {
    let block = small_block()?;
    let (mut x, _context) = small_inputs()?;
    let saved_by_norm1 = x.copy();
    let h = block.attn1.forward(&block.norm1.forward(&saved_by_norm1)?, None)?;
    x.add_in_place(&h)?;
    assert!(!x.equal(&saved_by_norm1));
    assert!(saved_by_norm1.equal(&small_inputs()?.0), "backward still reads norm1's input");
    Ok(())
}
