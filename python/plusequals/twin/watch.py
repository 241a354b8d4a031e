"""What a reading of a module looked at, and whether it is all still there: :class:`Watch`.

Every value the reading (:func:`plusequals.twin.faithful.read_block`) looked at, with the dict
it sits in; the exact class of every module of the block; the size of every dict read from;
the module's hook dicts, and torch's global module hooks. :meth:`Watch.seal` hands all of it to
Rust (``plusequals._rust.Watch``), which every call of a ``RustBlock`` compares first, in one pass.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .. import _rust
from . import casting
from .forward_code import Note, read_code
from .record import Ran

_IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: no instance's __class__ can be reassigned to or from it

__all__ = ["Exact", "Noted", "Sized", "Watch", "class_name", "global_hook_kinds"]

# Watch.code_of's readings of the forward's code, by the MROs they started from (the most recently
# used last), each a Watch of what it noted alone; at most _CODE_READS_KEPT (a class made anew
# for each block would otherwise keep every reading).
_CODE_READS: Dict[tuple, "Watch"] = {}
_CODE_READS_KEPT = 64
_CODE_READS_LOCK = threading.Lock()


def class_name(obj: Any) -> str:
    """``obj``'s class as a reader finds it: ``nn.Linear`` for torch's own layers, the qualified
    name otherwise (``peft.tuners.lora.layer.Linear``, not a bare ``Linear``)."""
    cls = type(obj)
    if cls.__module__.startswith("torch.nn.modules."):
        return f"nn.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _global_hooks() -> Dict[str, dict]:
    """torch's global module hooks, by kind: they fire on every module's forward or backward,
    the PyTorch block's submodules included, which the Rust block bypasses."""
    from torch.nn.modules import module

    return {
        "forward": module._global_forward_hooks,
        "forward pre": module._global_forward_pre_hooks,
        "backward": module._global_backward_hooks,
        "backward pre": module._global_backward_pre_hooks,
    }


def _observer_types() -> tuple:
    """Trackers whose global hooks only observe which module runs (FlopCounterMode's
    ModuleTracker, ModTracker): they change no input or output, and see the RustBlock as one
    module."""
    from torch.utils.module_tracker import ModuleTracker

    types = [ModuleTracker]
    try:
        from torch.distributed._tools.mod_tracker import ModTracker

        types.append(ModTracker)
    except ImportError:  # torch built without distributed
        pass
    return tuple(types)


def global_hook_kinds() -> List[str]:
    """The kinds of global module hooks registered now, other than observers' (the trackers', and
    those of an object that says it only observes: ``plusequals.audit``'s module watch, which
    sees a twin as one module)."""
    observers = _observer_types()

    def observer(owner: Any) -> bool:
        return isinstance(owner, observers) or getattr(owner, "observes_only", False) is True

    return [
        kind
        for kind, hooks in _global_hooks().items()
        if any(not observer(getattr(h, "__self__", None)) for h in hooks.values())
    ]


_METHODS = (types.FunctionType, staticmethod, classmethod, functools.partialmethod)
_MRO = type.__dict__["__mro__"].__get__  # a class's MRO, as getattr_static reads it (no metaclass property)


def _shadowed(module: nn.Module) -> List[str]:
    """The methods of ``module``'s class that a value in its instance dict shadows (``forward``
    aside): ``self.gelu(...)``, ``self._call_impl(...)`` find the instance's first, which the
    Rust block would bypass. Dunders are looked up on the class by Python's implicit calls.
    Only a name some class of the MRO has is looked up statically (an instance's own state, most
    of its dict, is in none: ``getattr_static`` for each name was a quarter of ``from_torch``)."""
    cls = type(module)
    classes = [vars(c) for c in _MRO(cls)]
    return [
        name
        for name in module.__dict__
        if name != "forward"
        and not (name.startswith("__") and name.endswith("__"))
        and any(name in d for d in classes)
        and isinstance(inspect.getattr_static(cls, name, None), _METHODS)
    ]


class Noted(NamedTuple):
    """One value a reading looked at: ``d[key]`` was ``value`` (compared by identity)."""

    d: dict
    key: str
    value: Any


class Sized(NamedTuple):
    """A dict read from, and its size then (a key added or removed later is a change)."""

    d: dict
    n: int


