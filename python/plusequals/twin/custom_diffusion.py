"""Custom Diffusion on the Rust block's attentions: what :func:`plusequals.twin.faithful.read_block`
reads of diffusers' ``CustomDiffusionAttnProcessor2_0`` (and ``CustomDiffusionAttnProcessor``) on
``attn1`` or ``attn2``.

diffusers' processor (what ``rust/processor/custom_diffusion.rs`` reproduces, op for op, on its tensors):
with ``train_q_out``, ``to_q_custom_diffusion`` and ``to_out_custom_diffusion`` replace the
attention's ``to_q`` and ``to_out``; with ``train_kv``, ``to_k_custom_diffusion`` and
``to_v_custom_diffusion`` replace ``to_k`` and ``to_v`` (the states cast to their dtype, the
results to ``to_q``'s). In a cross-attention call the first token's key and value are cut from the
graph (``detach * k + (1 - detach) * k.detach()``): the values are unchanged, the gradients not.
The Rust block takes those layers under the keys ``{attn}.custom_diffusion.to_q.weight``,
``.to_k.weight``, ``.to_v.weight``, ``.to_out.0.weight`` and ``.to_out.0.bias``
(rust/processor/custom_diffusion.rs; :attr:`plusequals.twin.config.BlockConfig.keys` reads them from there).

What the reading looks at is watched: ``train_kv``, ``train_q_out``, the layers and their
parameters, the output dropout; a change reads the block again. The layers a flag turns off are
the processor's own, unused (as in diffusers). Refused, naming the cause: flags that are not
bools, layers that are not ``nn.Linear`` (with a bias where diffusers has none), an output that is
not ``[Linear, Dropout]``, and an attention whose ``heads * d_head`` is not the block's width
(diffusers' 2_0 processor splits the heads by the hidden states' width). At the call
(:class:`CustomDiffusion`), masks are refused (diffusers' processor hands the mask, repeated per
head over the batch, to the attention without viewing it per head), and so is a traced call (the
custom ops take the base weights only).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from torch import nn

from ..errors import UnsupportedBlockError
from .adapter import Adapter, Carried
from .config import BlockConfig
from .watch import class_name

__all__ = [
    "CUSTOM_DIFFUSION",
    "CUSTOM_DIFFUSION_PROCESSORS",
    "CustomDiffusion",
    "KIND",
    "OPTIONS",
    "read_custom_diffusion",
]

#: Its kind in ``BlockConfig.processors`` (rust/processor/mod.rs, ``KINDS``), and its options there,
#: in rust/processor/custom_diffusion.rs's order: an entry is ``(KIND, attention, the options on)``.
KIND = "custom_diffusion"
OPTIONS = ("train_kv", "train_q_out", "out_bias")

_TRACED = "cannot be traced (torch.compile, torch.export, FakeTensor) or run under a mode or with tensor subclasses"

#: diffusers' Custom Diffusion processors that the Rust block computes: the 2_0 one bitwise (SDPA),
#: the other within 1e-5 (baddbmm and softmax instead of SDPA, as AttnProcessor).
CUSTOM_DIFFUSION_PROCESSORS = ("CustomDiffusionAttnProcessor2_0", "CustomDiffusionAttnProcessor")

_LAYERS = {
    "train_q_out": (("to_q", "to_q_custom_diffusion"),),
    "train_kv": (("to_k", "to_k_custom_diffusion"), ("to_v", "to_v_custom_diffusion")),
}


def read_custom_diffusion(r: Any, processor: Any, name: str, widths: tuple) -> None:
    """Reads the Custom Diffusion ``processor`` of ``name`` (``attn1``/``attn2``) with the reader
    ``r`` (``faithful._Reader``): one entry of ``r.processors`` and its slots, or the reasons
    it is refused. ``widths``: (the block's width, heads * d_head), None where unknown."""
    w = r.w
    flags = {flag: w.get(processor, flag) for flag in ("train_kv", "train_q_out")}
    for flag, value in flags.items():
        if type(value) is not bool:
            r.no(f"{name}.processor.{flag} is {value!r}, not a bool")
            return
    dim, inner = widths
    if None not in widths and dim != inner:
        r.no(
            f"{name} uses {class_name(processor)} with heads * d_head = {inner} and width {dim}: diffusers' "
            "processor splits the heads by the hidden states' width, which the Rust block does not reproduce"
        )
        return
    prefix = f"{name}.processor"
    for flag, layers in _LAYERS.items():
        for part, attr in layers:
            _layer(r, processor, f"{prefix}.{attr}", f"{name}.custom_diffusion.{part}", bias=False, used=flags[flag])
    out_bias = _output(r, processor, prefix, name, used=flags["train_q_out"])
    if out_bias is not None:
        on = {**flags, "out_bias": out_bias}
        r.processors.append((KIND, name, tuple(flag for flag in OPTIONS if on[flag])))


def _layer(r: Any, processor: Any, path: str, key: str, bias: bool, used: bool) -> bool:
    """One of the processor's linear layers: its slots when ``used``, else accounted for (the
    processor's own parameters, unused, as in diffusers). Returns whether it has a bias."""
    owner, attr = processor, path.rsplit(".", 1)[-1]
    if path.endswith(".0"):  # to_out_custom_diffusion.0
        owner, attr = r.w.get(processor, "to_out_custom_diffusion"), "0"
    lin = r.w.get(owner, attr)
    if not used:
        if isinstance(lin, nn.Module):
            r.accounted.update(f"{path}.{n}" for n in lin._parameters)
        return False
    if type(lin) is not nn.Linear:
        r.no(f"{path} is {class_name(lin)}, not a plain nn.Linear")
        return False
    r.param(lin, "weight", f"{path}.weight", f"{key}.weight")
    has_bias = r.param(lin, "bias", f"{path}.bias", f"{key}.bias" if bias else None) is not None
    if has_bias and not bias:
        r.no(f"{path} has a bias; diffusers' Custom Diffusion q/k/v layers have none")
    return has_bias


def _output(r: Any, processor: Any, prefix: str, name: str, used: bool) -> Any:
    """``to_out_custom_diffusion`` (``[Linear, Dropout]``): whether its linear has a bias, or None
    when refused. Unused (``train_q_out`` off) it is False."""
    if not used:
        _layer(r, processor, f"{prefix}.to_out_custom_diffusion.0", "", bias=True, used=False)
        return False
    out = r.w.get(processor, "to_out_custom_diffusion")
    if type(out) is not nn.ModuleList or len(out) != 2:
        r.no(f"{prefix}.to_out_custom_diffusion is {class_name(out)}, not [Linear, Dropout]")
        return None
    bias = _layer(r, processor, f"{prefix}.to_out_custom_diffusion.0", f"{name}.custom_diffusion.to_out.0", True, True)
    r.dropout(r.w.get(out, "1"), f"{prefix}.to_out_custom_diffusion.1")
    return bias


def _attns(config: BlockConfig) -> str:
    return ", ".join(attn for kind, attn, _ in config.processors if kind == KIND)


class CustomDiffusion(Adapter):
    """Custom Diffusion on attn1 or attn2 (module docstring)."""

    name = "Custom Diffusion"
    processors = CUSTOM_DIFFUSION_PROCESSORS

    def read_processor(self, r: Any, processor: Any, attn: str, widths: tuple) -> None:
        read_custom_diffusion(r, processor, attn, widths)

    def own_masks(self, processor: str) -> bool:
        return processor in self.processors  # refused (check)

    def untraceable(self, config: BlockConfig, casting: bool, lora_layers: Sequence[str]) -> Optional[str]:
        if config is not None and _attns(config):  # the ops take no layers of its
            return (
                f"a block with Custom Diffusion ({_attns(config)}) {_TRACED}: the custom ops take the base weights "
                "only; call it eagerly on plain tensors"
            )
        return None

    def check(self, now: Carried, masks: Mapping[str, Any]) -> None:
        if masks and _attns(now.config):
            raise UnsupportedBlockError(
                f"{now.where}: {' and '.join(masks)} with Custom Diffusion ({_attns(now.config)}): diffusers' "
                "CustomDiffusionAttnProcessor hands the mask, repeated per head over the batch, to the attention "
                "without viewing it per head, which the Rust block does not reproduce; call it without masks"
            )


CUSTOM_DIFFUSION = CustomDiffusion()
