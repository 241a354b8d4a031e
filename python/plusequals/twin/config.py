"""One configuration type for the Rust block, passed by name everywhere: to ``_rust.Block``
(``**config._asdict()``), to the custom ops, and between ``RustBlock``, the reading of a module
and the ops. A leaf."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

__all__ = ["BlockConfig", "custom_diffusion_keys", "lora_keys", "rust_keys"]


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
    # Custom Diffusion (rust/custom_diffusion.rs): (attention, train_kv, train_q_out, out_bias) per
    # attention that carries it. Not a custom-op argument: refused where the custom ops would run.
    custom_diffusion: Tuple[Tuple[str, bool, bool, bool], ...] = ()

    @property
    def keys(self) -> Tuple[str, ...]:
        """The weights' CompVis keys, in the order the custom ops take them, then the LoRA terms',
        IP-Adapter's and Custom Diffusion's."""
        ip = tuple(f"attn2.ip.{i}.{p}.weight" for i in range(len(self.ip_adapter)) for p in ("to_k", "to_v"))
        return rust_keys(self.gated_ff) + lora_keys(self.lora) + ip + custom_diffusion_keys(self.custom_diffusion)

    @property
    def op_fields(self) -> tuple:
        """The fields the custom ops take, in their order (all but ``lora``, ``ip_adapter`` and
        ``custom_diffusion``)."""
        return tuple(self)[:7]


def lora_keys(lora: Tuple[Tuple[str, int, float, bool, bool], ...]) -> Tuple[str, ...]:
    """The LoRA terms' weights by key (``{linear}.lora.{i}.A.weight``, ``.B.weight``, ``.B.bias``,
    and DoRA's ``.magnitude``)."""
    keys = []
    for i, (linear, _, _, bias, dora) in enumerate(lora):
        parts = ["A.weight", "B.weight"] + ["B.bias"] * bias + ["magnitude"] * dora
        keys += [f"{linear}.lora.{i}.{part}" for part in parts]
    return tuple(keys)


def custom_diffusion_keys(specs: Tuple[Tuple[str, bool, bool, bool], ...]) -> Tuple[str, ...]:
    """Custom Diffusion's weights by key (``{attn}.custom_diffusion.to_q.weight``, ...: rust/custom_diffusion.rs)."""
    keys = []
    for attn, train_kv, train_q_out, out_bias in specs:
        layers = [("to_q", False)] * train_q_out + [("to_k", False), ("to_v", False)] * train_kv
        layers += [("to_out.0", out_bias)] * train_q_out
        for name, bias in layers:
            keys += [f"{attn}.custom_diffusion.{name}.weight"] + [f"{attn}.custom_diffusion.{name}.bias"] * bias
    return tuple(keys)


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
