//! Twin of two_mutable_paths.rs: one name, one write after the other.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{AddInPlace, Result};

pub fn main() -> Result<()> {
    let block = small_block()?;
    let (mut x, context) = small_inputs()?;
    let a = block.attn1.forward(&block.norm1.forward(&x)?, None)?;
    let b = block.attn2.forward(&block.norm2.forward(&x)?, Some(&context))?;
    let expected = x.f_add(&a)?.f_add(&b)?;
    x.add_in_place(&a)?;
    x.add_in_place(&b)?;
    assert!(x.allclose(&expected, 1e-6, 1e-6, false));
    Ok(())
}
