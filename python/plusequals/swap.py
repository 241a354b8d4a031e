"""Drop-in: the Rust block inside a real diffusers UNet.

:func:`swap_transformer_blocks` replaces every diffusers ``BasicTransformerBlock`` of the SD v1
kind in a model (a ``UNet2DConditionModel``, say) with a :class:`RustTransformerBlock`, which
runs ``plusequals._rust`` on the *same* parameter tensors (no copies) and accepts diffusers'
call signature. It is all-or-nothing: every block is checked (and its Rust twin built) before
the first one is replaced, and one block of an unsupported kind refuses the whole swap with an
:class:`UnsupportedBlockError` naming each offending module path and why.

The returned :class:`SwapHandle` lists what was replaced and undoes it
(``handle.undo()``, :func:`unswap_transformer_blocks`, or ``with swap_transformer_blocks(unet):``).

The replacement registers the original block's own submodules (``norm1, attn1, norm2, attn2,
norm3, ff``) under the same names, so the model's ``state_dict`` keys, ``parameters()``,
``attn_processors`` and ``.to()`` behave as before; it rebuilds its Rust twin whenever the
parameters it was built on change identity, storage, dtype or device (``.to()``, ``.half()``,
``load_state_dict(assign=True)``), and refuses to run once something it cannot honour appears
(a non-default attention processor, PEFT/LoRA layers injected into the projections, ...).

diffusers is optional: this module imports it only when a function needs it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from .rust import RustBlock

__all__ = [
    "RustTransformerBlock",
    "SwapHandle",
    "Swapped",
    "UnsupportedBlockError",
    "sd_v1_unet_config",
    "swap_transformer_blocks",
    "unswap_transformer_blocks",
]

#: The names of the parameters of an SD v1 block (diffusers and CompVis spell them alike).
EXPECTED_PARAMETERS = frozenset(
    [
        "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "norm3.weight", "norm3.bias",
        "attn1.to_q.weight", "attn1.to_k.weight", "attn1.to_v.weight", "attn1.to_out.0.weight", "attn1.to_out.0.bias",
        "attn2.to_q.weight", "attn2.to_k.weight", "attn2.to_v.weight", "attn2.to_out.0.weight", "attn2.to_out.0.bias",
        "ff.net.0.proj.weight", "ff.net.0.proj.bias", "ff.net.2.weight", "ff.net.2.bias",
    ]
)  # fmt: skip

#: The submodules the replacement takes over, in diffusers' registration order (so the model's
#: state_dict keeps its key order).
_CHILDREN = ("norm1", "attn1", "norm2", "attn2", "norm3", "ff")

#: Processors whose semantics the Rust block reproduces: unmasked softmax(q k^T / sqrt(d)) v,
#: no dropout. AttnProcessor2_0 is diffusers' default under torch 2; AttnProcessor is the same
#: maths without SDPA (it honours ``attn.scale`` and upcasting, which are checked separately).
_SUPPORTED_PROCESSORS = ("AttnProcessor2_0", "AttnProcessor")


class UnsupportedBlockError(ValueError):
    """A block, or a call, that the Rust block cannot reproduce exactly. Raised by the swap
    (before anything is replaced) and by a swapped block's forward."""


class Swapped(NamedTuple):
    """One replacement: ``getattr(parent, name)`` was ``original`` and is now ``replacement``."""

    path: str
    parent: nn.Module
    name: str
    original: nn.Module
    replacement: "RustTransformerBlock"


_MODULES: Optional[tuple] = None


def _diffusers():
    """diffusers' attention, attention_processor and activations modules, imported on first use."""
    global _MODULES
    if _MODULES is not None:
        return _MODULES
    try:
        import diffusers  # noqa: F401
        from diffusers.models import attention as attention_mod
        from diffusers.models import attention_processor as processor_mod
        from diffusers.models import activations as activations_mod
    except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
        raise ImportError(
            "swap_transformer_blocks needs diffusers, an optional dependency of plusequals: "
            "pip install 'plusequals[diffusers]'"
        ) from e
    _MODULES = (attention_mod, processor_mod, activations_mod)
    return _MODULES


