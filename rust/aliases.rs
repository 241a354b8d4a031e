//! The alias routes on the Rust side: every way this crate knows to reach `x`'s memory through
//! a second name, run against the in-place entry points, with what happened.
//!
//! `tests/alias_routes.rs` asserts each outcome; `python -m plusequals demo` runs them live
//! (through `plusequals._rust.alias_routes`) beside the PyTorch and Python-boundary columns.
//! The routes rustc refuses (a live borrow, a use after the move, a second `&mut`) cannot be
//! written here: they are the compile-fail cases in `tests/ui/`.

use std::ffi::c_void;
use std::ptr::NonNull;

use tch::{Device, IndexOp, Kind, Tensor};
use torch_sys::C_tensor;

use crate::block::{deep_copy, AddInPlace};
use crate::cpp::CppBlock;
use crate::error::{Error, Failure, Result};
use crate::ownership::NoGrad;
use crate::testing::{small_block, small_config, small_inputs, small_weights};

/// What a route did.
#[derive(Debug)]
pub enum Outcome {
    /// Refused before any write: the error, and whether the other name's bytes (or, for a
    /// route without one, the gradient that depends on them) are exactly as before.
    Refused { error: Error, unchanged: bool },
    /// The write went through and the other name reads it: tch's own API, used directly.
    Written,
    /// Nothing refused, and the other name did not change either (a route that lost its alias).
    Untouched,
}

/// One route: its name, the line that makes the second name, and the code that tries it.
pub struct Route {
    pub name: &'static str,
    pub code: &'static str,
    pub run: fn() -> Result<Outcome>,
}

/// Every route, in the order of the README's table.
pub fn routes() -> Vec<Route> {
    vec![
        Route { name: "shallow_clone", code: "let kept = x.shallow_clone();", run: shallow_clone },
        Route { name: "detach", code: "let kept = x.detach();", run: detach },
        Route { name: "view / reshape", code: "let kept = x.view([-1]);", run: view },
        Route { name: "narrow / indexing", code: "let skip = x.narrow(1, 0, 3); let row = x.i(0);", run: narrow },
        Route { name: "transpose / expand", code: "let kept = x.transpose(1, 2);", run: transpose },
        Route {
            name: "context overlaps x",
            code: "forward_owned(x, Some(&x.narrow(2, 0, 24)), ..)",
            run: context_overlaps,
        },
        Route {
            name: "grad mode back on",
            code: "tch::with_grad(|| block.forward_owned(x, .., &no_grad))",
            run: grad_back_on,
        },
        Route { name: "autograd saved x", code: "let y = &x * &w; // w learnable", run: autograd_saved },
        Route {
            name: "add_in_place while autograd holds x",
            code: "let h = attn1(norm1(&x)?)?; x.add_in_place(&h)?;",
            run: add_while_saved,
        },
        Route { name: "foreign memory", code: "unsafe { Tensor::from_blob(vec.as_ptr(), ..) }", run: foreign_memory },
        Route {
            name: "weak reference kept",
            code: "let weak = x.storage().getWeakStorageImpl(); // C++: StorageWeakRef",
            run: weak_reference,
        },
        Route {
            name: "C++ twin: shallow_clone kept",
            code: "cpp.forward_owned(x, .., &no_grad)",
            run: cpp_shallow_clone,
        },
        Route { name: "in-place op's returned handle", code: "let h = x.f_mul_scalar_(1.0)?;", run: returned_handle },
        Route {
            name: "tch API: returned handle",
            code: "let h = x.f_add_(&y)?; x.f_add_(&y)?;",
            run: tch_returned_handle_written,
        },
        Route {
            name: "tch API: _out through &Tensor",
            code: "fn f(x: &Tensor) { x.f_add_out(x, &h) }",
            run: tch_out_through_shared_borrow,
        },
    ]
}

/// Moves `x` into `forward_owned` (grad off) while `kept` still reads its memory.
fn through_forward_owned(kept: &Tensor, x: Tensor, context: Option<&Tensor>) -> Result<Outcome> {
    let block = small_block()?;
    let before = deep_copy(kept)?;
    let no_grad = NoGrad::new();
    Ok(match block.forward_owned(x, context, &no_grad) {
        Err(error) => Outcome::Refused { error, unchanged: kept.f_equal(&before)? },
        Ok(_) => written(kept, &before)?,
    })
}

fn written(kept: &Tensor, before: &Tensor) -> Result<Outcome> {
    Ok(if kept.f_equal(before)? { Outcome::Untouched } else { Outcome::Written })
}

#[allow(clippy::disallowed_methods)] // the route itself: what user code does with tch
fn shallow_clone() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let kept = x.shallow_clone();
    through_forward_owned(&kept, x, Some(&c))
}

