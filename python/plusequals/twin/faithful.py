"""What this crate reproduces exactly: one definition, for ``RustBlock.from_torch`` and the swap.

:func:`read_block` reads a PyTorch block, a CompVis-layout one (``plusequals.BasicTransformerBlock``,
an independent CompVis implementation) or a diffusers ``BasicTransformerBlock``, and returns a
:class:`Reading`: the Rust block's configuration (:class:`BlockConfig`), where each of its weights
sits in the module (the *slots*), every reason it cannot reproduce the block exactly, and a
:class:`Watch` of everything it looked at.

A block is reproduced exactly when the Rust block computes its forward: ``x = op(norm(x)) + x``
three times, with

* LayerNorm (``nn.LayerNorm`` itself) over the last dimension, eps ``1e-5``, with affine weight and bias;
* attention with one head count for ``attn1`` and ``attn2``, bias-free q/k/v projections, an
  output projection with a bias, softmax scale ``d_head ** -0.5`` (masks are call arguments:
  :class:`plusequals.model.blocks.AttentionExtras`); in diffusers, one of :data:`SUPPORTED_PROCESSORS` and
  none of its options;
* each linear layer an ``nn.Linear``, or PEFT's LoRA layer on one (:mod:`plusequals.twin.lora`);
* a feed-forward of width ``4 * dim``: GEGLU with the exact GELU (SD v1), or a linear layer and
  the exact GELU (``nn.GELU()``, diffusers' ``activation_fn="gelu"``), then a linear layer with a bias;
* every ``nn.Dropout`` at ``p == 0``, or in eval mode (where dropout is the identity);
* no hooks (the Rust block would bypass them) but diffusers' layerwise casting (:mod:`plusequals.twin.casting`),
  no buffers, and exactly the expected parameters.

Anything else is refused, naming the module path and the cause; so are torch's global module
hooks, which fire on every submodule (observers such as FlopCounterMode's ModuleTracker
excepted). A block whose classes this module does not know (an independent CompVis
implementation) is refused too, unless the caller passes ``trust="probe"``: then it is accepted
when its layout and leaves pass these checks *and* its output agrees with the Rust block's on a
probe input (:func:`probe`), and it is probed again whenever its dtype, device or instance state
changes. The probe runs in the block's dtype and on its device; on the meta device it cannot run,
and waits for a device where it can.

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

from ..model import blocks
from . import casting
from .adapter import Adapter
from .config import BlockConfig, rust_keys
from .custom_diffusion import CUSTOM_DIFFUSION
from .dispatch import tracing_tensor
from .forward_code import data_descriptor
from .ip_adapter import IP_ADAPTER
from .lora import LORA, base_of, is_lora, read_lora
from .probe import PROBE_BOUND, can_probe, probe
from .watch import Watch, class_name, global_hook_kinds

__all__ = ["ADAPTERS", "CHILDREN", "PROBE_BOUND", "Reading", "TRUST", "can_probe", "probe", "read_block"]

#: The adapters a block may carry (twin/adapter.py), in the order their refusals are named.
ADAPTERS: Tuple[Adapter, ...] = (IP_ADAPTER, casting.CASTING_ADAPTER, CUSTOM_DIFFUSION, LORA)

#: The six submodules of a block, in diffusers' registration order (the CompVis order differs;
#: state_dict keys are the same).
CHILDREN = ("norm1", "attn1", "norm2", "attn2", "norm3", "ff")

#: Processors whose semantics the Rust block reproduces: softmax(q k^T / sqrt(d) + mask) v, no
#: dropout. AttnProcessor2_0 is diffusers' default under torch 2; AttnProcessor is the same maths
#: without SDPA (it honours ``attn.scale`` and upcasting, which are checked separately), and
#: SlicedAttnProcessor is AttnProcessor's maths a slice of the batch at a time (the Rust block
#: ignores the slice size: it only bounds memory).
SUPPORTED_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor", "SlicedAttnProcessor")

#: The refused processors SD users load, by class-name prefix: the feature they implement (named in the refusal).
_PROCESSOR_KINDS = {
    "IPAdapterX": "IP-Adapter with xformers: use IPAdapterAttnProcessor2_0 (set_attn_processor)",
    "CustomDiffusionX": "Custom Diffusion with xformers: use CustomDiffusionAttnProcessor2_0 (set_attn_processor)",
}

#: What ``read_block`` (and ``RustBlock.from_torch``) may be told to trust: nothing beyond the
#: classes it knows (None), or classes it does not know, once a probe agrees ("probe").
TRUST = (None, "probe")

LAYER_NORM_EPS = 1e-5


@dataclass
class Reading:
    """What :func:`read_block` found: the Rust block's configuration, where each weight sits in the
    module, every refusal, and the :class:`Watch` of what was looked at."""

    spec: Optional[BlockConfig]
    slots: Tuple[Tuple[nn.Module, str], ...]  # (owner module, parameter name), in spec.keys order
    paths: Tuple[str, ...]  # the same slots as attribute paths from the block ("ff.net.0.proj.weight")
    reasons: List[str]
    watch: Watch
    unknown: Tuple[str, ...]  # classes this module does not know (then the probe runs)
    lora_layers: Tuple[str, ...] = ()  # the paths of peft LoRA layers (twin/lora.py), active or not
    casting: Tuple[Tuple[str, nn.Module, Any], ...] = ()  # diffusers' layerwise casting hooks (twin/casting.py)
    ip_tokens: Optional[int] = None  # IP-Adapter's num_tokens[0]: a tensor context's image tokens (twin/ip_adapter.py)

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
    known = {
        nn.LayerNorm,
        nn.Linear,
        nn.Dropout,
        nn.GELU,
        nn.Sequential,
        nn.ModuleList,
        blocks.BasicTransformerBlock,
        blocks.CrossAttention,
        blocks.FeedForward,
        blocks.GEGLU,
    }
    if "peft.tuners.lora.layer" in sys.modules:
        from peft.tuners.lora.dora import DoraLinearLayer
        from peft.tuners.lora.layer import Linear as LoraLinear

        known |= {LoraLinear, DoraLinearLayer, nn.ModuleDict, nn.ParameterDict, nn.Identity}
    if "diffusers.models.attention" in sys.modules:
        attention, processor, activations = _diffusers_modules()
        known |= {
            attention.BasicTransformerBlock,
            attention.FeedForward,
            processor.Attention,
            activations.GEGLU,
            activations.GELU,
        }
    return known


class _Reader:
    def __init__(self, root: nn.Module, kids: Dict[str, Any]) -> None:
        self.root, self.kids = root, kids
        self.w = Watch()
        self.reasons: List[str] = []
        self.slots: Dict[str, Tuple[nn.Module, str, str]] = {}  # rust key -> (owner, name, path)
        self.refused: List[str] = []  # module paths refused for their class: their parameters say nothing more
        # PEFT LoRA (twin/lora.py): the layers' paths, the parameters they account for, the dropouts
        # they read themselves, and the terms (BlockConfig.lora)
        self.wrapped: List[str] = []
        self.accounted: set = set()
        self.skip_dropouts: set = set()
        self.lora: List[Tuple[str, int, float, bool, bool]] = []
        self.ip_adapter: List[float] = []  # attn2's IP-Adapter scales (twin/ip_adapter.py; BlockConfig.ip_adapter)
        self.ip_tokens: Optional[int] = None
        self.processors: List[tuple] = []  # attention processors (twin/custom_diffusion.py); BlockConfig.processors
        self.called: List[Any] = []  # what the forward calls besides modules (diffusers' processors)

    def no(self, reason: str) -> None:
        self.reasons.append(reason)

    def child(self, parent: Any, name: str) -> Any:
        return self.w.get(parent, name)

    def param(self, owner: nn.Module, name: str, path: str, key: Optional[str] = None) -> Optional[torch.Tensor]:
        p = self.w.get(owner, name)
        if not (isinstance(p, torch.Tensor) and name in owner._parameters):
            return None
        if name in owner.__dict__ or data_descriptor(type(owner), name):
            self.no(
                f"{path} is shadowed by an attribute of the {'instance' if name in owner.__dict__ else 'class'} "
                f"({class_name(owner)}), which Python's attribute lookup reads instead of the registered parameter"
            )
            return None
        self.w.exact(p)  # a __class__ assigned in place is a change
        if type(p) not in (nn.Parameter, torch.Tensor) and not tracing_tensor(p):
            self.no(
                f"{path} is a {class_name(p)}, not a plain nn.Parameter: a subclass's __torch_function__ or "
                "__torch_dispatch__ would see the PyTorch block's ops, which the Rust block bypasses"
            )
            return None
        self.slots[key or path] = (owner, name, path)
        return p

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
        """Checks a plain nn.Linear, or PEFT's LoRA layer on one, and notes its slots (``key``: its
        Rust name, when it differs)."""
        if is_lora(lin):
            return read_lora(self, lin, name, bias, key or name)
        if type(lin) is not nn.Linear:
            self.no(
                f"{name} is {class_name(lin)}, not a plain nn.Linear (LoRA/PEFT or quantised layers are not supported)"
            )
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
            self.no(
                f"{name} has dropout p={p} in training mode; the Rust block has no dropout "
                "(call .eval() to make it the identity, or set p=0)"
            )

    # -- the whole tree: hooks, buffers, dropouts, the parameter set ---------------------------

    def tree(self, expected: Tuple[str, ...]) -> None:
        modules = self._modules()
        kinds = global_hook_kinds()
        if kinds:
            self.no(
                f"torch's global module {' and '.join(kinds)} hooks are registered "
                "(torch.nn.modules.module.register_module_*_hook): they fire on the PyTorch block's submodules, "
                "which the Rust block bypasses; remove them (handle.remove()) to run it"
            )
        self.w.code_of([m for _, m in modules] + self.called)
        params, buffers = [], []
        for path, m in modules:
            self.w.module(m)
            if m is self.root:
                kinds = self.w.hooks_of(m)
                if kinds:
                    self.no(f"<block> has {', '.join(kinds)}, which the Rust block would bypass")
            else:
                self._submodule(path, m)
            prefix = f"{path}." if path else ""
            params += [f"{prefix}{n}" for n, p in m._parameters.items() if p is not None]
            buffers += [f"{prefix}{n}" for n, b in m._buffers.items() if b is not None]
        self._parameter_set(params, expected)
        if buffers:
            self.no(f"it has buffers {buffers[:4]}, which the Rust block does not use")
        self.reasons += casting.refusals(self.w.casting, self.lora)

    def _modules(self) -> List[Tuple[str, nn.Module]]:
        """Every module of the block by path, the block itself ("") first: its six submodules' trees
        (the ones read), then what else it holds (whose parameters count too)."""
        modules: List[Tuple[str, nn.Module]] = [("", self.root)]
        for name in CHILDREN:
            kid = self.kids.get(name)
            if isinstance(kid, nn.Module):
                modules += [(f"{name}.{sub}" if sub else name, m) for sub, m in kid.named_modules()]
        for name, other in self.root._modules.items():
            if name not in CHILDREN and isinstance(other, nn.Module):
                modules += [(f"{name}.{sub}" if sub else name, m) for sub, m in other.named_modules()]
        return modules

    def _submodule(self, path: str, m: nn.Module) -> None:
        """A submodule's hooks and dropout."""
        kinds = self.w.hooks_of(m, path)
        if kinds:
            self.no(f"{path} has {', '.join(kinds)}, which the Rust block would bypass")
        if id(m) in self.skip_dropouts:
            pass  # a LoRA adapter's dropout: twin/lora.py reads the active ones
        elif isinstance(m, nn.Dropout) and type(m) is nn.Dropout:
            self.dropout_p(m, path)
        elif isinstance(m, nn.modules.dropout._DropoutNd) and m.p != 0 and m.training:
            self.no(f"{path} is {class_name(m)} with p={m.p} in training mode")

    def _parameter_set(self, params: List[str], expected: Tuple[str, ...]) -> None:
        """The block's parameters are exactly the expected ones, those the adapters account for, and
        those of layers refused already (named there)."""
        explained = tuple(f"{path}." for path in self.refused)
        wrapped = tuple(f"{path}." for path in self.wrapped)  # their base layers' slots are the parameters
        used = {path for _, _, path in self.slots.values()} | self.accounted
        extra = [p for p in params if p not in expected and p not in used and not p.startswith(explained)]
        missing = [p for p in expected if p not in params and not p.startswith(explained + wrapped)]
        more = lambda names: f" (and {len(names) - 4} more)" if len(names) > 4 else ""  # noqa: E731
        if extra:
            self.no(f"parameters the Rust block does not use: {', '.join(extra[:4])}{more(extra)}")
        if missing:
            self.no(f"parameters missing: {', '.join(missing[:4])}{more(missing)}")

    def result(self, spec: Optional[BlockConfig], unknown: Tuple[str, ...] = ()) -> Reading:
        slots, paths = [], []
        if spec is not None:
            spec = spec._replace(
                lora=tuple(self.lora), ip_adapter=tuple(self.ip_adapter), processors=tuple(self.processors)
            )
        if spec is not None and not self.reasons:
            for key in spec.keys:
                owner, name, path = self.slots[key]
                slots.append((owner, name))
                paths.append(path)
        reasons = list(dict.fromkeys(self.reasons))  # a dropout is seen by its slot and by the tree walk
        watch, wrapped = self.w.seal(), tuple(self.wrapped)
        return Reading(
            spec, tuple(slots), tuple(paths), reasons, watch, unknown, wrapped, tuple(watch.casting), self.ip_tokens
        )


