"""A ``torch.jit.script``-ed module under the audit: never a crash, the program's results bit for
bit those of the plain run, and the scripted call audited as one opaque call, its arguments
checked at the boundary (TorchScript calls its submodules without Python: nothing inside it is
a module call the audit could see, but every aten op it runs is). Under ``audit()``, under
``audit run`` and under the pytest plugin."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch
from torch import nn

import plusequals
from plusequals.auditing.frames import short_path
from plusequals.auditing.scope import AuditScope
from support.programs import python

pytest_plugins = ["pytester"]


class Writer(nn.Module):
    def __init__(self, how: int) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == 0:
            x.mul_(2.0)
        elif self.how == 1:
            x += 1.0
        elif self.how == 2:
            x[0] = 0.0
        elif self.how == 3:
            x.copy_(x.flip(0))
        return x.sum(0) + 1.0


# as TorchScript dispatches them (a scalar stays a scalar; slice assignment is a copy_)
WRITES = {0: "aten.mul_.Scalar", 1: "aten.add_.Scalar", 2: "aten.copy_.default", 3: "aten.copy_.default"}


@pytest.mark.parametrize("how", [0, 1, 2, 3, 4])
def test_audit_of_a_scripted_module_checks_its_arguments_at_the_boundary(how):
    scripted = torch.jit.script(Writer(how))
    given = torch.arange(6.0).reshape(2, 3)
    plain = given.clone()
    expected = scripted(plain)
    audited = given.clone()
    line = inspect.currentframe().f_lineno + 1
    report = plusequals.audit(scripted, audited)
    assert report.error is None and torch.equal(audited, plain)  # the same write, bit for bit
    assert torch.equal(scripted(given.clone()), expected)
    if how == 4:  # writes nothing
        assert report.clean
        return
    (finding,) = report.findings
    assert (finding.code, finding.module, finding.op) == ("E0596", "", WRITES[how])
    assert "audited call's argument" in finding.message
    # no Python frame runs inside TorchScript: the line that called the scripted module
    assert finding.where == f"{short_path(__file__)}:{line}"


PROGRAM = """\
import torch
from torch import nn


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


class Scale(nn.Module):
    def forward(self, x):
        x.mul_(2.0)
        return x


with torch.random.fork_rng():
    torch.manual_seed(0)
    clean, scale = torch.jit.script(Clean()), torch.jit.script(Scale())
    x = torch.randn(2, 4)
for _ in range(3):
    y = clean(x)
z = scale(x.clone())
print(y.tolist(), z.tolist())
"""


def test_audit_run_audits_scripted_calls_as_opaque_calls_and_leaves_the_output_alone(tmp_path):
    (tmp_path / "scripted.py").write_text(PROGRAM)
    plain = python(tmp_path, "scripted.py")
    audited = python(tmp_path, "-m", "plusequals", "audit", "run", "scripted.py")
    assert plain.returncode == 0, plain.stderr
    assert audited.returncode == 1, audited.stderr  # the findings, not a crash
    assert audited.stdout == plain.stdout  # TorchScript's results, bit for bit
    err = audited.stderr
    assert "error[E0596]" in err and "  --> scripted.py:26:" in err and "z = scale(x.clone())" in err
    assert err.rstrip().endswith("error: 1 error (E0596) in 4 audited calls")


PLUGIN_TESTS = """\
import torch
from torch import nn


class Clean(nn.Module):
    def forward(self, x):
        return x.relu() + 1


class Scale(nn.Module):
    def forward(self, x):
        x.mul_(2.0)
        return x


def test_clean():
    x = torch.randn(2, 4)
    assert torch.equal(torch.jit.script(Clean())(x), Clean()(x))


def test_scale():
    torch.jit.script(Scale())(torch.randn(2, 4))
"""


def test_the_plugin_audits_scripted_calls(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_scripted=textwrap.dedent(PLUGIN_TESTS))
    result = pytester.runpytest_subprocess("-p", "plusequals.auditing.plugin", "--plusequals-audit")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*FAILED test_scripted.py::test_scale*"])
    # named by the scripted class, at the line that called it
    result.stdout.fnmatch_lines(["*error[[]E0596[]]: `Scale` wrote into `x`*", "*--> test_scripted.py:22:5"])


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def test_a_scripted_submodule_of_an_eager_model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, x = Parent(), torch.randn(3, 4)
    expected = model(x)
    report = plusequals.audit(model, x)
    assert report.error is None and report.clean
    with AuditScope() as scope:
        out = model(x)
    assert torch.equal(out, expected)
    assert [c.report.clean for c in scope.calls] == [True] and scope.not_audited == {}
