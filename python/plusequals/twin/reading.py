"""What :func:`plusequals.twin.faithful.read_block` returns: the Rust block's configuration, where
each weight sits in the module, every refusal, and the :class:`Watch` of what was looked at. A
leaf: imports nothing of the package but ``config`` and ``watch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .config import BlockConfig
from .watch import Watch

__all__ = ["Reading"]


@dataclass
class Reading:
    """What :func:`read_block` found: the spec, the weights' slots, and every refusal."""

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