def _not_a_block(block: Any, why: str) -> TypeError:
    return TypeError(
        f"block must be a BasicTransformerBlock (CompVis layout, or diffusers' SD v1 kind), got "
        f"{type(block).__name__}: {why}"
    )


def require_module(block: Any) -> None:
    """Raises ``TypeError`` naming ``block`` where it cannot be a PyTorch transformer block at all."""
    if getattr(type(block), "LANGUAGE", None) in ("rust", "cpp"):  # a RustBlock, CppBlock or the swap's
        raise TypeError(f"block is a {type(block).__name__} already: pass the PyTorch block it was made from")
    if not isinstance(block, nn.Module):
        raise _not_a_block(block, "not a torch.nn.Module")


def read_block(
    block: Any,
    kids: Optional[Dict[str, Any]] = None,
    *,
    modules: Optional[Dict[str, Any]] = None,
    trust: Optional[str] = None,
) -> Reading:
    """Reads ``block`` against the definition (module docstring).

    ``kids``: the six submodules to read instead of ``block``'s own; ``modules``: the submodule
    dict of the module that took them over (a ``RustBlock``, the swap's replacement), whose own
    slots for them are watched too. Block-level attributes are read from ``block``. ``trust="probe"`` accepts
    classes this module does not know, for the probe to check (``RustBlock.from_torch``).
    Raises ``TypeError`` naming ``block`` when it is not a transformer block at all; every other
    problem is a reason in the returned :class:`Reading`.
    """
    require_module(block)
    if kids is None:
        kids = {name: block._modules.get(name, getattr(block, name, None)) for name in CHILDREN}
    if trust not in TRUST:
        raise ValueError(f"trust must be one of {TRUST}, got {trust!r}")
    r = _Reader(block, kids)
    for name in CHILDREN:  # noted: a replaced submodule means a new reading
        if name in block._modules:
            r.w.get(block, name)
        if modules is not None and name in modules:  # by identity, with no guard that would hold their module
            r.w._note(modules, name, modules[name], None, by_identity=True)
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
    to_q = base_of(r.child(attn1, "to_q"))
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


