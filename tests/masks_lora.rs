//! The Rust block's extras and adapters: attention masks (diffusers' semantics) and IP-Adapter's
//! image embeddings (`AttentionExtras`), PEFT LoRA and DoRA terms (`BlockConfig::lora`), Custom
//! Diffusion; the C++ twin's masks; errors, not panics.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use std::collections::HashMap;

use plusequals::cpp::CppBlock;
use plusequals::testing::{small_config, small_inputs, small_weights, Normal};
use plusequals::{Attention, AttentionExtras, BasicTransformerBlock, BlockConfig, Error, LoraSpec, ProcessorSpec};
use tch::{Device, Kind, Tensor};

fn block(attention: Attention) -> BasicTransformerBlock {
    BasicTransformerBlock::from_weights(small_weights(0).expect("weights"), &small_config(attention)).expect("block")
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).norm().double_value(&[]);
    d / b.norm().double_value(&[]).max(1e-30)
}

#[test]
fn masks_follow_diffusers_semantics_in_both_attention_paths() -> plusequals::Result<()> {
    let (x, c) = small_inputs()?; // x (2, 16, 32), context (2, 7, 24)
    let zero = Tensor::zeros([2, 1, 7], (Kind::Float, Device::Cpu));
    let keep = Tensor::ones([2, 7], (Kind::Bool, Device::Cpu));
    let _ = keep.narrow(1, 0, 3).fill_(0);
    let bias = (keep.to_kind(Kind::Float).neg() + 1.0) * -10000.0; // the UNet's (1 - mask) * -10000
    let mut outs = Vec::new();
    for attention in [Attention::Sdpa, Attention::Einsum] {
        let b = block(attention);
        let plain = b.forward(&x, Some(&c))?;
        let zeroed = b.forward_masked(
            &x,
            Some(&c),
            AttentionExtras { attn1: None, attn2: Some(&zero), ..AttentionExtras::NONE },
        )?;
        assert!(rel_err(&zeroed, &plain) <= 1e-6, "a zero bias changes nothing");
        let by_bool = b.forward_masked(
            &x,
            Some(&c),
            AttentionExtras { attn1: None, attn2: Some(&keep), ..AttentionExtras::NONE },
        )?;
        let by_bias = b.forward_masked(
            &x,
            Some(&c),
            AttentionExtras { attn1: None, attn2: Some(&bias.unsqueeze(1)), ..AttentionExtras::NONE },
        )?;
        assert!(rel_err(&by_bool, &plain) > 1e-3, "hiding keys changes the output");
        assert!(rel_err(&by_bool, &by_bias) <= 1e-5, "-10000 and a boolean mask hide the same keys");
        outs.push(by_bool);
    }
    assert!(rel_err(&outs[0], &outs[1]) <= 1e-5, "sdpa and einsum agree on masks");
    Ok(())
}

#[test]
fn the_cpp_twin_computes_the_same_masked_block() -> plusequals::Result<()> {
    let (x, c) = small_inputs()?;
    let mask = Tensor::ones([2, 16, 16], (Kind::Bool, Device::Cpu)).tril(0); // causal, per query
    for attention in [Attention::Sdpa, Attention::Einsum] {
        let cfg = small_config(attention);
        let mut w: Vec<(String, Tensor)> = small_weights(0)?.into_iter().collect();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        let cpp = CppBlock::from_weights(&w, &cfg)?;
        let extras = AttentionExtras { attn1: Some(&mask), attn2: None, ..AttentionExtras::NONE };
        let rust = block(attention).forward_masked(&x, Some(&c), extras)?;
        assert!(cpp.forward_masked(&x, Some(&c), extras)?.equal(&rust), "the same ops in the same order");
    }
    Ok(())
}

