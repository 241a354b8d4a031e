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
        NoGrad {
            _guard: tch::no_grad_guard(),
            _not_send: PhantomData,
        }
    }
}
