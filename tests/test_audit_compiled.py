"""The module calls a ``torch.compile``-d function makes, and those of ``torch.export`` and
``torch.fx`` traces, under the audit: they run exactly as without it (the same results, bit for
bit; the same graphs and compile counts) and are counted as not audited, with the reason, in the
text, the JSON, the SARIF log and the plugin's section: one per outermost module call, each time
the compiled frame runs. One called inside an audited call runs with the audit stepped aside (as
without it, bit for bit) and counts one call. ``plusequals.audit`` of what ``torch.compile``
returned audits the code it compiled, eagerly, and leaves the compiled graph alone."""

from __future__ import annotations

import contextlib
import json
import textwrap
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import plusequals
from conftest import examples
from plusequals.auditing.scope import AuditScope
from plusequals.auditing.tracers import COMPILE, EXPORT, FX
from support.programs import package_path, python

pytest_plugins = ["pytester"]

PROGRAM = """\
import torch
from torch import nn

with torch.random.fork_rng():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 8)


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = net

    def forward(self, t):
        return self.net(t) + self.net(t * 2)


step = torch.compile(lambda t: net(t).sum() + net(t * 2).sum(), backend="aot_eager", fullgraph=True)
print([step(x).item() for _ in range(3)])
exported = torch.export.export(Twice(), (x,))
print(exported.module()(x).tolist())
traced = torch.fx.symbolic_trace(Twice())
print(traced(x).tolist(), str(traced.graph))
"""


def test_audit_run_counts_a_compiled_functions_module_calls_and_leaves_its_results_alone(tmp_path):
    (tmp_path / "compiled.py").write_text(PROGRAM)
    plain = python(tmp_path, "compiled.py")
    audited = python(tmp_path, "-m", "plusequals", "audit", "run", "compiled.py")
    assert plain.returncode == 0, plain.stderr
    assert audited.returncode == 0, audited.stderr
    assert audited.stdout == plain.stdout  # the floats bit for bit, the FX graph the same
    err = audited.stderr
    # two outermost module calls in the compiled frame, three runs; one export, one FX trace
    assert "note: 6 calls under a tracer (torch.compile) not audited\n" in err
    assert "note: 1 call under a tracer (torch.export) not audited\n" in err
    assert "note: 1 call under a tracer (torch.fx) not audited\n" in err
    # audited: the exported program's module and the FX GraphModule, each run eagerly once
    assert err.rstrip().endswith("no errors in 2 audited calls; 8 calls under a tracer not audited")


def test_json_and_sarif_count_the_compiled_calls(tmp_path, capsys, monkeypatch):
    import jsonschema

    from plusequals.cli.run import main as audit_run

    schema = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text())
    (tmp_path / "compiled.py").write_text(PROGRAM)
    monkeypatch.chdir(tmp_path)
    with torch.random.fork_rng():
        assert audit_run(["--format", "json", "-o", "out.json", "compiled.py"]) == 0
        assert audit_run(["--format", "sarif", "-o", "out.sarif", "compiled.py"]) == 0
    capsys.readouterr()
    counted = {COMPILE: 6, EXPORT: 1, FX: 1}
    assert json.loads((tmp_path / "out.json").read_text())["not_audited"] == counted
    log = json.loads((tmp_path / "out.sarif").read_text())
    jsonschema.validate(log, schema)
    (note,) = log["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert note["message"]["text"] == (
        "6 calls under a tracer (torch.compile) not audited; 1 call under a tracer (torch.export) not audited; "
        "1 call under a tracer (torch.fx) not audited"
    )


PLUGIN_TESTS = """\
import torch
from torch import nn


def test_compiled_step():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        x = torch.randn(3, 8)
    step = torch.compile(lambda t: net(t).sum(), backend="aot_eager", fullgraph=True)
    assert torch.equal(step(x), step(x))
"""


