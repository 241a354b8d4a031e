//! The libtorch C++ twin (`cpp/block.cpp`), reached through its C ABI (`cpp/capi.cpp`), and the
//! C++ bug gallery (`cpp/gallery.cpp`). C++ computes; this file only passes handles and errors.
//!
//! The C++ block shares the weights' storage (each key is a second `at::Tensor` handle), as
//! the Rust block does. Every C++ exception is caught on the C++ side and arrives here as an
//! `Err` with its message.

use std::ffi::{c_char, CStr, CString};
use std::ptr::NonNull;

use tch::Tensor;
use torch_sys::C_tensor;

use crate::attention_extras::AttentionExtras;
use crate::block::{Attention, BlockConfig};
use crate::error::{Error, Failure, Result};
use crate::facts::version;
use crate::failpoint::{self, Step};
use crate::ownership::{check_owned_by, Caller, NoGrad};
use crate::processor::ProcessorKind;

#[repr(C)]
struct RawBlock {
    _private: [u8; 0],
}

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn pe_cpp_block_new(
        keys: *const *const c_char,
        tensors: *const *const C_tensor,
        n: i64,
        dim: i64,
        n_heads: i64,
        d_head: i64,
        context_dim: i64,
        gated_ff: i32,
        einsum: i32,
        ip_scales: *const f64,
        n_ip: i64,
        err: *mut c_char,
        len: usize,
    ) -> *mut RawBlock;
    fn pe_cpp_block_free(block: *mut RawBlock);
    fn pe_cpp_forward(
        block: *const RawBlock,
        owned: i32,
        x: *const C_tensor,
        context: *const C_tensor,
        mask1: *const C_tensor,
        mask2: *const C_tensor,
        images: *const *const C_tensor,
        n_images: i64,
        err: *mut c_char,
        len: usize,
    ) -> *mut C_tensor;
    fn pe_cpp_forward_loop(
        block: *const RawBlock,
        x: *const C_tensor,
        context: *const C_tensor,
        n: i64,
        owned: i32,
        err: *mut c_char,
        len: usize,
    ) -> *mut C_tensor;
    fn pe_cpp_case_count() -> i64;
    fn pe_cpp_case_name(i: i64) -> *const c_char;
    fn pe_cpp_case_run(
        i: i64,
        block: *const RawBlock,
        x: *const C_tensor,
        context: *const C_tensor,
        what: *mut c_char,
        len: usize,
    ) -> i32;
}

const ERR_LEN: usize = 1024;

/// Calls `f` with an error buffer; a null result becomes `Err` with the C++ message.
fn call<T>(f: impl FnOnce(*mut c_char, usize) -> *mut T) -> Result<NonNull<T>> {
    let mut err = [0 as c_char; ERR_LEN]; // on the stack: this runs on every call
    let out = f(err.as_mut_ptr(), ERR_LEN);
    NonNull::new(out).ok_or_else(|| {
        // SAFETY: the C++ side wrote a NUL-terminated message into the buffer (or left zeros).
        let msg = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        Error::Cpp(msg)
    })
}

fn tensor(ptr: NonNull<C_tensor>) -> Tensor {
    // SAFETY: a new heap `at::Tensor` the C++ side handed over; tch frees it on drop.
    unsafe { Tensor::from_ptr(ptr.as_ptr()) }
}

fn opt(t: Option<&Tensor>) -> *const C_tensor {
    t.map_or(std::ptr::null(), |t| t.as_ptr())
}

/// The C++ `BasicTransformerBlock`, built from the same CompVis-keyed weights.
pub struct CppBlock {
    raw: NonNull<RawBlock>,
}

// SAFETY: the C++ block is immutable after construction (every method is `const`) and holds
// only `at::Tensor` handles, read by libtorch ops; libtorch reads a tensor from several
// threads safely (atomic refcounts). Moving it to another thread is equally safe.
unsafe impl Send for CppBlock {}
unsafe impl Sync for CppBlock {}