#[test]
fn bad_masks_are_errors_naming_the_argument() -> plusequals::Result<()> {
    let b = block(Attention::Sdpa);
    let (x, c) = small_inputs()?;
    let f = |shape: &[i64], kind: Kind| Tensor::zeros(shape, (kind, Device::Cpu));
    let cases = [
        (f(&[2, 15], Kind::Float), true, "attention_mask expected shape (2, 16) or (2, 1 or 16, 16)"),
        (f(&[2, 3, 7], Kind::Float), false, "encoder_attention_mask expected shape (2, 7) or (2, 1 or 16, 7)"),
        (f(&[2, 7], Kind::Int64), false, "encoder_attention_mask dtype torch.int64 is neither bool nor floating point"),
    ];
    for (mask, first, want) in cases {
        let extras = if first {
            AttentionExtras { attn1: Some(&mask), attn2: None, ..AttentionExtras::NONE }
        } else {
            AttentionExtras { attn1: None, attn2: Some(&mask), ..AttentionExtras::NONE }
        };
        let err = b.forward_masked(&x, Some(&c), extras).expect_err(want);
        assert!(matches!(err, Error::Input { .. }) && err.to_string().contains(want), "{err} should say {want:?}");
    }
    Ok(())
}

/// A LoRA term on `attn1.to_q` and on `ff.net.2`: the same as the block whose weights have the
/// deltas merged (`W + scaling * B @ A`, what PEFT's merge writes).
#[test]
fn lora_terms_equal_the_merged_weights() -> plusequals::Result<()> {
    let mut n = Normal::new(7);
    let specs = [("attn1.to_q", 32, 32, 3, 0.75, false), ("ff.net.2", 128, 32, 2, 2.0, true)];
    let mut weights = small_weights(0)?;
    let mut merged: HashMap<String, Tensor> = small_weights(0)?;
    let mut lora = Vec::new();
    for (i, (linear, d_in, d_out, rank, scaling, bias)) in specs.into_iter().enumerate() {
        let (a, b) = (n.tensor(&[rank, d_in], 0.3)?, n.tensor(&[d_out, rank], 0.3)?);
        let w = &merged[&format!("{linear}.weight")] + b.matmul(&a) * scaling;
        merged.insert(format!("{linear}.weight"), w);
        weights.insert(format!("{linear}.lora.{i}.A.weight"), a);
        weights.insert(format!("{linear}.lora.{i}.B.weight"), b);
        if bias {
            let b_bias = n.tensor(&[d_out], 0.3)?;
            let key = format!("{linear}.bias");
            merged.insert(key.clone(), &merged[&key] + &b_bias * scaling);
            weights.insert(format!("{linear}.lora.{i}.B.bias"), b_bias);
        }
        lora.push(LoraSpec { linear: linear.to_string(), rank, scaling, bias, dora: false });
    }
    let cfg = BlockConfig { lora, ..small_config(Attention::Sdpa) };
    let (x, c) = small_inputs()?;
    let with_lora = BasicTransformerBlock::from_weights(weights, &cfg)?.forward(&x, Some(&c))?;
    let reference =
        BasicTransformerBlock::from_weights(merged, &small_config(Attention::Sdpa))?.forward(&x, Some(&c))?;
    let plain = block(Attention::Sdpa).forward(&x, Some(&c))?;
    assert!(rel_err(&with_lora, &reference) <= 1e-5, "{}", rel_err(&with_lora, &reference));
    assert!(rel_err(&with_lora, &plain) > 1e-3, "the terms change the output");
    Ok(())
}

#[test]
fn lora_weights_are_taken_by_key_and_the_cpp_twin_refuses_them() -> plusequals::Result<()> {
    let spec = LoraSpec { linear: "attn2.to_k".into(), rank: 2, scaling: 1.0, bias: false, dora: false };
    let cfg = BlockConfig { lora: vec![spec], ..small_config(Attention::Sdpa) };
    let err = BasicTransformerBlock::from_weights(small_weights(0)?, &cfg).err();
    assert!(matches!(err, Some(Error::MissingWeight(k)) if k == "attn2.to_k.lora.0.A.weight"));
    let mut w = small_weights(0)?;
    w.insert("attn2.to_k.lora.0.A.weight".into(), Tensor::zeros([2, 23], (Kind::Float, Device::Cpu)));
    w.insert("attn2.to_k.lora.0.B.weight".into(), Tensor::zeros([32, 2], (Kind::Float, Device::Cpu)));
    let err = BasicTransformerBlock::from_weights(w, &cfg).err();
    assert!(matches!(err, Some(Error::WeightShape { key, .. }) if key == "attn2.to_k.lora.0.A.weight"));
    let w: Vec<(String, Tensor)> = small_weights(0)?.into_iter().collect();
    let err = CppBlock::from_weights(&w, &cfg).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("the C++ twin computes no LoRA terms"), "{err}");
    Ok(())
}

