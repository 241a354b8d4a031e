"""Python frames: which one is the user's (for ``where``), and the watcher that catches a moved
name being read (``E0382``).

A frame is the user's when its code is neither torch's nor the audit's (every module of this
package; the rest of plusequals, its models and :mod:`plusequals.cases` among them, is user code).
Once a module has written into its argument, the names that held that memory in the frames that
called it are *moved*; those frames are then watched instruction by instruction (``sys.monitoring``
on 3.12+, ``sys.settrace`` on 3.11; from that moment only: a clean model runs unwatched) until each
name is read (a finding), bound again or deleted (no finding), or the audit ends. A read in a
comprehension, a generator expression or a lambda that a watched frame calls (a free variable that
is the frame's cell) is seen; one in another function (a callee given the value) or after the audit
returns is not.
"""

from __future__ import annotations

import bisect
import dis
import os
import sys
from types import CodeType, FrameType
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple

import torch

__all__ = [
    "MoveTracer",
    "call_names",
    "closures",
    "function_holding",
    "holders",
    "is_user",
    "line_names",
    "location",
    "mutation_site",
    "swap_line",
    "taken_from",
    "user_frame",
]

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__))
# the audit's machinery: every module of this package (what it audits is elsewhere)
_AUDIT = frozenset(os.path.join(_HERE, f) for f in os.listdir(_HERE) if f.endswith(".py"))


