//! `Tensor::shallow_clone` makes a second owned handle on the same `at::Tensor`, and rustc sees
//! two independent values: moving one of them into an unchecked in-place forward would mutate
//! what the other reads (the caller-aliasing bug), and it compiles without complaint. rustc cannot
//! see it; libtorch can (two handles on one `TensorImpl`), and `forward_owned` asks it before the
//! first write. `tests/alias_routes.rs` has the other routes.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use plusequals::ownership::{Alias, Holders};
use plusequals::testing::{small_block, small_inputs};
use plusequals::{Error, NoGrad, Result};

#[test]
fn shallow_clone_compiles_but_the_move_is_refused_at_run_time() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let before = x.copy();
    let alias = x.shallow_clone(); // compiles: rustc sees two owned values
    let no_grad = NoGrad::new();
    let err = block.forward_owned(x, Some(&context), &no_grad).expect_err("an aliased x must be refused");
    assert!(matches!(err, Error::NotOwned { arg: "x", why: Alias::OtherHandles(1, Holders::Rust) }), "{err:?}");
    assert!(alias.equal(&before), "nothing was written");
    // Once the alias is gone, the same tensor can be given away.
    let y = block.forward_owned(alias, Some(&context), &no_grad)?;
    assert!(!y.equal(&before));
    Ok(())
}

#[test]
fn a_deep_copy_is_not_affected() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs()?;
    let kept = x.copy(); // a real copy: its own storage
    let no_grad = NoGrad::new();
    let y = block.forward_owned(x, Some(&context), &no_grad)?;
    assert_ne!(kept.data_ptr(), y.data_ptr());
    assert!(!kept.equal(&y));
    Ok(())
}
