"""The pytest plugin: ``pytest --plusequals-audit`` fails a test whose module calls
break rustc's rules, showing the diagnostics; passes the others unchanged; is off unless asked.
Run with pytest's own pytester on test files written into its temp dir."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from support.programs import RESIDUAL

pytest_plugins = ["pytester"]

TESTS = (
    RESIDUAL
    + """\


class Clean(nn.Module):
    def forward(self, x):
        return x + 1


def test_residual():
    Residual()(torch.randn(2, 4))


def test_clean():
    for _ in range(3):
        Clean()(torch.randn(2, 4))


def test_allowed():
    x = torch.randn(2, 4)
    Residual()(x)  # the write is in forward's line, not here: not silenced here


def test_training():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    out = model(torch.randn(2, 4, requires_grad=True))
    out.mul_(2)  # outside any module call: not the audit's
"""
)


@pytest.fixture
def tests_file(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # an installed entry point would load the plugin again by name; the tests name it with -p
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_model=TESTS)
    return pytester


def test_off_unless_asked(tests_file):
    result = tests_file.runpytest("-p", "plusequals.auditing.plugin")
    result.assert_outcomes(passed=4)


def test_a_test_with_findings_fails_with_the_diagnostics(tests_file):
    result = tests_file.runpytest("-p", "plusequals.auditing.plugin", "--plusequals-audit")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "FAILED test_model.py::test_residual" in out and "FAILED test_model.py::test_allowed" in out
    result.stdout.fnmatch_lines(
        [
            "*error[[]E0596[]]: `Residual` wrote into `x`, which it only borrowed",
            "*--> test_model.py:11:9",
            "*11 |         x += self.lin(x)",
            "*|         ^^^^ aten.add_.Tensor writes into `x`",
            "*help: write `x = x + ...`, or `.clone()` it first; in Rust: a move or `&mut`",
        ]
    )


def test_an_allow_silences_and_an_unused_one_warns(tests_file):
    tests_file.makepyfile(
        test_model=TESTS.replace("x += self.lin(x)", "x += self.lin(x)  # plusequals: allow(E0596, E0502)")
    )
    result = tests_file.runpytest("-p", "plusequals.auditing.plugin", "--plusequals-audit")
    result.assert_outcomes(passed=4)  # only warnings left: an unused allow does not fail a test


def test_backward_option_audits_a_backward_too(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(
        test_ckpt="""\
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        class Inner(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

            def forward(self, x):
                h = self.a(x)
                h += self.b(h)
                return h

        class Outer(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = Inner()

            def forward(self, x):
                return checkpoint(self.inner, x, use_reentrant=True)

        def test_ckpt():
            Outer()(torch.randn(2, 4, requires_grad=True))
        """
    )
    pytester.runpytest("-p", "plusequals.auditing.plugin", "--plusequals-audit").assert_outcomes(passed=1)
    result = pytester.runpytest("-p", "plusequals.auditing.plugin", "--plusequals-audit-backward")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*error[[]E0502[]]: `Outer.inner` overwrote a tensor autograd saved for backward"])


def test_pyproject_declares_the_entry_point():
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"plusequals.auditing.plugin": "plusequals.auditing.plugin"}
