"""Writes outside ATen: memory written through a NumPy array (``Tensor.numpy()``, ``__array__``:
``np.asarray(x)``) or a DLPack capsule (``__dlpack__``, ``torch.to_dlpack``: ``torch.from_dlpack``,
``np.from_dlpack``) that a tensor exported while the forward ran. Such a write is no op: no
dispatch mode sees it, and it bumps no version counter.

While the write watch runs a forward, :class:`Exports` wraps those exporting functions (each calls
the original and returns its result unchanged) and keeps, for each tensor exported in the audited
thread, a copy of its bytes and its version. Before each aten op, at each module boundary, at the
forward's end and, in the frame that exported it, at each new line, the bytes are compared: bytes
that changed while the version did not were written outside ATen, and the write watch is told
(``on_write``), with the exporting frame's line where the bytes were last seen unchanged: the
user's line that wrote (:class:`Lines`). An aten write into the same memory (the version moved) is
the write watch's own, and the copy is taken again. A NumPy export is dropped once its array and
every view of it are gone (nothing can write through it any more); a DLPack export is kept to the
forward's end. With no export, the only cost is a test of an empty list per op and per boundary.
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.utils.dlpack
from torch import Tensor

from .frames import EarlierTracers, short_path, user_frame
from .memory import Span, span

__all__ = ["Export", "Exports", "Lines"]

_MONITORING: Any = getattr(sys, "monitoring", None) if sys.version_info >= (3, 12) else None


class Export:
    """One tensor exported outside ATen, as the watch last saw its bytes."""

    __slots__ = ("tensor", "span", "how", "bytes", "version", "array", "frame", "path", "line")

    def __init__(self, tensor: Tensor, s: Span, how: str, array: Any, frame: Optional[FrameType]) -> None:
        self.tensor, self.span, self.how = tensor, s, how
        self.bytes, self.version = _bytes(tensor), tensor._version
        self.array: Optional[Callable[[], Any]] = array  # a weak reference to the NumPy array, if one
        self.frame = frame
        self.path = short_path(frame.f_code.co_filename) if frame is not None else "?"
        self.line = frame.f_lineno if frame is not None else 0  # the exporting frame's last line seen

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.line else self.path

    def written(self) -> bool:
        """Whether the bytes changed while the version did not (then they are taken again)."""
        if self.tensor._version != self.version:
            self.rebase()
            return False
        now = _bytes(self.tensor)
        with torch._C._DisableTorchDispatch():
            same = torch.equal(now, self.bytes)
        if same:
            return False
        self.bytes = now
        return True

    def rebase(self) -> None:
        self.bytes, self.version = _bytes(self.tensor), self.tensor._version

    def dead(self) -> bool:
        return self.array is not None and self.array() is None


def _bytes(t: Tensor) -> Tensor:
    """A copy of ``t``'s elements as bytes, made where no dispatch mode sees it (the audit's own
    ops are not the program's) and no version moves."""
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        return t.detach().reshape(-1).clone().view(torch.uint8)


