"""The watch's version-tag shortcut (``rust/python/watch.rs``): where CPython keeps a
dict's version tag (3.11 to 3.13), a call compares one tag per watched dict instead of every noted
value, and runs the full compare only when a tag moved. A shortcut must never say "unchanged"
where the full compare would not: generated sequences of changes to the watched dicts (a value
replaced, set to itself, a key added or removed and put back, a dict cleared and refilled, a class
swapped) are checked, after every step, against an oracle written in Python from the watch's own
record of what it read. The functions the forward's code runs are compared in place (their
code, defaults and closure cells), directly where CPython's layout is known and through
``getattr`` elsewhere: both ways agree with the oracle after generated changes and undos."""

import functools
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples, make_block, rel_err
from plusequals import RustBlock, _rust
from plusequals.model.blocks import BasicTransformerBlock
from plusequals.twin.forward_code import function_state

TAGS = (3, 11) <= sys.version_info[:2] < (3, 14)


def _reading(seed):
    rb = RustBlock.from_torch(make_block(dim=16, heads=2, d_head=8, context_dim=16, seed=seed))
    watch = rb._reading.watch
    keys = [list(d) for d in watch.globals]
    return rb, watch, keys


def _oracle(watch, global_keys) -> bool:
    """The full compare, from its definition: every noted value by identity, every module's exact
    class, every read dict's size, hook dicts empty, the global hook dicts' keys in order, and the
    watched lists' items."""
    missing = object()
    notes = watch.values + watch.tensors
    return (
        all(d.get(k, missing) is v for d, k, v in notes)
        and all(type(m) is cls for m, cls in watch.classes)
        and all(len(d) == n for d, n in watch.sizes)
        and all(len(d) == 0 for d in watch.hook_dicts)
        and all(len(d) == len(k) and all(a is b for a, b in zip(d, k)) for d, k in zip(watch.globals, global_keys))
        and all(len(lst) == len(items) and all(a is b for a, b in zip(lst, items)) for lst, items in watch.lists)
        and all(n.d.get(n.key, missing) is n.value for n in watch.code if n.d is not None)
        and all(len(d) == n for d, n in watch.code_sizes)
        and _functions_as_read(watch)
    )


def _functions_as_read(watch) -> bool:
    """Every watched function's state (code, defaults, cells) is the one its notes hold: the
    notes of each function follow its ``__code__`` note, in the order of ``watch.functions``."""
    missing = object()
    was = {n.label: n.value for n in watch.code if n.d is None}
    owners = [n.label[: -len(".__code__")] for n in watch.code if n.d is None and n.key == "__code__"]
    return len(owners) == len(watch.functions) and all(
        was.get(f"{owner}.{key}", missing) is value
        for f, owner in zip(watch.functions, owners)
        for key, value in function_state(f)
    )


def _dicts(watch):
    seen, out = set(), []
    for d in [n.d for n in watch.values + watch.tensors] + [s.d for s in watch.sizes] + watch.hook_dicts:
        if id(d) not in seen:
            seen.add(id(d))
            out.append(d)
    return out


class _Other:
    pass


def _change(watch, d: dict, op: str, pick: int):
    """Applies ``op`` to ``d``; returns how to undo it (or None)."""
    keys = list(d)
    key = keys[pick % len(keys)] if keys else None
    if op == "set_same" and key is not None:
        d[key] = d[key]
    elif op == "replace" and key is not None:
        old = d[key]
        d[key] = object()
        return lambda: d.__setitem__(key, old)
    elif op == "delete" and key is not None:
        old = d.pop(key)
        return lambda: d.__setitem__(key, old)  # put back, at the end
    elif op == "add":
        d["_plusequals_probe"] = 1
        return lambda: d.pop("_plusequals_probe")
    elif op == "refill":
        saved = dict(d)
        d.clear()
        d.update(saved)  # the same items in the same order: unchanged, though every tag moved
    elif op == "update_same" and key is not None:
        d.update({key: d[key]})
    elif op == "swap_class":
        m = watch.classes[pick % len(watch.classes)].obj
        cls = type(m)
        try:
            swapped = type("Swapped", (cls,), {})
        except TypeError:  # a class that cannot be subclassed (typing's TypeVar, a global the code names)
            return None
        # a module's through object's: nn.Module's reads _parameters first, which a step may have replaced
        assign = object.__setattr__ if isinstance(m, nn.Module) else setattr
        assign(m, "__class__", swapped)
        return lambda: assign(m, "__class__", cls)
    return None


