"""``plusequals.audit``: rustc's verdicts on PyTorch code, each with its line.

Each code and each way of writing is generated (hypothesis) and judged against an oracle that
does not use the audit: whether the caller's tensor changed (E0596), whether a name holding it
was read afterwards (E0382), whether PyTorch's own backward refuses the graph (E0502). The
project's strategies must agree with ``bugs.EXPECTED``; the clean ones, the unpatched diffusers
UNet and the real models must give no finding. The audit leaves nothing behind.
"""

from __future__ import annotations

import copy
import inspect
import operator
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from plusequals.auditing import AuditReport, audit
from plusequals.auditing.frames import short_path
from plusequals.cases import project as cases
from plusequals.model.blocks import STRATEGIES
from plusequals.model.bugs import VERSION_COUNTER
from support.docs import guide_block


def line_of(fn) -> str:
    """Where a one-line function (a lambda) is, as the audit writes it."""
    return f"{short_path(fn.__code__.co_filename)}:{fn.__code__.co_firstlineno}"


def line_in(obj, text: str) -> str:
    """The line of ``obj``'s source that contains ``text``, as the audit writes it."""
    src, start = inspect.getsourcelines(obj)
    return f"{short_path(inspect.getsourcefile(obj))}:{start + next(i for i, s in enumerate(src) if text in s)}"


def only(report: AuditReport, code: str):
    found = report.by_code(code)
    assert len(found) == 1, report.findings
    return found[0]


# ---------------------------------------------------------------------------------- E0596
# Each way of writing into a tensor, as a one-line function (its line is the finding's `where`)
# and the aten op the audit must name (a prefix, or a tuple of them).
WRITES = {
    "add_": (lambda t: t.add_(1.0), "aten.add_"),
    "+=": (lambda t: operator.iadd(t, 1.0), "aten.add_"),
    "out=": (lambda t: torch.mul(t, 2.0, out=t), "aten.mul.out"),
    "slice assignment": (lambda t: t.__setitem__(0, 0.0), ("aten.fill_", "aten.copy_")),  # copy_ into 0-dim
    "F.relu(inplace=True)": (lambda t: F.relu(t, inplace=True), "aten.relu_"),
    "copy_": (lambda t: t.copy_(torch.zeros_like(t)), "aten.copy_"),
    "index_put_": (lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(3.0)), "aten.index_put_"),
    "masked_fill_": (lambda t: t.masked_fill_(t > 0, 0.0), "aten.masked_fill_"),
    "clamp_": (lambda t: t.clamp_(max=0.0), "aten.clamp_"),
    ".data.zero_()": (lambda t: t.data.zero_(), "aten.zero_"),
}
# How the module reaches the argument's memory before writing.
VIEWS = {
    "itself": lambda t: t,
    "view(-1)": lambda t: t.view(-1),
    "t[1:]": lambda t: t[1:],
    "transpose": lambda t: t.transpose(0, 1),
    "unsqueeze(0)": lambda t: t.unsqueeze(0),
    "detach()": lambda t: t.detach(),
    "copy.copy": lambda t: copy.copy(t),
    "a fresh clone": lambda t: t.clone(),  # the module's own temporary: no finding
}


class Writer(nn.Module):
    def __init__(self, view, write) -> None:
        super().__init__()
        self.view, self.write = view, write

    def forward(self, x):
        self.write(self.view(x))
        return x * 2


class Wrap(nn.Module):
    """Depth > 1: passes its argument down unchanged; reads it afterwards if ``read``."""

    def __init__(self, inner: nn.Module, read: str) -> None:
        super().__init__()
        self.inner, self.read = inner, read

    def forward(self, x):
        keep = x
        if self.read == "after":
            y = self.inner(x)
            return y + keep
        if self.read == "same line":
            return self.inner(x) + x
        if self.read == "rebound":
            x = self.inner(x)
            keep = x
            return keep * 1
        return self.inner(x)


