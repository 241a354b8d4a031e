// The C ABI of the C++ twin, for rust/cpp.rs. Every entry point catches every exception and
// reports it through `err` (a NUL-terminated message), so no C++ exception crosses into Rust.
// Tensors cross as tch's `C_tensor`, an `at::Tensor*`; a returned tensor is a new heap handle
// that the caller owns (tch::Tensor::from_ptr).
#include <cstring>
#include <exception>

#include "block.h"

using plusequals::BasicTransformerBlock;

namespace {

void set_error(char* err, size_t len, const char* msg) {
  if (err != nullptr && len > 0) {
    std::strncpy(err, msg, len - 1);
    err[len - 1] = '\0';
  }
}

template <typename F>
auto guarded(char* err, size_t len, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    set_error(err, len, e.what_without_backtrace());
  } catch (const std::exception& e) {
    set_error(err, len, e.what());
  } catch (...) {
    set_error(err, len, "unknown C++ exception");
  }
  return nullptr;
}

std::optional<at::Tensor> optional(const at::Tensor* t) {
  return t == nullptr ? std::nullopt : std::optional<at::Tensor>(*t);
}

// IP-Adapter's image embeddings: `n` handles (none without IP-Adapter).
plusequals::Images images_of(const at::Tensor* const* images, int64_t n) {
  plusequals::Images out;
  for (int64_t i = 0; i < n; ++i) out.push_back(*images[i]);
  return out;
}

}  // namespace

extern "C" {

BasicTransformerBlock* pe_cpp_block_new(const char* const* keys, const at::Tensor* const* tensors, int64_t n,
                                        int64_t dim, int64_t n_heads, int64_t d_head, int64_t context_dim,
                                        int32_t gated_ff, int32_t einsum, const double* ip_scales, int64_t n_ip,
                                        char* err, size_t len) {
  return guarded(err, len, [&]() -> BasicTransformerBlock* {
    plusequals::Weights w;
    for (int64_t i = 0; i < n; ++i) w.emplace(keys[i], *tensors[i]);
    const plusequals::Config cfg{dim,
                                 n_heads,
                                 d_head,
                                 context_dim,
                                 gated_ff != 0,
                                 einsum != 0 ? plusequals::Attention::Einsum : plusequals::Attention::Sdpa,
                                 std::vector<double>(ip_scales, ip_scales + n_ip)};
    return new BasicTransformerBlock(w, cfg);
  });
}

void pe_cpp_block_free(BasicTransformerBlock* block) { delete block; }

// `forward` (out of place), or with `owned` set `forward_owned`, whose `x` is taken by value: the
// block gets a second handle on `*x`'s tensor, so the caller (rust/cpp.rs, which checked that it
// owns `x` alone) still holds the buffer if the block throws, and can tell from its version
// counter whether anything was written.
at::Tensor* pe_cpp_forward(const BasicTransformerBlock* block, int32_t owned, const at::Tensor* x,
                           const at::Tensor* context, const at::Tensor* mask1, const at::Tensor* mask2,
                           const at::Tensor* const* images, int64_t n_images, char* err, size_t len) {
  return guarded(err, len, [&] {
    const auto ctx = optional(context);
    const auto m1 = optional(mask1), m2 = optional(mask2);
    const auto ims = images_of(images, n_images);
    return new at::Tensor(owned != 0 ? block->forward_owned(*x, ctx, m1, m2, ims)
                                     : block->forward(*x, ctx, m1, m2, ims));
  });
}

// `n` forwards without leaving C++: `forward` on `x`, or `forward_owned` on a buffer refilled
// from `x` each time (as rust/python/twins.rs's forward_loop does).
at::Tensor* pe_cpp_forward_loop(const BasicTransformerBlock* block, const at::Tensor* x, const at::Tensor* context,
                                int64_t n, int32_t owned, char* err, size_t len) {
  return guarded(err, len, [&] {
    c10::NoGradGuard no_grad;
    const auto ctx = optional(context);
    at::Tensor y = x->clone();
    for (int64_t i = 0; i < n; ++i) {
      if (owned != 0) {
        y.copy_(*x);
        y = block->forward_owned(std::move(y), ctx);
      } else {
        y = block->forward(*x, ctx);
      }
    }
    return new at::Tensor(std::move(y));
  });
}

}  // extern "C"
