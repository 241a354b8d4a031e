"""The interface of an adapter: a feature a block carries on top of the SD v1 block, which the Rust
block computes on the adapter's own tensors (IP-Adapter, PEFT LoRA and DoRA, Custom Diffusion,
diffusers' layerwise casting). One adapter is one module of this package, its reading, its call and
its refusals together, plus its Rust file:

* its reading: what :func:`plusequals.twin.faithful.read_block` reads of it into the
  :class:`BlockConfig` (an attention processor of :attr:`Adapter.processors`:
  :meth:`Adapter.read_processor`; LoRA's layers and casting's hooks are found where they sit);
* its refusal where the custom ops would run, which take the base weights only
  (:meth:`Adapter.untraceable`);
* its eager call: a refusal (:meth:`Adapter.check`), or the call itself (:meth:`Adapter.takes`,
  :meth:`Adapter.eager`), given what it sees of the block that carries it, current: a
  :class:`Carried`, never the block.

The adapters, in the order their refusals are named: :data:`plusequals.twin.faithful.ADAPTERS`.
A leaf: imports nothing of the package but ``config``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Tuple

from torch import Tensor

from .config import BlockConfig

__all__ = ["Adapter", "Carried"]


class Carried(NamedTuple):
    """What an adapter's call sees of the block that carries it (a ``RustBlock`` or the swap's
    block), read again first if it changed."""

    where: str  # the block's name, for messages
    config: BlockConfig  # its current configuration, the adapters' terms included
    reading: Any  # its current reading (twin/faithful.py's Reading)
    modules: Mapping[str, Any]  # its submodules (norm1, attn1, ...): the processors
    functorch: bool  # whether its weights are functorch-wrapped now (torch.func over functional_call)
    rust: Callable[..., Tensor]  # the Rust block's method by name, with the watch: rust("forward", x, context, **kw)


class Adapter:
    """One adapter (module docstring). Every method has a default that does nothing: an adapter
    overrides what it has."""

    #: Its name in messages.
    name: str = ""
    #: The class names of diffusers' attention processors it reads (:meth:`read_processor`).
    processors: Tuple[str, ...] = ()
    #: Why ``forward_owned(donate=True)`` refuses a call that it takes (:meth:`takes`).
    undonatable: str = ""

    def read_processor(self, r: Any, processor: Any, attn: str, widths: tuple) -> None:
        """Reads ``processor`` (one of :attr:`processors`) on ``attn`` with the reader ``r``
        (``faithful._Reader``): its terms and slots, or the reasons it is refused. ``widths``: (the
        block's width, heads * d_head), None where unknown."""
        raise NotImplementedError(f"{type(self).__name__} reads no attention processor")

    def own_masks(self, processor: str) -> bool:
        """Whether a masked call under diffusers' processor class named ``processor`` is this
        adapter's to take (SDPA's masks, as the Rust block's) or to refuse (:meth:`check`), rather
        than the swap's check of the masks other processors cannot take."""
        return False

    def untraceable(self, config: BlockConfig, casting: bool, lora_layers: Sequence[str]) -> Optional[str]:
        """Why a block with this reading cannot run as the custom ops (traced, fake, under a mode or
        with tensor subclasses) because of this adapter, or None."""
        return None

    def hot(self, config: BlockConfig) -> bool:
        """Whether the hot path (one call into Rust, with no Python) may compute a block with this
        configuration."""
        return True

    def check(self, now: Carried, masks: Mapping[str, Any]) -> None:
        """Refuses (raises :class:`UnsupportedBlockError`, naming the cause) an eager call that the
        Rust block cannot take with this adapter."""

    def takes(self, now: Carried) -> bool:
        """Whether an eager call of this block is this adapter's to compute (:meth:`eager`)."""
        return False

    def eager(self, now: Carried, x: Tensor, context: Any, masks: Mapping[str, Any]) -> Tensor:
        """The eager call, computed with this adapter's inputs, or refused naming the cause."""
        raise NotImplementedError(f"{type(self).__name__} takes no call")
