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
//! * not a view, and no other tensor on its storage (views, `detach`, slices, a Python
//!   `UntypedStorage`);
//! * the memory is libtorch's: allocated by a libtorch allocator, not wrapped around a
//!   foreign pointer (`from_blob`, numpy, dlpack, `frombuffer`, shared memory), and not marked
//!   non-resizable (`x.numpy()` marks it, for the numpy array that may read it);
//! * `x` covers its storage exactly, from offset 0, with no element sharing bytes;
//! * grad mode is off on this thread at the moment of the call (the `&NoGrad` proves that a
//!   guard exists, not that nobody turned grad mode back on with `tch::with_grad`);
//! * `context` does not overlap `x`.
//!
//! What neither half covers: tch's own API in user code. Its in-place ops return a second
//! handle (`let h = x.f_add_(&y)?`), and its `f_*_out(&self, out: &Tensor, ..)` functions and
//! `f_internal_copy_from(&self, dst: &Tensor)` write through a shared borrow. This crate's own
//! code is kept free of those by clippy (`clippy.toml`, `disallowed-methods`); see
//! `tests/alias_routes.rs` for each route.
//!
//! [`BasicTransformerBlock::forward`]: crate::block::BasicTransformerBlock::forward
//! [`BasicTransformerBlock::forward_owned`]: crate::block::BasicTransformerBlock::forward_owned

use std::fmt;
use std::marker::PhantomData;

use tch::Tensor;

use crate::error::{Error, Result};

/// Grad mode is off while a `NoGrad` lives; `&NoGrad` is the proof the in-place forward needs.
///
/// Grad mode is thread-local in libtorch, so the guard is neither `Send` nor `Sync`: it
/// cannot be moved to, or shared with, a thread whose grad mode it does not control. The
/// proof is checked again at run time ([`Alias::GradMode`]): code inside the guard's scope can
/// still turn grad mode on (`tch::with_grad`).
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

/// Why a tensor cannot be written in place: someone else can read its memory, or the write
/// would corrupt a gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Alias {
    /// `n` handles on the tensor besides the ones the caller gave up: a view's hold on its base,
    /// `shallow_clone`, a copy autograd saved for backward, tch's in-place return value, a
    /// Python reference.
    OtherHandles(i64),
    /// A view of another tensor, which it keeps alive (Python can reach it as `x._base`).
    View,
    /// `n` other tensors (or Python storages) on the same memory: views, `detach`, slices.
    SharedStorage(i64),
    /// The bytes belong to someone libtorch does not track (numpy, dlpack, `frombuffer`,
    /// `from_blob`, shared memory), who may still read them.
    ForeignMemory,
    /// libtorch's own memory, marked non-resizable: `x.numpy()` does that, so that the numpy
    /// array, which may still read it, never sees it freed (the mark stays after the array is
    /// gone, so this refusal can be stricter than needed).
    NotResizable,
    /// Elements share bytes (a stride-0 or overlapping layout), or the layout has gaps.
    NotDense,
    /// The tensor covers only part of its storage; the rest may be someone else's.
    PartOfStorage { offset: i64, nbytes: i64, storage_nbytes: i64 },
    /// A nested, sparse or other tensor without one dense storage of its own.
    NoStorage,
    /// Grad mode is on: autograd may record the in-place writes, or have saved what they
    /// overwrite.
    GradMode,
    /// `context` shares memory with `x`, which the forward overwrites before it reads `context`.
    OverlapsX,
}

impl Alias {
    /// A few words for tables (the demo's run-time column).
    pub fn label(&self) -> String {
        match self {
            Alias::OtherHandles(n) => format!("{n} other handle(s)"),
            Alias::View => "a view".into(),
            Alias::SharedStorage(n) => format!("storage shared with {n}"),
            Alias::ForeignMemory => "foreign memory".into(),
            Alias::NotResizable => "non-resizable (numpy view?)".into(),
            Alias::NotDense => "not dense".into(),
            Alias::PartOfStorage { .. } => "part of a storage".into(),
            Alias::NoStorage => "no storage".into(),
            Alias::GradMode => "grad mode on".into(),
            Alias::OverlapsX => "overlaps x".into(),
        }
    }
}

