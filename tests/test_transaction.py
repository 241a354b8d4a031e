"""Donation is a transaction: every way the project knows to break it, tried on every
in-place entry point, and each outcome checked.

The promise, for ``forward_owned(x, context, donate=True)`` on ``RustBlock``, ``CppBlock`` and the
raw extension (``plusequals._rust.Block``, Rust and C++):

* it returns the PyTorch block's result in ``x``'s buffer, and ``x`` is marked donated; or
* it refuses before anything moves: ``x`` keeps its storage, shape, strides, dtype and bytes, is
  not marked, and is still usable; or
* it failed after the first write: ``x`` is marked donated, and the message says that its buffer
  was consumed and why the result was discarded.

Never an unmarked empty tensor, never a panic. The generated (stateful) version of the same
invariant is ``tests/test_transaction_stateful.py``.
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from plusequals import CppBlock, DonatedTensor, DonationConsumed, OwnershipError, RustBlock, _rust
from support.boundary import CTX, D_HEAD, DIM, HEADS, assert_matches, race, same_bits, small_block, small_inputs

ENTRIES = ["RustBlock", "CppBlock", "raw-rust", "raw-cpp"]

# Raised inside torch by the functorch cases: jvp registers its decompositions with torch.jit.script,
# and vmap has no batching rule for CPU flash attention (the PyTorch block's SDPA and Rust's alike).
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching"),
]


class EntryPoint:
    """One in-place entry point on a small block, and the PyTorch block it must equal."""

    def __init__(self, name: str, context_dim=CTX) -> None:
        self.name = name
        self.block = small_block(context_dim=context_dim)
        if name == "RustBlock":
            self.module = RustBlock.from_torch(self.block)
        elif name == "CppBlock":
            self.module = CppBlock.from_torch(self.block)
        else:
            self.module = _rust.Block(
                dict(self.block.named_parameters()),
                _rust.Config(
                    dim=DIM,
                    n_heads=HEADS,
                    d_head=D_HEAD,
                    context_dim=self.block.context_dim,
                    language=name.split("-")[1],
                ),
            )
        self.raw = name.startswith("raw")

    def owned(self, x, c, donate=True):
        with torch.no_grad():
            return self.module.forward_owned(x, c, donate=donate)

    def forward(self, x, c):
        return self.module.forward(x, c)

    def expected(self, x, c):
        with torch.no_grad():
            return self.block(x.clone(), c)


@pytest.fixture(params=ENTRIES)
def entry(request):
    return EntryPoint(request.param)


def record(t: torch.Tensor):
    """Everything a refusal must leave as it was: class, storage, layout, bytes."""
    return (
        type(t),
        t.untyped_storage().data_ptr(),
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.dtype,
        t.detach().clone(),
    )


def assert_intact(x, before, entry: EntryPoint, c=None):
    """A refusal left ``x`` exactly as it was and usable: it still computes the right answer."""
    cls, ptr, shape, stride, offset, dtype, data = before
    assert type(x) is cls and not isinstance(x, DonatedTensor), type(x)
    assert (x.untyped_storage().data_ptr(), tuple(x.shape), x.stride(), x.storage_offset(), x.dtype) == (
        ptr,
        shape,
        stride,
        offset,
        dtype,
    )
    assert same_bits(x, data), "x's bytes changed"
    assert_matches(entry.owned(x, c, donate=False), entry.expected(data, c))


def assert_donated(x):
    assert isinstance(x, DonatedTensor), type(x)
    with pytest.raises(RuntimeError, match="use of a donated tensor"):
        x + 1


# ----------------------------------------------------------------------------------------- weak references


def _python_weakref(x):
    return weakref.ref(x.untyped_storage())


def _storage_weak_ref(x):
    return StorageWeakRef(x.untyped_storage())


@pytest.mark.parametrize("make", [_python_weakref, _storage_weak_ref], ids=["weakref.ref(storage)", "StorageWeakRef"])
def test_a_weak_reference_to_the_storage_is_an_owner(entry, make):
    """A weak reference no use count shows can become a second name at any moment: refused,
    with its own kind, nothing moved; once it is gone, the same x is donated."""
    x, c = small_inputs()
    held = make(x)
    before = record(x)
    with pytest.raises(OwnershipError) as info:
        entry.owned(x, c)
    assert (info.value.arg, info.value.why, info.value.count) == ("x", "weak_refs", 1)
    assert "nothing was donated" in str(info.value)
    assert_intact(x, before, entry, c)
    del held
    y = entry.owned(x, c)
    assert_matches(y, entry.expected(before[-1], c))
    assert y.data_ptr() == before[1]
    assert_donated(x)


def test_a_python_weakref_to_x_itself_is_the_same_object(entry):
    """``weakref.ref(x)`` upgrades to the Python object ``x`` itself, which the donation marks:
    one object, two names, both invalidated (not an alias of the buffer)."""
    x, c = small_inputs()
    r = weakref.ref(x)
    y = entry.owned(x, c)
    assert r() is x
    assert_donated(r())
    assert_matches(y, entry.expected(small_inputs()[0], c))


def tensors_made_every_ordinary_way():
    """Tensors a caller may donate, made the ordinary ways (with no second name left)."""
    g = torch.Generator().manual_seed(0)

    def fresh():
        return torch.randn(2, 5, DIM, generator=g)

    out = {"randn": fresh(), "empty + copy": torch.empty(2, 5, DIM).copy_(fresh()), "clone": fresh().clone()}
    w = torch.randn(DIM, requires_grad=True)
    out["an op's output (grad on)"] = (fresh() * w).detach().clone()
    leaf = fresh().requires_grad_(True)
    (leaf * 2).sum().backward()
    out["a leaf after backward"] = leaf
    t = fresh()
    t.untyped_storage()  # a storage object made and dropped: PyObject preservation keeps it
    out["after untyped_storage()"] = t
    t = fresh()
    ref = weakref.ref(t.untyped_storage())
    del ref
    out["after a weakref came and went"] = t
    t = fresh()
    sw = StorageWeakRef(t.untyped_storage())
    del sw
    out["after a StorageWeakRef came and went"] = t
    out["a Parameter"] = torch.nn.Parameter(fresh())
    return out


@pytest.mark.parametrize("name", list(tensors_made_every_ordinary_way()))
def test_libtorchs_baseline_weak_count_is_not_refused(name):
    """libtorch keeps its weak count one above the weak references while a strong one lives:
    that baseline reads as 0 weak references, for tensors made every ordinary way, and their
    donation goes through."""
    x = tensors_made_every_ordinary_way()[name]
    facts = _rust.tensor_facts(x)
    assert facts["tensor_weak_refs"] == 0 and facts["storage_weak_refs"] == 0, facts
    assert facts["storage_object_weakrefs"] in (None, 0), facts
    entry = EntryPoint("RustBlock")
    _, c = small_inputs()
    expected = entry.expected(x.detach(), c)
    assert_matches(entry.owned(x, c), expected)
    assert isinstance(x, DonatedTensor)


@pytest.mark.parametrize("language", ["rust", "cpp"])
def test_a_thread_upgrading_a_storage_weak_ref_never_sees_a_write(language):
    """A thread upgrades a StorageWeakRef on x's storage over and over and reads the bytes, while
    the main thread tries to donate x: every donation is refused, so every state the thread saw
    is x's original bytes (the C++ twin once showed such a thread 5 different states)."""
    entry = EntryPoint(f"raw-{language}")
    x, c = small_inputs()
    original = x.clone()
    sw = StorageWeakRef(x.untyped_storage())
    seen, stop = set(), threading.Event()

    def upgrade_and_read():
        while not stop.is_set():
            storage = torch.UntypedStorage._new_with_weak_ptr(sw.cdata)
            if storage is not None:
                seen.add(torch.tensor([], dtype=x.dtype).set_(storage).view(x.shape).sum().item())

    thread = threading.Thread(target=upgrade_and_read)
    thread.start()
    try:
        refused = 0
        for _ in range(200):
            try:
                entry.owned(x, c)
            except OwnershipError as e:
                assert e.why == "weak_refs"
                refused += 1
    finally:
        stop.set()
        thread.join()
    assert refused == 200
    assert seen == {original.sum().item()}, seen
    assert same_bits(x, original)


