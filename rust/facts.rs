//! What libtorch knows about a tensor, read through `cpp/tensor_facts.cpp` without a libtorch op
//! and without a panic: use counts, weak references, storage, device, sizes, version counters,
//! and the calling thread's grad mode, dispatch modes and autocast state; and the one setter,
//! grad mode, for `ownership::NoGrad`.
//!
//! tch's own accessors (`size`, `kind`, `device`, `data_ptr`, ...) panic on a tensor that has
//! no storage (a functorch wrapper, a `__torch_dispatch__` subclass); these return `None` or a
//! code instead. `ownership.rs` and `block.rs` read tensors only through this module.

use std::ffi::{c_char, c_void, CStr};

use tch::{Kind, Tensor};

mod ffi {
    use std::ffi::{c_char, c_void};
    use torch_sys::C_tensor;

    /// `pe_tensor_facts` in `cpp/tensor_facts.cpp`; the field comments there say what each reads.
    #[repr(C)]
    pub struct TensorFacts {
        pub tensor_uses: i64,
        pub tensor_weak_refs: i64,
        pub storage_uses: i64,
        pub storage_weak_refs: i64,
        pub storage_pyobject: *mut c_void,
        pub storage_pyobject_unreachable: i32,
        pub storage_resizable: i32,
        pub storage_has_allocator: i32,
        pub deleter_is_allocators: i32,
        pub is_view: i32,
        pub storage_offset_bytes: i64,
        pub storage_nbytes: i64,
        pub nbytes: i64,
        pub non_overlapping_and_dense: i32,
        pub is_inference: i32,
        pub inference_mode: i32,
    }

    extern "C" {
        pub fn pe_tensor_facts(t: *const C_tensor, out: *mut TensorFacts) -> i32;
        pub fn pe_memory_span(t: *const C_tensor, start: *mut u64, end: *mut u64) -> i32;
        pub fn pe_grad_mode_enabled() -> i32;
        pub fn pe_set_grad_mode(enabled: i32) -> i32;
        pub fn pe_dispatch_modes() -> i64;
        pub fn pe_python_sees_ops() -> i32;
        pub fn pe_autocast_produces(t: *const C_tensor, weight: *const C_tensor) -> i32;
        pub fn pe_version(t: *const C_tensor) -> i64;
        pub fn pe_versions(ts: *const *const C_tensor, n: i64) -> i64;
        pub fn pe_dense_sizes(t: *const C_tensor, sizes: *mut i64, cap: i64) -> i64;
        pub fn pe_device(t: *const C_tensor) -> i64;
        pub fn pe_scalar_type(t: *const C_tensor) -> i64;
        pub fn pe_move_out(x: *const C_tensor) -> *mut C_tensor;
        pub fn pe_input_batch(t: *const C_tensor, width: i64, dtype: i64, device: i64) -> i64;
        pub fn pe_first_changed(
            ts: *const *const C_tensor,
            n: i64,
            ranks: *const i64,
            sizes: *const i64,
            dtype: i64,
            device: i64,
        ) -> i64;
        pub fn pe_device_name(t: *const C_tensor, buf: *mut c_char, len: usize);
    }
}

pub use ffi::TensorFacts;

impl Default for TensorFacts {
    fn default() -> Self {
        TensorFacts {
            tensor_uses: 0,
            tensor_weak_refs: 0,
            storage_uses: 0,
            storage_weak_refs: 0,
            storage_pyobject: std::ptr::null_mut(),
            storage_pyobject_unreachable: 0,
            storage_resizable: 0,
            storage_has_allocator: 0,
            deleter_is_allocators: 0,
            is_view: 0,
            storage_offset_bytes: 0,
            storage_nbytes: 0,
            nbytes: 0,
            non_overlapping_and_dense: 0,
            is_inference: 0,
            inference_mode: 0,
        }
    }
}

/// What libtorch says about a tensor's memory (`pe_memory` in `cpp/tensor_facts.cpp`).
pub enum Memory {
    /// A dense tensor on its own storage, with its bookkeeping.
    Dense(TensorFacts),
    /// A meta tensor: shapes only, no bytes anyone could read.
    None,
    /// Nested, sparse, undefined, ...: no dense storage of its own.
    NotDense,
    /// A functorch wrapper (vmap's BatchedTensor, grad's and jvp's wrappers): no storage.
    Functorch,
    /// A tensor subclass with `__torch_dispatch__`: its data and every op on it are Python's.
    PythonSubclass,
}