impl fmt::Display for Alias {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Alias::OtherHandles(n) => write!(
                f,
                "has {n} other handle(s) on it (a view of it, which keeps it alive; shallow_clone; a tensor \
                 autograd saved for backward; the handle an in-place op returned; a Python reference), which \
                 would read the in-place writes"
            ),
            Alias::View => write!(
                f,
                "is a view of another tensor, which the view keeps alive and which would read the in-place writes"
            ),
            Alias::SharedStorage(n) => write!(
                f,
                "shares its storage with {n} other tensor(s) or storage object(s) (views, detach(), slices), \
                 which would read the in-place writes"
            ),
            Alias::ForeignMemory => write!(
                f,
                "is memory libtorch did not allocate (numpy, dlpack, frombuffer, from_blob or shared memory): \
                 its owner may still read it"
            ),
            Alias::NotResizable => {
                write!(f, "has a storage marked non-resizable, as x.numpy() leaves it: a numpy array may still read it")
            }
            Alias::NotDense => write!(f, "has overlapping or non-dense memory (a stride-0 dimension or gaps)"),
            Alias::PartOfStorage { offset, nbytes, storage_nbytes } => write!(
                f,
                "covers {nbytes} of its storage's {storage_nbytes} bytes from byte offset {offset}: \
                 the rest of the storage may be another tensor's"
            ),
            Alias::NoStorage => write!(f, "has no dense storage of its own (nested, sparse, ...)"),
            Alias::GradMode => write!(
                f,
                "is written in place while grad mode is on (tch::with_grad inside the no-grad scope?): autograd \
                 may have saved what the writes overwrite"
            ),
            Alias::OverlapsX => write!(f, "overlaps x, which the in-place forward overwrites before reading it"),
        }
    }
}

mod ffi {
    use torch_sys::C_tensor;

    /// `pe_tensor_facts` in `cpp/tensor_facts.cpp`; the field comments there say what each reads.
    #[repr(C)]
    #[derive(Default)]
    pub struct TensorFacts {
        pub tensor_uses: i64,
        pub storage_uses: i64,
        pub storage_pyobject_unreachable: i32,
        pub storage_resizable: i32,
        pub storage_has_allocator: i32,
        pub deleter_is_allocators: i32,
        pub is_view: i32,
        pub storage_offset_bytes: i64,
        pub storage_nbytes: i64,
        pub nbytes: i64,
        pub non_overlapping_and_dense: i32,
    }

    extern "C" {
        pub fn pe_tensor_facts(t: *const C_tensor, out: *mut TensorFacts) -> i32;
        pub fn pe_grad_mode_enabled() -> i32;
        pub fn pe_dense_sizes(t: *const C_tensor, sizes: *mut i64, cap: i64) -> i64;
        pub fn pe_autocast_produces(t: *const C_tensor, weight: *const C_tensor) -> i32;
        pub fn pe_version(t: *const C_tensor) -> i64;
    }
}

pub use ffi::TensorFacts;

/// What libtorch says about a tensor's memory.
pub enum Memory {
    /// A dense tensor on its own storage, with its bookkeeping.
    Dense(TensorFacts),
    /// A meta tensor: shapes only, no bytes anyone could read.
    None,
    /// Nested, sparse, undefined, ...: no dense storage of its own.
    NotDense,
}

/// libtorch's bookkeeping for `t`.
pub fn tensor_facts(t: &Tensor) -> Memory {
    let mut facts = TensorFacts::default();
    // SAFETY: `as_ptr` is tch's live `at::Tensor*` for `t`, which the borrow keeps alive; the
    // C++ side only reads it and writes `facts`.
    match unsafe { ffi::pe_tensor_facts(t.as_ptr(), &mut facts) } {
        0 => Memory::Dense(facts),
        3 => Memory::None,
        _ => Memory::NotDense,
    }
}

/// This thread's grad mode, as libtorch sees it now.
pub fn grad_mode_enabled() -> bool {
    // SAFETY: reads a thread-local flag.
    unsafe { ffi::pe_grad_mode_enabled() != 0 }
}

/// Whether autocast is on for `weight`'s device type on this thread and casts to `t`'s dtype:
/// then `t` is what autocast produces (a bf16 activation beside fp32 weights), not a mismatch.
pub fn autocast_produces(t: &Tensor, weight: &Tensor) -> bool {
    // SAFETY: as in `tensor_facts`; reads thread-local autocast state.
    unsafe { ffi::pe_autocast_produces(t.as_ptr(), weight.as_ptr()) != 0 }
}

