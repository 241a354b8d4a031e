"""``plusequals.audit``'s move/borrow rule: a write into a tensor a module was given is
``E0596`` only when the memory outlives the call in someone else's hands, ``E0382`` when a name
that held it is read afterwards, and a move (``report.moves``, never a finding) otherwise. Also:
the finding names torch's module that wrote; a twin audited directly is one module; the audit
keeps nothing alive; ``backward_error`` is only the model's.
"""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from plusequals.auditing import audit
from plusequals.auditing.frames import short_path


def line_in(obj, text: str) -> str:
    src, start = inspect.getsourcelines(obj)
    return f"{short_path(inspect.getsourcefile(obj))}:{start + next(i for i, s in enumerate(src) if text in s)}"


# Who holds the memory the child writes, and the code rustc would give.
HOLDERS = {
    "a parameter": "E0596",
    "a buffer": "E0596",
    "a plain tensor attribute": "E0596",
    "the audited call's argument": "E0596",
    "a temporary read afterwards": "E0382",
    "a temporary nobody reads again": "move",
    "a temporary rebound to the result": "move",
}
CHILDREN = {
    "nn.ReLU(inplace=True)": (lambda: nn.ReLU(inplace=True), "aten.relu_.default"),
    "nn.Hardtanh(inplace=True)": (lambda: nn.Hardtanh(inplace=True), "aten.hardtanh_.default"),
    "nn.Dropout(p=0.0, inplace=True)": (lambda: nn.Dropout(0.0, inplace=True), None),  # p=0: no write
    "a user module's add_": (lambda: AddOne(), "aten.add_.Tensor"),
}


class AddOne(nn.Module):
    def forward(self, t):
        return t.add_(1.0)


class Holder(nn.Module):
    def __init__(self, child: nn.Module, holder: str) -> None:
        super().__init__()
        self.child, self.holder = child, holder
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("buf", torch.randn(3, 4))
        self.cache = torch.randn(3, 4)

    def forward(self, x):
        given = {"a parameter": self.weight, "a buffer": self.buf, "a plain tensor attribute": self.cache}
        if self.holder in given:
            self.child(given[self.holder])
            return x * 1
        if self.holder == "the audited call's argument":
            return self.child(x)
        h = x * 2
        if self.holder == "a temporary read afterwards":
            y = self.child(h)
            return y + h
        if self.holder == "a temporary rebound to the result":
            h = self.child(h)
            return h * 1
        return self.child(h)


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from(sorted(HOLDERS)), st.sampled_from(sorted(CHILDREN)))
def test_the_code_follows_who_else_holds_the_memory(holder, child):
    make, op = CHILDREN[child]
    model = Holder(make(), holder)
    with torch.no_grad():
        report = audit(model, torch.randn(3, 4))
    want = HOLDERS[holder] if op is not None else None
    codes = report.codes
    if want is None:
        assert report.clean and not report.moves, report.findings
    elif want == "move":
        assert report.clean and [m.op for m in report.moves] == [op], (report.findings, report.moves)
        assert report.moves[0].code == "move" and report.moves[0].module == "child"
    else:
        assert codes == [want], report.findings
        assert report.findings[0].op == op and not report.moves
    if want is not None and child.startswith("nn."):
        assert all(f.writer == child for f in report.findings + report.moves)
        if want != "E0382":
            assert "?" not in report.summary()


def test_torch_module_in_an_audited_sequential_is_named_and_the_audit_line_is_never_the_where():
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    audit_line = f"{short_path(__file__)}:{inspect.currentframe().f_lineno + 1}"
    report = audit(model, x)
    (f,) = report.findings
    assert (f.code, f.module, f.writer) == ("E0596", "0", "nn.ReLU(inplace=True)")
    assert f.where != audit_line and "torch/nn/" in f.where, f.where  # no user frame: torch's own line
    assert "nn.ReLU(inplace=True)" in f.message


def test_a_view_of_a_temporary_written_then_the_temporary_read_is_a_reborrow_not_a_finding():
    class Reborrow(nn.Module):
        def forward(self, x):
            t = x * 2
            h = t.view(-1)
            h.add_(1.0)
            return t.sum()

    assert audit(Reborrow(), torch.randn(3, 4)).clean


# ---------------------------------------------------------------------- the smaller problems
def test_a_rust_block_audited_directly_is_watched_as_one_module():
    from plusequals import RustBlock
    from plusequals.model.bugs import small_block

    rust = RustBlock.from_torch(small_block())
    x, c = torch.randn(2, 16, 32), torch.randn(2, 7, 24)
    expected = rust(x, c)
    report = audit(rust, x, c)
    assert report.error is None and report.clean, (report.error, report.findings)
    assert report.modules == 1 and report.calls == 1
    assert torch.equal(rust(x, c), expected)
    for m in rust.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def audited_and_dropped():
    """Audits a plain callable (closing over a tensor) and a module; returns weak references to
    all of them and the reports, the objects themselves dropped."""
    captured = torch.randn(3)

    def fn(x):
        x.add_(captured)  # an E0596: findings keep strings, not tensors or frames
        return x * 2

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            keep = x * 1
            self.act(keep)
            return keep.sum()

    model, x = Model(), torch.randn(3, requires_grad=True)
    refs = [weakref.ref(o) for o in (fn, captured, model, x)]
    return refs, [audit(fn, torch.randn(3)), audit(model, x, backward=True)]


def test_nothing_the_audit_saw_stays_alive_after_it_returns():
    from plusequals.auditing import modules

    assert not hasattr(modules, "_PARAMS")  # no module-wide cache of audited callables
    refs, reports = audited_and_dropped()
    assert reports[0].codes == ["E0596"] and reports[1].codes == ["E0382"]
    gc.collect()
    assert [r() for r in refs] == [None] * 4


class BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise ValueError("the model's own backward")


def test_backward_error_is_only_what_the_models_backward_raised():
    model = nn.Linear(3, 3).requires_grad_(False)
    report = audit(model, torch.randn(2, 3), backward=True)
    assert report.backward_error is None and report.clean
    assert "no output requires grad" in (report.backward_skipped or "")
    report = audit(BadBackward.apply, torch.randn(3, requires_grad=True), backward=True)
    assert report.backward_error == "ValueError: the model's own backward" and report.backward_skipped is None


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_the_summary_never_says_clean_when_the_model_raised(where):
    def raises_in_forward(x):
        raise KeyError("boom")

    model = raises_in_forward if where == "forward" else BadBackward.apply
    report = audit(model, torch.randn(3, requires_grad=True), backward=True)
    assert not report.findings and (report.error or report.backward_error)
    assert report.summary().startswith("no findings"), report.summary()
