"""What this crate reproduces exactly: one definition, for ``RustBlock.from_torch`` and the swap.

:func:`read_block` reads a PyTorch block, a CompVis-layout one (``plusequals.BasicTransformerBlock``,
an independent CompVis implementation) or a diffusers ``BasicTransformerBlock``, and returns a
:class:`Reading`: the Rust block's configuration (:class:`BlockSpec`), where each of its weights
sits in the module (the *slots*), every reason it cannot reproduce the block exactly, and a
:class:`Watch` of everything it looked at.

A block is reproduced exactly when the Rust block computes its forward: ``x = op(norm(x)) + x``
three times, with

* LayerNorm (``nn.LayerNorm`` itself) over the last dimension, eps ``1e-5``, with affine weight and bias;
* attention with one head count for ``attn1`` and ``attn2``, bias-free q/k/v projections, an
  output projection with a bias, softmax scale ``d_head ** -0.5`` and no mask; in diffusers,
  the default processor (``AttnProcessor2_0`` or ``AttnProcessor``) and none of its options;
* a feed-forward of width ``4 * dim``: GEGLU with the exact GELU (SD v1), or a linear layer and
  the exact GELU (``nn.GELU()``, diffusers' ``activation_fn="gelu"``), then a linear layer with a bias;
* every ``nn.Dropout`` at ``p == 0``, or in eval mode (where dropout is the identity);
* no hooks (the Rust block would bypass them), no buffers, and exactly the expected parameters.

Anything else is refused, naming the module path and the cause. A block whose classes this
module does not know (an independent CompVis implementation) is accepted when its layout
and leaves pass these checks *and* its output agrees with the Rust block's on a probe input
(:func:`probe`); on the meta device, or in a dtype other than fp32/fp64, the probe is skipped.

The :class:`Watch` is how a block made from a module stays current (``RustBlock._ensure_current``):
each call compares the values the reading looked at (submodules, parameters by identity;
``eps``, ``p``, ``training`` where it matters, processors, ...) with what they are now, checks
that no hook appeared, and reads the block again when anything differs.
"""

from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["BlockSpec", "Reading", "UnsupportedBlockError", "Watch", "read_block", "rust_keys", "probe"]

#: The six submodules of a block, in diffusers' registration order (the CompVis order differs;
#: state_dict keys are the same).
CHILDREN = ("norm1", "attn1", "norm2", "attn2", "norm3", "ff")

#: Processors whose semantics the Rust block reproduces: unmasked softmax(q k^T / sqrt(d)) v, no
#: dropout. AttnProcessor2_0 is diffusers' default under torch 2; AttnProcessor is the same maths
#: without SDPA (it honours ``attn.scale`` and upcasting, which are checked separately).
SUPPORTED_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")

LAYER_NORM_EPS = 1e-5


class UnsupportedBlockError(ValueError):
    """A block, or a call, that the Rust block cannot reproduce exactly."""


@dataclass(frozen=True)
class BlockSpec:
    """The Rust block's constructor arguments (what the weights alone do not tell)."""

    dim: int
    n_heads: int
    d_head: int
    context_dim: Optional[int]
    gated_ff: bool
    attention: str

    @property
    def keys(self) -> Tuple[str, ...]:
        return rust_keys(self.gated_ff)

    def config(self) -> Dict[str, Any]:
        return dict(dim=self.dim, n_heads=self.n_heads, d_head=self.d_head, context_dim=self.context_dim,
                    gated_ff=self.gated_ff, attention=self.attention)


def rust_keys(gated_ff: bool) -> Tuple[str, ...]:
    """The Rust block's weights by CompVis key, in the order the custom ops take them."""
    proj = "ff.net.0.proj" if gated_ff else "ff.net.0.0"
    keys = []
    for attn in ("attn1", "attn2"):
        keys += [f"{attn}.to_q.weight", f"{attn}.to_k.weight", f"{attn}.to_v.weight",
                 f"{attn}.to_out.0.weight", f"{attn}.to_out.0.bias"]
    keys += [f"{proj}.weight", f"{proj}.bias", "ff.net.2.weight", "ff.net.2.bias"]
    for norm in ("norm1", "norm2", "norm3"):
        keys += [f"{norm}.weight", f"{norm}.bias"]
    return tuple(keys)


