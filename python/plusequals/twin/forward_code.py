"""What a PyTorch forward's code reads, derived from the code itself: :func:`code_reads`.

A module's forward is Python code. What it computes depends on its instance state (read by
:mod:`plusequals.twin.faithful`), and on the *code* it runs: the methods of its class and of every
class in that class's MRO (``nn.LayerNorm.forward``, diffusers' ``GEGLU.forward``, a processor's
``__call__``, ``nn.Module.__call__``), and the module globals that code reads (``F`` and then
``F.layer_norm``, ``torch.baddbmm``, ``scaled_dot_product_attention``), transitively: a function
found there is code the forward runs too.

Every such read is a *note*: a dict (a class's own ``__dict__``, a module's globals, the
builtins), a key, the value found, and a label (``nn.LayerNorm.forward``,
``torch.nn.functional.gelu``). The watch (:mod:`plusequals.twin.watch`) compares each note by
identity on every call: on CPython 3.11 to 3.13 that is one version tag per dict (PEP 509),
whatever the dict's size. Every dict a lookup consulted is *sized* too (a name added later, which
Python's lookup would find first, is a change), and every Python function followed is watched in
place: its ``__code__``, ``__defaults__``, ``__kwdefaults__`` and the contents of its closure
cells (a note without a dict, compared by the watch through the function object itself).

Nothing here is a list of names: the classes are those of the objects the forward calls (and of
the tensors it computes on: ``torch.Tensor``, the parameters' class), and the names those in the
code objects' ``co_names`` plus the dunders their bytecode reaches implicitly (``x + y``,
``to_out[0]``, ``for m in self.net``, ``with``: :func:`implicit_dunders`). A leaf (imports nothing
of the package).
"""

from __future__ import annotations

import dis
import functools
import gc
import types
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, NamedTuple, Optional, Set, Tuple

__all__ = [
    "EMPTY",
    "HOLDS_FUNCTION",
    "INERT",
    "Note",
    "Reads",
    "class_dict",
    "classes_of",
    "code_changes",
    "code_reads",
    "data_descriptor",
    "function_state",
    "implicit_dunders",
    "read_code",
]

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


#: An empty closure cell's contents, in a note (a cell may hold None).
EMPTY = type("EMPTY", (), {"__repr__": lambda self: "<empty cell>"})()


class Note(NamedTuple):
    """One read: ``d[key]`` was ``value``; ``label`` names it in a refusal. ``d`` is None for a
    function's own state (``key``: ``__code__``, ``__defaults__``, ``__kwdefaults__``, or a closure
    cell ``<cell name>``), which the watch compares through the function (:class:`Reads`)."""

    d: Optional[dict]
    key: str
    value: Any
    label: str


class Reads(NamedTuple):
    """What :func:`read_code` found: the notes, every dict a lookup consulted (each once: sized,
    so that a name added is a change), and every Python function followed (each once: watched in
    place, :func:`function_state`)."""

    notes: List[Note]
    sized: List[dict]
    functions: List[types.FunctionType]


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


# what a function can be behind (:func:`_function`); most values a module holds are none of these
HOLDS_FUNCTION = (types.FunctionType, staticmethod, classmethod, types.MethodType, property)


def _function(value: Any) -> Any:
    """The Python function behind ``value`` (a method, staticmethod, classmethod, property's
    getter), or None."""
    if not isinstance(value, HOLDS_FUNCTION):
        return None
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
    """The notes of :func:`read_code`."""
    return read_code(objs, entries).notes


def read_code(
    objs: Iterable[Any], entries: Iterable[str] = ("forward", "__call__"), classes: Iterable[type] = ()
) -> Reads:
    """What calling ``objs`` (modules, processors) reads as code: every entry of every mutable
    class in their MROs and in those of ``classes`` (the tensors' classes: ``torch.Tensor``, a
    parameter's), and the module globals (attributes of modules found there, builtins) named in
    the code of their ``entries`` methods, and of the functions found so, to :data:`DEPTH` calls
    deep: globals, methods of those classes named in the code or reached implicitly
    (:func:`implicit_dunders`), a module's ``__getattr__`` that serves a name, a function in a
    closure cell, a ``functools.wraps``' ``__wrapped__``. Each function followed is noted in place
    (:func:`function_state`)."""
    objs = list(objs)
    everything = _all_classes(objs, classes)
    notes = [
        Note(class_dict(c), k, v, f"{_class_label(c)}.{k}")
        for c in everything
        for k, v in class_dict(c).items()
        if k not in INERT
    ]
    sized: Dict[int, dict] = {id(class_dict(c)): class_dict(c) for c in everything}
    methods = [(class_dict(c), _class_label(c)) for c in everything]
    queue = _entry_points(objs, entries)
    roots = {"torch"} | {_root(c.__module__) for c in everything}
    seen: Set[int] = set()
    functions: List[types.FunctionType] = []
    noted: Set[tuple] = set()
    while queue and len(seen) < MAX_FUNCTIONS:
        value, depth, label = queue.pop(0)
        f = _function(value)
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        functions.append(f)  # watched in place wherever it was defined (a wrapper set on torch)
        deeper = depth < DEPTH and _root(f.__globals__.get("__name__", "")) in roots  # followed within the roots
        for key, state in function_state(f):
            notes.append(Note(None, key, state, f"{label}.{key}"))
            if deeper and key.startswith("<cell"):  # a function in a cell runs too (a decorator's)
                queue.append((state, depth + 1, f"{label}.{key}"))
        if deeper and hasattr(f, "__wrapped__"):  # functools.wraps: the wrapped function runs too
            queue.append((f.__wrapped__, depth + 1, f"{label}.__wrapped__"))
        names = {n for code in _codes(f.__code__) for n in code.co_names} | implicit_dunders(f.__code__)
        for note in _globals_read(f, names, roots, sized):
            if (id(note.d), note.key) not in noted:
                noted.add((id(note.d), note.key))
                notes.append(note)
                if deeper:
                    queue.append((note.value, depth + 1, note.label))
        if deeper:  # a method called by name, or implicitly, on an object of these classes (self.helper())
            queue += [(d[n], depth + 1, f"{where}.{n}") for n in sorted(names) for d, where in methods if n in d]
    return Reads(notes, list(sized.values()), functions)