# ----------------------------------------------------------------------------------------- modes


class KeepEverything(TorchDispatchMode):
    """A dispatch mode that keeps every tensor it sees: the worst a mode can do to a donation."""

    def __init__(self):
        super().__init__()
        self.kept, self.ops = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        self.kept += [a for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "mode", [lambda: FlopCounterMode(display=False), KeepEverything], ids=["FlopCounterMode", "KeepEverything"]
)
def test_under_a_dispatch_mode_donation_is_refused_naming_it_and_the_rest_is_exact(entry, mode):
    x, c = small_inputs()
    before = record(x)
    expected = entry.expected(x, c)
    with mode() as m:
        with pytest.raises(OwnershipError) as info:
            entry.owned(x, c)
        assert (info.value.arg, info.value.why) == ("x", "dispatch_modes"), info.value
        assert {"_FlopCounterMode", "KeepEverything"} & set(info.value.modes), info.value.modes
        assert any(name in str(info.value) for name in info.value.modes)  # the message names the mode
        if entry.raw:  # no custom op to route through: the raw in-place forward refuses too
            with pytest.raises(OwnershipError) as info:
                entry.owned(x, c, donate=False)
            assert info.value.why == "dispatch_modes"
        else:
            assert same_bits(entry.owned(x, c, donate=False), expected)
        assert same_bits(entry.forward(x, c).detach(), expected)
    assert_intact(x, before, entry, c)
    if isinstance(m, KeepEverything) and not entry.raw:  # forward_owned ran the block's own ops, out of place
        assert "aten.native_layer_norm.default" in m.ops and "plusequals.block_forward" not in str(m.ops), m.ops[:5]


class SeeTorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["RustBlock", "CppBlock"])
def test_under_a_function_mode_the_block_is_one_op_and_donation_is_refused(name):
    """A TorchFunctionMode sees torch calls, never Rust's: RustBlock runs the PyTorch block it
    follows, whose calls the mode sees (and the result is exact), and refuses a donation, which the
    mode would not see.
    ``torch.device(...)`` as a context manager is a function mode too, and changes nothing here."""
    entry = EntryPoint(name)
    x, c = small_inputs()
    before = record(x)
    expected = entry.expected(x, c)
    with SeeTorchCalls() as mode:
        assert same_bits(entry.forward(x, c).detach(), expected)
        assert same_bits(entry.owned(x, c, donate=False), expected)
        with pytest.raises(OwnershipError) as info:
            entry.owned(x, c)
        assert (info.value.why, info.value.modes) == ("function_modes", ["SeeTorchCalls"])
        assert "TorchFunctionMode is active (SeeTorchCalls)" in str(info.value)
    assert {"linear", "layer_norm"} <= set(mode.calls) and "block_forward" not in " ".join(mode.calls), mode.calls
    assert_intact(x, before, entry, c)
    with torch.device("cpu"):
        assert_matches(entry.owned(x, c), expected)
    assert_donated(x)


# ----------------------------------------------------------------------------------------- subclasses


class Slotted(torch.Tensor):
    __slots__ = ("tag",)


class Plain(torch.Tensor):
    pass


@pytest.mark.parametrize("cls", [Slotted, Plain, torch.nn.Parameter], ids=["__slots__", "plain", "Parameter"])
def test_a_subclass_is_donated_and_marked_with_a_class_made_for_it(entry, cls):
    """``x.__class__ = DonatedTensor`` fails for a ``__slots__`` subclass (another layout); the
    donation marks it with a class made for it, checked before anything moves. The result has
    the class the PyTorch block would give (Tensor's __torch_function__ converts to the subclass)."""
    x0, c = small_inputs()
    x = torch.Tensor._make_subclass(cls, x0.clone())  # owns its storage (as_subclass makes a view)
    expected = entry.expected(x0, c)
    y = entry.owned(x, c)
    assert_matches(y.as_subclass(torch.Tensor), expected)
    assert isinstance(x, DonatedTensor) and isinstance(x, cls)
    with pytest.raises(RuntimeError, match="use of a donated tensor"):
        x.sum()
    if cls is not torch.nn.Parameter and not entry.raw:
        assert type(y) is cls


