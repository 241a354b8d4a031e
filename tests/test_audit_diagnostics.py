"""What a finding says: rustc's diagnostic format, the same write in a loop once with
its count, colour only on a terminal, allows, a ``where`` that is never the audit's caller, the
PyTorch fix in the help, ``summary()`` and ``str(report)``; ``plusequals.audit`` a typed
function (mypy, help())."""

from __future__ import annotations

import importlib.util
import io
import itertools
import os
import pydoc
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import plusequals
from conftest import examples
from plusequals.auditing import Finding, audit
from plusequals.auditing.diagnostics import build, render
from plusequals.cli.demo import build_cache

_COUNTER = itertools.count()


def load(text: str, directory: str):
    """A module written into ``directory`` and imported from there (its own name each time)."""
    name = f"user_model_{next(_COUNTER)}"
    path = os.path.join(directory, name + ".py")
    Path(path).write_text(textwrap.dedent(text))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESIDUAL = """\
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, times):
        super().__init__()
        self.lin, self.times = nn.Linear(4, 4), times

    def forward(self, x):
        for _ in range(self.times):
            x += self.lin(x){allow}
        return x
"""


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(allowed=st.sets(st.sampled_from(["E0596", "E0502", "E0382"])), times=st.integers(1, 4))
def test_an_allow_silences_its_codes_on_the_writing_line_and_warns_when_unused(allowed, times):
    """The write gives E0596 and E0502 (Linear saved x); an allow of a subset silences exactly
    that subset, and each allowed code that silenced nothing is an unused allow. The same write
    in a loop is one finding with its count."""
    allow = f"  # plusequals: allow({', '.join(sorted(allowed))})" if allowed else ""
    with tempfile.TemporaryDirectory() as d:
        module = load(RESIDUAL.format(allow=allow), d)
        report = audit(module.Residual(times), torch.randn(2, 4))
    assert set(report.codes) == {"E0596", "E0502"} - allowed
    assert {f.code for f in report.allowed} == {"E0596", "E0502"} & allowed
    assert sorted(code for _, code in report.unused_allows) == sorted(allowed - {"E0596", "E0502"})
    assert all(f.count == times for f in report.findings + report.allowed)
    text = str(report)
    assert text.count("error[E0596]") == ("E0596" not in allowed)
    if times > 1 and report.findings:
        assert f"the same write, seen {times} times" in text
    assert ("warning: unused allow: E0382" in text) == ("E0382" in allowed)


def test_an_allow_written_between_two_audits_is_read_as_the_file_is_now():
    """The allows are read once per file text (audit() reads its model's files at each call): an
    allow written into the model's file after an audit silences the next one, and taken out, the
    finding is back, with no unused allow left over."""
    with tempfile.TemporaryDirectory() as d:
        module = load(RESIDUAL.format(allow=""), d)
        path = Path(module.__file__)
        model = module.Residual(1)
        codes = []
        for allow in ("", "  # plusequals: allow(E0596)", ""):
            path.write_text(textwrap.dedent(RESIDUAL.format(allow=allow)))
            report = audit(model, torch.randn(2, 4))
            codes.append((sorted(report.codes), [f.code for f in report.allowed], report.unused_allows))
    assert codes == [(["E0502", "E0596"], [], []), (["E0502"], ["E0596"], []), (["E0502", "E0596"], [], [])]


INPLACE = [
    lambda: nn.ReLU(inplace=True),
    lambda: nn.LeakyReLU(0.1, inplace=True),
    lambda: nn.Hardtanh(inplace=True),
    lambda: nn.SiLU(inplace=True),
]