impl CppBlock {
    /// Why the C++ twin cannot compute a block of this configuration (the adapters it has no
    /// code for), or `None`.
    pub fn refusal(cfg: &BlockConfig) -> Result<Option<String>> {
        let rust = "use the Rust block (RustBlock)";
        if let Some(term) = cfg.lora.first() {
            return Ok(Some(format!(
                "the C++ twin computes no LoRA terms ({} carries an adapter): {rust}",
                term.linear
            )));
        }
        if let Some(spec) = cfg.processors.first() {
            let name = ProcessorKind::find(&spec.kind)?.name;
            return Ok(Some(format!("the C++ twin computes no {name} ({} carries it): {rust}", spec.attn)));
        }
        Ok(None)
    }

    /// Takes the weights by key (the caller validates them: see `BasicTransformerBlock::from_weights`).
    pub fn from_weights(weights: &[(String, Tensor)], cfg: &BlockConfig) -> Result<Self> {
        if let Some(why) = Self::refusal(cfg)? {
            return Err(Error::config(why));
        }
        let keys: Vec<CString> = weights
            .iter()
            .map(|(k, _)| CString::new(k.as_str()).map_err(|_| Error::config(format!("key {k:?} holds a NUL"))))
            .collect::<Result<_>>()?;
        let key_ptrs: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
        let tensors: Vec<*const C_tensor> = weights.iter().map(|(_, t)| t.as_ptr()).collect();
        let raw = call(|err, len| {
            // SAFETY: the arrays hold `weights.len()` live keys and tensors for the whole call;
            // the C++ side copies the handles it keeps.
            unsafe {
                pe_cpp_block_new(
                    key_ptrs.as_ptr(),
                    tensors.as_ptr(),
                    weights.len() as i64,
                    cfg.dim,
                    cfg.n_heads,
                    cfg.d_head,
                    cfg.context_dim.unwrap_or(cfg.dim),
                    cfg.gated_ff.into(),
                    (cfg.attention == Attention::Einsum).into(),
                    cfg.ip_adapter.as_ptr(),
                    cfg.ip_adapter.len() as i64,
                    err,
                    len,
                )
            }
        })?;
        Ok(CppBlock { raw })
    }

