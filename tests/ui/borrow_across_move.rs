//! PyTorch: a forward hook saved the block's input (`saved = x`), then `block(x)` with `+=`
//! rewrote it, so the hook later reads the block's output. In Rust a borrow of `x` that is
//! still alive forbids moving `x` into the in-place entry point.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{NoGrad, Result};
use tch::{Kind, Tensor};

fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let saved: &Tensor = &x;
    let no_grad = NoGrad::new();
    let _y = block.forward_owned(x, Some(&context), &no_grad)?;
    println!("hook saw mean {}", saved.f_mean(Kind::Float)?);
    Ok(())
}
