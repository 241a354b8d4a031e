//! Custom Diffusion on an attention of the block: diffusers' `CustomDiffusionAttnProcessor2_0`,
//! op for op, on the processor's own tensors.
//!
//! Its weights, by CompVis-style key (`{attn}` is `attn1` or `attn2`):
//! * `train_kv`: `{attn}.custom_diffusion.to_k.weight` and `{attn}.custom_diffusion.to_v.weight`
//!   (inner x context width, no bias), used instead of `to_k`/`to_v`;
//! * `train_q_out`: `{attn}.custom_diffusion.to_q.weight` (inner x dim, no bias) and
//!   `{attn}.custom_diffusion.to_out.0.weight` (dim x inner) with, when `out_bias`,
//!   `{attn}.custom_diffusion.to_out.0.bias`, used instead of `to_q` and `to_out.0`.
//!
//! In a cross-attention call (a context given) the first context token's key and value are cut
//! from the graph as diffusers does (`detach * k + (1 - detach) * k.detach()`): the same ops, so
//! the gradients are the library's bit for bit. Masks are refused (the processor passes diffusers'
//! repeated mask to SDPA without viewing it per head).

use tch::Tensor;

use super::{AttnProcessor, Base, ProcessorKind, ProcessorSpec, Widths};
use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::weights::{WeightKey, Weights};

/// Custom Diffusion in the configuration: `ProcessorSpec { kind: "custom_diffusion", .. }`, with
/// the options `train_kv`, `train_q_out` and `out_bias` (whether `to_out_custom_diffusion.0` has a
/// bias); an option left out is off.
pub const KIND: ProcessorKind = ProcessorKind {
    kind: "custom_diffusion",
    name: "Custom Diffusion",
    flags: &["train_kv", "train_q_out", "out_bias"],
    load: |w, spec, widths| Ok(Box::new(CustomDiffusion::load(w, spec, widths)?)),
};

/// The processor's own layers (the spec's options): `None` where it uses the attention's.
pub struct CustomDiffusion {
    pub to_q: Option<Linear>,
    pub to_k: Option<Linear>,
    pub to_v: Option<Linear>,
    pub to_out: Option<Linear>,
}

impl CustomDiffusion {
    /// The layers `spec` names, under its attention's prefix.
    fn load(w: &mut Weights, spec: &ProcessorSpec, (dim, context_dim, inner): Widths) -> Result<Self> {
        let prefix = &spec.attn;
        if dim != inner {
            return Err(Error::config(format!(
                "Custom Diffusion on {prefix} needs heads * d_head ({inner}) == dim ({dim}): diffusers' processor \
                 splits the heads by the hidden states' width"
            )));
        }
        let p = format!("{prefix}.custom_diffusion");
        let layer = |w: &mut Weights, name: &str, shape: (i64, i64), bias: bool| {
            Linear::load(w, &format!("{p}.{name}"), shape, bias, &[])
        };
        let (to_q, to_out) = if spec.has("train_q_out") {
            let out_bias = spec.has("out_bias");
            (Some(layer(w, "to_q", (dim, inner), false)?), Some(layer(w, "to_out.0", (inner, dim), out_bias)?))
        } else {
            (None, None)
        };
        let (to_k, to_v) = if spec.has("train_kv") {
            (Some(layer(w, "to_k", (context_dim, inner), false)?), Some(layer(w, "to_v", (context_dim, inner), false)?))
        } else {
            (None, None)
        };
        Ok(CustomDiffusion { to_q, to_k, to_v, to_out })
    }
}

impl AttnProcessor for CustomDiffusion {
    /// Its weights by key (`{attn}.custom_diffusion.to_q.weight`, ...), layer by layer: to_q, to_k,
    /// to_v, to_out.0.
    fn named(&self) -> Vec<(WeightKey<'_>, &Tensor)> {
        [&self.to_q, &self.to_k, &self.to_v, &self.to_out].into_iter().flatten().flat_map(Linear::named).collect()
    }

    /// diffusers' `CustomDiffusionAttnProcessor2_0.__call__`: `x` the hidden states, `context` the
    /// encoder hidden states (`None`: self-attention, no detach); a mask is an error (module docs).
    fn forward(&self, base: &Base<'_>, x: &Tensor, context: Option<&Tensor>, mask: Option<&Tensor>) -> Result<Tensor> {
        if mask.is_some() {
            let why = "is not taken by Custom Diffusion (diffusers' processor does not view it per head)";
            return Err(Error::input("mask", why.into()));
        }
        let query = match &self.to_q {
            Some(to_q) => to_q.forward(x)?,
            None => base.q.forward(x)?,
        };
        let crossattn = context.is_some();
        let states = context.unwrap_or(x);
        let (mut key, mut value) = match (&self.to_k, &self.to_v) {
            (Some(to_k), Some(to_v)) => {
                let key = to_k.forward(&to(states, &to_k.weight)?)?;
                let value = to_v.forward(&to(states, &to_v.weight)?)?;
                (to(&key, &base.q.weight)?, to(&value, &base.q.weight)?)
            }
            _ => (base.k.forward(states)?, base.v.forward(states)?),
        };
        if crossattn {
            key = detach_first_token(&key)?;
            value = detach_first_token(&value)?;
        }
        let (b, _, inner) = x.size3()?; // diffusers: inner_dim = hidden_states.shape[-1]
        let (h, d) = (base.heads, inner / base.heads);
        let split = |t: &Tensor| -> Result<Tensor> { Ok(t.f_view([b, -1, h, d])?.f_transpose(1, 2)?) };
        let (query, key, value) = (split(&query)?, split(&key)?, split(&value)?);
        let out =
            Tensor::f_scaled_dot_product_attention(&query, &key, &value, None::<&Tensor>, 0.0, false, None, false)?;
        let out = out.f_transpose(1, 2)?.f_reshape([b, -1, h * d])?;
        let out = to(&out, &query)?;
        match &self.to_out {
            Some(to_out) => to_out.forward(&out),
            None => base.out.forward(&out),
        }
    }
}

/// Python's `t.to(like.dtype)`: the same tensor when the dtype is already `like`'s.
fn to(t: &Tensor, like: &Tensor) -> Result<Tensor> {
    Ok(t.f_to_dtype(like.f_kind()?, false, false)?)
}

/// diffusers' `detach = ones_like(k); detach[:, :1, :] = detach[:, :1, :] * 0.0;
/// k = detach * k + (1 - detach) * k.detach()`: the first token's values unchanged, its gradient cut.
fn detach_first_token(t: &Tensor) -> Result<Tensor> {
    let detach = t.f_ones_like()?;
    let mut first = detach.f_slice(1, 0, 1, 1)?;
    let zeroed = first.f_mul_scalar(0.0)?;
    first.f_copy_(&zeroed)?;
    let kept = detach.f_mul(t)?;
    let cut = detach.f_rsub_scalar(1)?.f_mul(&t.f_detach()?)?;
    Ok(kept.f_add(&cut)?)
}
