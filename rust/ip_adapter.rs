//! IP-Adapter on `attn2`: diffusers' `IPAdapterAttnProcessor2_0`'s decoupled cross-attention
//! (`CrossAttention::forward_ip` adds the terms).

use tch::Tensor;

use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::weights::Weights;

/// One IP-Adapter of diffusers' `IPAdapterAttnProcessor2_0`: `to_k_ip[i]`, `to_v_ip[i]` (bias-free)
/// and `scale[i]`; it adds `scale * sdpa(q, to_k_ip(image), to_v_ip(image))` to the attention.
/// Its weights are `attn2.ip.{i}.to_k.weight` and `attn2.ip.{i}.to_v.weight` (inner x context).
pub struct IpAdapter {
    pub to_k: Linear,
    pub to_v: Linear,
    pub scale: f64,
}

impl IpAdapter {
    /// `attn2`'s adapters, one per scale (`BlockConfig::ip_adapter`); none for `attn1`. `sdpa`:
    /// whether the block's attention is SDPA; `shape`: (context width, inner width).
    pub(crate) fn load_all(
        w: &mut Weights,
        prefix: &str,
        shape: (i64, i64),
        scales: &[f64],
        sdpa: bool,
    ) -> Result<Vec<Self>> {
        if prefix != "attn2" || scales.is_empty() {
            return Ok(Vec::new());
        }
        if !sdpa {
            return Err(Error::config("IP-Adapter needs attention='sdpa' (diffusers' processor calls SDPA)".into()));
        }
        let mut adapters = Vec::new();
        for (i, &scale) in scales.iter().enumerate() {
            let to_k = Linear::load(w, &format!("{prefix}.ip.{i}.to_k"), shape, false, &[])?;
            let to_v = Linear::load(w, &format!("{prefix}.ip.{i}.to_v"), shape, false, &[])?;
            adapters.push(IpAdapter { to_k, to_v, scale });
        }
        Ok(adapters)
    }

    /// `scale * sdpa(q, to_k_ip(image), to_v_ip(image))`, heads merged: `q` is `(b, h, n, d)`.
    pub fn term(&self, q: &Tensor, image: &Tensor) -> Result<Tensor> {
        let (b, h, _, d) = q.size4()?;
        let split = |t: &Tensor| -> Result<Tensor> { Ok(t.f_reshape([b, -1, h, d])?.f_transpose(1, 2)?) };
        let (k, v) = (split(&self.to_k.forward(image)?)?, split(&self.to_v.forward(image)?)?);
        let image_out = Tensor::f_scaled_dot_product_attention(q, &k, &v, None::<&Tensor>, 0.0, false, None, false)?;
        let image_out = image_out.f_transpose(1, 2)?.f_reshape([b, -1, h * d])?;
        Ok(image_out.f_mul_scalar(self.scale)?)
    }
}
