"""What the PyTorch forward *ran*, recorded at check time: :class:`Recorder` and :class:`Ran`.

The reading (:mod:`plusequals.twin.forward_code`) derives the watch from the forward's code, to a bound
(three calls deep, within torch and the block's packages) and without following data (a function
taken from a dict: ``STRATEGIES[residual]``). At check time, the probe runs the PyTorch block
once anyway: under a recorder (``sys.monitoring`` on 3.12+, ``sys.setprofile`` on 3.11, or
``sys.settrace`` there while a profiler written in C holds the profile function), that run
also says which Python code it executed, in which globals. :meth:`Ran.reads` turns it into more of
the watch, from the values there now:

* every global, builtin and module attribute each executed code object names, in the globals it
  ran with (a global read four calls deep, in a helper of any package), and each entry of a
  global dict it reads by a constant key (``CONFIG["scale"]``);
* the function that holds each executed code object, wherever it is found (a module global, a
  class attribute, an entry of a dict or an item of a list or tuple that is a global): watched in
  place like the reading's (code, defaults, cells), and each dict entry that holds it by identity
  (``STRATEGIES["op_plus_x"]`` replaced is a change, as is the global ``op_plus_x``: which one the
  call took is not recorded, so either is).

A code object no function was found for (a generator expression, a lambda made by each call) is
nested in an executed code object, whose function is watched. A leaf (imports nothing of the
package but :mod:`plusequals.twin.forward_code`).
"""

from __future__ import annotations

import dis
import functools
import gc
import sys
import types
from itertools import compress, repeat
from operator import itemgetter
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from .forward_code import (
    HOLDS_FUNCTION,
    INERT,
    Note,
    Reads,
    _class_label,
    _codes,
    _function,
    _module_read,
    _mutable,
    class_dict,
    function_state,
)

__all__ = ["Ran", "Recorder"]


class Ran:
    """The code objects one run executed, each once, with the globals and builtins it ran in, and
    where each one's function was found: (container, key, label) for each place, the container a
    dict (found there by key) or None (a list or tuple item, kept as the key)."""

    def __init__(
        self,
        frames: List[Tuple[types.CodeType, dict, dict]],
        known: Set[int] = frozenset(),
        receivers: Optional[Dict[int, type]] = None,
    ) -> None:
        self.frames = frames
        self.ops: Any = None  # the ATen ops of the run, once the probe proved it (twin/probe.py's Trace)
        self.places: Dict[int, List[Tuple[Any, Any, str]]] = {}
        # the class of each code's first argument (a method's self), where Python code can change it
        self.receivers: Dict[int, type] = dict(receivers or {})
        nested = {id(c) for code, _, _ in frames for c in list(_codes(code))[1:]}
        looked = [(code, g) for code, g, _ in frames if id(code) not in known and id(code) not in nested]
        found = _find(looked)
        for code, _ in looked:
            places = found.get(id(code), []) + _in_classes(code, self.receivers.get(id(code)))
            if places:
                self.places[id(code)] = places

    def reads(self, watched: Iterable[types.FunctionType] = ()) -> Reads:
        """The notes, sized dicts and functions of what ran, from the values there now; the
        functions in ``watched`` (the reading's) are not noted again."""
        notes: List[Note] = []
        sized: Dict[int, dict] = {}
        functions: List[types.FunctionType] = []
        seen_notes: Set[Tuple[int, Any]] = set()
        seen_functions = {id(f) for f in watched}

        def note(n: Note) -> None:
            if (id(n.d), n.key) not in seen_notes:
                seen_notes.add((id(n.d), n.key))
                notes.append(n)

        for n in _cells_read(self.frames, watched, sized):
            note(n)
        for n in _receivers_read(self.receivers.values(), sized):
            note(n)
        for code, g, builtins in self.frames:
            for n in _names_read(code, g, builtins, sized):
                note(n)
            for container, key, label in self.places.get(id(code), ()):
                if isinstance(container, dict):
                    sized.setdefault(id(container), container)
                    if key not in container:
                        continue  # gone: the dict is sized
                    value = container[key]
                    note(Note(container, key, value, label))
                else:
                    value = key
                f = _function(value)
                if f is not None and id(f) not in seen_functions:
                    seen_functions.add(id(f))
                    functions.append(f)
                    notes += [Note(None, k, v, f"{label}.{k}") for k, v in function_state(f)]
                    for n in _cells_read(self.frames, [f], sized):
                        note(n)
        return Reads(notes, list(sized.values()), functions)


