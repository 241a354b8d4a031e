"""Donation as a transaction, generated: a hypothesis state machine makes second names for ``x``
in random sequences, then donates ``x`` to one in-place entry point, and checks the invariant.

Steps: views, slices, ``detach``, Python storage objects, weakrefs to them, ``StorageWeakRef``,
numpy views, DLPack tensors, autograd saving ``x`` (plain, and through saved-tensor hooks that keep
the Python object), a TorchDispatchMode or TorchFunctionMode around the call, a tensor subclass
as ``x``, a thread taking views of ``x`` during the call, and dropping any name made so far.

The invariant, after every donation (``forward_owned(x, context, donate=True)``):

* accepted: the result equals the PyTorch block's, ``x`` is marked donated, and no live name
  (tensor, storage, weakref, numpy array, a thread's view) reads the result's memory;
* refused: ``x`` keeps its class, storage, layout and bytes, is not marked, and still computes the
  right answer; every other name is unchanged;
* failed after the first write: ``x`` is marked donated and the message says its buffer was
  consumed.

500 examples per entry point (RustBlock, CppBlock, the raw extension in Rust and in C++), the same
ones on every run (``derandomize``).
"""

from __future__ import annotations

import functools
import threading
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import rel_err
from plusequals import CppBlock, DonatedTensor, DonationConsumed, OwnershipError, RustBlock, _rust
from support.boundary import CTX, D_HEAD, DIM, HEADS, TOL, same_bits, small_block

EXAMPLES = 500


@functools.lru_cache(maxsize=None)
def entry_point(name: str):
    block = small_block()
    if name == "RustBlock":
        module = RustBlock.from_torch(block)
    elif name == "CppBlock":
        module = CppBlock.from_torch(block)
    else:
        module = _rust.Block(
            dict(block.named_parameters()),
            _rust.Config(dim=DIM, n_heads=HEADS, d_head=D_HEAD, context_dim=CTX, language=name.split("-")[1]),
        )
    return block, module