def _feed_forward(
    r: _Reader, ff: Any, dim: Optional[int], gated_types: tuple, gelu_types: tuple, duck: bool
) -> Optional[bool]:
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
    if type(act) in gated_types or (
        duck
        and type(act) not in gelu_types
        and type(act) is not nn.Sequential
        and isinstance(r.w.get(act, "proj"), nn.Module)
        and list(act._modules) == ["proj"]
        and not act._parameters
    ):
        gated = True  # GEGLU: proj to twice the width, x * gelu(gate) (an unknown class: probed)
        r.linear(r.child(act, "proj"), "ff.net.0.proj", bias=True)
        width = 8 * dim if dim else None
    elif type(act) in gelu_types:  # diffusers' GELU: proj, then F.gelu(approximate=...)
        gated = False
        approximate = r.w.get(act, "approximate")
        if approximate != "none":
            r.no(
                f"ff.net.0 is GELU(approximate={approximate!r}); the Rust block uses the exact GELU "
                "(approximate='none')"
            )
        r.linear(r.child(act, "proj"), "ff.net.0.proj", bias=True, key="ff.net.0.0")
        width = 4 * dim if dim else None
    elif type(act) is nn.Sequential and len(act) == 2:  # CompVis non-gated: Linear, nn.GELU()
        gated = False
        r.linear(r.child(act, "0"), "ff.net.0.0", bias=True)
        gelu = r.child(act, "1")
        if type(gelu) is not nn.GELU:
            r.no(f"ff.net.0.1 is {class_name(gelu)}; the Rust block's feed-forward uses the exact GELU (nn.GELU())")
        elif r.w.get(gelu, "approximate") != "none":
            r.no(
                f"ff.net.0.1 is GELU(approximate={gelu.approximate!r}); the Rust block uses the exact GELU "
                "(approximate='none')"
            )
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
            r.no(
                f"{proj[2].rsplit('.', 1)[0]} maps {lin.in_features} -> {lin.out_features}, expected {dim} -> {width} "
                "(the Rust block's feed-forward is 4 x dim wide; ff_inner_dim/mult are not supported)"
            )
    return gated