def is_user(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    return not filename.startswith(_TORCH) and filename not in _AUDIT


def user_frame(frame: Optional[FrameType], stop: Optional[FrameType] = None) -> Optional[FrameType]:
    """``frame`` or the first frame above it that is the user's; None if ``stop`` (the audit's
    own frame) comes first."""
    while frame is not None and frame is not stop and not is_user(frame):
        frame = frame.f_back
    return None if frame is stop else frame


_SHORT: Dict[str, str] = {}


def short_path(filename: str) -> str:
    """``filename`` relative to the ``sys.path`` entry that gives the shortest path (so
    ``diffusers/models/attention.py``, ``plusequals/model/blocks.py``), else as it is."""
    found = _SHORT.get(filename)
    if found is None:
        candidates = [filename]
        for entry in sys.path:
            root = os.path.abspath(entry or os.curdir) + os.sep
            if filename.startswith(root):
                candidates.append(filename[len(root) :])
        found = _SHORT[filename] = min(candidates, key=len)
    return found


def location(frame: Optional[FrameType]) -> str:
    if frame is None:
        return "?"
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"


_MONITORING: Any = getattr(sys, "monitoring", None) if sys.version_info >= (3, 12) else None

# The opcodes that read or (re)bind a name, across CPython 3.11 to 3.13.
_READS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF", "LOAD_NAME", "LOAD_GLOBAL")
_BINDS = ("STORE_FAST", "STORE_DEREF", "STORE_NAME", "STORE_GLOBAL", "DELETE_FAST", "DELETE_DEREF", "DELETE_NAME")
_STORE_PAIRS = ("STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST")

_YIELD_VALUE = dis.opmap["YIELD_VALUE"]

_INSTRUCTIONS: Dict[CodeType, Dict[int, Tuple[str, Tuple[str, ...]]]] = {}


def _names(code: CodeType) -> Dict[int, Tuple[str, Tuple[str, ...]]]:
    """``offset -> (what, names)`` for the instructions of ``code`` that read or bind names."""
    found = _INSTRUCTIONS.get(code)
    if found is None:
        found = {}
        for ins in dis.get_instructions(code):
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if ins.opname in _READS:
                found[ins.offset] = ("read", names)
            elif ins.opname in _BINDS or ins.opname in _STORE_PAIRS:
                found[ins.offset] = ("bind", names)
        _INSTRUCTIONS[code] = found
    return found


_LINES: Dict[CodeType, Dict[int, Set[str]]] = {}


def line_names(frame: FrameType) -> Set[str]:
    """The names that the instructions of ``frame``'s current line read or bind (the names the
    line writes through, among others)."""
    code = frame.f_code
    lines = _LINES.get(code)
    if lines is None:
        lines = _LINES[code] = {}
        for ins in dis.get_instructions(code):
            if ins.opname in _READS or ins.opname in _BINDS or ins.opname in _STORE_PAIRS:
                names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
                line = ins.positions.lineno if ins.positions is not None else None
                if line is not None:
                    lines.setdefault(line, set()).update(str(n) for n in names)
    return lines.get(frame.f_lineno, set())


_Where = Tuple[int, int, int, int]  # (line, column, end line, end column)
_Row = Tuple[int, Optional[_Where], str, Tuple[str, ...]]  # offset, where, opname, names
_ROWS: Dict[CodeType, Tuple[Tuple[int, ...], Tuple[_Row, ...]]] = {}
_WITHIN: Dict[Tuple[CodeType, int], Set[str]] = {}


def _table(code: CodeType) -> Tuple[Tuple[int, ...], Tuple[_Row, ...]]:
    """``code``'s instructions' offsets, and each as ``(offset, where, opname, names)``."""
    found = _ROWS.get(code)
    if found is None:
        rows = []
        for ins in dis.get_instructions(code):
            p = ins.positions
            where = None
            if p is not None and p.lineno is not None:
                where = (p.lineno, p.col_offset or 0, p.end_lineno or p.lineno, p.end_col_offset or 0)
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            rows.append((ins.offset, where, ins.opname, tuple(str(n) for n in names)))
        found = _ROWS[code] = (tuple(r[0] for r in rows), tuple(rows))
    return found


def _inside(inner: Optional[_Where], outer: _Where) -> bool:
    return inner is not None and outer[:2] <= inner[:2] and inner[2:] <= outer[2:]


def _read_within(code: CodeType, index: int) -> Set[str]:
    """The names read by the instructions up to ``index`` that lie in the source span of the
    instruction at ``index`` (the expression it evaluates)."""
    found = _WITHIN.get((code, index))
    if found is None:
        found = set()
        _, rows = _table(code)
        outer = rows[index][1]
        if outer is not None:
            for _, where, opname, names in rows[: index + 1]:
                if opname in _READS and _inside(where, outer):
                    found.update(names)
        _WITHIN[(code, index)] = found
    return found


def call_names(frame: FrameType) -> Set[str]:
    """The names read by the expression ``frame`` is evaluating now (a call, for a frame that
    called another: the callee and its arguments, the names it lent)."""
    offsets, _ = _table(frame.f_code)
    # the instruction that holds f_lasti (on 3.11 a frame that called another points at the
    # call's last inline cache entry, past the CALL instruction itself)
    at = bisect.bisect_right(offsets, frame.f_lasti) - 1
    return set() if at < 0 else _read_within(frame.f_code, at)


_TAKEN: Dict[Tuple[CodeType, str], Set[str]] = {}
_BETWEEN = ("UNPACK_SEQUENCE", "UNPACK_EX", "COPY", "SWAP", "DUP_TOP", "FOR_ITER", "GET_ITER") + _BINDS + _STORE_PAIRS


def taken_from(code: CodeType, name: str) -> Set[str]:
    """The names that ``name`` is bound from anywhere in ``code`` (``t = ts[i]``, ``for t in
    ts``, ``for i, t in enumerate(ts)``, ``h = x``): the names its value may be a reborrow of."""
    found = _TAKEN.get((code, name))
    if found is None:
        found = set()
        _, rows = _table(code)
        for i, (_, _, opname, names) in enumerate(rows):
            if (opname in _BINDS or opname in _STORE_PAIRS) and name in names and not opname.startswith("DELETE"):
                j = i - 1
                while j >= 0 and rows[j][2] in _BETWEEN:  # the other targets, the loop's iteration
                    j -= 1
                if j >= 0:
                    found |= _read_within(code, j)
        found.discard(name)
        _TAKEN[(code, name)] = found
    return found


_MUTATORS = frozenset(
    {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "sort", "reverse"}
)


def mutation_site(code: CodeType, name: str) -> Tuple[int, str]:
    """The first line of ``code`` that mutates the list or dict ``name`` (or an element taken
    from it: ``for t in targets: t["boxes"] = ...``), and how (``__setitem__``, ``append``);
    ``code``'s first line and ``"mutated"`` if none is found (the mutation is in a callee)."""
    names = {name} | {n for n in code.co_varnames if name in taken_from(code, n)}
    _, rows = _table(code)
    for i, (_, where, opname, argnames) in enumerate(rows):
        if where is None:
            continue
        if opname in ("STORE_SUBSCR", "DELETE_SUBSCR") and _read_within(code, i) & names:
            return where[0], "__setitem__" if opname == "STORE_SUBSCR" else "__delitem__"
        if opname in ("LOAD_METHOD", "LOAD_ATTR") and argnames[0] in _MUTATORS and i > 0:
            before = rows[i - 1]
            if before[2] in _READS and before[3][0] in names:
                return where[0], argnames[0]
    return code.co_firstlineno, "mutated"


def swap_line(code: CodeType) -> int:
    """The last line of ``code`` that swaps a tensor's memory (``t.data = ...``, ``t.set_(...)``:
    the swap back, after the ops that used the swapped data); its first line if none."""
    _, rows = _table(code)
    found = [
        where[0]
        for _, where, opname, names in rows
        if where is not None
        and (
            (opname == "STORE_ATTR" and names[0] == "data")
            or (opname in ("LOAD_METHOD", "LOAD_ATTR") and names[0] == "set_")
        )
    ]
    return found[-1] if found else code.co_firstlineno


def holders(frame: FrameType, overlaps: Callable[[Any], bool]) -> Iterator[str]:
    """The names in ``frame`` whose value (or an element of a tuple, list or dict bound to it)
    ``overlaps`` is true of."""
    for name, value in list(frame.f_locals.items()):
        if overlaps(value):
            yield name
        elif isinstance(value, (tuple, list)) and any(overlaps(v) for v in value[:1024]):
            yield name
        elif isinstance(value, dict) and any(overlaps(v) for v in list(value.values())[:1024]):
            yield name


def function_holding(
    frame: Optional[FrameType], stop: Optional[FrameType], overlaps: Callable[[Any], bool]
) -> Optional[str]:
    """The ``torch.autograd.Function`` whose ``forward`` is running below ``stop`` and was given a
    tensor ``overlaps`` is true of (its ``ctx`` keeps its inputs for backward: a checkpoint
    recomputes from them), as ``CheckpointFunction``; None if none."""
    while frame is not None and frame is not stop:
        if frame.f_code.co_name == "forward" and "ctx" in frame.f_code.co_varnames[:1]:
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.FunctionCtx) and any(holders(frame, overlaps)):
                return type(ctx).__name__.removesuffix("Backward")
        frame = frame.f_back
    return None


