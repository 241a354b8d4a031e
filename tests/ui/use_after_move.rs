//! PyTorch: `y = block(x)` with `+=` inside, then `skip = x + y`: the caller (the UNet's
//! skip connection) still holds `x` and reads what the block wrote into it. In Rust the
//! in-place entry point takes `x` by value: after the call there is no `x` to read.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{NoGrad, Result};

fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let no_grad = NoGrad::new();
    let y = block.forward_owned(x, Some(&context), &no_grad)?;
    let _skip = x.f_add(&y)?;
    Ok(())
}
