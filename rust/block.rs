//! The tch twin of `python/plusequals/model/blocks.py`: CompVis `BasicTransformerBlock` (SD v1).
//!
//! Same modules, same field names, same order of operations, weights taken by their PyTorch
//! state_dict keys. Every libtorch call goes through tch's fallible `f_` form and `?`, so a bad
//! shape, dtype or device is an `Err`, never a panic.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use crate::attention_extras::{add_mask, check_mask, per_head, AttentionExtras};
use crate::error::{Error, Failure, Result};
use crate::facts::{autocast_produces, dense_size, device, device_name, dtype_name, versions, Recorded};
use crate::failpoint::{self, Step};
pub use crate::ip_adapter::IpAdapter;
pub use crate::linear::{Linear, Lora, LoraSpec};
use crate::ownership::{check_exclusive, check_owned_by, Caller, NoGrad};
pub use crate::processor::ProcessorSpec;
use crate::processor::{self, AttnProcessor, Base};
use crate::weights::{WeightKey, Weights};

/// Which attention kernel `CrossAttention` uses (`attention=` in the PyTorch block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// `F.scaled_dot_product_attention`.
    Sdpa,
    /// The 2022 path: two einsums and a softmax, the score matrix materialised.
    Einsum,
}

impl std::str::FromStr for Attention {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sdpa" => Ok(Attention::Sdpa),
            "einsum" => Ok(Attention::Einsum),
            other => Err(Error::config(format!("attention must be 'sdpa' or 'einsum', got {other:?}"))),
        }
    }
}

/// The constructor arguments of the PyTorch block that the weights alone do not tell.
#[derive(Clone, Debug)]
pub struct BlockConfig {
    pub dim: i64,
    pub n_heads: i64,
    pub d_head: i64,
    pub context_dim: Option<i64>,
    pub gated_ff: bool,
    pub attention: Attention,
    /// The PEFT LoRA terms on the linear layers, in the order they are added.
    pub lora: Vec<LoraSpec>,
    /// IP-Adapter on `attn2` (diffusers' `IPAdapterAttnProcessor2_0`): one scale per adapter,
    /// whose weights are `attn2.ip.{i}.to_k.weight` and `attn2.ip.{i}.to_v.weight` (inner x context).
    pub ip_adapter: Vec<f64>,
    /// The attention processors with layers of their own ([`crate::processor`]: Custom Diffusion)
    /// on `attn1` and/or `attn2`, one per attention.
    pub processors: Vec<ProcessorSpec>,
}

impl BlockConfig {
    /// The CompVis keys of the weights a block of this configuration takes, in the order the
    /// custom ops take them: [`BasicTransformerBlock::weight_keys`] of that block, built on
    /// stand-ins ([`Weights::stand_ins`]). An error if the configuration builds no block.
    pub fn weight_keys(&self) -> Result<Vec<String>> {
        Ok(BasicTransformerBlock::load(Weights::stand_ins(), self)?.weight_keys())
    }

    /// `n_heads * d_head`, the attention's inner width (an error if it overflows).
    pub fn inner_dim(&self) -> Result<i64> {
        self.n_heads
            .checked_mul(self.d_head)
            .ok_or_else(|| Error::config(format!("n_heads * d_head overflows: {} * {}", self.n_heads, self.d_head)))
    }
}

/// `nn.LayerNorm(dim)`, eps 1e-5, with affine weight and bias.
pub struct LayerNorm {
    /// Its CompVis key ("norm1"): its weights' keys are this and `.weight`, `.bias`.
    pub key: String,
    pub weight: Tensor,
    pub bias: Tensor,
    pub dim: i64,
}

impl LayerNorm {
    fn load(w: &mut Weights, prefix: &str, dim: i64) -> Result<Self> {
        let (weight, bias) = (w.take(prefix, "weight", &[dim])?, w.take(prefix, "bias", &[dim])?);
        Ok(LayerNorm { key: prefix.to_string(), weight, bias, dim })
    }