class Lines:
    """Calls ``on_line(frame)`` at each new line of the frames it follows, and ``on_return(frame)``
    when one returns (3.11: the frame's ``f_trace``, with ``sys.settrace`` installed only if no
    trace function is; 3.12+: ``sys.monitoring``'s LINE events on its code). A frame that another
    Python tracer already follows (a debugger, coverage's Python tracer, Hypothesis's) keeps it:
    its ``f_trace`` is called first, with every event, and is put back once the frame is no longer
    followed. A tracer that replaces the ``f_trace`` later, or a C tracer (which never calls
    ``f_trace``), leaves the export's line the last one seen."""

    def __init__(self, on_line: Callable[[FrameType], None], on_return: Callable[[FrameType], None]) -> None:
        self.on_line, self.on_return = on_line, on_return
        self.frames: Set[FrameType] = set()
        self._theirs = EarlierTracers()  # 3.11: the f_trace each had (given every event first)
        self._installed = False
        self._tool: Optional[int] = None
        self._codes: Dict[Any, int] = {}

    def follow(self, frame: FrameType) -> None:
        if frame in self.frames:
            return
        if _MONITORING is not None:
            if self._start():
                self.frames.add(frame)
                count = self._codes.get(frame.f_code, 0)
                self._codes[frame.f_code] = count + 1
                if count == 0:
                    events = _MONITORING.events.LINE | _MONITORING.events.PY_RETURN
                    _MONITORING.set_local_events(self._tool, frame.f_code, events)
            return
        self.frames.add(frame)
        self._theirs.keep(frame, frame.f_trace)
        frame.f_trace = self._trace
        frame.f_trace_lines = True
        if sys.gettrace() is None:
            self._installed = True
            sys.settrace(_untraced)

    def unfollow(self, frame: FrameType) -> None:
        if frame not in self.frames:
            return
        self.frames.discard(frame)
        if _MONITORING is not None:
            count = self._codes.pop(frame.f_code, 1) - 1
            if count > 0:
                self._codes[frame.f_code] = count
            elif self._tool is not None:
                _MONITORING.set_local_events(self._tool, frame.f_code, 0)
            return
        previous = self._theirs.release(frame)
        if frame.f_trace == self._trace:
            frame.f_trace = previous
        self._untrace()

    def stop(self) -> None:
        for frame in list(self.frames):
            self.unfollow(frame)
        self._untrace()
        if self._tool is not None:
            for code in self._codes:
                _MONITORING.set_local_events(self._tool, code, 0)
            self._codes.clear()
            _MONITORING.register_callback(self._tool, _MONITORING.events.LINE, None)
            _MONITORING.register_callback(self._tool, _MONITORING.events.PY_RETURN, None)
            _MONITORING.free_tool_id(self._tool)
            self._tool = None

    def _untrace(self) -> None:
        # only its own, and only while on top (a tracer installed since keeps it as its previous)
        if self._installed and not self.frames and sys.gettrace() is _untraced:
            self._installed = False
            sys.settrace(None)

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame not in self.frames:
            return None
        if self._theirs.passing(frame):  # called back by the tracer this one is giving the event to
            return self._trace
        self._theirs.give(frame, event, arg)  # the tracer that followed the frame first: as if alone
        if event == "line":
            self.on_line(frame)
        elif event == "return":
            self.on_return(frame)
            self.unfollow(frame)
            return None
        return self._trace

    def _start(self) -> bool:
        if self._tool is None:
            free = [t for t in (4, 3) if _MONITORING.get_tool(t) is None]
            if not free:
                return False
            self._tool = free[0]
            _MONITORING.use_tool_id(self._tool, "plusequals.auditing.exports")
            _MONITORING.register_callback(self._tool, _MONITORING.events.LINE, self._line)
            _MONITORING.register_callback(self._tool, _MONITORING.events.PY_RETURN, self._returned)
        return True

    def _line(self, code: Any, line: int) -> Any:
        frame = sys._getframe(1)
        if frame in self.frames:
            self.on_line(frame)

    def _returned(self, code: Any, offset: int, value: Any) -> Any:
        frame = sys._getframe(1)
        if frame in self.frames:
            self.on_return(frame)
            self.unfollow(frame)


def _untraced(frame: FrameType, event: str, arg: Any) -> None:
    """The global trace function while only followed frames are traced: no new frame is."""
    return None


_PATCHED: List[Tuple[Any, str]] = [(Tensor, "numpy"), (Tensor, "__array__"), (Tensor, "__dlpack__")]
_PATCHED += [(torch, "to_dlpack"), (torch.utils.dlpack, "to_dlpack")]