def _processor_ok(attn: Any) -> bool:
    processor_mod = _diffusers()[1]
    return type(getattr(attn, "processor", None)) in tuple(getattr(processor_mod, n) for n in _SUPPORTED_PROCESSORS)


# --------------------------------------------------------------------------------------------
# What counts as "the SD v1 kind"
# --------------------------------------------------------------------------------------------


def _hooks(module: nn.Module, skip_root: bool = False) -> List[str]:
    """Hooks or forward overrides the Rust block would bypass (accelerate offload, user hooks)."""
    found = []
    for name, m in module.named_modules():
        if skip_root and m is module:
            continue
        kinds = [
            attr.strip("_")
            for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
            if getattr(m, attr, None)
        ]
        if hasattr(m, "_hf_hook"):
            kinds.append("accelerate _hf_hook")
        if "forward" in vars(m):
            kinds.append("an instance-level forward override")
        if kinds:
            found.append(f"{name or '<block>'} has {', '.join(kinds)}, which the Rust block would bypass")
    return found


def _check_layer_norm(norm: Any, name: str, dim: int) -> List[str]:
    if type(norm) is not nn.LayerNorm:
        return [f"{name} is {type(norm).__name__}, not a plain nn.LayerNorm"]
    reasons = []
    if tuple(norm.normalized_shape) != (dim,):
        reasons.append(f"{name} normalises over {tuple(norm.normalized_shape)}, not ({dim},)")
    if not norm.elementwise_affine or norm.weight is None or norm.bias is None:
        reasons.append(f"{name} has no affine weight and bias (norm_elementwise_affine=False or bias=False)")
    if norm.eps != 1e-5:
        reasons.append(f"{name} has eps={norm.eps!r}; the Rust block uses 1e-5")
    return reasons


def _check_linear(lin: Any, name: str, bias: bool) -> List[str]:
    if type(lin) is not nn.Linear:
        return [f"{name} is {type(lin).__name__}, not a plain nn.Linear (LoRA/PEFT or quantised layers are not supported)"]
    if bias and lin.bias is None:
        return [f"{name} has no bias; SD v1 has one"]
    if not bias and lin.bias is not None:
        return [f"{name} has a bias (attention_bias=True); SD v1's q/k/v projections have none"]
    return []


def _check_dropout(m: Any, name: str) -> List[str]:
    if type(m) is not nn.Dropout:
        return [f"{name} is {type(m).__name__}, not nn.Dropout"]
    if m.p != 0.0:
        return [f"{name} has dropout p={m.p}; only 0 is supported"]
    return []


