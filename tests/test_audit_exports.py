"""Writes outside ATen through a NumPy or DLPack view of a tensor: ``x.numpy()``,
``np.asarray(x)``, ``torch.from_dlpack(x)``, ``np.from_dlpack(x)``, ``to_dlpack``. No op is
dispatched and no version moves, so neither a dispatch mode nor autograd sees the write. The
audit notices the export, keeps the exported bytes, and compares them before each op, at each
module boundary and at each new line of the exporting frame: a write into the audited call's
argument is ``E0596``, into a temporary the caller reads afterwards ``E0382``, into a tensor
autograd saved ``E0502`` (backward will not refuse it: the gradient is silently wrong), each at
the user's line that wrote. Reading through the view, or writing into a fresh tensor's view, is
clean. The audited run is the plain run, bit for bit.
"""

from __future__ import annotations

import inspect
import itertools
import sys

import numpy as np
import pytest
import torch
import torch.utils.dlpack
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from plusequals.auditing import audit

# How the view `a` of tensor `t` is taken (the tensor is detached: `numpy()` and `__dlpack__`
# refuse a tensor that requires grad).
EXPORTS = {
    "Tensor.numpy": "a = {t}.detach().numpy()",
    "np.asarray": "a = np.asarray({t}.detach())",
    "torch.from_dlpack": "a = torch.from_dlpack({t}.detach())",
    "np.from_dlpack": "a = np.from_dlpack({t}.detach())",
    "to_dlpack": "a = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack({t}.detach()))",
    "helper": "a = export({t})",  # exported in a function that returns the array
    "torch.from_numpy": "a = torch.from_numpy({t}.detach().numpy())",  # a tensor of its own storage
}
# How it is written through `a` (a NumPy array or, from torch.from_dlpack, a tensor that is not
# the tensor object, nor its storage), and reads that change nothing.
WRITES = {
    "slice": "a[...] = 0",
    "augmented": "a *= 2",
    "element": "a[0] += 1",
    "row": "a[1] = a[0]",
}
READS = {"sum": "r = float(a.sum())", "element": "r = float(a[0, 0] * 1)", "none": "r = 0.0"}

_counter = itertools.count()
HELPER = "def export(t):\n    return t.detach().numpy()\n"
INNER = (
    "class Inner(nn.Module):\n"
    "    def forward(self, t):\n"
    "        {export}\n"
    "        {write}  # write\n"
    "        return t * 1.0\n"
)


def _compile(source: str) -> tuple:
    filename = f"<exports-{next(_counter)}>"
    namespace = {"torch": torch, "nn": nn, "np": np}
    exec(compile(source, filename, "exec"), namespace)
    lines = {s.rsplit("# ", 1)[1]: f"{filename}:{i}" for i, s in enumerate(source.splitlines(), start=1) if "# " in s}
    return namespace, lines


def program(export: str, write: str, holder: str, saved: str, module: bool, read_after: bool) -> str:
    """The source of a model ``M`` (or function ``f(x, w)``) that exports a tensor and writes
    through the view: ``holder`` says which tensor (the call's argument ``x``, a fresh one, or a
    temporary of the caller's that an inner module is given and the caller reads afterwards or
    not); ``saved`` whether ``t * w`` saves it before the write, after it, or never."""
    body = ["t = x" if holder == "argument" else "t = x.detach() * 2.0 + 1.0"]
    body.append("s = t * w" if saved == "before" else "s = x * 1.0")
    if holder == "inner":
        body.append("y = inner(t)")
        body.append("r = t.sum()  # read" if read_after else "r = y.sum()")
    else:
        body.append(EXPORTS[export].format(t="t"))
        body.append(f"{write}  # write")
        body.append("r = 0.0")
    if saved == "after":
        body.append("s = t * w  # after")
    body.append("return s.sum() + r" + (" + t.sum()" if holder != "inner" else ""))
    inner = INNER.format(export=EXPORTS[export].format(t="t"), write=write) if holder == "inner" else ""
    if module:
        return (
            f"{HELPER}{inner}class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 3))\n"
            + ("        self.inner = Inner()\n" if holder == "inner" else "")
            + "    def forward(self, x):\n        w = self.w\n"
            + ("        inner = self.inner\n" if holder == "inner" else "")
            + "".join(f"        {b}\n" for b in body)
        )
    return f"{HELPER}def f(x, w):\n" + "".join(f"    {b}\n" for b in body)