/// The C++ twin's in-place forward has the Rust one's contract (`&NoGrad`, libtorch's counts
/// asked first): C++ itself would write through the kept handle.
#[allow(clippy::disallowed_methods)] // the route itself: what user code does with tch
fn cpp_shallow_clone() -> Result<Outcome> {
    let cfg = small_config(crate::Attention::Sdpa);
    let mut weights: Vec<_> = small_weights(0)?.into_iter().collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    let cpp = CppBlock::from_weights(&weights, &cfg)?;
    let (x, c) = small_inputs()?;
    let kept = x.shallow_clone();
    let before = deep_copy(&kept)?;
    let no_grad = NoGrad::new();
    Ok(match cpp.forward_owned(x, Some(&c), &no_grad) {
        Err(error) => Outcome::Refused { error, unchanged: kept.f_equal(&before)? },
        Ok(_) => written(&kept, &before)?,
    })
}

extern "C" {
    fn pe_storage_weak_ref(t: *const C_tensor) -> *mut c_void;
    fn pe_storage_weak_ref_upgrade(weak: *mut c_void, like: *const C_tensor) -> *mut C_tensor;
    fn pe_storage_weak_ref_free(weak: *mut c_void);
}

/// A weak reference to a tensor's storage (`cpp/weak_ref.cpp`), freed on drop.
struct StorageWeakRef(NonNull<c_void>);

impl StorageWeakRef {
    fn new(t: &Tensor) -> Result<Self> {
        // SAFETY: `t` is a live tensor; the C++ side returns a new heap weak pointer, or null.
        NonNull::new(unsafe { pe_storage_weak_ref(t.as_ptr()) })
            .map(StorageWeakRef)
            .ok_or_else(|| Error::config("no storage to refer to".into()))
    }

    /// The memory again, viewed like `like`: a second name, made from the weak reference.
    fn upgrade(&self, like: &Tensor) -> Option<Tensor> {
        // SAFETY: `self.0` is live until drop; the result is a new heap tensor that tch then owns.
        NonNull::new(unsafe { pe_storage_weak_ref_upgrade(self.0.as_ptr(), like.as_ptr()) })
            .map(|t| unsafe { Tensor::from_ptr(t.as_ptr()) })
    }
}

impl Drop for StorageWeakRef {
    fn drop(&mut self) {
        // SAFETY: made by `pe_storage_weak_ref`, freed once.
        unsafe { pe_storage_weak_ref_free(self.0.as_ptr()) }
    }
}

/// A weak reference to `x`'s storage, kept: no use count shows it, and upgraded after the call
/// it would read whatever the block wrote. `try_forward_owned` hands the refused `x` back.
fn weak_reference() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let weak = StorageWeakRef::new(&x)?;
    let before = deep_copy(&x)?;
    let block = small_block()?;
    let no_grad = NoGrad::new();
    Ok(match block.try_forward_owned(x, Some(&c), &no_grad) {
        Err(Failure::Unwritten(error, x)) => {
            let upgraded = weak.upgrade(&x).ok_or_else(|| Error::config("the storage is gone".into()))?;
            Outcome::Refused { error, unchanged: upgraded.f_equal(&before)? && x.f_equal(&before)? }
        }
        Err(failure) => return Err(failure.into()),
        Ok(y) => {
            let upgraded = weak.upgrade(&y).ok_or_else(|| Error::config("the storage is gone".into()))?;
            written(&upgraded, &before)?
        }
    })
}

fn detach() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let kept = x.f_detach()?;
    through_forward_owned(&kept, x, Some(&c))
}

fn view() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let kept = x.f_view([-1])?;
    through_forward_owned(&kept, x, Some(&c))
}

fn narrow() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let skip = x.f_narrow(1, 0, 3)?; // a skip connection kept from x
    let row = x.f_i(0)?;
    let outcome = through_forward_owned(&skip, x, Some(&c))?;
    Ok(match outcome {
        Outcome::Refused { error, unchanged } => {
            Outcome::Refused { error, unchanged: unchanged && row.f_narrow(0, 0, 3)?.f_equal(&skip.f_i(0)?)? }
        }
        written => written,
    })
}

fn transpose() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let kept = x.f_transpose(1, 2)?;
    let expanded = x.f_unsqueeze(0)?.f_expand([2, -1, -1, -1], false)?;
    let outcome = through_forward_owned(&kept, x, Some(&c))?;
    Ok(match outcome {
        Outcome::Refused { error, unchanged } => {
            Outcome::Refused { error, unchanged: unchanged && expanded.f_i(1)?.f_transpose(1, 2)?.f_equal(&kept)? }
        }
        written => written,
    })
}

fn context_overlaps() -> Result<Outcome> {
    let (x, _) = small_inputs()?;
    let context = x.f_narrow(2, 0, 24)?; // the small block's context width
    through_forward_owned(&context, x, Some(&context))
}

#[allow(clippy::disallowed_methods)] // the route itself: what user code does with tch
fn grad_back_on() -> Result<Outcome> {
    let block = small_block()?;
    let (x, c) = small_inputs()?;
    let kept = deep_copy(&c)?; // no second name on x: the check must hold on grad mode alone
    let no_grad = NoGrad::new();
    Ok(match tch::with_grad(|| block.forward_owned(x, Some(&c), &no_grad)) {
        Err(error) => Outcome::Refused { error, unchanged: c.f_equal(&kept)? },
        Ok(_) => Outcome::Written,
    })
}

