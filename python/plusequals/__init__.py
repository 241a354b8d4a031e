"""plusequals: the Stable Diffusion v1 residual block in PyTorch and in Rust, and what ``+=`` does to it.

Import torch before the extension: ``plusequals._rust`` unwraps ``torch.Tensor`` objects and
needs torch's Python classes registered.
"""

import torch  # noqa: F401  (must precede the extension)

from .blocks import STRATEGIES, BasicTransformerBlock, CrossAttention, FeedForward, GEGLU
from .rust import DonatedTensor, RustBlock

__all__ = [
    "STRATEGIES",
    "BasicTransformerBlock",
    "CrossAttention",
    "FeedForward",
    "GEGLU",
    "RustBlock",
    "DonatedTensor",
]
__version__ = "0.1.0"
