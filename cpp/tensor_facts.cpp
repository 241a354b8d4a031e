// What libtorch knows about a tensor's owners, for rust/ownership.rs.
//
// tch exposes none of these counts. Each function reads one libtorch invariant through the
// same headers torch-sys compiles against; nothing here allocates or mutates, and every function
// catches whatever libtorch throws, so no C++ exception can cross into Rust. A tch `Tensor` is a pointer to a heap `at::Tensor`
// (torch-sys's `C_tensor`), which is what every function takes.
#include <ATen/core/Tensor.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/PyInterpreter.h>
#include <cstdint>

extern "C" {

// Everything `ownership::check_owned` needs, read in one call.
struct pe_tensor_facts {
  // c10::intrusive_ptr<TensorImpl>::use_count(): the at::Tensor handles on this TensorImpl.
  // Every handle counts: a tch Tensor, tch's `shallow_clone`, the handle a Python tensor
  // object holds, and the copy autograd keeps when a SavedVariable saves an op's input.
  int64_t tensor_uses;
  // c10::Storage::use_count(): the strong references to the StorageImpl. Every tensor that
  // reads the memory holds one: views, `detach()`, slices, autograd's saved copy of an op's
  // output (`tensor_data()`), and a Python `UntypedStorage` object.
  int64_t storage_uses;
  // PyObjectSlot::has_unique_reference() of the StorageImpl: a Python `UntypedStorage` object
  // exists and nothing but libtorch's PyObject preservation holds it. Since torch 2.11 such an
  // object, once made (by `x.untyped_storage()`, say), holds a strong reference to the storage
  // for as long as the storage lives; it counts in `storage_uses`, yet no Python code can reach
  // it except through a tensor on this storage, which counts on its own.
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
};

// 0 and `out` filled for a defined dense tensor; 1 for an undefined one, 2 for a tensor with
// no storage of its own (nested, sparse, mkldnn, ...), whose counts mean nothing here; 3 for a
// meta tensor (shapes only: no memory, so nothing can be read or written).
int32_t pe_tensor_facts(const at::Tensor* t, pe_tensor_facts* out) noexcept try {
  if (t == nullptr || !t->defined()) return 1;
  if (t->is_nested() || t->layout() != c10::kStrided || !t->has_storage()) return 2;
  if (t->is_meta()) return 3;
  const c10::Storage& s = t->storage();
  out->tensor_uses = static_cast<int64_t>(t->use_count());
  out->storage_uses = static_cast<int64_t>(s.use_count());
  out->storage_pyobject_unreachable = s.unsafeGetStorageImpl()->pyobj_slot()->has_unique_reference();
  out->storage_resizable = s.resizable();
  c10::Allocator* a = s.allocator();
  out->storage_has_allocator = a != nullptr;
  out->deleter_is_allocators = a != nullptr && s.data_ptr().get_deleter() == a->raw_deleter();
  out->is_view = t->is_view();
  out->storage_offset_bytes = t->storage_offset() * static_cast<int64_t>(t->element_size());
  out->storage_nbytes = static_cast<int64_t>(s.nbytes());
  out->nbytes = static_cast<int64_t>(t->numel()) * static_cast<int64_t>(t->element_size());
  out->non_overlapping_and_dense = t->is_non_overlapping_and_dense();
  return 0;
} catch (...) {  // symbolic sizes and the like: no facts, so nothing is proven
  return 2;
}

// c10::GradMode::is_enabled(): the calling thread's grad mode (thread-local in libtorch).
int32_t pe_grad_mode_enabled() noexcept { return c10::GradMode::is_enabled(); }

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

}  // extern "C"
