"""plusequals: the Stable Diffusion v1 residual block in PyTorch and in Rust, and what ``+=`` does to it.

The package mirrors the parts: :mod:`plusequals.model` (the PyTorch block and its twins that need
no Rust), :mod:`plusequals.twin` (the bridge to the Rust and C++ twins), :mod:`plusequals.bench`
(measure, analyse, render), :mod:`plusequals.auditing` (rustc's verdicts on PyTorch code, at run
time), :mod:`plusequals.cases` (what the audit and the benchmarks run on) and :mod:`plusequals.cli`
(``python -m plusequals``). The exception classes are made in Rust and re-exported here
(:mod:`plusequals.errors`).

Import torch before the extension: ``plusequals._rust`` unwraps ``torch.Tensor`` objects and
needs torch's Python classes registered.
"""

import torch  # noqa: F401  (must precede the extension)

from .auditing import AuditReport, Finding, audit
from .errors import (
    DonationConsumed,
    OwnershipError,
    StaleBlock,
    UnsupportedBlockError,
    UseAfterDonation,
    WeightsChanged,
)
from .model.blocks import BasicTransformerBlock
from .twin.block import CppBlock, RustBlock
from .twin.donated import DonatedTensor
from .twin.swap import sd_v1_unet_config, swap_transformer_blocks  # diffusers is imported only when called

# What the README and the guide use: the block, its twins, the swap, the audit and its report, the
# errors. The rest is imported from its subpackage (plusequals.model.blocks.STRATEGIES,
# plusequals.twin.config.BlockConfig, plusequals.twin.swap.SwapHandle, ...).
__all__ = [
    "AuditReport",
    "BasicTransformerBlock",
    "CppBlock",
    "DonatedTensor",
    "DonationConsumed",
    "Finding",
    "OwnershipError",
    "RustBlock",
    "StaleBlock",
    "UnsupportedBlockError",
    "UseAfterDonation",
    "WeightsChanged",
    "audit",
    "sd_v1_unet_config",
    "swap_transformer_blocks",
]
__version__ = "0.1.0"