/// IP-Adapter on attn2 (`BlockConfig::ip_adapter`, `AttentionExtras::ip_adapter`): an adapter at
/// scale 0 is skipped (the plain block's output, bitwise), one at a non-zero scale changes the
/// output, the image count must match, the weights are taken by key, and the C++ twin refuses it.
#[test]
fn ip_adapter_terms_scales_and_refusals() -> plusequals::Result<()> {
    let mut n = Normal::new(34);
    let mut w = small_weights(0)?;
    for i in 0..2 {
        for part in ["to_k", "to_v"] {
            w.insert(format!("attn2.ip.{i}.{part}.weight"), n.tensor(&[32, 24], 0.3)?);
        }
    }
    let (x, c) = small_inputs()?;
    let images = [n.tensor(&[2, 1, 4, 24], 1.0)?, n.tensor(&[2, 1, 4, 24], 1.0)?];
    let with = |scales: Vec<f64>| -> plusequals::Result<Tensor> {
        let cfg = BlockConfig { ip_adapter: scales, ..small_config(Attention::Sdpa) };
        let w = w.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect();
        BasicTransformerBlock::from_weights(w, &cfg)?.forward_masked(
            &x,
            Some(&c),
            AttentionExtras { ip_adapter: &images, ..AttentionExtras::NONE },
        )
    };
    let plain = block(Attention::Sdpa).forward(&x, Some(&c))?;
    assert!(with(vec![0.0, 0.0])?.equal(&plain), "scale 0: the adapter is skipped");
    let one = with(vec![0.5, 0.0])?;
    assert!(rel_err(&one, &plain) > 1e-3, "the adapter changes the output");
    assert!(rel_err(&with(vec![0.5, 1.0])?, &one) > 1e-3, "so does the second");
    let cfg = BlockConfig { ip_adapter: vec![1.0, 1.0], ..small_config(Attention::Sdpa) };
    let b = BasicTransformerBlock::from_weights(w.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect(), &cfg)?;
    assert_eq!(cfg.weight_keys()?, b.weight_keys(), "the configuration's keys are its block's");
    let err =
        b.forward_masked(&x, Some(&c), AttentionExtras { ip_adapter: &images[..1], ..AttentionExtras::NONE }).err();
    assert!(matches!(err, Some(Error::Input { .. })), "{err:?}");
    let cfg = BlockConfig { ip_adapter: vec![1.0, 1.0, 1.0], ..small_config(Attention::Sdpa) };
    let err =
        BasicTransformerBlock::from_weights(w.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect(), &cfg)
            .err();
    assert!(matches!(err, Some(Error::MissingWeight(ref k)) if k == "attn2.ip.2.to_k.weight"), "{err:?}");
    // The C++ twin computes it too, bit for bit (cpp/block.cpp, CrossAttention::forward_ip).
    let cfg = BlockConfig { ip_adapter: vec![0.5, 1.0], ..small_config(Attention::Sdpa) };
    let rust = with(vec![0.5, 1.0])?;
    let w: Vec<(String, Tensor)> = w.into_iter().collect();
    let cpp = CppBlock::from_weights(&w, &cfg)?;
    let extras = AttentionExtras { ip_adapter: &images, ..AttentionExtras::NONE };
    assert!(cpp.forward_masked(&x, Some(&c), extras)?.equal(&rust));
    let err =
        cpp.forward_masked(&x, Some(&c), AttentionExtras { ip_adapter: &images[..1], ..AttentionExtras::NONE }).err();
    assert!(err.is_some_and(|e| e.to_string().contains("1 image embeddings for 2 IP-Adapters")));
    Ok(())
}

