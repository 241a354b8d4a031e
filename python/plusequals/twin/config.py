"""One configuration type for the Rust block, passed by name everywhere: to ``_rust.Block``
(``**config._asdict()``), to the custom ops, and between ``RustBlock``, the reading of a module
and the ops. A leaf."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

__all__ = ["BlockConfig", "rust_keys"]


class BlockConfig(NamedTuple):
    """What the weights alone do not tell the Rust block, and which twin computes."""

    dim: int
    n_heads: int
    d_head: int
    context_dim: Optional[int]
    gated_ff: bool
    attention: str  # "sdpa" or "einsum"
    language: str = "rust"  # "rust" (rust/block.rs) or "cpp" (cpp/block.cpp)

    @property
    def keys(self) -> Tuple[str, ...]:
        """The weights' CompVis keys, in the order the custom ops take them."""
        return rust_keys(self.gated_ff)


def rust_keys(gated_ff: bool) -> Tuple[str, ...]:
    """The Rust block's weights by CompVis key, in the order the custom ops take them."""
    proj = "ff.net.0.proj" if gated_ff else "ff.net.0.0"
    keys = []
    for attn in ("attn1", "attn2"):
        keys += [
            f"{attn}.to_q.weight",
            f"{attn}.to_k.weight",
            f"{attn}.to_v.weight",
            f"{attn}.to_out.0.weight",
            f"{attn}.to_out.0.bias",
        ]
    keys += [f"{proj}.weight", f"{proj}.bias", "ff.net.2.weight", "ff.net.2.bias"]
    for norm in ("norm1", "norm2", "norm3"):
        keys += [f"{norm}.weight", f"{norm}.bias"]
    return tuple(keys)
