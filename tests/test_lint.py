"""What clippy checks in this crate's own code: no tch method that writes through a shared
reference (`_out`, `copy_from`), and no tch call that panics on a libtorch error. rustc accepts
those calls (they are tch's API); clippy.toml lists every one under `disallowed-methods`, and
`make lint` runs clippy with `-D warnings`."""

import re
import subprocess
import sys

from plusequals.cli.demo import REPO


def test_clippy_toml_lists_every_write_through_shared_method_of_tch():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_clippy_toml.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (REPO / "clippy.toml").read_text()
    for method in ["f_add_out", "add_out", "f_internal_copy_from", "f_mm_out", "f_native_layer_norm_out"]:
        assert f'"tch::Tensor::{method}"' in text, method
    # The README's numbers: 870 `f_*_out` functions, each also in tch's panicking form, plus the
    # `_out_` and `copy_from` families: 1754 methods.
    assert len(re.findall(r'^    "tch::Tensor::f_\w*_out",$', text, re.M)) == 870
    assert len(re.findall(r'^    "tch::Tensor::\w+",$', text, re.M)) == 1754


def test_clippy_toml_lists_every_panicking_tch_call():
    """The second group: each with its reason. The README's number is this count."""
    text = (REPO / "clippy.toml").read_text()
    panicking = re.findall(r'\{ path = "(tch::[\w:]+)", reason = "panics on a libtorch error', text)
    for call in [
        "tch::Tensor::size",
        "tch::Tensor::kind",
        "tch::Tensor::device",
        "tch::Tensor::data_ptr",
        "tch::Tensor::shallow_clone",
        "tch::Tensor::g_add",
        "tch::Tensor::copy",
        "tch::IndexOp::i",
        "tch::no_grad_guard",
    ]:
        assert call in panicking, call
    assert not [c for c in panicking if c.startswith("tch::Tensor::f_")]
    assert len(panicking) == 1735
    assert "1735 in all" in (REPO / "docs/guide/bugs.md").read_text()


def test_clippy_refuses_writing_through_a_shared_borrow_and_panicking_calls():
    """tests/lint/write_through_shared.rs: `x.f_add_out(x, &h)` on `x: &Tensor` compiles with
    rustc (rust/aliases.rs runs the same thing and sees x change); clippy refuses it.
    tests/lint/panics_on_error.rs: `x.size()` and `x.kind()`, which panic on a tensor without
    storage; clippy refuses them. Each call carries `#[expect(clippy::disallowed_methods)]`, and
    `make lint` checks the examples with `-D warnings`: an expectation clippy leaves unfulfilled
    (it accepted the call) fails that run. Here: each refused call is so marked, and make lint
    checks every target, examples included."""
    cases = {"write_through_shared.rs": ["f_add_out"], "panics_on_error.rs": ["size", "kind"]}
    for name, calls in cases.items():
        lines = (REPO / "tests" / "lint" / name).read_text().splitlines()
        for call in calls:
            at = [i for i, line in enumerate(lines) if f".{call}(" in line and not line.lstrip().startswith("//")]
            assert len(at) == 1, (name, call, at)
            assert lines[at[0] - 1].strip().startswith("#[expect(clippy::disallowed_methods"), (name, call)
    makefile = (REPO / "Makefile").read_text()
    clippy = next(line for line in makefile.splitlines() if line.strip().startswith("cargo clippy"))
    assert "--all-targets" in clippy and "-D warnings" in clippy, clippy
    manifest = (REPO / "Cargo.toml").read_text()
    assert "required-features" not in manifest  # an example behind a feature would not be checked
