"""The audit steps aside while a tracer or compiler runs (``torch.jit.trace``, ``torch.compile``,
``torch.fx.symbolic_trace``, ``torch.export``): a traced or compiled call runs exactly as it does
without the audit (the same graph, the same result, bit for bit), and the summary counts the
calls it did not audit. A regression here can kill the process (SIGSEGV in the JIT tracer),
so the programs that trace run in a subprocess."""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path

import torch
from torch import nn

from plusequals.auditing.scope import AuditScope, tracer
from support.programs import package_path, python

pytest_plugins = ["pytester"]

TRACE = """\
import torch
from torch import nn

with torch.random.fork_rng():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 8)
traced = torch.jit.trace(net, (x,))
print(traced.graph)
print(traced(x).tolist(), net(x).tolist())
"""


def test_jit_trace_under_audit_run_is_the_plain_run_and_is_counted(tmp_path):
    (tmp_path / "trace.py").write_text(TRACE)
    plain = python(tmp_path, "trace.py")
    audited = python(tmp_path, "-m", "plusequals", "audit", "run", "trace.py")
    assert plain.returncode == 0, plain.stderr
    assert audited.returncode == 0, audited.stderr  # not 139: SIGSEGV in TracingState::getOutput
    assert audited.stdout == plain.stdout  # the same graph (no audit op in it), the same floats
    assert "TracerWarning" not in audited.stderr
    # the trace and check_trace's second trace: each an outermost call under the tracer
    assert "note: 2 calls under a tracer (torch.jit.trace) not audited\n" in audited.stderr
    # audited: check_trace's run of the traced module and the program's (TorchScript, run
    # eagerly: one opaque call each), and net(x)
    assert audited.stderr.rstrip().endswith("no errors in 3 audited calls; 2 calls under a tracer not audited")


SPAN_IN_A_TRACE = """\
import re

import torch
from torch import nn
from plusequals.auditing.memory import span


class Probe(nn.Module):
    def __init__(self, probe):
        super().__init__()
        self.lin, self.probe = nn.Linear(4, 4), probe

    def forward(self, x):
        y = self.lin(x).relu()
        if self.probe:  # a saved tensor, unpacked anew: a tensor the trace has not seen
            assert span(y.grad_fn._saved_result) is not None
            assert torch._C._get_tracing_state() is not None
        return y * 2


x = torch.randn(2, 4)
graphs = [str(torch.jit.trace(Probe(probe), (x,), check_trace=False).graph) for probe in (False, True)]
graphs = [re.sub(r"___torch_mangle_\\d+\\.", "", g) for g in graphs]  # the second class's name, mangled
assert graphs[0] == graphs[1], graphs
print("same graph")
"""


def test_the_audits_memory_reads_are_never_recorded_by_the_jit_tracer(tmp_path):
    """The crash's cause: under ``torch.jit.trace``, ``numel()`` of a tensor the trace has not
    seen that requires grad (what autograd saved, unpacked anew) raises inside the tracer and
    leaves its thread state cleared; the trace's end then dereferences it. ``span`` pauses the
    tracer: no crash, and nothing of the audit's in the user's graph."""
    (tmp_path / "probe.py").write_text(SPAN_IN_A_TRACE)
    proc = python(tmp_path, "probe.py")
    assert proc.returncode == 0 and proc.stdout == "same graph\n", proc.stderr


def _net() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_torch_compile_compiles_under_the_scope_and_the_call_is_counted():
    from torch._dynamo.testing import CompileCounter

    net, x = _net(), torch.ones(3, 8)
    counters = []
    outs = []
    for scoped in (False, True):
        counter = CompileCounter()
        compiled = torch.compile(net, backend=counter)
        scope = AuditScope()
        with scope if scoped else contextlib.nullcontext():
            outs.append(compiled(x))
        counters.append((counter.frame_count, counter.op_count))
    assert counters[0] == counters[1] == (1, 3)  # one graph of three ops, as without the audit
    assert torch.equal(outs[0], outs[1])
    assert scope.calls == [] and scope.not_audited == {"under a tracer (torch.compile)": 1}


def test_a_compiled_function_that_calls_modules_is_traced_by_dynamo_through_the_scope():
    """Dynamo inlines the scope's ``nn.Module.__call__``: it takes the branch that steps aside
    (``is_compiling``), with no graph break."""
    from torch._dynamo.testing import CompileCounter

    net, x = _net(), torch.ones(3, 8)
    counters = []
    for scoped in (False, True):
        counter = CompileCounter()
        fn = torch.compile(lambda t: net(t).sum() + net(t * 2).sum(), backend=counter, fullgraph=True)
        scope = AuditScope()
        with scope if scoped else contextlib.nullcontext():
            out = fn(x)
        counters.append((counter.frame_count, counter.op_count, out))
    assert counters[0][:2] == counters[1][:2] and torch.equal(counters[0][2], counters[1][2])
    assert scope.calls == []


def test_fx_and_export_trace_the_same_graph_under_the_scope_and_the_graph_module_is_audited():
    net, x = _net(), torch.ones(3, 8)
    plain = (str(torch.fx.symbolic_trace(net).graph), str(torch.export.export(net, (x,)).graph))
    with AuditScope() as scope:
        gm = torch.fx.symbolic_trace(net)
        exported = torch.export.export(net, (x,))
        traced = (str(gm.graph), str(exported.graph))
        out = gm(x)
    assert traced == plain and torch.equal(out, net(x))
    assert [c.module for c in scope.calls][-1:] == ["GraphModule.__new__.<locals>.GraphModuleImpl"]
    assert all(c.report.clean for c in scope.calls)


def test_tracer_names_what_runs():
    assert tracer(nn.Linear(2, 2)) is None
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(tracer(self))
            return x + 1

    torch.jit.trace(Spy(), (torch.ones(2),), check_trace=False)
    torch.fx.symbolic_trace(Spy())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        Spy()(torch.ones(2))
    assert seen == ["torch.jit.trace", "torch.fx", "FakeTensorMode"]


PLUGIN_TESTS = """\
import torch
from torch import nn


def test_trace():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        x = torch.randn(3, 8)
    traced = torch.jit.trace(net, (x,))
    assert torch.equal(traced(x), net(x))
    assert "aten::numel" not in str(traced.graph)
"""


def test_the_plugin_survives_a_trace_and_says_what_it_did_not_audit(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTHONPATH", package_path())
    pytester.makepyfile(test_traced=textwrap.dedent(PLUGIN_TESTS))
    # in a subprocess: the crash this guards against took the whole session down
    result = pytester.runpytest_subprocess("-p", "plusequals.auditing.plugin", "--plusequals-audit", "-rA")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*plusequals audit*", "*2 calls under a tracer (torch.jit.trace) not audited*"])


def test_json_and_sarif_name_the_calls_not_audited(tmp_path, capsys, monkeypatch):
    import json

    import jsonschema

    from plusequals.cli.run import main as audit_run

    schema = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text())
    (tmp_path / "trace.py").write_text(TRACE)
    monkeypatch.chdir(tmp_path)
    assert audit_run(["--format", "json", "-o", "out.json", "trace.py"]) == 0
    assert audit_run(["--format", "sarif", "-o", "out.sarif", "trace.py"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "out.json").read_text())["not_audited"] == {"under a tracer (torch.jit.trace)": 2}
    log = json.loads((tmp_path / "out.sarif").read_text())
    jsonschema.validate(log, schema)
    (note,) = log["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert note["level"] == "note" and note["message"]["text"] == "2 calls under a tracer (torch.jit.trace) not audited"