/// Custom Diffusion (a `BlockConfig::processors` entry, rust/processor/custom_diffusion.rs): with its
/// own layers equal to the attention's it computes the plain block's values (the detach keeps them;
/// SDPA's default scale instead of d_head ** -0.5), the first context token gets no gradient, and a
/// mask, a missing key, heads * d_head != dim and the C++ twin are errors.
#[test]
fn custom_diffusion_layers_detach_and_refusals() -> plusequals::Result<()> {
    let mut w = small_weights(0)?;
    for part in ["to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight", "to_out.0.bias"] {
        let copy = w[&format!("attn2.{part}")].copy();
        w.insert(format!("attn2.custom_diffusion.{part}"), copy);
    }
    let flags = ["train_kv", "train_q_out", "out_bias"].map(String::from).to_vec();
    let spec = |attn: &str| ProcessorSpec { kind: "custom_diffusion".into(), attn: attn.into(), flags: flags.clone() };
    let cfg = BlockConfig { processors: vec![spec("attn2")], ..small_config(Attention::Sdpa) };
    let shared = |w: &HashMap<String, Tensor>| w.iter().map(|(k, v)| (k.clone(), v.shallow_clone())).collect();
    let b = BasicTransformerBlock::from_weights(shared(&w), &cfg)?;
    assert_eq!(cfg.weight_keys()?, b.weight_keys(), "the configuration's keys are its block's");
    let (x, c) = small_inputs()?;
    let c = c.set_requires_grad(true);
    let y = b.forward(&x, Some(&c))?;
    assert!(rel_err(&y, &block(Attention::Sdpa).forward(&x, Some(&c))?) < 1e-6);
    y.square().sum(Kind::Float).backward();
    let grad = c.grad();
    assert_eq!(grad.narrow(1, 0, 1).abs().sum(Kind::Float).double_value(&[]), 0.0, "the first token: detached");
    assert!(grad.narrow(1, 1, 6).abs().sum(Kind::Float).double_value(&[]) > 0.0);
    let mask = Tensor::zeros([2, 1, 7], (Kind::Float, Device::Cpu));
    let err = b.forward_masked(&x, Some(&c), AttentionExtras { attn2: Some(&mask), ..AttentionExtras::NONE }).err();
    assert!(matches!(err, Some(Error::Input { .. })), "{err:?}");
    let cfg = BlockConfig { processors: vec![spec("attn1"), spec("attn2")], ..small_config(Attention::Sdpa) };
    let err = BasicTransformerBlock::from_weights(shared(&w), &cfg).err();
    assert!(matches!(err, Some(Error::MissingWeight(ref k)) if k == "attn1.custom_diffusion.to_q.weight"), "{err:?}");
    let wide = BlockConfig { d_head: 16, processors: vec![spec("attn1")], ..small_config(Attention::Sdpa) };
    let err = BasicTransformerBlock::from_weights(shared(&w), &wide).err();
    assert!(err.is_some_and(|e| e.to_string().contains("splits the heads by the hidden states' width")));
    let w: Vec<(String, Tensor)> = w.into_iter().collect();
    assert!(CppBlock::from_weights(&w, &cfg).is_err_and(|e| e.to_string().contains("no Custom Diffusion")));
    Ok(())
}