def _all_classes(objs: List[Any], classes: Iterable[type]) -> List[type]:
    """The mutable classes in the MROs of ``objs`` (:func:`classes_of`) and of ``classes``, once each."""
    everything = classes_of(objs)
    seen = {id(c) for c in everything}
    for c in (c for cls in classes for c in cls.__mro__):
        if id(c) not in seen and _mutable(c):
            seen.add(id(c))
            everything.append(c)
    return everything


def _entry_points(objs: List[Any], entries: Iterable[str]) -> List[Tuple[Any, int, str]]:
    """The ``entries`` methods of the classes of ``objs``, as :func:`read_code`'s queue starts:
    (function, depth 0, label)."""
    owners = [(_owner(cls, entry), entry) for cls in {type(o): None for o in objs} for entry in entries]
    return [
        (owner.__dict__[entry], 0, f"{_class_label(owner)}.{entry}") for owner, entry in owners if owner is not None
    ]


def function_state(f: types.FunctionType) -> List[Tuple[str, Any]]:
    """What ``f`` runs besides its globals, all attributes of the function object itself, which
    can be set in place: ``__code__``, ``__defaults__``, ``__kwdefaults__``, and each closure cell's
    contents (:data:`EMPTY` for an empty cell), as (key, value)."""
    state = [("__code__", f.__code__), ("__defaults__", f.__defaults__), ("__kwdefaults__", f.__kwdefaults__)]
    for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # empty
            contents = EMPTY
        state.append((f"<cell {name}>", contents))
    return state


_BINARY = {
    "+": "add", "-": "sub", "*": "mul", "/": "truediv", "//": "floordiv", "%": "mod", "**": "pow",
    "@": "matmul", "<<": "lshift", ">>": "rshift", "&": "and", "|": "or", "^": "xor",
}  # fmt: skip
_COMPARE = {
    "<": ("lt", "gt"), "<=": ("le", "ge"), "==": ("eq", "eq"),
    "!=": ("ne", "ne"), ">": ("gt", "lt"), ">=": ("ge", "le"),
}  # fmt: skip
_IMPLICIT = {
    "BINARY_SUBSCR": ("__getitem__",),
    "BINARY_SLICE": ("__getitem__",),
    "STORE_SUBSCR": ("__setitem__",),
    "STORE_SLICE": ("__setitem__",),
    "DELETE_SUBSCR": ("__delitem__",),
    "GET_ITER": ("__iter__", "__next__"),
    "FOR_ITER": ("__next__",),
    "UNPACK_SEQUENCE": ("__iter__", "__next__"),
    "UNPACK_EX": ("__iter__", "__next__"),
    "GET_LEN": ("__len__",),
    "CONTAINS_OP": ("__contains__", "__iter__"),
    "UNARY_NEGATIVE": ("__neg__",),
    "UNARY_POSITIVE": ("__pos__",),
    "UNARY_INVERT": ("__invert__",),
    "UNARY_NOT": ("__bool__", "__len__"),
    "TO_BOOL": ("__bool__", "__len__"),
    "BEFORE_WITH": ("__enter__", "__exit__"),
    "FORMAT_VALUE": ("__format__", "__str__", "__repr__"),
    "FORMAT_SIMPLE": ("__format__", "__str__"),
    "FORMAT_WITH_SPEC": ("__format__",),
    "CONVERT_VALUE": ("__str__", "__repr__"),
    "LOAD_ATTR": ("__getattr__", "__getattribute__"),
    "LOAD_METHOD": ("__getattr__", "__getattribute__"),
    "LOAD_SUPER_ATTR": ("__getattr__", "__getattribute__"),
    "STORE_ATTR": ("__setattr__",),
    "DELETE_ATTR": ("__delattr__",),
    "CALL": ("__call__",),
    "CALL_FUNCTION_EX": ("__call__",),
    "CALL_KW": ("__call__",),
}


