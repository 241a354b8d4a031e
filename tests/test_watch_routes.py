"""Never stale by what the forward runs: the routes that change no dict the reading
noted by name, each followed or refused on ``RustBlock``, ``CppBlock`` and a swapped diffusers
UNet, and working again once undone.

* A function changed in place: its ``__code__``, ``__defaults__``, ``__kwdefaults__``, or a closure
  cell's contents (torch's ``nn.LayerNorm.forward``; a Python wrapper a library set as ``F.gelu``
  before the twin was made, as a user's monkeypatch would; the implicit ``Sequential.__iter__``).
* ``torch.Tensor`` methods the forward calls: ``chunk``, ``__add__`` set on ``torch.Tensor``.
* A name served by a module ``__getattr__`` (``torch._VF.dropout``, which ``F.dropout`` calls), a
  builtin shadowed in a module's globals (``iter`` in ``torch.nn.modules.container``, which every
  ``for`` over a ``Sequential`` or ``ModuleList`` calls).
* What only the run recorded at check time shows (``twin/record.py``): a global read by a helper
  that the ``F.gelu`` wrapper calls (outside torch and the block's packages, which the reading
  does not follow), a module attribute it reads through a closure cell (``ns.scale``), and an
  entry of a dict the forward took its function from (``STRATEGIES[residual]``).
* A method bound in a module's instance dict, a forward hook added after the reading, and a
  ``functools.partial`` set as ``F.gelu``.

Generated sequences of these changes (each step applies a change, or undoes one made earlier) are
checked after every step against the PyTorch model (the oracle, fp32 CPU, <= 1e-5 relative): the
same result, or a refusal that leaves the inputs bitwise as they were. Every patch is undone in
``finally``.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import sys
import types
from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import examples, rel_err
from plusequals import CppBlock, RustBlock, UnsupportedBlockError, swap_transformer_blocks
from support.sites import SCALE, TOL, Site, generated_sequences, run_sequence
from support.sites import same_or_refused as _same_or_refused

FACTOR = 1.0  # a global of this module, read by _helper: a function the reading does not follow


def _helper():
    return FACTOR


NS = types.ModuleType("plusequals_test_ns")  # a module the wrapper holds in a closure cell, not a global
NS.scale = 1.0


def _wrapper():
    """A Python ``F.gelu`` of the same maths (a library's wrapper), with a default, a keyword
    default, a closure cell and a module attribute read through a cell (``ns.scale``) that each
    take part; and another code of the same free variables."""
    gelu = F.gelu
    factor = 1.0
    ns = NS

    def wrapped_gelu(input, approximate="none", *, scale=1.0):
        return gelu(input, approximate=approximate) * (factor * scale * _helper() * ns.scale)

    def other_code(input, approximate="none", *, scale=1.0):
        return gelu(input, approximate=approximate) * (factor * scale * _helper() * ns.scale * 1.5)

    return wrapped_gelu, other_code


@pytest.fixture(scope="module", params=["RustBlock", "CppBlock", "swap"])
def site(request):
    """The site, made while ``F.gelu`` is the wrapper (put back at the end of the module)."""
    original = F.gelu
    F.gelu, other = _wrapper()
    F.gelu.other_code = other
    try:
        site = Site(request.param)
        site.gelu = F.gelu  # the wrapper the routes change, whatever F.gelu is set to later
        yield site
    finally:
        F.gelu = original


def _set(obj, name: str, value) -> Callable[[], None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old)


def _cell(f, name: str, value) -> Callable[[], None]:
    cell = f.__closure__[f.__code__.co_freevars.index(name)]
    old = cell.cell_contents
    cell.cell_contents = value
    return lambda: setattr(cell, "cell_contents", old)


def _layer_norm_scaled(self, input):  # run with torch.nn.modules.normalization's globals
    return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps) * 1.5


def _iter_scaling_a_last_linear(self):  # run with torch.nn.modules.container's globals
    items = list(self._modules.values())
    if items and type(items[-1]).__name__ == "Linear":
        items[-1] = lambda x, last=items[-1]: last(x) * 1.5
    return iter(items)


def _code(f, code) -> Callable[[], None]:
    return _set(f, "__code__", code)


def _iter_code(site: Site) -> Callable[[], None]:
    """Both containers' ``__iter__`` (a ``for`` over ``ff.net`` reaches it implicitly) run other code."""
    undos = [_code(cls.__iter__, _iter_scaling_a_last_linear.__code__) for cls in (nn.Sequential, nn.ModuleList)]
    return lambda: [undo() for undo in reversed(undos)]


def _iter_shadowed(site: Site) -> Callable[[], None]:
    """A global ``iter`` in torch.nn.modules.container, shadowing the builtin that the containers'
    ``__iter__`` calls: it scales a last ``Linear`` (the feed-forward's output)."""
    g = nn.Sequential.__iter__.__globals__

    def iter(values):
        items = list(values)
        if items and type(items[-1]) is nn.Linear:
            last = items[-1]
            items[-1] = lambda x: last(x) * SCALE
        return builtins.iter(items)

    assert "iter" not in g
    g["iter"] = iter
    return lambda: g.pop("iter")


def _added(owner, name: str, value) -> Callable[[], None]:
    assert name not in vars(owner), (owner, name)
    setattr(owner, name, value)
    return lambda: delattr(owner, name)


def _chunk_scaled(self, *args, **kwargs):
    return tuple(t * SCALE for t in torch._C.TensorBase.chunk(self, *args, **kwargs))


def _add_scaled(self, other):
    return torch._C.TensorBase.__add__(self, other) * SCALE


def _instance_forward(site: Site) -> Callable[[], None]:
    """A bound method in the attention module's instance dict: ``self.forward`` finds it first."""
    attn = site.block.attn1
    forward = type(attn).forward

    def scaled(self, *args, **kwargs):
        return forward(self, *args, **kwargs) * SCALE

    attn.__dict__["forward"] = types.MethodType(scaled, attn)
    return lambda: attn.__dict__.pop("forward")


def _hook_added(site: Site) -> Callable[[], None]:
    handle = site.block.ff.register_forward_hook(lambda module, args, out: out * SCALE)
    return handle.remove


def _call_impl_shadowed(site: Site) -> Callable[[], None]:
    """``_call_impl`` (which ``nn.Module.__call__`` calls by name) shadowed on the feed-forward's last
    linear: ``self._call_impl`` finds the instance's first."""
    lin = site.block.ff.net[2]
    call = lin._call_impl
    lin.__dict__["_call_impl"] = lambda *args, **kwargs: call(*args, **kwargs) * SCALE
    return lambda: lin.__dict__.pop("_call_impl")


def _hook_dict_replaced(site: Site) -> Callable[[], None]:
    """The feed-forward's hook dict replaced by one that holds a hook (torch itself reassigns these
    dicts): the dict noted empty stays empty, the attribute holds another."""
    ff = site.block.ff
    old = ff._forward_hooks
    ff._forward_hooks = type(old)({0: lambda module, args, out: out * SCALE})
    return lambda: setattr(ff, "_forward_hooks", old)


def _compiled_call(site: Site) -> Callable[[], None]:
    """What ``module.compile()`` sets on the feed-forward (``_compiled_call_impl``, which
    ``nn.Module.__call__`` runs instead of ``_call_impl``), with a backend that scales."""
    ff = site.block.ff
    ff._compiled_call_impl = lambda *args, **kwargs: ff._call_impl(*args, **kwargs) * SCALE
    return lambda: delattr(ff, "_compiled_call_impl")


class _ScalingModule(nn.Module):
    """A base whose ``__call__`` scales what the module's own call returns."""

    def __call__(self, *args, **kwargs):
        return nn.Module.__call__(self, *args, **kwargs) * SCALE


def _bases_reassigned(site: Site) -> Callable[[], None]:
    """The GEGLU class's ``__bases__`` reassigned to a base whose ``__call__`` scales (in no dict and
    no function: its ``__mro__`` is a new tuple)."""
    cls = type(site.block.ff.net[0])
    bases = cls.__bases__
    cls.__bases__ = (_ScalingModule,)
    return lambda: setattr(cls, "__bases__", bases)


ROUTES: Dict[str, Callable[[Site], Callable[[], None]]] = {
    # 1. a function changed in place
    "nn.LayerNorm.forward's __code__ replaced": lambda site: _code(nn.LayerNorm.forward, _layer_norm_scaled.__code__),
    "F.gelu's __code__ replaced": lambda site: _code(site.gelu, site.gelu.other_code.__code__),
    "F.gelu's __defaults__ set": lambda site: _set(site.gelu, "__defaults__", ("tanh",)),
    "F.gelu's __kwdefaults__ set": lambda site: _set(site.gelu, "__kwdefaults__", {"scale": SCALE}),
    "F.gelu's closure cell set": lambda site: _cell(site.gelu, "factor", SCALE),
    # 2. torch.Tensor's methods
    "torch.Tensor.chunk set": lambda site: _added(torch.Tensor, "chunk", _chunk_scaled),
    "torch.Tensor.__add__ set": lambda site: _added(torch.Tensor, "__add__", _add_scaled),
    # 4. what only the recorded run saw: a global read by a helper outside torch and the packages
    "a global the wrapper's helper reads set": lambda site: _set(sys.modules[__name__], "FACTOR", SCALE),
    # 3. a module's __getattr__, a shadowed builtin, implicit dunders
    "torch._VF.dropout set": lambda site: _added(torch._VF, "dropout", lambda input, p, train: input * SCALE),
    "iter shadowed in torch.nn.modules.container": _iter_shadowed,
    "the containers' __iter__ code replaced": _iter_code,
    # 5. more routes: a module attribute read through a closure cell, an instance-dict method,
    # a hook added after the reading, a functools.partial set as a global
    "a module attribute the wrapper reads through a cell set": lambda site: _set(NS, "scale", SCALE),
    "a forward bound on the attention's instance": _instance_forward,
    "a forward hook added to the feed-forward": _hook_added,
    "F.gelu set to a functools.partial": lambda site: _set(F, "gelu", functools.partial(F.gelu, approximate="tanh")),
    # 6. what nn.Module's call finds on the instance: a method shadowed, a hook dict replaced, a compiled call
    "_call_impl shadowed on the feed-forward's last linear": _call_impl_shadowed,
    "the feed-forward's forward-hook dict replaced": _hook_dict_replaced,
    "a compiled call set on the feed-forward": _compiled_call,
    # 7. a class's bases
    "the GEGLU class's __bases__ reassigned": _bases_reassigned,
}
NAMES = list(ROUTES)


def test_every_route_changes_the_pytorch_model(site):
    """No route is a no-op on the oracle (else following it would prove nothing)."""
    before = site.pytorch()
    assert rel_err(site.run(), before) <= TOL
    for name, route in ROUTES.items():
        undo = route(site)
        try:
            assert rel_err(site.pytorch(), before) > TOL, name
        finally:
            undo()
    assert rel_err(site.run(), before) <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_each_route_is_followed_or_refused_and_undone_works_again(site, name):
    assert rel_err(site.run(), site.pytorch()) <= TOL
    undo = ROUTES[name](site)
    try:
        _same_or_refused(site, name)
    finally:
        undo()
    assert rel_err(site.run(), site.pytorch()) <= TOL, f"{name} undone: it must work again"


@generated_sequences(NAMES)
def test_generated_changes_are_followed_or_refused_and_undone_work_again(site, steps):
    run_sequence(site, ROUTES, steps)


def _made_anew(site: Site) -> None:
    """The site's Rust side made again from the model as it is now (a refusal keeps the last)."""
    try:
        if site.name == "swap":
            site.handle.undo()
            site.handle = swap_transformer_blocks(site.torch)
        else:
            site.rust = type(site.rust).from_torch(site.block)
    except UnsupportedBlockError:
        pass


def _after_a_new_twin(route: Callable[[Site], Callable[[], None]]) -> Callable[[Site], Callable[[], None]]:
    def apply(site: Site) -> Callable[[], None]:
        _made_anew(site)
        undo = route(site)

        def undo_after_a_new_twin() -> None:
            _made_anew(site)
            undo()

        return undo_after_a_new_twin

    return apply


@generated_sequences(NAMES)
def test_a_twin_made_again_before_each_change_follows_it(site, steps):
    """``from_torch`` (or the swap) again before each change and each undo: a new twin's reading of
    the code is taken from the last one's while that one's watch holds (``Watch.code_of``), and
    must follow or refuse the next change as a first reading does."""
    run_sequence(site, {name: _after_a_new_twin(route) for name, route in ROUTES.items()}, steps)


# ------------------------------------- what the code's objects hold: a class, a partial's keywords
# ``F.gelu`` set (before the site is made) to a ``functools.partial`` of a callable object whose
# class is no global of any module: the class of an object the checked run called a method of, the
# exact class of each object the code names (``F`` itself, the partial's callable) and the partial's
# keywords are watched.


def _callable_gelu():
    """A callable of ``F.gelu``'s maths, of a class that is no module global, and another class."""
    gelu = F.gelu

    class Gelu:
        def __call__(self, input, approximate="none"):
            return gelu(input, approximate=approximate)

    class Scaled(Gelu):
        def __call__(self, input, approximate="none"):
            return gelu(input, approximate=approximate) * SCALE

    return Gelu(), Scaled


@pytest.fixture(scope="module", params=["RustBlock", "CppBlock", "swap"])
def held(request):
    original = F.gelu
    gelu, scaled = _callable_gelu()
    F.gelu = functools.partial(gelu, approximate="none")
    try:
        site = Site(request.param)
        site.scaled, site.partial = scaled, F.gelu  # as the routes find them (F's class may change)
        yield site
    finally:
        F.gelu = original


def _module_class(site: Site) -> Callable[[], None]:
    """``F.__class__`` set to a ``ModuleType`` subclass whose ``__getattribute__`` scales ``gelu``:
    no dict changes, only the module's class."""

    class Scaling(types.ModuleType):
        def __getattribute__(self, name):
            found = super().__getattribute__(name)
            return functools.partial(_scaled_call_of, found) if name == "gelu" else found

    F.__class__ = Scaling
    return lambda: setattr(F, "__class__", types.ModuleType)


def _scaled_call_of(f, *args, **kwargs):
    return f(*args, **kwargs) * SCALE


def _callable_class_call(site: Site) -> Callable[[], None]:
    cls = type(site.partial.func)
    old = cls.__dict__["__call__"]
    cls.__call__ = lambda self, input, approximate="none": old(self, input, approximate) * SCALE
    return lambda: setattr(cls, "__call__", old)


def _callable_class_swapped(site: Site) -> Callable[[], None]:
    obj = site.partial.func
    old = type(obj)
    obj.__class__ = site.scaled
    return lambda: setattr(obj, "__class__", old)


def _keywords(site: Site) -> Callable[[], None]:
    site.partial.keywords["approximate"] = "tanh"
    return lambda: site.partial.keywords.__setitem__("approximate", "none")


HELD: Dict[str, Callable[[Site], Callable[[], None]]] = {
    "F's __class__ set to a ModuleType subclass": _module_class,
    "the callable's class __call__ set": _callable_class_call,
    "the callable's __class__ reassigned": _callable_class_swapped,
    "the partial's keywords set": _keywords,
}


def test_every_held_route_changes_the_pytorch_model(held):
    before = held.pytorch()
    assert rel_err(held.run(), before) <= TOL
    for name, route in HELD.items():
        undo = route(held)
        try:
            assert rel_err(held.pytorch(), before) > TOL, name
        finally:
            undo()
    assert rel_err(held.run(), before) <= TOL


@pytest.mark.parametrize("name", list(HELD))
def test_what_the_codes_objects_hold_is_followed_or_refused(held, name):
    assert rel_err(held.run(), held.pytorch()) <= TOL
    undo = HELD[name](held)
    try:
        _same_or_refused(held, name)
    finally:
        undo()
    assert rel_err(held.run(), held.pytorch()) <= TOL, f"{name} undone: it must work again"


@generated_sequences(list(HELD), budget=8, longest=4)
def test_generated_changes_of_what_the_code_holds(held, steps):
    run_sequence(held, HELD, steps)


def test_an_equal_change_in_place_is_followed_on_the_hot_path():
    """A function changed in place to code of the same maths is probed and followed: the twin
    runs again, on the hot path (no refusal, no stale result)."""
    from conftest import make_block, make_inputs

    block = make_block(32, 4, 8, context_dim=24)
    x, c = make_inputs(4, dim=32)
    c = c[..., :24].contiguous()
    rust = RustBlock.from_torch(block)
    with torch.no_grad():
        assert torch.equal(rust(x, c), block(x, c))
    old = nn.LayerNorm.forward.__code__
    nn.LayerNorm.forward.__code__ = old.replace()  # a copy: another object, the same code
    try:
        with torch.no_grad():
            assert torch.equal(rust(x, c), block(x, c))
        assert rust._entry is not None and "nn.LayerNorm.forward.__code__" in rust._follow.code_ok
    finally:
        nn.LayerNorm.forward.__code__ = old


# ------------------------------------------------- a method of any module's class, shadowed on its instance


def _methods_run(block: nn.Module, x: torch.Tensor, c: torch.Tensor) -> list:
    """(path, name) of every method of a module of ``block`` that its forward runs (its own
    ``forward`` and ``nn.Module``'s ``_call_impl`` included; dunders aside, which Python's implicit
    calls look up on the class), recorded by a profile function."""
    paths = {id(m): path for path, m in block.named_modules()}
    ran = set()

    def profile(frame, event, arg):
        me = frame.f_locals.get("self") if event == "call" else None
        if id(me) in paths and not frame.f_code.co_name.startswith("__"):  # dunders: looked up on the class
            attr = inspect.getattr_static(type(me), frame.f_code.co_name, None)
            if isinstance(attr, types.FunctionType) and attr.__code__ is frame.f_code:
                ran.add((paths[id(me)], frame.f_code.co_name))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        with torch.no_grad():
            block(x, c)
    finally:
        sys.setprofile(previous)
    return sorted(ran)


def _scaled(result):
    return result * SCALE if isinstance(result, torch.Tensor) and result.is_floating_point() else result


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
@settings(max_examples=examples(24), deadline=None)
@given(data=st.data())
def test_a_method_shadowed_on_an_instance_is_followed_or_refused(cls, data):
    """Any method of a module of the block that its forward runs (``self._call_impl``, the CompVis
    block's ``_forward``, its attention's ``attend``, ...) shadowed in the instance's dict by one
    whose tensor results are scaled: ``self.<name>`` finds it first. Followed or refused, the
    inputs unchanged; undone, it works again."""
    block, rust, x, c = _small(cls)
    path, name = data.draw(st.sampled_from(_methods_run(block, x, c)), label="method")
    m = block.get_submodule(path)
    method = getattr(m, name)
    with torch.no_grad():
        assert torch.equal(rust(x, c), block(x, c))
        m.__dict__[name] = lambda *args, **kwargs: _scaled(method(*args, **kwargs))
        try:
            expected = block(x, c)
            before = (x.clone(), c.clone())
            try:
                got = rust(x, c)
            except UnsupportedBlockError as e:
                assert torch.equal(x, before[0]) and torch.equal(c, before[1]), "a refusal changed the inputs"
                assert f"{type(m).__qualname__}.{name}" in str(e) or "forward" in str(e), e
            else:
                assert rel_err(got, expected) <= TOL, f"{path}.{name} shadowed: stale"
        finally:
            del m.__dict__[name]
        assert torch.equal(rust(x, c), block(x, c)), "undone, it must work again"


class _ScaledGelu(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * SCALE if func is torch.ops.aten.gelu.default else out


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_forward_owned_under_a_dispatch_mode_computes_the_ops_the_mode_sees(cls):
    """A TorchDispatchMode sees the PyTorch block's ATen ops and may change them; ``forward_owned``
    (``donate=False``) then computes as ``forward`` does, the Rust block's own ops through the mode,
    and writes nothing in place: the PyTorch block's result under the mode, x unchanged."""
    block, rust, x, c = _small(cls)
    before = x.clone()
    with torch.no_grad():
        with _ScaledGelu():
            expected, got, forward = block(x, c), rust.forward_owned(x, c), rust(x, c)
        assert rel_err(expected, block(x, c)) > TOL, "the mode changes the PyTorch block"
        assert torch.equal(got, expected) and torch.equal(forward, expected)
        assert torch.equal(x, before)
        assert torch.equal(rust.forward_owned(x, c), block(x, c)), "once the mode exits"


def test_a_swapped_unet_owned_under_a_dispatch_mode_computes_what_the_mode_sees(tiny_unet):
    """The swap with ``owned=True`` (its blocks' ``forward_owned`` under ``no_grad``), under the mode
    above: the unswapped UNet's output under it."""
    from support.unet import unet_inputs

    unet = tiny_unet()
    inputs = unet_inputs()
    with torch.no_grad(), _ScaledGelu():
        expected = unet(*inputs).sample
    handle = swap_transformer_blocks(unet, owned=True)
    try:
        with torch.no_grad(), _ScaledGelu():
            assert rel_err(unet(*inputs).sample, expected) <= TOL
    finally:
        handle.undo()


# ------------------------------------------------- a dict entry; and what is out of contract
# Each case marked OUT_OF_CONTRACT is written in docs/guide/guarantees.md ("Out of contract"): the
# test shows the twin stale on it (strict xfail: once the watch covers it, the test fails, and the
# contract moves).


def _small(cls=RustBlock):
    from conftest import make_block, make_inputs

    block = make_block(32, 4, 8, context_dim=24)
    x, _ = make_inputs(4, dim=32)
    c = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(3))
    return block, cls.from_torch(block), x, c


def _stale_or_not(block, rust, x, c, change, undo) -> None:
    """The change is followed, or refused with the inputs unchanged; undone, it works again."""
    with torch.no_grad():
        assert torch.equal(rust(x, c), block(x, c))
        change()
        try:
            expected = block(x, c)
            before = (x.clone(), c.clone())
            try:
                got = rust(x, c)
            except UnsupportedBlockError:
                assert torch.equal(x, before[0]) and torch.equal(c, before[1]), "a refusal changed the inputs"
            else:
                assert rel_err(got, expected) <= TOL, "stale"
        finally:
            undo()
        assert torch.equal(rust(x, c), block(x, c)), "undone, it must work again"


OUT_OF_CONTRACT = pytest.mark.xfail(strict=True, raises=AssertionError, reason="out of contract: see guarantees.md")


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_an_entry_of_a_dict_the_forward_took_its_function_from(cls):
    """``STRATEGIES[residual]``: the recorded run found ``op_plus_x`` there (and as a global): the
    entry replaced is followed or refused."""
    from plusequals.model import blocks

    block, rust, x, c = _small(cls)
    old = blocks.STRATEGIES["op_plus_x"]
    _stale_or_not(
        block, rust, x, c,
        lambda: blocks.STRATEGIES.__setitem__("op_plus_x", lambda *a, **k: old(*a, **k) * SCALE),
        lambda: blocks.STRATEGIES.__setitem__("op_plus_x", old),
    )  # fmt: skip


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_a_classs_bases_reassigned(cls):
    """``GEGLU.__bases__`` reassigned to a base whose ``__call__`` scales: GEGLU's ``__mro__`` is
    a new tuple (the watch holds each noted class's MRO by identity), so the block is read again
    and the change followed or refused; undone, it works again."""
    from plusequals.model import blocks

    class Scaling(nn.Module):
        def __call__(self, *args, **kwargs):
            return nn.Module.__call__(self, *args, **kwargs) * SCALE

    block, rust, x, c = _small(cls)
    _stale_or_not(
        block, rust, x, c,
        lambda: setattr(blocks.GEGLU, "__bases__", (Scaling,)),
        lambda: setattr(blocks.GEGLU, "__bases__", (nn.Module,)),
    )  # fmt: skip


@OUT_OF_CONTRACT
def test_out_of_contract_a_branch_on_a_shape_no_check_ran():
    """``F.gelu`` replaced by one that scales only on 9 tokens: the check (run by a call of 4
    tokens: the probe's inputs of 5, 7, 2 and 4 tokens) agrees, so the twin follows; a later call
    of 9 tokens finds nothing changed. (A change equal on the probe's seeded input only is
    refused: tests/test_probe_proves.py.)"""
    original = F.gelu

    def gelu(input, approximate="none"):
        out = original(input, approximate=approximate)
        return out * SCALE if input.shape[-2] == 9 else out

    block, rust, x, c = _small()
    x9 = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        F.gelu = gelu
        try:
            assert torch.equal(rust(x, c), block(x, c))  # the check, at 4 tokens: followed
            assert rel_err(rust(x9, c), block(x9, c)) <= TOL, "stale"
        finally:
            F.gelu = original


CONFIG = {"scale": 1.0}  # a dict of values (no function) that a wrapper reads
NESTED = {"inner": {"scale": 1.0}}  # a dict of a dict of values
FACTOR2 = 1.0  # read only on a branch the probe's input does not take


def _other_helper():
    return FACTOR2


def _factor2_scaled() -> None:
    global FACTOR2
    FACTOR2 = SCALE


def _factor2_back() -> None:
    global FACTOR2
    FACTOR2 = 1.0


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_an_entry_of_a_global_dict_read_by_a_constant_key(cls):
    """A wrapper set as ``F.gelu`` reads ``CONFIG["scale"]``: the checked run executed that read,
    so the entry is watched (by identity, in ``CONFIG``): set, it is followed or refused; undone,
    it works again."""
    original = F.gelu

    def gelu(input, approximate="none"):
        return original(input, approximate=approximate) * CONFIG["scale"]

    F.gelu = gelu
    try:
        block, rust, x, c = _small(cls)
        _stale_or_not(
            block, rust, x, c, lambda: CONFIG.__setitem__("scale", SCALE), lambda: CONFIG.__setitem__("scale", 1.0)
        )
    finally:
        F.gelu = original


@OUT_OF_CONTRACT
def test_out_of_contract_a_value_inside_a_dict_the_forward_reads():
    """A wrapper set as ``F.gelu`` reads ``NESTED["inner"]["scale"]``: ``NESTED["inner"]`` is
    watched (by identity), the values inside the inner dict are not."""
    original = F.gelu

    def gelu(input, approximate="none"):
        return original(input, approximate=approximate) * NESTED["inner"]["scale"]

    F.gelu = gelu
    inner = NESTED["inner"]
    try:
        block, rust, x, c = _small()
        _stale_or_not(
            block, rust, x, c, lambda: inner.__setitem__("scale", SCALE), lambda: inner.__setitem__("scale", 1.0)
        )
    finally:
        F.gelu = original


@OUT_OF_CONTRACT
def test_out_of_contract_code_the_checked_run_did_not_reach():
    """A wrapper set as ``F.gelu`` (outside the packages the reading follows) calls a helper only
    on inputs of 9 tokens: no probe input ran it (5, 7, 2 tokens, and the checking call's), so the
    global it reads is not watched, and a call of 9 tokens is stale."""
    original = F.gelu

    def gelu(input, approximate="none"):
        out = original(input, approximate=approximate)
        return out * _other_helper() if input.shape[-2] == 9 else out

    F.gelu = gelu
    try:
        block, rust, _, c = _small()
        x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
        _stale_or_not(block, rust, x, c, _factor2_scaled, _factor2_back)
    finally:
        F.gelu = original


def test_the_recorder_chains_a_profiler_already_set_and_puts_everything_back():
    """A profiler already set (a user's cProfile) still sees every event, and is set again after;
    the garbage collector is on again; the helper's frame is recorded with its globals."""
    import gc

    from plusequals.twin.record import Recorder

    seen = []

    def previous(frame, event, arg):
        seen.append(event)

    recorder = Recorder()
    sys.setprofile(previous)
    try:
        assert recorder.call(_helper) == FACTOR
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)
    assert "call" in seen and gc.isenabled()
    assert [g for code, g, _ in recorder.ran.frames if code is _helper.__code__] == [globals()]
    notes = {n.label for n in recorder.ran.reads().notes}
    assert f"{__name__}.FACTOR" in notes and f"{__name__}._helper.__code__" in notes


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_an_instances_dict_reassigned(cls):
    """``attn1.__dict__`` replaced by a copy holding a bound ``forward``: the old dict is unchanged
    (its tag with it), but the watch holds each instance's pointer to its dict: followed or
    refused, and undone it works again."""
    block, rust, x, c = _small(cls)
    attn = block.attn1
    old = attn.__dict__
    forward = type(attn).forward

    def change():
        d = dict(old)
        d["forward"] = types.MethodType(lambda self, *a, **k: forward(self, *a, **k) * SCALE, attn)
        attn.__dict__ = d

    _stale_or_not(block, rust, x, c, change, lambda: setattr(attn, "__dict__", old))


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_a_partial_rebuilt_by_setstate(cls):
    """``F.gelu`` a ``functools.partial``: ``__setstate__`` puts a new keywords dict (and may put
    a new ``func`` and ``args``) in place, the partial the same object; the watch holds the three
    fields: followed or refused, and undone it works again."""
    original = F.gelu
    F.gelu = functools.partial(original, approximate="none")
    try:
        block, rust, x, c = _small(cls)
        partial = F.gelu
        _stale_or_not(
            block, rust, x, c,
            lambda: partial.__setstate__((original, (), {"approximate": "tanh"}, None)),
            lambda: partial.__setstate__((original, (), {"approximate": "none"}, None)),
        )  # fmt: skip
    finally:
        F.gelu = original


