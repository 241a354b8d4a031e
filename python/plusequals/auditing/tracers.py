"""The module calls a tracer or compiler takes over, counted for the scope's summary (never
silently dropped): the audit cannot watch them, and leaves them exactly as they would run.

* ``torch.compile`` of a function (Dynamo): the module calls it makes are inlined into a graph
  that runs compiled. At trace time, ``comptime`` (Dynamo runs it while tracing; it adds nothing
  to the graph nor to the guards) tallies the outermost module calls of each traced frame; at run
  time, the compiled frame's pre-graph bytecode calls ``torch._dynamo.utils``'s
  ``record_pregraph_bytecode_enter`` (looked up there on each run), which the open scope wraps to
  count that frame's tally once per run.
* ``torch.fx`` tracing (``symbolic_trace``) and ``torch.export`` (strict or not): FX's
  ``Tracer.trace`` and ``Tracer.call_module``, wrapped while the scope is open. An export, or
  the trace of a module, is one call; the trace of a function counts the outermost module calls
  it makes. The traces AOTAutograd makes inside ``torch.compile`` are not counted (the compiled
  frame is, when it runs).
* A function compiled with ``torch.compile`` called inside an audited call: the scope steps
  aside (``aside``: its dispatch modes and module hooks lifted) from the moment the compiled
  function sets Dynamo's frame callback (``_maybe_set_eval_frame`` in ``torch._dynamo.eval_frame``,
  looked up there on each call) until that same call of the compiled function resets it: Dynamo
  traces and runs it as it would without the audit (with a mode on the stack it would skip the
  frame and compile the audit's own handler instead).
"""

from __future__ import annotations

import functools
import sys
from types import CodeType, FrameType
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["COMPILE", "EXPORT", "FX", "Tracers", "in_compiled_code", "module_call", "traced_by_dynamo"]

COMPILE = "under a tracer (torch.compile)"
EXPORT = "under a tracer (torch.export)"
FX = "under a tracer (torch.fx)"

# (co_filename, co_firstlineno, co_name) of a frame Dynamo compiled -> (the trace it came from,
# the outermost module calls in it). Dynamo's transformed code keeps the three.
_COMPILED: Dict[Tuple[str, int, str], Tuple[int, int]] = {}
_OPEN: List["Tracers"] = []


def _key(code: CodeType) -> Tuple[str, int, str]:
    return (code.co_filename, code.co_firstlineno, code.co_name)


_MARKER: List[CodeType] = []  # the code of the scope's ``nn.Module.__call__``


def _tally(ctx: Any) -> None:
    """At Dynamo's trace time (``comptime``; a function with no free variable): one more
    outermost module call in the frame being compiled."""
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    depth, root = 0, tx
    while tx is not None:  # the inlined frames, innermost first, up to the compiled frame
        depth += tx.f_code in _MARKER
        root, tx = tx, getattr(tx, "parent", None)
    if depth != 1 or getattr(root, "export", False):  # nested, or an export (counted by FX's hooks)
        return
    key, trace = _key(root.f_code), id(root.output)
    seen, n = _COMPILED.get(key, (None, 0))
    _COMPILED[key] = (trace, (n if seen == trace else 0) + 1)  # a retrace restarts the tally
    if _OPEN:
        _OPEN[-1].hook_dynamo()


_UNPATCHED: List[Callable[..., Any]] = []  # torch's own ``nn.Module.__call__``


def module_call(fn: Callable[..., Any], original: Callable[..., Any]) -> None:
    """``fn`` is the scope's ``nn.Module.__call__``, ``original`` torch's (set once, at import:
    never while Dynamo traces, which would make the write a side effect of the compiled code)."""
    _MARKER.append(fn.__code__)
    _UNPATCHED.append(original)


def _unpatched(utils: Any) -> None:
    """Dynamo imported while the scope was open took the scope's ``nn.Module.__call__`` for
    torch's own, and would skip it (no tally): it gets torch's, as without the audit."""
    if getattr(utils, "unpatched_nn_module_call", None) is _UNPATCHED[0]:
        return
    utils.unpatched_nn_module_call = _UNPATCHED[0]
    nn_module = sys.modules.get("torch._dynamo.variables.nn_module")
    if nn_module is not None and hasattr(nn_module, "unpatched_nn_module_call"):
        nn_module.unpatched_nn_module_call = _UNPATCHED[0]


def traced_by_dynamo() -> None:
    """Called in the scope's ``nn.Module.__call__`` while Dynamo traces it: tallies the call for
    the frame being compiled, when it is the outermost module call there."""
    from torch._dynamo.comptime import comptime

    comptime(_tally)