/// A processor's configuration names what the crate computes ([`plusequals::processor::KINDS`]):
/// an unknown kind or option, two processors on one attention and an attention the block does not
/// have are errors naming them; an option left out is off (its layers are not taken).
#[test]
fn processor_specs_name_what_the_crate_computes() -> plusequals::Result<()> {
    let spec = |kind: &str, attn: &str, flags: &[&str]| ProcessorSpec {
        kind: kind.into(),
        attn: attn.into(),
        flags: flags.iter().map(|f| f.to_string()).collect(),
    };
    let refused = [
        (vec![spec("sliced", "attn2", &[])], "no attention processor \"sliced\""),
        (vec![spec("custom_diffusion", "attn2", &["train_q"])], "Custom Diffusion has no option \"train_q\""),
        (vec![spec("custom_diffusion", "attn3", &[])], "custom_diffusion on \"attn3\""),
        (vec![spec("custom_diffusion", "attn2", &[]), spec("custom_diffusion", "attn2", &[])], "attn2 carries two"),
    ];
    for (processors, why) in refused {
        let cfg = BlockConfig { processors, ..small_config(Attention::Sdpa) };
        let err = cfg.weight_keys().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(why), "{err:?} does not name {why:?}");
    }
    let keys = |flags: &[&str]| {
        let cfg =
            BlockConfig { processors: vec![spec("custom_diffusion", "attn1", flags)], ..small_config(Attention::Sdpa) };
        cfg.weight_keys().map(|k| k.into_iter().filter(|k| k.contains("custom_diffusion")).collect::<Vec<_>>())
    };
    assert!(keys(&[])?.is_empty());
    assert_eq!(keys(&["train_kv"])?, ["attn1.custom_diffusion.to_k.weight", "attn1.custom_diffusion.to_v.weight"]);
    assert_eq!(keys(&["train_q_out"])?.len(), 2, "to_q and to_out.0's weight, no bias");
    assert_eq!(keys(&["train_q_out", "out_bias"])?.len(), 3);
    Ok(())
}

/// A DoRA term (`LoraSpec::dora`) equals the linear layer whose weight is DoRA's merged
/// one, `m / ‖W + s·BA‖ * (W + s·BA)` row by row (the bias unscaled), within 1e-5; its magnitude
/// is taken by key, with the layer's output width.
#[test]
fn dora_terms_equal_their_merged_weights() -> plusequals::Result<()> {
    let mut n = Normal::new(35);
    let (linear, d_in, d_out, rank, scaling) = ("ff.net.2", 128, 32, 3, 1.5);
    let spec = LoraSpec { linear: linear.into(), rank, scaling, bias: false, dora: true };
    let cfg = BlockConfig { lora: vec![spec], ..small_config(Attention::Sdpa) };
    let (a, b, m) = (n.tensor(&[rank, d_in], 0.3)?, n.tensor(&[d_out, rank], 0.3)?, n.tensor(&[d_out], 1.0)?);
    let parts = [("A.weight", &a), ("B.weight", &b), ("magnitude", &m)];
    for (given, missing) in [(0, "A.weight"), (2, "magnitude")] {
        let mut w = small_weights(0)?;
        w.extend(parts[..given].iter().map(|(p, t)| (format!("{linear}.lora.0.{p}"), t.shallow_clone())));
        let err = BasicTransformerBlock::from_weights(w, &cfg).err();
        assert!(matches!(err, Some(Error::MissingWeight(k)) if k == format!("{linear}.lora.0.{missing}")));
    }
    let mut weights = small_weights(0)?;
    weights.extend(parts.iter().map(|(p, t)| (format!("{linear}.lora.0.{p}"), t.shallow_clone())));
    let mut merged: HashMap<String, Tensor> = small_weights(0)?;
    let updated = &merged[&format!("{linear}.weight")] + b.matmul(&a) * scaling;
    let norm = updated.linalg_norm(2, [1i64].as_slice(), true, None);
    merged.insert(format!("{linear}.weight"), &updated * (m.view([-1, 1]) / norm));
    let (x, c) = small_inputs()?;
    let dora = BasicTransformerBlock::from_weights(weights, &cfg)?;
    let keys = dora.weight_keys();
    assert_eq!(cfg.weight_keys()?, keys, "the configuration's keys are its block's");
    assert_eq!(
        keys[keys.len() - 3..],
        ["ff.net.2.lora.0.A.weight", "ff.net.2.lora.0.B.weight", "ff.net.2.lora.0.magnitude"]
    );
    let with_dora = dora.forward(&x, Some(&c))?;
    let reference =
        BasicTransformerBlock::from_weights(merged, &small_config(Attention::Sdpa))?.forward(&x, Some(&c))?;
    assert!(rel_err(&with_dora, &reference) <= 1e-5, "{}", rel_err(&with_dora, &reference));
    assert!(rel_err(&with_dora, &block(Attention::Sdpa).forward(&x, Some(&c))?) > 1e-3, "the term changes the output");
    Ok(())
}
