//! Every public in-place entry point of the crate checks ownership before it writes. The
//! entry points are found, not listed: this test parses `rust/*.rs` (syn) for every `pub fn`
//! that takes a `Tensor` by value (the signature of a move), and fails on one it has no run for.
//! Each is then given an aliased `x` (a `shallow_clone` kept, a view kept) and, with no alias,
//! a call with grad mode turned back on: each must refuse, with the other name unchanged.
#![allow(clippy::disallowed_methods)] // tests use tch as its users do: a panic fails the test

use std::collections::BTreeSet;

use plusequals::cpp::CppBlock;
use plusequals::ownership::Alias;
use plusequals::testing::{small_block, small_config, small_inputs, small_weights};
use plusequals::{Attention, Error, Failure, NoGrad, Result};
use syn::visit::Visit;
use tch::Tensor;

/// `Type::method` (or `function`) for every `pub fn` in `rust/*.rs` with a by-value `Tensor` parameter.
fn by_value_tensor_fns() -> BTreeSet<String> {
    struct Finder {
        owner: Option<String>,
        found: BTreeSet<String>,
    }
    fn takes_tensor(sig: &syn::Signature) -> bool {
        sig.inputs.iter().any(|arg| match arg {
            syn::FnArg::Typed(p) => {
                matches!(&*p.ty, syn::Type::Path(t) if t.path.segments.last().is_some_and(|s| s.ident == "Tensor"))
            }
            syn::FnArg::Receiver(_) => false,
        })
    }
    impl<'ast> Visit<'ast> for Finder {
        fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
            let owner = match &*item.self_ty {
                syn::Type::Path(t) => t.path.segments.last().map(|s| s.ident.to_string()),
                _ => None,
            };
            let before = std::mem::replace(&mut self.owner, owner);
            syn::visit::visit_item_impl(self, item);
            self.owner = before;
        }
        fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
            if matches!(f.vis, syn::Visibility::Public(_)) && takes_tensor(&f.sig) {
                self.found.insert(format!("{}::{}", self.owner.clone().unwrap_or_default(), f.sig.ident));
            }
        }
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            if matches!(f.vis, syn::Visibility::Public(_)) && takes_tensor(&f.sig) {
                self.found.insert(f.sig.ident.to_string());
            }
        }
    }
    let mut finder = Finder { owner: None, found: BTreeSet::new() };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rust");
    for entry in std::fs::read_dir(dir).expect("rust/") {
        let path = entry.expect("a file").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let file = syn::parse_file(&std::fs::read_to_string(&path).expect("readable")).expect("parses");
            finder.visit_file(&file);
        }
    }
    finder.found
}

/// How to call each entry point: `x` (given up), the context, the proof.
type Run = fn(Tensor, &Tensor, &NoGrad) -> Result<Tensor>;

fn cpp() -> Result<CppBlock> {
    let mut weights: Vec<_> = small_weights(0)?.into_iter().collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    CppBlock::from_weights(&weights, &small_config(Attention::Sdpa))
}

fn runs() -> Vec<(&'static str, Run)> {
    vec![
        ("BasicTransformerBlock::forward_owned", |x, c, g| small_block()?.forward_owned(x, Some(c), g)),
        ("BasicTransformerBlock::try_forward_owned", |x, c, g| Ok(small_block()?.try_forward_owned(x, Some(c), g)?)),
        ("CppBlock::forward_owned", |x, c, g| cpp()?.forward_owned(x, Some(c), g)),
        ("CppBlock::try_forward_owned", |x, c, g| Ok(cpp()?.try_forward_owned(x, Some(c), g)?)),
    ]
}

#[test]
fn every_pub_fn_that_takes_a_tensor_by_value_is_run_here() {
    let found = by_value_tensor_fns();
    let run: BTreeSet<String> = runs().iter().map(|(name, _)| name.to_string()).collect();
    assert_eq!(found, run, "a pub fn takes a Tensor by value: give it a run in tests/entry_points.rs");
}

#[test]
fn each_refuses_an_aliased_x_and_grad_mode_turned_back_on() -> Result<()> {
    for (name, run) in runs() {
        type Alias_ = fn(&Tensor) -> Result<Tensor>;
        let kept: [(&str, Alias_); 2] =
            [("shallow_clone", |x| Ok(x.shallow_clone())), ("a view", |x| Ok(x.f_view([-1])?))];
        for (how, make) in kept {
            let (x, c) = small_inputs()?;
            let alias = make(&x)?;
            let before = alias.copy();
            let no_grad = NoGrad::new();
            let err = run(x, &c, &no_grad).expect_err(name);
            assert!(
                matches!(err, Error::NotOwned { arg: "x", why: Alias::OtherHandles(..) }),
                "{name}, {how}: {err:?}"
            );
            assert!(alias.equal(&before), "{name}, {how}: the other name changed");
        }
        let (x, c) = small_inputs()?;
        let before = x.copy();
        let kept = x.copy(); // compares the bytes after: run with no alias, grad mode back on
        let no_grad = NoGrad::new();
        let err = tch::with_grad(|| run(x, &c, &no_grad)).expect_err(name);
        assert!(matches!(err, Error::NotOwned { arg: "x", why: Alias::GradMode }), "{name}, grad mode: {err:?}");
        assert!(kept.equal(&before));
    }
    Ok(())
}

#[test]
fn a_refusal_hands_x_back_untouched() -> Result<()> {
    let block = small_block()?;
    let (x, c) = small_inputs()?;
    let (ptr, before) = (x.data_ptr(), x.copy());
    let alias = x.f_view([-1])?;
    let no_grad = NoGrad::new();
    match block.try_forward_owned(x, Some(&c), &no_grad) {
        Err(Failure::Unwritten(Error::NotOwned { .. }, x)) => {
            assert_eq!(x.data_ptr(), ptr);
            assert!(x.equal(&before));
            drop(alias);
            assert!(block.try_forward_owned(x, Some(&c), &no_grad).is_ok(), "once the view is gone, x is given");
        }
        other => panic!("{other:?}"),
    }
    Ok(())
}

#[test]
fn a_failure_after_the_first_write_consumes_x_for_both_twins() -> Result<()> {
    use plusequals::failpoint::{fail_next_at, Step};
    let rust = small_block()?;
    let cpp = cpp()?;
    let no_grad = NoGrad::new();
    for step in [Step::BeforeFirstWrite, Step::AfterFirstWrite] {
        let results = [
            {
                fail_next_at(Some(step));
                rust.try_forward_owned(small_inputs()?.0, Some(&small_inputs()?.1), &no_grad)
            },
            {
                fail_next_at(Some(step));
                cpp.try_forward_owned(small_inputs()?.0, Some(&small_inputs()?.1), &no_grad)
            },
        ];
        for result in results {
            match (step, result) {
                (Step::BeforeFirstWrite, Err(Failure::Unwritten(Error::Injected(_), x))) => {
                    assert!(x.equal(&small_inputs()?.0), "handed back untouched");
                }
                (Step::AfterFirstWrite, Err(Failure::Consumed(Error::Injected(_)))) => {}
                (_, other) => panic!("{step:?}: {other:?}"),
            }
        }
    }
    Ok(())
}