    /// Its weights by key: `weight`, `bias`.
    fn named(&self) -> [(WeightKey<'_>, &Tensor); 2] {
        [(WeightKey::new(&self.key, "weight"), &self.weight), (WeightKey::new(&self.key, "bias"), &self.bias)]
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_layer_norm([self.dim], Some(&self.weight), Some(&self.bias), 1e-5, true)?)
    }
}

/// q, k and v (b, n, h * d) and the mask per head ([`CrossAttention::project`]).
type Projected = (Tensor, Tensor, Tensor, Option<Tensor>);

/// CompVis `CrossAttention`: bias-free `to_q`/`to_k`/`to_v`, `to_out.0` with bias.
pub struct CrossAttention {
    pub to_q: Linear,
    pub to_k: Linear,
    pub to_v: Linear,
    pub to_out: Linear,
    pub scale: f64,
    pub heads: i64,
    pub attention: Attention,
    /// IP-Adapter's decoupled cross-attentions (`attn2` only), in diffusers' adapter order.
    pub ip_adapter: Vec<IpAdapter>,
    /// The processor that computes this attention instead, on layers of its own that replace some
    /// of the above ([`crate::processor`]).
    pub processor: Option<Box<dyn AttnProcessor>>,
}

impl CrossAttention {
    fn load(w: &mut Weights, prefix: &str, query_dim: i64, context_dim: i64, cfg: &BlockConfig) -> Result<Self> {
        let inner_dim = cfg.inner_dim()?;
        let processor = processor::load(w, prefix, (query_dim, context_dim, inner_dim), &cfg.processors)?;
        Ok(CrossAttention {
            to_q: Linear::load(w, &format!("{prefix}.to_q"), (query_dim, inner_dim), false, &cfg.lora)?,
            to_k: Linear::load(w, &format!("{prefix}.to_k"), (context_dim, inner_dim), false, &cfg.lora)?,
            to_v: Linear::load(w, &format!("{prefix}.to_v"), (context_dim, inner_dim), false, &cfg.lora)?,
            to_out: Linear::load(w, &format!("{prefix}.to_out.0"), (inner_dim, query_dim), true, &cfg.lora)?,
            scale: (cfg.d_head as f64).powf(-0.5),
            heads: cfg.n_heads,
            attention: cfg.attention,
            ip_adapter: IpAdapter::load_all(
                w,
                prefix,
                (context_dim, inner_dim),
                &cfg.ip_adapter,
                cfg.attention == Attention::Sdpa,
            )?,
            processor,
        })
    }

    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.forward_masked(x, context, None)
    }

    /// [`forward_masked`](Self::forward_masked) plus IP-Adapter's decoupled cross-attention on
    /// `images` (one embedding per adapter), as diffusers' `IPAdapterAttnProcessor2_0` computes it:
    /// the text attention, then `+ scale * sdpa(q, to_k_ip(image), to_v_ip(image))` per adapter
    /// whose scale is not 0, then `to_out`.
    pub fn forward_ip(
        &self,
        x: &Tensor,
        context: Option<&Tensor>,
        mask: Option<&Tensor>,
        images: &[Tensor],
    ) -> Result<Tensor> {
        if images.len() != self.ip_adapter.len() {
            return Err(Error::input(
                "encoder_hidden_states",
                format!("carries {} image embeddings for {} IP-Adapters", images.len(), self.ip_adapter.len()),
            ));
        }
        let (q, mut out) = self.attend(x, context, mask)?;
        for (ip, image) in self.ip_adapter.iter().zip(images) {
            if ip.scale == 0.0 {
                continue; // diffusers skips it
            }
            out = out.f_add(&ip.term(&q, image)?)?;
        }
        self.to_out.forward(&out)
    }

    /// Where both attention paths start: `to_q(x)`, `to_k`/`to_v` of the context (`x` when None), the mask per head.
    fn project(&self, x: &Tensor, context: Option<&Tensor>, mask: Option<&Tensor>) -> Result<Projected> {
        let q = self.to_q.forward(x)?;
        let context = context.unwrap_or(x);
        let k = self.to_k.forward(context)?;
        let v = self.to_v.forward(context)?;
        let mask = mask.map(|m| per_head(m, q.size3()?.0, self.heads)).transpose()?;
        Ok((q, k, v, mask))
    }

    /// The text attention of the SDPA path before `to_out`: (q split per head, the attention).
    fn attend(&self, x: &Tensor, context: Option<&Tensor>, mask: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let h = self.heads;
        let (q, k, v, mask) = self.project(x, context, mask)?;
        let (b, n, inner) = q.size3()?;
        let d = inner / h;
        let split = |t: &Tensor| -> Result<Tensor> { Ok(t.f_reshape([b, -1, h, d])?.f_transpose(1, 2)?) };
        let (q, k, v) = (split(&q)?, split(&k)?, split(&v)?);
        let out = Tensor::f_scaled_dot_product_attention(&q, &k, &v, mask.as_ref(), 0.0, false, self.scale, false)?;
        Ok((q, out.f_transpose(1, 2)?.f_reshape([b, n, h * d])?))
    }

    /// [`forward`](Self::forward) with an attention mask ([`crate::attention_extras`]).
    pub fn forward_masked(&self, x: &Tensor, context: Option<&Tensor>, mask: Option<&Tensor>) -> Result<Tensor> {
        if let Some(processor) = &self.processor {
            let base = Base { q: &self.to_q, k: &self.to_k, v: &self.to_v, out: &self.to_out, heads: self.heads };
            return processor.forward(&base, x, context, mask);
        }
        if self.attention == Attention::Sdpa {
            return self.to_out.forward(&self.attend(x, context, mask)?.1);
        }
        let h = self.heads;
        let (q, k, v, mask) = self.project(x, context, mask)?;
        let (b, n, inner) = q.size3()?;
        let d = inner / h;
        // The einsum path. 'b n (h d) -> (b h) n d'
        let split = |t: &Tensor| -> Result<Tensor> {
            Ok(t.f_reshape([b, -1, h, d])?.f_permute([0, 2, 1, 3])?.f_reshape([b * h, -1, d])?)
        };
        let (q, k, v) = (split(&q)?, split(&k)?, split(&v)?);
        let mut sim = Tensor::f_einsum("b i d, b j d -> b i j", &[&q, &k], None::<&[i64]>)?.f_mul_scalar(self.scale)?;
        if let Some(mask) = &mask {
            // '(b h) 1|i j' against sim's '(b h) i j'
            sim = add_mask(&sim, &mask.f_flatten(0, 1)?)?;
        }
        let attn = sim.f_softmax(-1, None::<Kind>)?;
        let out = Tensor::f_einsum("b i j, b j d -> b i d", &[&attn, &v], None::<&[i64]>)?;
        // '(b h) n d -> b n (h d)'
        self.to_out.forward(&out.f_reshape([b, h, n, d])?.f_permute([0, 2, 1, 3])?.f_reshape([b, n, h * d])?)
    }
}

