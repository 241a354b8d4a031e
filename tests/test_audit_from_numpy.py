"""Writes into an argument's memory through a tensor of another storage: ``torch.from_numpy``
(``torch.as_tensor``, ``torch.frombuffer``) of the NumPy array the argument was made from. The
new tensor shares the argument's bytes but not its storage, so the write is an aten op on memory
the audit knows by another name: it is compared by address, and judged as a write into the
argument itself (``E0596`` for the audited call's argument, at the line). A numpy-backed
argument written directly is the argument's own storage. What stays unseen, pinned here: a write
through the NumPy array itself (no op, and no export during the call to compare).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from plusequals.auditing import audit

ALIASES = {
    "torch.from_numpy": lambda a: torch.from_numpy(a),
    "torch.as_tensor": lambda a: torch.as_tensor(a),
    "torch.frombuffer": lambda a: torch.frombuffer(a, dtype=torch.float32),
}


def _line(fn, marker: str) -> str:
    import inspect

    from plusequals.auditing.frames import short_path

    lines, start = inspect.getsourcelines(fn)
    return f"{short_path(inspect.getsourcefile(fn))}:{start + next(i for i, s in enumerate(lines) if marker in s)}"


def _given(alias: str, module: bool):
    make = ALIASES[alias]

    def f(x, a):
        t = make(a)
        t.mul_(2.0)  # write
        return x + 1.0

    class M(nn.Module):
        def forward(self, x, a):
            t = make(a)
            t.mul_(2.0)  # write
            return x + 1.0

    return (M(), M.forward) if module else (f, f)


@pytest.mark.parametrize("module", [False, True], ids=["function", "module"])
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_a_write_through_from_numpy_of_the_arguments_array_is_E0596_at_its_line(alias, module):
    after = []
    for audited in (False, True):
        a = np.linspace(-1.0, 1.0, 4, dtype=np.float32)
        x = torch.from_numpy(a)  # the caller's tensor, made from its array
        model, fn = _given(alias, module)
        if audited:
            report = audit(model, x, a)
            assert [(f.code, f.where) for f in report.findings] == [("E0596", _line(fn, "# write"))], report.findings
            assert "audited call's argument `x`" in report.findings[0].message
        else:
            model(x, a)
        after.append(x.clone())
    assert torch.equal(after[0], after[1])  # the audited run wrote what the plain run wrote


def test_a_numpy_backed_argument_written_directly_and_a_fresh_array_are_judged_as_any_tensor():
    def writes(x):
        x.add_(1.0)  # write
        return x * 2.0

    def fresh(x):
        t = torch.from_numpy(np.zeros(4, dtype=np.float32))
        t.add_(1.0)  # a tensor of its own memory: nobody else's
        return x + t

    x = torch.from_numpy(np.zeros(4, dtype=np.float32))
    assert [(f.code, f.where) for f in audit(writes, x).findings] == [("E0596", _line(writes, "# write"))]
    assert audit(fresh, torch.from_numpy(np.zeros(4, dtype=np.float32))).clean


def test_a_write_through_the_callers_array_itself_is_not_seen():
    """The limit: the caller made ``x`` from ``a`` and passes both; writing through ``a`` is no op
    and no export made during the call, so nothing compares its bytes (in Rust, ``E0596``)."""

    def f(x, a):
        a *= 2.0  # the caller's x changes: unseen
        return x + 1.0

    a = np.ones(4, dtype=np.float32)
    x = torch.from_numpy(a)
    assert audit(f, x, a).clean and x.tolist() == [2.0] * 4
