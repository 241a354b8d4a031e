//! PyTorch: `x += self.attn1(self.norm1(x))` while autograd still holds `x` (LayerNorm saved
//! its input for backward): "one of the variables needed for gradient computation has been
//! modified by an inplace operation". Here a Rust borrow kept by hand stands in for what autograd
//! saved, and rustc refuses the in-place add while it lives (E0502). Autograd's real saved tensor
//! is not a Rust borrow: `let h = attn1(norm1(&x)?)?; x.add_in_place(&h)?;` in grad mode compiles,
//! and libtorch's count refuses it at run time (tests/alias_routes.rs).
use plusequals::testing::{small_block, small_inputs};
use plusequals::{AddInPlace, Result};
use tch::Kind;

fn main() -> Result<()> {
    let block = small_block()?;
    let (mut x, _context) = small_inputs()?;
    let saved_by_norm1 = &x;
    let h = block.attn1.forward(&block.norm1.forward(saved_by_norm1)?, None)?;
    x.add_in_place(&h)?;
    println!("backward reads {}", saved_by_norm1.f_mean(Kind::Float)?);
    Ok(())
}