/// `GEGLU`: `proj` to twice the width; one half gated by the exact GELU of the other.
pub struct GeGlu {
    pub proj: Linear,
}

impl GeGlu {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let chunks = self.proj.forward(x)?.f_chunk(2, -1)?;
        let (x, gate) = (&chunks[0], &chunks[1]);
        Ok(x.f_mul(&gate.f_gelu("none")?)?)
    }
}

/// `FeedForward.net[0]`: GEGLU when `gated_ff` (SD v1), else `Linear` + exact GELU.
pub enum ProjectIn {
    GeGlu(GeGlu),
    Gelu(Linear),
}

/// CompVis `FeedForward` (mult 4): `net = [project_in, Dropout, Linear]`.
pub struct FeedForward {
    pub net_0: ProjectIn,
    pub net_2: Linear,
}

impl FeedForward {
    /// The projection in (GEGLU's `proj`, or the plain linear layer) and `net.2`.
    fn linears(&self) -> (&Linear, &Linear) {
        match &self.net_0 {
            ProjectIn::GeGlu(g) => (&g.proj, &self.net_2),
            ProjectIn::Gelu(l) => (l, &self.net_2),
        }
    }

    fn load(w: &mut Weights, prefix: &str, dim: i64, cfg: &BlockConfig) -> Result<Self> {
        let inner_dim =
            dim.checked_mul(8).map(|_| 4 * dim).ok_or_else(|| Error::config(format!("dim {dim} overflows")))?;
        let lora = &cfg.lora;
        let net_0 = if cfg.gated_ff {
            ProjectIn::GeGlu(GeGlu {
                proj: Linear::load(w, &format!("{prefix}.net.0.proj"), (dim, inner_dim * 2), true, lora)?,
            })
        } else {
            ProjectIn::Gelu(Linear::load(w, &format!("{prefix}.net.0.0"), (dim, inner_dim), true, lora)?)
        };
        Ok(FeedForward { net_0, net_2: Linear::load(w, &format!("{prefix}.net.2"), (inner_dim, dim), true, lora)? })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match &self.net_0 {
            ProjectIn::GeGlu(geglu) => geglu.forward(x)?,
            ProjectIn::Gelu(linear) => linear.forward(x)?.f_gelu("none")?,
        };
        self.net_2.forward(&x)
    }
}

