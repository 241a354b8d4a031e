// What libtorch knows about a tensor's owners, for rust/ownership.rs.
//
// tch exposes none of these counts. Each function reads one libtorch invariant through the
// same headers torch-sys compiles against; nothing here allocates a tensor or mutates one (but
// two: pe_set_grad_mode sets the thread's grad mode for ownership::NoGrad, and pe_move_out is
// a donation's move, rust/python/donation.rs), and
// every function catches whatever libtorch throws, so no C++ exception can cross into Rust. A
// tch `Tensor` is a pointer to a heap `at::Tensor` (torch-sys's `C_tensor`), which is what every
// function takes.
#include <algorithm>
#include <ATen/core/Tensor.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/PyInterpreter.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <typeinfo>

extern "C" {

// Everything `ownership::check_exclusive` needs, read in one call.
struct pe_tensor_facts {
  // c10::intrusive_ptr<TensorImpl>::use_count(): the at::Tensor handles on this TensorImpl.
  // Every handle counts: a tch Tensor, tch's `shallow_clone`, the handle a Python tensor
  // object holds, and the copy autograd keeps when a SavedVariable saves an op's input.
  int64_t tensor_uses;
  // intrusive_ptr::weak_use_count() - 1: the weak_intrusive_ptrs on the TensorImpl. While any
  // strong reference lives, libtorch's count is one more than the weak references (the strong
  // references together hold one), so 0 here means none. A weak reference can be upgraded to a
  // strong one at any moment, from any thread: a second name nobody's use_count shows.
  int64_t tensor_weak_refs;
  // c10::Storage::use_count(): the strong references to the StorageImpl. Every tensor that
  // reads the memory holds one: views, `detach()`, slices, autograd's saved copy of an op's
  // output (`tensor_data()`), and a Python `UntypedStorage` object.
  int64_t storage_uses;
  // The weak references to the StorageImpl (torch.multiprocessing's StorageWeakRef, which
  // `storage._weak_ref()` makes; caches keyed by storage), counted as for the TensorImpl.
  int64_t storage_weak_refs;
  // The storage's Python object (PyObjectSlot::load_pyobj()), or null when none was ever made.
  // Rust asks Python, through the extension, whether a Python weakref points at it.
  void* storage_pyobject;
  // PyObjectSlot::has_unique_reference() of the StorageImpl: a Python `UntypedStorage` object
  // exists and nothing but libtorch's PyObject preservation holds it. Since torch 2.11 such an
  // object, once made (by `x.untyped_storage()`, say), holds a strong reference to the storage
  // for as long as the storage lives; it counts in `storage_uses`, yet no Python code can reach
  // it except through a tensor on this storage (which counts on its own) or a Python weakref
  // to it (which the extension counts).
  int32_t storage_pyobject_unreachable;
  // StorageImpl::resizable(): true only for storages libtorch allocated itself
  // (`at::empty` and friends). `from_blob` (numpy, dlpack, frombuffer) makes non-resizable ones.
  int32_t storage_resizable;
  // StorageImpl::allocator() != nullptr: the memory came from a libtorch allocator. Storages
  // that wrap foreign memory (from_blob, shared-memory maps) have none.
  int32_t storage_has_allocator;
  // DataPtr's deleter is that allocator's raw deleter: the bytes are the allocator's own,
  // not a foreign pointer later swapped into a libtorch storage (share_memory_()).
  int32_t deleter_is_allocators;
  // TensorImpl::is_view() (autograd's view metadata): a view keeps its base tensor alive, and
  // Python can reach that base (`x._base`).
  int32_t is_view;
  // Where the tensor starts in its storage and how many bytes it spans, against the storage's
  // size: Tensor::storage_offset() * element_size(), numel() * element_size(), Storage::nbytes().
  int64_t storage_offset_bytes;
  int64_t storage_nbytes;
  int64_t nbytes;
  // Tensor::is_non_overlapping_and_dense(): every element has its own bytes, none unused.
  int32_t non_overlapping_and_dense;
  // TensorImpl::is_inference() and c10::InferenceMode::is_enabled(): libtorch refuses an
  // in-place write to an inference tensor outside inference mode (and `set_`, which a
  // donation's move is).
  int32_t is_inference;
  int32_t inference_mode;
};

// What `pe_tensor_facts` found; only PE_DENSE fills `out`.
enum pe_memory : int32_t {
  PE_DENSE = 0,       // a defined strided tensor on a storage of its own
  PE_UNDEFINED = 1,   // no tensor at all
  PE_NO_STORAGE = 2,  // nested, sparse, mkldnn, ...: no dense storage whose counts mean anything
  PE_META = 3,        // shapes only: no memory, so nothing can be read or written
  PE_FUNCTORCH = 4,   // a functorch wrapper (vmap's BatchedTensor, grad's and jvp's wrappers)
  PE_PYTHON = 5,      // a tensor subclass with __torch_dispatch__: Python code owns its data and ops
};

int32_t pe_tensor_facts(const at::Tensor* t, pe_tensor_facts* out) noexcept try {
  if (t == nullptr || !t->defined()) return PE_UNDEFINED;
  const c10::DispatchKeySet keys = t->key_set();
  if (keys.has_any(c10::functorch_transforms_ks)) return PE_FUNCTORCH;
  if (keys.has(c10::DispatchKey::Python)) return PE_PYTHON;
  if (t->is_nested() || t->layout() != c10::kStrided || !t->has_storage()) return PE_NO_STORAGE;
  if (t->is_meta()) return PE_META;
  const c10::Storage& s = t->storage();
  out->tensor_uses = static_cast<int64_t>(t->use_count());
  out->tensor_weak_refs = static_cast<int64_t>(t->weak_use_count()) - 1;
  out->storage_uses = static_cast<int64_t>(s.use_count());
  // The temporary weak pointer counts itself: one for it, one for the strong references.
  out->storage_weak_refs = static_cast<int64_t>(s.getWeakStorageImpl().weak_use_count()) - 2;
  const c10::impl::PyObjectSlot* slot = s.unsafeGetStorageImpl()->pyobj_slot();
  out->storage_pyobject = slot->load_pyobj();
  out->storage_pyobject_unreachable = slot->has_unique_reference();
  out->storage_resizable = s.resizable();
  c10::Allocator* a = s.allocator();
  out->storage_has_allocator = a != nullptr;
  out->deleter_is_allocators = a != nullptr && s.data_ptr().get_deleter() == a->raw_deleter();
  out->is_view = t->is_view();
  out->storage_offset_bytes = t->storage_offset() * static_cast<int64_t>(t->element_size());
  out->storage_nbytes = static_cast<int64_t>(s.nbytes());
  out->nbytes = static_cast<int64_t>(t->numel()) * static_cast<int64_t>(t->element_size());
  out->non_overlapping_and_dense = t->is_non_overlapping_and_dense();
  out->is_inference = t->is_inference();
  out->inference_mode = c10::InferenceMode::is_enabled();
  return PE_DENSE;
} catch (...) {  // symbolic sizes and the like: no facts, so nothing is proven
  return PE_NO_STORAGE;
}

// The tensor's memory span [start, end) in bytes, for the overlap check: 0 and both ends
// written for a dense tensor (start == end when it holds no bytes), -1 otherwise.
int32_t pe_memory_span(const at::Tensor* t, uint64_t* start, uint64_t* end) noexcept try {
  if (t == nullptr || !t->defined() || t->layout() != c10::kStrided || !t->has_storage()) return -1;
  if (t->key_set().has_any(c10::functorch_transforms_ks) || t->key_set().has(c10::DispatchKey::Python)) return -1;
  const auto begin = reinterpret_cast<uint64_t>(t->storage().data());
  *start = *end = begin + static_cast<uint64_t>(t->storage_offset() * static_cast<int64_t>(t->element_size()));
  if (t->numel() == 0 || begin == 0) return 0;  // no bytes: an empty tensor, or the meta device
  int64_t last = 0;
  for (int64_t i = 0; i < t->dim(); ++i) last += (t->sizes()[i] - 1) * t->strides()[i];
  *end = *start + static_cast<uint64_t>((last + 1) * static_cast<int64_t>(t->element_size()));
  return 0;
} catch (...) {
  return -1;
}

// c10::GradMode::is_enabled(): the calling thread's grad mode (thread-local in libtorch).
int32_t pe_grad_mode_enabled() noexcept { return c10::GradMode::is_enabled(); }

// The one setter here: c10::GradMode::set_enabled, for ownership::NoGrad. Returns the mode before.
int32_t pe_set_grad_mode(int32_t enabled) noexcept {
  const bool before = c10::GradMode::is_enabled();
  c10::GradMode::set_enabled(enabled != 0);
  return before;
}

// The number of TorchDispatchModes active on this thread (user modes such as FlopCounterMode,
// and the fake, proxy and functional infrastructure modes): each one sees every op's tensors.
int64_t pe_dispatch_modes() noexcept try {
  return c10::impl::TorchDispatchModeTLS::stack_len();
} catch (...) {
  return -1;
}

// Whether Python code on this thread would see the ops of a call (RustBlock's hot path,
// rust/python/entry.rs): a TorchDispatchMode (user or infrastructure), a TorchFunctionMode, or,
// under grad mode, a saved-tensor hook (its pack function runs for every tensor saved). What
// torch._C._len_torch_dispatch_stack, _is_torch_function_mode_enabled and
// _top_saved_tensors_default_hooks read, without a Python call.
int32_t pe_python_sees_ops() noexcept try {
  return c10::impl::TorchDispatchModeTLS::stack_len() != 0 || at::impl::torch_function_mode_enabled() ||
         (c10::GradMode::is_enabled() && !at::SavedTensorDefaultHooks::get_tls_state().stack.empty());
} catch (...) {
  return 1;
}

// Whether autocast, on the calling thread, turns ops on `weight`'s device type into `t`'s dtype
// (at::autocast::is_autocast_enabled / get_autocast_dtype): then an input of that dtype is
// what autocast produces, not a mismatch with the weights.
int32_t pe_autocast_produces(const at::Tensor* t, const at::Tensor* weight) noexcept try {
  const at::DeviceType device = weight->device().type();
  return at::autocast::is_autocast_enabled(device) && at::autocast::get_autocast_dtype(device) == t->scalar_type();
} catch (...) {
  return 0;
}

// TensorImpl's version counter (bumped by every in-place write), or -1 for a tensor without one
// (inference tensors).
int64_t pe_version(const at::Tensor* t) noexcept try {
  return t->_version();
} catch (...) {
  return -1;
}

// The sum of the version counters of `n` tensors (-1 counted for each one without a counter).
int64_t pe_versions(const at::Tensor* const* ts, int64_t n) noexcept {
  int64_t sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += pe_version(ts[i]);
  return sum;
}

// The sizes of a dense tensor without a libtorch op: tch's `size()` panics on nested tensors.
// Returns the number of dimensions (writing at most `cap` sizes), or -1 for a tensor without
// dense sizes (undefined, nested, or any layout whose sizes are not strided sizes).
int64_t pe_dense_sizes(const at::Tensor* t, int64_t* sizes, int64_t cap) noexcept try {
  if (t == nullptr || !t->defined() || t->is_nested() || t->layout() != c10::kStrided) return -1;
  const int64_t dim = t->dim();
  for (int64_t i = 0; i < dim && i < cap; ++i) sizes[i] = t->sizes()[i];
  return dim;
} catch (...) {
  return -1;
}

// The tensor's device as one number (its c10::DeviceType in the high bits, its index in the low
// 16), -1 for an undefined tensor: tch's `device()` panics where this returns.
int64_t pe_device(const at::Tensor* t) noexcept try {
  if (t == nullptr || !t->defined()) return -1;
  const c10::Device d = t->device();
  return (static_cast<int64_t>(d.type()) << 16) | static_cast<int64_t>(static_cast<uint16_t>(d.index()));
} catch (...) {
  return -1;
}

// A donation's move, with no libtorch op (where `x.detach()` then `x.set_()` go through the
// dispatcher twice): returns a new handle on x's TensorImpl's storage, sizes, strides, offset and
// version counter, with no autograd history, and leaves x (the caller's Python object's tensor)
// on an empty storage of its device, shape [0], its version bumped, as `set_()` would. Returns
// nullptr, with x unchanged, where it does not apply (x's TensorImpl is not a plain strided one
// whose metadata may change) or anything throws before x is changed; the caller then moves with
// the ops.
at::Tensor* pe_move_out(const at::Tensor* x) noexcept try {
  if (x == nullptr || !x->defined()) return nullptr;
  c10::TensorImpl* impl = x->unsafeGetTensorImpl();
  if (typeid(*impl) != typeid(c10::TensorImpl) || impl->layout() != c10::kStrided ||
      !impl->allow_tensor_metadata_change() || impl->has_symbolic_sizes_strides() || !impl->has_storage()) {
    return nullptr;
  }
  auto out = std::make_unique<at::Tensor>(
      impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/true));
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, impl->device()), nullptr, false);
  // x is changed only from here, where nothing throws for a plain strided TensorImpl whose
  // metadata may change (checked above).
  impl->set_storage_keep_dtype(std::move(empty));
  impl->set_storage_offset(0);
  impl->set_sizes_contiguous({0});
  impl->bump_version();
  return out.release();
} catch (...) {
  return nullptr;
}