OPS = ["set_same", "replace", "delete", "add", "refill", "update_same", "swap_class"]


@pytest.mark.skipif(not TAGS, reason="CPython keeps no dict version tags here: the watch compares in full")
def test_the_shortcut_covers_every_watched_dict_where_cpython_keeps_tags():
    _, watch, _ = _reading(0)
    code = [n.d for n in watch.code if n.d is not None]  # the dicts the forward's code reads (classes, globals)
    code += [d for d, _ in watch.code_sizes]
    assert code and watch.rust.tagged == len({id(d) for d in _dicts(watch) + watch.globals + code})
    assert watch.rust.unchanged()


# (the change, which dict, which key or module, whether to undo it)
STEP = st.tuples(st.sampled_from(OPS), st.integers(0, 10**6), st.integers(0, 10**6), st.booleans())


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(STEP, max_size=12))
def test_the_watch_agrees_with_the_full_compare_after_every_change(steps):
    _, watch, global_keys = _reading(1)
    dicts = _dicts(watch)
    assert watch.rust.unchanged() and _oracle(watch, global_keys)
    for op, which, pick, undo in steps:
        restore = _change(watch, dicts[which % len(dicts)], op, pick)
        assert watch.rust.unchanged() == _oracle(watch, global_keys), (op, "after the change")
        assert watch.rust.unchanged() == _oracle(watch, global_keys), (op, "asked again")
        if undo and restore is not None:
            restore()
            assert watch.rust.unchanged() == _oracle(watch, global_keys), (op, "after the undo")


class _Cells:
    """A function whose code, defaults and cells take part, watched with the block's functions."""

    @staticmethod
    def make():
        a, b = 1.0, 2.0

        def f(x, y=1, *, z=2):
            return x * a + b + y + z

        def g(x, y=1, *, z=2):
            return x * a - b - y - z

        return f, g


FUNCTION_OPS = ["code", "defaults", "defaults_none", "kwdefaults", "kwdefaults_none", "cell", "cell_empty", "cell_same"]


def _change_function(f, other, op: str, which: int):
    """Applies ``op`` to ``f`` in place; returns the undo (or None)."""
    cells = f.__closure__ or ()
    if op == "code":
        old = f.__code__
        f.__code__ = other.__code__
        return lambda: setattr(f, "__code__", old)
    if op in ("defaults", "defaults_none"):
        old = f.__defaults__
        f.__defaults__ = None if op == "defaults_none" else (which,)
        return lambda: setattr(f, "__defaults__", old)
    if op in ("kwdefaults", "kwdefaults_none"):
        old = f.__kwdefaults__
        f.__kwdefaults__ = None if op == "kwdefaults_none" else {"z": which}
        return lambda: setattr(f, "__kwdefaults__", old)
    if cells:
        cell = cells[which % len(cells)]
        empty = old = None
        try:
            old = cell.cell_contents
        except ValueError:
            empty = True
        if op == "cell":
            cell.cell_contents = object()
        elif op == "cell_empty" and not empty:
            del cell.cell_contents
        elif not empty:  # cell_same: the same object again, unchanged
            cell.cell_contents = old
        return (lambda: _empty(cell)) if empty else (lambda: setattr(cell, "cell_contents", old))
    return None


def _empty(cell) -> None:
    try:
        del cell.cell_contents
    except ValueError:
        pass