class Exports:
    """The tensors exported outside ATen during a forward (see the module doc). ``live`` is the
    list the write watch tests on its hot path; ``on_write(export, where)`` is told each write."""

    def __init__(self, on_write: Callable[[Export, str], None], stop: Optional[FrameType]) -> None:
        self.on_write = on_write
        self.stop_frame = stop
        self.live: List[Export] = []
        self.lines = Lines(self._line, self._returned)
        self._thread = threading.get_ident()
        self._saved: List[Tuple[Any, str, Any, bool]] = []
        self._depth = 0
        self._inside = False  # an export calling another (``__array__`` calls ``numpy()``)
        self.busy = False  # a check running (what it reports may dispatch ops: not checked again)

    # -- the wrappers -----------------------------------------------------------------------------
    def install(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        for owner, name in _PATCHED:
            original = getattr(owner, name)
            self._saved.append((owner, name, original, name in vars(owner)))
            setattr(owner, name, self._wrap(original, name, owner is Tensor))

    def uninstall(self) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for owner, name, original, own in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # inherited (``numpy`` is TensorBase's)
        self._saved.clear()

    def _wrap(self, original: Any, name: str, method: bool) -> Any:
        how = f"Tensor.{name}" if method else f"torch.{name}"
        array = name in ("numpy", "__array__")

        # every argument passed on as given: what torch's own accepts or refuses (numpy retries
        # ``__array__`` without ``copy=`` on a TypeError) is unchanged
        def export(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            return self._export(original, how, tensor, args, kwargs, array)

        export.__name__ = export.__qualname__ = name
        export.__doc__ = getattr(original, "__doc__", None)
        return export

    def _export(self, original: Any, how: str, tensor: Any, args: tuple, kwargs: dict, array: bool) -> Any:
        if self._inside or threading.get_ident() != self._thread or not isinstance(tensor, Tensor):
            return original(tensor, *args, **kwargs)
        self._inside = True
        try:
            out = original(tensor, *args, **kwargs)
        finally:
            self._inside = False
        self._record(tensor, how, out if array else None)
        return out

    def _record(self, tensor: Tensor, how: str, out: Any) -> None:
        s = span(tensor)
        if s is None:
            return
        try:
            ref = weakref.ref(out) if out is not None else None
        except TypeError:
            ref = None
        frame = user_frame(sys._getframe(3), self.stop_frame)
        if self.live:  # the arrays gone since (a loop exporting anew each time): compared, dropped
            self._each(Export.dead, None)
        self.live.append(Export(tensor, s, how, ref, frame))
        if frame is not None:
            self.lines.follow(frame)

    # -- the checks ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Before an op, at a boundary, at the forward's end: each export's bytes compared, the
        write reported at the exporting frame's line last seen."""
        self._each(lambda e: True, None)

    def _each(self, mine: Callable[[Export], bool], frame: Optional[FrameType]) -> None:
        """Compares the exports ``mine`` selects; each changed is reported at its last line, and
        then (``frame``: a new line of the exporting frame) takes that frame's line. The dead
        are dropped."""
        if self.busy:
            return
        self.busy = True
        try:
            for e in [e for e in self.live if mine(e)]:
                if e.written():
                    self.on_write(e, e.where)
                if frame is not None:
                    e.line = frame.f_lineno
            self.live[:] = [e for e in self.live if not e.dead()]
        finally:
            self.busy = False

    def rebase(self, written: List[Optional[Span]]) -> None:
        """After an op: an aten write into an exported tensor (its version moved, or the op wrote
        its memory through another tensor of the same storage, as ``.data``) is the write
        watch's; its bytes are taken again."""
        for e in self.live:
            if e.tensor._version != e.version or any(s is not None and s.overlaps(e.span) for s in written):
                e.rebase()

    def _line(self, frame: FrameType) -> None:
        """A new line of an exporting frame: a write since the last line was on that line."""
        self._each(lambda e: e.frame is frame, frame)

    def _returned(self, frame: FrameType) -> None:
        """An exporting frame returns: what it wrote is reported at its line; the array may be
        what it returns, so the user frame that called it is followed from its current line."""
        self._each(lambda e: e.frame is frame, None)
        back = user_frame(frame.f_back, self.stop_frame)
        for e in self.live:
            if e.frame is frame:
                e.frame = back  # None: its line stays the last seen
                if back is not None:
                    e.path, e.line = short_path(back.f_code.co_filename), back.f_lineno
                    self.lines.follow(back)

    def finish(self) -> None:
        """The forward ended: what was written is reported, and nothing is followed any more."""
        if self.live:
            self.check()
        self.lines.stop()
        self.live.clear()
