"""plusequals: the Stable Diffusion v1 residual block in PyTorch and in Rust, and what ``+=`` does to it.

Import torch before the extension: ``plusequals._rust`` unwraps ``torch.Tensor`` objects and
needs torch's Python classes registered.
"""

import torch  # noqa: F401  (must precede the extension)

from .model.blocks import STRATEGIES, BasicTransformerBlock, CrossAttention, FeedForward, GEGLU
from .twin import aliases
from .twin.block import CppBlock, DonatedTensor, RustBlock
from .twin.swap import (  # imports diffusers only when called: diffusers stays optional
    RustTransformerBlock,
    SwapHandle,
    UnsupportedBlockError,
    sd_v1_unet_config,
    swap_transformer_blocks,
    unswap_transformer_blocks,
)

__all__ = [
    "CppBlock",
    "STRATEGIES",
    "BasicTransformerBlock",
    "CrossAttention",
    "FeedForward",
    "GEGLU",
    "RustBlock",
    "DonatedTensor",
    "RustTransformerBlock",
    "SwapHandle",
    "UnsupportedBlockError",
    "sd_v1_unet_config",
    "swap_transformer_blocks",
    "unswap_transformer_blocks",
]
__version__ = "0.1.0"