/// Autograd saves `x` for the backward of `x * w`; the refusal keeps that gradient right.
fn autograd_saved() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let w = Tensor::f_ones([32], (Kind::Float, Device::Cpu))?.f_set_requires_grad(true)?;
    let y = x.f_mul(&w)?;
    let expected = x.f_sum_dim_intlist([0i64, 1].as_slice(), false, Kind::Float)?; // d sum(x * w) / dw
    let block = small_block()?;
    let result = {
        let no_grad = NoGrad::new();
        block.forward_owned(x, Some(&c), &no_grad)
    };
    Ok(match result {
        Err(error) => Outcome::Refused { error, unchanged: grad_of(&y, &w)?.f_equal(&expected)? },
        Ok(_) => Outcome::Written,
    })
}

/// The realistic E0502 sequence, no borrow kept by hand: grad on, `x` in the graph, LayerNorm
/// saved it for backward, then the in-place residual add.
fn add_while_saved() -> Result<Outcome> {
    let block = small_block()?;
    let (x0, _) = small_inputs()?;
    let residual = |w: &Tensor, in_place: bool| -> Result<(Result<()>, Tensor)> {
        let mut x = x0.f_mul(w)?; // an activation in the graph
        let h = block.attn1.forward(&block.norm1.forward(&x)?, None)?;
        let added = if in_place { x.add_in_place(&h) } else { Ok(()) };
        let y = x.f_add(&h)?; // what a refusal leaves: the out-of-place residual
        Ok((added, y))
    };
    let w = Tensor::f_ones([32], (Kind::Float, Device::Cpu))?.f_set_requires_grad(true)?;
    let (added, y) = residual(&w, true)?;
    let w_eager = w.f_detach()?.f_set_requires_grad(true)?;
    let (_, y_eager) = residual(&w_eager, false)?;
    Ok(match added {
        Err(error) => Outcome::Refused { error, unchanged: grad_of(&y, &w)?.f_equal(&grad_of(&y_eager, &w_eager)?)? },
        Ok(()) => Outcome::Written,
    })
}

fn grad_of(y: &Tensor, w: &Tensor) -> Result<Tensor> {
    let mut grads = Tensor::f_run_backward(&[y.f_sum(Kind::Float)?], &[w], false, false)?;
    grads.pop().ok_or_else(|| Error::config("no gradient".into()))
}

/// Memory a Rust `Vec` owns, wrapped by libtorch without a copy (what numpy and dlpack do).
fn foreign_memory() -> Result<Outcome> {
    let (x, c) = small_inputs()?;
    let mut owned = vec![0f32; 2 * 16 * 32];
    let n = owned.len();
    x.f_copy_data(&mut owned, n)?;
    let before = owned.clone();
    // SAFETY: `owned` outlives `wrapped` (dropped inside this function before `owned`), holds
    // exactly the 2 * 16 * 32 floats described, and is not touched by Rust meanwhile.
    let wrapped =
        unsafe { Tensor::f_from_blob(owned.as_ptr() as *const u8, &[2, 16, 32], &[], Kind::Float, Device::Cpu)? };
    let block = small_block()?;
    let no_grad = NoGrad::new();
    let result = block.forward_owned(wrapped, Some(&c), &no_grad);
    Ok(match result {
        Err(error) => Outcome::Refused { error, unchanged: owned == before },
        Ok(_) => Outcome::Written,
    })
}

/// tch's in-place ops return a second handle on the same tensor; kept, it is an alias.
fn returned_handle() -> Result<Outcome> {
    let (mut x, c) = small_inputs()?;
    let kept = x.f_mul_scalar_(1.0)?;
    through_forward_owned(&kept, x, Some(&c))
}

/// tch's own API in user code, which this crate cannot refuse: the handle an in-place op
/// returned reads every later in-place write to `x`.
fn tch_returned_handle_written() -> Result<Outcome> {
    let (mut x, _) = small_inputs()?;
    let one = x.f_ones_like()?;
    let kept = x.f_add_(&one)?;
    let before = deep_copy(&kept)?;
    let _ = x.f_add_(&one)?;
    written(&kept, &before)
}

/// tch's `_out` functions write through `&Tensor`: this compiles and mutates the caller's `x`.
/// This crate's own code cannot call them (clippy.toml, `disallowed-methods`).
#[allow(clippy::disallowed_methods)] // the route itself: what user code can do with tch
fn tch_out_through_shared_borrow() -> Result<Outcome> {
    fn attn1_residual(x: &Tensor, h: &Tensor) -> Result<()> {
        let _same_tensor_as_x = x.f_add_out(x, h)?;
        Ok(())
    }
    let block = small_block()?;
    let (x, _) = small_inputs()?;
    let before = deep_copy(&x)?;
    let h = block.attn1.forward(&block.norm1.forward(&x)?, None)?;
    attn1_residual(&x, &h)?;
    written(&x, &before)
}
