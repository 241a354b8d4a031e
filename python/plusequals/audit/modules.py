"""The module boundary: which module calls are running, what each was given, and who called it.

Every module of the audited model gets a forward pre-hook (pushes a :class:`Call`) and an
always-called forward hook (pops it). A Rust or C++ twin (``plusequals.twin``) is watched as one
module: it computes its children's work in Rust, and a hook on a child would make it read the
block again.
"""

from __future__ import annotations

import inspect
import sys
import threading
from types import FrameType
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .frames import user_frame
from .memory import Span, span, tensors

__all__ = ["Arg", "Call", "ModuleWatch"]

_OPAQUE_PREFIX = "plusequals.twin."


class Arg(NamedTuple):
    label: str  # the parameter's name in ``forward``'s signature (``args[i]`` for ``*args``)
    span: Span
    tensor: Tensor


class Call(NamedTuple):
    module: str  # qualified name, as in named_modules()
    cls: str
    args: Tuple[Arg, ...]
    caller: Optional[FrameType]  # the user frame that called the module (None: the audit itself)
    ident: int  # id() of the module object


_PARAMS: Dict[Any, Tuple[str, ...]] = {}


def _param_names(fn: Any) -> Tuple[str, ...]:
    """The positional parameters' names of a module's ``forward`` (or of a plain callable)."""
    call = fn.forward if isinstance(fn, nn.Module) else fn
    key = getattr(call, "__func__", call)
    found = _PARAMS.get(key)
    if found is None:
        try:
            params = list(inspect.signature(call).parameters.values())
        except (TypeError, ValueError):
            params = []
        found = _PARAMS[key] = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return found


def arguments(module: Any, args: tuple, kwargs: dict) -> Tuple[Arg, ...]:
    names = _param_names(module)
    labelled = [(names[i] if i < len(names) else f"args[{i}]", v) for i, v in enumerate(args)]
    labelled += list(kwargs.items())
    out = []
    with torch._C.DisableTorchFunction():
        for label, value in labelled:
            for t in tensors(value):
                s = span(t)
                if s is not None:
                    out.append(Arg(label, s, t))
    return tuple(out)


class ModuleWatch:
    """The running module calls of the audited thread, innermost last."""

    def __init__(self, stop: FrameType) -> None:
        self.stack: List[Call] = []
        self.calls = 0
        self.watched = 0
        self._stop = stop  # the audit's frame: frames above it are not the model's
        self._names: Dict[int, str] = {}
        self._handles: List[Any] = []
        self._thread = threading.get_ident()

    def attach(self, model: nn.Module) -> None:
        opaque: List[str] = []
        for name, m in model.named_modules():
            if any(name.startswith(prefix + ".") for prefix in opaque):
                continue
            if type(m).__module__.startswith(_OPAQUE_PREFIX):
                opaque.append(name)
            self._names[id(m)] = name
            self._handles.append(m.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True))
            self._handles.append(m.register_forward_hook(self._leave, with_kwargs=True, always_call=True))
        self.watched = len(self._names)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.stack.clear()

    def push_root(self, fn: Any, args: tuple, kwargs: dict) -> None:
        """For a callable that is not a module: its arguments are the borrowed ones."""
        self.stack.append(
            Call("", getattr(fn, "__qualname__", type(fn).__name__), arguments(fn, args, kwargs), None, 0)
        )

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != self._thread:
            return None
        self.calls += 1
        caller = user_frame(sys._getframe(1), self._stop)
        name = self._names.get(id(module), type(module).__name__)
        self.stack.append(Call(name, type(module).__qualname__, arguments(module, args, kwargs), caller, id(module)))
        return None

    def _leave(self, module: nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
        if threading.get_ident() != self._thread:
            return None
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].ident == id(module):
                del self.stack[i:]
                break
        return None

    def current(self) -> str:
        return self.stack[-1].module if self.stack else ""

    def running(self, frame: Optional[FrameType]) -> str:
        """The innermost module running at ``frame``: the innermost call, or when no call is
        (a checkpoint recomputing in backward calls ``self._forward`` directly) the innermost
        frame whose ``self`` is a watched module; ``""`` if none."""
        if self.stack:
            return self.stack[-1].module
        while frame is not None and frame is not self._stop:
            me = frame.f_locals.get("self") if frame.f_code.co_varnames[:1] == ("self",) else None
            if me is not None and id(me) in self._names:
                return self._names[id(me)]
            frame = frame.f_back
        return ""

    def owner(self, written: Span, tensor: Tensor, metadata_only: bool) -> Optional[Tuple[Call, Arg]]:
        """The innermost running call that was given the memory ``written`` (for a metadata-only
        write, the tensor itself), and which argument it came as."""
        for call in reversed(self.stack):
            for arg in call.args:
                if (arg.tensor is tensor) if metadata_only else arg.span.overlaps(written):
                    return call, arg
        return None

    def frames_above(self, call: Call) -> List[FrameType]:
        """The user frames from ``call``'s caller up to the audit: where names of the moved
        value may live."""
        out = []
        frame = call.caller
        while frame is not None and frame is not self._stop:
            if user_frame(frame, self._stop) is frame:
                out.append(frame)
            frame = frame.f_back
        return out
