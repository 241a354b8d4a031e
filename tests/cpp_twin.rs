//! The C++ twin (cpp/block.cpp) against the Rust one, on the same weights, and the C++ bug
//! gallery (cpp/gallery.cpp): every case compiled (it is part of the build) and each bug
//! happens at run time, where rustc refused the same code (tests/ui/).
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use plusequals::cpp::CppBlock;
use plusequals::testing::{small_config, small_inputs, small_weights};
use plusequals::{Attention, BasicTransformerBlock, NoGrad};

fn twins(attention: Attention) -> plusequals::Result<(BasicTransformerBlock, CppBlock)> {
    let cfg = small_config(attention);
    let mut weights: Vec<_> = small_weights(0)?.into_iter().collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    let cpp = CppBlock::from_weights(&weights, &cfg)?;
    let rust = BasicTransformerBlock::from_weights(weights.into_iter().collect(), &cfg)?;
    Ok((rust, cpp))
}

#[test]
fn cpp_forward_is_bitwise_equal_to_rust_for_both_attention_paths() -> plusequals::Result<()> {
    for attention in [Attention::Sdpa, Attention::Einsum] {
        let (rust, cpp) = twins(attention)?;
        let (x, c) = small_inputs()?;
        let before = x.copy();
        let expected = rust.forward(&x, Some(&c))?;
        assert!(cpp.forward(&x, Some(&c))?.equal(&expected), "{attention:?}: forward differs");
        assert!(x.equal(&before), "forward wrote into x");
        let no_grad = NoGrad::new();
        let owned = cpp.forward_owned(x.copy(), Some(&c), &no_grad)?;
        assert!(owned.equal(&rust.forward_owned(x.copy(), Some(&c), &no_grad)?));
        assert!(cpp.forward_loop(&x, Some(&c), 3, true)?.equal(&expected), "{attention:?}: loop differs");
        assert!(cpp.forward_loop(&x, Some(&c), 2, false)?.equal(&expected));
    }
    Ok(())
}

#[test]
fn a_cpp_exception_is_an_err_with_its_message() -> plusequals::Result<()> {
    let (_, cpp) = twins(Attention::Sdpa)?;
    let (x, c) = small_inputs()?;
    let err = cpp.forward(&x.narrow(2, 0, 31), Some(&c)).expect_err("a wrong width must fail in libtorch");
    assert!(matches!(err, plusequals::Error::Cpp(ref m) if !m.is_empty()), "{err:?}");
    let mut weights: Vec<_> = small_weights(0)?.into_iter().collect();
    weights.retain(|(k, _)| k != "norm2.bias");
    let err = CppBlock::from_weights(&weights, &small_config(Attention::Sdpa)).err().expect("a missing key");
    assert!(err.to_string().contains("missing weight \"norm2.bias\""), "{err}");
    Ok(())
}

#[test]
fn every_cpp_gallery_case_compiles_and_its_bug_happens_at_run_time() -> plusequals::Result<()> {
    let (_, cpp) = twins(Attention::Sdpa)?;
    let (x, c) = small_inputs()?;
    let cases = cpp.gallery(&x, &c);
    let names: Vec<_> = cases.iter().map(|(n, ..)| n.as_str()).collect();
    let ui: Vec<_> = include_str!("ui/cases.txt")
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(names[..ui.len()], ui[..], "one C++ case per rustc case, in the same order");
    for (name, happened, what) in cases {
        let happened = happened?;
        if name == "clone_guard" {
            assert!(!happened, "the clone guard let the bug through: {what}");
        } else {
            assert!(happened, "{name}: the bug did not happen in C++: {what}");
        }
        if name.contains("grad") || name.contains("inplace_add") {
            assert!(what.contains("modified by an inplace operation"), "{name}: {what}");
        }
    }
    Ok(())
}