    /// `forward(const at::Tensor& x, ...)`: out of place.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.forward_masked(x, context, AttentionExtras::NONE)
    }

    /// [`forward`](Self::forward) with the attentions' masks and IP-Adapter's image embeddings
    /// ([`AttentionExtras`]; the caller checks the masks).
    pub fn forward_masked(&self, x: &Tensor, context: Option<&Tensor>, extras: AttentionExtras<'_>) -> Result<Tensor> {
        self.call_forward(false, x, context, extras)
    }

    /// `pe_cpp_forward`: C++'s `forward`, or with `owned` its `forward_owned` on `x`'s buffer.
    fn call_forward(
        &self,
        owned: bool,
        x: &Tensor,
        context: Option<&Tensor>,
        extras: AttentionExtras<'_>,
    ) -> Result<Tensor> {
        let (m1, m2) = (opt(extras.attn1), opt(extras.attn2));
        let images: Vec<*const C_tensor> = extras.ip_adapter.iter().map(|t| t.as_ptr()).collect();
        let n = images.len() as i64;
        // SAFETY: `raw` is live; `x`, `context`, the masks and the images outlive the call. Owned,
        // the C++ side takes a second handle on `*x` for the call, so `x` still holds the buffer if
        // it throws.
        call(|err, len| unsafe {
            let (block, x, context) = (self.raw.as_ptr(), x.as_ptr(), opt(context));
            pe_cpp_forward(block, owned.into(), x, context, m1, m2, images.as_ptr(), n, err, len)
        })
        .map(tensor)
    }

    /// `forward_owned(at::Tensor x, ...)`: `x` given up, residuals added into it, with the same
    /// contract as `BasicTransformerBlock::forward_owned`: the `&NoGrad` proof, and libtorch's
    /// counts asked first (`ownership::check_owned`), because C++ itself checks nothing of the kind.
    pub fn forward_owned(&self, x: Tensor, context: Option<&Tensor>, no_grad: &NoGrad) -> Result<Tensor> {
        self.try_forward_owned(x, context, no_grad).map_err(Error::from)
    }

    /// [`forward_owned`](Self::forward_owned) that hands `x` back, untouched, when it fails
    /// before the first write ([`Failure::Unwritten`]). C++ does not say where it failed, so the
    /// first write is read from `x`'s version counter, which every in-place write bumps; an
    /// inference tensor has none, and its failure is [`Failure::Consumed`], to be safe.
    pub fn try_forward_owned(&self, x: Tensor, context: Option<&Tensor>, no_grad: &NoGrad) -> Result<Tensor, Failure> {
        self.forward_owned_by(x, context, AttentionExtras::NONE, no_grad, &Caller::RUST)
    }

    /// [`try_forward_owned`](Self::try_forward_owned) for a given [`Caller`] (the Python glue).
    pub(crate) fn forward_owned_by(
        &self,
        x: Tensor,
        context: Option<&Tensor>,
        extras: AttentionExtras<'_>,
        _grad_off: &NoGrad,
        caller: &Caller,
    ) -> Result<Tensor, Failure> {
        if let Err(e) = check_owned_by(&x, context, caller).and_then(|()| failpoint::check(Step::BeforeFirstWrite)) {
            return Err(Failure::Unwritten(e, x));
        }
        let before = version(&x);
        let result = self
            .call_forward(true, &x, context, extras)
            .and_then(|y| failpoint::check(Step::AfterFirstWrite).map(|()| y)); // C++ has written by now
        match result {
            Ok(y) => Ok(y),
            Err(e) if before >= 0 && version(&x) == before => Err(Failure::Unwritten(e, x)),
            Err(e) => Err(Failure::Consumed(e)),
        }
    }

    /// `n` forwards without leaving C++ (grad off).
    pub fn forward_loop(&self, x: &Tensor, context: Option<&Tensor>, n: i64, owned: bool) -> Result<Tensor> {
        // SAFETY: as in `forward`.
        call(|err, len| unsafe {
            pe_cpp_forward_loop(self.raw.as_ptr(), x.as_ptr(), opt(context), n, owned.into(), err, len)
        })
        .map(tensor)
    }

    /// Runs every case of `cpp/gallery.cpp` on copies of `x` and `context`:
    /// `(case, whether its bug happened, what it saw)`; a case that itself failed is `Err`.
    pub fn gallery(&self, x: &Tensor, context: &Tensor) -> Vec<(String, Result<bool>, String)> {
        // SAFETY: static strings and a case index in range; `raw`, `x`, `context` are live.
        (0..unsafe { pe_cpp_case_count() })
            .map(|i| {
                let name = unsafe { CStr::from_ptr(pe_cpp_case_name(i)) }.to_string_lossy().into_owned();
                let mut what = vec![0 as c_char; ERR_LEN];
                let r = unsafe {
                    pe_cpp_case_run(i, self.raw.as_ptr(), x.as_ptr(), context.as_ptr(), what.as_mut_ptr(), ERR_LEN)
                };
                let what = unsafe { CStr::from_ptr(what.as_ptr()) }.to_string_lossy().into_owned();
                let result = if r < 0 { Err(Error::Cpp(what.clone())) } else { Ok(r == 1) };
                (name, result, what)
            })
            .collect()
    }
}

impl Drop for CppBlock {
    fn drop(&mut self) {
        // SAFETY: made by `pe_cpp_block_new`, freed once.
        unsafe { pe_cpp_block_free(self.raw.as_ptr()) }
    }
}
