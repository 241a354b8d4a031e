"""Writes outside ATen: a parameter's ``.data`` swapped out and back inside a forward (a mask, a
quantised copy). ``.data =`` is no op and bumps no version, so PyTorch never notices that an op
which saved the parameter itself for backward will compute with the data swapped back, not the
data the forward used: the gradient is silently wrong. The audit gives ``E0502`` at the swap
back (autograd borrowed the parameter until backward); the same swap under ``no_grad``, one that
is never undone, or an op that saved only a view taken while swapped is clean.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from plusequals.auditing import audit
from plusequals.auditing.frames import short_path

# Ops that save the parameter itself (autograd unpacks the same tensor in backward), and one that
# saves only what it computed from it.
SAVES_PARAMETER = {
    "x * w": lambda x, w: x * w,
    "w * x": lambda x, w: w * x,
    "torch.div(x, w)": lambda x, w: torch.div(x, w + 3.0) * w,
    "torch.addcmul": lambda x, w: torch.addcmul(x, x, w),
}


class Swapped(nn.Module):
    def __init__(self, op: str, swap_back: bool) -> None:
        super().__init__()
        self.op, self.swap_back = SAVES_PARAMETER[op], swap_back
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.register_buffer("mask", (torch.arange(4) % 2).float())

    def forward(self, x):
        orig = self.weight.data
        self.weight.data = orig * self.mask  # swap out
        out = self.op(x, self.weight)
        if self.swap_back:
            self.weight.data = orig  # swap back
        return out


class Fixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 4))
        self.register_buffer("mask", (torch.arange(4) % 2).float())

    def forward(self, x):
        return x * (self.weight * self.mask)


class SwappedLinear(nn.Module):
    """F.linear saves ``weight.t()``, a view taken while swapped: backward uses what forward did."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        orig = self.lin.weight.data
        self.lin.weight.data = orig * 0.5
        out = nn.functional.linear(x, self.lin.weight, self.lin.bias)
        self.lin.weight.data = orig
        return out


def line_in(cls, text: str) -> str:
    src, start = inspect.getsourcelines(cls)
    return f"{short_path(inspect.getsourcefile(cls))}:{start + next(i for i, s in enumerate(src) if text in s)}"


def _x() -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).requires_grad_(True)


def wrong_gradient(model: nn.Module) -> bool:
    """The oracle, without the audit: does x's gradient differ from the one of the data the
    forward used (the masked weight, kept fixed)?"""
    x = _x()
    model(x).sum().backward()
    y = _x()
    used = (model.weight.detach() * model.mask).requires_grad_(False)
    model.op(y, used).sum().backward()
    return not torch.allclose(x.grad, y.grad)


@settings(max_examples=examples(30), deadline=None)
@given(st.sampled_from(sorted(SAVES_PARAMETER)), st.booleans(), st.booleans())
def test_a_parameter_swapped_back_after_autograd_saved_it_is_E0502_at_the_swap(op, swap_back, grad):
    model = Swapped(op, swap_back)
    refuses = wrong_gradient(Swapped(op, swap_back))
    with torch.set_grad_enabled(grad):
        report = audit(model, _x(), backward=grad)
    assert report.error is None and report.backward_error is None
    assert refuses == swap_back  # swapped back, the gradient is silently wrong (never swapped back: right)
    if swap_back and grad:
        (f,) = report.findings
        assert f.code == "E0502" and f.where == line_in(Swapped, "# swap back"), f
        assert "the parameter `weight`" in f.message and f.op == ".data ="
    else:
        assert report.clean, report.findings  # under no_grad nothing is saved: no backward to mislead


@pytest.mark.parametrize("model", [Fixed, SwappedLinear])
def test_the_fixed_twin_and_a_view_saved_while_swapped_are_clean(model):
    report = audit(model(), _x(), backward=True)
    assert report.error is None and report.clean, report.findings