// The batch of an input that is dense, of shape (batch, tokens, `width`) with neither batch nor
// tokens 0, of scalar type `dtype` and on device `device` (as in pe_first_changed); -1 for any
// other (the caller then says which check fails, or accepts what autocast produces).
int64_t pe_input_batch(const at::Tensor* t, int64_t width, int64_t dtype, int64_t device) noexcept try {
  if (t == nullptr || !t->defined() || t->is_nested() || t->layout() != c10::kStrided) return -1;
  const c10::IntArrayRef s = t->sizes();
  if (s.size() != 3 || s[2] != width || s[0] == 0 || s[1] == 0) return -1;
  if (static_cast<int64_t>(t->scalar_type()) != dtype || pe_device(t) != device) return -1;
  return s[0];
} catch (...) {
  return -1;
}

// The tensor's c10::ScalarType as a number, -1 for an undefined tensor.
int64_t pe_scalar_type(const at::Tensor* t) noexcept try {
  if (t == nullptr || !t->defined()) return -1;
  return static_cast<int64_t>(t->scalar_type());
} catch (...) {
  return -1;
}

// The index of the first of `n` tensors that is not dense with its recorded sizes (`ranks[i]`
// sizes each, one after the other in `sizes`), the scalar type `dtype` (pe_scalar_type's number)
// and the device `device` (pe_device's code); -1 when every one is as recorded. One call for a
// block's weights on every forward, where one call per fact per weight cost microseconds.
int64_t pe_first_changed(const at::Tensor* const* ts, int64_t n, const int64_t* ranks, const int64_t* sizes,
                         int64_t dtype, int64_t device) noexcept try {
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* t = ts[i];
    if (t == nullptr || !t->defined() || t->is_nested() || t->layout() != c10::kStrided) return i;
    if (static_cast<int64_t>(t->scalar_type()) != dtype || pe_device(t) != device) return i;
    const c10::IntArrayRef now = t->sizes();
    if (static_cast<int64_t>(now.size()) != ranks[i] || !std::equal(now.begin(), now.end(), sizes)) return i;
    sizes += ranks[i];
  }
  return -1;
} catch (...) {
  return 0;
}

// The tensor's device as torch names it ("cpu", "cuda:0", "meta"), NUL-terminated in `buf`:
// tch calls every device other than CPU, CUDA and Vulkan "Mps".
void pe_device_name(const at::Tensor* t, char* buf, size_t len) noexcept try {
  if (len == 0) return;
  const std::string name = (t == nullptr || !t->defined()) ? "an undefined tensor" : t->device().str();
  std::strncpy(buf, name.c_str(), len - 1);
  buf[len - 1] = '\0';
} catch (...) {
  if (len > 0) buf[0] = '\0';
}

}  // extern "C"