def _check_attention(attn: Any, name: str, dim: int, heads: int, d_head: int, cross: bool, processor_mod) -> List[str]:
    if type(attn) is not processor_mod.Attention:
        return [f"{name} is {type(attn).__name__}, not diffusers' Attention"]
    reasons = []
    processor = type(attn.processor).__name__
    if not _processor_ok(attn):
        reasons.append(f"{name} uses attention processor {processor}; only {', '.join(_SUPPORTED_PROCESSORS)} are supported")
    if getattr(attn, "fused_projections", False):
        reasons.append(f"{name} has fused QKV projections (fuse_qkv_projections)")
    for flag, bad in (
        ("spatial_norm", None), ("group_norm", None), ("norm_q", None), ("norm_k", None), ("norm_cross", None),
        ("added_kv_proj_dim", None), ("add_q_proj", None), ("add_k_proj", None), ("add_v_proj", None),
        ("to_add_out", None),
    ):  # fmt: skip
        if getattr(attn, flag, None) is not bad:
            reasons.append(f"{name}.{flag} is set")
    for flag in ("residual_connection", "upcast_attention", "upcast_softmax", "only_cross_attention", "is_causal", "pre_only"):
        if getattr(attn, flag, False):
            reasons.append(f"{name}.{flag} is True")
    if getattr(attn, "rescale_output_factor", 1.0) != 1.0:
        reasons.append(f"{name}.rescale_output_factor is {attn.rescale_output_factor}, not 1")
    if attn.heads != heads:
        reasons.append(f"{name} has {attn.heads} heads but attn1 has {heads}")
    for proj in ("to_q", "to_k", "to_v"):
        reasons += _check_linear(getattr(attn, proj, None), f"{name}.{proj}", bias=False)
    to_out = getattr(attn, "to_out", None)
    if type(to_out) is not nn.ModuleList or len(to_out) != 2:
        reasons.append(f"{name}.to_out is not [Linear, Dropout]")
    else:
        reasons += _check_linear(to_out[0], f"{name}.to_out.0", bias=True)
        reasons += _check_dropout(to_out[1], f"{name}.to_out.1")
    if reasons:
        return reasons
    inner = heads * d_head
    if (attn.to_q.in_features, attn.to_q.out_features) != (dim, inner):
        reasons.append(f"{name}.to_q maps {attn.to_q.in_features} -> {attn.to_q.out_features}, expected {dim} -> {inner}")
    if attn.to_k.out_features != inner or attn.to_v.out_features != inner:
        reasons.append(f"{name}.to_k/to_v do not project to {inner} (grouped or multi-query attention)")
    if not cross and attn.to_k.in_features != dim:
        reasons.append(f"{name} is meant to be self-attention but its keys read width {attn.to_k.in_features}")
    if (attn.to_out[0].in_features, attn.to_out[0].out_features) != (inner, dim):
        reasons.append(f"{name}.to_out.0 maps {attn.to_out[0].in_features} -> {attn.to_out[0].out_features}, expected {inner} -> {dim}")
    if abs(attn.scale - d_head**-0.5) > 1e-12 * d_head**-0.5:
        reasons.append(f"{name}.scale is {attn.scale}, not 1/sqrt({d_head}) (scale_qk=False?)")
    return reasons


def _check_feed_forward(ff: Any, dim: int, attention_mod, activations_mod) -> List[str]:
    if type(ff) is not attention_mod.FeedForward:
        return [f"ff is {type(ff).__name__}, not diffusers' FeedForward"]
    net = ff.net
    if len(net) != 3:
        return [f"ff.net has {len(net)} layers, not [GEGLU, Dropout, Linear] (final_dropout=True?)"]
    if type(net[0]) is not activations_mod.GEGLU:
        return [f"ff.net.0 is {type(net[0]).__name__}; only GEGLU (activation_fn='geglu') is supported"]
    reasons = _check_linear(net[0].proj, "ff.net.0.proj", bias=True)
    reasons += _check_dropout(net[1], "ff.net.1")
    reasons += _check_linear(net[2], "ff.net.2", bias=True)
    if reasons:
        return reasons
    inner = 4 * dim
    if (net[0].proj.in_features, net[0].proj.out_features) != (dim, 2 * inner):
        reasons.append(
            f"ff.net.0.proj maps {net[0].proj.in_features} -> {net[0].proj.out_features}, expected {dim} -> {2 * inner} "
            "(the Rust block's feed-forward is 4 x dim wide; ff_inner_dim/mult are not supported)"
        )
    if (net[2].in_features, net[2].out_features) != (inner, dim):
        reasons.append(f"ff.net.2 maps {net[2].in_features} -> {net[2].out_features}, expected {inner} -> {dim}")
    return reasons