/// CompVis `BasicTransformerBlock`: self-attention, cross-attention, feed-forward, each
/// behind a LayerNorm and a residual add.
pub struct BasicTransformerBlock {
    pub attn1: CrossAttention,
    pub ff: FeedForward,
    pub attn2: CrossAttention,
    pub norm1: LayerNorm,
    pub norm2: LayerNorm,
    pub norm3: LayerNorm,
    pub dim: i64,
    pub context_dim: i64,
    kind: Kind,
    /// The weights' device (`facts::device`'s code, and torch's name for it).
    device: (i64, String),
    /// Each weight's shape at the build, in [`BasicTransformerBlock::weights`] order, and their
    /// dtype and device, checked in one call on every forward: the weights are shared handles,
    /// and an in-place metadata change (`w.t_()`, `w.resize_()`, `p.data = ..`) reaches this
    /// block too.
    recorded: Recorded,
}

impl BasicTransformerBlock {
    /// Builds the block from a state_dict with CompVis keys; every key must be used exactly once.
    pub fn from_weights(weights: HashMap<String, Tensor>, cfg: &BlockConfig) -> Result<Self> {
        Self::load(Weights::new(weights), cfg)
    }

    fn load(mut weights: Weights, cfg: &BlockConfig) -> Result<Self> {
        if cfg.dim <= 0 || cfg.n_heads <= 0 || cfg.d_head <= 0 || cfg.context_dim.is_some_and(|c| c <= 0) {
            return Err(Error::config(format!("dimensions must be positive: {cfg:?}")));
        }
        cfg.inner_dim()?;
        let (dim, context_dim) = (cfg.dim, cfg.context_dim.unwrap_or(cfg.dim));
        let w = &mut weights;
        let attn1 = CrossAttention::load(w, "attn1", dim, dim, cfg)?;
        let ff = FeedForward::load(w, "ff", dim, cfg)?;
        let attn2 = CrossAttention::load(w, "attn2", dim, context_dim, cfg)?;
        let norm1 = LayerNorm::load(w, "norm1", dim)?;
        let norm2 = LayerNorm::load(w, "norm2", dim)?;
        let norm3 = LayerNorm::load(w, "norm3", dim)?;
        let (kind, device, name) = weights.finish()?;
        let mut block = BasicTransformerBlock {
            attn1,
            ff,
            attn2,
            norm1,
            norm2,
            norm3,
            dim,
            context_dim,
            kind,
            device: (device, name),
            recorded: Recorded::default(),
        };
        block.recorded = Recorded::new(&block.weights());
        Ok(block)
    }