# --------------------------------------------------------------------------------------------
# The watch: what a reading looked at
# --------------------------------------------------------------------------------------------


class Watch:
    """Every value a reading looked at, with the dict it sits in (a module's ``__dict__``,
    ``_modules`` or ``_parameters``), and the size of each instance ``__dict__`` read from.
    :meth:`unchanged` compares them in C loops: tensors (parameters) by identity, other values
    by ``==``, and the sizes (an attribute set later on an instance, such as accelerate's
    ``_hf_hook`` and ``forward``). Hook dicts must stay empty. A change only costs a second
    reading, so a false alarm is harmless. (A parameter, buffer or submodule *added* later,
    which the Rust block would not use, is not watched.)"""

    __slots__ = ("vdicts", "vkeys", "values", "tdicts", "tkeys", "tensors", "ldicts", "lens", "hook_dicts", "attrs",
                 "_seen", "_lseen")

    def __init__(self) -> None:
        self.vdicts: List[dict] = []
        self.vkeys: List[str] = []
        self.values: List[Any] = []
        self.tdicts: List[dict] = []
        self.tkeys: List[str] = []
        self.tensors: List[torch.Tensor] = []
        self.ldicts: List[dict] = []
        self.lens: List[int] = []
        self.hook_dicts: List[dict] = []
        # (object, name, value) of every non-tensor value: what a traced forward compares, so
        # that torch.compile guards on it (tensors reach the custom op as arguments instead).
        self.attrs: List[Tuple[Any, str, Any]] = []
        self._seen: set = set()
        self._lseen: set = set()

    def _sized(self, d: dict) -> None:
        if id(d) not in self._lseen:
            self._lseen.add(id(d))
            self.ldicts.append(d)

    def _note(self, d: dict, key: str, value: Any, obj: Any) -> Any:
        if (id(d), key) in self._seen:
            return value
        self._seen.add((id(d), key))
        if isinstance(value, torch.Tensor):
            self.tdicts.append(d)
            self.tkeys.append(key)
            self.tensors.append(value)
        else:
            self.vdicts.append(d)
            self.vkeys.append(key)
            self.values.append(value)
            self.attrs.append((obj, key, value))
        return value

    def get(self, obj: Any, name: str, default: Any = None) -> Any:
        """``getattr(obj, name, default)``, noted."""
        if isinstance(obj, nn.Module):
            for store in (obj._parameters, obj._buffers, obj._modules):
                if name in store:
                    return self._note(store, name, store[name], obj)
        d = getattr(obj, "__dict__", None)
        if d is None:
            return getattr(obj, name, default)
        self._sized(d)
        if name in d:
            return self._note(d, name, d[name], obj)
        # A class attribute, a property, or nothing: setting it on the instance later grows
        # the instance's dict, which is watched.
        return getattr(obj, name, default)

    def in_dict(self, obj: Any, name: str) -> bool:
        """Whether ``name`` is set on the instance itself (an instance-level ``forward``)."""
        self._sized(obj.__dict__)
        return name in obj.__dict__

    def hooks_of(self, module: nn.Module) -> List[str]:
        """The kinds of hooks ``module`` has; its hook dicts are watched for new ones."""
        kinds = []
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            hooks = module.__dict__.get(attr)
            if hooks is not None:
                self.hook_dicts.append(hooks)
                if hooks:
                    kinds.append(attr.strip("_"))
        if self.get(module, "_hf_hook") is not None:
            kinds.append("accelerate _hf_hook")
        if self.in_dict(module, "forward"):
            kinds.append("an instance-level forward override")
        return kinds

    def seal(self) -> "Watch":
        self.lens = list(map(len, self.ldicts))
        self._seen = self._lseen = set()
        return self

    def unchanged(self) -> bool:
        try:
            return (
                list(map(operator.getitem, self.vdicts, self.vkeys)) == self.values
                and all(map(operator.is_, map(operator.getitem, self.tdicts, self.tkeys), self.tensors))
                and list(map(len, self.ldicts)) == self.lens
                and not any(self.hook_dicts)
            )
        except (KeyError, RuntimeError):  # a key gone; a tensor where a value was (its == is elementwise)
            return False


