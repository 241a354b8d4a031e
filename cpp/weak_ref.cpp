// A weak reference to a tensor's storage, made the way torch.multiprocessing's StorageWeakRef
// makes one (`storage._weak_ref()`: a c10::weak_intrusive_ptr<StorageImpl>), for the Rust alias
// route that shows the in-place forward refusing it (rust/aliases.rs). It raises no use count,
// and can be upgraded to a strong name at any moment: that is what makes it an owner.
#include <ATen/ATen.h>

extern "C" {

void* pe_storage_weak_ref(const at::Tensor* t) noexcept try {
  return new c10::weak_intrusive_ptr<c10::StorageImpl>(t->storage().getWeakStorageImpl());
} catch (...) {
  return nullptr;
}

// Upgrades the weak reference and views the storage with `like`'s dtype, sizes and strides: a
// second name on the memory, or null when the storage is gone.
at::Tensor* pe_storage_weak_ref_upgrade(void* weak, const at::Tensor* like) noexcept try {
  auto strong = static_cast<c10::weak_intrusive_ptr<c10::StorageImpl>*>(weak)->lock();
  if (!strong) return nullptr;
  return new at::Tensor(at::empty({0}, like->options()).set_(c10::Storage(std::move(strong)), 0, like->sizes(),
                                                            like->strides()));
} catch (...) {
  return nullptr;
}

void pe_storage_weak_ref_free(void* weak) noexcept {
  delete static_cast<c10::weak_intrusive_ptr<c10::StorageImpl>*>(weak);
}

}  // extern "C"