READ_LINES = {
    "after": "return y + keep",
    "same line": "return self.inner(x) + x",
}


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(WRITES)),
    st.sampled_from(sorted(VIEWS)),
    st.integers(1, 3),
    st.sampled_from(["after", "same line", "rebound", "none"]),
)
def test_every_write_into_an_argument_is_E0596_and_every_later_read_E0382(kind, view, depth, read):
    write, op = WRITES[kind]
    model: nn.Module = Writer(VIEWS[view], write)
    name = ""
    for _ in range(depth - 1):
        model, name = Wrap(model, read), "inner" + ("." + name if name else "")
    x = torch.randn(4, 3)
    before = x.clone()
    with torch.no_grad():
        report = audit(model, x)
    mutated = not torch.equal(x, before)  # the oracle: did the caller's memory change?
    fresh = view == "a fresh clone"
    assert mutated == (not fresh) or kind in ("clamp_", "masked_fill_")  # (may leave values as they were)
    if fresh:
        assert report.clean, report.findings
        return
    f = only(report, "E0596")
    assert (f.module, f.where) == (name, line_of(write)), f
    assert f.op.startswith(op), f
    moved_read = depth > 1 and read in READ_LINES
    assert ("E0382" in report.codes) == moved_read, report.findings
    if moved_read:
        g = only(report, "E0382")
        assert (g.module, g.where, g.read_at) == (name, f.where, line_in(Wrap, READ_LINES[read]))


def test_a_metadata_write_counts_on_the_argument_itself_not_on_a_view():
    def unsqueeze_(t):
        t.unsqueeze_(0)

    x = torch.randn(3)
    assert audit(Writer(lambda t: t, unsqueeze_), x).codes == ["E0596"]
    assert x.shape == (1, 3)  # the caller's tensor did change
    y = torch.randn(3)
    assert audit(Writer(lambda t: t.view(3), unsqueeze_), y).clean
    assert y.shape == (3,)


def test_a_child_that_writes_into_its_parents_temporary_is_a_move_not_a_finding():
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            h = x * 2
            return self.act(h)  # nobody reads h afterwards: a move, forward_owned in Rust

    report = audit(Parent(), torch.randn(5))
    assert report.clean and report.summary().startswith("clean"), report.findings
    (m,) = report.moves
    assert (m.code, m.module, m.where, m.op) == (
        "move",
        "act",
        line_in(Parent, "return self.act(h)"),
        "aten.relu_.default",
    )
    assert m.writer == "nn.ReLU(inplace=True)"


def test_a_module_writing_its_own_temporaries_and_buffers_is_clean():
    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3).train()  # writes its running statistics
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            h = self.bn(x)
            h += 1
            h[0] = 0.0
            self.calls += 1
            return F.relu(h, inplace=True)

    assert audit(Own(), torch.randn(4, 3)).clean


def test_the_innermost_module_given_the_memory_is_named_and_a_view_of_an_input_counts():
    class Inner(nn.Module):
        def forward(self, part):
            part.mul_(2)
            return part

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            self.inner(x[:, :2])  # a view of Outer's input
            return x.sum()

    report = audit(nn.Sequential(Outer()), torch.randn(3, 4))
    f = only(report, "E0596")
    assert f.module == "0.inner" and "part" in f.message
    g = only(report, "E0382")
    assert g.read_at == line_in(Outer, "return x.sum()")


def test_a_module_called_twice_is_counted_and_a_functional_call_inside_a_module_is_its_own():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = Writer(lambda t: t, WRITES["add_"][0])

        def forward(self, a, b):
            return self.w(a) + self.w(b)

    report = audit(Twice(), torch.randn(2), torch.randn(2))
    f = only(report, "E0596")
    assert (f.module, f.count) == ("w", 2)

    class Functional(nn.Module):
        def forward(self, x):
            return F.hardtanh(x, inplace=True)

    f = only(audit(Functional(), torch.randn(3)), "E0596")
    assert (f.module, f.where, f.op) == ("", line_in(Functional, "F.hardtanh"), "aten.hardtanh_.default")