@dataclass
class Reading:
    """What :func:`read_block` found: the spec, the weights' slots, and every refusal."""

    spec: Optional[BlockSpec]
    slots: Tuple[Tuple[nn.Module, str], ...]  # (owner module, parameter name), in spec.keys order
    paths: Tuple[str, ...]  # the same slots as attribute paths from the block ("ff.net.0.proj.weight")
    reasons: List[str]
    watch: Watch
    unknown: Tuple[str, ...]  # classes this module does not know (then the probe runs)

    def weights(self) -> List[torch.Tensor]:
        return [owner._parameters[name] for owner, name in self.slots]


# --------------------------------------------------------------------------------------------
# The reading
# --------------------------------------------------------------------------------------------


def _diffusers_modules():
    """diffusers' attention, attention_processor and activations modules (imported only for a
    diffusers block)."""
    from diffusers.models import activations, attention, attention_processor

    return attention, attention_processor, activations


def _is_diffusers_block(block: Any) -> bool:
    attention = sys.modules.get("diffusers.models.attention")
    return attention is not None and isinstance(block, attention.BasicTransformerBlock)


def _known_classes() -> set:
    from . import blocks

    known = {nn.LayerNorm, nn.Linear, nn.Dropout, nn.GELU, nn.Sequential, nn.ModuleList,
             blocks.BasicTransformerBlock, blocks.CrossAttention, blocks.FeedForward, blocks.GEGLU}
    if "diffusers.models.attention" in sys.modules:
        attention, processor, activations = _diffusers_modules()
        known |= {attention.BasicTransformerBlock, attention.FeedForward, processor.Attention,
                  activations.GEGLU, activations.GELU}
    return known