_CLOSURES: Dict[Tuple[CodeType, str], Tuple[CodeType, ...]] = {}


def closures(code: CodeType, name: str) -> Tuple[CodeType, ...]:
    """The code objects nested in ``code`` that read its cell ``name`` as a free variable: a list
    comprehension's or generator expression's (their own frames on 3.11), a lambda's, a nested
    function's."""
    found = _CLOSURES.get((code, name))
    if found is None:
        out = []
        stack = [c for c in code.co_consts if isinstance(c, CodeType)]
        while stack:
            inner = stack.pop()
            if name in inner.co_freevars:
                out.append(inner)
                stack += [c for c in inner.co_consts if isinstance(c, CodeType)]
        found = _CLOSURES[(code, name)] = tuple(out)
    return found


class EarlierTracers:
    """3.11: the local trace functions that other tracers (a debugger's, coverage's, the audit's
    other one) had on the frames an audit tracer now follows, each given every event first, as
    CPython gives it: what it returns replaces it, and None keeps it (only the ``call`` event's
    None means "do not trace"). While one runs, a call back into the audit tracer for the same frame
    (the audit's other tracer, which took this one as its earlier) is ``passing``: answered
    without handing the event on again."""

    def __init__(self) -> None:
        self._theirs: Dict[FrameType, Any] = {}
        self._passing: Set[FrameType] = set()

    def keep(self, frame: FrameType, theirs: Any) -> None:
        if theirs is not None:
            self._theirs[frame] = theirs

    def __contains__(self, frame: FrameType) -> bool:
        return frame in self._theirs

    def passing(self, frame: FrameType) -> bool:
        return frame in self._passing

    def give(self, frame: FrameType, event: str, arg: Any) -> None:
        theirs = self._theirs.get(frame)
        if theirs is None:
            return
        self._passing.add(frame)
        try:
            again = theirs(frame, event, arg)
        finally:
            self._passing.discard(frame)
        if again is not None and frame in self._theirs:
            self._theirs[frame] = again

    def release(self, frame: FrameType) -> Any:
        """The frame's tracer from now on (None: it had none), no longer kept here."""
        return self._theirs.pop(frame, None)

    def frames(self) -> list:
        return list(self._theirs)


