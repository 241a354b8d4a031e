//! The blocks behind the Python class, and what makes them shareable between Python threads.

use tch::Tensor;

use crate::attention_extras::AttentionExtras;
use crate::block::deep_copy;
use crate::cpp::CppBlock;
use crate::error::Failure;
use crate::ownership::Caller;
use crate::{BasicTransformerBlock, Error, NoGrad, Result};

/// The block behind the Python class: the Rust twin, and the C++ twin when `language="cpp"`.
/// The Rust block validates the weights and every input for both; the C++ one, when present,
/// computes.
pub(super) struct Twins {
    pub(super) rust: BasicTransformerBlock,
    pub(super) cpp: Option<CppBlock>,
}

impl Twins {
    /// Runs `f`, and discards its result if a weight was written in place meanwhile (the
    /// weights' version counters moved): see `SharedBlock`'s SAFETY note.
    pub(super) fn guarded<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let before = self.rust.weights_version();
        let out = f()?;
        if self.rust.weights_version() != before {
            return Err(Error::WeightsChanged);
        }
        Ok(out)
    }

    pub(super) fn forward(&self, x: &Tensor, context: Option<&Tensor>, extras: AttentionExtras<'_>) -> Result<Tensor> {
        self.guarded(|| self.forward_unguarded(x, context, extras))
    }

    pub(super) fn forward_unguarded(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        extras: AttentionExtras<'_>,
    ) -> Result<Tensor> {
        match &self.cpp {
            None => self.rust.forward_masked(x, context, extras),
            Some(cpp) => {
                self.rust.check_inputs(x, context)?;
                self.rust.check_masks(x, context, extras)?;
                cpp.forward_masked(x, context, extras)
            }
        }
    }

    /// The in-place forward, as a transaction: `Failure::Unwritten` hands `x` back untouched;
    /// a result computed while a weight was written in place (the weights' versions moved since
    /// `versions`, read before `x` was taken) is discarded as `Failure::Consumed`.
    pub(super) fn forward_owned(
        &self,
        x: Tensor,
        (context, extras): (Option<&Tensor>, AttentionExtras<'_>),
        no_grad: &NoGrad,
        caller: &Caller,
        versions: i64,
    ) -> Result<Tensor, Failure> {
        let y = match &self.cpp {
            None => self.rust.forward_owned_by(x, context, extras, no_grad, caller)?,
            Some(cpp) => {
                match self.rust.check_inputs(&x, context).and_then(|()| self.rust.check_masks(&x, context, extras)) {
                    Err(e) => return Err(Failure::Unwritten(e, x)),
                    Ok(()) => cpp.forward_owned_by(x, context, extras, no_grad, caller)?, // C++ checks no alias: cpp.rs does
                }
            }
        };
        if self.rust.weights_version() != versions {
            return Err(Failure::Consumed(Error::WeightsChanged));
        }
        Ok(y)
    }

    /// `n` forwards without returning to Python (grad off); `owned` reuses the last output's
    /// buffer as the next input, refilled from `x`.
    pub(super) fn forward_loop(&self, x: &Tensor, context: Option<&Tensor>, n: usize, owned: bool) -> Result<Tensor> {
        self.guarded(|| self.forward_loop_unguarded(x, context, n, owned))
    }

    pub(super) fn forward_loop_unguarded(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        n: usize,
        owned: bool,
    ) -> Result<Tensor> {
        self.rust.check_inputs(x, context)?;
        if let Some(cpp) = &self.cpp {
            return cpp.forward_loop(x, context, n as i64, owned);
        }
        let no_grad = NoGrad::new();
        let mut y = deep_copy(x)?;
        for _ in 0..n {
            y = if owned {
                let mut fresh = y;
                fresh.f_copy_(x)?;
                self.rust.forward_owned(fresh, context, &no_grad)?
            } else {
                self.rust.forward(x, context)?
            };
        }
        Ok(y)
    }
}

/// Lets Python threads call one block at the same time.
///
/// SAFETY: `tch::Tensor` is `!Sync` because some tch methods mutate through `&self`. The only
/// methods reached through a shared reference (`forward`, `forward_owned`, `forward_loop`) pass
/// the weights to libtorch ops as read-only inputs, and libtorch reads a tensor from several
/// threads safely (atomic refcounts, no lazy state on a read). Nothing here hands a weight out
/// or writes one.
///
/// The weights' storage is *not* private: `RustBlock.from_torch` and the swap share it with the
/// PyTorch module by design, so Python code can write it while Rust reads it. The contract is
/// eager PyTorch's: do not write a module's parameters while another thread runs its forward.
/// What breaking it does here:
/// * An in-place write (an optimizer step, `p.add_()`) moves the weights' version counters, and
///   the forward that overlapped it returns `WeightsChanged` instead of a result computed from
///   torn weights (`Twins::guarded`).
/// * Rebinding a parameter (`p.data = ..`, which `.half()` and `.to()` use) is not detected
///   during the forward. pyo3-tch gives this block a handle on the parameter's own `TensorImpl`
///   (autograd needs that identity for training through Rust), and `set_data` swaps that
///   `TensorImpl`'s storage in place. Done while a kernel reads the weight, it is the same data
///   race as in eager PyTorch, where the old storage may be freed under the kernel. Between
///   calls it is safe: `RustBlock` sees the changed data pointer, dtype or device on its next
///   call and rebuilds (python/plusequals/twin/faithful.py).
pub(super) struct SharedBlock(pub(super) Twins);
unsafe impl Sync for SharedBlock {}

impl SharedBlock {
    pub(super) fn get(&self) -> &Twins {
        &self.0
    }
}

/// The extras of a call with its masks only (no IP-Adapter images), borrowed from the tensors
/// Python passed (`attention_mask`, `encoder_attention_mask`).
pub(super) fn masks_of(masks: &[Option<Tensor>; 2]) -> AttentionExtras<'_> {
    AttentionExtras { attn1: masks[0].as_ref(), attn2: masks[1].as_ref(), ip_adapter: &[] }
}