class _Reader:
    def __init__(self, root: nn.Module, kids: Dict[str, Any]) -> None:
        self.root, self.kids = root, kids
        self.w = Watch()
        self.reasons: List[str] = []
        self.slots: Dict[str, Tuple[nn.Module, str, str]] = {}  # rust key -> (owner, name, path)

    def no(self, reason: str) -> None:
        self.reasons.append(reason)

    def child(self, parent: Any, name: str) -> Any:
        return self.w.get(parent, name)

    def param(self, owner: nn.Module, name: str, path: str, key: Optional[str] = None) -> Optional[torch.Tensor]:
        p = self.w.get(owner, name)
        if isinstance(p, torch.Tensor) and name in owner._parameters:
            self.slots[key or path] = (owner, name, path)
            return p
        return None

    # -- leaves --------------------------------------------------------------------------------

    def layer_norm(self, norm: Any, name: str, dim: int) -> None:
        if type(norm) is not nn.LayerNorm:
            self.no(f"{name} is {type(norm).__name__}, not a plain nn.LayerNorm")
            return
        shape = tuple(self.w.get(norm, "normalized_shape"))
        if shape != (dim,):
            self.no(f"{name} normalises over {shape}, not ({dim},)")
        affine = norm.elementwise_affine  # not watched: forward reads the parameters (watched) instead
        weight = self.param(norm, "weight", f"{name}.weight")
        bias = self.param(norm, "bias", f"{name}.bias")
        if not affine or weight is None:
            self.no(f"{name} has no affine weight (elementwise_affine=False): parameter {name}.weight is missing")
        elif bias is None:
            self.no(f"{name} has no bias (bias=False): parameter {name}.bias is missing")
        eps = self.w.get(norm, "eps")
        if eps != LAYER_NORM_EPS:
            self.no(f"{name} has eps={eps!r}; the Rust block uses {LAYER_NORM_EPS}")

    def linear(self, lin: Any, name: str, bias: bool, key: Optional[str] = None) -> bool:
        """Checks a plain nn.Linear and notes its slots (``key``: its Rust name, when it differs)."""
        if type(lin) is not nn.Linear:
            self.no(f"{name} is {type(lin).__name__}, not a plain nn.Linear "
                    "(LoRA/PEFT or quantised layers are not supported)")
            return False
        key = key or name
        self.param(lin, "weight", f"{name}.weight", f"{key}.weight")
        b = self.param(lin, "bias", f"{name}.bias", f"{key}.bias")
        if self.w.get(lin, "bias") is None and bias:
            self.no(f"{name} has no bias: parameter {name}.bias is missing")
            return False
        if b is not None and not bias:
            self.no(f"{name} has a bias (attention_bias=True?); the Rust block's q/k/v projections have none")
            return False
        return True

    def dropout(self, m: Any, name: str) -> None:
        if type(m) is not nn.Dropout:
            self.no(f"{name} is {type(m).__name__}, not nn.Dropout")
            return
        self.dropout_p(m, name)

    def dropout_p(self, m: nn.Module, name: str) -> None:
        """Dropout is reproduced when it is the identity: p == 0, or eval mode."""
        p = self.w.get(m, "p")
        if p != 0 and self.w.get(m, "training"):
            self.no(f"{name} has dropout p={p} in training mode; the Rust block has no dropout "
                    "(call .eval() to make it the identity, or set p=0)")

    # -- the whole tree: hooks, buffers, dropouts, the parameter set ---------------------------

    def tree(self, expected: Tuple[str, ...], skip_root_hooks: bool = False) -> None:
        modules: List[Tuple[str, nn.Module]] = [("", self.root)]
        for name in CHILDREN:
            kid = self.kids.get(name)
            if isinstance(kid, nn.Module):
                modules += [(f"{name}.{sub}" if sub else name, m) for sub, m in kid.named_modules()]
        for name, other in self.root._modules.items():  # what else the block holds: its parameters count
            if name not in CHILDREN and isinstance(other, nn.Module):
                modules += [(f"{name}.{sub}" if sub else name, m) for sub, m in other.named_modules()]
        params, buffers = [], []
        for path, m in modules:
            if m is self.root:
                if not skip_root_hooks:
                    kinds = self.w.hooks_of(m)
                    if kinds:
                        self.no(f"<block> has {', '.join(kinds)}, which the Rust block would bypass")
                params += [n for n, p in m._parameters.items() if p is not None]
                buffers += [n for n, b in m._buffers.items() if b is not None]
                continue
            kinds = self.w.hooks_of(m)
            if kinds:
                self.no(f"{path} has {', '.join(kinds)}, which the Rust block would bypass")
            if isinstance(m, nn.Dropout) and type(m) is nn.Dropout:
                self.dropout_p(m, path)
            elif isinstance(m, nn.modules.dropout._DropoutNd) and m.p != 0 and m.training:
                self.no(f"{path} is {type(m).__name__} with p={m.p} in training mode")
            params += [f"{path}.{n}" for n, p in m._parameters.items() if p is not None]
            buffers += [f"{path}.{n}" for n, b in m._buffers.items() if b is not None]
        extra = [p for p in params if p not in expected]
        missing = [p for p in expected if p not in params]
        for p in extra[:4]:
            self.no(f"parameter {p} is not one the Rust block uses (extra parameters: {extra[:4]})")
        for p in missing[:4]:
            self.no(f"parameter {p} is missing")
        if buffers:
            self.no(f"it has buffers {buffers[:4]}, which the Rust block does not use")

    def result(self, spec: Optional[BlockSpec], unknown: Tuple[str, ...] = ()) -> Reading:
        slots, paths = [], []
        if spec is not None and not self.reasons:
            for key in spec.keys:
                owner, name, path = self.slots[key]
                slots.append((owner, name))
                paths.append(path)
        reasons = list(dict.fromkeys(self.reasons))  # a dropout is seen by its slot and by the tree walk
        return Reading(spec, tuple(slots), tuple(paths), reasons, self.w.seal(), unknown)


