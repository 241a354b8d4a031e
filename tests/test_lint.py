"""What clippy checks in this crate's own code: no tch method that writes through a shared
reference (`_out`, `copy_from`). rustc accepts those calls (they are tch's API); clippy.toml
lists every one under `disallowed-methods`, and `make lint` runs clippy with `-D warnings`."""

import re
import subprocess
import sys

from plusequals.demo import REPO, cargo_env


def test_clippy_toml_lists_every_write_through_shared_method_of_tch():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_clippy_toml.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (REPO / "clippy.toml").read_text()
    for method in ["f_add_out", "add_out", "f_internal_copy_from", "f_mm_out", "f_native_layer_norm_out"]:
        assert f'"tch::Tensor::{method}"' in text, method
    # The README's numbers: 870 `f_*_out` functions, each also in tch's panicking form, plus the
    # `_out_` and `copy_from` families: 1754 methods.
    assert len(re.findall(r'"tch::Tensor::f_\w*_out"', text)) == 870
    assert text.count("tch::Tensor::") == 1754


def test_clippy_refuses_writing_through_a_shared_borrow():
    """tests/lint/write_through_shared.rs: `x.f_add_out(x, &h)` on `x: &Tensor` compiles with
    rustc (rust/aliases.rs runs the same thing and sees x change); clippy refuses it here."""
    cmd = ["cargo", "clippy", "--quiet", "--example", "write_through_shared", "--features", "lint-case", "--", "-D", "warnings"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=cargo_env(), timeout=1800)
    assert proc.returncode != 0, "clippy accepted a write through &Tensor"
    assert "use of a disallowed method `tch::Tensor::f_add_out`" in proc.stderr, proc.stderr[-3000:]
