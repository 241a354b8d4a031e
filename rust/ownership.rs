//! Types that make the seed's bugs unrepresentable, and the one door the borrow checker
//! cannot watch.
//!
//! * Caller aliasing (`x += ...` mutating the caller's tensor): [`BasicTransformerBlock::forward`]
//!   borrows `x` immutably; [`BasicTransformerBlock::forward_owned`] takes it by value, so the
//!   caller cannot use it afterwards (E0382) or keep a borrow across the call (E0505).
//! * Autograd's "modified by an inplace operation": the in-place entry point needs a
//!   `&NoGrad`, a proof that grad mode is off for as long as the borrow lives. A training step
//!   (grad on) has no such value, and dropping the guard while the proof is borrowed is E0505.
//! * The limit: `Tensor::shallow_clone` (and any `at::Tensor` handle made on the C++ side, such
//!   as a Python reference to the same tensor) aliases storage behind rustc's back. The block's
//!   API never calls it and never hands out a second handle; see `tests/shallow_clone.rs`.
//!
//! [`BasicTransformerBlock::forward`]: crate::block::BasicTransformerBlock::forward
//! [`BasicTransformerBlock::forward_owned`]: crate::block::BasicTransformerBlock::forward_owned

use std::marker::PhantomData;

use tch::Tensor;

use crate::block::dense_size;
use crate::error::{Error, Result};

/// Grad mode is off while a `NoGrad` lives; `&NoGrad` is the proof the in-place forward needs.
///
/// Grad mode is thread-local in libtorch, so the guard is neither `Send` nor `Sync`: it
/// cannot be moved to, or shared with, a thread whose grad mode it does not control.
pub struct NoGrad {
    _guard: tch::NoGradGuard,
    _not_send: PhantomData<*const ()>,
}

impl NoGrad {
    /// Turns grad mode off for this thread until the value is dropped (then restores it).
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        NoGrad { _guard: tch::no_grad_guard(), _not_send: PhantomData }
    }
}

/// Checks that `x` can be written in place: no two of its elements share memory (a stride-0
/// dimension), and `context`, which is read after the writes start, does not overlap it.
///
/// This is the run-time half of a move for tensors that arrive from outside Rust (Python), where
/// the borrow checker cannot see other handles on the same storage.
pub fn check_donatable(x: &Tensor, context: Option<&Tensor>) -> Result<()> {
    let size = dense_size(x).map_err(|e| Error::input("x", format!("has no dense shape ({e})")))?;
    let stride = x.stride(); // dense: safe
    if size.iter().zip(&stride).any(|(&n, &s)| n > 1 && s == 0) {
        return Err(Error::input(
            "x",
            "has overlapping memory (a stride-0 dimension): it cannot be written in place".into(),
        ));
    }
    if let Some(c) = context {
        let overlap = overlaps(x, c).map_err(|e| Error::input("context", format!("has no dense shape ({e})")))?;
        if overlap {
            return Err(Error::input(
                "context",
                "overlaps the donated x, which the in-place forward overwrites".into(),
            ));
        }
    }
    Ok(())
}

/// Whether the memory spans of two tensors intersect (by address range).
fn overlaps(a: &Tensor, b: &Tensor) -> Result<bool> {
    let span = |t: &Tensor| -> Result<(usize, usize)> {
        let start = t.data_ptr() as usize;
        let size = dense_size(t)?;
        let stride = t.stride(); // dense: safe
        if size.contains(&0) {
            return Ok((start, start));
        }
        let last: i64 = size.iter().zip(&stride).map(|(&n, &s)| (n - 1) * s).sum();
        Ok((start, start + (last as usize + 1) * t.f_kind()?.elt_size_in_bytes()))
    };
    let ((a0, a1), (b0, b1)) = (span(a)?, span(b)?);
    Ok(a0 < b1 && b0 < a1)
}