def _not_a_block(block: Any, why: str) -> TypeError:
    return TypeError(
        f"block must be a BasicTransformerBlock (CompVis layout, or diffusers' SD v1 kind), got "
        f"{type(block).__name__}: {why}"
    )


def read_block(block: Any, kids: Optional[Dict[str, Any]] = None, *, owner: Optional[nn.Module] = None,
               skip_root_hooks: bool = False) -> Reading:
    """Reads ``block`` against the definition (module docstring).

    ``kids``: the six submodules to read instead of ``block``'s own; ``owner``: the module that
    took them over (a ``RustBlock``, the swap's replacement), whose own slots for them are
    watched too. Block-level attributes are read from ``block``.
    Raises ``TypeError`` naming ``block`` when it is not a transformer block at all; every other
    problem is a reason in the returned :class:`Reading`.
    """
    from .rust import RustBlock

    if isinstance(block, RustBlock):
        raise TypeError(f"block is a {type(block).__name__} already: pass the PyTorch block it was made from")
    if not isinstance(block, nn.Module):
        raise _not_a_block(block, "not a torch.nn.Module")
    if kids is None:
        kids = {name: block._modules.get(name, getattr(block, name, None)) for name in CHILDREN}
    r = _Reader(block, kids)
    for holder in (block, owner):  # noted: a replaced submodule means a new reading
        if holder is not None:
            for name in CHILDREN:
                if name in holder._modules:
                    r.w.get(holder, name)
    if type(block).__module__.startswith("diffusers.") or _is_diffusers_block(block):
        return _read_diffusers(r, block, skip_root_hooks)
    missing = [name for name in CHILDREN if not isinstance(kids.get(name), nn.Module)]
    if missing:
        raise _not_a_block(block, f"it has no submodule {', '.join(missing)}")
    return _read_compvis(r, skip_root_hooks)