/// libtorch's bookkeeping for `t`.
pub fn tensor_facts(t: &Tensor) -> Memory {
    let mut facts = TensorFacts::default();
    // SAFETY: `as_ptr` is tch's live `at::Tensor*` for `t`, which the borrow keeps alive; the
    // C++ side only reads it and writes `facts`.
    match unsafe { ffi::pe_tensor_facts(t.as_ptr(), &mut facts) } {
        0 => Memory::Dense(facts),
        3 => Memory::None,
        4 => Memory::Functorch,
        5 => Memory::PythonSubclass,
        _ => Memory::NotDense,
    }
}

/// The byte range `[start, end)` a dense tensor's elements occupy (`start == end` when it holds
/// no bytes); `None` for a tensor without dense memory.
pub fn memory_span(t: &Tensor) -> Option<(u64, u64)> {
    let (mut start, mut end) = (0u64, 0u64);
    // SAFETY: as in `tensor_facts`.
    (unsafe { ffi::pe_memory_span(t.as_ptr(), &mut start, &mut end) } == 0).then_some((start, end))
}

/// This thread's grad mode, as libtorch sees it now.
pub fn grad_mode_enabled() -> bool {
    // SAFETY: reads a thread-local flag.
    unsafe { ffi::pe_grad_mode_enabled() != 0 }
}

/// Sets this thread's grad mode and returns what it was (`ownership::NoGrad` uses it; tch's
/// `no_grad_guard` would panic on a libtorch error).
pub fn set_grad_mode(enabled: bool) -> bool {
    // SAFETY: sets a thread-local flag.
    unsafe { ffi::pe_set_grad_mode(i32::from(enabled)) != 0 }
}

/// How many TorchDispatchModes are active on this thread (each sees every op's tensors).
pub fn dispatch_modes() -> i64 {
    // SAFETY: reads thread-local state.
    unsafe { ffi::pe_dispatch_modes() }
}

/// Whether Python code on this thread would see a call's ops: a TorchDispatchMode, a
/// TorchFunctionMode, or under grad mode a saved-tensor hook (`cpp/tensor_facts.cpp`).
pub fn python_sees_ops() -> bool {
    // SAFETY: reads thread-local state.
    unsafe { ffi::pe_python_sees_ops() != 0 }
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

/// The sum of the tensors' version counters, in one call.
pub fn versions(ts: &[&Tensor]) -> i64 {
    // SAFETY: `ptrs` holds `ts.len()` live tensors, borrowed for the call.
    with_ptrs(ts, |ptrs| unsafe { ffi::pe_versions(ptrs.as_ptr(), ptrs.len() as i64) })
}

/// `f` on the tensors' pointers: on the stack for a block's weights (these run on every call).
fn with_ptrs<R>(ts: &[&Tensor], f: impl FnOnce(&[*const torch_sys::C_tensor]) -> R) -> R {
    const ON_STACK: usize = 32;
    if ts.len() <= ON_STACK {
        let mut ptrs = [std::ptr::null::<torch_sys::C_tensor>(); ON_STACK];
        for (p, t) in ptrs.iter_mut().zip(ts) {
            *p = t.as_ptr();
        }
        f(&ptrs[..ts.len()])
    } else {
        f(&ts.iter().map(|t| t.as_ptr()).collect::<Vec<_>>())
    }
}

/// A donation's move without a libtorch op (`pe_move_out`): a new handle on `x`'s buffer, and `x`
/// (every handle on its TensorImpl, the Python object's too) left empty, as `x.detach()` then
/// `x.set_()` leave it. `None`, `x` unchanged, where it does not apply: the caller then uses the ops.
pub fn move_out(x: &Tensor) -> Option<Tensor> {
    // SAFETY: `x` is a live tensor borrowed for the call; a non-null result is a new heap
    // `at::Tensor` handed over, which tch frees on drop.
    let moved = unsafe { ffi::pe_move_out(x.as_ptr()) };
    (!moved.is_null()).then(|| unsafe { Tensor::from_ptr(moved) })
}

/// What a block records of its weights at the build, to compare on every call in one C++ call
/// ([`Recorded::first_changed`]): each one's sizes, and their one dtype and device.
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    ranks: Vec<i64>,
    sizes: Vec<i64>,
    dtype: i64,
    device: i64,
}

