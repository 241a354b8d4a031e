"""What clippy checks in this crate's own code: no tch method that writes through a shared
reference (`_out`, `copy_from`), and no tch call that panics on a libtorch error. rustc accepts
those calls (they are tch's API); clippy.toml lists every one under `disallowed-methods`, and
`make lint` runs clippy with `-D warnings`."""

import re
import subprocess
import sys

from plusequals.cli.demo import REPO, cargo_env


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
    rustc (rust/aliases.rs runs the same thing and sees x change); clippy refuses it here.
    tests/lint/panics_on_error.rs: `x.size()` and `x.kind()`, which panic on a tensor without
    storage; clippy refuses them, with the reason."""
    # with make lint's features (python): its check of the dependencies is reused
    cmd = ["cargo", "clippy", "--quiet", "--examples", "--features", "lint-case,python", "--", "-D", "warnings"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cargo_env(), timeout=1800)
    assert proc.returncode != 0, "clippy accepted the lint cases"
    assert "use of a disallowed method `tch::Tensor::f_add_out`" in proc.stderr, proc.stderr[-3000:]
    for call in ("size", "kind"):
        assert f"use of a disallowed method `tch::Tensor::{call}`" in proc.stderr, proc.stderr[-3000:]
    assert "panics on a libtorch error: use its f_ form, or rust/facts.rs" in proc.stderr