def _heads_and_scale(r: _Reader, attn1: Any, attn2: Any) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(dim, heads, d_head) from attn1, checked against attn2; None where they cannot be derived."""
    heads = r.w.get(attn1, "heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        r.no(f"attn1.heads is {heads!r}, not a positive int")
        return None, None, None
    to_q = r.child(attn1, "to_q")
    if type(to_q) is not nn.Linear:
        return None, heads, None  # the linear check names it
    # Not watched: a Linear's forward reads only its weight (whose shape the build checks).
    dim, inner = to_q.in_features, to_q.out_features
    if inner % heads:
        r.no(f"attn1.to_q width {inner} is not a multiple of heads={heads} (d_head would not be an integer)")
        return dim, heads, None
    d_head = inner // heads
    heads2 = r.w.get(attn2, "heads", heads)
    if heads2 != heads:
        r.no(f"attn1 has {heads} heads but attn2 has {heads2} heads: the Rust block uses one head count for both")
    for name, attn in (("attn1", attn1), ("attn2", attn2)):
        scale = r.w.get(attn, "scale")
        if scale is not None and not math.isclose(scale, d_head**-0.5, rel_tol=1e-12):
            r.no(f"{name}.scale is {scale}, but the Rust block uses d_head ** -0.5 = {d_head**-0.5} (d_head {d_head})")
    return dim, heads, d_head


def _attention_projections(r: _Reader, attn: Any, name: str) -> None:
    for proj in ("to_q", "to_k", "to_v"):
        r.linear(r.child(attn, proj), f"{name}.{proj}", bias=False)
    to_out = r.child(attn, "to_out")
    if type(to_out) not in (nn.Sequential, nn.ModuleList) or len(to_out) != 2:
        r.no(f"{name}.to_out is {type(to_out).__name__}, not [Linear, Dropout]")
        return
    r.linear(r.child(to_out, "0"), f"{name}.to_out.0", bias=True)
    r.dropout(r.child(to_out, "1"), f"{name}.to_out.1")


def _feed_forward(r: _Reader, ff: Any, dim: Optional[int], gated_types: tuple, gelu_types: tuple,
                  duck: bool) -> Optional[bool]:
    """Checks ``ff.net``; returns gated_ff (None when refused). ``duck``: an unknown class with
    only a ``proj`` is taken for a GEGLU (the CompVis layout; the probe checks its forward)."""
    net = r.child(ff, "net")
    if type(net) not in (nn.Sequential, nn.ModuleList):
        r.no(f"ff.net is {type(net).__name__}, not a Sequential [activation, Dropout, Linear]")
        return None
    if len(net) != 3:
        r.no(f"ff.net has {len(net)} layers, not [activation, Dropout, Linear] (final_dropout=True?)")
        return None
    act = r.child(net, "0")
    gated: Optional[bool] = None
    if type(act) in gated_types or (duck and type(act) not in gelu_types and type(act) is not nn.Sequential
                                    and isinstance(r.w.get(act, "proj"), nn.Module)
                                    and list(act._modules) == ["proj"] and not act._parameters):
        gated = True  # GEGLU: proj to twice the width, x * gelu(gate) (an unknown class: probed)
        r.linear(r.child(act, "proj"), "ff.net.0.proj", bias=True)
        width = 8 * dim if dim else None
    elif type(act) in gelu_types:  # diffusers' GELU: proj, then F.gelu(approximate=...)
        gated = False
        approximate = r.w.get(act, "approximate")
        if approximate != "none":
            r.no(f"ff.net.0 is GELU(approximate={approximate!r}); the Rust block uses the exact GELU (approximate='none')")
        r.linear(r.child(act, "proj"), "ff.net.0.proj", bias=True, key="ff.net.0.0")
        width = 4 * dim if dim else None
    elif type(act) is nn.Sequential and len(act) == 2:  # CompVis non-gated: Linear, nn.GELU()
        gated = False
        r.linear(r.child(act, "0"), "ff.net.0.0", bias=True)
        gelu = r.child(act, "1")
        if type(gelu) is not nn.GELU:
            r.no(f"ff.net.0.1 is {type(gelu).__name__}; the Rust block's feed-forward uses the exact GELU (nn.GELU())")
        elif r.w.get(gelu, "approximate") != "none":
            r.no(f"ff.net.0.1 is GELU(approximate={gelu.approximate!r}); the Rust block uses the exact GELU "
                 "(approximate='none')")
        width = 4 * dim if dim else None
    else:
        r.no(f"ff.net.0 is {type(act).__name__}; only GEGLU (exact GELU) or Linear + exact GELU are supported")
        return None
    r.dropout(r.child(net, "1"), "ff.net.1")
    r.linear(r.child(net, "2"), "ff.net.2", bias=True)
    proj = r.slots.get("ff.net.0.proj.weight" if gated else "ff.net.0.0.weight")
    if proj is not None and width is not None:
        lin = proj[0]
        if (lin.in_features, lin.out_features) != (dim, width):
            r.no(f"{proj[2].rsplit('.', 1)[0]} maps {lin.in_features} -> {lin.out_features}, expected {dim} -> {width} "
                 "(the Rust block's feed-forward is 4 x dim wide; ff_inner_dim/mult are not supported)")
    return gated


def _read_compvis(r: _Reader, skip_root_hooks: bool) -> Reading:
    from . import blocks

    kids = r.kids
    attn1, attn2, ff = kids["attn1"], kids["attn2"], kids["ff"]
    dim, heads, d_head = _heads_and_scale(r, attn1, attn2)
    attention = r.w.get(attn1, "attention", "sdpa")
    attention2 = r.w.get(attn2, "attention", "sdpa")
    if attention not in ("sdpa", "einsum"):
        r.no(f"attn1.attention is {attention!r}, not 'sdpa' or 'einsum'")
    elif attention2 != attention:
        r.no(f"attn1 computes attention with {attention!r} but attn2 with {attention2!r}; the Rust block uses one")
    for name, attn in (("attn1", attn1), ("attn2", attn2)):
        _attention_projections(r, attn, name)
    gated = _feed_forward(r, ff, dim, (blocks.GEGLU,), (), duck=True)
    context_dim = None
    to_k = attn2._modules.get("to_k")
    if type(to_k) is nn.Linear:
        context_dim = to_k.in_features
    for name in ("norm1", "norm2", "norm3"):
        r.layer_norm(kids[name], name, dim)
    r.tree(rust_keys(bool(gated)), skip_root_hooks)
    known = _known_classes()
    unknown = tuple(sorted({type(m).__qualname__ for m in [r.root, *(m for k in CHILDREN for m in kids[k].modules())]
                            if type(m) not in known}))
    spec = None
    if None not in (dim, heads, d_head, gated):
        spec = BlockSpec(dim, heads, d_head, context_dim, bool(gated), attention)
    return r.result(spec, unknown)


def _read_diffusers(r: _Reader, block: nn.Module, skip_root_hooks: bool) -> Reading:
    attention_mod, processor_mod, activations_mod = _diffusers_modules()
    if not isinstance(block, attention_mod.BasicTransformerBlock):
        raise _not_a_block(block, "a diffusers module that is not a BasicTransformerBlock")
    if type(block) is not attention_mod.BasicTransformerBlock:
        r.no(f"it is a {type(block).__qualname__}, a subclass of BasicTransformerBlock whose forward may differ")
        return r.result(None)
    w = r.w
    norm_type = w.get(block, "norm_type")
    if norm_type != "layer_norm":
        r.no(f"norm_type={norm_type!r}; only 'layer_norm' is supported")
    if w.get(block, "only_cross_attention"):
        r.no("only_cross_attention=True (attn1 attends to the encoder states)")
    if w.get(block, "double_self_attention"):
        r.no("double_self_attention=True (attn2 is a second self-attention)")
    if w.get(block, "pos_embed") is not None:
        r.no(f"positional_embeddings={w.get(block, 'positional_embeddings')!r}")
    if w.get(block, "fuser") is not None:
        r.no("attention_type is 'gated'/'gated-text-image' (GLIGEN fuser)")
    if w.get(block, "scale_shift_table") is not None:
        r.no("it has a scale_shift_table (PixArt ada_norm_single)")
    if w.get(block, "_chunk_size") is not None:
        r.no("feed-forward chunking is on (set_chunk_feed_forward / enable_forward_chunking)")
    kids = r.kids
    if kids.get("attn2") is None or kids.get("norm2") is None:
        r.no("it has no cross-attention (cross_attention_dim=None)")
    if r.reasons:
        return r.result(None)  # the structure below is not the SD v1 one; its checks would only add noise
    attn1, attn2 = kids["attn1"], kids["attn2"]
    for name, attn in (("attn1", attn1), ("attn2", attn2)):
        if type(attn) is not processor_mod.Attention:
            r.no(f"{name} is {type(attn).__name__}, not diffusers' Attention")
    if r.reasons:
        return r.result(None)
    dim, heads, d_head = _heads_and_scale(r, attn1, attn2)
    for name, attn in (("attn1", attn1), ("attn2", attn2)):
        _diffusers_attention(r, attn, name, processor_mod)
        _attention_projections(r, attn, name)
    if None not in (dim, heads, d_head):
        inner = heads * d_head
        for name, attn in (("attn1", attn1), ("attn2", attn2)):
            to_k, to_v = attn._modules.get("to_k"), attn._modules.get("to_v")
            if type(to_k) is nn.Linear and type(to_v) is nn.Linear and (to_k.out_features, to_v.out_features) != (inner, inner):
                r.no(f"{name}.to_k/to_v do not project to {inner} (grouped or multi-query attention)")
        to_k = attn1._modules.get("to_k")
        if type(to_k) is nn.Linear and to_k.in_features != dim:
            r.no(f"attn1 is meant to be self-attention but its keys read width {to_k.in_features}")
    ff = kids["ff"]
    gated = None
    if type(ff) is not attention_mod.FeedForward:
        r.no(f"ff is {type(ff).__name__}, not diffusers' FeedForward")
    else:
        gated = _feed_forward(r, ff, dim, (activations_mod.GEGLU,), (activations_mod.GELU,), duck=False)
    for name in ("norm1", "norm2", "norm3"):
        r.layer_norm(kids[name], name, dim)
    expected = tuple(k.replace("ff.net.0.0.", "ff.net.0.proj.") for k in rust_keys(bool(gated)))
    r.tree(expected, skip_root_hooks)
    context_dim = attn2.to_k.in_features if type(attn2._modules.get("to_k")) is nn.Linear else None
    spec = None
    if None not in (dim, heads, d_head, gated):
        spec = BlockSpec(dim, heads, d_head, context_dim, bool(gated), "sdpa")
    return r.result(spec)


def _diffusers_attention(r: _Reader, attn: Any, name: str, processor_mod) -> None:
    w = r.w
    processor = w.get(attn, "processor")
    supported = tuple(getattr(processor_mod, n) for n in SUPPORTED_PROCESSORS)
    if type(processor) not in supported:
        r.no(f"{name} uses attention processor {type(processor).__name__}; only {', '.join(SUPPORTED_PROCESSORS)} "
             "are supported")
    if w.get(attn, "fused_projections"):
        r.no(f"{name} has fused QKV projections (fuse_qkv_projections)")
    for flag in ("spatial_norm", "group_norm", "norm_q", "norm_k", "norm_cross", "added_kv_proj_dim", "add_q_proj",
                 "add_k_proj", "add_v_proj", "to_add_out"):
        if w.get(attn, flag) is not None:
            r.no(f"{name}.{flag} is set")
    for flag in ("residual_connection", "upcast_attention", "upcast_softmax", "only_cross_attention", "is_causal",
                 "pre_only"):
        if w.get(attn, flag, False):
            r.no(f"{name}.{flag} is True")
    factor = w.get(attn, "rescale_output_factor", 1.0)
    if factor != 1.0:
        r.no(f"{name}.rescale_output_factor is {factor}, not 1")


# --------------------------------------------------------------------------------------------
# The probe: for classes this module does not know
# --------------------------------------------------------------------------------------------

PROBE_BOUND = 1e-5  # the parity bar (README): ||a - b|| / ||b||, fp32 and fp64


def probe(block: nn.Module, rust_forward, spec: BlockSpec, weight: torch.Tensor) -> Optional[str]:
    """Runs ``block`` and the Rust block on one small seeded input and returns the reason they
    differ (None: they agree within :data:`PROBE_BOUND`, or the probe cannot run: meta device,
    a dtype other than fp32/fp64)."""
    if weight.device.type == "meta" or weight.dtype not in (torch.float32, torch.float64):
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, spec.dim, generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    c = torch.randn(2, 3, spec.context_dim or spec.dim, generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            expected = block(x, c)
        except Exception as e:  # noqa: BLE001  (reported as the reason)
            return f"its forward raised {type(e).__name__} on a probe input: {e}"
        got = rust_forward(x, c)
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return f"its forward returns {type(expected).__name__} {getattr(expected, 'shape', '')}, not a tensor of x's shape"
    err = ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
    if not err <= PROBE_BOUND:
        return (f"its output differs from the Rust block's by {err:.3g} (||a-b||/||b||, bound {PROBE_BOUND}) on a "
                "probe input: its forward does not compute the CompVis block")
    return None