@pytest.mark.parametrize("direct", [True, False], ids=["in place", "getattr"])
@settings(max_examples=examples(40), deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(FUNCTION_OPS), st.integers(0, 10**6), st.booleans()), max_size=10))
def test_functions_changed_in_place_agree_with_the_oracle(direct, steps):
    """A function's ``__code__``, ``__defaults__`` (to a value or None), ``__kwdefaults__`` or a
    cell's contents (to another object, emptied, or set to itself) changed in place, and undone:
    the watch says changed exactly when the function's state differs from the one read."""
    f, other = _Cells.make()
    read = function_state(f)

    def oracle():
        now = function_state(f)
        return len(now) == len(read) and all(a[1] is b[1] for a, b in zip(now, read))

    _, watch, _ = _reading(2)
    rust = _rust.Watch(
        same=[], classes=watch.classes, sizes=[], empty=[], keys=[],
        functions=[f, *watch.functions], direct=direct,
    )  # fmt: skip
    assert rust.functions[1 - direct] > 0
    assert rust.unchanged() and oracle()
    for op, which, undo in steps:
        restore = _change_function(f, other, op, which)
        assert rust.unchanged() == oracle(), (op, "after the change")
        if undo and restore is not None:
            restore()
            assert rust.unchanged() == oracle(), (op, "after the undo")


@pytest.mark.parametrize("direct", [True, False], ids=["in place", "getattr"])
@settings(max_examples=examples(40), deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from("ABC"), st.sampled_from(["X", "Y", "parent"])), max_size=8))
def test_a_classs_bases_reassigned_is_a_change_of_every_class_below_it(direct, steps):
    """``__bases__`` reassigned on a noted class or any class above it (to another base, or back):
    the noted class gets a new ``__mro__``, and the watch says changed exactly when it is not the
    tuple read (a static type, whose bases cannot be reassigned, is not compared)."""

    class X:
        pass

    class Y:
        pass

    class A(X):
        pass

    class B(A):
        pass

    class C(B):
        pass

    parents = {"A": X, "B": A, "C": B}
    classes = {"A": A, "B": B, "C": C}
    rust = _rust.Watch(same=[], classes=[(C(), C), (1, int)], sizes=[], empty=[], keys=[], direct=direct)
    assert rust.fields == ((1, 0) if direct else (0, 1))
    read = C.__mro__
    assert rust.unchanged()
    for name, base in steps:
        classes[name].__bases__ = (parents[name] if base == "parent" else {"X": X, "Y": Y}[base],)
        assert rust.unchanged() == (C.__mro__ is read), (name, base)


class _Plain:
    pass  # a managed dict (3.11+): its pointer before the object


class _Slotted:
    __slots__ = ("__dict__", "other")  # a managed dict too, beside a slot


class _Error(Exception):
    pass  # its dict at the type's __dictoffset__ (BaseException's), not a managed one


class _Tuple(tuple):
    pass  # a var-sized object: its dict's place is counted from the end (read through getattr)


def _holders():
    """Objects with a field the watch holds: instances' dicts of three layouts, and a partial."""
    objs = [_Plain(), _Error(), _Slotted(), _Tuple((1, 2))]
    for o in objs:
        o.__dict__["k"] = 1
    p = functools.partial(max, 1, key=abs)
    holders = [(o, "__dict__", o.__dict__) for o in objs]
    holders += [(p, name, getattr(p, name)) for name in ("func", "args", "keywords")]
    return objs, p, holders


HOLDER_OPS = ["new dict", "dict back", "setstate new", "setstate back", "setstate same func"]