def _inputs(grad: bool) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, generator=g).requires_grad_(grad)
    w = torch.linspace(-1.0, 1.0, 3).requires_grad_(grad)
    return x, w


def _run(namespace: dict, module: bool, grad: bool, audited: bool) -> tuple:
    """The program run plainly or audited, from the same inputs: the output, the gradients, the
    input afterwards, and the report."""
    torch.manual_seed(0)
    outs: list = []
    if module:
        model = namespace["M"]()
        model.register_forward_hook(lambda m, i, out: outs.append(out.detach().clone()))
    else:

        def model(x, w):
            out = namespace["f"](x, w)
            outs.append(out.detach().clone())
            return out

    x, w = _inputs(grad)
    args = (x,) if module else (x, w)
    params = list(model.parameters()) if module else [w]
    with torch.enable_grad() if grad else torch.no_grad():
        if audited:
            report = audit(model, *args, backward=grad)
        else:
            report, out = None, model(*args)
            if grad:
                out.sum().backward()
    grads = [None if p.grad is None else p.grad.clone() for p in [x, *params]]
    return outs[0], grads, x.detach().clone(), report


def _bitwise(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# The generated programs (``program``): what is exported, how it is written, which tensor, when
# autograd saves it.
PROGRAMS = dict(
    export=st.sampled_from(sorted(EXPORTS)),
    write=st.sampled_from(sorted(WRITES)),
    holder=st.sampled_from(["argument", "fresh", "inner"]),
    saved=st.sampled_from(["before", "after", "never"]),
)


@settings(max_examples=examples(80), deadline=None)
@given(**PROGRAMS, module=st.booleans(), grad=st.booleans(), read_after=st.booleans())
def test_a_write_through_an_exported_view_is_judged_as_an_aten_write_at_its_line(
    export, write, holder, saved, module, grad, read_after
):
    module = module or holder == "inner"  # a function's module calls are not watched
    source = program(export, WRITES[write], holder, saved, module, read_after)
    namespace, lines = _compile(source)
    plain_out, plain_grads, plain_x, _ = _run(namespace, module, grad, audited=False)
    out, grads, x_after, report = _run(namespace, module, grad, audited=True)
    assert report.error is None and report.backward_error is None, (source, report.error, report.backward_error)
    # the audit changes nothing: the output, the input afterwards and every gradient are the plain run's
    assert _bitwise(out, plain_out) and _bitwise(x_after, plain_x)
    assert all(_bitwise(a, b) for a, b in zip(grads, plain_grads)), source
    want = set()
    if holder == "argument":
        want.add("E0596")  # the audited call's argument, kept by the caller
    if holder == "inner" and (read_after or saved == "after"):
        want.add("E0382")  # the caller reads its temporary after the inner module wrote it
    if grad and saved == "before":
        want.add("E0502")  # silently: autograd never sees the write
    assert set(report.codes) == want, (source, report.findings)
    if holder == "inner" and not read_after and saved != "after":
        assert report.moves, source  # the inner module took its temporary by value: a move
    for f in report.findings:
        assert f.where == lines["write"], (source, f)
        assert "view" in f.op or "capsule" in f.op
        if f.code == "E0382":
            assert f.read_at == lines["read" if read_after else "after"], (source, f)


def _lines_seen(filename: str, run, keeps: bool = True) -> tuple:
    """``run()`` under a Python line tracer (as coverage's or a debugger's), which follows the
    frames of ``filename``: the (function, line) pairs it saw, and what ``run`` returned.
    ``keeps=False``: its local trace function returns None after a line (CPython keeps a frame's
    ``f_trace`` then: only what it returns otherwise replaces it)."""
    seen = set()

    def local(frame, event, arg):
        if event == "line":
            seen.add((frame.f_code.co_name, frame.f_lineno))
            return local if keeps else None
        return local

    def starts(frame, event, arg):
        return local if frame.f_code.co_filename == filename else None

    previous = sys.gettrace()
    sys.settrace(starts)
    try:
        out = run()
    finally:
        sys.settrace(previous)
    return seen, out


@settings(max_examples=examples(40), deadline=None)
@given(**PROGRAMS, grad=st.booleans(), read_after=st.booleans(), keeps=st.booleans())
def test_a_line_tracer_sees_every_line_under_the_audit_and_the_findings_stay(
    export, write, holder, saved, grad, read_after, keeps
):
    """A line tracer already following the program (coverage under ``pytest --cov``, a debugger)
    sees the same lines audited as plain, though the audit traces the same frames (a moved name's
    frame, an exported view's lines; 3.11: their ``f_trace``); the audit's findings are those it
    finds without the tracer. The audit gave a moved name's frame back untraced, and its two
    tracers once each took the other for the frame's earlier one (a RecursionError)."""
    source = program(export, WRITES[write], holder, saved, True, read_after)
    namespace, lines = _compile(source)
    filename = lines["write"].rsplit(":", 1)[0]
    plain_lines, _ = _lines_seen(filename, lambda: _run(namespace, True, grad, audited=False), keeps)
    audited_lines, (out, _, _, report) = _lines_seen(filename, lambda: _run(namespace, True, grad, audited=True), keeps)
    *_, alone = _run(namespace, True, grad, audited=True)
    assert report.error is None and report.backward_error is None, (source, report.error)
    assert audited_lines == plain_lines, (source, sorted(plain_lines - audited_lines))
    assert [(f.code, f.where) for f in report.findings] == [(f.code, f.where) for f in alone.findings], source


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(sorted(EXPORTS)), st.sampled_from(sorted(READS)), st.booleans(), st.booleans())
def test_reading_through_a_view_or_writing_a_fresh_tensors_view_is_clean(export, read, module, grad):
    """Correct programs: a read through the view of the call's argument or of a saved tensor, and
    a write into the view of a fresh tensor that nothing saved, give no finding."""
    body = [
        "s = x * w",
        EXPORTS[export].format(t="x"),
        READS[read],
        "t = torch.zeros_like(x)",
        EXPORTS[export].format(t="t").replace("a = ", "b = "),
        "b[...] = 1",
        "return s.sum() + r + t.sum()",
    ]
    if module:
        source = HELPER + (
            "class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 3))\n"
            "    def forward(self, x):\n        w = self.w\n" + "".join(f"        {b}\n" for b in body)
        )
    else:
        source = HELPER + "def f(x, w):\n" + "".join(f"    {b}\n" for b in body)
    namespace, _ = _compile(source)
    plain_out, plain_grads, _, _ = _run(namespace, module, grad, audited=False)
    out, grads, _, report = _run(namespace, module, grad, audited=True)
    assert report.error is None and report.backward_error is None
    assert report.findings == [], (source, report.findings)
    assert _bitwise(out, plain_out) and all(_bitwise(a, b) for a, b in zip(grads, plain_grads))


