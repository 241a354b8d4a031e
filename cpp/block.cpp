// The libtorch C++ twin: read it line for line against python/plusequals/model/blocks.py and
// rust/block.rs.
#include "block.h"

#include <cmath>

namespace plusequals {

// diffusers' prepare_attention_mask (repeated per head over the batch) and the view before SDPA:
// (b, [1 or q,] k) -> (b * h, [1 or q,] k) -> (b, h, 1 or q, k)
static at::Tensor per_head(const at::Tensor& mask, int64_t b, int64_t h) {
  return mask.repeat_interleave(h, 0, b * h).view({b, h, -1, mask.size(-1)});
}

// `sim + mask` for the einsum path: a boolean mask becomes the bias SDPA makes of it.
static at::Tensor add_mask(const at::Tensor& sim, const at::Tensor& mask) {
  if (mask.scalar_type() == at::kBool) {
    const at::Tensor bias = at::zeros_like(mask).to(sim.scalar_type()).masked_fill(mask.logical_not(), -INFINITY);
    return sim + bias;
  }
  return sim + mask;
}

at::Tensor CrossAttention::forward(const at::Tensor& x, const std::optional<at::Tensor>& context_,
                                   const std::optional<at::Tensor>& mask_) const {
  if (attention == Attention::Sdpa) return to_out.forward(attend(x, context_, mask_).second);
  const int64_t h = heads;
  const auto [q, k, v, mask] = project(x, context_, mask_);
  const int64_t b = q.size(0), n = q.size(1), inner = q.size(2);
  const int64_t d = inner / h;
  // The einsum path. 'b n (h d) -> (b h) n d'
  auto split = [&](const at::Tensor& t) { return t.reshape({b, -1, h, d}).permute({0, 2, 1, 3}).reshape({b * h, -1, d}); };
  at::Tensor sim = at::einsum("b i d, b j d -> b i j", {split(q), split(k)}) * scale;
  // '(b h) 1|i j' against sim's '(b h) i j'
  if (mask.has_value()) sim = add_mask(sim, mask->flatten(0, 1));
  const at::Tensor attn = sim.softmax(-1);
  const at::Tensor out = at::einsum("b i j, b j d -> b i d", {attn, split(v)});
  // '(b h) n d -> b n (h d)'
  return to_out.forward(out.reshape({b, h, n, d}).permute({0, 2, 1, 3}).reshape({b, n, h * d}));
}

Projected CrossAttention::project(const at::Tensor& x, const std::optional<at::Tensor>& context_,
                                 const std::optional<at::Tensor>& mask_) const {
  const at::Tensor q = to_q.forward(x);
  const at::Tensor& context = context_.has_value() ? *context_ : x;
  const at::Tensor k = to_k.forward(context);
  const at::Tensor v = to_v.forward(context);
  const std::optional<at::Tensor> mask =
      mask_.has_value() ? std::optional<at::Tensor>(per_head(*mask_, q.size(0), heads)) : std::nullopt;
  return {q, k, v, mask};
}

std::pair<at::Tensor, at::Tensor> CrossAttention::attend(const at::Tensor& x,
                                                         const std::optional<at::Tensor>& context_,
                                                         const std::optional<at::Tensor>& mask_) const {
  const int64_t h = heads;
  const auto [q, k, v, mask] = project(x, context_, mask_);
  const int64_t b = q.size(0), n = q.size(1), inner = q.size(2);
  const int64_t d = inner / h;
  // 'b n (h d) -> b h n d'
  auto split = [&](const at::Tensor& t) { return t.reshape({b, -1, h, d}).transpose(1, 2); };
  const at::Tensor qh = split(q);
  const at::Tensor out = at::scaled_dot_product_attention(qh, split(k), split(v), mask, 0.0, false, scale);
  return {qh, out.transpose(1, 2).reshape({b, n, h * d})};
}

at::Tensor CrossAttention::forward_ip(const at::Tensor& x, const std::optional<at::Tensor>& context,
                                      const std::optional<at::Tensor>& mask, const Images& images) const {
  TORCH_CHECK(images.size() == ip_adapter.size(), "encoder_hidden_states carries ", images.size(),
              " image embeddings for ", ip_adapter.size(), " IP-Adapters");
  auto [q, out] = attend(x, context, mask);
  for (size_t i = 0; i < ip_adapter.size(); ++i) {
    const IpAdapter& ip = ip_adapter[i];
    if (ip.scale == 0.0) continue;  // diffusers skips it
    out = out + ip.term(q, images[i]);
  }
  return to_out.forward(out);
}

at::Tensor IpAdapter::term(const at::Tensor& q, const at::Tensor& image) const {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(3);
  auto split = [&](const at::Tensor& t) { return t.reshape({b, -1, h, d}).transpose(1, 2); };
  const at::Tensor k = split(to_k.forward(image)), v = split(to_v.forward(image));
  const at::Tensor image_out = at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, false, std::nullopt);
  return image_out.transpose(1, 2).reshape({b, -1, h * d}) * scale;
}