@pytest.mark.parametrize("direct", [True, False], ids=["in place", "getattr"])
@settings(max_examples=examples(40), deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(HOLDER_OPS), st.integers(0, 3)), max_size=8))
def test_an_instances_dict_and_a_partials_fields_agree_with_the_oracle(direct, steps):
    """An instance's ``__dict__`` reassigned (to a copy, or back) and a partial rebuilt by
    ``__setstate__`` (other fields, its own back, the same func with new args): the watch says
    changed exactly when a field no longer holds what it held when read."""
    objs, p, holders = _holders()
    state = p.__reduce__()[2]
    classes = [(objs[0], _Plain)]  # (a watch of no class is a cleared one: changed)
    rust = _rust.Watch(same=[], classes=classes, sizes=[], empty=[], keys=[], holders=holders, direct=direct)
    in_place = 7 if direct else 0  # _Plain's MRO, 3 dicts, 3 partial fields; the var-sized object's dict by getattr
    assert rust.fields == (in_place, len(holders) + 1 - in_place)
    read = [(o, n, v) for o, n, v in holders]

    def oracle():
        return all(getattr(o, n) is v for o, n, v in read)

    assert rust.unchanged() and oracle()
    for op, which in steps:
        o = objs[which]
        if op == "new dict":
            o.__dict__ = dict(o.__dict__)
        elif op == "dict back":
            o.__dict__ = next(v for h, n, v in read if h is o)
        elif op == "setstate new":
            p.__setstate__((min, (2,), {"key": len}, None))
        elif op == "setstate back":
            p.__setstate__(state)
        else:
            p.__setstate__((p.func, (3,), dict(p.keywords), None))
        assert rust.unchanged() == oracle(), (op, which)


def _block_of_a_class_of_its_own(n: int):
    """``n`` blocks of a new subclass of the block: no reading of its MRO was made before."""
    cls = type("OwnBlock", (BasicTransformerBlock,), {})
    blocks = [make_block(32, 2, 16, context_dim=24, seed=i) for i in range(n)]
    for b in blocks:
        b.__class__ = cls
    return cls, blocks


def test_a_reading_of_the_same_classes_is_taken_from_the_last_while_it_holds(monkeypatch):
    """``Watch.code_of`` keeps its reading of the forward's code by the MROs it started from: a
    second block of the class reads no code; a method added to the class (a change the kept
    reading's watch sees) reads it again; and no more than ``_CODE_READS_KEPT`` are kept."""
    from plusequals.twin import watch

    reads = []
    read_code = watch.read_code
    monkeypatch.setattr(watch, "read_code", lambda *a, **kw: reads.append(1) or read_code(*a, **kw))
    cls, (first, second) = _block_of_a_class_of_its_own(2)
    RustBlock.from_torch(first, trust="probe")
    once = len(reads)
    assert once >= 1
    RustBlock.from_torch(second, trust="probe")
    assert len(reads) == once, "the same classes, nothing changed: read again"
    cls.helper = lambda self: None
    RustBlock.from_torch(second, trust="probe")
    assert len(reads) > once, "a method added to the class: the kept reading was used"
    monkeypatch.setattr(watch, "_CODE_READS_KEPT", 2)
    for _ in range(3):
        RustBlock.from_torch(_block_of_a_class_of_its_own(1)[1][0], trust="probe")
    assert len(watch._CODE_READS) <= 2
    assert not any(cls in key[0] for key in watch._CODE_READS)


def test_readings_kept_are_shared_by_threads_making_twins_at_once():
    """Four threads making twins of blocks of one class at once, while a fifth adds and removes a
    method of it: every twin computes its block's output (the kept reading is taken out while in
    use, so no two threads share one), and nothing raises."""
    import threading

    import torch

    cls, blocks = _block_of_a_class_of_its_own(4)
    x, c = torch.randn(1, 4, 32), torch.randn(1, 3, 24)
    failures, stop = [], threading.Event()

    def make(block):
        try:
            for _ in range(5):
                twin = RustBlock.from_torch(block, trust="probe")
                with torch.no_grad():
                    assert rel_err(twin(x, c), block(x, c)) <= 1e-5
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            failures.append(e)

    def churn():
        while not stop.is_set():
            cls.helper = lambda self: None
            del cls.helper

    churner = threading.Thread(target=churn)
    churner.start()
    threads = [threading.Thread(target=make, args=(b,)) for b in blocks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    churner.join()
    assert failures == []