def test_a_callable_that_is_not_a_module_borrows_its_arguments_too():
    def fn(x, *, scale):
        x.mul_(scale)
        return x

    f = only(audit(fn, torch.randn(3), scale=2.0), "E0596")
    assert f.module == "" and f.where == line_in(fn, "x.mul_(scale)")


_POOL = ["a", "b", "x", "h", "inp", "hidden", "t_0"]


def _writer(names: list, k: int):
    """``def forward(self, <names>)`` that writes into its ``k``-th parameter and returns the first."""
    src = f"def forward(self, {', '.join(names)}):\n    {names[k]}.add_(1.0)\n    return {names[0]} * 2\n"
    scope: dict = {}
    exec(compile(src, "<generated forward>", "exec"), scope)
    return scope["forward"]


def _named(report) -> str:
    return only(report, "E0596").message.split("wrote into its argument `", 1)[1].split("`", 1)[0]


@settings(max_examples=examples(10), deadline=None)
@given(st.data())
def test_an_argument_is_named_by_the_forward_that_runs_now(data):
    """Each audit names the argument as the function that runs now does: generated parameter
    names, after its ``__code__`` was swapped for other names, and whether it runs bound (a
    module's ``forward``) or unbound (the same function audited as a plain callable). No audit
    keeps the function alive."""
    import gc
    import weakref

    n = data.draw(st.integers(2, 4))
    first, second = (data.draw(st.lists(st.sampled_from(_POOL), min_size=n, max_size=n, unique=True)) for _ in "12")
    k = data.draw(st.integers(0, n - 1))
    forward = _writer(first, k)
    model = type("Generated", (nn.Module,), {"forward": forward})()
    args = [torch.randn(3) for _ in first]
    assert _named(audit(model, *args)) == first[k]
    assert _named(audit(forward, model, *args)) == first[k]  # unbound: ``self`` is its first parameter
    assert _named(audit(model, *args)) == first[k]
    forward.__code__ = _writer(second, k).__code__
    assert _named(audit(model, *args)) == second[k]
    gone = weakref.ref(forward)
    del model, forward
    gc.collect()
    assert gone() is None


def test_E0382_follows_names_held_in_containers_and_forgets_rebound_and_deleted_ones():
    class Level(nn.Module):
        def __init__(self, mode: str) -> None:
            super().__init__()
            self.w = Writer(lambda t: t, WRITES["add_"][0])
            self.mode = mode

        def forward(self, x):
            skips = [x]
            also = x
            out = self.w(x)
            if self.mode == "list":
                return out + skips[0]
            del also
            also = out
            return also * 1

    assert only(audit(Level("list"), torch.randn(3)), "E0382").read_at == line_in(Level, "skips[0]")
    assert "E0382" not in audit(Level("rebind"), torch.randn(3)).codes


# ---------------------------------------------------------------------------------- E0502
# An op that saves something for backward (its input, its result, or both), and where a later
# write goes; PyTorch's own backward is the oracle.
SAVERS = {
    "exp (saves its result)": torch.exp,
    "sigmoid (result)": torch.sigmoid,
    "mul by itself (input)": lambda t: t * t,
    "pow (input)": lambda t: t.pow(3),
    "layer_norm (input)": lambda t: F.layer_norm(t, t.shape[-1:]),
    "relu (result)": torch.relu,
    "add (nothing)": lambda t: t + 1,
    "linear (input)": lambda t: F.linear(t, torch.ones(3, 3)),
}
TARGETS = ("the saved input", "the result", "a view of the input", "an unrelated tensor", "nothing")


class Saver(nn.Module):
    def __init__(self, op, target: str) -> None:
        super().__init__()
        self.op, self.target = op, target

    def forward(self, x):
        t = x * 1.0  # the module's own tensor: writing into it is no E0596
        u = x * 1.0
        y = self.op(t)
        victim = {"the saved input": t, "the result": y, "a view of the input": t[0], "an unrelated tensor": u}
        if self.target in victim:
            victim[self.target].add_(1.0)
        return y.sum() + u.sum()