def _refusals(block: nn.Module, mods) -> List[str]:
    """Every reason the Rust block cannot stand in for ``block`` (empty: it can)."""
    attention_mod, processor_mod, activations_mod = mods
    if type(block) is not attention_mod.BasicTransformerBlock:
        return [f"it is a {type(block).__qualname__}, a subclass of BasicTransformerBlock whose forward may differ"]
    reasons = []
    if block.norm_type != "layer_norm":
        reasons.append(f"norm_type={block.norm_type!r}; only 'layer_norm' is supported")
    if block.only_cross_attention:
        reasons.append("only_cross_attention=True (attn1 attends to the encoder states)")
    if block.double_self_attention:
        reasons.append("double_self_attention=True (attn2 is a second self-attention)")
    if getattr(block, "pos_embed", None) is not None:
        reasons.append(f"positional_embeddings={block.positional_embeddings!r}")
    if hasattr(block, "fuser"):
        reasons.append("attention_type is 'gated'/'gated-text-image' (GLIGEN fuser)")
    if hasattr(block, "scale_shift_table"):
        reasons.append("it has a scale_shift_table (PixArt ada_norm_single)")
    if getattr(block, "_chunk_size", None) is not None:
        reasons.append("feed-forward chunking is on (set_chunk_feed_forward / enable_forward_chunking)")
    if block.attn2 is None or block.norm2 is None:
        reasons.append("it has no cross-attention (cross_attention_dim=None)")
    if reasons:
        return reasons  # the structure below is not the SD v1 one; its checks would only add noise
    attn1 = block.attn1
    if type(attn1) is not processor_mod.Attention or type(attn1.to_q) is not nn.Linear:
        return [f"attn1 is {type(attn1).__name__} / to_q is {type(getattr(attn1, 'to_q', None)).__name__}"]
    dim, heads = attn1.to_q.in_features, attn1.heads
    if heads <= 0 or attn1.to_q.out_features % heads:
        return [f"attn1.to_q width {attn1.to_q.out_features} is not a multiple of heads={heads}"]
    d_head = attn1.to_q.out_features // heads
    for norm in ("norm1", "norm2", "norm3"):
        reasons += _check_layer_norm(getattr(block, norm), norm, dim)
    reasons += _check_attention(attn1, "attn1", dim, heads, d_head, False, processor_mod)
    reasons += _check_attention(block.attn2, "attn2", dim, heads, d_head, True, processor_mod)
    reasons += _check_feed_forward(block.ff, dim, attention_mod, activations_mod)
    for name, m in block.named_modules():
        if isinstance(m, nn.Dropout) and m.p != 0.0:
            reasons.append(f"{name} has dropout p={m.p}; only 0 is supported")
    reasons += _hooks(block)
    names = {name for name, _ in block.named_parameters()}
    if names != EXPECTED_PARAMETERS:
        extra, missing = sorted(names - EXPECTED_PARAMETERS), sorted(EXPECTED_PARAMETERS - names)
        reasons.append(f"its parameters are not the SD v1 set (extra: {extra[:4]}, missing: {missing[:4]})")
    buffers = [name for name, _ in block.named_buffers()]
    if buffers:
        reasons.append(f"it has buffers {buffers[:4]}, which the Rust block does not use")
    params = list(block.parameters())
    if params and len({(p.dtype, p.device) for p in params}) > 1:
        reasons.append("its parameters do not share one dtype and device")
    if any(p.is_meta for p in params):
        reasons.append("its parameters are on the meta device (no data to run on)")
    return reasons


# --------------------------------------------------------------------------------------------
# The replacement module
# --------------------------------------------------------------------------------------------


