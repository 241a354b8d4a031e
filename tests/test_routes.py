"""Never stale by construction: the routes by which Python reaches a forward without
touching anything a hand-written list names. Each is a change that alters what the PyTorch block
computes: a class patched (torch's ``nn.LayerNorm.forward`` and ``nn.Linear.forward``, the GEGLU's
``forward``, the attention's code), a module global replaced (``F.gelu``,
``F.scaled_dot_product_attention``, the ``F`` that the attention's module reads), the
``__class__`` of the attention processor or module and of a weight, ``_parameters``/``_buffers``/
``_modules`` replaced, an instance-dict shadow of a parameter, a ``__torch_function__`` Parameter
subclass, and a name added to a class the forward uses (a property ``eps`` on ``nn.LayerNorm``, a
``__call__`` on ``nn.Linear``, a ``__getattr__`` on the attention's class).

Generated sequences of these changes (hypothesis: each step applies a change, or undoes one made
earlier) run on ``RustBlock``, ``CppBlock`` and the swap, and after every step the Rust side must
give the changed PyTorch block's result (the oracle, fp32 CPU, <= 1e-5 relative) or refuse
(``UnsupportedBlockError``) leaving the inputs as they were; with every change undone it must work
again. Every patch is undone in ``finally``: nothing outlives an example.
"""

from __future__ import annotations

import types
from typing import Callable, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import rel_err
from support.sites import SCALE, SITES, TOL, Site, generated_sequences, run_sequence, same_or_refused


def _patch(owner, name: str, wrap: Callable) -> Callable[[], None]:
    """Sets ``owner.name`` to ``wrap(old)``; returns the undo (which also removes an attribute
    the owner did not have itself)."""
    had = name in vars(owner)
    old = getattr(owner, name)
    setattr(owner, name, wrap(old))
    return (lambda: setattr(owner, name, old)) if had else (lambda: delattr(owner, name))


def _scaled(f: Callable) -> Callable:
    def scaled(*args, **kwargs):
        return f(*args, **kwargs) * SCALE

    return scaled


def _attention_code(site: Site) -> Callable[[], None]:
    """The attention's code: a diffusers processor's ``__call__``, or the CompVis attention's
    ``forward``."""
    attn = site.block.attn1
    processor = getattr(attn, "processor", None)
    target = type(processor) if processor is not None else type(attn)
    return _patch(target, "__call__" if processor is not None else "forward", _scaled)


def _attention_class(site: Site) -> Callable[[], None]:
    """``__class__`` of the object the forward calls for attention: the processor (diffusers) or
    the attention module (CompVis), swapped in place to a subclass that scales its output."""
    attn = site.block.attn1
    obj = getattr(attn, "processor", None) or attn
    original = type(obj)
    method = "__call__" if obj is not attn else "forward"
    obj.__class__ = type("Scaled" + original.__name__, (original,), {method: _scaled(getattr(original, method))})
    return lambda: setattr(obj, "__class__", original)


def _module_global_f(site: Site) -> Callable[[], None]:
    """The ``F`` global of the attention's module, replaced by a namespace whose SDPA scales."""
    attn = site.block.attn1
    processor = getattr(attn, "processor", None)
    code = type(processor).__call__ if processor is not None else type(attn).forward
    g = code.__globals__
    fake = types.SimpleNamespace(**vars(F))
    fake.scaled_dot_product_attention = _scaled(F.scaled_dot_product_attention)
    old = g["F"]
    g["F"] = fake
    return lambda: g.__setitem__("F", old)


def _weight(site: Site) -> nn.Linear:
    return site.block.attn1.to_q


def _new_parameter(like: torch.Tensor, cls: type = nn.Parameter) -> nn.Parameter:
    return cls(like.detach() * SCALE, requires_grad=like.requires_grad)


def _parameters_replaced(site: Site) -> Callable[[], None]:
    norm = site.block.norm1
    old = norm._parameters
    norm._parameters = {**old, "weight": _new_parameter(old["weight"])}
    return lambda: setattr(norm, "_parameters", old)


def _buffers_replaced(site: Site) -> Callable[[], None]:
    norm = site.block.norm2
    old = norm._buffers
    norm._buffers = {"extra": torch.ones(1)}
    return lambda: setattr(norm, "_buffers", old)


def _modules_replaced(site: Site) -> Callable[[], None]:
    net = site.block.ff.net
    old = net._modules
    last = old["2"]
    new = nn.Linear(last.in_features, last.out_features)
    with torch.no_grad():
        new.weight.copy_(last.weight * SCALE)
        new.bias.copy_(last.bias)
    net._modules = {**old, "2": new}
    return lambda: setattr(net, "_modules", old)


