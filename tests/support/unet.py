"""The project's tiny UNet (``plusequals.twin.swap.tiny_unet_config``) as the tests use it:
its transformer blocks randomised, its inputs, a call. conftest's session fixture ``tiny_unet``
builds it once per seed and gives each test a deep copy (:class:`TinyUnets`)."""

from __future__ import annotations

import copy
from typing import Dict

import torch
from torch import nn

from plusequals.model.blocks import randomize_
from plusequals.twin.swap import tiny_unet_config

N_BLOCKS = 4  # transformer blocks: width 32 (three, head width 4) and 64 (the mid block's, head width 8)
REPLACED = "up_blocks.1.attentions.1.transformer_blocks.0"  # where the refusal tests plant a bad block


def build(seed: int = 0) -> nn.Module:
    """The tiny UNet initialised from ``seed`` (the global generator left as it was), in eval
    mode, its i-th transformer block randomised with seed ``100 * seed + i`` (LayerNorm affine
    and every projection non-trivial)."""
    import diffusers
    from diffusers.models.attention import BasicTransformerBlock

    with torch.random.fork_rng(devices=[]):  # diffusers initialises from the global generator
        torch.manual_seed(seed)
        unet = diffusers.UNet2DConditionModel(**tiny_unet_config()).eval()
    for i, block in enumerate(m for m in unet.modules() if isinstance(m, BasicTransformerBlock)):
        randomize_(block, seed=100 * seed + i)
    return unet


class TinyUnets:
    """``tiny_unet(seed=0)``: a fresh deep copy of :func:`build`'s UNet, each seed built once
    (building takes seconds, a copy a fraction of one). What it keeps is never handed out."""

    def __init__(self) -> None:
        self._built: Dict[int, nn.Module] = {}

    def __call__(self, seed: int = 0) -> nn.Module:
        if seed not in self._built:
            self._built[seed] = build(seed)
        return copy.deepcopy(self._built[seed])


def unet_inputs(seed: int = 1, batch: int = 2, dtype: torch.dtype = torch.float32):
    """``(sample, timesteps, encoder_hidden_states)`` for the tiny UNet: latents 16 x 16, 77
    tokens of width 32, from their own generator."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, 16, 16, generator=g).to(dtype)
    context = torch.randn(batch, 77, 32, generator=g).to(dtype)
    return sample, torch.tensor([10, 700]), context


def run(unet: nn.Module, inputs, **kw) -> torch.Tensor:
    sample, t, context = inputs
    return unet(sample, t, context, **kw).sample