def _act(self, x, scale):
    return F.gelu(x) * scale


def _geglu_forward(self, x):
    x, gate = self.proj(x).chunk(2, dim=-1)
    return x * self.act(gate)


@pytest.mark.parametrize("change", ["keywords", "func"])
@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_a_partialmethods_keywords_or_func_set_in_place(cls, change):
    """GEGLU calling ``self.act``, a ``functools.partialmethod`` in its class dict: one of its
    keywords set in the keywords dict, or its ``func`` set on it (the partialmethod the same
    object in the same class dict): followed or refused, and undone it works again."""
    from plusequals.model import blocks

    saved = {name: blocks.GEGLU.__dict__.get(name) for name in ("act", "forward")}
    blocks.GEGLU.act = functools.partialmethod(_act, scale=1.0)
    blocks.GEGLU.forward = _geglu_forward
    try:
        block, rust, x, c = _small(cls)
        pm = blocks.GEGLU.__dict__["act"]
        if change == "keywords":
            _stale_or_not(
                block, rust, x, c,
                lambda: pm.keywords.__setitem__("scale", SCALE),
                lambda: pm.keywords.__setitem__("scale", 1.0),
            )  # fmt: skip
        else:
            _stale_or_not(
                block, rust, x, c,
                lambda: setattr(pm, "func", lambda self, x, scale: F.gelu(x) * SCALE),
                lambda: setattr(pm, "func", _act),
            )  # fmt: skip
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(blocks.GEGLU, name)
            else:
                setattr(blocks.GEGLU, name, value)


def test_a_c_profiler_on_while_the_twin_is_checked():
    """cProfile on while the twin is made: a global read by a helper of a wrapper set as ``F.gelu``
    (which only the recorded run finds) is watched, changed later it is followed or refused. On
    3.11 ``sys.setprofile`` cannot chain a C profiler, and the trace function records the check's
    run instead; 3.12's recorder (``sys.monitoring``) runs beside it."""
    import cProfile

    original = F.gelu

    def gelu(input, approximate="none"):
        return original(input, approximate=approximate) * _other_helper()

    F.gelu = gelu
    profiler = cProfile.Profile()
    try:
        profiler.enable()
        try:
            block, rust, x, c = _small()
        finally:
            profiler.disable()
        _stale_or_not(block, rust, x, c, _factor2_scaled, _factor2_back)
    finally:
        F.gelu = original
