"""``plusequals.audit``: rustc's verdicts on PyTorch code, at run time, with the line that broke
the rule.

``audit(model, *args, backward=False, **kwargs)`` runs ``model(*args, **kwargs)`` once, in the
caller's grad mode (and with ``backward=True`` a backward from the sum of its outputs), and
returns an :class:`AuditReport` whose ``findings`` carry rustc's error codes:

* ``E0596``: a module wrote into the memory of a tensor it was given (in-place methods, ``out=``,
  slice assignment, ``F.*(inplace=True)``, ``copy_``, through a view) that outlives the call in
  someone else's hands: a parameter, a buffer, a module's tensor attribute, an input of a running
  ``torch.autograd.Function`` (a checkpoint keeps it to recompute), or an argument of the audited
  call itself (the user's tensor, whose later reads the audit cannot see). The module only
  borrowed it.
* ``E0382``: after such a write, a name that held that memory before it was read: the value
  moved into the module, and the caller used it after the move (the UNet skip).
* ``E0502``: a write into a tensor that autograd saved for backward, found at the write.
* ``E0499``: a write through one name into a tensor object that another live name (or container
  slot) in the writing frame or its callers still holds, when that other name is read after the
  write (two mutable names for one tensor; a view is a reborrow, not a second name).

A write into a temporary that nothing else holds and that no name reads afterwards (``out =
self.relu(out)`` with ``nn.ReLU(inplace=True)``) is a move, which Rust accepts: it is listed in
``report.moves`` (code ``"move"``), never in ``findings``.

It watches with forward hooks on each module (:mod:`.modules`), a TorchDispatchMode for the
writes (:mod:`.mode`), a TorchFunctionMode for what autograd saves (:mod:`.saved`) and, once a
value has moved, an opcode tracer on the frames that hold it (:mod:`.frames`). It imports
nothing else of plusequals; :mod:`.cases` holds the project's harnesses.
"""

from __future__ import annotations

import sys
import types
from typing import Any, List, Optional

import torch
from torch import Tensor, nn
from torch.autograd.graph import _engine_run_backward

from .memory import tensors
from .mode import Recorder, WriteWatch
from .modules import ModuleWatch
from .report import CODES, AuditReport, Finding
from .saved import SavedTensors

__all__ = ["CODES", "AuditReport", "Finding", "audit"]


class _CallableModule(types.ModuleType):
    """``plusequals.audit(model, ...)`` is :func:`audit`, and ``plusequals.audit.cases`` still the
    harnesses: the package is a module that can be called."""

    def __call__(self, model: Any, *args: Any, backward: bool = False, **kwargs: Any) -> AuditReport:
        return audit(model, *args, backward=backward, **kwargs)


def audit(model: Any, *args: Any, backward: bool = False, **kwargs: Any) -> AuditReport:
    """Runs ``model(*args, **kwargs)`` once under watch; see the module's docstring."""
    modules = ModuleWatch(stop=sys._getframe())
    if isinstance(model, nn.Module):
        modules.attach(model)
    else:
        modules.push_root(model, args, kwargs)
    recorder = Recorder()
    saved = SavedTensors(modules.current)
    watch = WriteWatch(modules, saved, recorder)
    report = AuditReport(modules=modules.watched)
    try:
        with saved, watch:
            out = _run(report, "error", lambda: model(*args, **kwargs))
            roots = [t.grad_fn for t in _differentiable(out)]
            watch.confirm(roots)
            if backward and report.error is None and not roots:
                report.backward_skipped = "no output requires grad: nothing to differentiate"
            elif backward and report.error is None:
                watch.phase = "backward"
                _run(report, "backward_error", lambda: _backward(out))
                watch.confirm(None)
    finally:
        watch.tracer.stop()
        modules.detach()
    report.findings, report.moves = recorder.findings(), recorder.moves()
    report.ops, report.calls = watch.ops, modules.calls
    return report


def _run(report: AuditReport, slot: str, fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # the model's own error: recorded, findings before it kept
        lines = str(e).strip().splitlines()
        setattr(report, slot, f"{type(e).__name__}: {lines[0] if lines else ''}")
        return None


def _differentiable(out: Any) -> List[Tensor]:
    return [t for t in tensors(out) if t.requires_grad and t.grad_fn is not None]


def _backward(out: Any) -> None:
    outs = _differentiable(out)
    if not outs:
        raise ValueError("nothing to differentiate: no output requires grad")
    loss: Optional[Tensor] = None
    for t in outs:
        loss = t.sum() if loss is None else loss + t.sum()
    # the engine itself: torch.autograd.backward would be handed to the TorchFunctionMode, which
    # runs it with the mode off, and the mode would miss what backward recomputes (checkpoints)
    assert loss is not None
    _engine_run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


sys.modules[__name__].__class__ = _CallableModule