class _Seen(NamedTuple):
    """What :meth:`Watch._objects` has noted already: (dict, key) entries, sized dicts, partials."""

    notes: set
    sized: set
    partials: set


class Exact(NamedTuple):
    """An object read (a module, a processor, a parameter), and its exact class then."""

    obj: Any
    cls: type


class Watch:
    """Every value a reading looked at, with the dict it sits in (a module's ``__dict__``,
    ``_modules`` or ``_parameters``), and the size of each dict read from. :meth:`unchanged`
    compares them in one pass in Rust (``plusequals._rust.Watch``, which every call of a
    ``RustBlock`` runs first): every value by identity (a value set again, equal, only costs a
    second reading); the exact class of every module read; the sizes (an attribute set later on
    an instance, such as accelerate's ``_hf_hook`` and ``forward``; a submodule appended to a
    ``Sequential``; a parameter or buffer added). Hook dicts must stay empty, and torch's global
    module hooks as they were. A change only costs a second reading, so a false alarm is
    harmless."""

    __slots__ = (
        "values",
        "tensors",
        "sizes",
        "hook_dicts",
        "attrs",
        "classes",
        "globals",
        "lists",
        "code",
        "code_sizes",
        "functions",
        "casting",
        "holders",
        "rust",
        "_sized_dicts",
        "_seen",
        "_lseen",
        "_mseen",
    )

    def __init__(self) -> None:
        self.values: List[Noted] = []  # values compared by identity, which a traced call guards on too (attrs)
        self.tensors: List[Noted] = []  # tensors (parameters), stores, and unknown classes' state
        self.sizes: List[Sized] = []  # every dict read from, with its size when sealed
        self.hook_dicts: List[dict] = []
        self.classes: List[Exact] = []  # every module read (processors, parameters too), and its exact class
        self.globals: List[dict] = list(_global_hooks().values())
        self.lists: List[Tuple[list, List[Any]]] = []  # lists whose items are watched (PEFT's merged_adapters)
        self.code: List[Note] = []  # what the forward's code reads: classes and module globals (twin/forward_code.py)
        self.code_sizes: List[Tuple[dict, int]] = []  # every dict the code's lookups consulted, once, and its size
        self.functions: List[Any] = []  # every Python function the code reads followed: watched in place
        self.casting: List[Tuple[str, nn.Module, Any]] = []  # layerwise casting's hooks: (path, module, hook)
        # (object, attribute, value) held in a field of the object: an instance's __dict__ (the dict
        # read from: `m.__dict__ = {...}` is a change), a functools.partial's func, args and keywords
        self.holders: List[Tuple[Any, str, Any]] = []
        self.rust: Any = None  # the Rust watch, made by seal()
        # (object, name, value) of every non-tensor value: what a traced forward compares, so
        # that torch.compile guards on it (tensors reach the custom op as arguments instead).
        self.attrs: List[Tuple[Any, str, Any]] = []
        self._sized_dicts: List[dict] = []  # the dicts of sizes, until seal() reads their sizes
        self._seen: set = set()
        self._lseen: set = set()
        self._mseen: set = set()

    def _sized(self, d: dict) -> None:
        if id(d) not in self._lseen:
            self._lseen.add(id(d))
            self._sized_dicts.append(d)

    def _instance(self, obj: Any, d: dict) -> None:
        """Notes ``d``, ``obj``'s instance dict, by its size, and as ``obj``'s dict."""
        if id(d) not in self._lseen:
            self.holders.append((obj, "__dict__", d))
        self._sized(d)

    def _note(self, d: dict, key: str, value: Any, obj: Any, by_identity: bool = False) -> Any:
        if (id(d), key) in self._seen:
            return value
        self._seen.add((id(d), key))
        if by_identity or isinstance(value, torch.Tensor):
            self.tensors.append(Noted(d, key, value))
        else:
            self.values.append(Noted(d, key, value))
            if obj is not None:  # an entry of a plain dict (PEFT's scaling) is no attribute to guard on
                self.attrs.append((obj, key, value))
        return value

    def entry(self, d: dict, key: str) -> Any:
        """``d.get(key)`` of a plain dict (PEFT's ``scaling``, ``use_dora``), noted: a value set
        again or a key added or removed is a change."""
        if not isinstance(d, dict):
            return None
        self._sized(d)
        if key in d:
            return self._note(d, key, d[key], None)
        return None

    def items(self, lst: list) -> list:
        """Notes the items of ``lst`` (by identity, in order): an item appended, popped or replaced
        is a change (PEFT's ``merged_adapters``, which merge and unmerge change in place)."""
        if isinstance(lst, list):
            self.lists.append((lst, list(lst)))
        return lst

    def exact(self, obj: Any) -> None:
        """Notes ``obj``'s exact class (a ``__class__`` assigned in place is a change): a module, a
        processor, a parameter."""
        if id(obj) not in self._mseen:
            self._mseen.add(id(obj))
            self.classes.append(Exact(obj, type(obj)))

    def module(self, m: nn.Module) -> None:
        """Notes ``m``'s exact class, its submodule, parameter and buffer dicts (the dicts
        themselves, by identity: ``m._parameters = {...}`` is a change) and their sizes, and the
        size of its instance dict (an attribute set on the instance later, such as one that
        shadows a parameter, is a change)."""
        if id(m) in self._mseen:
            return
        self.exact(m)
        self._instance(m, m.__dict__)
        for name in ("_modules", "_parameters", "_buffers"):
            store = m.__dict__.get(name)
            if isinstance(store, dict):
                self._sized(self._note(m.__dict__, name, store, None, by_identity=True))

    def code_of(self, objs: List[Any]) -> None:
        """Notes what calling ``objs`` (the block's modules, its processors) reads as code: the
        entries of their classes (MROs included) and of the tensors' (``torch.Tensor``, the
        parameters' classes), the module globals and builtins their code reads
        (:func:`plusequals.twin.forward_code.read_code`), the size of each dict consulted, and every
        Python function followed, in place (its code, defaults and closure cells): a name added
        later (a property ``eps`` on ``nn.LayerNorm``, a ``__call__`` on ``nn.Linear``, a global
        that shadows a builtin, a ``torch.Tensor.chunk``) or a function changed in place is a
        change, which reads the block again and probes the new code.

        The reading is kept (:data:`_CODE_READS`) by the MROs it started from, with a watch of its
        own over what it noted: read_code follows only what it notes, so while that watch holds, a
        new reading of the same MROs would find the same code, and it is taken from there (every
        block of a UNet, and each ``from_torch`` of one block again, read the same classes)."""
        tensors = {torch.Tensor: None}
        for obj in objs:
            if isinstance(obj, nn.Module):
                tensors.update((type(p), None) for p in obj._parameters.values() if isinstance(p, torch.Tensor))
        key = tuple(type(o).__mro__ for o in objs) + tuple(c.__mro__ for c in tensors)
        with _CODE_READS_LOCK:  # taken out while in use: another thread reads for itself
            read = _CODE_READS.pop(key, None)
        if read is None or not read.unchanged():
            read = Watch()
            read._read_code(objs, list(tensors))
            read.seal()
        with _CODE_READS_LOCK:
            _CODE_READS[key] = read  # the most recent last
            while len(_CODE_READS) > _CODE_READS_KEPT:
                del _CODE_READS[next(iter(_CODE_READS))]
        self.code, self.code_sizes, self.functions = list(read.code), list(read.code_sizes), list(read.functions)
        self.holders += read.holders
        for e in read.classes:
            self.exact(e.obj)

    def _read_code(self, objs: List[Any], classes: List[type]) -> None:
        reads = read_code(objs, classes=classes)
        self.code = reads.notes
        self.code_sizes = [(d, len(d)) for d in reads.sized]
        self.functions = reads.functions
        self._objects(reads.notes)

    def state(self, m: nn.Module) -> None:
        """Notes every value on the instance ``m`` by identity: the state an unknown class's
        forward may read (mutation inside a value, a class attribute or a global it reads is
        beyond this: see ``RustBlock.from_torch``'s ``trust``)."""
        self._instance(m, m.__dict__)
        for key, value in m.__dict__.items():
            if key not in _MODULE_STORES:
                self._note(m.__dict__, key, value, m, by_identity=True)

    def get(self, obj: Any, name: str, default: Any = None) -> Any:
        """``getattr(obj, name, default)``, noted, in Python's order: the instance dict, then (a
        module's ``__getattr__``) its parameters, buffers and submodules. A class attribute that is
        a data descriptor comes first in Python; the reader refuses one on a slot it reads."""
        d = getattr(obj, "__dict__", None)
        if d is None:
            return getattr(obj, name, default)
        self._instance(obj, d)
        if name in d:
            return self._note(d, name, d[name], obj)
        if isinstance(obj, nn.Module):  # its class and stores: tree() notes every module of the block
            for store in (obj._parameters, obj._buffers, obj._modules):
                if name in store:
                    return self._note(store, name, store[name], obj)
        # A class attribute, a property, or nothing: setting it on the instance later grows
        # the instance's dict, which is watched.
        return getattr(obj, name, default)

    def in_dict(self, obj: Any, name: str) -> bool:
        """Whether ``name`` is set on the instance itself (an instance-level ``forward``)."""
        self._sized(obj.__dict__)
        return name in obj.__dict__

    def hooks_of(self, module: nn.Module, path: str = "") -> List[str]:
        """The kinds of hooks ``module`` (at ``path``) has; its hook dicts are watched for new ones.
        diffusers' layerwise casting hooks are no refusal but noted in :attr:`casting`
        (twin/casting.py), each by identity."""
        kinds = []
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            hooks = module.__dict__.get(attr)
            if hooks is not None:  # the dict itself, by identity (one set in its place), and kept empty
                self._note(module.__dict__, attr, hooks, module, by_identity=True)
                self.hook_dicts.append(hooks)
                if hooks:
                    kinds.append(attr.strip("_"))
        if self.get(module, "_hf_hook") is not None:
            kinds.append("accelerate _hf_hook")
        diffusers_hooks = self.diffusers_hooks(module)
        hooks = self.get(self.get(module, "_diffusers_hook"), "hooks")
        for name in diffusers_hooks:
            hook = self.entry(hooks, name)
            if casting.accepted(name, hook):
                self.casting.append((path, module, hook))
            else:
                kinds.append(_DIFFUSERS_HOOKS.get(name, f"diffusers' {name!r} hook (a forward override)"))
        if self.in_dict(module, "forward") and not diffusers_hooks:  # a diffusers hook's is named above
            kinds.append("an instance-level forward override")
        kinds += [f"an instance-level override of {type(module).__qualname__}.{name}" for name in _shadowed(module)]
        if self.get(module, "_compiled_call_impl") is not None:  # nn.Module's own call runs it instead
            kinds.append("a compiled call (module.compile(): torch.compile's forward)")
        return kinds

    def diffusers_hooks(self, module: nn.Module) -> List[str]:
        """The names of the hooks in diffusers' ``HookRegistry`` on ``module`` (``_diffusers_hook``:
        ``enable_layerwise_casting``, group offloading, caches), which override its ``forward``."""
        registry = self.get(module, "_diffusers_hook")
        hooks = getattr(registry, "hooks", None)
        if not isinstance(hooks, dict):
            return []
        self._sized(hooks)
        return [str(name) for name in hooks]

    def add(self, ran: Optional[Ran]) -> None:
        """Adds what a recorded run of the PyTorch forward read (:mod:`plusequals.twin.record`),
        from the values there now, to the code watched (each dict entry and function once), and
        seals again. None: nothing recorded."""
        if ran is None:
            return
        reads = ran.reads(self.functions)
        have = {(id(n.d), n.key) for n in self.code if n.d is not None}
        functions = {id(f) for f in self.functions}
        sized = {id(d) for d, _ in self.code_sizes}
        skip = set()
        for f in reads.functions:
            (functions if id(f) not in functions else skip).add(id(f))
        self.functions += [f for f in reads.functions if id(f) not in skip]
        owners = iter(reads.functions)
        owner = None
        for n in reads.notes:
            if n.d is None:
                if n.key == "__code__":
                    owner = next(owners)
                if id(owner) not in skip:
                    self.code.append(n)
            elif (id(n.d), n.key) not in have:
                have.add((id(n.d), n.key))
                self.code.append(n)
        self.code_sizes += [(d, len(d)) for d in reads.sized if id(d) not in sized]
        self._objects(reads.notes)
        self.rust = self._rust()

    def _objects(self, notes: List[Note]) -> None:
        """What the code's notes hold besides their identity, watched too: the exact class of each
        object of a class Python code can reassign (a module, whose ``__class__`` may become a
        ``ModuleType`` subclass with a ``__getattribute__``; a callable object set as ``F.gelu``),
        and what a ``functools.partial`` or ``partialmethod`` calls with (:meth:`_partial`)."""
        seen = _Seen(
            {(id(n.d), n.key) for n in self.code if n.d is not None},
            {id(d) for d, _ in self.code_sizes},
            {id(obj) for obj, name, _ in self.holders if name == "func"},
        )
        classes = {n.label for n in self.code if n.d is None and n.key == "__class__"}
        for n in list(notes):
            held = [(n.label, n.value)]
            if isinstance(n.value, (functools.partial, functools.partialmethod)):
                held.append((f"{n.label}.func", n.value.func))
                self._partial(n.value, n.label, seen)
            for label, obj in held:
                if isinstance(obj, types.ModuleType) or not type(obj).__flags__ & _IMMUTABLE:
                    self.exact(obj)  # compared on every call; the note names it in a refusal
                    if f"{label}.__class__" not in classes:
                        classes.add(f"{label}.__class__")
                        self.code.append(Note(None, "__class__", type(obj), f"{label}.__class__"))

    def _partial(self, p: Any, label: str, seen: "_Seen") -> None:
        """A ``functools.partial``'s or ``partialmethod``'s keywords (a dict it calls with: each
        entry by identity, the dict sized); a partial's fields (``func``, ``args``, ``keywords``:
        ``__setstate__`` sets all three in place), a partialmethod's (entries of its ``__dict__``)."""
        if isinstance(p.keywords, dict):
            self._entries(p.keywords, f"{label}.keywords", seen)
        if isinstance(p, functools.partialmethod) and isinstance(getattr(p, "__dict__", None), dict):
            self._entries(vars(p), label, seen)
        elif isinstance(p, functools.partial) and id(p) not in seen.partials:
            seen.partials.add(id(p))
            self.holders += [(p, name, getattr(p, name)) for name in ("func", "args", "keywords")]

    def _entries(self, d: dict, label: str, seen: "_Seen") -> None:
        """Every entry of ``d`` as code, by identity, and ``d`` sized (each once)."""
        if id(d) not in seen.sized:
            seen.sized.add(id(d))
            self.code_sizes.append((d, len(d)))
        for key, v in d.items():
            if (id(d), key) not in seen.notes:
                seen.notes.add((id(d), key))
                self.code.append(Note(d, key, v, f"{label}[{key!r}]"))

    def seal(self) -> "Watch":
        self.sizes = [Sized(d, len(d)) for d in self._sized_dicts]
        self.rust = self._rust()
        self._seen = self._lseen = self._mseen = set()
        return self

    def _rust(self) -> Any:
        # the code's notes as plain (d, key, value) tuples, what Rust reads of a Noted: a NamedTuple's
        # constructor cost an eighth of a from_torch, run for each of thousands of notes
        same = self.values + self.tensors + [(n.d, n.key, n.value) for n in self.code if n.d is not None]
        return _rust.Watch(
            same=same,
            classes=self.classes,
            sizes=self.sizes + self.code_sizes,
            empty=self.hook_dicts,
            keys=[(d, list(d)) for d in self.globals],
            lists=self.lists,
            functions=self.functions,
            holders=self.holders,
        )

    def unchanged(self) -> bool:
        return self.rust.unchanged()


# diffusers' hooks (diffusers.hooks, by registry name) that the reader names; any other one is
# named by its registry name. Layerwise casting's own classes are accepted (twin/casting.py).
_DIFFUSERS_HOOKS = {
    "layerwise_casting": "diffusers' layerwise casting hook of a class of its own (not LayerwiseCastingHook)",
    "peft_autocast_disable": "diffusers' layerwise casting hook for peft layers, of a class of its own",
}

# What a module's __dict__ holds besides its own state: watched on their own (Watch.module, hooks_of).
_MODULE_STORES = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
    }
)