class Relu(nn.Module):
    """A module that "clamps" a ReLU's output through NumPy after autograd saved it: the
    gradient computed from the clamped values is wrong, and PyTorch never says so."""

    def __init__(self, through_numpy: bool) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.lin, self.through_numpy = nn.Linear(4, 4), through_numpy

    def forward(self, x):
        h = torch.relu(self.lin(x))
        if self.through_numpy:
            np.minimum(h.detach().numpy(), 0.5, out=h.detach().numpy())  # the write
        else:
            h = h.clamp(max=0.5)
        return h * 2.0


def test_a_saved_tensor_written_through_numpy_is_E0502_though_backward_never_refuses_it():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the clamp changes something (the weights are seeded, not the suite's RNG)
        assert (torch.relu(Relu(True).lin(x)) > 0.5).any()
    report = audit(Relu(True), x, backward=True)
    assert report.backward_error is None  # PyTorch's backward runs, with the clamped values
    (f,) = report.findings
    line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if s.endswith("# the write"))
    assert f.code == "E0502" and f.where.endswith(f":{line}") and f.op == "Tensor.numpy() view"
    assert "no version counter moved" in f.message and "ReluBackward0" in f.message
    assert audit(Relu(False), x, backward=True).clean


def test_the_wrappers_are_the_originals_again_after_the_audit_and_other_threads_pass_through():
    import threading

    before = {n: getattr(torch.Tensor, n) for n in ("numpy", "__array__", "__dlpack__")}
    before_dl = (torch.to_dlpack, torch.utils.dlpack.to_dlpack)
    seen = []

    class Threaded(nn.Module):
        def forward(self, x):
            t = threading.Thread(target=lambda: seen.append(x.numpy().__imul__(2)))
            t.start()
            t.join()
            return x + 1

    x = torch.ones(3)
    assert audit(Threaded(), x).clean and len(seen) == 1  # another thread's export is not watched
    assert x.tolist() == [2.0, 2.0, 2.0]
    assert {n: getattr(torch.Tensor, n) for n in before} == before
    assert "numpy" not in vars(torch.Tensor)  # inherited from TensorBase again
    assert (torch.to_dlpack, torch.utils.dlpack.to_dlpack) == before_dl