class RustTransformerBlock(nn.Module):
    """A diffusers ``BasicTransformerBlock`` (SD v1 kind) run by the Rust twin.

    It holds the original block's submodules under the same names (so its parameters *are*
    the original's: training, ``load_state_dict`` and ``.to()`` on the model reach both), and
    calls :meth:`RustBlock.forward` (differentiable; gradients reach the shared parameters) or,
    with ``owned=True`` and grad mode off, :meth:`RustBlock.forward_owned` (one copy, then the
    three residuals added in place).

    Build it with :func:`swap_transformer_blocks`, which checks the block first.
    """

    def __init__(self, block: nn.Module, path: str = "", owned: bool = False) -> None:
        super().__init__()
        for name in _CHILDREN:
            setattr(self, name, getattr(block, name))
        attn1 = block.attn1
        self.dim = attn1.to_q.in_features
        self.n_heads = attn1.heads
        self.d_head = attn1.to_q.out_features // attn1.heads
        self.context_dim = block.attn2.to_k.in_features
        self.path = path
        self.owned = bool(owned)
        # Not registered as a submodule: its parameters are already registered above.
        object.__setattr__(self, "original", block)
        self._rust: Optional[RustBlock] = None
        self._key: Optional[tuple] = None
        self._snapshot()

    # -- the Rust twin, rebuilt when the parameters it was built on change -------------------

    def _snapshot(self) -> None:
        """Records which module sits where and which parameter slots there are (see _is_current)."""
        self._tree = list(self.modules())
        self._edges = [(m, name, child) for m in self._tree for name, child in m._modules.items()]
        self._slots = [(m, name) for m in self._tree for name in m._parameters]

    def _weights_key(self) -> tuple:
        return tuple(
            None if p is None else (id(p), p.data_ptr()) for p in (m._parameters.get(n) for m, n in self._slots)
        )

    def _is_current(self) -> bool:
        """Whether the Rust twin still runs on this block's parameters: no submodule replaced
        (LoRA/PEFT injection), no parameter replaced (``load_state_dict(assign=True)``), none
        moved to new storage (``.to()``, ``.half()``: any dtype or device change allocates).
        A few us per call, against ~20 us for ``named_parameters()``."""
        return (
            self._rust is not None
            and all(m._modules.get(name) is child for m, name, child in self._edges)
            and self._weights_key() == self._key
        )

    def _build(self) -> RustBlock:
        return RustBlock.from_state_dict(
            dict(self.named_parameters()),
            dim=self.dim,
            n_heads=self.n_heads,
            d_head=self.d_head,
            context_dim=self.context_dim,
            gated_ff=True,
            attention="sdpa",
        )

    def _check_still_supported(self) -> None:
        """What can change after the swap without touching the parameters: processors, fused
        projections, hooks on the submodules (which the Rust call would bypass)."""
        reasons = []
        for name in ("attn1", "attn2"):
            attn = getattr(self, name)
            if not _processor_ok(attn):
                processor = type(getattr(attn, "processor", None)).__name__
                reasons.append(f"{name} now uses attention processor {processor}")
            if getattr(attn, "fused_projections", False):
                reasons.append(f"{name} now has fused QKV projections")
        for m in self._tree[1:]:  # hooks on the replacement itself run as usual
            d = m.__dict__
            if (
                d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                or d.get("_backward_pre_hooks") or "_hf_hook" in d or "forward" in d
            ):  # fmt: skip
                reasons += _hooks(self, skip_root=True)
                break
        if reasons:
            raise UnsupportedBlockError(
                f"{self.path or 'RustTransformerBlock'}: {'; '.join(reasons)}. The Rust block computes default "
                f"attention ({' / '.join(_SUPPORTED_PROCESSORS)}) and calls no submodule. Undo the swap to use them."
            )

    def _rebuild(self) -> None:
        self._snapshot()
        key = self._weights_key()
        names = {name for name, _ in self.named_parameters()}
        if names != EXPECTED_PARAMETERS:
            extra, missing = sorted(names - EXPECTED_PARAMETERS), sorted(EXPECTED_PARAMETERS - names)
            raise UnsupportedBlockError(
                f"{self.path or 'RustTransformerBlock'}: its parameters are no longer the SD v1 set "
                f"(extra: {extra[:4]}, missing: {missing[:4]}); were LoRA/PEFT layers injected after the swap? "
                "Undo the swap first."
            )
        self._rust, self._key = self._build(), key

    def rust_block(self) -> RustBlock:
        """The Rust twin on the current parameters (rebuilt if they were moved or replaced)."""
        if not self._is_current():
            self._rebuild()
        self._check_still_supported()
        return self._rust

    # -- diffusers' call signature -----------------------------------------------------------

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        encoder_hidden_states: Optional[Tensor] = None,
        encoder_attention_mask: Optional[Tensor] = None,
        timestep: Optional[Tensor] = None,
        cross_attention_kwargs: Optional[Dict[str, Any]] = None,
        class_labels: Optional[Tensor] = None,
        added_cond_kwargs: Optional[Dict[str, Tensor]] = None,
        **kwargs: Any,
    ) -> Tensor:
        # timestep, class_labels and added_cond_kwargs are read only by the ada-norm kinds;
        # diffusers' block of the layer_norm kind ignores them, and so does this one.
        where = self.path or "RustTransformerBlock"
        if attention_mask is not None:
            raise UnsupportedBlockError(f"{where}: attention_mask is not supported by the Rust block (pass None)")
        if encoder_attention_mask is not None:
            raise UnsupportedBlockError(f"{where}: encoder_attention_mask is not supported by the Rust block (pass None)")
        if cross_attention_kwargs:
            raise UnsupportedBlockError(
                f"{where}: cross_attention_kwargs {sorted(cross_attention_kwargs)} are not supported by the Rust block "
                "(it has no LoRA scale, GLIGEN or IP-adapter inputs); pass None or {}"
            )
        if kwargs:
            raise TypeError(f"{where}: unexpected keyword arguments {sorted(kwargs)}")
        rust = self.rust_block()
        if self.owned and not torch.is_grad_enabled():
            return rust.forward_owned(hidden_states, encoder_hidden_states, donate=False)
        return rust.forward(hidden_states, encoder_hidden_states)

    def set_chunk_feed_forward(self, chunk_size: Optional[int], dim: int = 0) -> None:
        if chunk_size is not None:
            raise UnsupportedBlockError(
                f"{self.path or 'RustTransformerBlock'}: feed-forward chunking is not supported by the Rust block"
            )

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, n_heads={self.n_heads}, d_head={self.d_head}, context_dim={self.context_dim}, "
            f"owned={self.owned}, path={self.path!r}"
        )

    # The Rust handle is neither picklable nor deep-copyable: copy.deepcopy / pickle drop it,
    # and the copy builds its own on first use (on the copied parameters).
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_rust=None, _key=None, _tree=[], _edges=[], _slots=[])
        return state


