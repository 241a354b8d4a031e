//! PyTorch: `with torch.no_grad(): ...` ends, grad mode is back on, and the in-place forward
//! runs anyway. In Rust the proof `&NoGrad` borrows the guard: the guard (and so the no-grad
//! mode) cannot end while the proof is still to be used.
use plusequals::testing::{small_block, small_inputs};
use plusequals::{NoGrad, Result};

fn main() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let guard = NoGrad::new();
    let proof = &guard;
    drop(guard);
    let _y = block.forward_owned(x, Some(&context), proof)?;
    Ok(())
}
