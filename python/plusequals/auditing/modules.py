"""The module boundary: which module calls are running, what each was given, and who called it.

Two of torch's global module hooks, a forward pre-hook (pushes a :class:`Call`) and an
always-called forward hook (pops it), watch the calls of the audited model's modules (by id, in
the audited thread); no module gets a hook of its own, so a module that checks its hooks (the
fused fast path of ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention``) runs as it would
unaudited. A Rust or C++ twin (``plusequals.twin``) is watched as one module, the audited model
itself included: it computes its children's work in Rust. A ``ScriptModule`` is one call too: its
insides are TorchScript, which calls its submodules without Python.

What outlives a call in someone else's hands (:meth:`ModuleWatch.kept`): the parameters, buffers
and tensor attributes of the watched modules, and the arguments of the audited call itself. The
watch keeps nothing after :meth:`ModuleWatch.detach` (its caches are its own, not the module's).
"""

from __future__ import annotations

import inspect
import sys
import threading
from types import FrameType
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .frames import is_user, short_path, swap_line
from .memory import Span, span, tensors

__all__ = ["Arg", "Call", "ModuleWatch"]

_OPAQUE_PREFIX = "plusequals.twin."
_MODULE_PY = _module.__file__.removesuffix("c")  # torch/nn/modules/module.py


class Arg(NamedTuple):
    label: str  # the parameter's name in ``forward``'s signature (``args[i]`` for ``*args``)
    span: Span
    tensor: Tensor


class Call(NamedTuple):
    module: str  # qualified name, as in named_modules()
    cls: str
    args: Tuple[Arg, ...]
    caller: Optional[FrameType]  # the frame below which the module runs (its callers' user frames are above it)
    ident: int  # id() of the module object
    obj: Any = None  # the module (held while it runs)
    # the lists and dicts of tensors it was given that someone else holds: [container, label, contents]
    containers: Tuple[List[Any], ...] = ()


def _param_names(fn: Any, cache: Dict[Any, Tuple[str, ...]]) -> Tuple[str, ...]:
    """The positional parameters' names of a module's ``forward`` (or of a plain callable);
    ``cache`` is one audit's (a module-wide one would keep every audited callable alive)."""
    call = fn.forward if isinstance(fn, nn.Module) else fn
    key = getattr(call, "__func__", call)
    found = cache.get(key)
    if found is None:
        try:
            params = list(inspect.signature(call).parameters.values())
        except (TypeError, ValueError):
            params = []
        found = cache[key] = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return found


def writer_of(module: Any) -> Optional[str]:
    """How torch's own module ``module`` is written in code (``nn.ReLU(inplace=True)``); None for
    a module that is not torch's."""
    cls = type(module)
    if not cls.__module__.startswith("torch.nn."):
        return None
    return f"nn.{cls.__name__}" + ("(inplace=True)" if getattr(module, "inplace", False) is True else "")


def labelled(module: Any, args: tuple, kwargs: dict, cache: Dict[Any, Tuple[str, ...]]) -> List[Tuple[str, Any]]:
    """Each argument with its parameter's name in ``forward``'s signature."""
    names = _param_names(module, cache)
    out = [(names[i] if i < len(names) else f"args[{i}]", v) for i, v in enumerate(args)]
    return out + list(kwargs.items())


def contents(c: Any) -> tuple:
    """What a list or dict holds, by identity (a change is a mutation)."""
    return tuple((k, id(v)) for k, v in list(c.items())) if isinstance(c, dict) else tuple(map(id, list(c)))


def containers(value: Any) -> List[Tuple[str, Any]]:
    """The lists and dicts holding tensors in ``value``: itself (``""``), and those one level
    inside it (a list of dicts of targets: ``"[0]"``)."""
    if not isinstance(value, (list, tuple, dict)):
        return []
    inside = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    out = [("", value)] if not isinstance(value, tuple) and any(isinstance(v, Tensor) for _, v in inside[:256]) else []
    for k, v in inside[:256]:
        if isinstance(v, (list, dict)) and any(
            isinstance(t, Tensor) for t in (v.values() if isinstance(v, dict) else v)
        ):
            out.append((f"[{k!r}]", v))
    return out


