//! The honest limit of the borrow checker: `Tensor::shallow_clone` makes a second owned handle
//! on the same storage, and rustc sees two independent values. Moving one of them into the
//! in-place forward then mutates what the other one reads: the seed's caller-aliasing bug,
//! compiled without complaint.
//!
//! Why: a `tch::Tensor` is a pointer to a reference-counted C++ `at::Tensor`; ownership of the
//! Rust handle says nothing about who else holds the storage (another handle, a view, a
//! Python reference). The crate's public API never calls `shallow_clone` and never returns a
//! second handle on an input; the Python boundary, where every tensor is such a shared handle,
//! copies unless the caller donates (and then invalidates the Python handle at run time).

use plusequals::testing::{small_block, small_inputs};
use plusequals::{NoGrad, Result};

#[test]
fn shallow_clone_aliases_storage_behind_the_borrow_checker() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs();
    let before = x.copy();
    let alias = x.shallow_clone(); // compiles: rustc sees two owned values
    let no_grad = NoGrad::new();
    let y = block.forward_owned(x, Some(&context), &no_grad)?;
    assert_eq!(alias.data_ptr(), y.data_ptr(), "the alias and the output share one buffer");
    assert!(!alias.equal(&before), "the mutation leaked through the alias");
    assert!(alias.equal(&y), "the alias now reads the block's output");
    Ok(())
}

#[test]
fn a_deep_copy_is_not_affected() -> Result<()> {
    let block = small_block()?;
    let (x, context) = small_inputs();
    let kept = x.copy(); // a real copy: its own storage
    let no_grad = NoGrad::new();
    let y = block.forward_owned(x, Some(&context), &no_grad)?;
    assert_ne!(kept.data_ptr(), y.data_ptr());
    assert!(!kept.equal(&y));
    Ok(())
}
