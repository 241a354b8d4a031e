"""Drop-in: the Rust block inside a real diffusers UNet.

:func:`swap_transformer_blocks` replaces every diffusers ``BasicTransformerBlock`` of the SD v1
kind in a model (a ``UNet2DConditionModel``, say) with a :class:`RustTransformerBlock`, which
runs ``plusequals._rust`` on the *same* parameter tensors (no copies) and accepts diffusers'
call signature. It is all-or-nothing: every block is checked (and its Rust twin built) before
the first one is replaced, and one block of an unsupported kind refuses the whole swap with an
:class:`UnsupportedBlockError` naming each offending module path and why.

The returned :class:`SwapHandle` lists what was replaced and undoes it
(``handle.undo()``, :func:`unswap_transformer_blocks`, or ``with swap_transformer_blocks(unet):``).

The replacement is a :class:`~plusequals.RustBlock`: it registers the original block's own
submodules (``norm1, attn1, norm2, attn2, norm3, ff``) under the same names, so the model's
``state_dict`` keys, ``parameters()``, ``attn_processors`` and ``.to()`` behave as before; it
rebuilds its Rust twin whenever the parameters it was built on change identity, storage, dtype
or device (``.to()``, ``.half()``, ``load_state_dict(assign=True)``), and refuses to run once
something it cannot honour appears (an attention processor it does not compute, LoRA dropout in
training, ...): the same mechanism as ``RustBlock.from_torch``. It takes diffusers' masks
(``attention_mask``, ``encoder_attention_mask``) and runs peft LoRA adapters in Rust; what runs and
what is refused is the README's drop-in section. What
counts as "the SD v1 kind" is :mod:`plusequals.twin.faithful`, shared with ``RustBlock.from_torch``.

diffusers is optional: this module imports it only when a function needs it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from ..errors import UnsupportedBlockError
from . import casting
from .block import ADOPT, RustBlock
from .config import rust_keys
from .delegate import delegated_call, why_delegated
from .dispatch import seen_by_python, symbolic
from .faithful import ADAPTERS, SUPPORTED_PROCESSORS, read_block
from .ip_adapter import forward_tuple
from .probe import note_call

__all__ = [
    "RustTransformerBlock",
    "SwapHandle",
    "Swapped",
    "UnsupportedBlockError",
    "sd_v1_unet_config",
    "swap_transformer_blocks",
    "tiny_unet_config",
    "unswap_transformer_blocks",
]

#: The names of the parameters of an SD v1 block (diffusers and CompVis spell them alike).
EXPECTED_PARAMETERS = frozenset(rust_keys(True))

_SUPPORTED_PROCESSORS = SUPPORTED_PROCESSORS


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
        from diffusers.models import activations as activations_mod
        from diffusers.models import attention as attention_mod
        from diffusers.models import attention_processor as processor_mod
    except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
        raise ImportError(
            "swap_transformer_blocks needs diffusers, an optional dependency of plusequals: "
            "pip install 'plusequals[diffusers]'"
        ) from e
    _MODULES = (attention_mod, processor_mod, activations_mod)
    return _MODULES


# --------------------------------------------------------------------------------------------
# The replacement module
# --------------------------------------------------------------------------------------------


class RustTransformerBlock(RustBlock):
    """A diffusers ``BasicTransformerBlock`` (SD v1 kind) run by the Rust twin: a
    :class:`RustBlock` that takes diffusers' call signature.

    It holds the original block's submodules under the same names (so its parameters *are*
    the original's: training, ``load_state_dict`` and ``.to()`` on the model reach both), and
    calls :meth:`RustBlock.forward` (differentiable; gradients reach the shared parameters) or,
    with ``owned=True`` and grad mode off, :meth:`RustBlock.forward_owned` (one copy, then the
    three residuals added in place). It follows its parameters and submodules exactly as a
    ``RustBlock`` made with ``from_torch`` does (one mechanism: twin/follow.py).

    Build it with :func:`swap_transformer_blocks`, which checks the block first. diffusers'
    layerwise casting runs around each call (twin/casting.py).
    """

    CASTS_LAYERWISE = True
    _casting_now = False  # inside diffusers' casts (_cast)

    def __init__(self, block: nn.Module, path: str = "", owned: bool = False) -> None:
        super().__init__(ADOPT)
        self.path = path
        self.owned = bool(owned)
        self._adopt(block)

    @property
    def original(self) -> nn.Module:
        """The diffusers block this one stands in for (not registered: its submodules are)."""
        return self._source

    def _where(self) -> str:
        return self.path or "RustTransformerBlock"

    def rust_block(self) -> "RustTransformerBlock":
        """Checks that the block is still one the Rust block reproduces, rebuilding the Rust
        block if the parameters moved or were replaced; raises UnsupportedBlockError if not."""
        self._ensure_current()
        return self

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
        masks = {"attention_mask": attention_mask, "encoder_attention_mask": encoder_attention_mask}
        why = why_delegated(hidden_states, encoder_hidden_states, masks, follows=self._follow is not None)
        if why is not None:  # Python code would see the library's block's calls: it runs, with these arguments
            kw = dict(attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states, timestep=timestep)
            kw.update(encoder_attention_mask=encoder_attention_mask, cross_attention_kwargs=cross_attention_kwargs)
            kw.update(class_labels=class_labels, added_cond_kwargs=added_cond_kwargs, **kwargs)
            return delegated_call(self._follow, self._where(), why, (hidden_states,), kw)
        pair = isinstance(encoder_hidden_states, (tuple, list)) and len(encoder_hidden_states) > 0
        context = encoder_hidden_states[0] if pair else encoder_hidden_states
        cast = self._layerwise_casting(call=(hidden_states, context))
        if not cast or symbolic(hidden_states, context) or seen_by_python(hidden_states, context, dispatch_modes=True):
            # traced, fake or seen by Python: refused where the custom ops take the weights (_traced_weights)
            return self._forward(hidden_states, encoder_hidden_states, masks, cross_attention_kwargs, kwargs)
        with self._cast(cast):  # diffusers' hooks' own casts, around the whole block (twin/casting.py)
            self._ensure_current()
            return self._forward(hidden_states, encoder_hidden_states, masks, cross_attention_kwargs, kwargs)

    def _layerwise_casting(self, error: type = UnsupportedBlockError, call: tuple = ()) -> tuple:
        """diffusers' layerwise casting hooks in the block (twin/casting.py), from a current reading
        (a stale one is read again first; with hooks, :meth:`_ensure_current` builds inside the
        casts), or () inside the casts. ``call``: the call's ``(hidden_states, context)``, whose
        shapes a check it runs probes too (:func:`plusequals.twin.probe.note_call`), as
        ``RustBlock.forward``'s does; noted only when the reading is stale, off the hot path."""
        if self._source is None or self._casting_now or torch.compiler.is_compiling():
            return ()  # traced: refused where the custom ops take the weights (RustBlock._traced_weights)
        reading = self._reading
        if reading is None or not reading.watch.unchanged():
            if call:
                note_call(*call)
            self._read(error)
            if not self._reading.casting:
                RustBlock._ensure_current(self, error)  # nothing to cast: built now, on the new reading
        return self._reading.casting

    @contextlib.contextmanager
    def _cast(self, cast: tuple) -> Iterator[None]:
        self._casting_now = True
        try:
            with casting.window(cast):
                why = casting.mixed_dtypes(self._reading.paths, self._reading.weights())
                if why:
                    self._refuse(why)
                yield
        finally:
            self._casting_now = False

    def _probe_forward(self) -> Any:
        """The probe runs the library's block first, whose hooks store the weights again after each
        layer: the Rust block's half casts them again (diffusers' pre_forward) before it runs."""
        forward = super()._probe_forward()
        if not self._casting_now:
            return forward
        cast = self._reading.casting

        def cast_forward(*args: Any, **kwargs: Any) -> Any:
            casting.recast(cast)
            return forward(*args, **kwargs)

        return cast_forward

    def _ensure_current(self, error: type = UnsupportedBlockError) -> None:
        """RustBlock's, with the Rust block built on the weights cast to the compute dtype when the
        block has layerwise casting (they are stored in another dtype between calls)."""
        cast = self._layerwise_casting(error)
        if not cast:
            return super()._ensure_current(error)
        with self._cast(cast):
            super()._ensure_current(error)

    def _forward(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Any,
        masks: Dict[str, Any],
        cross_attention_kwargs: Optional[Dict[str, Any]],
        kwargs: Dict[str, Any],
    ) -> Tensor:
        where = self._where()
        for (name, mask), attn in zip(masks.items(), ("attn1", "attn2")):
            if isinstance(mask, Tensor) and (mask.dtype == torch.bool or mask.dim() == 2):
                self._check_mask_for_processor(name, mask, attn)
        if cross_attention_kwargs:
            raise UnsupportedBlockError(
                f"{where}: cross_attention_kwargs {sorted(cross_attention_kwargs)} are not supported by the Rust block "
                "(it has no LoRA scale, GLIGEN or IP-adapter inputs); pass None or {}"
            )
        if kwargs:
            raise TypeError(f"{where}: unexpected keyword arguments {sorted(kwargs)}")
        if isinstance(encoder_hidden_states, (tuple, list)):
            return forward_tuple(self._carried(), hidden_states, encoder_hidden_states, masks)
        if self.owned and not torch.is_grad_enabled():
            return RustBlock.forward_owned(self, hidden_states, encoder_hidden_states, donate=False, **masks)
        return RustBlock.forward(self, hidden_states, encoder_hidden_states, **masks)

    def _check_mask_for_processor(self, name: str, mask: Tensor, attn: str) -> None:
        """A boolean mask is SDPA's (True: attend), and a (batch, keys) one is viewed per head, under
        AttnProcessor2_0, which the Rust block reproduces. AttnProcessor and SlicedAttnProcessor hand
        the mask to ``torch.baddbmm`` as a bias broadcast against (batch * heads, queries, keys):
        it raises on a boolean one and reads a 2-d one as (queries, keys). Refused here, before
        anything runs; diffusers' UNet passes neither (a (batch, 1, keys) float bias)."""
        processor = type(getattr(self._modules.get(attn), "processor", None)).__name__
        if processor == "AttnProcessor2_0" or any(a.own_masks(processor) for a in ADAPTERS):  # SDPA's, or refused
            return
        what = "a boolean mask" if mask.dtype == torch.bool else "2-d (batch, keys)"
        raise UnsupportedBlockError(
            f"{self._where()}: {name} is {what}, which {attn}'s {processor} cannot take as diffusers' other "
            "processors do (its torch.baddbmm needs a floating (batch, 1 or queries, keys) bias: diffusers' UNet "
            "passes (1 - mask) * -10000.0 with a query dimension)"
        )

    def set_chunk_feed_forward(self, chunk_size: Optional[int], dim: int = 0) -> None:
        if chunk_size is not None:
            raise UnsupportedBlockError(f"{self._where()}: feed-forward chunking is not supported by the Rust block")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, owned={self.owned}, path={self.path!r}"


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
    block_cls = _diffusers()[0].BasicTransformerBlock
    if isinstance(model, block_cls):
        raise ValueError("swap_transformer_blocks needs the model that contains the blocks, not a block itself")

    sites = _sites(model, block_cls)
    if not sites:
        already = sum(isinstance(m, RustTransformerBlock) for m in model.modules())
        hint = f" ({already} are already swapped)" if already else ""
        raise ValueError(f"{type(model).__name__} contains no diffusers BasicTransformerBlock to swap{hint}")

    # 1. Check every block and build every Rust twin; nothing is replaced yet. The check is
    # plusequals.twin.faithful.read_block, the same definition RustBlock.from_torch uses.
    built, refusals, n_bad = _build(sites, owned)
    if refusals:
        raise UnsupportedBlockError(
            f"swap_transformer_blocks refused {n_bad} of {len(sites)} BasicTransformerBlock(s); nothing was swapped. "
            "Only what the Rust block reproduces exactly is supported (plusequals.twin.faithful: LayerNorm norms, "
            "bias-free "
            "q/k/v (plain or PEFT LoRA), a GEGLU or exact-GELU feed-forward, AttnProcessor2_0, AttnProcessor or "
            "SlicedAttnProcessor, no active dropout, ada-norm, positional embeddings or hooks):\n" + "\n".join(refusals)
        )

    # 2. Replace.
    swapped = []
    for path, parent, name, block in sites:
        replacement = built[id(block)]
        setattr(parent, name, replacement)
        swapped.append(Swapped(path, parent, name, block, replacement))
    return SwapHandle(swapped)