def _read_compvis(r: _Reader, trust: Optional[str]) -> Reading:
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
    to_k = base_of(attn2._modules.get("to_k"))
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
        r.no(
            f"its classes {', '.join(unknown)} are not ones this crate knows, so nothing can watch what their "
            "forward reads; pass trust='probe' to accept it after a probe (see RustBlock.from_torch)"
        )
    for m in strangers:  # what their forward may read: a change reads the block again, and probes it again
        r.w.state(m)
    spec = None
    if None not in (dim, heads, d_head, gated):
        spec = BlockConfig(dim, heads, d_head, context_dim, bool(gated), attention)
    return r.result(spec, unknown)


def _read_diffusers(r: _Reader, block: nn.Module) -> Reading:
    attention_mod, processor_mod, activations_mod = _diffusers_modules()
    if not isinstance(block, attention_mod.BasicTransformerBlock):
        raise _not_a_block(block, "a diffusers module that is not a BasicTransformerBlock")
    if type(block) is not attention_mod.BasicTransformerBlock:
        r.no(f"it is a {class_name(block)}, a subclass of BasicTransformerBlock whose forward may differ")
        return r.result(None)
    _diffusers_options(r, block)
    kids = r.kids
    if r.reasons:
        return r.result(None)  # the structure below is not the SD v1 one; its checks would only add noise
    attn1, attn2 = kids["attn1"], kids["attn2"]
    for name, attn in (("attn1", attn1), ("attn2", attn2)):
        if type(attn) is not processor_mod.Attention:
            r.no(f"{name} is {class_name(attn)}, not diffusers' Attention")
    if r.reasons:
        return r.result(None)
    dim, heads, d_head = _heads_and_scale(r, attn1, attn2)
    widths = (dim, None if None in (heads, d_head) else heads * d_head)
    for name, attn in (("attn1", attn1), ("attn2", attn2)):
        _diffusers_attention(r, attn, name, processor_mod, widths)
        _attention_projections(r, attn, name)
    if None not in (dim, heads, d_head):
        _key_widths(r, attn1, attn2, dim, heads * d_head)
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
    to_k2 = base_of(attn2._modules.get("to_k"))
    context_dim = to_k2.in_features if type(to_k2) is nn.Linear else None
    spec = None
    if None not in (dim, heads, d_head, gated):
        spec = BlockConfig(dim, heads, d_head, context_dim, bool(gated), "sdpa")
    return r.result(spec)