    /// `op_plus_x`, out of place: `x` is only borrowed, so it cannot be mutated.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Result<Tensor> {
        self.forward_masked(x, context, AttentionExtras::NONE)
    }

    /// [`forward`](Self::forward) with the attentions' masks and IP-Adapter's image embeddings
    /// ([`AttentionExtras`]).
    pub fn forward_masked(&self, x: &Tensor, context: Option<&Tensor>, extras: AttentionExtras<'_>) -> Result<Tensor> {
        self.check_inputs(x, context)?;
        self.check_masks(x, context, extras)?;
        let x = self.attn1.forward_masked(&self.norm1.forward(x)?, None, extras.attn1)?.f_add(x)?;
        let x = self.attn2_forward(&self.norm2.forward(&x)?, context, extras)?.f_add(&x)?;
        let x = self.ff.forward(&self.norm3.forward(&x)?)?.f_add(&x)?;
        Ok(x)
    }

    /// `attn2`: the cross-attention, with IP-Adapter's when the block carries adapters.
    fn attn2_forward(&self, x: &Tensor, context: Option<&Tensor>, extras: AttentionExtras<'_>) -> Result<Tensor> {
        if self.attn2.ip_adapter.is_empty() && extras.ip_adapter.is_empty() {
            return self.attn2.forward_masked(x, context, extras.attn2);
        }
        self.attn2.forward_ip(x, context, extras.attn2, extras.ip_adapter)
    }

    /// `iadd` made safe: the caller gave `x` up (it is moved in), and the `&NoGrad` proof
    /// says a no-grad guard is alive. Before the first write, `check_owned` asks libtorch what
    /// rustc cannot see: that no other handle, view or owner can read `x`'s memory, that grad
    /// mode really is off, and that `context` does not overlap `x`. Otherwise `Err`, `x` untouched.
    pub fn forward_owned(&self, x: Tensor, context: Option<&Tensor>, no_grad: &NoGrad) -> Result<Tensor> {
        self.try_forward_owned(x, context, no_grad).map_err(Error::from)
    }

    /// [`forward_owned`](Self::forward_owned) that hands `x` back, untouched, when it fails
    /// before the first write (a refusal, a bad input, an error computing the first residual):
    /// [`Failure::Unwritten`]. After the first write, `x`'s buffer is consumed:
    /// [`Failure::Consumed`].
    pub fn try_forward_owned(&self, x: Tensor, context: Option<&Tensor>, no_grad: &NoGrad) -> Result<Tensor, Failure> {
        self.forward_owned_by(x, context, AttentionExtras::NONE, no_grad, &Caller::RUST)
    }

    /// [`try_forward_owned`](Self::try_forward_owned) for a given [`Caller`] (the Python glue).
    pub(crate) fn forward_owned_by(
        &self,
        mut x: Tensor,
        context: Option<&Tensor>,
        extras: AttentionExtras<'_>,
        _grad_off: &NoGrad,
        caller: &Caller,
    ) -> Result<Tensor, Failure> {
        let first = self
            .check_inputs(&x, context)
            .and_then(|()| self.check_masks(&x, context, extras))
            .and_then(|()| check_owned_by(&x, context, caller));
        // Up to and including the first `add_`, nothing is written: libtorch's add_ checks its
        // arguments (shapes, dtypes, inference tensors) before its kernel runs.
        let first = first
            .and_then(|()| failpoint::check(Step::BeforeFirstWrite))
            .and_then(|()| self.attn1.forward_masked(&self.norm1.forward(&x)?, None, extras.attn1))
            .and_then(|h| add_into(&mut x, &h, caller));
        if let Err(e) = first {
            return Err(Failure::Unwritten(e, x));
        }
        let mut rest = || -> Result<()> {
            failpoint::check(Step::AfterFirstWrite)?;
            let h = self.attn2_forward(&self.norm2.forward(&x)?, context, extras)?;
            add_into(&mut x, &h, caller)?;
            let h = self.ff.forward(&self.norm3.forward(&x)?)?;
            add_into(&mut x, &h, caller)?;
            Ok(())
        };
        rest().map_err(Failure::Consumed)?;
        Ok(x)
    }

    /// Every weight with its CompVis key, in the order the custom ops take them: the PyTorch
    /// block's (`attn1`'s, `attn2`'s, the feed-forward's, the norms'), then the LoRA terms' (in
    /// [`BlockConfig::lora`] order), IP-Adapter's and the processors' (`attn1`'s, `attn2`'s). The
    /// one list of the block's weights: [`weights`](Self::weights) and
    /// [`weight_keys`](Self::weight_keys) read it.
    pub fn named_weights(&self) -> Vec<(WeightKey<'_>, &Tensor)> {
        let mut w = Vec::with_capacity(16);
        for attn in [&self.attn1, &self.attn2] {
            for lin in [&attn.to_q, &attn.to_k, &attn.to_v, &attn.to_out] {
                w.extend(lin.named());
            }
        }
        let (project_in, net_2) = self.ff.linears();
        w.extend(project_in.named().chain(net_2.named()));
        for n in [&self.norm1, &self.norm2, &self.norm3] {
            w.extend(n.named());
        }
        let mut lora: Vec<&Lora> = self.lora_terms().collect(); // no allocation without LoRA terms
        lora.sort_by_key(|t| t.index);
        for t in lora {
            w.extend(t.named());
        }
        for ip in &self.attn2.ip_adapter {
            w.extend(ip.to_k.named().chain(ip.to_v.named()));
        }
        for processor in [&self.attn1, &self.attn2].into_iter().filter_map(|a| a.processor.as_ref()) {
            w.extend(processor.named());
        }
        w
    }

    /// Every weight, in [`named_weights`](Self::named_weights) order (it runs on every call: the
    /// keys are not formatted).
    pub fn weights(&self) -> Vec<&Tensor> {
        self.named_weights().into_iter().map(|(_, t)| t).collect()
    }

    /// Every LoRA term, linear by linear.
    fn lora_terms(&self) -> impl Iterator<Item = &Lora> {
        let (project_in, net_2) = self.ff.linears();
        let [a1, a2] = [&self.attn1, &self.attn2];
        let linears = [&a1.to_q, &a1.to_k, &a1.to_v, &a1.to_out, &a2.to_q, &a2.to_k, &a2.to_v, &a2.to_out];
        linears.into_iter().chain([project_in, net_2]).flat_map(|lin| lin.lora.iter())
    }

    /// The CompVis key of each of [`weights`](Self::weights), in the same order.
    pub fn weight_keys(&self) -> Vec<String> {
        self.named_weights().into_iter().map(|(key, _)| key.to_string()).collect()
    }

    /// The sum of the weights' version counters: it changes with every in-place write to a
    /// weight (an optimizer step, `p.add_(..)`), never otherwise.
    pub fn weights_version(&self) -> i64 {
        versions(&self.weights())
    }

    /// The weights are still what the block was built on: each one's shape, and all of them
    /// one dtype on one device. They are shared handles, so an in-place change of a weight's
    /// metadata (`w.t_()`, `w.resize_()`, `p.data = other`) reaches the block; a change of values
    /// is what sharing is for (an optimizer step).
    pub fn check_weights(&self) -> Result<()> {
        let weights = self.weights();
        let Some(first) = self.recorded.first_changed(&weights) else {
            return Ok(()); // every one as recorded: one C++ call
        };
        for (i, w) in weights.into_iter().enumerate().skip(first) {
            let (size, shape) = (dense_size(w), self.recorded.shape(i));
            let same = size.as_deref() == Some(shape)
                && w.f_kind().ok() == Some(self.kind)
                && device(w) == Some(self.device.0);
            if !same {
                let key = self.named_weights().get(i).map(|(key, _)| key.to_string()).unwrap_or_default();
                let now = match w.f_kind() {
                    Ok(kind) => {
                        format!("{} of shape {:?} on {}", dtype_name(kind), size.unwrap_or_default(), device_name(w))
                    }
                    Err(_) => "not a dense tensor".to_string(),
                };
                return Err(Error::WeightChanged {
                    key,
                    was: format!("{} of shape {shape:?} on {}", dtype_name(self.kind), self.device.1),
                    now,
                });
            }
        }
        Ok(())
    }

    /// Checks what libtorch would otherwise reject with a less helpful message, and that the
    /// weights are still the ones the block was built on ([`check_weights`](Self::check_weights)).
    pub fn check_inputs(&self, x: &Tensor, context: Option<&Tensor>) -> Result<()> {
        self.check_weights()?; // first: inputs are checked against what the weights are
        let xb = self.check_input("x", x, self.dim)?;
        if let Some(context) = context {
            let cb = self.check_input("context", context, self.context_dim)?;
            if cb != xb {
                return Err(Error::input("context", format!("batch {cb} does not match x's batch {xb}")));
            }
        } else if self.context_dim != self.dim {
            return Err(Error::input(
                "context",
                format!("is required: the block's cross-attention expects width {}", self.context_dim),
            ));
        }
        Ok(())
    }

    /// Checks the masks of `extras` against `x` and `context` (already checked):
    /// [`crate::attention_extras::check_mask`].
    pub fn check_masks(&self, x: &Tensor, context: Option<&Tensor>, extras: AttentionExtras<'_>) -> Result<()> {
        if extras.attn1.is_none() && extras.attn2.is_none() {
            return Ok(()); // the usual call: nothing to read
        }
        let tokens = |t: &Tensor| dense_size(t).and_then(|s| Some((*s.first()?, *s.get(1)?))).unwrap_or((0, 0));
        let (batch, queries) = tokens(x);
        let keys = context.map_or(queries, |c| tokens(c).1);
        let on = (self.device.0, self.device.1.as_str());
        if let Some(m) = extras.attn1 {
            check_mask("attention_mask", m, (batch, queries, queries), on)?;
        }
        if let Some(m) = extras.attn2 {
            check_mask("encoder_attention_mask", m, (batch, queries, keys), on)?;
        }
        Ok(())
    }

    /// Checks one input; returns its batch size.
    fn check_input(&self, arg: &'static str, t: &Tensor, width: i64) -> Result<i64> {
        if let Some(batch) = self.recorded.input_batch(t, width) {
            return Ok(batch); // every check below passes: one C++ call
        }
        let size = dense_size(t).ok_or_else(|| Error::input(arg, "has no dense shape (nested, sparse, ...)".into()))?;
        if size.len() != 3 || size[2] != width {
            return Err(Error::input(arg, format!("expected shape (batch, tokens, {width}), got {size:?}")));
        }
        if size[0] == 0 || size[1] == 0 {
            return Err(Error::input(arg, format!("is empty (shape {size:?}): attention needs a batch and tokens")));
        }
        let kind = t.f_kind()?;
        if kind != self.kind && !autocast_produces(t, &self.norm1.weight) {
            return Err(Error::input(
                arg,
                format!(
                    "dtype {} does not match the block's weights ({}), and autocast is off",
                    dtype_name(kind),
                    dtype_name(self.kind)
                ),
            ));
        }
        if device(t) != Some(self.device.0) {
            return Err(Error::input(
                arg,
                format!("is on {} but the block's weights are on {}", device_name(t), self.device.1),
            ));
        }
        Ok(size[0])
    }
}