def _instance_shadow(site: Site) -> Callable[[], None]:
    lin = _weight(site)
    lin.__dict__["weight"] = _new_parameter(lin._parameters["weight"])
    return lambda: lin.__dict__.pop("weight")


class ScaledParameter(nn.Parameter):
    """A Parameter subclass whose ``__torch_function__`` scales every F.linear it takes part in."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * SCALE if func is F.linear else out


def _weight_subclass(site: Site) -> Callable[[], None]:
    lin = _weight(site)
    old = lin.weight
    lin.weight = _new_parameter(old, ScaledParameter)  # the same values: only its class acts
    with torch.no_grad():
        lin.weight.div_(SCALE)
    return lambda: setattr(lin, "weight", old)


def _weight_class_swapped(site: Site) -> Callable[[], None]:
    w = site.block.attn2.to_v.weight
    w.__class__ = ScaledParameter
    return lambda: setattr(w, "__class__", nn.Parameter)


def _added(cls: type, name: str, value) -> Callable[[], None]:
    """A name the class did not have, added to it (its dict grows): undone by deleting it."""
    assert name not in vars(cls), (cls, name)
    setattr(cls, name, value)
    return lambda: delattr(cls, name)


def _scaled_call(self, *args, **kwargs):
    return nn.Module.__call__(self, *args, **kwargs) * SCALE


def _getattr_added(site: Site) -> Callable[[], None]:
    """A ``__getattr__`` on the attention's class, which the forward's ``self.to_v`` reaches (a
    submodule is no instance attribute): it hands out a scaled ``to_v``."""

    def __getattr__(self, name):
        found = nn.Module.__getattr__(self, name)
        return _scaled(found) if name == "to_v" else found

    return _added(type(site.block.attn1), "__getattr__", __getattr__)


ROUTES: Dict[str, Callable[[Site], Callable[[], None]]] = {
    "nn.LayerNorm.forward patched": lambda site: _patch(nn.LayerNorm, "forward", _scaled),
    "nn.Linear.forward patched": lambda site: _patch(nn.Linear, "forward", _scaled),
    "the GEGLU's forward patched": lambda site: _patch(type(site.block.ff.net[0]), "forward", _scaled),
    "the attention's code patched": _attention_code,
    "F.gelu replaced": lambda site: _patch(F, "gelu", _scaled),
    "F.scaled_dot_product_attention replaced": lambda site: _patch(F, "scaled_dot_product_attention", _scaled),
    "the attention module's F replaced": _module_global_f,
    "the attention's __class__ swapped": _attention_class,
    "_parameters replaced": _parameters_replaced,
    "_buffers replaced": _buffers_replaced,
    "_modules replaced": _modules_replaced,
    "an instance-dict shadow of a weight": _instance_shadow,
    "a __torch_function__ Parameter subclass": _weight_subclass,
    "a weight's __class__ swapped": _weight_class_swapped,
    "a property eps added to nn.LayerNorm": lambda site: _added(nn.LayerNorm, "eps", property(lambda self: 0.5)),
    "__call__ added to nn.Linear": lambda site: _added(nn.Linear, "__call__", _scaled_call),
    "__getattr__ added to the attention's class": _getattr_added,
}
NAMES = list(ROUTES)


@pytest.fixture(scope="module", params=SITES)
def site(request):
    return Site(request.param, request.getfixturevalue("tiny_unet") if request.param == "swap" else None)


def test_every_route_changes_the_pytorch_block(site):
    """No route is a no-op on the oracle (else following it would prove nothing), _buffers aside:
    a buffer the forward does not read changes nothing, and may still be refused."""
    before = site.pytorch()
    for name, route in ROUTES.items():
        undo = route(site)
        try:
            moved = rel_err(site.pytorch(), before) > TOL
        finally:
            undo()
        assert moved == (name != "_buffers replaced"), name
    assert rel_err(site.run(), before) <= TOL


@generated_sequences(NAMES)
def test_generated_changes_are_followed_or_refused_and_undone_work_again(site, steps):
    run_sequence(site, ROUTES, steps)


@pytest.mark.parametrize(
    "name",
    [
        "a property eps added to nn.LayerNorm",
        "__call__ added to nn.Linear",
        "__getattr__ added to the attention's class",
    ],
)
def test_a_name_added_to_a_class_the_forward_uses_is_followed_or_refused(site, name):
    """Only the names a class had when read were compared: a new one (its dict grows) is a change,
    which reads the block again and probes the new code. Undone, it works again."""
    assert rel_err(site.run(), site.pytorch()) <= TOL
    undo = ROUTES[name](site)
    try:
        same_or_refused(site, name)
    finally:
        undo()
    assert rel_err(site.run(), site.pytorch()) <= TOL
