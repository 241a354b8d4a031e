//! `nn.Linear`, and PEFT's LoRA and DoRA terms on it: what every projection of the block computes.

use tch::Tensor;

use crate::error::Result;
use crate::weights::{WeightKey, Weights};

/// One LoRA term of a linear layer (PEFT's `lora.Linear`, one active adapter): its weights are
/// `{linear}.lora.{i}.A.weight` (rank x in), `{linear}.lora.{i}.B.weight` (out x rank), with
/// `bias` `{linear}.lora.{i}.B.bias`, and with `dora` `{linear}.lora.{i}.magnitude` (out), where
/// `i` is its index in [`BlockConfig::lora`](crate::BlockConfig::lora).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    /// The linear layer's CompVis key ("attn1.to_q", "ff.net.2", ...).
    pub linear: String,
    pub rank: i64,
    pub scaling: f64,
    pub bias: bool,
    /// DoRA (PEFT's `use_dora=True`): the term is [`Linear::dora`]'s, with a magnitude vector.
    pub dora: bool,
}

/// `nn.Linear`: `x @ weight.T + bias`, plus PEFT's LoRA terms when it carries adapters.
pub struct Linear {
    /// Its CompVis key ("attn1.to_q", "ff.net.2", ...): its weights' keys are this and `.weight`, `.bias`.
    pub key: String,
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub lora: Vec<Lora>,
}

/// One LoRA term ([`LoraSpec`]): `lora_B(lora_A(x)) * scaling`, on PEFT's own tensors, or DoRA's
/// term when it has a `magnitude` (PEFT's `lora_magnitude_vector[adapter].weight`).
pub struct Lora {
    /// `{linear}.lora.{i}`: its weights' keys are this and `.A.weight`, `.B.weight`, `.B.bias`, `.magnitude`.
    pub key: String,
    /// `i`: its index in [`BlockConfig::lora`](crate::BlockConfig::lora).
    pub index: usize,
    pub a: Tensor,
    pub b: Tensor,
    pub b_bias: Option<Tensor>,
    pub scaling: f64,
    pub magnitude: Option<Tensor>,
}

impl Lora {
    /// Its weights by key: `A.weight`, `B.weight`, then `B.bias` and `magnitude` where it has them.
    pub fn named(&self) -> impl Iterator<Item = (WeightKey<'_>, &Tensor)> {
        let optional = [("B.bias", self.b_bias.as_ref()), ("magnitude", self.magnitude.as_ref())];
        let tensors = [("A.weight", &self.a), ("B.weight", &self.b)].into_iter();
        let tensors = tensors.chain(optional.into_iter().filter_map(|(name, t)| Some((name, t?))));
        tensors.map(|(name, t)| (WeightKey::new(&self.key, name), t))
    }

    /// `lora_B(lora_A(x))`.
    fn lora_b(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_linear(&self.a, None::<&Tensor>)?.f_linear(&self.b, self.b_bias.as_ref())?)
    }
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
            let magnitude =
                if spec.dora { Some(w.take(prefix, &format!("lora.{i}.magnitude"), &[d_out])?) } else { None };
            let key = format!("{prefix}.lora.{i}");
            terms.push(Lora { key, index: i, a, b, b_bias, scaling: spec.scaling, magnitude });
        }
        Ok(Linear { key: prefix.to_string(), weight, bias, lora: terms })
    }

    /// Its own weights by key, `weight` then `bias` (its LoRA terms' are theirs: [`Lora::named`]).
    pub fn named(&self) -> impl Iterator<Item = (WeightKey<'_>, &Tensor)> {
        let bias = self.bias.as_ref().map(|b| (WeightKey::new(&self.key, "bias"), b));
        std::iter::once((WeightKey::new(&self.key, "weight"), &self.weight)).chain(bias)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut result = x.f_linear(&self.weight, self.bias.as_ref())?;
        if self.lora.is_empty() {
            return Ok(result); // nn.Linear: no dtype bookkeeping on the common path
        }
        let kind = result.f_kind()?;
        let mut input: Option<Tensor> = None;
        for t in &self.lora {
            // PEFT's lora.Linear: x = _cast_input_dtype(x, lora_A's dtype) (it stays cast for the next
            // adapter), then result + lora_B(lora_A(dropout(x))) * scaling (dropout: identity), or DoRA's term
            let x = input.as_ref().unwrap_or(x).f_to_kind(t.a.f_kind()?)?;
            result = match &t.magnitude {
                None => result.f_add(&t.lora_b(&x)?.f_mul_scalar(t.scaling)?)?,
                Some(magnitude) => {
                    let dora = self.dora(t, magnitude, &x, &result)?;
                    result.f_add(&dora)?
                }
            };
            input = Some(x);
        }
        Ok(result.f_to_kind(kind)?) // PEFT: result.to(torch_result_dtype) (a no-op unless DoRA promoted it)
    }

    /// PEFT's `DoraLinearLayer.forward` with `base_result` (its dropout is the identity):
    /// `(m / ‖W + s·ΔW‖ - 1) * (result - bias) + m / ‖W + s·ΔW‖ * lora_B(lora_A(x)) * s`, where
    /// `ΔW = lora_B(lora_A(eye)).T` and the row norm is detached (DoRA paper, section 4.3).
    fn dora(&self, t: &Lora, magnitude: &Tensor, x: &Tensor, result: &Tensor) -> Result<Tensor> {
        // torch.eye(in, dtype and device of lora_A's weight): a row of ones, on the diagonal
        let eye = t.a.f_select(0, 0)?.f_ones_like()?.f_diag_embed(0, -2, -1)?;
        let lora_weight = t.lora_b(&eye)?.f_numpy_t()?.f_to_kind(x.f_kind()?)?;
        let weight = self.weight.f_to_kind(x.f_kind()?)?;
        let summed = weight.f_add(&lora_weight.f_detach()?.f_mul_scalar(t.scaling)?)?;
        let weight_norm = summed.f_linalg_norm(2, [1i64].as_slice(), false, None)?.f_to_kind(weight.f_kind()?)?;
        let mag_norm_scale = magnitude.f_div(&weight_norm.f_detach()?)?.f_view([1, -1])?;
        let lora_result = t.lora_b(x)?;
        let unbiased;
        let base_result = match &self.bias {
            Some(bias) => {
                unbiased = result.f_sub(bias)?;
                &unbiased
            }
            None => result,
        };
        let scaled = mag_norm_scale.f_mul(&lora_result)?.f_mul_scalar(t.scaling)?;
        Ok(mag_norm_scale.f_sub_scalar(1)?.f_mul(base_result)?.f_add(&scaled)?)
    }
}