def test_an_array_exported_before_the_audited_call_is_not_watched():
    """The limit: only exports made while the forward runs are watched. An array taken before the
    call (a module that keeps ``x.numpy()`` of a buffer from its ``__init__``) writes unseen."""

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(3))
            self.view = self.scale.numpy()  # taken once, outside any audited call

        def forward(self, x):
            self.view *= 2.0  # writes the buffer; no op, no export during the call
            return x * self.scale

    class Given(nn.Module):
        def forward(self, x, a):
            a *= 2.0  # a is x's NumPy view, made by the caller before the call
            return x + 1

    assert audit(Cached(), torch.ones(3)).clean
    x = torch.ones(3)
    assert audit(Given(), x, x.numpy()).clean  # the caller's x changed: E0596 in Rust, unseen here
    assert x.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("traced", [False, True])
def test_under_another_trace_function_the_write_is_still_caught(traced):
    """A trace function already installed (a debugger, coverage) keeps its place: the write is
    still caught; the line is the exporting frame's last line seen."""
    import sys

    class W(nn.Module):
        def forward(self, x):
            a = x.numpy()
            a *= 2  # write
            return x + 1

    lines = []

    def tracer(frame, event, arg):
        if frame.f_code is W.forward.__code__ and event == "line":
            lines.append(frame.f_lineno)
        return tracer  # traces every frame's lines itself

    previous = sys.gettrace()
    if traced:
        sys.settrace(tracer)
    try:
        report = audit(W(), torch.ones(3))
    finally:
        sys.settrace(previous)
    (f,) = report.findings
    assert f.code == "E0596"
    line = W.forward.__code__.co_firstlineno + 2
    assert f.where.endswith(f":{line}")
    assert sys.gettrace() is previous
    if traced:  # the trace function already there saw every line of the frame, the audit's too
        assert lines == [line - 1, line, line + 1]


def test_a_write_in_a_function_given_the_array_is_reported_at_the_call():
    """The line is the exporting frame's: a callee that writes through the array it was given is
    found at the line that called it."""

    def scale(a):
        a *= 2.0

    class Caller(nn.Module):
        def forward(self, x):
            scale(x.numpy())  # the call
            return x + 1

    (f,) = audit(Caller(), torch.ones(3)).findings
    line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if s.endswith("# the call"))
    assert f.code == "E0596" and f.where.endswith(f":{line}")


def test_a_numpy_export_is_dropped_once_its_array_and_views_are_gone():
    """What the watch costs while no export lives: nothing but a test of an empty list. A NumPy
    export lives while its array or a view of it does; a DLPack export to the forward's end."""
    import gc

    from plusequals.auditing.exports import Exports

    written = []
    exports = Exports(lambda e, where: written.append(where), None)
    exports.install()
    try:
        t = torch.zeros(4)
        a = t.numpy()
        view = a[1:]
        capsule = torch.utils.dlpack.to_dlpack(t)
        assert len(exports.live) == 2
        del a
        gc.collect()
        exports.check()
        assert len(exports.live) == 2  # the view keeps the array
        view[0] = 1.0
        del view
        gc.collect()
        exports.check()
        assert len(written) == 2 and len(exports.live) == 1  # both saw the write; the DLPack one stays
        del capsule
    finally:
        exports.uninstall()
        exports.finish()
    assert exports.live == []


