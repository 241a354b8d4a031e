//! `nn.Linear`, and PEFT's LoRA terms on it (issue 26), out of `block.rs`: what every projection
//! of the block computes.

use tch::Tensor;

use crate::error::Result;
use crate::weights::Weights;

/// One LoRA term of a linear layer (PEFT's `lora.Linear`, one active adapter): its weights are
/// `{linear}.lora.{i}.A.weight` (rank x in), `{linear}.lora.{i}.B.weight` (out x rank) and, with
/// `bias`, `{linear}.lora.{i}.B.bias`, where `i` is its index in [`BlockConfig::lora`].
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    /// The linear layer's CompVis key ("attn1.to_q", "ff.net.2", ...).
    pub linear: String,
    pub rank: i64,
    pub scaling: f64,
    pub bias: bool,
}

/// `nn.Linear`: `x @ weight.T + bias`, plus PEFT's LoRA terms when it carries adapters.
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub lora: Vec<Lora>,
}

/// One LoRA term ([`LoraSpec`]): `lora_B(lora_A(x)) * scaling`, on PEFT's own tensors.
pub struct Lora {
    /// `{linear}.lora.{i}`: its weights' keys are this and `.A.weight`, `.B.weight`, `.B.bias`.
    pub key: String,
    pub a: Tensor,
    pub b: Tensor,
    pub b_bias: Option<Tensor>,
    pub scaling: f64,
}

impl Linear {
    pub(crate) fn load(
        w: &mut Weights,
        prefix: &str,
        (d_in, d_out): (i64, i64),
        bias: bool,
        lora: &[LoraSpec],
    ) -> Result<Self> {
        let weight = w.take(prefix, "weight", &[d_out, d_in])?;
        let bias = if bias { Some(w.take(prefix, "bias", &[d_out])?) } else { None };
        let mut terms = Vec::new();
        for (i, spec) in lora.iter().enumerate().filter(|(_, s)| s.linear == prefix) {
            let a = w.take(prefix, &format!("lora.{i}.A.weight"), &[spec.rank, d_in])?;
            let b = w.take(prefix, &format!("lora.{i}.B.weight"), &[d_out, spec.rank])?;
            let b_bias = if spec.bias { Some(w.take(prefix, &format!("lora.{i}.B.bias"), &[d_out])?) } else { None };
            terms.push(Lora { key: format!("{prefix}.lora.{i}"), a, b, b_bias, scaling: spec.scaling });
        }
        Ok(Linear { weight, bias, lora: terms })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut result = x.f_linear(&self.weight, self.bias.as_ref())?;
        for t in &self.lora {
            // PEFT's lora.Linear: result = result + lora_B(lora_A(dropout(x))) * scaling (dropout: identity)
            let lora_b = x.f_linear(&t.a, None::<&Tensor>)?.f_linear(&t.b, t.b_bias.as_ref())?;
            result = result.f_add(&lora_b.f_mul_scalar(t.scaling)?)?;
        }
        Ok(result)
    }
}