/// `t`'s version counter, which every in-place write bumps (-1 for a tensor without one).
pub fn version(t: &Tensor) -> i64 {
    // SAFETY: as in `tensor_facts`.
    unsafe { ffi::pe_version(t.as_ptr()) }
}

/// The sizes of a dense tensor, or `None` for one that has none (nested and other layouts,
/// where tch's `size()` panics). Reads the sizes directly: no libtorch op, no allocation
/// beyond the returned vector.
pub fn dense_size(t: &Tensor) -> Option<Vec<i64>> {
    let mut sizes = [0i64; 8];
    // SAFETY: as in `tensor_facts`; the C++ side writes at most `sizes.len()` values.
    let dim = unsafe { ffi::pe_dense_sizes(t.as_ptr(), sizes.as_mut_ptr(), sizes.len() as i64) };
    match usize::try_from(dim) {
        Ok(d) if d <= sizes.len() => Some(sizes[..d].to_vec()),
        Ok(_) => {
            let mut sizes = vec![0i64; dim as usize];
            // SAFETY: as above, with a buffer of `dim` values.
            let again = unsafe { ffi::pe_dense_sizes(t.as_ptr(), sizes.as_mut_ptr(), dim) };
            (again == dim).then_some(sizes)
        }
        Err(_) => None,
    }
}

/// The run-time half of a move: proves from libtorch's bookkeeping that nobody but the caller
/// can read `x`'s memory, that grad mode is off, and that `context` does not overlap `x`.
/// `Err(Error::NotOwned { .. })` names the argument and the [`Alias`]; nothing is written.
pub fn check_owned(x: &Tensor, context: Option<&Tensor>) -> Result<()> {
    check_owned_with_handles(x, context, 1)
}

/// [`check_owned`] for a caller that holds `handles` handles on `x`'s `TensorImpl` and gives
/// them all up (the Python glue: its own handle and the Python object's, which it empties).
pub fn check_owned_with_handles(x: &Tensor, context: Option<&Tensor>, handles: i64) -> Result<()> {
    if grad_mode_enabled() {
        return Err(Error::NotOwned { arg: "x", why: Alias::GradMode });
    }
    if let Some(c) = context {
        if overlaps(x, c)? {
            return Err(Error::NotOwned { arg: "context", why: Alias::OverlapsX });
        }
    }
    check_exclusive(x, handles).map_err(|why| Error::NotOwned { arg: "x", why })
}

/// Nobody but the holder of `handles` handles can read `t`'s memory: no other handle on its
/// `TensorImpl`, no other tensor on its storage, memory libtorch allocated, covered exactly.
/// The ownership half of [`check_owned`], without the grad-mode rule; `AddInPlace` uses it.
pub fn check_exclusive(t: &Tensor, handles: i64) -> std::result::Result<(), Alias> {
    let f = match tensor_facts(t) {
        Memory::Dense(f) => f,
        Memory::None => return Ok(()), // nothing to read, nothing written
        Memory::NotDense => return Err(Alias::NoStorage),
    };
    if f.storage_has_allocator == 0 || f.deleter_is_allocators == 0 {
        return Err(Alias::ForeignMemory);
    }
    if f.storage_resizable == 0 {
        return Err(Alias::NotResizable);
    }
    if f.tensor_uses > handles {
        return Err(Alias::OtherHandles(f.tensor_uses - handles));
    }
    if f.is_view != 0 {
        return Err(Alias::View);
    }
    let storage_uses = f.storage_uses - i64::from(f.storage_pyobject_unreachable != 0);
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

/// Whether the memory spans of two tensors intersect (by address range).
fn overlaps(a: &Tensor, b: &Tensor) -> Result<bool> {
    let span = |arg: &'static str, t: &Tensor| -> Result<(usize, usize)> {
        let size = dense_size(t).ok_or(Error::NotOwned { arg, why: Alias::NoStorage })?;
        let start = t.data_ptr() as usize;
        if size.contains(&0) || start == 0 {
            // no bytes (an empty tensor, or the meta device, which only infers shapes)
            return Ok((start, start));
        }
        let stride = t.stride(); // dense: safe
        let last: i64 = size.iter().zip(&stride).map(|(&n, &s)| (n - 1) * s).sum();
        Ok((start, start + (last as usize + 1) * t.f_kind()?.elt_size_in_bytes()))
    };
    let ((a0, a1), (b0, b1)) = (span("x", a)?, span("context", b)?);
    Ok(a0 < b1 && b0 < a1)
}