def test_what_the_watch_does_not_see():
    """The limit, shown: an export in the Python code that backward runs (a custom Function's
    backward) is not watched. An export through a name bound to torch's function before the audit
    (``from torch.utils.dlpack import to_dlpack``) is not watched either, but an aten write through
    the tensor made from it is compared by address with the call's arguments: the caller's ``x``,
    ``E0596`` at the write."""
    from torch.utils.dlpack import from_dlpack, to_dlpack

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            (w,) = ctx.saved_tensors
            w.detach().numpy()[...] = 0.0  # writes the parameter during backward
            return g * w, None

    class Early(nn.Module):
        def forward(self, x):
            y = from_dlpack(to_dlpack(x))
            y.mul_(2.0)  # writes the caller's x, through a capsule the watch never saw: early
            return x + 1

    w = torch.ones(3)
    report = audit(lambda x: Scale.apply(x, w), torch.ones(3, requires_grad=True), backward=True)
    assert report.findings == [] and w.tolist() == [0.0, 0.0, 0.0]
    x = torch.ones(3)
    found = audit(Early(), x).findings
    assert x.tolist() == [2.0, 2.0, 2.0] and [f.code for f in found] == ["E0596"]
    line = next(
        i for i, s in enumerate(inspect.getsource(test_what_the_watch_does_not_see).splitlines()) if "early" in s
    )
    assert found[0].where.endswith(f":{test_what_the_watch_does_not_see.__code__.co_firstlineno + line}")


def test_audit_run_and_the_plugin_scope_see_the_same_write():
    """An outermost call audited by the scope (``audit run``, the pytest plugin) watches exports
    as ``audit()`` does, and the program's result is its own."""
    from plusequals.auditing.scope import AuditScope

    class Clamp(nn.Module):
        def forward(self, h):
            a = np.asarray(h.detach())
            np.minimum(a, 0.5, out=a)  # scope write
            return h * 2

    x = torch.linspace(0.0, 1.0, 4)
    with AuditScope() as scope:
        out = Clamp()(x)
    (call,) = scope.calls
    (f,) = call.report.findings
    line = next(i for i, s in enumerate(open(__file__).read().splitlines(), 1) if s.endswith("# scope write"))
    assert f.code == "E0596" and f.where.endswith(f":{line}") and f.op == "Tensor.__array__() view"
    assert torch.equal(out, torch.linspace(0.0, 1.0, 4).clamp(max=0.5) * 2)
    assert "numpy" not in vars(torch.Tensor)


def test_an_aten_write_into_exported_memory_is_the_aten_write_only():
    """A tensor read through NumPy and then written by an aten op, through itself or through
    ``.data`` (which bumps no version of its own), is judged once, as that op."""

    class ReadThenWrite(nn.Module):
        def __init__(self, through_data: bool) -> None:
            super().__init__()
            self.through_data = through_data

        def forward(self, x):
            a = np.asarray(x)  # kept: the export lives on
            (x.data if self.through_data else x).add_(float(a.max()))  # aten write
            return x * float(a.min())

    for through_data in (False, True):
        (f,) = audit(ReadThenWrite(through_data), torch.ones(3)).findings
        assert f.code == "E0596" and f.op == "aten.add_.Tensor", f


def test_numpy_sees_torch_s_own_array_protocol_warnings_included():
    """``np.asarray``, ``np.array(copy=True)`` and a ``dtype`` reach torch's ``__array__`` with
    the arguments NumPy gave: its warnings and results are the plain run's."""
    import warnings

    class Reads(nn.Module):
        def forward(self, x):
            arrays = [np.asarray(x), np.array(x, copy=True), np.array(x, dtype=np.float64), np.asarray(x, np.float32)]
            return x + float(sum(a.sum() for a in arrays))

    def run(audited: bool) -> list:
        x = torch.linspace(0.0, 1.0, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if audited:
                report = audit(Reads(), x)
                assert report.clean and report.error is None, (report.findings, report.error)
            else:
                Reads()(x)
        return [(w.category, str(w.message)) for w in caught]

    assert run(audited=True) == run(audited=False)
