//! The Rust block on its own: the two entry points agree, bad weights and inputs are `Err`s.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use std::collections::HashMap;

use plusequals::testing::{small_config, small_inputs, small_weights};
use plusequals::{Attention, BasicTransformerBlock, BlockConfig, Error, NoGrad};
use tch::{Device, Kind, Tensor};

fn config(attention: Attention) -> BlockConfig {
    small_config(attention)
}

fn weights(seed: u64) -> HashMap<String, Tensor> {
    small_weights(seed).expect("test weights")
}

fn inputs() -> (Tensor, Tensor) {
    small_inputs().expect("test inputs")
}

#[test]
fn forward_owned_equals_forward_and_leaves_borrowed_input_alone() -> plusequals::Result<()> {
    for attention in [Attention::Sdpa, Attention::Einsum] {
        let block = BasicTransformerBlock::from_weights(weights(0), &config(attention))?;
        let (x, c) = inputs();
        let before = x.copy();
        let y = block.forward(&x, Some(&c))?;
        assert!(x.equal(&before), "forward mutated its borrowed input");
        let no_grad = NoGrad::new();
        let y_owned = block.forward_owned(x.copy(), Some(&c), &no_grad)?;
        assert!(y.allclose(&y_owned, 1e-6, 1e-6, false));
    }
    Ok(())
}

#[test]
fn einsum_and_sdpa_agree() -> plusequals::Result<()> {
    let (x, c) = inputs();
    let a = BasicTransformerBlock::from_weights(weights(0), &config(Attention::Sdpa))?.forward(&x, Some(&c))?;
    let b = BasicTransformerBlock::from_weights(weights(0), &config(Attention::Einsum))?.forward(&x, Some(&c))?;
    assert!(a.allclose(&b, 1e-5, 1e-5, false));
    Ok(())
}

/// The keys: one list (`named_weights`), the same for the configuration (built on stand-ins) as
/// for the block built on the state_dict, each key of which it names once, with its tensor.
#[test]
fn a_configuration_names_the_keys_its_block_takes() -> plusequals::Result<()> {
    for gated_ff in [true, false] {
        let cfg = BlockConfig { gated_ff, ..config(Attention::Sdpa) };
        let mut w = weights(0);
        if !gated_ff {
            for part in ["weight", "bias"] {
                let t = w.remove(&format!("ff.net.0.proj.{part}")).expect("the gated projection");
                w.insert(format!("ff.net.0.0.{part}"), t.narrow(0, 0, 128));
            }
        }
        let expected: HashMap<String, Tensor> = w.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
        let block = BasicTransformerBlock::from_weights(w, &cfg)?;
        assert_eq!(cfg.weight_keys()?, block.weight_keys());
        let named = block.named_weights();
        assert_eq!(named.len(), expected.len());
        for (key, t) in named {
            let e = &expected[&key.to_string()];
            assert!(t.data_ptr() == e.data_ptr() && t.size() == e.size(), "{key}");
        }
    }
    let err = BlockConfig { dim: 0, ..config(Attention::Sdpa) }.weight_keys().err();
    assert!(matches!(err, Some(Error::Config(_))), "{err:?}");
    Ok(())
}

#[test]
fn bad_weights_are_errors_naming_the_key() {
    let cfg = config(Attention::Sdpa);
    let mut w = weights(0);
    w.remove("attn2.to_v.weight");
    assert!(
        matches!(BasicTransformerBlock::from_weights(w, &cfg), Err(Error::MissingWeight(k)) if k == "attn2.to_v.weight")
    );

    let mut w = weights(0);
    w.insert("attn3.to_q.weight".into(), Tensor::zeros([1], (Kind::Float, Device::Cpu)));
    assert!(
        matches!(BasicTransformerBlock::from_weights(w, &cfg), Err(Error::UnexpectedWeight(k)) if k == "attn3.to_q.weight")
    );

    let mut w = weights(0);
    w.insert("norm2.bias".into(), Tensor::zeros([31], (Kind::Float, Device::Cpu)));
    assert!(
        matches!(BasicTransformerBlock::from_weights(w, &cfg), Err(Error::WeightShape { key, .. }) if key == "norm2.bias")
    );

    let mut w = weights(0);
    w.insert("norm2.bias".into(), Tensor::zeros([32], (Kind::Double, Device::Cpu)));
    assert!(
        matches!(BasicTransformerBlock::from_weights(w, &cfg), Err(Error::WeightType { key, .. }) if key == "norm2.bias")
    );
}

#[test]
fn bad_inputs_are_errors_not_panics() -> plusequals::Result<()> {
    let block = BasicTransformerBlock::from_weights(weights(0), &config(Attention::Sdpa))?;
    let (x, c) = inputs();
    let cases: Vec<(Tensor, Option<Tensor>, &str)> = vec![
        (x.view([32, 32]), Some(c.copy()), "x expected shape"),
        (Tensor::zeros([2, 16, 31], (Kind::Float, Device::Cpu)), Some(c.copy()), "x expected shape"),
        (x.to_kind(Kind::Double), Some(c.copy()), "x dtype"),
        (x.copy(), Some(c.narrow(0, 0, 1)), "context batch"),
        (x.copy(), Some(Tensor::zeros([2, 7, 23], (Kind::Float, Device::Cpu))), "context expected shape"),
        (x.copy(), None, "context is required"),
        (Tensor::zeros([2, 0, 32], (Kind::Float, Device::Cpu)), Some(c.copy()), "x is empty"),
    ];
    for (x, c, want) in cases {
        let err = block.forward(&x, c.as_ref()).expect_err(want).to_string();
        let words: Vec<_> = want.split(' ').collect();
        assert!(words.iter().all(|w| err.contains(w)), "{err:?} should mention {want:?}");
    }
    Ok(())
}

/// Test data must not depend on libtorch's global RNG, which other test threads reseed and draw
/// from. Two threads build the same block while a third
/// keeps reseeding and drawing; the weights and outputs must be bitwise equal.
#[test]
fn test_data_is_bitwise_equal_across_threads_while_the_global_rng_is_in_use() {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noise = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut seed = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tch::manual_seed(seed);
                let _ = Tensor::randn([64], (Kind::Float, Device::Cpu));
                seed += 1;
            }
        })
    };
    let build = || {
        std::thread::spawn(|| {
            (0..50)
                .map(|_| {
                    let w = weights(0);
                    let (x, c) = inputs();
                    let y = BasicTransformerBlock::from_weights(w, &config(Attention::Sdpa))
                        .and_then(|b| b.forward(&x, Some(&c)))
                        .expect("the small block runs");
                    (weights(0), y)
                })
                .collect::<Vec<_>>()
        })
    };
    let (a, b) = (build(), build());
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    noise.join().unwrap();
    let reference = weights(0);
    for ((wa, ya), (wb, yb)) in a.iter().zip(&b) {
        assert!(ya.equal(yb) && ya.equal(&a[0].1), "outputs differ between threads");
        for (key, w) in &reference {
            assert!(wa[key].equal(w) && wb[key].equal(w), "{key} differs between threads");
        }
    }
}
