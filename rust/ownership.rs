//! Ownership of an activation, in two halves: what rustc proves, and what libtorch is asked.
//!
//! **Compile time.** [`BasicTransformerBlock::forward`] borrows `x`, so it cannot write into
//! it through tch's `&mut self` in-place ops (E0596). [`BasicTransformerBlock::forward_owned`]
//! takes `x` by value, so the caller cannot read it afterwards (E0382) or keep a Rust borrow
//! across the call (E0505), and it needs a `&NoGrad`, the proof that a no-grad guard is alive
//! (E0061, E0505). rustc sees Rust values and Rust borrows, nothing else.
//!
//! **Run time.** A `tch::Tensor` is a pointer to a reference-counted C++ `at::Tensor`, and
//! every tch op that returns a view (`detach`, `view`, `narrow`, `i`, `transpose`, ...) returns a
//! new owned `Tensor` on the same memory, with no lifetime. Autograd keeps its own handles on
//! the tensors it saved, a Python object holds one, numpy can own the bytes. rustc sees none
//! of these. So before the in-place forward writes, [`check_owned`] asks libtorch's own
//! bookkeeping (`cpp/tensor_facts.cpp`) and refuses, naming the reason and writing nothing,
//! unless all of this holds:
//!
//! * no other handle on `x`'s `TensorImpl` (`shallow_clone`, a tensor autograd saved for
//!   backward, the handle returned by tch's in-place ops, a Python reference);
//! * no weak reference on it, its storage or its storage's Python object (`StorageWeakRef`,
//!   `weakref.ref(x.untyped_storage())`): no use count shows one, and any can be upgraded to a
//!   strong name at any moment, from any thread;
//! * no `__torch_dispatch__` subclass or functorch wrapper as `x` or `context`, and no
//!   TorchDispatchMode active: each would see `x` inside the in-place ops, and could keep it;
//! * not a view, and no other tensor on its storage (views, `detach`, slices, a Python
//!   `UntypedStorage`);
//! * the memory is libtorch's: allocated by a libtorch allocator, not wrapped around a
//!   foreign pointer (`from_blob`, numpy, dlpack, `frombuffer`, shared memory), and not marked
//!   non-resizable (`x.numpy()` marks it, for the numpy array that may read it);
//! * `x` covers its storage exactly, from offset 0, with no element sharing bytes;
//! * grad mode is off on this thread at the moment of the call (the `&NoGrad` proves that a
//!   guard exists, not that nobody turned grad mode back on with `tch::with_grad`);
//! * `context` does not overlap `x`;
//! * an inference tensor is written only in inference mode (libtorch refuses it otherwise).
//!
//! What neither half covers: tch's own API in user code. Its in-place ops return a second
//! handle (`let h = x.f_add_(&y)?`), and its `f_*_out(&self, out: &Tensor, ..)` functions and
//! `f_internal_copy_from(&self, dst: &Tensor)` write through a shared borrow. This crate's own
//! code is kept free of those by clippy (`clippy.toml`, `disallowed-methods`); see
//! `tests/alias_routes.rs` for each route.
//!
//! [`BasicTransformerBlock::forward`]: crate::block::BasicTransformerBlock::forward
//! [`BasicTransformerBlock::forward_owned`]: crate::block::BasicTransformerBlock::forward_owned

use std::marker::PhantomData;

use tch::Tensor;

pub use crate::error::{Alias, Holders};
use crate::error::{Error, Result};
use crate::facts::{dispatch_modes, grad_mode_enabled, memory_span, set_grad_mode, tensor_facts, Memory, PyObjectPtr};

/// Grad mode is off while a `NoGrad` lives; `&NoGrad` is the proof the in-place forward needs.
///
/// Grad mode is thread-local in libtorch, so the guard is neither `Send` nor `Sync`: it
/// cannot be moved to, or shared with, a thread whose grad mode it does not control. The
/// proof is checked again at run time ([`Alias::GradMode`]): code inside the guard's scope can
/// still turn grad mode on (`tch::with_grad`).
pub struct NoGrad {
    /// The thread's grad mode before, restored on drop.
    was_enabled: bool,
    _not_send: PhantomData<*const ()>,
}

impl NoGrad {
    /// Turns grad mode off for this thread until the value is dropped (then restores it).
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        NoGrad { was_enabled: set_grad_mode(false), _not_send: PhantomData }
    }
}

impl Drop for NoGrad {
    fn drop(&mut self) {
        set_grad_mode(self.was_enabled);
    }
}

/// Who calls an in-place entry point, as far as the ownership check is concerned.
pub struct Caller<'a> {
    /// The handles on `x`'s `TensorImpl` the caller holds and gives up: 1 for a moved `Tensor`;
    /// 2 for the extension's donation (its own handle, and the Python object's, which it empties).
    pub handles: i64,
    /// Counts the Python weak references to a Python object (the extension asks Python). `None`
    /// outside Python: an existing storage object is then counted as reachable.
    pub python_weakrefs: Option<&'a dyn Fn(PyObjectPtr) -> i64>,
}

