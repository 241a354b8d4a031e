//! The second lint case: tch calls that panic on a libtorch error. `x.size()` panics on a tensor
//! without storage (a functorch wrapper under vmap), and a panic must not cross into Python.
//! clippy.toml lists every such call under `disallowed-methods`. Each call carries
//! `#[expect(clippy::disallowed_methods)]`: `make lint`'s clippy run (`--all-targets`, which
//! checks this example, `-D warnings`) fails if clippy stops refusing it (unfulfilled expectation).
use plusequals::testing::small_inputs;
use plusequals::Result;
use tch::Tensor;

fn batch_and_dtype(x: &Tensor) -> (i64, tch::Kind) {
    #[expect(clippy::disallowed_methods, reason = "the case: size() panics on a tensor without storage")]
    let batch = x.size()[0];
    #[expect(clippy::disallowed_methods, reason = "the case: kind() panics on a tensor without storage")]
    let kind = x.kind();
    (batch, kind)
}

fn main() -> Result<()> {
    let (x, _context) = small_inputs()?;
    let _ = batch_and_dtype(&x);
    Ok(())
}