# values that hold no tensor: not walked as a tree (a module call's flags and sizes)
_LEAVES = (type(None), bool, int, float, str)


def arguments(module: Any, args: tuple, kwargs: dict, cache: Dict[Any, Tuple[str, ...]]) -> Tuple[Arg, ...]:
    """The tensors among a call's arguments, each with its parameter's name and its memory."""
    return tensor_args(labelled(module, args, kwargs, cache))


def tensor_args(labelled_: List[Tuple[str, Any]]) -> Tuple[Arg, ...]:
    """The tensors among the labelled arguments (see :func:`labelled`), each with its memory."""
    out = []
    with torch._C.DisableTorchFunction():
        for label, value in labelled_:
            if isinstance(value, _LEAVES):
                continue
            for t in (value,) if isinstance(value, Tensor) else tensors(value):
                s = span(t)
                if s is not None:
                    out.append(Arg(label, s, t))
    return tuple(out)


# nn.Module's own bookkeeping (its parameter, buffer, submodule and hook dicts): the parameters
# and buffers are kept one by one, and no module is given these dicts to mutate
_MODULE_OWN = frozenset(vars(nn.Module()))


class ModuleWatch:
    """The running module calls of the audited thread, innermost last."""

    # its global hooks change no argument or result, and see a twin as one module: the twin's
    # check of torch's global hooks (twin/watch.py) accepts them
    observes_only = True

    def __init__(self, stop: FrameType) -> None:
        self.stack: List[Call] = []
        self.calls = 0
        self.watched = 0
        self.stop = stop  # the audit's frame: frames above it are not the model's
        self._stop = stop
        self._names: Dict[int, str] = {}
        self._params: Dict[Any, Tuple[str, ...]] = {}
        self._kept: Dict[int, List[Tuple[Span, Tuple[str, str]]]] = {}  # storage -> (span, (kind, name))
        self._given: Tuple[Arg, ...] = ()  # the audited call's tensor arguments
        self._root: Optional[int] = None  # id() of the audited module
        # the lists and dicts of tensors that outlive the calls (the audited call's arguments, the
        # watched modules' attributes): id -> (the container, who holds it)
        self._shared: Dict[int, Tuple[Any, str]] = {}
        self._by_name: Dict[str, nn.Module] = {}
        # a call mutated a shared container it was given: (call, label, kind, holder)
        self.mutated: Callable[[Call, str, str, str], None] = lambda call, label, kind, holder: None
        self._handles: List[Any] = []
        self._thread = threading.get_ident()
        # called at each boundary, before the stack changes (the write watch settles what
        # autograd saved in the running call, and arms the tracer of the names moved in it)
        self.boundary: Callable[[], None] = lambda: None

    def attach(self, model: nn.Module) -> None:
        """Watches ``model``'s modules through torch's *global* module hooks, filtered to them (by
        id) and to this thread: each module's own hook dicts stay empty, so what checks them
        (``nn.TransformerEncoderLayer``'s and ``MultiheadAttention``'s fused fast path) runs as
        without the audit, and a ``ScriptModule`` (which refuses hooks of its own) is one call."""
        self._root = id(model)
        opaque: List[str] = []
        for name, m in model.named_modules():
            if any(prefix == "" or name.startswith(prefix + ".") for prefix in opaque):
                continue
            if type(m).__module__.startswith(_OPAQUE_PREFIX):
                opaque.append(name)
            self._names[id(m)] = name
            self._by_name[name] = m
            self._keep_module(name, m)
        self.watched = len(self._names)
        self._handles.append(register_module_forward_pre_hook(self._enter))
        self._handles.append(register_module_forward_hook(self._leave, with_kwargs=True, always_call=True))

    def pause(self) -> Callable[[], None]:
        """Lifts the watch's global hooks (a compiled function runs inside the call: Dynamo would
        trace them); returns what puts them back, in their places among torch's global hooks."""
        ids = {h.id for h in self._handles}
        tables = [
            _module._global_forward_pre_hooks,
            _module._global_forward_hooks,
            _module._global_forward_hooks_always_called,
            _module._global_forward_hooks_with_kwargs,
        ]
        before = [list(t.items()) for t in tables]
        for t in tables:
            for i in ids:
                t.pop(i, None)

        def resume() -> None:
            for t, items in zip(tables, before):
                now = dict(t)
                t.clear()
                t.update((k, v) for k, v in items if k in ids or k in now)
                t.update((k, v) for k, v in now.items() if k not in t)

        return resume

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
            # torch's handle of a global forward hook with kwargs leaves its kwargs mark behind:
            # left there, every later ``torch.compile(module)`` call warns of global hooks
            _module._global_forward_hooks_with_kwargs.pop(h.id, None)
        self._handles.clear()
        self.stack.clear()
        self._params.clear()
        self._kept.clear()
        self._given = ()
        self._shared.clear()
        self._by_name.clear()

    def _keep(self, t: Tensor, label: Tuple[str, str]) -> None:
        # the whole storage (a parameter owns its storage, or shares a flat one with others that
        # are parameters too): its address only, cheaper than a span, for every audit's attach
        try:
            storage = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, TypeError):
            return
        self._kept.setdefault(storage, []).append((Span(storage, 0, sys.maxsize), label))

    def _keep_module(self, name: str, m: nn.Module) -> None:
        prefix = name + "." if name else ""
        with torch._C.DisableTorchFunction():
            for kind, tensors_ in (("parameter", m._parameters), ("buffer", m._buffers)):
                for attr, t in tensors_.items():
                    if t is not None:
                        self._keep(t, (kind, prefix + attr))
            for attr, t in vars(m).items():
                if attr in _MODULE_OWN or isinstance(t, _LEAVES):
                    continue
                if isinstance(t, Tensor):
                    self._keep(t, ("attribute", prefix + attr))
                    continue
                for at, c in containers(t):
                    self._shared.setdefault(id(c), (c, f"the attribute `{prefix + attr}{at}`"))

    def _keep_given(self, args: Tuple[Arg, ...]) -> None:
        self._given += args
        for a in args:
            self._kept.setdefault(a.span.storage, []).append((a.span, ("audited call's argument", a.label)))

    def kept(self, written: Span) -> Optional[str]:
        """What else holds the memory ``written`` and outlives the running calls (a parameter,
        a buffer, a module's tensor attribute, the audited call's argument), or None."""
        for s, (kind, label) in self._kept.get(written.storage, ()):
            if s.overlaps(written):
                return f"the {kind} `{label}`"
        return None

    def _share_given(self, values: List[Tuple[str, Any]]) -> None:
        for label, value in values:
            for at, c in containers(value):
                self._shared.setdefault(id(c), (c, f"the audited call's argument `{label}{at}`"))

    def _given_containers(self, values: List[Tuple[str, Any]]) -> Tuple[List[Any], ...]:
        if not self._shared:
            return ()
        found = [[c, label + at, contents(c)] for label, v in values for at, c in containers(v)]
        return tuple(e for e in found if id(e[0]) in self._shared)

    def check_containers(self, call: Call) -> None:
        """Whether ``call`` mutated a shared list or dict it was given (reported once: the calls
        around it that were given it too take its new contents)."""
        for entry in call.containers:
            c, label, before = entry
            now = contents(c)
            if now == before:
                continue
            holder = self._shared.get(id(c), (c, "held by the caller"))[1]
            self.mutated(call, label, "dict" if isinstance(c, dict) else "list", holder)
            for other in self.stack:
                for e in other.containers:
                    if e[0] is c:
                        e[2] = now

    def push_root(self, fn: Any, args: tuple, kwargs: dict) -> None:
        """For a callable that is not a module: its arguments are the borrowed ones."""
        values = labelled(fn, args, kwargs, self._params)
        given = tensor_args(values)
        self._keep_given(given)
        self._share_given(values)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        self.stack.append(Call("", name, given, None, 0, fn, self._given_containers(values)))

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if id(module) not in self._names or threading.get_ident() != self._thread:
            return None
        self.boundary()
        self.calls += 1
        caller = sys._getframe(1)  # torch's; the user frame above it is looked for only on a write
        # a global pre-hook is given no keyword arguments: they are the calling frame's (torch's
        # Module._call_impl), else none are seen
        kwargs = caller.f_locals.get("kwargs") if caller.f_code.co_filename.startswith(_MODULE_PY) else None
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        values = labelled(module, args, kwargs, self._params)
        given = tensor_args(values)
        if id(module) == self._root and not self.stack:
            self._keep_given(given)
            self._share_given(values)
        name, cls = self._names[id(module)], type(module).__qualname__
        self.stack.append(Call(name, cls, given, caller, id(module), module, self._given_containers(values)))
        return None

    def _leave(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        # (module, args, kwargs, result); torch gives (module, args, result) when forward raised
        if id(module) not in self._names or threading.get_ident() != self._thread:
            return None
        self.boundary()
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].ident == id(module):
                if self.stack[i].containers:
                    self.check_containers(self.stack[i])
                del self.stack[i:]
                break
        return None

    def swap_site(self, module: str) -> str:
        """``path:line`` in ``module``'s ``forward`` that swaps a tensor's ``.data`` (see
        :func:`.frames.swap_line`); ``"?"`` if it has no Python ``forward``."""
        fn = getattr(self._by_name.get(module), "forward", None)
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        return "?" if code is None else f"{short_path(code.co_filename)}:{swap_line(code)}"

    def current(self) -> str:
        return self.stack[-1].module if self.stack else ""

    def writer(self) -> Optional[str]:
        """torch's own module running innermost (``nn.ReLU(inplace=True)``), if it is torch's."""
        return writer_of(self.stack[-1].obj) if self.stack else None

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

    def same_memory(self, tensor: Tensor, written: Span) -> Span:
        """``written`` (the memory a write into ``tensor`` reaches) as the memory of a running
        call's argument or of the audited call's whose bytes ``tensor`` shares through a storage
        of its own: ``torch.from_numpy`` (or ``torch.as_tensor``, ``torch.frombuffer``) of the
        NumPy array an argument was made from or exported to. Else ``written`` itself. Compared
        by address, on a device with addresses (the meta device has none)."""
        if written.storage in self._kept or any(a.span.storage == written.storage for c in self.stack for a in c.args):
            return written
        try:
            base = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return written
        if base == 0:
            return written
        lo, hi = base + written.start, base + written.stop
        others = [a for c in reversed(self.stack) for a in c.args] + [a for a in self._given]
        for a in others:
            try:
                storage = a.tensor.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            other = storage.data_ptr()
            if other and storage._cdata == a.span.storage and other + a.span.start < hi and lo < other + a.span.stop:
                return Span(a.span.storage, lo - other, hi - other)
        return written

    def owner(self, written: Span, tensor: Tensor, metadata_only: bool) -> Optional[Tuple[Call, Arg]]:
        """The innermost running call that was given the memory ``written`` (for a metadata-only
        write, the tensor itself), and which argument it came as."""
        for call in reversed(self.stack):
            for arg in call.args:
                if (arg.tensor is tensor) if metadata_only else arg.span.overlaps(written):
                    return call, arg
        return None

    def frames_above(self, call: Call) -> List[FrameType]:
        """The user frames above ``call``'s caller up to the audit: where names of the moved
        value may live."""
        out = []
        frame = call.caller
        while frame is not None and frame is not self._stop:
            if is_user(frame):
                out.append(frame)
            frame = frame.f_back
        return out