at::Tensor GeGlu::forward(const at::Tensor& x) const {
  const auto chunks = proj.forward(x).chunk(2, -1);
  const at::Tensor &a = chunks[0], &gate = chunks[1];
  return a * at::gelu(gate);
}

at::Tensor FeedForward::forward(const at::Tensor& x) const {
  const at::Tensor y = gated ? geglu.forward(x) : at::gelu(net_0_0.forward(x));
  return net_2.forward(y);
}

at::Tensor BasicTransformerBlock::forward(const at::Tensor& x_, const std::optional<at::Tensor>& context,
                                          const std::optional<at::Tensor>& mask1,
                                          const std::optional<at::Tensor>& mask2, const Images& images) const {
  at::Tensor x = attn1.forward(norm1.forward(x_), std::nullopt, mask1) + x_;
  x = attn2_forward(norm2.forward(x), context, mask2, images) + x;
  x = ff.forward(norm3.forward(x)) + x;
  return x;
}

at::Tensor BasicTransformerBlock::attn2_forward(const at::Tensor& x, const std::optional<at::Tensor>& context,
                                                const std::optional<at::Tensor>& mask2, const Images& images) const {
  if (attn2.ip_adapter.empty() && images.empty()) return attn2.forward(x, context, mask2);
  return attn2.forward_ip(x, context, mask2, images);
}

at::Tensor BasicTransformerBlock::forward_owned(at::Tensor x, const std::optional<at::Tensor>& context,
                                                const std::optional<at::Tensor>& mask1,
                                                const std::optional<at::Tensor>& mask2, const Images& images) const {
  x.add_(attn1.forward(norm1.forward(x), std::nullopt, mask1));
  x.add_(attn2_forward(norm2.forward(x), context, mask2, images));
  x.add_(ff.forward(norm3.forward(x)));
  return x;
}

// ----------------------------------------------------------------------------- loading by key

static at::Tensor take(const Weights& w, const std::string& key) {
  const auto it = w.find(key);
  TORCH_CHECK(it != w.end(), "missing weight \"", key, "\"");
  return it->second;
}

static Linear linear(const Weights& w, const std::string& prefix, bool bias) {
  return Linear{take(w, prefix + ".weight"), bias ? std::optional<at::Tensor>(take(w, prefix + ".bias")) : std::nullopt};
}

static std::vector<IpAdapter> ip_adapters(const Weights& w, const std::string& p, const Config& cfg) {
  std::vector<IpAdapter> adapters;
  if (p != "attn2") return adapters;
  for (size_t i = 0; i < cfg.ip_adapter.size(); ++i) {
    const std::string ip = p + ".ip." + std::to_string(i);
    adapters.push_back(IpAdapter{linear(w, ip + ".to_k", false), linear(w, ip + ".to_v", false), cfg.ip_adapter[i]});
  }
  return adapters;
}

static CrossAttention cross_attention(const Weights& w, const std::string& p, const Config& cfg) {
  return CrossAttention{linear(w, p + ".to_q", false),  linear(w, p + ".to_k", false),
                        linear(w, p + ".to_v", false),  linear(w, p + ".to_out.0", true),
                        std::pow(static_cast<double>(cfg.d_head), -0.5), cfg.n_heads,
                        cfg.attention,                  ip_adapters(w, p, cfg)};
}

static LayerNorm layer_norm(const Weights& w, const std::string& p, int64_t dim) {
  return LayerNorm{take(w, p + ".weight"), take(w, p + ".bias"), dim};
}

static FeedForward feed_forward(const Weights& w, const Config& cfg) {
  FeedForward ff{cfg.gated_ff, {}, {}, linear(w, "ff.net.2", true)};
  if (cfg.gated_ff) {
    ff.geglu = GeGlu{linear(w, "ff.net.0.proj", true)};
  } else {
    ff.net_0_0 = linear(w, "ff.net.0.0", true);
  }
  return ff;
}

BasicTransformerBlock::BasicTransformerBlock(const Weights& w, const Config& cfg)
    : attn1(cross_attention(w, "attn1", cfg)),
      ff(feed_forward(w, cfg)),
      attn2(cross_attention(w, "attn2", cfg)),
      norm1(layer_norm(w, "norm1", cfg.dim)),
      norm2(layer_norm(w, "norm2", cfg.dim)),
      norm3(layer_norm(w, "norm3", cfg.dim)) {}

}  // namespace plusequals