impl Caller<'static> {
    /// Rust code that moved its own `Tensor` in.
    pub const RUST: Caller<'static> = Caller { handles: 1, python_weakrefs: None };
}

/// The run-time half of a move: proves from libtorch's bookkeeping that nobody but the caller
/// can read `x`'s memory, that grad mode is off, and that `context` does not overlap `x`.
/// `Err(Error::NotOwned { .. })` names the argument and the [`Alias`]; nothing is written.
pub fn check_owned(x: &Tensor, context: Option<&Tensor>) -> Result<()> {
    check_owned_by(x, context, &Caller::RUST)
}

/// [`check_owned`] for a given [`Caller`] (the Python glue: two handles, and Python's weakrefs).
pub fn check_owned_by(x: &Tensor, context: Option<&Tensor>, caller: &Caller) -> Result<()> {
    let refuse = |arg, why| Err(Error::NotOwned { arg, why });
    if grad_mode_enabled() {
        return refuse("x", Alias::GradMode);
    }
    if dispatch_modes() != 0 {
        return refuse("x", Alias::DispatchModes(Vec::new()));
    }
    if let Some(c) = context {
        check_readable(c).or_else(|why| refuse("context", why))?;
        if overlaps(x, c) {
            return refuse("context", Alias::OverlapsX);
        }
    }
    check_exclusive(x, caller).or_else(|why| refuse("x", why))?;
    if let Memory::Dense(f) = tensor_facts(x) {
        if f.is_inference != 0 && f.inference_mode == 0 {
            return Err(Error::input(
                "x",
                "is an inference tensor (made under torch.inference_mode()), which libtorch refuses to write in \
                 place outside inference mode: call under torch.inference_mode(), or pass x.clone()"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// A tensor the in-place forward reads while it writes `x` (the context): one whose ops stay in
/// libtorch. A `__torch_dispatch__` subclass would receive `x` itself in the in-place adds.
fn check_readable(t: &Tensor) -> std::result::Result<(), Alias> {
    match tensor_facts(t) {
        Memory::Functorch => Err(Alias::Functorch),
        Memory::PythonSubclass => Err(Alias::PythonSubclass),
        _ => Ok(()),
    }
}

/// Nobody but the caller can read `t`'s memory: no other handle on its `TensorImpl`, no weak
/// reference that could become one, no other tensor on its storage, memory libtorch
/// allocated, covered exactly. The ownership half of [`check_owned`], without the grad-mode
/// rule; `AddInPlace` uses it.
pub fn check_exclusive(t: &Tensor, caller: &Caller) -> std::result::Result<(), Alias> {
    let f = match tensor_facts(t) {
        Memory::Dense(f) => f,
        Memory::None => return Ok(()), // nothing to read, nothing written
        Memory::NotDense => return Err(Alias::NoStorage),
        Memory::Functorch => return Err(Alias::Functorch),
        Memory::PythonSubclass => return Err(Alias::PythonSubclass),
    };
    if f.storage_has_allocator == 0 || f.deleter_is_allocators == 0 {
        return Err(Alias::ForeignMemory);
    }
    if f.storage_resizable == 0 {
        return Err(Alias::NotResizable);
    }
    // The storage's Python object, if one exists: weakly referenced, or reachable at all?
    let (object_weakrefs, object_unreachable) = match (f.storage_pyobject.is_null(), caller.python_weakrefs) {
        (true, _) => (0, false),
        (false, Some(count)) => {
            let n = count(f.storage_pyobject);
            (n, n == 0 && f.storage_pyobject_unreachable != 0)
        }
        (false, None) => (0, false), // no Python to ask: counted as reachable below
    };
    let storage_uses = f.storage_uses - i64::from(object_unreachable);
    if f.tensor_uses > caller.handles {
        let holders = match (storage_uses > 1, caller.python_weakrefs.is_some()) {
            (true, _) => Holders::Views,
            (false, true) => Holders::Cpp,
            (false, false) => Holders::Rust,
        };
        return Err(Alias::OtherHandles(f.tensor_uses - caller.handles, holders));
    }
    let weak = f.tensor_weak_refs + f.storage_weak_refs + object_weakrefs;
    if weak > 0 {
        return Err(Alias::WeakRefs(weak));
    }
    if f.is_view != 0 {
        return Err(Alias::View);
    }
    if storage_uses > 1 {
        return Err(Alias::SharedStorage(storage_uses - 1));
    }
    if f.non_overlapping_and_dense == 0 {
        return Err(Alias::NotDense);
    }
    if f.storage_offset_bytes != 0 || f.nbytes != f.storage_nbytes {
        let (offset, nbytes, storage_nbytes) = (f.storage_offset_bytes, f.nbytes, f.storage_nbytes);
        return Err(Alias::PartOfStorage { offset, nbytes, storage_nbytes });
    }
    Ok(())
}

/// Whether the memory spans of two tensors intersect. A tensor without dense memory overlaps
/// nothing here (the exclusivity check refuses it on its own terms).
fn overlaps(a: &Tensor, b: &Tensor) -> bool {
    match (memory_span(a), memory_span(b)) {
        (Some((a0, a1)), Some((b0, b1))) => a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1,
        _ => false,
    }
}
