//! PyTorch: `h = x` gives the activation a second name; `x += attn1(...)` and `h += attn2(...)`
//! then both write into one tensor, and neither name means what its reader thinks. In Rust
//! only one mutable path to a value can exist at a time.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{AddInPlace, Result};

fn main() -> Result<()> {
    let block = small_block()?;
    let (mut x, context) = small_inputs()?;
    let a = block.attn1.forward(&block.norm1.forward(&x)?, None)?;
    let b = block.attn2.forward(&block.norm2.forward(&x)?, Some(&context))?;
    let x_path = &mut x;
    let h_path = &mut x;
    x_path.add_in_place(&a)?;
    h_path.add_in_place(&b)?;
    Ok(())
}