# --------------------------------------------------------------------------------------------
# Swap and undo
# --------------------------------------------------------------------------------------------


class SwapHandle:
    """What :func:`swap_transformer_blocks` replaced: a sequence of :class:`Swapped`.

    ``undo()`` puts the original modules back (idempotent); the handle is also a context
    manager that undoes on exit.
    """

    def __init__(self, swapped: List[Swapped]) -> None:
        self.swapped = list(swapped)
        self.active = True

    def __len__(self) -> int:
        return len(self.swapped)

    def __iter__(self) -> Iterator[Swapped]:
        return iter(self.swapped)

    def __getitem__(self, i: int) -> Swapped:
        return self.swapped[i]

    @property
    def paths(self) -> List[str]:
        return [s.path for s in self.swapped]

    def undo(self) -> None:
        """Restores every original module; all-or-nothing like the swap."""
        if not self.active:
            return
        moved = [s.path for s in self.swapped if s.parent._modules.get(s.name) is not s.replacement]
        if moved:
            raise RuntimeError(
                f"cannot undo the swap: {len(moved)} replaced module(s) are no longer where the swap put them "
                f"({', '.join(moved[:4])}); nothing was restored"
            )
        for s in self.swapped:
            setattr(s.parent, s.name, s.original)
        self.active = False

    def __enter__(self) -> "SwapHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"SwapHandle({len(self)} blocks, {state})"


