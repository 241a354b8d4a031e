"""What a traced call cannot take: under torch.compile, torch.export or FakeTensor, under a mode or
with tensor subclasses, the block runs as the custom ops of :mod:`plusequals.twin.ops`, which take
the base weights, ``x`` and ``context`` only. A block whose last reading has more (an IP-Adapter's
image embeddings, layerwise casting's stored dtype, Custom Diffusion's or LoRA's layers) is refused
there, naming what it has. A leaf: imports nothing of the package but ``config``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .config import BlockConfig

__all__ = ["untraceable"]

_TRACED = "cannot be traced (torch.compile, torch.export, FakeTensor) or run under a mode or with tensor subclasses"


def untraceable(config: Optional[BlockConfig], casting: bool, lora_layers: Sequence[str]) -> Optional[str]:
    """Why a block with this reading cannot run as the custom ops, or None."""
    if config is not None and config.ip_adapter:  # the ops take no image embeddings
        return "a block with an IP-Adapter (attn2) cannot be traced"
    if casting:
        return (
            f"a block under diffusers' layerwise casting {_TRACED}: the custom ops would take the stored "
            "low-precision weights; call it eagerly on plain tensors"
        )
    if config is not None and config.custom_diffusion:  # nor its layers
        attns = ", ".join(spec[0] for spec in config.custom_diffusion)
        return (
            f"a block with Custom Diffusion ({attns}) {_TRACED}: the custom ops take the base weights only; call it "
            "eagerly on plain tensors"
        )
    if lora_layers:  # merged or disabled too: a traced graph would not see them change
        return (
            f"a block with LoRA adapters ({', '.join(lora_layers)}) {_TRACED}: the custom ops take the base weights "
            "only; call it eagerly on plain tensors, or remove the adapters (merge_and_unload, unload_lora)"
        )
    return None