def pytorch_refuses(model: nn.Module, x: torch.Tensor) -> bool:
    try:
        model(x).backward()
    except RuntimeError as e:
        assert VERSION_COUNTER in str(e), e
        return True
    return False


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from(sorted(SAVERS)), st.sampled_from(TARGETS), st.booleans())
def test_E0502_exactly_when_pytorchs_backward_refuses(saver, target, backward):
    model = Saver(SAVERS[saver], target)
    x = torch.randn(2, 3, requires_grad=True)
    refuses = pytorch_refuses(model, x)
    report = audit(model, x, backward=backward)
    assert ("E0502" in report.codes) == refuses, (report.findings, refuses)
    assert "E0596" not in report.codes and "E0382" not in report.codes
    if refuses:
        f = only(report, "E0502")
        assert f.where == line_in(Saver, "victim[self.target].add_(1.0)")
        assert (report.backward_error is not None) == backward  # found at the write, before backward


def test_E0502_is_silent_for_a_graph_nobody_will_run_and_for_batchnorm_called_twice():
    class Discarded(nn.Module):
        def forward(self, x):
            t = x * 1.0
            unused = t * t  # saves t; dropped before backward
            del unused
            t += 1
            return t.sum()

    x = torch.randn(3, requires_grad=True)
    report = audit(Discarded(), x, backward=True)
    assert report.clean and report.backward_error is None

    bn = nn.BatchNorm1d(4).train()  # running stats are written without a version bump
    model = nn.Sequential(bn, nn.Linear(4, 4), bn)
    report = audit(model, torch.randn(8, 4), backward=True)
    assert report.clean and report.backward_error is None


def test_E0502_under_no_grad_is_silent():
    with torch.no_grad():
        report = audit(Saver(torch.exp, "the result"), torch.randn(2, 3))
    # nothing saved; the write goes through `victim`, taken from `y`, which is never used again:
    # `y` read afterwards ends a reborrow, as Rust accepts (`tests/test_audit_alias.py`)
    assert report.clean, report.findings