def swap_transformer_blocks(model: nn.Module, *, owned: bool = False) -> SwapHandle:
    """Replaces every diffusers ``BasicTransformerBlock`` in ``model`` with a
    :class:`RustTransformerBlock` on the same weights, and returns the :class:`SwapHandle`.

    All-or-nothing: raises :class:`UnsupportedBlockError` (naming each offending module path
    and the reason) before replacing anything if any block is not of the SD v1 kind, and
    ``ValueError`` if ``model`` holds no such block at all.

    ``owned=True``: with grad mode off, the blocks run ``RustBlock.forward_owned`` (copy of the
    input, then ``+=``); with grad on they always run the differentiable ``forward``.
    """
    mods = _diffusers()
    block_cls = mods[0].BasicTransformerBlock
    if isinstance(model, block_cls):
        raise ValueError("swap_transformer_blocks needs the model that contains the blocks, not a block itself")

    sites: List[Tuple[str, nn.Module, str, nn.Module]] = []
    seen = set()
    for parent_path, parent in model.named_modules(remove_duplicate=False):
        for name, child in parent._modules.items():
            if isinstance(child, block_cls) and (id(parent), name) not in seen:
                seen.add((id(parent), name))
                sites.append((f"{parent_path}.{name}" if parent_path else name, parent, name, child))
    if not sites:
        already = sum(isinstance(m, RustTransformerBlock) for m in model.modules())
        hint = f" ({already} are already swapped)" if already else ""
        raise ValueError(f"{type(model).__name__} contains no diffusers BasicTransformerBlock to swap{hint}")

    # 1. Check every block and build every Rust twin; nothing is replaced yet.
    refusals: List[str] = []
    n_bad = 0
    built: Dict[int, RustTransformerBlock] = {}
    for path, _, _, block in sites:
        if id(block) in built:
            continue  # the same block registered twice: one replacement for both sites
        reasons = _refusals(block, mods)
        if not reasons:
            try:
                replacement = RustTransformerBlock(block, path=path, owned=owned)
                replacement.rust_block()
            except (ValueError, TypeError, RuntimeError) as e:
                reasons = [f"the Rust block could not be built: {e}"]
            else:
                built[id(block)] = replacement
        n_bad += bool(reasons)
        refusals += [f"  {path}: {r}" for r in reasons]
    if refusals:
        raise UnsupportedBlockError(
            f"swap_transformer_blocks refused {n_bad} of {len(sites)} BasicTransformerBlock(s); nothing was swapped. "
            "Only the SD v1 kind is supported (LayerNorm norms, bias-free q/k/v, GEGLU feed-forward, default "
            "attention processor, no dropout, masks, ada-norm, positional embeddings or hooks):\n" + "\n".join(refusals)
        )

    # 2. Replace.
    swapped = []
    for path, parent, name, block in sites:
        replacement = built[id(block)]
        setattr(parent, name, replacement)
        swapped.append(Swapped(path, parent, name, block, replacement))
    return SwapHandle(swapped)


def unswap_transformer_blocks(handle: SwapHandle) -> None:
    """Puts back what :func:`swap_transformer_blocks` replaced (same as ``handle.undo()``)."""
    if not isinstance(handle, SwapHandle):
        raise TypeError(f"expected the SwapHandle returned by swap_transformer_blocks, got {type(handle).__name__}")
    handle.undo()


# --------------------------------------------------------------------------------------------
# The full-size SD v1 UNet, without a download
# --------------------------------------------------------------------------------------------


def sd_v1_unet_config() -> Dict[str, Any]:
    """``UNet2DConditionModel(**sd_v1_unet_config())`` is the Stable Diffusion v1.x UNet
    (859.5M parameters, randomly initialised).

    The values are those of ``unet/config.json`` in the SD v1.4/v1.5 diffusers repositories,
    equivalently what diffusers' ``create_unet_diffusers_config_from_ldm`` derives from
    CompVis ``v1-inference.yaml`` (model_channels 320, channel_mult 1,2,4,4, attention at
    resolutions 4,2,1, num_res_blocks 2, num_heads 8, context_dim 768, image 512 / VAE factor 8).

    Note diffusers' naming: ``attention_head_dim=8`` is really the *number of heads* (8) in
    every transformer; the head width is channels / 8 (40, 80, 160).
    """
    return {
        "sample_size": 64,
        "in_channels": 4,
        "out_channels": 4,
        "center_input_sample": False,
        "flip_sin_to_cos": True,
        "freq_shift": 0,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "mid_block_type": "UNetMidBlock2DCrossAttn",
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        "only_cross_attention": False,
        "block_out_channels": [320, 640, 1280, 1280],
        "layers_per_block": 2,
        "downsample_padding": 1,
        "mid_block_scale_factor": 1,
        "dropout": 0.0,
        "act_fn": "silu",
        "norm_num_groups": 32,
        "norm_eps": 1e-5,
        "cross_attention_dim": 768,
        "transformer_layers_per_block": 1,
        "attention_head_dim": 8,
        "use_linear_projection": False,
        "upcast_attention": False,
    }