def _cells_read(
    frames: List[Tuple[types.CodeType, dict, dict]], functions: Iterable[types.FunctionType], sized: Dict[int, dict]
) -> Iterator[Note]:
    """The attributes that each of ``functions`` whose code ran reads from a module held in one of
    its closure cells (``ns.act`` where ``ns`` is a free variable, not a global): the cell is watched
    by identity, the module's attributes named in the code here. Its dict is sized."""
    ran = {id(code) for code, _, _ in frames}
    for f in functions:
        if id(f.__code__) not in ran or not f.__closure__:
            continue
        names = set(f.__code__.co_names)
        for nested in list(_codes(f.__code__))[1:]:
            names |= set(nested.co_names)
        for cell in f.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, types.ModuleType):
                yield from _module_read(value, names, sized)


def _names_read(code: types.CodeType, g: dict, builtins: dict, sized: Dict[int, dict]) -> List[Note]:
    """The globals and builtins ``code`` names, as it ran with ``g`` and ``builtins`` (a module's
    attributes named there too), and each entry of a global dict it reads by a constant key; the
    dicts consulted are added to ``sized`` (not those read by key)."""
    sized.setdefault(id(g), g)
    where = g.get("__name__", "?")
    out: List[Note] = []
    for name in sorted(set(code.co_names)):
        if name in g:
            value = g[name]
            out.append(Note(g, name, value, f"{where}.{name}"))
            if isinstance(value, types.ModuleType):
                out += _module_read(value, set(code.co_names), sized)
        elif name in builtins and not name.startswith("__"):
            sized.setdefault(id(builtins), builtins)
            out.append(Note(builtins, name, builtins[name], f"builtins.{name}"))
    for name, key in _constant_subscripts(code):
        d = g.get(name)
        if type(d) is dict and key in d:  # the entry by identity; the dict is not sized
            out.append(Note(d, key, d[key], f"{where}.{name}[{key!r}]"))
    return out


@functools.lru_cache(maxsize=4096)
def _constant_subscripts(code: types.CodeType) -> Tuple[Tuple[str, Any], ...]:
    """(global, key) for each ``GLOBAL[constant]`` that ``code`` reads: a global loaded, a
    constant (a str, int or tuple of them) loaded, then subscripted (``BINARY_SUBSCR``; 3.14's
    ``BINARY_OP []``)."""
    ins = list(dis.get_instructions(code))
    found = []
    for load, const, subscript in zip(ins, ins[1:], ins[2:]):
        reads = subscript.opname == "BINARY_SUBSCR" or (subscript.opname == "BINARY_OP" and subscript.argrepr == "[]")
        if load.opname == "LOAD_GLOBAL" and const.opname == "LOAD_CONST" and reads and _constant_key(const.argval):
            found.append((load.argval, const.argval))
    return tuple(found)


def _constant_key(key: Any) -> bool:
    return isinstance(key, (str, int)) or (isinstance(key, tuple) and all(_constant_key(k) for k in key))


def _find(looked: List[Tuple[types.CodeType, dict]]) -> Dict[int, List[Tuple[Any, Any, str]]]:
    """For each code of ``looked`` (by id), every place of the globals it ran with where a function
    running it sits: a global, a class attribute (of a class that is a global), an entry of a dict
    or an item of a list or tuple that is a global. Each globals dict is read once, for all the
    codes that ran in it (a module's large dicts, read once per code, were most of a check's time)."""
    by_globals: Dict[int, Tuple[dict, Set[int]]] = {}
    for code, g in looked:
        by_globals.setdefault(id(g), (g, set()))[1].add(id(code))
    found: Dict[int, List[Tuple[Any, Any, str]]] = {}
    for g, codes in by_globals.values():
        where = g.get("__name__", "?")
        for name, value in list(g.items()):
            for code, place in _held(g, where, name, value, codes):
                found.setdefault(code, []).append(place)
    return found