@settings(max_examples=examples(10), deadline=None)
@given(which=st.integers(0, len(INPLACE) - 1), depth=st.integers(1, 3))
def test_where_is_never_the_audits_caller_and_help_names_the_pytorch_fix(which, depth):
    """A Sequential's in-place child writes in torch's code, called by torch's code: the finding
    points at that child's forward, not at this line. First in the Sequential,
    it writes into the audited call's own argument (E0596); after the Linear, into a temporary
    (a move, whose ``where`` follows the same rule)."""

    def nested(*children: nn.Module) -> nn.Module:
        model: nn.Module = nn.Sequential(*children)
        for _ in range(depth - 1):
            model = nn.Sequential(model)
        return model

    report = audit(nested(INPLACE[which](), nn.Linear(4, 4)), torch.randn(2, 4))
    moved = audit(nested(nn.Linear(4, 4), INPLACE[which]()), torch.randn(2, 4))
    assert report.codes == ["E0596"] and moved.findings == [] and len(moved.moves) == 1, (report, moved.moves)
    here = f"{Path(__file__).name}:"
    sites = [f.where for f in report.findings + moved.moves]
    assert all(here not in where and where.startswith("torch/nn/modules/activation.py:") for where in sites), sites
    (diagnostic,) = [d for d in build([("Sequential", report)]) if d.code == "E0596"]
    assert diagnostic.help.startswith("pass `inplace=False`") or "inplace=False" in diagnostic.help


def test_summary_is_never_clean_when_the_forward_raised():
    class Raises(nn.Module):
        def forward(self, x):
            return x @ torch.ones(3, 3)

    report = audit(Raises(), torch.ones(2, 2))
    assert report.error and "clean" not in report.summary()
    assert report.summary().startswith("no findings before the error")
    assert "note: the forward of `(root)` raised RuntimeError" in str(report)
    assert audit(nn.Linear(2, 2), torch.ones(2, 2)).summary().startswith("clean")


def test_str_of_a_report_is_rustcs_format():
    with tempfile.TemporaryDirectory() as d:
        module = load(RESIDUAL.format(allow=""), d)
        report = audit(module.Residual(1), torch.randn(2, 4))
        text = str(report)
    path = report.findings[0].where.rsplit(":", 1)[0]  # the file is not under sys.path: as Python named it
    assert text.startswith("error[E0596]: `(root)` (Residual) wrote into `x`, which it only borrowed\n")
    assert f"  --> {path}:12:13\n" in text
    assert "12 |             x += self.lin(x)\n   |             ^^^^ aten.add_.Tensor writes into `x`" in text
    assert "help: write `x = x + ...`" in text and "Finding(" not in text
    assert text.splitlines()[-2] == "error: 2 errors (E0596, E0502) in 1 audited call"
    assert text.splitlines()[-1] == report.summary()
    assert max(len(line) for line in text.splitlines()) <= 80


def test_colour_only_on_a_terminal():
    report = audit(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)), torch.randn(2, 4))  # E0596: writes x
    plain, coloured = io.StringIO(), io.StringIO()
    render([("Net", report)], file=plain)  # not a terminal
    render([("Net", report)], file=coloured, color=True)
    assert "error[E0596]" in plain.getvalue() and "\x1b[" not in plain.getvalue()
    assert "\x1b[" in coloured.getvalue()


def test_moves_are_listed_only_when_asked():
    report = audit(nn.Linear(2, 2), torch.ones(2, 2))
    report.moves = [Finding("move", "act", "model.py:3", "aten.relu_.default", "a move")]  # a move's record
    assert "moved its argument" not in render([("Net", report)])
    text = render([("Net", report)], moves=True)
    assert "note: `Net.act` moved its argument" in text and "no errors in 1 audited call" in text


def test_help_shows_the_function():
    doc = pydoc.render_doc(plusequals.audit, renderer=pydoc.plaintext)
    assert "function audit" in doc and "AuditReport" in doc and "package" not in doc.split("\n")[0]