_Site = Tuple[str, nn.Module, str, nn.Module]  # (path, parent, name, block)


def _sites(model: nn.Module, block_cls: type) -> List[_Site]:
    """Where ``model`` registers a block of ``block_cls``: every (parent, name) once."""
    sites: List[_Site] = []
    seen = set()
    for parent_path, parent in model.named_modules(remove_duplicate=False):
        for name, child in parent._modules.items():
            if isinstance(child, block_cls) and (id(parent), name) not in seen:
                seen.add((id(parent), name))
                sites.append((f"{parent_path}.{name}" if parent_path else name, parent, name, child))
    return sites


def _build(sites: List[_Site], owned: bool) -> Tuple[Dict[int, "RustTransformerBlock"], List[str], int]:
    """A replacement for each block (by id), or the reasons it is refused: (built, refusals, how
    many blocks were refused)."""
    refusals: List[str] = []
    n_bad = 0
    built: Dict[int, RustTransformerBlock] = {}
    for path, _, _, block in sites:
        if id(block) in built:
            continue  # the same block registered twice: one replacement for both sites
        reasons = read_block(block).reasons
        if not reasons:
            try:
                built[id(block)] = RustTransformerBlock(block, path=path, owned=owned)
            except UnsupportedBlockError as e:
                reasons = [str(e).split(": ", 1)[-1]]
            except (ValueError, TypeError, RuntimeError) as e:
                reasons = [f"the Rust block could not be built: {e}"]
        n_bad += bool(reasons)
        refusals += [f"  {path}: {r}" for r in reasons]
    return built, refusals, n_bad


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


def tiny_unet_config() -> Dict[str, Any]:
    """SD v1's UNet shrunk (:func:`sd_v1_unet_config`), the one small UNet of the cases, the sweep, the
    report's --quick step and the tests: 2 levels (one with cross-attention), 1 resnet each, 8 heads,
    GroupNorm(32), 4 blocks."""
    return dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        norm_num_groups=32,
    )