class Tracers:
    """The hooks, installed while a scope is open; ``count(why, n)`` is the scope's (it checks
    its thread, and that no audited call is running)."""

    def __init__(
        self, count: Callable[[str, int], None], aside: Callable[[], Optional[Callable[[], None]]] = lambda: None
    ) -> None:
        self.count = count
        self.aside = aside  # inside an audited call: steps aside, and returns what puts it back
        self._enter: Optional[Callable[[], Any]] = None
        self._eval: Optional[Callable[[Any], Any]] = None
        self._compile: Optional[Callable[..., Any]] = None
        self._module_call: Optional[Callable[..., Any]] = None
        self._stepped: List[Tuple[Optional[FrameType], Callable[[], None]]] = []  # (the compiled call's frame, resume)
        self._fx: Optional[Tuple[Any, Any]] = None
        self._mode: Optional[str] = None  # in an FX trace: FX (a function's: count its calls), or "" (counted)
        self._depth = 0  # the module calls running in that trace

    def __enter__(self) -> "Tracers":
        _OPEN.append(self)
        self.hook_dynamo()
        tracer = torch.fx.Tracer
        self._fx = (tracer.__dict__["trace"], tracer.__dict__["call_module"])
        trace, call_module = self._fx
        hooks = self

        def counted_trace(tracer_self: Any, root: Any, *args: Any, **kwargs: Any) -> Any:
            if hooks._mode is not None or _inside_compile():
                return trace(tracer_self, root, *args, **kwargs)
            exporting = torch.compiler.is_exporting()
            if exporting or isinstance(root, nn.Module):
                hooks.count(EXPORT if exporting else FX, 1)
            hooks._mode, hooks._depth = ("" if exporting or isinstance(root, nn.Module) else FX), 0
            try:
                return trace(tracer_self, root, *args, **kwargs)
            finally:
                hooks._mode = None

        def counted_call(tracer_self: Any, m: Any, forward: Any, args: Any, kwargs: Any) -> Any:
            if hooks._mode and hooks._depth == 0:
                hooks.count(hooks._mode, 1)
            hooks._depth += 1
            try:
                return call_module(tracer_self, m, forward, args, kwargs)
            finally:
                hooks._depth -= 1

        tracer.trace, tracer.call_module = counted_trace, counted_call  # type: ignore[method-assign]
        if self._eval is None:  # Dynamo not imported yet: hooked once torch.compile imports it
            self._compile = original = torch.compile

            @functools.wraps(original)
            def compile(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                finally:
                    hooks.hook_dynamo()

            torch.compile = compile
        return self

    def hook_dynamo(self) -> None:
        if self not in _OPEN:
            return
        self._hook_eval_frame()
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is not None and _UNPATCHED:
            _unpatched(utils)
        if self._enter is not None or utils is None or not hasattr(utils, "record_pregraph_bytecode_enter"):
            return
        self._enter = enter = utils.record_pregraph_bytecode_enter
        hooks = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            n = _COMPILED.get(_key(sys._getframe(1).f_code), (None, 0))[1]
            if n:
                hooks.count(COMPILE, n)
            return enter(*args, **kwargs)

        utils.record_pregraph_bytecode_enter = counted

    def _hook_eval_frame(self) -> None:
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if self._eval is not None or eval_frame is None or not hasattr(eval_frame, "_maybe_set_eval_frame"):
            return
        self._eval = original = eval_frame._maybe_set_eval_frame
        stepped = self._stepped

        def set_eval_frame(callback: Any) -> Any:
            if stepped:  # the compiled call that stepped aside resets the callback on its way out
                if sys._getframe(1) is not stepped[-1][0]:
                    return original(callback)
                try:
                    return original(callback)
                finally:
                    stepped.pop()[1]()
            if callback is not None:  # compiled code runs from here (None: a disabled function's)
                resume = self.aside()
                if resume is not None:
                    stepped.append((sys._getframe(1), resume))
            return original(callback)

        eval_frame._maybe_set_eval_frame = set_eval_frame
        optimized = eval_frame.OptimizedModule
        self._module_call = optimized_call = optimized.__dict__.get("__call__")
        if optimized_call is None:
            return

        def call(module: Any, *args: Any, **kwargs: Any) -> Any:
            # a compiled module steps aside before its own check of the global module hooks
            resume = None if stepped else self.aside()
            if resume is None:
                return optimized_call(module, *args, **kwargs)
            stepped.append((None, resume))
            try:
                return optimized_call(module, *args, **kwargs)
            finally:
                stepped.pop()[1]()

        optimized.__call__ = call

    def resume(self) -> None:
        """Puts the audit back if a compiled call left it aside (it raised before resetting)."""
        while self._stepped:
            self._stepped.pop()[1]()

    def __exit__(self, *exc: Any) -> None:
        _OPEN.remove(self)
        self.resume()
        if self._compile is not None:
            if getattr(torch.compile, "__wrapped__", None) is self._compile:
                torch.compile = self._compile
            self._compile = None
        if self._eval is not None:
            eval_frame = sys.modules["torch._dynamo.eval_frame"]
            eval_frame._maybe_set_eval_frame = self._eval
            if self._module_call is not None:
                eval_frame.OptimizedModule.__call__ = self._module_call
            self._eval = self._module_call = None
        if self._enter is not None:
            sys.modules["torch._dynamo.utils"].record_pregraph_bytecode_enter = self._enter
            self._enter = None
        if self._fx is not None:
            torch.fx.Tracer.trace, torch.fx.Tracer.call_module = self._fx  # type: ignore[method-assign]
            self._fx = None


def in_compiled_code(frame: Optional[FrameType]) -> bool:
    """Whether ``frame`` runs inside code Dynamo compiled (a frame whose bytecode calls a
    ``__compiled_fn``): a module call there is the backend's own (``aot_eager`` calls its graph
    modules), part of the compiled frame already counted."""
    while frame is not None:
        if any(name.startswith("__compiled_fn") for name in frame.f_code.co_names):
            return True
        frame = frame.f_back
    return False


def _inside_compile() -> bool:
    """AOTAutograd's trace of a graph Dynamo captured (not an export's)."""
    if torch.compiler.is_exporting():
        return False
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.TracingContext.try_get() is not None