def _diffusers_options(r: _Reader, block: nn.Module) -> None:
    """The options of diffusers' block that the SD v1 kind leaves off, and its cross-attention."""
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
    if r.kids.get("attn2") is None or r.kids.get("norm2") is None:
        r.no("it has no cross-attention (cross_attention_dim=None)")


def _key_widths(r: _Reader, attn1: Any, attn2: Any, dim: int, inner: int) -> None:
    """Both attentions' keys and values project to ``heads * d_head``; attn1's keys read the block's width."""
    for name, attn in (("attn1", attn1), ("attn2", attn2)):
        to_k, to_v = base_of(attn._modules.get("to_k")), base_of(attn._modules.get("to_v"))
        if (
            type(to_k) is nn.Linear
            and type(to_v) is nn.Linear
            and (to_k.out_features, to_v.out_features) != (inner, inner)
        ):
            r.no(f"{name}.to_k/to_v do not project to {inner} (grouped or multi-query attention)")
    to_k = base_of(attn1._modules.get("to_k"))
    if type(to_k) is nn.Linear and to_k.in_features != dim:
        r.no(f"attn1 is meant to be self-attention but its keys read width {to_k.in_features}")


def _diffusers_attention(r: _Reader, attn: Any, name: str, processor_mod, widths: tuple) -> None:
    w = r.w
    processor = w.get(attn, "processor")
    w.exact(processor)  # its class swapped in place is a change; its code is watched (Watch.code_of)
    if getattr(processor, "__dict__", None) is not None:
        w.state(processor)
    r.called.append(processor)
    supported = tuple(getattr(processor_mod, n) for n in SUPPORTED_PROCESSORS)
    adapter = next((a for a in ADAPTERS if type(processor) in [getattr(processor_mod, n) for n in a.processors]), None)
    if adapter is not None:
        adapter.read_processor(r, processor, name, widths)
    elif type(processor) not in supported:
        kind = next((v for k, v in _PROCESSOR_KINDS.items() if type(processor).__name__.startswith(k)), None)
        r.no(
            f"{name} uses attention processor {class_name(processor)}"
            + (f" ({kind}, which the Rust block does not compute)" if kind else "")
            + f"; only {', '.join(SUPPORTED_PROCESSORS)} are supported"
        )
    if w.get(attn, "fused_projections"):
        r.no(f"{name} has fused QKV projections (fuse_qkv_projections)")
    none_flags = "spatial_norm group_norm norm_q norm_k norm_cross added_kv_proj_dim add_q_proj add_k_proj add_v_proj"
    for flag in (*none_flags.split(), "to_add_out"):
        if w.get(attn, flag) is not None:
            r.no(f"{name}.{flag} is set")
    true_flags = "residual_connection upcast_attention upcast_softmax only_cross_attention is_causal pre_only"
    for flag in true_flags.split():
        if w.get(attn, flag, False):
            r.no(f"{name}.{flag} is True")
    factor = w.get(attn, "rescale_output_factor", 1.0)
    if factor != 1.0:
        r.no(f"{name}.rescale_output_factor is {factor}, not 1")