def test_mypy_accepts_the_readmes_call(tmp_path):
    """The README's ``plusequals.audit(block, x, c)`` type-checks (it was "Module not callable");
    torch itself is skipped, to keep this a few seconds. mypy's cache is kept with the build caches
    every clone shares (CACHE/mypy): mypy checks each cached module against its source's hash, so
    typeshed's stubs are not analysed again in every run (3 s to 0.2 s)."""
    (tmp_path / "use.py").write_text(
        "import torch\nimport plusequals\n\nblock = plusequals.BasicTransformerBlock(32, 2, 16, 24)\n"
        "x, c = torch.randn(2, 16, 32), torch.randn(2, 7, 24)\n"
        "report: plusequals.AuditReport = plusequals.audit(block, x, c)\nwrong: int = plusequals.audit(block, x)\n"
    )
    skipped = "torch.*,numpy.*,rich.*,matplotlib.*,diffusers.*,jax.*,onnx.*,onnxruntime.*,hypothesis.*"
    (tmp_path / "mypy.ini").write_text(f"[mypy]\nfollow_imports = silent\n[mypy-{skipped}]\nfollow_imports = skip\n")
    env = {**os.environ, "MYPYPATH": str(Path(plusequals.__file__).parents[1])}
    cache = build_cache() / "mypy"
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(cache), "use.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    # exactly one error: the deliberate one (an AuditReport is no int), so the call was typed
    assert proc.stdout.count("error:") == 1, proc.stdout
    assert 'use.py:7: error: Incompatible types in assignment (expression has type "AuditReport"' in proc.stdout


def test_a_scope_audits_outermost_calls_of_its_thread_only_and_leaves_audit_to_itself():
    import threading

    from plusequals.auditing.scope import AuditScope

    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))  # writes into its caller's tensor: E0596
    inner, original = nn.Sequential(model), nn.Module.__call__
    with AuditScope() as scope:
        assert nn.Module.__call__ is not original
        thread = threading.Thread(target=lambda: model(torch.randn(2, 4)))
        thread.start()
        thread.join()
        assert scope.calls == []  # another thread's call: not audited
        report = audit(model, torch.randn(2, 4))  # audit() inside a scope: its own watch only
        assert report.codes == ["E0596"] and scope.calls == []
        inner(torch.randn(2, 4))
        inner(torch.randn(2, 4))
    assert nn.Module.__call__ is original  # restored
    assert [c.module for c in scope.calls] == ["Sequential", "Sequential"]  # the outermost, once a call
    assert all(c.report.calls == 4 and c.report.codes == ["E0596"] for c in scope.calls)
    assert all(c.report.findings[0].module == "0.0" for c in scope.calls)  # nested: named from the outermost


NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda s: s not in {"in", "is", "if", "or"})


@settings(max_examples=examples(60), deadline=None)
@given(
    name=NAMES,
    indent=st.integers(0, 12),
    op=st.sampled_from(["add_", "mul_", "sub_", "div_", "clamp_", "copy_", "sigmoid_"]),
    augmented=st.booleans(),
)
def test_the_caret_is_under_the_write_and_the_help_names_its_variable(name, indent, op, augmented):
    """Generated write lines: ``x.op_(...)`` or ``x += ...``; the caret starts at the receiver
    and covers the method (or the operator), and the help rewrites that very variable."""
    from plusequals.auditing.diagnostics import _span, pytorch_fix
    from plusequals.auditing.sites import Site

    symbol = {"add_": "+", "mul_": "*", "sub_": "-", "div_": "/"}.get(op)
    augmented = augmented and symbol is not None
    code = f"{name} {symbol}= other" if augmented else f"{name}.{op}(other)"
    line = " " * indent + code + "  # trailing"
    start, end = _span(Site("f.py", "f.py", 1), line, f"aten.{op}.Tensor")
    underlined = line[start - 1 : end - 1]
    assert start == indent + 1
    assert underlined == (f"{name} {symbol}=" if augmented else f"{name}.{op}")
    fix = pytorch_fix("E0596", f"aten.{op}.Tensor", line, "arg")
    if op == "copy_":
        assert fix == f"write into a copy: `{name} = {name}.clone()` first"
    elif symbol is not None:
        assert fix.startswith(f"write `{name} = {name} {symbol} ...`")
    else:
        assert fix.startswith(f"write `{name} = {name}.{op[:-1]}(...)`")