def test_the_plugin_says_how_many_compiled_calls_it_did_not_audit(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTHONPATH", package_path())
    pytester.makepyfile(test_compiled=textwrap.dedent(PLUGIN_TESTS))
    result = pytester.runpytest_subprocess("-p", "plusequals.auditing.plugin", "--plusequals-audit", "-rA")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*plusequals audit*", "*note: 2 calls under a tracer (torch.compile) not audited*"])


def _net() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


@settings(max_examples=examples(5), deadline=None)
@given(calls=st.integers(1, 3), runs=st.integers(1, 4), nested=st.booleans())
def test_each_run_counts_the_outermost_module_calls_of_the_compiled_frame(calls, runs, nested):
    """``calls`` outermost module calls (each a Sequential whose three children are nested, not
    counted; or, ``nested``, each inside a wrapper module), ``runs`` runs: ``calls * runs``,
    with the compile count and the results of the plain run."""
    from torch._dynamo.testing import CompileCounter

    net, x = _net(), torch.ones(3, 8)
    outer = nn.Sequential(net) if nested else net

    def fn(t: torch.Tensor) -> torch.Tensor:
        return sum(outer(t * (i + 1)).sum() for i in range(calls))

    seen = []
    for scoped in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        scope = AuditScope()
        with scope if scoped else contextlib.nullcontext():
            outs = [compiled(x) for _ in range(runs)]
        seen.append((counter.frame_count, counter.op_count, outs))
    (frames, ops, plain), (frames_, ops_, audited) = seen
    assert (frames, ops) == (frames_, ops_) and all(torch.equal(a, b) for a, b in zip(plain, audited))
    assert scope.calls == [] and scope.not_audited == {COMPILE: calls * runs}


def test_a_graph_break_counts_the_calls_of_each_compiled_frame():
    net, x = _net(), torch.ones(3, 8)

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = net(t)
        torch._dynamo.graph_break()
        return net(t * 2).sum() + y.sum()

    compiled = torch.compile(fn, backend="eager")
    with AuditScope() as scope:
        outs = [compiled(x) for _ in range(2)]
    assert torch.equal(outs[0], fn(x)) and torch.equal(outs[1], fn(x))
    assert scope.not_audited == {COMPILE: 4}  # net(t) in the first frame, net(t * 2) in the resumed one


def test_nothing_is_counted_outside_the_scope_or_for_a_compiled_function_without_module_calls():
    net, x = _net(), torch.ones(3, 8)
    compiled = torch.compile(lambda t: net(t).sum(), backend="eager")
    with AuditScope() as scope:
        compiled(x)
        torch.compile(lambda t: (t * 2).sum(), backend="eager")(x)
    assert scope.not_audited == {COMPILE: 1}
    compiled(x)  # the scope is closed: its hooks are gone
    assert scope.not_audited == {COMPILE: 1}
    assert torch.fx.Tracer.trace.__qualname__ == "Tracer.trace"


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return x.sum(0)


def test_audit_of_what_torch_compile_returned_audits_its_code_and_leaves_the_graph_alone():
    from torch.nn.modules import module as torch_module

    net, scale = _net(), Scale()
    for model, plain in (
        (torch.compile(lambda t: net(t).sum() + scale(t.clone()).sum(), backend="aot_eager"), None),
        (torch.compile(Scale(), backend="aot_eager"), Scale()),
    ):
        given = torch.arange(24.0).reshape(3, 8)
        before = model(given.clone())
        report = plusequals.audit(model, given.clone())
        assert report.eager == "torch.compile" and "audited eagerly" in report.summary()
        assert torch.equal(model(given.clone()), before)  # the compiled graph's bits, untouched
        if plain is not None:  # the compiled module's write, found as in the module itself
            assert [f.code for f in report.findings] == [
                f.code for f in plusequals.audit(plain, given.clone()).findings
            ]
            assert report.codes == ["E0596"]
        else:
            assert report.clean  # scale writes into a clone
    # no global hook left behind (torch would warn at every later compiled module's call)
    assert not torch_module._has_any_global_hook()


class Twice(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.net(t) + self.net(t * 2)


def test_an_export_strict_or_not_is_one_call_and_its_graph_is_the_plain_ones():
    net, x = _net(), torch.ones(3, 8)
    plain = [str(torch.export.export(Twice(net), (x,), strict=strict).graph) for strict in (False, True)]
    with AuditScope() as scope:
        audited = [str(torch.export.export(Twice(net), (x,), strict=strict).graph) for strict in (False, True)]
    assert audited == plain
    assert scope.calls == [] and scope.not_audited == {EXPORT: 2}


class Calls(nn.Module):
    """An eager module whose forward calls ``step``, a compiled function or module, ``runs``
    times (what an audited call of it runs inside)."""

    def __init__(self, step, runs: int) -> None:
        super().__init__()
        self.step, self.runs = step, runs

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.step(t * (i + 1)) for i in range(self.runs)]).cos()


