// The libtorch C++ twin of python/plusequals/model/blocks.py and rust/block.rs: CompVis
// `BasicTransformerBlock` (SD v1), same modules, same field names, same order of operations,
// weights taken by their PyTorch state_dict keys.
//
// The thread's claim was that in C++ "x would not have been passed as a mutable reference". In
// libtorch that is half true: `at::Tensor` is a handle, its in-place methods are `const`
// members, so `forward(const at::Tensor& x)` may still call `x.add_(...)` (cpp/gallery.cpp).
// `forward` below does not; `forward_owned` takes `x` by value and adds in place into it.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace plusequals {

using Weights = std::map<std::string, at::Tensor>;

// `nn.Linear`: `x @ weight.T + bias`.
struct Linear {
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  at::Tensor forward(const at::Tensor& x) const { return at::linear(x, weight, bias); }
};

// `nn.LayerNorm(dim)`, eps 1e-5, with affine weight and bias.
struct LayerNorm {
  at::Tensor weight, bias;
  int64_t dim;
  at::Tensor forward(const at::Tensor& x) const { return at::layer_norm(x, {dim}, weight, bias, 1e-5, true); }
};

enum class Attention { Sdpa, Einsum };

// IP-Adapter's images: one embedding per adapter (diffusers' `encoder_hidden_states[1]`).
using Images = std::vector<at::Tensor>;

// One IP-Adapter of diffusers' `IPAdapterAttnProcessor2_0` (rust/ip_adapter.rs): `to_k_ip[i]`,
// `to_v_ip[i]` (bias-free) and `scale[i]`.
struct IpAdapter {
  Linear to_k, to_v;
  double scale;
  // `scale * sdpa(q, to_k_ip(image), to_v_ip(image))`, heads merged: `q` is (b, h, n, d).
  at::Tensor term(const at::Tensor& q, const at::Tensor& image) const;
};

// q, k and v (b, n, h * d) and the mask per head (`CrossAttention::project`).
struct Projected {
  at::Tensor q, k, v;
  std::optional<at::Tensor> mask;
};

// CompVis `CrossAttention`: bias-free `to_q`/`to_k`/`to_v`, `to_out.0` with bias.
struct CrossAttention {
  Linear to_q, to_k, to_v, to_out;
  double scale;
  int64_t heads;
  Attention attention;
  std::vector<IpAdapter> ip_adapter;  // attn2 only, in diffusers' adapter order
  // `mask`: diffusers' semantics, as in rust/attention_extras.rs (a bias or a boolean mask, repeated per head).
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& context,
                     const std::optional<at::Tensor>& mask = std::nullopt) const;
  // `forward` plus IP-Adapter's decoupled cross-attention on `images` (rust/block.rs, forward_ip).
  at::Tensor forward_ip(const at::Tensor& x, const std::optional<at::Tensor>& context,
                        const std::optional<at::Tensor>& mask, const Images& images) const;
  // Where both attention paths start: `to_q(x)`, `to_k`/`to_v` of the context (`x` when none),
  // each (b, n, h * d), and the mask per head.
  Projected project(const at::Tensor& x, const std::optional<at::Tensor>& context,
                    const std::optional<at::Tensor>& mask) const;
  // The text attention of the SDPA path before `to_out`: (q split per head, the attention).
  std::pair<at::Tensor, at::Tensor> attend(const at::Tensor& x, const std::optional<at::Tensor>& context,
                                           const std::optional<at::Tensor>& mask) const;
};

// `GEGLU`: `proj` to twice the width; one half gated by the exact GELU of the other.
struct GeGlu {
  Linear proj;
  at::Tensor forward(const at::Tensor& x) const;
};

// CompVis `FeedForward` (mult 4): `net = [GEGLU or Linear + GELU, Dropout, Linear]`.
struct FeedForward {
  bool gated;
  GeGlu geglu;     // net.0 when gated (SD v1)
  Linear net_0_0;  // net.0.0 otherwise
  Linear net_2;
  at::Tensor forward(const at::Tensor& x) const;
};

struct Config {
  int64_t dim, n_heads, d_head, context_dim;
  bool gated_ff;
  Attention attention;
  std::vector<double> ip_adapter;  // one scale per IP-Adapter on attn2
};

// CompVis `BasicTransformerBlock`: self-attention, cross-attention, feed-forward, each behind a
// LayerNorm and a residual add.
struct BasicTransformerBlock {
  CrossAttention attn1;
  FeedForward ff;
  CrossAttention attn2;
  LayerNorm norm1, norm2, norm3;

  // Takes every weight by its CompVis key; throws (c10::Error) on a missing key.
  BasicTransformerBlock(const Weights& w, const Config& cfg);

  // `op_plus_x`, out of place: `x` is only read.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& context,
                     const std::optional<at::Tensor>& mask1 = std::nullopt,
                     const std::optional<at::Tensor>& mask2 = std::nullopt, const Images& images = {}) const;

  // `attn2`: the cross-attention, with IP-Adapter's when the block carries adapters.
  at::Tensor attn2_forward(const at::Tensor& x, const std::optional<at::Tensor>& context,
                           const std::optional<at::Tensor>& mask2, const Images& images) const;

  // `iadd`: the caller hands `x` over (by value) and the residuals are added into it. The
  // compiler checks none of this: the caller may keep another handle on the same tensor.
  at::Tensor forward_owned(at::Tensor x, const std::optional<at::Tensor>& context,
                           const std::optional<at::Tensor>& mask1 = std::nullopt,
                           const std::optional<at::Tensor>& mask2 = std::nullopt, const Images& images = {}) const;
};

}  // namespace plusequals
