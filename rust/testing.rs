//! Small random blocks for tests, the compile-fail twins and the demo.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use crate::block::{Attention, BasicTransformerBlock, BlockConfig};
use crate::error::Result;

/// A 32-wide block, 4 heads x 8, cross-attention on width-24 context, SDPA.
pub fn small_config(attention: Attention) -> BlockConfig {
    BlockConfig { dim: 32, n_heads: 4, d_head: 8, context_dim: Some(24), gated_ff: true, attention }
}

/// Random weights under every CompVis key of a [`small_config`] block.
pub fn small_weights(seed: i64) -> HashMap<String, Tensor> {
    tch::manual_seed(seed);
    let (dim, inner, ctx) = (32, 32, 24);
    let mut w = HashMap::new();
    let mut put = |k: String, shape: &[i64]| {
        w.insert(k, Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.2);
    };
    for (attn, kv_dim) in [("attn1", dim), ("attn2", ctx)] {
        put(format!("{attn}.to_q.weight"), &[inner, dim]);
        put(format!("{attn}.to_k.weight"), &[inner, kv_dim]);
        put(format!("{attn}.to_v.weight"), &[inner, kv_dim]);
        put(format!("{attn}.to_out.0.weight"), &[dim, inner]);
        put(format!("{attn}.to_out.0.bias"), &[dim]);
    }
    put("ff.net.0.proj.weight".into(), &[8 * dim, dim]);
    put("ff.net.0.proj.bias".into(), &[8 * dim]);
    put("ff.net.2.weight".into(), &[dim, 4 * dim]);
    put("ff.net.2.bias".into(), &[dim]);
    for n in ["norm1", "norm2", "norm3"] {
        put(format!("{n}.weight"), &[dim]);
        put(format!("{n}.bias"), &[dim]);
    }
    w
}

/// A random [`small_config`] block.
pub fn small_block() -> Result<BasicTransformerBlock> {
    BasicTransformerBlock::from_weights(small_weights(0), &small_config(Attention::Sdpa))
}

/// `(x, context)` for a [`small_block`]: batch 2, 16 tokens, 7 context tokens.
pub fn small_inputs() -> (Tensor, Tensor) {
    tch::manual_seed(1);
    (Tensor::randn([2, 16, 32], (Kind::Float, Device::Cpu)), Tensor::randn([2, 7, 24], (Kind::Float, Device::Cpu)))
}