class KeepEverything(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kept = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kept += [a for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


class SeeTorchCalls(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Slotted(torch.Tensor):
    __slots__ = ("tag",)


class ViewTaker:
    """A thread that keeps taking views of x (and the storage) until stopped."""

    def __init__(self, x):
        self.x, self.views, self.stop = x, [], threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self):
        while not self.stop.is_set():
            try:
                self.views.append(self.x.view(-1))
            except RuntimeError:
                return  # x was donated: every use raises
            if len(self.views) > 4:
                self.views.pop(0)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def reads(name, span):
    """Whether a kept name can read memory in the byte range ``span`` now."""
    lo, hi = span
    if isinstance(name, weakref.ref):
        name = name()
    elif isinstance(name, StorageWeakRef):
        name = None if name.expired() else torch.UntypedStorage._new_with_weak_ptr(name.cdata)
    if name is None or isinstance(name, DonatedTensor):
        return False
    if isinstance(name, np.ndarray):
        ptr = name.__array_interface__["data"][0]
        return lo <= ptr < hi
    if isinstance(name, torch.UntypedStorage):
        return name.nbytes() > 0 and lo <= name.data_ptr() < hi
    if isinstance(name, torch.Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return name.numel() > 0 and lo <= name.data_ptr() < hi
    return False


class Donation(RuleBasedStateMachine):
    """Episodes: a fresh x, second names made for it, then one donation, checked."""

    entry = "RustBlock"
    outcomes: list = []  # every donation's outcome, across the examples (the test checks both occur)

    @initialize(seed=st.integers(0, 2**16))
    def fresh(self, seed):
        self.block, self.module = entry_point(self.entry)
        self.seed = seed
        self.episode()

    def episode(self):
        """A fresh x and context; no second names, no mode, no thread."""
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        self.x = torch.randn(2, 5, DIM, generator=g)
        self.c = torch.randn(2, 3, CTX, generator=g)
        self.names, self.kept = [], []  # second names; other things that must live (a graph)
        self.mode = None  # "dispatch", "function" or None, around the call
        self.thread = False

    # -- second names ------------------------------------------------------------------------

    def keep(self, name):
        self.names.append(name)

    @rule(kind=st.sampled_from(["view", "slice", "detach", "transpose"]))
    def view(self, kind):
        x = self.x
        self.keep(
            {
                "view": lambda: x.view(-1),
                "slice": lambda: x[:1],
                "detach": x.detach,
                "transpose": lambda: x.transpose(1, 2),
            }[kind]()
        )

    @rule()
    def storage_object(self):
        self.keep(self.x.untyped_storage())

    @rule()
    def python_weakref_to_storage(self):
        self.keep(weakref.ref(self.x.untyped_storage()))

    @rule()
    def storage_weak_ref(self):
        self.keep(StorageWeakRef(self.x.untyped_storage()))

    @precondition(lambda self: type(self.x) is torch.Tensor)
    @rule()
    def numpy_view(self):
        self.keep(self.x.numpy())

    @rule()
    def dlpack(self):
        self.keep(torch.from_dlpack(self.x))

    @rule(hooks=st.booleans())
    def autograd_saves_x(self, hooks):
        w = torch.ones(DIM, requires_grad=True)
        if hooks:  # the hook keeps the Python object: autograd holds no handle on the memory
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                self.kept.append((self.x * w).sum())
        else:
            self.kept.append((self.x * w).sum())

    @precondition(lambda self: not self.names and type(self.x) is torch.Tensor)
    @rule()
    def subclass(self):
        x = self.x
        self.x = torch.Tensor._make_subclass(Slotted, x)  # the old handle dies with this frame
        del x

    @rule(mode=st.sampled_from(["dispatch", "function"]))
    def mode_around_the_call(self, mode):
        self.mode = mode

    @rule()
    def thread_taking_views(self):
        self.thread = True

    @precondition(lambda self: self.names)
    @rule(i=st.integers(0, 10))
    def drop_a_name(self, i):
        del self.names[i % len(self.names)]

    # -- the donation --------------------------------------------------------------------------

    @rule()
    def donate(self):
        x, c = self.x, self.c
        before = (type(x), x.untyped_storage().data_ptr(), tuple(x.shape), x.stride(), x.detach().clone())
        others = [
            n.detach().clone() if isinstance(n, torch.Tensor) else n.copy() if isinstance(n, np.ndarray) else None
            for n in self.names
        ]
        with torch.no_grad():
            expected = self.block(before[-1].clone(), c)
        mode = {"dispatch": KeepEverything, "function": SeeTorchCalls}.get(self.mode)
        taker = ViewTaker(x) if self.thread else None
        error = y = None
        try:
            with torch.no_grad():
                if taker:
                    taker.__enter__()
                try:
                    if mode:
                        with mode() as active:
                            y = self.module.forward_owned(x, c, donate=True)
                            self.kept.append(active)
                    else:
                        y = self.module.forward_owned(x, c, donate=True)
                finally:
                    if taker:
                        taker.__exit__()
                        self.names += taker.views
        except (ValueError, TypeError, RuntimeError) as e:
            error = e
        if error is None:
            self.accepted(x, y, expected)
        elif isinstance(x, DonatedTensor):
            assert isinstance(error, DonationConsumed), repr(error)
        else:
            self.refused(x, before, others, expected, error)
        self.outcomes.append("accepted" if error is None else "refused")
        self.episode()

    def accepted(self, x, y, expected):
        assert isinstance(x, DonatedTensor), type(x)
        got = y.as_subclass(torch.Tensor) if isinstance(y, torch.Tensor) else y
        assert rel_err(got, expected) <= TOL
        span = (y.data_ptr(), y.data_ptr() + y.numel() * y.element_size())
        live = [n for n in self.names + self.kept if reads(n, span)]
        assert not live, f"accepted, but {len(live)} live name(s) read the output: {[type(n).__name__ for n in live]}"

    def refused(self, x, before, others, expected, error):
        assert isinstance(error, (OwnershipError, TypeError)) or "nothing was donated" in str(error), repr(error)
        cls, ptr, shape, stride, data = before
        assert type(x) is cls, type(x)
        assert (x.untyped_storage().data_ptr(), tuple(x.shape), x.stride()) == (ptr, shape, stride)
        assert same_bits(x, data), "refused, but x's bytes changed"
        for name, was in zip(self.names, others):
            if isinstance(name, torch.Tensor):
                assert same_bits(name, was), "refused, but another name changed"
            elif isinstance(name, np.ndarray):
                assert np.array_equal(name, was)
        with torch.no_grad():  # still usable, and still right
            got = self.module.forward_owned(x, self.c, donate=False) if self.mode is None else None
        if got is not None:
            assert rel_err(got.as_subclass(torch.Tensor), expected) <= TOL

    def teardown(self):
        """Every example ends with a donation of what its steps made (so 500 examples donate at
        least 500 times)."""
        if hasattr(self, "x"):
            self.donate()

    @invariant()
    def never_an_unmarked_empty_tensor(self):
        x = getattr(self, "x", None)
        if x is not None and not isinstance(x, DonatedTensor):
            assert x.numel() > 0, "x was emptied and not marked donated"


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["RustBlock", "CppBlock", "raw-rust", "raw-cpp"])
def test_donation_is_a_transaction(entry):
    machine = type(f"Donation_{entry.replace('-', '_')}", (Donation,), {"entry": entry, "outcomes": []})
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES,
        stateful_step_count=8,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )
    machine.TestCase().runTest()
    seen = {o: machine.outcomes.count(o) for o in ("accepted", "refused")}
    assert min(seen.values()) >= 100, seen  # both sides of the invariant were exercised
