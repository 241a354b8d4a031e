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

Anything else is refused, naming the module path and the cause; so are torch's global module
hooks, which fire on every submodule (observers such as FlopCounterMode's ModuleTracker
excepted). A block whose classes this module does not know (an independent CompVis
implementation) is refused too, unless the caller passes ``trust="probe"``: then it is accepted
when its layout and leaves pass these checks *and* its output agrees with the Rust block's on a
probe input (:func:`probe`), and it is probed again whenever its dtype, device or instance state
changes. On the meta device, or in a dtype other than fp32/fp64, the probe cannot run, and waits
for a state where it can.

The :class:`Watch` is how a block made from a module stays current (``RustBlock._ensure_current``):
each call compares the values the reading looked at (submodules, parameters and unknown classes'
state by identity; ``eps``, ``p``, ``training`` where it matters, processors, ...) and the exact
class of every module with what they are now, checks that no submodule, parameter or buffer was
added and no hook appeared (global ones included), and reads the block again when anything differs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

__all__ = ["BlockSpec", "Reading", "UnsupportedBlockError", "Watch", "can_probe", "class_name", "probe", "read_block",
           "rust_keys"]

#: The six submodules of a block, in diffusers' registration order (the CompVis order differs;
#: state_dict keys are the same).
CHILDREN = ("norm1", "attn1", "norm2", "attn2", "norm3", "ff")

#: Processors whose semantics the Rust block reproduces: unmasked softmax(q k^T / sqrt(d)) v, no
#: dropout. AttnProcessor2_0 is diffusers' default under torch 2; AttnProcessor is the same maths
#: without SDPA (it honours ``attn.scale`` and upcasting, which are checked separately).
SUPPORTED_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")

#: What ``read_block`` (and ``RustBlock.from_torch``) may be told to trust: nothing beyond the
#: classes it knows (None), or classes it does not know, once a probe agrees ("probe").
TRUST = (None, "probe")

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

    return {"forward": module._global_forward_hooks, "forward pre": module._global_forward_pre_hooks,
            "backward": module._global_backward_hooks, "backward pre": module._global_backward_pre_hooks}


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
    """The kinds of global module hooks registered now, other than observers'."""
    observers = _observer_types()
    return [kind for kind, hooks in _global_hooks().items()
            if any(not isinstance(getattr(h, "__self__", None), observers) for h in hooks.values())]


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

    __slots__ = ("vdicts", "vkeys", "values", "tdicts", "tkeys", "tensors", "ldicts", "lens", "hook_dicts", "attrs",
                 "modules", "classes", "globals", "rust", "_seen", "_lseen", "_mseen")

    def __init__(self) -> None:
        self.vdicts: List[dict] = []
        self.vkeys: List[str] = []
        self.values: List[Any] = []
        self.tdicts: List[dict] = []  # tensors (parameters), and unknown classes' state
        self.tkeys: List[str] = []
        self.tensors: List[Any] = []
        self.ldicts: List[dict] = []
        self.lens: List[int] = []
        self.hook_dicts: List[dict] = []
        self.modules: List[nn.Module] = []  # every module read, and its exact class
        self.classes: List[type] = []
        self.globals: List[dict] = list(_global_hooks().values())
        self.rust: Any = None  # the Rust watch, made by seal()
        # (object, name, value) of every non-tensor value: what a traced forward compares, so
        # that torch.compile guards on it (tensors reach the custom op as arguments instead).
        self.attrs: List[Tuple[Any, str, Any]] = []
        self._seen: set = set()
        self._lseen: set = set()
        self._mseen: set = set()

    def _sized(self, d: dict) -> None:
        if id(d) not in self._lseen:
            self._lseen.add(id(d))
            self.ldicts.append(d)

    def _note(self, d: dict, key: str, value: Any, obj: Any, by_identity: bool = False) -> Any:
        if (id(d), key) in self._seen:
            return value
        self._seen.add((id(d), key))
        if by_identity or isinstance(value, torch.Tensor):
            self.tdicts.append(d)
            self.tkeys.append(key)
            self.tensors.append(value)
        else:
            self.vdicts.append(d)
            self.vkeys.append(key)
            self.values.append(value)
            self.attrs.append((obj, key, value))
        return value

    def module(self, m: nn.Module) -> None:
        """Notes ``m``'s exact class and the sizes of its submodule, parameter and buffer dicts."""
        if id(m) in self._mseen:
            return
        self._mseen.add(id(m))
        self.modules.append(m)
        self.classes.append(type(m))
        for store in (m._modules, m._parameters, m._buffers):
            self._sized(store)

    def state(self, m: nn.Module) -> None:
        """Notes every value on the instance ``m`` by identity: the state an unknown class's
        forward may read (mutation inside a value, a class attribute or a global it reads is
        beyond this: see ``RustBlock.from_torch``'s ``trust``)."""
        self._sized(m.__dict__)
        for key, value in m.__dict__.items():
            if key not in _MODULE_STORES:
                self._note(m.__dict__, key, value, m, by_identity=True)

    def get(self, obj: Any, name: str, default: Any = None) -> Any:
        """``getattr(obj, name, default)``, noted."""
        if isinstance(obj, nn.Module):  # its class and stores: tree() notes every module of the block
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
        from .. import _rust

        self.lens = list(map(len, self.ldicts))
        same = list(zip(self.vdicts, self.vkeys, self.values)) + list(zip(self.tdicts, self.tkeys, self.tensors))
        self.rust = _rust.Watch(same=same, classes=list(zip(self.modules, self.classes)),
                                sizes=list(zip(self.ldicts, self.lens)), empty=self.hook_dicts,
                                keys=[(d, list(d)) for d in self.globals])
        self._seen = self._lseen = self._mseen = set()
        return self

    def unchanged(self) -> bool:
        return self.rust.unchanged()