def _compiled_inside(scoped: bool, module: bool, graph_break: bool, grad: bool, runs: int, backward: bool):
    """One program, plain or in a scope: an audited call runs a compiled function (or module),
    then the program calls it directly. Returns what it computed, the compile counts, what was
    warned, and the scope."""
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    net, x = _net(), torch.randn(3, 8, generator=torch.Generator().manual_seed(1), requires_grad=grad)

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = net(t).relu()
        if graph_break:
            torch._dynamo.graph_break()
        return (net(y.repeat(1, 4)) * t[:, :2]).sum()

    counter = CompileCounterWithBackend("aot_eager")

    class Fn(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return fn(t)

    step = torch.compile(Fn() if module else fn, backend=counter)
    scope = AuditScope(backward=backward)
    with warnings.catch_warnings(record=True) as warned, torch.set_grad_enabled(grad):
        warnings.simplefilter("always")
        with scope if scoped else contextlib.nullcontext():
            outs = [Calls(step, runs)(x), step(x)]
        outs.append(step(x))
        if grad:
            outs.append(torch.autograd.grad(outs[0].sum() + outs[1], x)[0])
    return outs, (counter.frame_count, counter.op_count), [str(w.message) for w in warned], scope


@settings(max_examples=examples(8), deadline=None)
@given(
    module=st.booleans(), graph_break=st.booleans(), grad=st.booleans(), runs=st.integers(1, 2), backward=st.booleans()
)
def test_a_compiled_function_inside_an_audited_call_runs_as_without_the_audit(
    module, graph_break, grad, runs, backward
):
    """The audit steps aside while it runs: the same bits (its results, later ones, the
    gradients), the same compile counts, nothing warned; each call of it counted."""
    plain, compiled, warned, _ = _compiled_inside(False, module, graph_break, grad, runs, backward)
    outs, compiled_, warned_, scope = _compiled_inside(True, module, graph_break, grad, runs, backward)
    assert len(outs) == len(plain) and all(torch.equal(a, b) for a, b in zip(plain, outs))
    assert compiled_ == compiled and warned_ == warned == []
    assert [c.module for c in scope.calls] == ["Calls"] and scope.calls[0].report.clean
    # each call inside the audited one; the outermost module calls of the direct run's frames
    direct = 1 if module else 2
    assert scope.not_audited == {COMPILE: runs + direct}


class Writes(nn.Module):
    def __init__(self, step) -> None:
        super().__init__()
        self.step = step

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.step(t) * 2


def test_a_compiled_function_inside_an_audited_call_is_one_call_not_audited_and_its_write_unseen():
    """No module call inside it: still counted, once per call; its write into the audited call's
    argument (``E0596`` in eager code) is not seen."""
    step = torch.compile(lambda t: t.add_(1), backend="eager")
    given = torch.ones(3)
    with AuditScope() as scope:
        Writes(step)(given)
        Writes(step)(given)
    assert torch.equal(given, torch.full((3,), 3.0))
    assert [c.report.clean for c in scope.calls] == [True, True] and scope.not_audited == {COMPILE: 2}


UNHOOKED = """\
import torch
import torch._dynamo
from torch import nn

net = nn.Linear(4, 2)
step = torch._dynamo.optimize("eager")(lambda t: net(t).sum())
print(step(torch.ones(2, 4)).item() == net(torch.ones(2, 4)).sum().item())
"""


def test_dynamo_imported_in_the_scope_without_torch_compile_counts_nothing(tmp_path):
    """The limit the guide states: Dynamo imported after ``audit run`` opened its scope, and used
    before ``torch.compile`` or an audited call, took the scope's module call for torch's."""
    (tmp_path / "unhooked.py").write_text(UNHOOKED)
    audited = python(tmp_path, "-m", "plusequals", "audit", "run", "unhooked.py")
    assert audited.returncode == 0, audited.stderr
    assert audited.stdout == "True\n"
    # the eager call of ``net`` only: the compiled call is neither audited nor counted
    assert audited.stderr == "no errors in 1 audited call\n", audited.stderr


def test_a_frame_compiled_before_the_scope_opened_is_counted_only_inside_an_audited_call():
    """The limit the guide states: compiled before the scope (no tally), a run of its own is
    unseen; a call of it inside an audited call steps aside and counts one, as any does."""
    net, x = _net(), torch.ones(3, 8)
    step = torch.compile(lambda t: net(t).sum(), backend="eager")
    before = step(x)
    with AuditScope() as scope:
        outs = [step(x), Calls(step, 2)(x)]
    assert torch.equal(outs[0], before) and torch.equal(outs[1], torch.stack([step(x), step(x * 2)]).cos())
    assert scope.not_audited == {COMPILE: 2}