# ------------------------------------------------------------------------- the project's code
@pytest.mark.parametrize("setting", cases.SETTINGS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_each_strategy_agrees_with_what_pytorch_does(strategy, setting):
    report = cases.strategy_audit(strategy, setting)
    assert cases.agreement(strategy, setting, report) is None, report.findings
    if strategy in ("op_plus_x", "x_plus_op"):
        assert report.clean


def test_the_seeds_iadd_lines_are_named():
    lines = [line_in(STRATEGIES["iadd"], f"x += b.{name}(") for name in ("attn1", "attn2", "ff")]
    assert lines[0] == "plusequals/model/blocks.py:" + lines[0].split(":")[1]
    skip = cases.strategy_audit("iadd", "skip")
    assert skip.codes == ["E0382"] and not skip.moves  # the three writes went into what `skip` reads
    assert only(skip, "E0382").read_at == line_in(cases.SkipHarness, "return h + skip")
    assert only(skip, "E0382").where == lines[0]  # the first write moved it
    training = cases.strategy_audit("iadd", "training")
    assert only(training, "E0502").where == lines[2]  # norm3 saved x: the embedding reaches x at attn2


@pytest.mark.parametrize("training", [False, True])
def test_the_unpatched_diffusers_unet_is_clean(diffusers, training):
    report = cases.unet_audit(patched=False, training=training)
    assert report.clean and report.error is None and report.backward_error is None
    assert report.modules > 200 and report.calls > 200


def test_the_seeds_iadd_in_diffusers_is_found_in_every_transformer_block(diffusers):
    report = cases.unet_audit(patched=True, training=True)
    blocks = {n for n, m in cases.tiny_unet()[0].named_modules() if type(m).__name__ == "BasicTransformerBlock"}
    # diffusers rebinds each block's output and never reads its input again: the writes are
    # moves (no E0596), and the ones into what autograd saved are E0502
    assert report.codes == ["E0502"] and {f.module for f in report.by_code("E0502")} == blocks
    assert {m.module for m in report.moves} == blocks
    lines = {line_in(cases.seed_iadd_forward, f"hidden_states += self.{n}(") for n in ("attn1", "attn2", "ff")}
    assert {f.where for f in report.findings} | {m.where for m in report.moves} == lines
    assert VERSION_COUNTER in (report.backward_error or "")
    inference = cases.unet_audit(patched=True, training=False)
    assert inference.clean and {m.module for m in inference.moves} == blocks


def test_a_rust_block_inside_an_audited_model_runs_through_its_custom_op_and_is_clean():
    from plusequals import RustBlock
    from plusequals.model.bugs import small_block

    block = small_block()
    rust = RustBlock.from_torch(block)
    harness = cases.SkipHarness(rust)
    x, c = torch.randn(2, 16, 32), torch.randn(2, 7, 24)
    expected = harness(x, c)
    report = audit(harness, x, c)
    assert report.clean and report.error is None, (report.findings, report.error)
    assert torch.equal(harness(x, c), expected)


# ---------------------------------------------------------------------------- leaves nothing
def test_the_audit_leaves_no_hook_mode_or_tracer_behind_even_when_the_model_raises():
    class Raises(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = Writer(lambda t: t, WRITES["add_"][0])

        def forward(self, x):
            keep = x
            self.w(x)
            raise KeyError("the model's own error")
            return keep  # noqa

    model = Raises()
    tracer = sys.gettrace()
    grad = torch.is_grad_enabled()
    report = audit(model, torch.randn(3))
    assert report.codes == ["E0596"] and report.error == 'KeyError: "the model\'s own error"'
    assert sys.gettrace() is tracer and torch.is_grad_enabled() == grad
    assert torch._C._len_torch_dispatch_stack() == 0 and not torch._C._is_torch_function_mode_enabled()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def _traced(frame) -> bool:
    """Whether the audit traces ``frame`` now (its opcodes: settrace on 3.11, the code's local
    events on 3.12+), or has a trace function of its own installed."""
    monitoring = getattr(sys, "monitoring", None) if sys.version_info >= (3, 12) else None
    if monitoring is None:
        return frame.f_trace is not None or getattr(sys.gettrace(), "__self__", None).__class__.__name__ == "MoveTracer"
    tools = [t for t in range(6) if monitoring.get_tool(t) == "plusequals.auditing"]
    return any(monitoring.get_local_events(t, frame.f_code) for t in tools)


def test_a_move_rebound_at_once_leaves_no_frame_traced():
    """``out = self.relu(out)`` moves ``out`` and rebinds it at once: from then on nothing is
    traced (on 3.11 a trace function would slow every Python frame of the rest of the step),
    while a name still unread stays watched until it is read."""
    seen = []

    class Probe(nn.Module):
        def forward(self, h):
            caller = sys._getframe(1)
            while caller.f_code is not Net.forward.__code__:  # up through torch's module call
                caller = caller.f_back
            seen.append(_traced(caller))
            return h

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.relu, self.probe = nn.ReLU(inplace=True), Probe()

        def forward(self, x, keep_name: bool):
            out = x * 2
            kept = out if keep_name else None
            out = self.relu(out)
            out = self.probe(out)
            return out if kept is None else out + kept

    first = audit(Net(), torch.randn(3), False)
    second = audit(Net(), torch.randn(3), True)
    assert first.clean and len(first.moves) == 1 and second.codes == ["E0382"]
    assert seen == [False, True]


def test_another_threads_module_calls_are_not_the_audited_ones():
    model = Writer(lambda t: t, WRITES["add_"][0])
    other_done = threading.Event()

    def other():
        with torch.no_grad():
            model(torch.randn(3))  # hooks fire in this thread too: ignored
        other_done.set()

    class Caller(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x):
            t = threading.Thread(target=other)
            t.start()
            t.join()
            return x * 1

    report = audit(Caller(), torch.randn(3))
    assert other_done.is_set() and report.clean, report.findings


# ------------------------------------------------------------------- the README and the CLI
def test_the_readmes_strategy_table_is_what_the_audit_finds_now():
    from plusequals.cli.audit import strategies_markdown

    assert guide_block("audit-strategies") == strategies_markdown()


def test_the_readmes_real_model_table_is_what_the_audit_finds_now(diffusers):
    pytest.importorskip("transformers", reason="the text encoder needs transformers (with peft, in the extra)")
    from plusequals.cli.audit import models_markdown

    reports = [(m, cases.real_model_audit(m)) for m in cases.REAL_MODELS]
    for m, r in reports:
        assert set(r.codes) == m.expected, (m.name, r.findings[:3])
        assert r.ops > 400 and r.modules > 100  # the forward's ops, and those of Python code in backward
    assert guide_block("audit-models") == models_markdown(reports)


def test_torch_export_reports_only_whole_graph_inputs():
    """The README's torch.export column (torch 2.11)."""
    from plusequals.model.bugs import small_block

    block = small_block()
    block.residual = "iadd"
    x, c = torch.randn(2, 16, 32), torch.randn(2, 7, 24)
    ep = torch.export.export(block, (x.clone(), c))
    assert any("add_" in str(n.target) for n in ep.graph.nodes)  # the default IR keeps aten.add_
    assert ep.graph_signature.user_inputs_to_mutate == {}
    assert list(ep.run_decompositions().graph_signature.user_inputs_to_mutate.values()) == ["x"]
    harness = cases.SkipHarness(small_block())
    harness.block.residual = "iadd"
    exported = torch.export.export(harness, (x.clone(), c))
    assert exported.run_decompositions().graph_signature.user_inputs_to_mutate == {}  # the skip: nothing
    assert torch.equal(exported.module()(x.clone(), c), harness(x.clone(), c))  # the bug, reproduced silently
    assert "E0382" in cases.strategy_audit("iadd", "skip").codes  # what the audit says of the same harness


def test_the_cli_agrees_with_pytorch_and_exits_zero(capsys):
    from plusequals.cli import main

    assert main(["audit"]) == 0
    out = capsys.readouterr().out
    assert "Every verdict agrees with PyTorch." in out and "DISAGREES" not in out
    assert "plusequals/model/blocks.py:" in out  # the findings' lines are printed


def test_non_reentrant_checkpointing_saves_under_hooks_and_is_a_move_only():
    """The README's stated limit: tensors saved under saved-tensor hooks are not E0502 findings
    (and the block's input is the level's temporary: its writes are moves)."""
    from torch.utils.checkpoint import checkpoint

    from plusequals.model.bugs import small_block

    class Level(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(32, 32)
            self.block = small_block()
            self.block.residual = "iadd"

        def forward(self, x, c):
            return checkpoint(self.block, self.proj(x), c, use_reentrant=False)

    report = audit(Level(), torch.randn(2, 16, 32), torch.randn(2, 7, 24), backward=True)
    assert report.clean and report.moves and VERSION_COUNTER in (report.backward_error or "")
    assert report.summary().startswith("no findings")  # never "clean" when backward raised


def test_plusequals_audit_is_a_function_that_hides_no_package():
    """``plusequals.audit`` is a plain function (no callable module); the audit's package is
    ``plusequals.auditing``, so no import of a submodule is hidden by the function."""
    import importlib
    import inspect

    import plusequals

    imported = importlib.import_module("plusequals.auditing.report")
    assert plusequals.audit is importlib.import_module("plusequals.auditing").audit
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("plusequals.audit")

    report = plusequals.audit(Writer(lambda t: t, WRITES["add_"][0]), torch.randn(3))
    assert isinstance(report, plusequals.AuditReport) and report.codes == ["E0596"]
    assert plusequals.audit is audit and inspect.isfunction(plusequals.audit)
    assert imported.AuditReport is plusequals.AuditReport
    assert inspect.signature(plusequals.audit).return_annotation in ("AuditReport", plusequals.AuditReport)
