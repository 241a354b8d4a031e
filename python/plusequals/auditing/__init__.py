"""``plusequals.auditing``, the machinery of :func:`plusequals.audit`: rustc's verdicts on PyTorch
code, at run time, with the line that broke the rule. (The package is not named ``audit``: that
name is the function's, and a package under it would be hidden by it.)

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

:class:`.scope.AuditScope` audits every outermost module call a program makes (``python -m
plusequals audit run``, the pytest plugin :mod:`.plugin`); :mod:`.diagnostics` prints findings as
rustc does, :mod:`.sarif` as JSON and SARIF; ``# plusequals: allow(E0596)`` on the writing line
silences a code there (:mod:`.allow`).

It watches with torch's global module hooks (:mod:`.modules`), a TorchDispatchMode for the
writes and, from the ops' outputs, what autograd saves (:mod:`.mode`, :mod:`.saved`; in
backward only the Python code that backward runs is dispatched to it) and, while a moved value
has a name not read yet, an opcode tracer on the frames that hold it (:mod:`.frames`). It
imports nothing else of plusequals; what the project audits is in :mod:`plusequals.cases`.
"""

from __future__ import annotations

import sys
from typing import Any

from .allow import Allows
from .report import CODES, AuditReport, Finding
from .scope import CallAudit, describe, roots, unscoped

__all__ = ["CODES", "AuditReport", "Finding", "audit"]


def audit(model: Any, *args: Any, backward: bool = False, **kwargs: Any) -> AuditReport:
    """Runs ``model(*args, **kwargs)`` once under watch, in the caller's grad mode (with
    ``backward=True``, then a backward from the sum of its outputs that need grad) and returns
    what broke rustc's rules: :class:`AuditReport` (``findings``, each a :class:`Finding` with
    its code E0596, E0382, E0502 or E0499, module, ``path:line`` and op). The model's own error is
    recorded in ``error`` / ``backward_error``, not raised; findings before it are kept. A
    ``# plusequals: allow(CODE)`` comment on the writing line silences that code there.

    What ``torch.compile`` returned is audited as the code it compiled, run eagerly (the same
    writes, in the same tensors): its compiled graph is left as it was (run under the audit's
    dispatch mode, it would give the program's later calls other bits), and ``report.eager`` says
    so."""
    model, eager = _uncompiled(model)
    unit = CallAudit(model, args, kwargs, stop=sys._getframe())
    report = unit.report
    report.eager = eager
    with unscoped(), unit.watching():
        with unit.forward():
            out = _run(report, lambda: model(*args, **kwargs))
        differentiable = roots(out)
        unit.watch.confirm(differentiable)
        if backward and report.error is None and not differentiable:
            report.backward_skipped = "no output requires grad: nothing to differentiate"
        elif backward and report.error is None:
            unit.backward(out, keep=False)
    allows = Allows()
    allows.watch(unit.files)
    allows.apply(report)
    report.unused_allows = allows.unused()
    return report


def _uncompiled(model: Any) -> Any:
    """``(the code torch.compile compiled, "torch.compile")`` for what it returned (a module or a
    function), else ``(model, None)``."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        return model._orig_mod, "torch.compile"
    original = getattr(model, "_torchdynamo_orig_callable", None)
    if original is not None and not getattr(model, "_torchdynamo_disable", False):
        return original, "torch.compile"
    return model, None


def _run(report: AuditReport, fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # the model's own error: recorded, findings before it kept
        report.error = describe(e)
        return None