impl Recorded {
    /// Records `ts` as they are now (each one's sizes; the first one's dtype and device).
    pub fn new(ts: &[&Tensor]) -> Self {
        let shapes: Vec<Vec<i64>> = ts.iter().map(|t| dense_size(t).unwrap_or_default()).collect();
        let ranks = shapes.iter().map(|s| s.len() as i64).collect();
        // SAFETY: as in `tensor_facts`.
        let dtype = ts.first().map_or(-1, |t| unsafe { ffi::pe_scalar_type(t.as_ptr()) });
        let device = ts.first().and_then(|t| device(t)).unwrap_or(-1);
        Recorded { ranks, sizes: shapes.concat(), dtype, device }
    }

    /// The index of the first of `ts` (the same tensors, in the same order) that is no longer
    /// dense with its recorded sizes, dtype and device; `None` when all are.
    pub fn first_changed(&self, ts: &[&Tensor]) -> Option<usize> {
        if ts.len() != self.ranks.len() {
            return Some(0);
        }
        // SAFETY: `ptrs` holds `ts.len()` live tensors borrowed for the call; `ranks` has one rank
        // per tensor and `sizes` their sum of sizes (made by `new` from as many tensors).
        let i = with_ptrs(ts, |ptrs| unsafe {
            ffi::pe_first_changed(
                ptrs.as_ptr(),
                ptrs.len() as i64,
                self.ranks.as_ptr(),
                self.sizes.as_ptr(),
                self.dtype,
                self.device,
            )
        });
        usize::try_from(i).ok()
    }

    /// The `i`-th tensor's recorded sizes (empty past the last).
    pub fn shape(&self, i: usize) -> &[i64] {
        let start: i64 = self.ranks.iter().take(i).sum();
        let rank = self.ranks.get(i).copied().unwrap_or(0);
        let (start, end) = (start as usize, (start + rank) as usize);
        self.sizes.get(start..end).unwrap_or_default()
    }

    /// The batch of `t` when it is an input these weights take as they are: dense, of shape
    /// (batch, tokens, `width`) with neither 0, of the weights' dtype and device, in one C++ call;
    /// `None` otherwise (the caller's own checks then say why, or accept autocast's dtype).
    pub fn input_batch(&self, t: &Tensor, width: i64) -> Option<i64> {
        // SAFETY: as in `tensor_facts`.
        let batch = unsafe { ffi::pe_input_batch(t.as_ptr(), width, self.dtype, self.device) };
        (batch > 0).then_some(batch)
    }
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
        Ok(d) => {
            let mut sizes = vec![0i64; d];
            // SAFETY: as above, with a buffer of `dim` values.
            let again = unsafe { ffi::pe_dense_sizes(t.as_ptr(), sizes.as_mut_ptr(), dim) };
            (again == dim).then_some(sizes)
        }
        Err(_) => None,
    }
}

/// The tensor's device as one comparable number (`None` for an undefined tensor): tch's
/// `device()` panics where this returns.
pub fn device(t: &Tensor) -> Option<i64> {
    // SAFETY: as in `tensor_facts`.
    let code = unsafe { ffi::pe_device(t.as_ptr()) };
    (code >= 0).then_some(code)
}

/// The tensor's device as torch names it: "cpu", "cuda:0", "meta" (for messages).
pub fn device_name(t: &Tensor) -> String {
    let mut buf = [0 as c_char; 64];
    // SAFETY: as in `tensor_facts`; the C++ side writes a NUL-terminated name into `buf`.
    unsafe {
        ffi::pe_device_name(t.as_ptr(), buf.as_mut_ptr(), buf.len());
        CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
    }
}

/// A Python object's address, as the C++ side reports it (a storage's `UntypedStorage`).
pub type PyObjectPtr = *mut c_void;

/// A dtype as torch names it (`torch.float32`), for messages: tch's `Kind` debug names
/// (`Float`, `Double`) are not what a PyTorch user reads.
pub fn dtype_name(kind: Kind) -> String {
    let name = match kind {
        Kind::Float => "float32",
        Kind::Double => "float64",
        Kind::Half => "float16",
        Kind::BFloat16 => "bfloat16",
        Kind::Bool => "bool",
        Kind::Uint8 => "uint8",
        Kind::Int8 => "int8",
        Kind::Int16 => "int16",
        Kind::Int => "int32",
        Kind::Int64 => "int64",
        Kind::ComplexHalf => "complex32",
        Kind::ComplexFloat => "complex64",
        Kind::ComplexDouble => "complex128",
        other => return format!("{other:?}"),
    };
    format!("torch.{name}")
}
