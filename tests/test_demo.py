"""`python -m plusequals demo` runs every bug and every compile-fail case, and exits 0."""

import os
import subprocess
import sys

from plusequals import demo


def test_demo_exits_zero_and_shows_every_case():
    proc = subprocess.run([sys.executable, "-m", "plusequals", "demo"], capture_output=True, text=True, timeout=1800, env={**os.environ, "COLUMNS": "250"})
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "UNEXPECTED" not in out
    for case in demo.read_cases():
        assert case.name in out and f"error[{case.code}]" in out
    assert "MUTATED" in out and "modified by an inplace operation" in out


def test_demo_fails_when_an_expectation_fails(monkeypatch):
    """The demo's exit code can fail: flip one expectation and it must return 1."""
    from plusequals import bugs

    flipped = dict(bugs.EXPECTED)
    flipped["op_plus_x"] = bugs.Expected(True, None, None)
    monkeypatch.setattr(bugs, "EXPECTED", flipped)
    assert demo.run(skip_compile_fail=True) == 1