class MoveTracer:
    """Watches the frames that hold moved names and calls ``on_read(frame, name, info)`` the
    first time each is read. On CPython 3.12+ it asks ``sys.monitoring`` for the instructions of
    those frames' code (3.12's ``settrace`` gives no opcode events to a frame already running);
    on 3.11, ``sys.settrace`` with ``f_trace_opcodes``. A frame is watched only while it holds a
    name not yet read, bound again or deleted, and until it returns: once no frame is, nothing is
    traced (on 3.11 a trace function slows every Python frame, not only the watched ones). A
    moved name that is a cell (read by a comprehension, a generator expression or a lambda) is
    also watched in the frames of those inner code objects that the watched frame calls.
    ``stop()`` undoes it all."""

    def __init__(self, on_read: Callable[[FrameType, str, Any], None]) -> None:
        self._on_read = on_read
        self._moved: Dict[FrameType, Dict[str, Any]] = {}
        self._codes: Dict[CodeType, int] = {}  # 3.12+: code -> how many watched frames run it
        self._inner: Dict[CodeType, int] = {}  # inner code -> how many watched frames' cells it reads
        self._inner_of: Dict[FrameType, Set[CodeType]] = {}
        self._previous: Any = None
        # 3.11: the local trace function another tracer (coverage's, a debugger's, the export
        # watch's) had on a frame the audit traces: it still gets every event but the opcodes, and
        # has the frame back after
        self._theirs = EarlierTracers()
        self._tool: Optional[int] = None
        self._started = False  # 3.12+: the tool id is ours
        self._tracing = False  # 3.11: sys.settrace is ours

    def watch(self, frame: FrameType, name: str, info: Any, now: bool = True) -> Any:
        """Watches ``name`` in ``frame``; returns the info it is watched with (an earlier one if
        it already was). ``now=False``, for a frame that cannot run before :meth:`arm` (it waits
        for a module call to return): on 3.11 the trace function is installed only then, so
        that the code up to there (the rest of the module call) runs untraced."""
        names = self._moved.get(frame)
        if names is None:
            names = self._moved[frame] = {}
            self._follow(frame, now)
        if name in frame.f_code.co_cellvars and name not in names:
            mine = self._inner_of.setdefault(frame, set())
            for code in closures(frame.f_code, name):
                if code not in mine:
                    mine.add(code)
                    self._inner[code] = self._inner.get(code, 0) + 1
                    self._use(code)
        return names.setdefault(name, info)

    def arm(self) -> None:
        """Traces the frames watched with ``now=False`` (3.11: installs the trace function)."""
        if self._moved and not self._tracing and _MONITORING is None:
            self._tracing = True
            self._previous = sys.gettrace()
            sys.settrace(self._call)

    def _use(self, code: CodeType) -> None:
        """3.12+: ``code``'s instructions are reported (counted: several frames may need them)."""
        if _MONITORING is None:
            return
        if not self._started:
            self._start()
        count = self._codes.get(code, 0)
        self._codes[code] = count + 1
        if count == 0 and self._tool is not None:
            events = _MONITORING.events.INSTRUCTION | _MONITORING.events.PY_RETURN
            _MONITORING.set_local_events(self._tool, code, events)

    def _unuse(self, code: CodeType) -> None:
        if _MONITORING is None:
            return
        count = self._codes.pop(code, 1) - 1
        if count > 0:
            self._codes[code] = count
        elif self._tool is not None:
            _MONITORING.set_local_events(self._tool, code, 0)

    def _follow(self, frame: FrameType, now: bool) -> None:
        if _MONITORING is not None:
            self._use(frame.f_code)
            return
        theirs = frame.f_trace
        if theirs != self._opcode:
            self._theirs.keep(frame, theirs)
        frame.f_trace = self._opcode
        frame.f_trace_lines = frame in self._theirs  # line events only for the tracer that wants them
        frame.f_trace_opcodes = True
        if now:
            self.arm()

    def _unfollow(self, frame: FrameType) -> None:
        """``frame`` holds no moved name any more (or returned): no longer traced."""
        if self._moved.pop(frame, None) is None:
            return
        for code in self._inner_of.pop(frame, ()):
            count = self._inner.pop(code, 1) - 1
            if count > 0:
                self._inner[code] = count
            self._unuse(code)
        if _MONITORING is not None:
            self._unuse(frame.f_code)
            return
        frame.f_trace = self._release(frame)
        if not self._moved:
            self._untrace()

    def _release(self, frame: FrameType) -> Any:
        """3.11: ``frame`` is no longer traced by the audit; returns its tracer from now on (the
        one it had before the audit's, or None)."""
        frame.f_trace_opcodes = False
        frame.f_trace_lines = True
        return self._theirs.release(frame)

    def _untrace(self) -> None:
        if self._tracing:
            self._tracing = False
            sys.settrace(self._previous)
            self._previous = None

    def _start(self) -> None:
        self._started = True
        free = [t for t in (3, 4) if _MONITORING.get_tool(t) is None]
        if free:  # none free: another tool holds both ids, and reads go unseen (E0596 still found)
            self._tool = free[0]
            _MONITORING.use_tool_id(self._tool, "plusequals.auditing")
            _MONITORING.register_callback(self._tool, _MONITORING.events.INSTRUCTION, self._instruction)
            _MONITORING.register_callback(self._tool, _MONITORING.events.PY_RETURN, self._returned)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        # new frames are not traced by the audit but those of an inner code object that reads a
        # watched cell; a tracer that was there before still is, in those too
        theirs = self._previous(frame, event, arg) if self._previous is not None else None
        if frame.f_code in self._inner:
            self._theirs.keep(frame, theirs)
            frame.f_trace_lines = theirs is not None
            frame.f_trace_opcodes = True
            return self._opcode
        return theirs

    def _opcode(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self._theirs.passing(frame):  # called back by the tracer this one is giving the event to
            return self._opcode
        if event == "opcode":
            self._seen(frame, frame.f_lasti)
        else:
            self._theirs.give(frame, event, arg)
            if event == "return" and frame.f_code.co_code[frame.f_lasti] != _YIELD_VALUE:  # 3.11: a yield too
                self._unfollow(frame)
                if frame.f_code in self._inner:  # an inner frame that returned: not watched any more
                    return self._release(frame)
        if frame in self._moved or frame.f_code in self._inner:
            return self._opcode
        # no longer traced by the audit: _unfollow gave the frame its tracer back, or (an inner
        # frame whose code is not watched any more) it gets it now
        return frame.f_trace if frame.f_trace != self._opcode else self._release(frame)

    def _instruction(self, code: CodeType, offset: int) -> Any:
        self._seen(sys._getframe(1), offset)

    def _returned(self, code: CodeType, offset: int, value: Any) -> Any:
        self._unfollow(sys._getframe(1))

    def _seen(self, frame: FrameType, offset: int) -> None:
        moved = self._moved.get(frame)
        if moved is None and frame.f_code in self._inner:
            self._seen_inner(frame, offset)
        if not moved:
            return
        what, names = _names(frame.f_code).get(offset, ("", ()))
        self._consume(frame, what, names, moved, frame)

    def _seen_inner(self, frame: FrameType, offset: int) -> None:
        """An instruction of a comprehension, generator expression or lambda: a read of a free
        variable that is a moved cell of a watched frame that called it."""
        what, names = _names(frame.f_code).get(offset, ("", ()))
        free = [n for n in names if n in frame.f_code.co_freevars]
        if not free:
            return
        outer, depth = frame.f_back, 0
        while outer is not None and depth < 64:
            moved = self._moved.get(outer)
            if moved and frame.f_code in self._inner_of.get(outer, ()) and any(n in moved for n in free):
                break
            outer, depth = outer.f_back, depth + 1
        else:
            return
        if outer is None:
            return
        self._consume(frame, what, free, moved, outer)

    def _consume(self, frame: FrameType, what: str, names, moved: dict, owner: FrameType) -> None:
        """``names`` used at ``frame``'s instruction (``what``: "read" or else): each moved one is
        done with, and a read of it reported; ``owner`` (the frame whose moves they are) is
        no longer followed once none is left."""
        for name in names:
            info = moved.pop(name, None)
            if info is not None and what == "read":
                self._on_read(frame, name, info)
        if not moved:
            self._unfollow(owner)

    def stop(self) -> None:
        for frame in list(self._moved):
            self._unfollow(frame)
        for frame in self._theirs.frames():  # inner frames still running: their tracer back
            frame.f_trace = self._release(frame)
        self._untrace()
        if self._started:
            if self._tool is not None:
                for code in self._codes:
                    _MONITORING.set_local_events(self._tool, code, 0)
                _MONITORING.register_callback(self._tool, _MONITORING.events.INSTRUCTION, None)
                _MONITORING.register_callback(self._tool, _MONITORING.events.PY_RETURN, None)
                _MONITORING.free_tool_id(self._tool)
            self._tool = None
            self._started = False
        self._moved.clear()
        self._codes.clear()
        self._inner.clear()
        self._inner_of.clear()
