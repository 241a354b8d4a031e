//! Small blocks and inputs for tests, the compile-fail twins and the demo.
//!
//! The values come from a local generator seeded by the caller, never from libtorch's
//! process-wide one: cargo runs a binary's tests on parallel threads, and a `tch::manual_seed`
//! followed by `Tensor::randn` races with every other test that draws or reseeds in between.
//! Here the same seed gives the same bits on any thread, whatever else runs.

use std::collections::HashMap;

use tch::Tensor;

use crate::block::{Attention, BasicTransformerBlock, BlockConfig};
use crate::error::Result;

/// A 32-wide block, 4 heads x 8, cross-attention on width-24 context, SDPA.
pub fn small_config(attention: Attention) -> BlockConfig {
    BlockConfig {
        dim: 32,
        n_heads: 4,
        d_head: 8,
        context_dim: Some(24),
        gated_ff: true,
        attention,
        lora: Vec::new(),
        ip_adapter: Vec::new(),
        processors: Vec::new(),
    }
}

/// Standard normal samples from a SplitMix64 stream (Box-Muller), owned by the caller.
///
/// Not libtorch's distribution bit for bit, but the same scale (mean 0, std 1), so the
/// tolerances written against `Tensor::randn` keep their meaning.
pub struct Normal {
    state: u64,
    spare: Option<f64>,
}

impl Normal {
    pub fn new(seed: u64) -> Self {
        Normal { state: seed ^ 0x5DEE_CE66_D1CE_4E5B, spare: None }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1]: 53 random bits, never 0 (the logarithm below needs that).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    pub fn sample(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u, v) = (self.uniform(), self.uniform());
        let r = (-2.0 * u.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * v;
        self.spare = Some(r * theta.sin());
        r * theta.cos()
    }

    /// A float32 CPU tensor of `shape` filled with `scale` times the next samples. It owns its
    /// storage alone (not a view of a flat tensor), so it can be given to `forward_owned`.
    pub fn tensor(&mut self, shape: &[i64], scale: f64) -> Result<Tensor> {
        let n: i64 = shape.iter().product();
        let bytes: Vec<u8> = (0..n).flat_map(|_| ((scale * self.sample()) as f32).to_ne_bytes()).collect();
        Ok(Tensor::f_from_data_size(&bytes, shape, tch::Kind::Float)?)
    }
}

/// Random weights (std 0.2) under every CompVis key of a [`small_config`] block.
pub fn small_weights(seed: u64) -> Result<HashMap<String, Tensor>> {
    let mut rng = Normal::new(seed);
    let (dim, inner, ctx) = (32, 32, 24);
    // Sorted key order, so each key's values depend only on the seed.
    let mut shapes: Vec<(String, Vec<i64>)> = Vec::new();
    for (attn, kv_dim) in [("attn1", dim), ("attn2", ctx)] {
        shapes.push((format!("{attn}.to_q.weight"), vec![inner, dim]));
        shapes.push((format!("{attn}.to_k.weight"), vec![inner, kv_dim]));
        shapes.push((format!("{attn}.to_v.weight"), vec![inner, kv_dim]));
        shapes.push((format!("{attn}.to_out.0.weight"), vec![dim, inner]));
        shapes.push((format!("{attn}.to_out.0.bias"), vec![dim]));
    }
    shapes.push(("ff.net.0.proj.weight".into(), vec![8 * dim, dim]));
    shapes.push(("ff.net.0.proj.bias".into(), vec![8 * dim]));
    shapes.push(("ff.net.2.weight".into(), vec![dim, 4 * dim]));
    shapes.push(("ff.net.2.bias".into(), vec![dim]));
    for n in ["norm1", "norm2", "norm3"] {
        shapes.push((format!("{n}.weight"), vec![dim]));
        shapes.push((format!("{n}.bias"), vec![dim]));
    }
    shapes.sort();
    shapes.into_iter().map(|(k, shape)| Ok((k, rng.tensor(&shape, 0.2)?))).collect()
}

/// A random [`small_config`] block.
pub fn small_block() -> Result<BasicTransformerBlock> {
    BasicTransformerBlock::from_weights(small_weights(0)?, &small_config(Attention::Sdpa))
}

/// `(x, context)` for a [`small_block`]: batch 2, 16 tokens, 7 context tokens, std 1.
pub fn small_inputs() -> Result<(Tensor, Tensor)> {
    let mut rng = Normal::new(1);
    Ok((rng.tensor(&[2, 16, 32], 1.0)?, rng.tensor(&[2, 7, 24], 1.0)?))
}