/// A copy of `t` on storage of its own (tch's `copy()` panics on a libtorch error).
pub fn deep_copy(t: &Tensor) -> Result<Tensor> {
    let mut c = t.f_empty_like()?;
    c.f_copy_(t)?;
    Ok(c)
}

/// `x += y` without tch's panicking `AddAssign`: libtorch's `add_`, its error returned.
///
/// `&mut self` is what rustc checks; before the write, libtorch is asked what it cannot see
/// (`ownership::check_exclusive`): another handle on `self` (a tensor autograd saved for
/// backward, a `shallow_clone`), a weak reference, a view, foreign memory. Then `Err`, and
/// nothing is written.
pub trait AddInPlace {
    fn add_in_place(&mut self, y: &Tensor) -> Result<()>;
}

impl AddInPlace for Tensor {
    fn add_in_place(&mut self, y: &Tensor) -> Result<()> {
        add_into(self, y, &Caller::RUST)
    }
}

/// `x += y` after `check_exclusive` for `caller`.
fn add_into(x: &mut Tensor, y: &Tensor, caller: &Caller) -> Result<()> {
    check_exclusive(x, caller).map_err(|why| Error::NotOwned { arg: "x", why })?;
    let _same_tensor_as_x = x.f_add_(y)?; // tch's second handle, dropped at once
    Ok(())
}
