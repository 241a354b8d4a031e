"""One configuration type for the Rust block, passed by name everywhere: to ``_rust.Block`` (as
``_rust.Config(**config._asdict())``), to the custom ops, and between ``RustBlock``, the reading of
a module and the ops; and the keys of the weights it takes, which the extension gives. Imports nothing of
the package but the extension."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

from .. import _rust

__all__ = ["OP_FIELDS", "BlockConfig", "rust_keys"]


class BlockConfig(NamedTuple):
    """What the weights alone do not tell the Rust block, and which twin computes."""

    dim: int
    n_heads: int
    d_head: int
    context_dim: Optional[int]
    gated_ff: bool
    attention: str  # "sdpa" or "einsum"
    language: str = "rust"  # "rust" (rust/block.rs) or "cpp" (cpp/block.cpp)
    # The PEFT LoRA terms on the linear layers (rust/linear.rs, LoraSpec): (linear's CompVis key,
    # rank, scaling, whether lora_B has a bias, whether it is DoRA), in the order they are added.
    # Not a custom-op argument: a block with LoRA terms is refused where the custom ops would run.
    lora: Tuple[Tuple[str, int, float, bool, bool], ...] = ()
    # IP-Adapter on attn2 (rust/block.rs, IpAdapter): one scale per adapter. Not a custom-op
    # argument either: refused where the custom ops would run.
    ip_adapter: Tuple[float, ...] = ()
    # The attention processors with layers of their own (rust/processor/mod.rs: Custom Diffusion):
    # (kind, attention, the options that are on) per attention that carries one. Not a custom-op
    # argument: refused where the custom ops would run.
    processors: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = ()

    @property
    def keys(self) -> Tuple[str, ...]:
        """The weights' CompVis keys, in the order the custom ops take them: the PyTorch block's
        (``attn1``'s, ``attn2``'s, the feed-forward's, the norms'), then the LoRA terms'
        (``{linear}.lora.{i}.A.weight``, ...), IP-Adapter's (``attn2.ip.{i}.to_k.weight``, ...) and
        the processors' (``{attn}.custom_diffusion.to_q.weight``, ...). Read from the Rust block
        (``BlockConfig::weight_keys`` in rust/block.rs), the one list of them; a configuration
        the Rust block refuses raises its ``ValueError``."""
        return _weight_keys(self)

    @property
    def op_fields(self) -> tuple:
        """The fields the custom ops take, in their order (all but ``lora``, ``ip_adapter`` and
        ``processors``)."""
        return tuple(self)[: len(OP_FIELDS)]


#: The fields the custom ops take (twin/ops.py), in their order: the adapters' terms are no
#: custom-op argument (a block with them is refused where the custom ops would run).
OP_FIELDS: Tuple[str, ...] = BlockConfig._fields[: BlockConfig._fields.index("lora")]


@functools.lru_cache(maxsize=256)
def _weight_keys(config: BlockConfig) -> Tuple[str, ...]:
    return tuple(_rust.Config(**config._asdict()).weight_keys())


def rust_keys(gated_ff: bool) -> Tuple[str, ...]:
    """The weights of the PyTorch block, without adapters, by CompVis key, in the order the
    custom ops take them."""
    return BlockConfig(1, 1, 1, None, gated_ff, "sdpa").keys
