"""The audit of one call (:class:`CallAudit`, what :func:`plusequals.audit` runs) and a scope that
audits every outermost ``nn.Module`` call a program makes while it is open (:class:`AuditScope`,
what ``audit run`` and the pytest plugin use).

The scope replaces ``nn.Module.__call__`` (restored on exit): a call made while no audited call
is running, in the scope's thread, is audited as :func:`plusequals.audit` would audit it; the
calls it makes (its children, nested calls) belong to it. Unlike ``audit()``, the program's own
exception propagates (recorded first) and its output is returned unchanged. ``backward=True``
also runs a backward from the outputs that need grad, keeping the graph and accumulating no
``.grad`` (so the program's own backward runs as it would have).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import _engine_run_backward

from . import sites
from .allow import Allows, source_files
from .children import Children, dump
from .frames import MoveTracer, holders, location, user_frame
from .memory import Span, span, tensors
from .mode import FindingLog, PythonCalls, WriteWatch
from .modules import Arg, ModuleWatch, arguments
from .report import AuditReport, Finding
from .saved import SavedTensors, reachable
from .tracers import COMPILE, Tracers, in_compiled_code, module_call, traced_by_dynamo

__all__ = ["AuditScope", "AuditedCall", "CallAudit", "backward_from", "child", "describe", "roots", "tracer"]


def describe(e: BaseException) -> str:
    """``Type: first line`` of an exception (what a report keeps of the model's error)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _differentiable(out: Any) -> List[Tensor]:
    return [t for t in tensors(out) if t.requires_grad and t.grad_fn is not None]


def roots(out: Any) -> List[Any]:
    """The autograd nodes of ``out``'s tensors that need grad."""
    return [t.grad_fn for t in _differentiable(out)]


def _leaves(nodes: List[Any]) -> List[Tensor]:
    return [v for n in reachable(nodes) if (v := getattr(n, "variable", None)) is not None]


def backward_from(out: Any, keep: bool, leaves: Iterable[Tensor] = ()) -> None:
    """A backward from the sum of ``out``'s tensors that need grad, by autograd's engine (so the
    TorchFunctionMode sees what backward recomputes). ``keep``: keep the graph, and put back the
    ``.grad`` of the graph's leaves and of ``leaves`` (a reentrant checkpoint's parameters are
    not in the graph) as they were, so the program's own backward runs as it would have."""
    outs = _differentiable(out)
    if not outs:
        raise ValueError("nothing to differentiate: no output requires grad")
    loss: Tensor = outs[0].sum()
    for t in outs[1:]:
        loss = loss + t.sum()
    kept = {id(t): t for t in [*_leaves([loss.grad_fn]), *leaves]} if keep else {}
    grads = [(t, None if t.grad is None else t.grad.detach().clone()) for t in kept.values()]
    try:
        _engine_run_backward(
            (loss,), (torch.ones_like(loss),), keep, False, (), allow_unreachable=True, accumulate_grad=True
        )
    finally:
        for t, g in grads:
            t.grad = g


def _lift(
    length: Callable[[], int],
    at: Callable[[int], Any],
    pop: Callable[[], Any],
    push: Callable[[Any], None],
    mine: tuple,
) -> Callable[[], None]:
    """Takes the modes in ``mine`` off a mode stack (the others keep their order); returns what
    puts them back where they were."""
    stack = [at(i) for i in range(length())]
    ours = [i for i, m in enumerate(stack) if any(m is x for x in mine)]
    if not ours:
        return lambda: None
    popped = [pop() for _ in range(len(stack) - ours[0])][::-1]  # bottom first
    kept = [m for m in popped if not any(m is x for x in mine)]
    for m in kept:
        push(m)

    def restore() -> None:
        for _ in kept:
            pop()
        for m in popped:
            push(m)

    return restore


class CallAudit:
    """The watchers of one audited call of ``model``; ``stop`` is the frame that calls it. Inside
    :meth:`watching`, the forward runs in :meth:`forward` (every op dispatched to the write watch)
    and the backward in :meth:`backward` (only the ops of the Python code that backward runs)."""

    def __init__(self, model: Any, args: tuple, kwargs: dict, stop: FrameType) -> None:
        self.modules = ModuleWatch(stop=stop)
        if isinstance(model, nn.Module):
            self.modules.attach(model)
        else:
            self.modules.push_root(model, args, kwargs)
        self.log = FindingLog()
        self.saved = SavedTensors()
        self.watch = WriteWatch(self.modules, self.saved, self.log)
        self.report = AuditReport(modules=self.modules.watched)
        self.files = source_files(model)
        self.python_calls: List[PythonCalls] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[AuditReport]:
        """Fills the report when it ends (raising or not), and leaves nothing behind."""
        try:
            yield self.report
        finally:
            self.watch.tracer.stop()
            self.watch.forget()
            self.modules.detach()
            self.report.findings, self.report.moves = self.log.findings(), self.log.moves()
            self.report.ops, self.report.calls = self.watch.ops, self.modules.calls

    def forward(self) -> contextlib.AbstractContextManager:
        """The forward phase: every aten op through the write watch."""
        return self.watch

    def aside(self) -> Callable[[], None]:
        """Lifts the watch (its dispatch and function modes, the module hooks) while code it must
        not see runs (a compiled function); returns what puts it back as it was."""
        mine = (self.watch, *self.python_calls)
        dispatch = _lift(
            torch._C._len_torch_dispatch_stack,
            torch._C._get_dispatch_stack_at,
            lambda: torch._C._pop_torch_dispatch_stack(None),
            torch._C._push_on_torch_dispatch_stack,
            mine,
        )
        function = _lift(
            torch._C._len_torch_function_stack,
            torch._C._get_function_stack_at,
            torch._C._pop_torch_function_stack,
            torch._C._push_on_torch_function_stack,
            mine,
        )
        hooks = self.modules.pause()
        done: List[bool] = []

        def resume() -> None:
            if not done:
                done.append(True)
                hooks()
                function()
                dispatch()

        return resume

    def backward(self, out: Any, keep: bool, leaves: Iterable[Tensor] = ()) -> None:
        """The backward phase: errors recorded in ``backward_error``, not raised."""
        self.watch.phase = "backward"
        calls = PythonCalls(self.watch)
        self.python_calls.append(calls)
        try:
            with calls:
                backward_from(out, keep, leaves)
        except Exception as e:  # the model's own error: recorded, findings before it kept
            self.report.backward_error = describe(e)
        self.watch.confirm(None)


@dataclass
class AuditedCall:
    """One outermost module call of a scope: the module's class, where the program called it."""

    module: str
    caller: str
    report: AuditReport
    worker: Optional[str] = None  # fork or spawn: audited in a worker process, merged here
    transform: bool = False  # a torchvision transform's call (per sample), not a model's


def _version(t: Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version
        return None


def _versions(args: Tuple[Arg, ...]) -> List[Tuple[Span, Tensor, Optional[int]]]:
    return [(a.span, a.tensor, _version(a.tensor)) for a in args]


class CallerReads:
    """After an outermost call wrote into its argument (``E0596`` in the outermost module), the
    names of the caller's frame that held that memory are moved: the first read of one, before
    the next outermost call or the scope's end, is an ``E0382`` of that call (the UNet skip's
    ``h = x; x = block(x); x + h``, at the program's own level)."""

    def __init__(self) -> None:
        self.tracer: Optional[MoveTracer] = None

    def watch(self, frame: Optional[FrameType], report: AuditReport, written: List[Span]) -> None:
        write = next((f for f in report.findings if f.code == "E0596" and f.module == ""), None)
        if frame is None or write is None or not written:
            return

        def overlaps(value: Any) -> bool:
            other = span(value) if isinstance(value, Tensor) else None
            return other is not None and any(other.overlaps(w) for w in written)

        def read(at: FrameType, name: str, _: Any) -> None:
            message = (
                f"`{name}` is read after `(root)` wrote into its value ({write.op} at {write.where}): "
                "the value was moved into the module, and this is a use after move"
            )
            report.findings.append(Finding("E0382", "", write.where, write.op, message, location(at)))

        self.tracer = MoveTracer(read)
        with torch._C.DisableTorchFunction():
            names = list(holders(frame, overlaps))
        for name in names:
            self.tracer.watch(frame, name, write)

    def stop(self) -> None:
        if self.tracer is not None:
            self.tracer.stop()
            self.tracer = None


_ORIGINAL_CALL: Callable[..., Any] = nn.Module.__call__
_ACTIVE: List["AuditScope"] = []  # the open scope (one at a time)


def tracer(module: Any) -> Optional[str]:
    """The tracer or compiler running now, or that would run ``module``'s call, by name; None when
    the call runs eagerly. The audit steps aside for it: its span reads and hooks would be
    recorded into (or break) the user's graph, and a compiled call runs no aten op one by one."""
    if torch._C._get_tracing_state() is not None:
        return "torch.jit.trace"
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is not None and isinstance(module, dynamo.OptimizedModule):
        return "torch.compile"
    fx = sys.modules.get("torch.fx._symbolic_trace")
    if fx is not None and fx._is_fx_tracing_flag:  # fx.symbolic_trace, torch.export's tracing
        return "torch.fx"
    if sys.modules.get("torch._subclasses.fake_tensor") is not None:
        from torch._guards import detect_fake_mode

        if detect_fake_mode() is not None:
            return "FakeTensorMode"
    return None


def _class_name(module: nn.Module) -> str:
    """The module's class as its code names it (a ScriptModule's: the scripted class's)."""
    if isinstance(module, torch.jit.ScriptModule):
        return str(getattr(module, "original_name", type(module).__qualname__))
    return type(module).__qualname__


def _audited_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_compiling():  # Dynamo (torch.compile, torch.export) traces this call: not ours
        traced_by_dynamo()  # counted each time the compiled frame runs
        return _ORIGINAL_CALL(module, *args, **kwargs)
    scope = _ACTIVE[-1] if _ACTIVE else None
    if scope is None or scope.busy or threading.get_ident() != scope.thread:
        return _ORIGINAL_CALL(module, *args, **kwargs)
    by = tracer(module)
    if by is not None:
        return scope.aside(f"under a tracer ({by})", module, args, kwargs)
    if isinstance(module, torch.fx.GraphModule) and in_compiled_code(sys._getframe(1)):
        return scope.unaudited(module, args, kwargs)  # a compiled frame's backend: the frame is counted
    return scope.call(module, args, kwargs)


module_call(_audited_call, _ORIGINAL_CALL)


@contextlib.contextmanager
def unscoped() -> Iterator[None]:
    """Inside, the open scope (if any) audits nothing: ``audit()`` runs its own watch."""
    scope = _ACTIVE[-1] if _ACTIVE else None
    busy = scope.busy if scope is not None else False
    if scope is not None:
        scope.busy = True
    try:
        yield
    finally:
        if scope is not None:
            scope.busy = busy


class AuditScope:
    """Audits each outermost module call made in this thread while open (see the module doc), and
    with ``children`` those of the worker processes its program starts (:mod:`.children`)."""

    def __init__(self, backward: bool = False, children: bool = True) -> None:
        self.backward = backward
        self.children = Children(backward, self.as_child) if children else None
        self.child: Optional[Tuple[str, str]] = None  # in a worker: (fork or spawn, its file)
        self.workers: Dict[str, Set[int]] = {}  # the parent's: fork or spawn -> the pids merged
        self.calls: List[AuditedCall] = []
        self.allows = Allows()
        self.thread = threading.get_ident()
        self.busy = False
        self.unused_allows: List[Tuple[str, str]] = []
        self.reads = CallerReads()
        # the outermost calls run but not audited, by why (``under a tracer (torch.jit.trace)``)
        self.not_audited: Dict[str, int] = {}
        self.unit: Optional[CallAudit] = None  # the audited call running
        self.tracers = Tracers(self.count, self.step_aside)  # torch.compile'd functions, FX and export traces

    def __enter__(self) -> "AuditScope":
        if _ACTIVE:
            raise RuntimeError("an audit scope is already open")
        _ACTIVE.append(self)
        nn.Module.__call__ = _audited_call  # type: ignore[method-assign]
        self.tracers.__enter__()
        if self.children is not None:
            self.children.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reads.stop()
        nn.Module.__call__ = _ORIGINAL_CALL  # type: ignore[method-assign]
        self.tracers.__exit__(*exc)
        _ACTIVE.remove(self)
        if self.children is not None and self.child is None:
            self.children.__exit__(*exc)
            self._merge(self.children.collect())

    def as_child(self, kind: str, directory: str) -> None:
        """This scope, in a worker process (``fork``: inherited; ``spawn``: opened there), audits
        the worker's calls for the parent: each goes to the worker's own file in ``directory``."""
        self.reads.stop()
        self.calls, self.not_audited, self.busy = [], {}, False
        self.reads, self.thread = CallerReads(), threading.get_ident()
        self.child = (kind, os.path.join(directory, f"{os.getpid()}.jsonl"))

    def _merge(self, records: List[Dict[str, Any]]) -> None:
        for r in records:
            self.workers.setdefault(r["kind"], set()).add(r["pid"])
            sites.restore(r["sites"])  # the carets' columns, the user's line that called a library
            self.allows.watch(r["files"])
            if r["report"] is None:
                self.not_audited[r["module"]] = self.not_audited.get(r["module"], 0) + 1
            else:
                self.calls.append(AuditedCall(r["module"], r["caller"], r["report"], r["kind"], r["transform"]))

    def notes(self) -> List[str]:
        """What the summary adds about the worker processes whose calls were merged."""
        out = []
        transforms = sum(c.transform for c in self.calls)
        if transforms:
            models = len(self.calls) - transforms
            were = f"{transforms} were torchvision transforms" if transforms != 1 else "1 was a torchvision transform"
            out.append(f"of these calls, {were} (per sample), {models} model call{'s' * (models != 1)}")
        started = self.children.forkserver if self.children is not None else 0
        if started:
            processes = f"{started} forkserver worker process{'es' * (started != 1)}"
            out.append(f"{processes} not audited (their server runs unaudited)")
        for kind, pids in self.workers.items():
            n = sum(1 for c in self.calls if c.worker == kind)
            out.append(f"{n} of these calls ran in {len(pids)} {kind}ed worker process{'es' * (len(pids) != 1)}")
        return out

    def count(self, why: str, n: int = 1, inside: bool = False) -> None:
        """``n`` outermost calls of this scope's thread ran but were not audited, because ``why``
        (nothing when an audited call is running: they are its own; ``inside``: a call inside
        it that it did not audit)."""
        if (self.busy and not inside) or threading.get_ident() != self.thread:
            return
        self.not_audited[why] = self.not_audited.get(why, 0) + n
        if self.child is not None:
            for _ in range(n):
                dump(self.child[1], self.child[0], AuditedCall(why, "", None), [])  # type: ignore[arg-type]

    def step_aside(self) -> Optional[Callable[[], None]]:
        """A compiled function starts inside the audited call of this thread (if one runs): it is
        counted, and runs unwatched until the returned function puts the watch back."""
        unit = self.unit
        if unit is None or threading.get_ident() != self.thread:
            return None
        self.count(COMPILE, 1, inside=True)
        return unit.aside()

    def aside(self, why: str, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Runs an outermost call as it would run without the audit (nothing watches it, nor the
        calls it makes), counted in ``not_audited`` under ``why``."""
        self.count(why)
        return self.unaudited(module, args, kwargs)

    def unaudited(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Runs a call, and the calls it makes, as without the audit."""
        self.busy = True
        try:
            return _ORIGINAL_CALL(module, *args, **kwargs)
        finally:
            self.busy = False

    def call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        self.busy = True
        self.reads.stop()
        frame = user_frame(sys._getframe(2))
        caller = location(frame)
        unit = CallAudit(module, args, kwargs, stop=sys._getframe())
        versions = _versions(arguments(module, args, kwargs, {}))
        self.tracers.hook_dynamo()  # Dynamo imported since the scope opened
        self.unit = unit
        try:
            with unit.watching() as report:
                try:
                    with unit.forward():
                        out = _ORIGINAL_CALL(module, *args, **kwargs)
                except Exception as e:
                    report.error = describe(e)
                    raise
                unit.watch.confirm(roots(out))
                if self.backward and roots(out):
                    unit.backward(out, keep=True, leaves=module.parameters())
        finally:
            self.tracers.resume()
            self.unit = None
            self.busy = False
            self.allows.watch(unit.files)
            transform = type(module).__module__.startswith("torchvision.transforms")
            self.calls.append(AuditedCall(_class_name(module), caller, unit.report, transform=transform))
            if self.child is not None:
                dump(self.child[1], self.child[0], self.calls[-1], sorted(unit.files))
        self.reads.watch(frame, unit.report, [s for s, t, v in versions if _version(t) != v])
        return out

    def finish(self, files: Iterable[str] = ()) -> List[Tuple[str, str]]:
        """Applies the allows to every call's report (once all ran: an allow in a loop may silence
        a later call); returns, and keeps in ``unused_allows``, those that silenced nothing."""
        self.allows.watch(files)
        for c in self.calls:
            self.allows.apply(c.report)
        self.unused_allows = self.allows.unused()
        return self.unused_allows


def child(directory: str, backward: bool) -> None:
    """The start of a spawned worker (:mod:`.children`): a scope that audits its calls for the
    parent, open until the interpreter ends."""
    scope = AuditScope(backward=backward, children=False)
    scope.as_child("spawn", directory)
    scope.__enter__()
