//! The second lint case: tch calls that panic on a libtorch error. `x.size()` panics on a tensor
//! without storage (a functorch wrapper under vmap), and a panic must not cross into Python.
//! clippy.toml lists every such call under `disallowed-methods`; tests/test_lint.py checks that
//! clippy names `size` and `kind` here. Built only with `--features lint-case`.
use plusequals::testing::small_inputs;
use plusequals::Result;
use tch::Tensor;

fn batch_and_dtype(x: &Tensor) -> (i64, tch::Kind) {
    (x.size()[0], x.kind())
}

fn main() -> Result<()> {
    let (x, _context) = small_inputs()?;
    let _ = batch_and_dtype(&x);
    Ok(())
}