# What a module's __dict__ holds besides its own state: watched on their own (Watch.module, hooks_of).
_MODULE_STORES = frozenset({"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                            "_backward_hooks", "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                            "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
                            "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                            "_load_state_dict_post_hooks", "_non_persistent_buffers_set"})


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
    from ..model import blocks

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
        self.refused: List[str] = []  # module paths refused for their class: their parameters say nothing more

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

    def layer_norm(self, norm: Any, name: str, dim: Optional[int]) -> None:
        if type(norm) is not nn.LayerNorm:
            self.no(f"{name} is {class_name(norm)}, not a plain nn.LayerNorm")
            return
        shape = tuple(self.w.get(norm, "normalized_shape"))
        if dim is not None and shape != (dim,):  # dim is None when to_q is refused: no second cause
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
            self.no(f"{name} is {class_name(lin)}, not a plain nn.Linear "
                    "(LoRA/PEFT or quantised layers are not supported)")
            self.refused.append(name)
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
            self.no(f"{name} is {class_name(m)}, not nn.Dropout")
            return
        self.dropout_p(m, name)

    def dropout_p(self, m: nn.Module, name: str) -> None:
        """Dropout is reproduced when it is the identity: p == 0, or eval mode."""
        p = self.w.get(m, "p")
        if p != 0 and self.w.get(m, "training"):
            self.no(f"{name} has dropout p={p} in training mode; the Rust block has no dropout "
                    "(call .eval() to make it the identity, or set p=0)")

    # -- the whole tree: hooks, buffers, dropouts, the parameter set ---------------------------

    def tree(self, expected: Tuple[str, ...]) -> None:
        modules: List[Tuple[str, nn.Module]] = [("", self.root)]
        for name in CHILDREN:
            kid = self.kids.get(name)
            if isinstance(kid, nn.Module):
                modules += [(f"{name}.{sub}" if sub else name, m) for sub, m in kid.named_modules()]
        for name, other in self.root._modules.items():  # what else the block holds: its parameters count
            if name not in CHILDREN and isinstance(other, nn.Module):
                modules += [(f"{name}.{sub}" if sub else name, m) for sub, m in other.named_modules()]
        kinds = global_hook_kinds()
        if kinds:
            self.no(f"torch's global module {' and '.join(kinds)} hooks are registered "
                    "(torch.nn.modules.module.register_module_*_hook): they fire on the PyTorch block's submodules, "
                    "which the Rust block bypasses; remove them (handle.remove()) to run it")
        params, buffers = [], []
        for path, m in modules:
            self.w.module(m)
            if m is self.root:
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
                self.no(f"{path} is {class_name(m)} with p={m.p} in training mode")
            params += [f"{path}.{n}" for n, p in m._parameters.items() if p is not None]
            buffers += [f"{path}.{n}" for n, b in m._buffers.items() if b is not None]
        explained = tuple(f"{path}." for path in self.refused)
        extra = [p for p in params if p not in expected and not p.startswith(explained)]
        missing = [p for p in expected if p not in params and not p.startswith(explained)]
        more = lambda names: f" (and {len(names) - 4} more)" if len(names) > 4 else ""  # noqa: E731
        if extra:
            self.no(f"parameters the Rust block does not use: {', '.join(extra[:4])}{more(extra)}")
        if missing:
            self.no(f"parameters missing: {', '.join(missing[:4])}{more(missing)}")
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
               trust: Optional[str] = None) -> Reading:
    """Reads ``block`` against the definition (module docstring).

    ``kids``: the six submodules to read instead of ``block``'s own; ``owner``: the module that
    took them over (a ``RustBlock``, the swap's replacement), whose own slots for them are
    watched too. Block-level attributes are read from ``block``. ``trust="probe"`` accepts
    classes this module does not know, for the probe to check (``RustBlock.from_torch``).
    Raises ``TypeError`` naming ``block`` when it is not a transformer block at all; every other
    problem is a reason in the returned :class:`Reading`.
    """
    from .block import RustBlock

    if isinstance(block, RustBlock):
        raise TypeError(f"block is a {type(block).__name__} already: pass the PyTorch block it was made from")
    if not isinstance(block, nn.Module):
        raise _not_a_block(block, "not a torch.nn.Module")
    if kids is None:
        kids = {name: block._modules.get(name, getattr(block, name, None)) for name in CHILDREN}
    if trust not in TRUST:
        raise ValueError(f"trust must be one of {TRUST}, got {trust!r}")
    r = _Reader(block, kids)
    for name in CHILDREN:  # noted: a replaced submodule means a new reading
        if name in block._modules:
            r.w.get(block, name)
        if owner is not None and name in owner._modules:  # by identity, with no guard that would hold owner
            r.w._note(owner._modules, name, owner._modules[name], None, by_identity=True)
    if type(block).__module__.startswith("diffusers.") or _is_diffusers_block(block):
        return _read_diffusers(r, block)
    missing = [name for name in CHILDREN if not isinstance(kids.get(name), nn.Module)]
    if missing:
        raise _not_a_block(block, f"it has no submodule {', '.join(missing)}")
    return _read_compvis(r, trust)


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
        r.no(f"{name}.to_out is {class_name(to_out)}, not [Linear, Dropout]")
        return
    r.linear(r.child(to_out, "0"), f"{name}.to_out.0", bias=True)
    r.dropout(r.child(to_out, "1"), f"{name}.to_out.1")


def _feed_forward(r: _Reader, ff: Any, dim: Optional[int], gated_types: tuple, gelu_types: tuple,
                  duck: bool) -> Optional[bool]:
    """Checks ``ff.net``; returns gated_ff (None when refused). ``duck``: an unknown class with
    only a ``proj`` is taken for a GEGLU (the CompVis layout; the probe checks its forward)."""
    net = r.child(ff, "net")
    if type(net) not in (nn.Sequential, nn.ModuleList):
        r.no(f"ff.net is {class_name(net)}, not a Sequential [activation, Dropout, Linear]")
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
            r.no(f"ff.net.0.1 is {class_name(gelu)}; the Rust block's feed-forward uses the exact GELU (nn.GELU())")
        elif r.w.get(gelu, "approximate") != "none":
            r.no(f"ff.net.0.1 is GELU(approximate={gelu.approximate!r}); the Rust block uses the exact GELU "
                 "(approximate='none')")
        width = 4 * dim if dim else None
    else:
        r.no(f"ff.net.0 is {class_name(act)}; only GEGLU (exact GELU) or Linear + exact GELU are supported")
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


def _read_compvis(r: _Reader, trust: Optional[str]) -> Reading:
    from ..model import blocks

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
    r.tree(rust_keys(bool(gated)))
    known = _known_classes()
    modules = [r.root, *(m for k in CHILDREN for m in kids[k].modules())]
    strangers = [m for m in modules if type(m) not in known]
    unknown = tuple(sorted({class_name(m) for m in strangers}))
    if unknown and trust != "probe" and not r.reasons:  # refused already: the causes are named
        r.no(f"its classes {', '.join(unknown)} are not ones this crate knows, so nothing can watch what their "
             "forward reads; pass trust='probe' to accept it after a probe (see RustBlock.from_torch)")
    for m in strangers:  # what their forward may read: a change reads the block again, and probes it again
        r.w.state(m)
    spec = None
    if None not in (dim, heads, d_head, gated):
        spec = BlockSpec(dim, heads, d_head, context_dim, bool(gated), attention)
    return r.result(spec, unknown)


def _read_diffusers(r: _Reader, block: nn.Module) -> Reading:
    attention_mod, processor_mod, activations_mod = _diffusers_modules()
    if not isinstance(block, attention_mod.BasicTransformerBlock):
        raise _not_a_block(block, "a diffusers module that is not a BasicTransformerBlock")
    if type(block) is not attention_mod.BasicTransformerBlock:
        r.no(f"it is a {class_name(block)}, a subclass of BasicTransformerBlock whose forward may differ")
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
            r.no(f"{name} is {class_name(attn)}, not diffusers' Attention")
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
        r.no(f"ff is {class_name(ff)}, not diffusers' FeedForward")
    else:
        gated = _feed_forward(r, ff, dim, (activations_mod.GEGLU,), (activations_mod.GELU,), duck=False)
    for name in ("norm1", "norm2", "norm3"):
        r.layer_norm(kids[name], name, dim)
    expected = tuple(k.replace("ff.net.0.0.", "ff.net.0.proj.") for k in rust_keys(bool(gated)))
    r.tree(expected)
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
        r.no(f"{name} uses attention processor {class_name(processor)}; only {', '.join(SUPPORTED_PROCESSORS)} "
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


def can_probe(weight: torch.Tensor) -> bool:
    """Whether the probe can run on weights like ``weight``: not on the meta device (no values),
    and only in fp32 or fp64 (where :data:`PROBE_BOUND` is the parity bar)."""
    return weight.device.type != "meta" and weight.dtype in (torch.float32, torch.float64)


def probe(block: nn.Module, rust_forward, spec: BlockSpec, weight: torch.Tensor) -> Optional[str]:
    """Runs ``block`` and the Rust block on one small seeded input and returns the reason they
    differ (None: they agree within :data:`PROBE_BOUND`). Only where :func:`can_probe`."""
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
