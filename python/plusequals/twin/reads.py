"""What a PyTorch forward's code reads, derived from the code itself: :func:`code_reads`.

A module's forward is Python code. What it computes depends on its instance state (read by
:mod:`plusequals.twin.faithful`), and on the *code* it runs: the methods of its class and of every
class in that class's MRO (``nn.LayerNorm.forward``, diffusers' ``GEGLU.forward``, a processor's
``__call__``, ``nn.Module.__call__``), and the module globals that code reads (``F`` and then
``F.layer_norm``, ``torch.baddbmm``, ``scaled_dot_product_attention``), transitively: a function
found there is code the forward runs too.

Every such read is a *note*: a dict (a class's own ``__dict__``, a module's globals), a key, the
value found, and a label (``nn.LayerNorm.forward``, ``torch.nn.functional.gelu``). The watch
(:mod:`plusequals.twin.watch`) compares each note by identity on every call: on CPython 3.11 to
3.13 that is one version tag per dict (PEP 509), whatever the dict's size. Nothing here is a list
of names: the classes are those of the objects the forward calls, and the names those in the code
objects' ``co_names``. A leaf (imports nothing of the package).
"""

from __future__ import annotations

import gc
import types
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Set

__all__ = ["INERT", "Note", "class_dict", "classes_of", "code_changes", "code_reads", "data_descriptor"]

_IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a static or immutable type, which no one can patch
#: How far from the forward the code is followed, and how many functions at most (a bound on the
#: reading's cost; the functions nearest the forward come first).
DEPTH = 3
MAX_FUNCTIONS = 400
#: A class's entries that no forward runs or reads: its docstring, and ``abc``'s bookkeeping
#: (``_abc_impl``, whose registry and caches only ``isinstance``/``issubclass`` consult, and the
#: abstract methods, which only instantiation checks), which ``abc`` may set again at any time.
INERT = frozenset(
    {
        "__doc__",
        "__abstractmethods__",
        "_abc_impl",
        "_abc_registry",
        "_abc_cache",
        "_abc_negative_cache",
        "_abc_negative_cache_version",
    }
)


class Note(NamedTuple):
    """One read: ``d[key]`` was ``value``; ``label`` names it in a refusal."""

    d: dict
    key: str
    value: Any
    label: str


def class_dict(cls: type) -> dict:
    """``cls``'s own attribute dict (the one ``cls.__dict__``'s mappingproxy wraps): setting or
    deleting a class attribute changes it, and so its version tag."""
    (d,) = [r for r in gc.get_referents(cls.__dict__) if isinstance(r, dict)]
    return d


def _mutable(cls: type) -> bool:
    return not cls.__flags__ & _IMMUTABLE


def classes_of(objs: Iterable[Any]) -> List[type]:
    """Every class in the MROs of ``objs``' classes that Python code can change (not ``object`` or
    any other immutable type), each once, in first-seen order."""
    seen: Set[int] = set()
    out: List[type] = []
    for obj in objs:
        for cls in type(obj).__mro__:
            if id(cls) not in seen and _mutable(cls):
                seen.add(id(cls))
                out.append(cls)
    return out


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _function(value: Any) -> Any:
    """The Python function behind ``value`` (a method, staticmethod, classmethod, property's
    getter), or None."""
    if isinstance(value, (staticmethod, classmethod, types.MethodType)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    return value if isinstance(value, types.FunctionType) else None


def _class_label(cls: type) -> str:
    module = cls.__module__
    if module.startswith("torch.nn.modules."):
        module = "nn"
    return f"{module}.{cls.__qualname__}"


def code_reads(objs: Iterable[Any], entries: Iterable[str] = ("forward", "__call__")) -> List[Note]:
    """The notes of what calling ``objs`` (modules, processors) reads as code: every entry of
    every mutable class in their MROs, and the module globals (and attributes of modules found
    there) named in the code of their ``entries`` methods, and of the functions found so, to
    :data:`DEPTH` calls deep."""
    objs = list(objs)
    classes = classes_of(objs)
    notes = [
        Note(class_dict(c), k, v, f"{_class_label(c)}.{k}")
        for c in classes
        for k, v in class_dict(c).items()
        if k not in INERT
    ]
    methods = [class_dict(c) for c in classes]
    queue = [(f, 0) for c in {type(o) for o in objs} for f in map(lambda e: _lookup(c, e), entries) if f]
    roots = {"torch"} | {_root(c.__module__) for c in classes}
    seen: Set[int] = set()
    noted: Set[tuple] = set()
    while queue and len(seen) < MAX_FUNCTIONS:
        f, depth = queue.pop(0)
        f = _function(f)
        if f is None or id(f) in seen or _root(f.__globals__.get("__name__", "")) not in roots:
            continue
        seen.add(id(f))
        if depth < DEPTH and hasattr(f, "__wrapped__"):  # functools.wraps: the wrapped function runs too
            queue.append((f.__wrapped__, depth + 1))
        names = {n for code in _codes(f.__code__) for n in code.co_names}
        for d, key, value, label in _globals_read(f, names, roots):
            if (id(d), key) not in noted:
                noted.add((id(d), key))
                notes.append(Note(d, key, value, label))
                if depth < DEPTH:
                    queue.append((value, depth + 1))
        if depth < DEPTH:  # a method called by name on an object of these classes (self.helper())
            queue += [(d[n], depth + 1) for n in names for d in methods if n in d]
    return notes


def _lookup(cls: type, name: str) -> Any:
    for c in cls.__mro__:
        if name in c.__dict__:
            return c.__dict__[name]
    return None


def _root(module: str) -> str:
    return module.partition(".")[0]


def _globals_read(f: types.FunctionType, names: Set[str], roots: Set[str]) -> Iterator[Note]:
    """What ``f``'s code reads from its module's globals, and from modules found there
    (``F.gelu``: ``F`` in the globals, then ``gelu`` in ``F``)."""
    g = f.__globals__
    where = g.get("__name__", "?")
    for name in names:
        if name not in g:
            continue  # an attribute name, a local, or a builtin
        value = g[name]
        yield Note(g, name, value, f"{where}.{name}")
        if isinstance(value, types.ModuleType) and _root(value.__name__) in roots:
            attrs = vars(value)
            for attr in names:
                if attr in attrs:
                    yield Note(attrs, attr, attrs[attr], f"{value.__name__}.{attr}")


def data_descriptor(cls: type, name: str) -> bool:
    """Whether ``name`` on ``cls`` (its MRO) is a data descriptor, which Python's attribute lookup
    reads before the instance dict and a module's ``__getattr__`` (a property named ``weight``)."""
    found = _lookup(cls, name)
    return found is not None and hasattr(type(found), "__set__")


def code_changes(ok: Optional[Dict[str, Any]], notes: List[Note]) -> List[str]:
    """The labels of ``notes`` whose values differ from ``ok`` (label -> value, when last checked):
    those changed first, then those gone and those new (a class that joined the forward: a peft
    layer), each sorted. None for ``ok``: nothing was checked yet, nothing changed."""
    if ok is None:
        return []
    now = {n.label: n.value for n in notes}
    changed = sorted(k for k in ok.keys() & now.keys() if ok[k] is not now[k])
    gone = sorted(f"{k} (gone)" for k in ok.keys() - now.keys())
    return changed + gone + sorted(f"{k} (new)" for k in now.keys() - ok.keys())
