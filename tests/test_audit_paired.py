"""The sweep's comparison of an audited run with a plain one (``plusequals/cases/paired.py``) can
fail: a model that branches on what the audit changes (the dispatch-mode stack, the one thing of
it a model can see) gives differences that name the phase and the tensor or op, and a model that
does not gives none.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from plusequals.cases.paired import differences, paired


def _audited() -> bool:
    """True under the audit, whose write watch is a dispatch mode (the counter is the other)."""
    return torch._C._len_torch_dispatch_stack() > 1


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.norm(self.lin(x)))


class Sees(Plain):
    """Computes otherwise under the audit: ``what`` is the output, a buffer, an input, or only
    the ops (the same bits by another op)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, x):
        out = super().forward(x)
        if not _audited():
            return out
        if self.what == "output":
            return out + 1e-3
        if self.what == "buffer":
            self.norm.running_mean.add_(1.0)
        if self.what == "input":
            with torch.no_grad():
                x.mul_(2.0)
        return out * 1.0  # the same bits, one more op


def _build(cls, *args):
    return lambda: (cls(*args), (torch.randn(3, 4),), {})


def test_a_model_that_does_not_see_the_audit_runs_the_same():
    pair = paired(_build(Plain))
    assert pair.differences == [] and pair.train.clean and pair.eval.clean
    assert pair.ops["train"]["aten.addmm.default"] == 1 and pair.ops["eval"]["aten.addmm.default"] == 1


def test_each_difference_is_named_with_its_phase():
    out = paired(_build(Sees, "output")).differences
    assert "train: output 0" in out and "eval: output 0" in out
    assert not any("gradient" in d for d in out)  # an offset of the output changes no gradient
    buffer = paired(_build(Sees, "buffer")).differences
    assert "train: buffer norm.running_mean" in buffer and "eval: buffer norm.running_mean" in buffer
    assert "train: output 0" not in buffer
    assert "train: input 0" in paired(_build(Sees, "input")).differences
    (ops,) = {d for d in paired(_build(Sees, "ops")).differences if d.startswith("train")}
    assert ops == "train: op counts of aten.mul.Tensor"


@settings(max_examples=examples(60), deadline=None)
@given(
    dtype=st.sampled_from(
        [
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.float64,
            torch.int8,
            torch.bool,
            torch.complex64,
            torch.complex128,
        ]
    ),
    n=st.integers(1, 9),
    data=st.data(),
)
def test_tensors_are_the_same_only_when_every_bit_is(dtype, n, data):
    """The comparison reads whole elements as integers of their width: one flipped bit anywhere
    (a NaN's payload, a zero's sign, a complex number's imaginary part) is a difference."""
    t = torch.zeros(n, dtype=dtype)
    raw = t.view(torch.uint8)
    byte, bit = data.draw(st.integers(0, raw.numel() - 1)), data.draw(st.integers(0, 7))
    other = t.clone()
    other.view(torch.uint8)[byte] ^= 1 << bit

    def same(a, b):
        return differences([("t", a)], [("t", b)]) == []

    assert same(t, t.clone()) and not same(t, other)
    assert not same(t, torch.zeros(n, dtype=torch.uint8)) and not same(t, t[:0])  # another dtype or shape
