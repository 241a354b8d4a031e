"""IP-Adapter on the Rust block's cross-attention: what :func:`plusequals.twin.faithful.read_block`
reads of diffusers' ``IPAdapterAttnProcessor2_0`` (and ``IPAdapterAttnProcessor``) on ``attn2``.

diffusers' processor (what ``rust/block.rs``, ``CrossAttention::forward_ip``, reproduces on its
tensors): ``encoder_hidden_states`` is the tuple ``(text, images)``; the text attention is
``AttnProcessor2_0``'s; then for each adapter ``i`` whose ``scale[i]`` is not 0,
``+ scale[i] * sdpa(q, to_k_ip[i](images[i]), to_v_ip[i](images[i]))`` (the image tokens of all
of the adapter's images, no mask, SDPA's default scale); then ``to_out``. The "plus" variants
differ only in the UNet's image projection (``encoder_hid_proj``), before the blocks.

diffusers also takes a plain tensor as ``encoder_hidden_states`` (deprecated): its last
``num_tokens[0]`` tokens are the image embedding, which only the first adapter reads
(:func:`split_tensor_context`; a ``RustBlock`` does the same, and refuses it, naming the cause,
with more than one adapter).

What the reading looks at is watched: the processor's ``to_k_ip``/``to_v_ip`` lists and their
layers' parameters, the items of ``scale`` (``set_ip_adapter_scale`` writes them in place) and
of ``num_tokens``; a change reads the block again. Refused, naming the cause: an IP-Adapter processor on ``attn1``,
a scale that is a list (per-image scales, used with ``ip_adapter_masks``), layers that are not
bias-free ``nn.Linear``, and a different number of key and value projections. A leaf: imports
nothing of the package but ``watch``.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import nn

from .watch import class_name

__all__ = ["IP_ADAPTER_PROCESSORS", "read_ip_adapter", "split_tensor_context"]

#: diffusers' IP-Adapter processors that the Rust block computes: the 2_0 one bitwise (SDPA), the
#: other one within 1e-5 (baddbmm and softmax instead of SDPA, as AttnProcessor).
IP_ADAPTER_PROCESSORS = ("IPAdapterAttnProcessor2_0", "IPAdapterAttnProcessor")


def read_ip_adapter(r: Any, processor: Any, name: str) -> None:
    """Reads the IP-Adapter ``processor`` of ``name`` with the reader ``r`` (``faithful._Reader``):
    one entry of ``r.ip_adapter`` (its scale) and two slots per adapter, or the reasons it is refused."""
    if name != "attn2":
        r.no(f"{name} uses {class_name(processor)}, an IP-Adapter processor on the self-attention")
        return
    w = r.w
    to_k, to_v = w.get(processor, "to_k_ip"), w.get(processor, "to_v_ip")
    scales = w.items(w.get(processor, "scale"))
    if type(to_k) is not nn.ModuleList or type(to_v) is not nn.ModuleList or len(to_k) != len(to_v):
        r.no(f"{name}.processor's to_k_ip/to_v_ip are not two nn.ModuleLists of one length")
        return
    if not isinstance(scales, list) or len(scales) != len(to_k):
        r.no(f"{name}.processor.scale is {scales!r}, not one scale per adapter ({len(to_k)})")
        return
    for i, scale in enumerate(scales):
        if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
            r.no(
                f"{name}.processor.scale[{i}] is {scale!r}: per-image scales (a list, used with ip_adapter_masks) "
                "are not supported by the Rust block; pass one number per adapter to set_ip_adapter_scale"
            )
            return
    for i in range(len(to_k)):
        for part, layers in (("to_k", to_k), ("to_v", to_v)):
            lin = w.get(layers, str(i))
            path = f"{name}.processor.{part}_ip.{i}"
            if type(lin) is not nn.Linear:
                r.no(f"{path} is {class_name(lin)}, not a plain nn.Linear")
                return
            r.param(lin, "weight", f"{path}.weight", f"{name}.ip.{i}.{part}.weight")
            if r.param(lin, "bias", f"{path}.bias") is not None:
                r.no(f"{path} has a bias; diffusers' to_k_ip/to_v_ip have none")
                return
    r.ip_adapter.extend(float(s) for s in scales)
    tokens = w.items(w.get(processor, "num_tokens"))
    if isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], int) and not isinstance(tokens[0], bool):
        r.ip_tokens = tokens[0]


def split_tensor_context(context: Any, tokens: int) -> tuple:
    """diffusers' deprecated tensor ``encoder_hidden_states`` for an IP-Adapter processor, split as
    it splits it: ``(text, [image])``, the image its last ``tokens`` tokens (``num_tokens[0]``)."""
    end_pos = context.shape[1] - tokens
    return context[:, :end_pos, :], [context[:, end_pos:, :]]