@functools.lru_cache(maxsize=8192)
def implicit_dunders(code: types.CodeType) -> FrozenSet[str]:
    """The dunder methods ``code`` (and the code nested in it) reaches without naming them: an
    operator's (``+``: ``__add__``, ``__radd__``, and ``__iadd__`` for ``+=``), indexing's
    ``__getitem__``, a ``for``'s ``__iter__``, a truth test's ``__bool__``, a ``with``'s
    ``__enter__``/``__exit__``, an attribute's ``__getattr__``, a call's ``__call__``."""
    out: Set[str] = set()
    for c in _codes(code):
        for ins in dis.get_instructions(c):
            name = ins.opname
            if name in _IMPLICIT:
                out.update(_IMPLICIT[name])
            elif name == "BINARY_OP":
                op = _BINARY.get(ins.argrepr.rstrip("="))
                if op:
                    out.update((f"__{op}__", f"__r{op}__"))
                    if ins.argrepr.endswith("=") and ins.argrepr not in ("==", "<=", ">="):
                        out.add(f"__i{op}__")
            elif name == "COMPARE_OP":
                op = ins.argrepr.removeprefix("bool(").rstrip(")")
                out.update(f"__{x}__" for x in _COMPARE.get(op, ()))
            elif name.startswith("POP_JUMP") and "NONE" not in name:
                out.update(("__bool__", "__len__"))
    return frozenset(out)


def _owner(cls: type, name: str) -> Optional[type]:
    """The class in ``cls``'s MRO whose own dict holds ``name``."""
    for c in cls.__mro__:
        if name in c.__dict__:
            return c
    return None


def _lookup(cls: type, name: str) -> Any:
    for c in cls.__mro__:
        if name in c.__dict__:
            return c.__dict__[name]
    return None


def _root(module: str) -> str:
    return module.partition(".")[0]


def _globals_read(f: types.FunctionType, names: Set[str], roots: Set[str], sized: Dict[int, dict]) -> Iterator[Note]:
    """What ``f``'s code reads from its module's globals (and, for a name not there, from the
    builtins: a global added later shadows it, and the globals are sized), and from modules found
    there (``F.gelu``: ``F`` in the globals, then ``gelu`` in ``F``, or from ``F``'s
    ``__getattr__``). Each dict consulted is added to ``sized``."""
    g = f.__globals__
    where = g.get("__name__", "?")
    sized.setdefault(id(g), g)
    builtins = getattr(f, "__builtins__", None)
    if not isinstance(builtins, dict):
        builtins = getattr(builtins, "__dict__", {})
    for name in sorted(names):
        if name not in g:
            if name in builtins and not name.startswith("__"):  # a builtin (or an attribute name: noted anyway)
                sized.setdefault(id(builtins), builtins)
                yield Note(builtins, name, builtins[name], f"builtins.{name}")
            continue  # otherwise an attribute name, or a local
        value = g[name]
        yield Note(g, name, value, f"{where}.{name}")
        if isinstance(value, types.ModuleType) and _root(value.__name__) in roots:
            yield from _module_read(value, names, sized)


def _module_read(module: types.ModuleType, names: Set[str], sized: Dict[int, dict]) -> Iterator[Note]:
    """The attributes of ``module`` named in ``names``; its dict is sized (an attribute added is a
    change). A name it does not hold is served by its ``__getattr__`` (``torch._VF``'s class's,
    or PEP 562's in its globals) where it has one: that hook is noted (and followed, as code that
    runs), with the attributes of the module its code names (``self.vf``)."""
    attrs = vars(module)
    sized.setdefault(id(attrs), attrs)
    cls = type(module)
    hooks: List[Note] = []
    if cls is not types.ModuleType and _mutable(cls):  # a module of its own class (torch._VF's VFModule)
        d = class_dict(cls)
        sized.setdefault(id(d), d)
        owner = _owner(cls, "__getattr__")
        if owner is not None and owner is not types.ModuleType:
            hook = owner.__dict__["__getattr__"]
            hooks.append(Note(class_dict(owner), "__getattr__", hook, f"{_class_label(owner)}.__getattr__"))
    if "__getattr__" in attrs:  # PEP 562
        hooks.append(Note(attrs, "__getattr__", attrs["__getattr__"], f"{module.__name__}.__getattr__"))
    served = False
    for attr in sorted(names):
        if attr in attrs:
            yield Note(attrs, attr, attrs[attr], f"{module.__name__}.{attr}")
        elif hooks and not attr.startswith("__"):
            served = True
    if served:
        for hook in hooks:
            yield hook
            f = _function(hook.value)
            if f is not None:
                for attr in sorted({n for code in _codes(f.__code__) for n in code.co_names}):
                    if attr in attrs and attr not in names:
                        yield Note(attrs, attr, attrs[attr], f"{module.__name__}.{attr}")


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
