"""plusequals: the Stable Diffusion v1 residual block in PyTorch and in Rust, and what ``+=`` does to it.

The package mirrors the parts: :mod:`plusequals.model` (the PyTorch block and its twins that need
no Rust), :mod:`plusequals.twin` (the bridge to the Rust and C++ twins), :mod:`plusequals.bench`
(measure, analyse, render), :mod:`plusequals.audit` (rustc's verdicts on PyTorch code, at run
time), :mod:`plusequals.cases` (what the audit and the benchmarks run on) and :mod:`plusequals.cli`
(``python -m plusequals``). The exception classes are made in Rust and re-exported here
(:mod:`plusequals.errors`).

Import torch before the extension: ``plusequals._rust`` unwraps ``torch.Tensor`` objects and
needs torch's Python classes registered.
"""

import torch  # noqa: F401  (must precede the extension)

# plusequals.audit is the function (it shadows its package's attribute: `from plusequals.audit import
# cases` still imports the package's modules, through sys.modules)
from .audit import AuditReport, Finding, audit
from .errors import (
    DonationConsumed,
    OwnershipError,
    StaleBlock,
    UnsupportedBlockError,
    UseAfterDonation,
    WeightsChanged,
)
from .model.blocks import GEGLU, STRATEGIES, BasicTransformerBlock, CrossAttention, FeedForward
from .twin.block import CppBlock, RustBlock
from .twin.config import BlockConfig
from .twin.donated import DonatedTensor
from .twin.swap import (  # imports diffusers only when called: diffusers stays optional
    RustTransformerBlock,
    SwapHandle,
    sd_v1_unet_config,
    swap_transformer_blocks,
    unswap_transformer_blocks,
)

__all__ = [
    "STRATEGIES",
    "AuditReport",
    "BasicTransformerBlock",
    "BlockConfig",
    "CppBlock",
    "CrossAttention",
    "DonatedTensor",
    "DonationConsumed",
    "FeedForward",
    "Finding",
    "GEGLU",
    "OwnershipError",
    "RustBlock",
    "RustTransformerBlock",
    "StaleBlock",
    "SwapHandle",
    "UnsupportedBlockError",
    "UseAfterDonation",
    "WeightsChanged",
    "audit",
    "sd_v1_unet_config",
    "swap_transformer_blocks",
    "unswap_transformer_blocks",
]
__version__ = "0.1.0"