def _held(g: dict, where: str, name: str, value: Any, codes: Set[int]) -> Iterator[Tuple[int, Tuple[Any, Any, str]]]:
    """(code, place) for each function running one of ``codes`` that the global ``name`` is or
    holds: the global itself, a class's attribute, a dict's entry, a list's or tuple's item. A
    place is made for a match alone: a module's dicts are large."""
    code = _code_of(value)
    if code is not None:
        if code in codes:
            yield code, (g, name, f"{where}.{name}")
    elif isinstance(value, type):
        for key, attr in _may_hold(list(vars(value).items())):
            if (code := _code_of(attr)) in codes:
                yield code, (class_dict(value), key, f"{where}.{name}.{key}")
    elif isinstance(value, dict):
        for key, item in _may_hold(list(value.items())):
            if (code := _code_of(item)) in codes:
                yield code, (value, key, f"{where}.{name}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for _, item in _may_hold(list(enumerate(value))):
            if (code := _code_of(item)) in codes:
                yield code, (None, item, f"{where}.{name}[...]")


def _may_hold(entries: List[Tuple[Any, Any]]) -> Iterator[Tuple[Any, Any]]:
    """The (key, value) entries whose value a function can be behind (:func:`_function`), picked
    out in C: inspect's caches, globals of a module a diffusers forward runs, hold an entry for
    every module loaded, and read in Python they were most of the search."""
    return compress(entries, map(isinstance, map(itemgetter(1), entries), repeat(HOLDS_FUNCTION)))


def _mro(cls: Optional[type]) -> List[type]:
    """The classes of ``cls``'s MRO that Python code can change (none for None)."""
    return [c for c in cls.__mro__ if _mutable(c)] if cls is not None else []


def _in_classes(code: types.CodeType, cls: Optional[type]) -> List[Tuple[Any, Any, str]]:
    """Where a function running ``code`` sits in the dicts of ``cls``'s MRO (the class of the
    first argument it ran with: a method of an object the forward calls, such as a callable set
    as ``F.gelu`` whose class is no global)."""
    return [
        (class_dict(c), key, f"{_class_label(c)}.{key}")
        for c in _mro(cls)
        for key, attr in list(class_dict(c).items())
        if _runs(attr, code)
    ]


def _receivers_read(classes: Iterable[type], sized: Dict[int, dict]) -> Iterator[Note]:
    """Every entry of every class in the MROs of ``classes`` (those of the objects whose methods
    ran), as the reading notes the block's own classes: a name added to one (its dict is sized) or
    set again is a change."""
    seen: Set[int] = set()
    for cls in {id(c): c for c in classes}.values():
        for c in _mro(cls):
            if id(c) in seen:
                continue
            seen.add(id(c))
            d = class_dict(c)
            sized.setdefault(id(d), d)
            yield from (Note(d, k, v, f"{_class_label(c)}.{k}") for k, v in list(d.items()) if k not in INERT)


def _code_of(value: Any) -> Optional[int]:
    """The id of the code a function behind ``value`` runs (:func:`_function`), or None."""
    f = _function(value)
    return id(f.__code__) if f is not None else None


def _runs(value: Any, code: types.CodeType) -> bool:
    return _code_of(value) == id(code)


class Recorder:
    """Records the Python code calls run (:meth:`call`), as one :class:`Ran` (:attr:`ran`;
    None where nothing could be recorded: another tool holds every ``sys.monitoring`` id, or on
    3.11 a C profiler the profile function and a tracer the trace function). The
    functions of ``known`` (the reading's, watched already) are not looked for.

    ``proven``: the last run the probe proved equal; its ATen ops (:attr:`proven`, a
    :class:`plusequals.twin.probe.Trace`) are what the probe compares this run's with, and it
    sets this run's (:attr:`ops`) once it agrees."""

    def __init__(self, known: Iterable[types.FunctionType] = (), proven: Optional[Ran] = None) -> None:
        self._ran: Optional[Ran] = None
        self._recorded = False
        self.known = {id(f.__code__) for f in known}
        self.proven = proven.ops if proven is not None else None
        self._ops: Any = None
        self._frames: List[Tuple[types.CodeType, dict, dict]] = []
        self._receivers: Dict[int, type] = {}
        self._seen: Set[int] = set()
        self.same_as_twin = False  # whether the block ran the Rust block's ATen ops (set by the probe)

    @property
    def ops(self) -> Any:
        """The ATen ops of the recorded run, once the probe proved it (kept on :attr:`ran` too)."""
        return self._ops

    @ops.setter
    def ops(self, trace: Any) -> None:
        self._ops = trace
        if self._ran is not None:
            self._ran.ops = trace

    def call(self, f, *args: Any, **kwargs: Any) -> Any:
        """``f(*args, **kwargs)``, recorded: only the frames it starts (none of this module's), with
        the cyclic garbage collector off, whose callbacks and finalizers are no part of the forward
        (hypothesis' ``gc.callbacks`` write their module's globals on every collection). Each call
        adds to :attr:`ran`: the probe records every input's run (a helper called only on some
        token counts is watched once one of them ran it)."""
        frames, seen, receivers = self._frames, self._seen, self._receivers

        def started(frame: types.FrameType) -> None:
            code = frame.f_code
            if id(code) not in seen and frame.f_globals is not _HERE:  # not the recorder's own stop
                seen.add(id(code))
                frames.append((code, frame.f_globals, frame.f_builtins))
                cls = _receiver(frame)
                if cls is not None:
                    receivers[id(code)] = cls

        stop = _start(started)
        if stop is None:
            return f(*args, **kwargs)
        collecting = gc.isenabled()
        gc.disable()
        try:
            out = f(*args, **kwargs)
        finally:
            stop()
            if collecting:
                gc.enable()
        self._recorded = True
        return out

    @property
    def ran(self) -> Optional[Ran]:
        """What the calls so far ran (None: nothing was recorded), built once per new frame."""
        if self._recorded and (self._ran is None or len(self._ran.frames) != len(self._frames)):
            self._ran = Ran(list(self._frames), self.known, self._receivers)
            self._ran.ops = self._ops
        return self._ran


_HERE = globals()


def _receiver(frame: types.FrameType) -> Optional[type]:
    """The class of the first argument a frame started with (a method's ``self``), where Python
    code can change it and it is no module; else None. Read as the frame starts, before its code
    ran (3.11's profiler has made its locals already)."""
    code = frame.f_code
    if not code.co_argcount:
        return None
    cls = type(frame.f_locals.get(code.co_varnames[0]))
    return cls if _mutable(cls) and not issubclass(cls, types.ModuleType) else None


def _profile(started) -> Optional[Callable[[], None]]:
    """3.11: ``sys.setprofile`` for this thread, chained to a Python profiler already set; returns
    the function that puts the previous one back. Where a profiler written in C is set
    (cProfile's: ``sys.getprofile()`` gives its object, which Python cannot call), it is left
    alone, profiling, and the trace function records instead (:func:`_trace`)."""
    previous = sys.getprofile()
    if previous is not None and not callable(previous):
        return _trace(started)

    def profile(frame, event, arg):
        if event == "call":
            started(frame)
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(profile)
    return lambda: sys.setprofile(previous)


def _trace(started) -> Optional[Callable[[], None]]:
    """3.11 under a C profiler: ``sys.settrace`` for this thread, its ``call`` events only (no
    local trace function: no line events); returns the function that takes it off. None where a
    trace function is set already (a debugger's, coverage's): it is left alone, and nothing is
    recorded."""
    if sys.gettrace() is not None:
        return None

    def trace(frame, event, arg):
        if event == "call":
            started(frame)
        return None

    sys.settrace(trace)
    return lambda: sys.settrace(None)


def _start(started, monitoring: Any = None) -> Optional[Callable[[], None]]:
    """Starts calling ``started(frame)`` for each Python frame that starts, and returns the function
    that stops it (None: nothing could be started). ``sys.monitoring`` where the interpreter has it
    (3.12+: ``monitoring``, the module, or a stand-in), else ``sys.setprofile`` (3.11)."""
    mon = getattr(sys, "monitoring", None) if monitoring is None else monitoring
    return _monitor(started, mon) if mon is not None else _profile(started)


def _monitor(started, mon: Any) -> Optional[Callable[[], None]]:
    """3.12+: ``PY_START`` events of ``sys.monitoring`` (``mon``) under a free tool id (None: none
    is free); returns the function that frees it. The events are the interpreter's, every thread's:
    a frame another thread starts meanwhile is recorded too (watched: at worst a check too many)."""
    tool = next((t for t in range(6) if mon.get_tool(t) is None), None)
    if tool is None:
        return None
    mon.use_tool_id(tool, "plusequals.record")
    mon.register_callback(tool, mon.events.PY_START, lambda code, offset: started(sys._getframe(1)))
    mon.set_events(tool, mon.events.PY_START)

    def stop() -> None:
        mon.set_events(tool, 0)
        mon.register_callback(tool, mon.events.PY_START, None)
        mon.free_tool_id(tool)

    return stop