class Logged(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Logged.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("name", ["RustBlock", "CppBlock"])
def test_a_subclass_with_its_own_torch_function_sees_the_pytorch_blocks_calls(name):
    """Its ``__torch_function__`` sees the PyTorch block's torch calls, which run in the twin's
    place (twin/delegate.py); a donation is refused, leaving it as it was."""
    entry = EntryPoint(name)
    x0, c = small_inputs()
    x = torch.Tensor._make_subclass(Logged, x0.clone())
    expected = entry.expected(x0, c)
    Logged.calls.clear()
    got = entry.forward(x, c)
    assert type(got) is Logged and same_bits(got.as_subclass(torch.Tensor).detach(), expected)
    got = entry.owned(x, c, donate=False)
    assert type(got) is Logged and same_bits(got.as_subclass(torch.Tensor), expected)
    assert {"linear", "layer_norm"} <= set(Logged.calls) and "block_forward" not in " ".join(Logged.calls)
    before = record(x)
    with pytest.raises(OwnershipError) as info:
        entry.owned(x, c)
    assert (info.value.arg, info.value.why) == ("x", "torch_function_subclass")
    assert "x is a Logged" in str(info.value)
    assert type(x) is Logged and same_bits(x, before[-1])


@pytest.mark.parametrize("which", ["x", "context"])
def test_a_torch_dispatch_subclass_gives_the_pytorch_result_or_is_refused(entry, which):
    """TwoTensor (two tensors in one, every op applied to both): forward and donate=False give the
    PyTorch block's TwoTensor; a donation is refused naming it (its Python code would be handed
    x by the in-place ops). The C++ twin once returned a plain tensor 0.578 away here."""
    x, c = small_inputs()
    if which == "x":
        xs, cs = TwoTensor(x.clone(), x * 2), c
        expected = TwoTensor(entry.expected(x, c), entry.expected(x * 2, c))
    else:
        xs, cs = x, TwoTensor(c.clone(), c * 2)
        expected = TwoTensor(entry.expected(x, c), entry.expected(x, c * 2))
    got = entry.forward(xs, cs)
    assert isinstance(got, TwoTensor) and same_bits(got.a, expected.a) and same_bits(got.b, expected.b)
    if not entry.raw:
        got = entry.owned(xs, cs, donate=False)
        assert isinstance(got, TwoTensor) and same_bits(got.a, expected.a) and same_bits(got.b, expected.b)
    with pytest.raises(OwnershipError) as info:
        entry.owned(xs, cs)
    assert (info.value.arg, info.value.why) == (which, "python_subclass"), info.value
    assert not isinstance(xs, DonatedTensor)
    target = xs if which == "x" else x
    assert same_bits(target.a if which == "x" else target, x)


# ----------------------------------------------------------------------------------------- functorch


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("transform", ["vmap", "jvp", "grad"])
def test_functorch_transforms_get_a_clear_exception_from_the_in_place_forward(entry, transform, donate):
    """Inside vmap, jvp or grad, x is a storage-less wrapper: the in-place forward refuses it with
    a ValueError that says so (it was a Rust panic). Nothing outside the transform changes."""
    x, c = small_inputs()
    xs = torch.stack([x, x * 2])
    before = xs.clone()

    def f(v):
        return entry.owned(v, c, donate=donate)

    with pytest.raises(OwnershipError) as info:
        if transform == "vmap":
            torch.func.vmap(f)(xs)
        elif transform == "jvp":
            torch.func.jvp(f, (x,), (torch.ones_like(x),))
        else:
            torch.func.grad(lambda v: f(v).sum())(x)
    assert (info.value.arg, info.value.why) == ("x", "functorch")
    assert same_bits(xs, before)


def test_forward_under_vmap_and_grad_is_the_pytorch_blocks(entry):
    """The out-of-place forward runs under functorch: its libtorch ops are batched (vmap) and
    differentiated (grad) like the PyTorch block's."""
    x, c = small_inputs()
    xs = torch.stack([x, x * 2, -x])
    expected = torch.func.vmap(lambda v: entry.block(v, c))(xs)
    assert_matches(torch.func.vmap(lambda v: entry.forward(v, c))(xs).detach(), expected.detach())
    grad = torch.func.grad(lambda v: entry.forward(v, c).sum())(x)
    assert_matches(grad, torch.func.grad(lambda v: entry.block(v, c).sum())(x))


# ----------------------------------------------------------------------------------------- the weights


@pytest.mark.parametrize("change", ["t_", "resize_"])
def test_a_weight_changed_in_place_is_refused_before_the_move(entry, change):
    """A weight's metadata changed in place (same tensor, same pointer): the block's shapes no
    longer hold. Refused before anything moves, naming the weight (it was a shape error after the
    move, with x emptied). The PyTorch block fails on it too."""
    x, c = small_inputs()
    w = entry.block.attn2.to_k.weight  # (16, 12): not square
    with torch.no_grad():
        w.t_() if change == "t_" else w.requires_grad_(False).resize_(w.numel())
    with pytest.raises(RuntimeError):
        entry.expected(x, c)
    before = record(x)
    # RustBlock and CppBlock read their module again and name the shape; the raw block names the change
    with pytest.raises(ValueError, match='weight "attn2.to_k.weight" (changed since the block was built|has shape)'):
        entry.owned(x, c)
    cls, ptr, shape, stride, offset, dtype, data = before
    assert type(x) is cls and same_bits(x, data) and x.untyped_storage().data_ptr() == ptr


def test_a_weight_written_by_another_thread_during_a_donation_is_never_lost():
    """A writer thread bumps a weight's version in bursts while donations run: each donation
    returns the exact result (x marked), or fails after its writes (x marked, the message says the
    buffer was consumed and why the result was discarded). Never an unmarked empty x (21 of 200
    were, before). Runs until both outcomes were seen."""
    entry = EntryPoint("RustBlock")
    x0, c = small_inputs()
    expected = entry.expected(x0, c)

    def attempt():
        x = x0.clone()
        try:
            y = entry.owned(x, c)
        except DonationConsumed as e:
            assert "written in place" in str(e), str(e)  # why the result was discarded
            assert isinstance(x, DonatedTensor)
            return "consumed"
        assert same_bits(y, expected) and isinstance(x, DonatedTensor)
        return "exact"

    outcomes = race(entry.block.attn1.to_q.weight, attempt, ("exact", "consumed"), least=200)
    assert outcomes["exact"] and outcomes["consumed"], outcomes


# ----------------------------------------------------------------------------------------- failures after the move


def test_a_failure_before_the_first_write_puts_the_buffer_back(entry):
    """Fault injection (rust/failpoint.rs): the donation fails after the move, before the first
    write. x gets its buffer back (same storage, shape, strides, dtype, bytes) and its class back,
    and works."""
    x, c = small_inputs()
    before = record(x)
    _rust._fail_next_forward_owned_at("before_first_write")
    with pytest.raises(RuntimeError, match="injected at BeforeFirstWrite.*nothing was donated: x is unchanged"):
        entry.owned(x, c)
    assert_intact(x, before, entry, c)
    assert_matches(entry.owned(x, c), entry.expected(before[-1], c))


def test_a_failure_after_the_first_write_marks_x_and_says_its_buffer_was_consumed(entry):
    x, c = small_inputs()
    _rust._fail_next_forward_owned_at("after_first_write")
    with pytest.raises(DonationConsumed, match="injected at AfterFirstWrite") as e:
        entry.owned(x, c)
    assert "discarded" in str(e.value)
    assert_donated(x)


def test_a_failpoint_is_this_threads_and_fires_once():
    entry = EntryPoint("raw-rust")
    x, c = small_inputs()
    _rust._fail_next_forward_owned_at("before_first_write")
    other = []
    thread = threading.Thread(target=lambda: other.append(entry.owned(small_inputs()[0], c)))
    thread.start()
    thread.join()
    assert len(other) == 1  # another thread's donation went through
    with pytest.raises(RuntimeError, match="injected"):
        entry.owned(x, c)
    assert_matches(entry.owned(x, c), entry.expected(small_inputs()[0], c))  # fired once
    _rust._fail_next_forward_owned_at(None)


def test_an_inference_tensor_outside_inference_mode_is_refused_before_the_move(entry):
    """libtorch refuses an in-place write to an inference tensor outside inference mode (and the
    `set_` a move is): refused first, with x intact. Inside inference mode it is donated."""
    x0, c = small_inputs()
    with torch.inference_mode():
        x = x0.clone()
    with pytest.raises(ValueError, match="^x is an inference tensor"):
        entry.owned(x, c)
    assert not isinstance(x, DonatedTensor) and same_bits(x, x0)
    with torch.inference_mode():
        y = entry.module.forward_owned(x, c, donate=True)
    assert_matches(y, entry.expected(x0, c))
    assert isinstance(x, DonatedTensor)


# ----------------------------------------------------------------------------------------- the argument itself


@pytest.mark.parametrize("donate", ["False", "no", [0], 0, 1, None], ids=repr)
def test_donate_must_be_a_bool(entry, donate):
    x, c = small_inputs()
    before = record(x)
    with pytest.raises(TypeError):
        entry.owned(x, c, donate=donate)
    assert_intact(x, before, entry, c)


def test_an_empty_batch_is_named_as_empty_not_as_an_overlap(entry):
    """Zero-batch x and context hold no bytes (both data pointers null): the message is about
    the empty input, never "context overlaps x"."""
    x, c = torch.empty(0, 5, DIM), torch.empty(0, 3, CTX)
    with pytest.raises(ValueError, match="^x is empty") as info:
        entry.owned(x, c)
    assert "overlap" not in str(info.value)
    assert not isinstance(x, DonatedTensor)


# ----------------------------------------------------------------------------------------- saved-tensor hooks


@pytest.mark.parametrize("hooks", ["identity", "save_on_cpu"])
def test_saved_tensor_hooks_hold_the_python_object_and_backward_fails_loudly(hooks):
    """With saved-tensor hooks that keep the Python object itself (an identity pack hook, or
    ``save_on_cpu`` on a CPU tensor, whose ``.cpu()`` returns the same object), autograd holds
    ``x``'s *Python object*, not a second handle on its memory: libtorch's counts show nothing, and
    the donation goes through. What the catalogue says, exactly: that object is marked donated,
    so the backward that unpacks it raises; it never computes a gradient from the output."""
    x, c = small_inputs()
    w = torch.randn(DIM, requires_grad=True)
    ctx = (
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        if hooks == "identity"
        else torch.autograd.graph.save_on_cpu()
    )
    with ctx:
        loss = (x * w).sum()  # mul saves x for w's gradient
    entry = EntryPoint("RustBlock")
    y = entry.owned(x, c)
    assert_matches(y, entry.expected(small_inputs()[0], c))
    assert isinstance(x, DonatedTensor)
    with pytest.raises(RuntimeError):
        loss.backward()
    assert w.grad is None


@pytest.mark.parametrize("failure", ["bad context", "before_first_write", "after_first_write"])
@pytest.mark.parametrize("name", ["RustBlock", "CppBlock"])
def test_the_custom_op_path_writes_x_only_with_a_result(name, failure):
    """``plusequals::block_forward_owned_(x!, ...)`` (what a compiled graph calls) declares that it
    writes x; it computes on its own copy and writes x only once the result exists. A refusal,
    and a failure before or after the copy's first write, leave x bitwise as it was."""
    entry = EntryPoint(name)
    x, c = small_inputs()
    before = x.clone()
    args = list(entry.module._op_args(x, c))
    if failure == "bad context":
        args[1] = c[:1]
        expected_error = ValueError
    else:
        _rust._fail_next_forward_owned_at(failure)
        expected_error = RuntimeError
    with torch.no_grad(), pytest.raises(expected_error):
        torch.ops.plusequals.block_forward_owned_(*args)
    _rust._fail_next_forward_owned_at(None)
    assert same_bits(x, before)
    with torch.no_grad():
        torch.ops.plusequals.block_forward_owned_(*entry.module._op_args(x, c))
    assert same_bits(x, entry.expected(before, c))
