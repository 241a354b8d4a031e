//! What a call gives the attentions besides `x` and `context` ([`AttentionExtras`]): the attention
//! masks, with diffusers' semantics (`Attention.prepare_attention_mask` and `AttnProcessor2_0`),
//! line for line with `python/plusequals/model/blocks.py` and `cpp/block.cpp`, and IP-Adapter's
//! image embeddings.
//!
//! A mask is what diffusers' `BasicTransformerBlock` receives: an additive bias (floating; the
//! UNet and `Transformer2DModel` turn a 0/1 or boolean `(batch, key_tokens)` mask into
//! `(1 - mask) * -10000.0` with a singleton query dimension before the block sees it), or a
//! boolean mask (true: attend), which `F.scaled_dot_product_attention` honours as it is. Its
//! shape is `(batch, key_tokens)` or `(batch, 1 or query_tokens, key_tokens)`; it is repeated per
//! head (`repeat_interleave` over the batch) and viewed as `(batch, heads, 1 or query_tokens,
//! key_tokens)`, as diffusers does before SDPA.

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::facts::{dense_size, device, device_name, dtype_name};

/// What one call gives the attentions besides `x` and `context`, each field named by what takes it.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionExtras<'a> {
    /// `attn1`'s mask (diffusers' `attention_mask`; keys are `x`'s tokens).
    pub attn1: Option<&'a Tensor>,
    /// `attn2`'s mask (diffusers' `encoder_attention_mask`; keys are the context's tokens).
    pub attn2: Option<&'a Tensor>,
    /// IP-Adapter's image embeddings (diffusers' `encoder_hidden_states[1]`), one per adapter of
    /// `attn2` ([`crate::block::IpAdapter`]); empty without IP-Adapter.
    pub ip_adapter: &'a [Tensor],
}

impl AttentionExtras<'_> {
    /// None: what `forward(x, context)` passes.
    pub const NONE: AttentionExtras<'static> = AttentionExtras { attn1: None, attn2: None, ip_adapter: &[] };
}

/// diffusers' `prepare_attention_mask` (repeated per head over the batch) and the view before
/// SDPA: `(b, [1 or q,] k) -> (b * h, [1 or q,] k) -> (b, h, 1 or q, k)`.
pub fn per_head(mask: &Tensor, b: i64, h: i64) -> Result<Tensor> {
    let k = dense_size(mask).and_then(|s| s.last().copied()).unwrap_or(-1);
    Ok(mask.f_repeat_interleave_self_int(h, Some(0), Some(b * h))?.f_view([b, h, -1, k])?)
}

/// `sim + mask` for the einsum path: a floating mask is the bias; a boolean one becomes the bias
/// SDPA makes of it (0 where true, -inf where false).
pub fn add_mask(sim: &Tensor, mask: &Tensor) -> Result<Tensor> {
    if mask.f_kind()? == Kind::Bool {
        let bias =
            mask.f_zeros_like()?.f_to_kind(sim.f_kind()?)?.f_masked_fill(&mask.f_logical_not()?, f64::NEG_INFINITY)?;
        return Ok(sim.f_add(&bias)?);
    }
    Ok(sim.f_add(mask)?)
}

/// One mask's checks: `(batch, keys)` or `(batch, 1 or queries, keys)`, boolean or floating, on
/// `device` (the weights' device: its `facts::device` code and torch's name).
pub fn check_mask(
    arg: &'static str,
    mask: &Tensor,
    (batch, queries, keys): (i64, i64, i64),
    on: (i64, &str),
) -> Result<()> {
    let size = dense_size(mask).ok_or_else(|| Error::input(arg, "has no dense shape (nested, sparse, ...)".into()))?;
    let shape_ok = match size.as_slice() {
        [b, k] => *b == batch && *k == keys,
        [b, q, k] => *b == batch && (*q == 1 || *q == queries) && *k == keys,
        _ => false,
    };
    if !shape_ok {
        return Err(Error::input(
            arg,
            format!(
                "expected shape ({batch}, {keys}) or ({batch}, 1 or {queries}, {keys}) (batch, [query tokens,] key \
                 tokens), got {size:?}"
            ),
        ));
    }
    let kind = mask.f_kind()?;
    if !matches!(kind, Kind::Bool | Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double) {
        return Err(Error::input(arg, format!("dtype {} is neither bool nor floating point", dtype_name(kind))));
    }
    if device(mask) != Some(on.0) {
        return Err(Error::input(arg, format!("is on {} but the block's weights are on {}", device_name(mask), on.1)));
    }
    Ok(())
}
