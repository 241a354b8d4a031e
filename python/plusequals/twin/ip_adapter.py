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
bias-free ``nn.Linear``, and a different number of key and value projections.

The call (:class:`IPAdapter`, for ``RustBlock`` and the swap's ``RustTransformerBlock``): the image
embeddings are an argument of the Rust block's forward only, in eager calls on plain tensors
(:func:`forward_ip`), as diffusers' UNet passes them (:func:`forward_tuple`) or in diffusers'
deprecated tensor form (:meth:`IPAdapter.eager`). Everything else is refused with an
:class:`UnsupportedBlockError` naming the cause, never a ``TypeError`` or ``ValueError`` from the
boundary: a traced call, a donation, a malformed pair.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
from typing import Any, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from ..errors import UnsupportedBlockError
from .adapter import Adapter, Carried
from .arguments import check_tensor
from .config import BlockConfig
from .dispatch import seen_by_python, symbolic
from .hooks import run_under_saved_tensor_hooks
from .watch import class_name

__all__ = [
    "IP_ADAPTER",
    "IP_ADAPTER_PROCESSORS",
    "IPAdapter",
    "forward_ip",
    "forward_tuple",
    "read_ip_adapter",
    "split_tensor_context",
    "takes_images",
]

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


# --------------------------------------------------------------------------------------------
# The call
# --------------------------------------------------------------------------------------------


def forward_ip(now: Carried, x: Tensor, context: Any, masks: Mapping[str, Any], images: List[Tensor]) -> Tensor:
    """The block with IP-Adapter's image embeddings: eagerly, on plain tensors (the custom ops take none)."""
    check_tensor("encoder_hidden_states[0]", context)
    ip = now.config.ip_adapter
    if len(images) != len(ip):
        raise UnsupportedBlockError(
            f"{now.where}: encoder_hidden_states carries {len(images)} image embeddings for {len(ip)} "
            "IP-Adapters on attn2: pass one per adapter (diffusers' UNet does, from added_cond_kwargs)"
        )
    given = {k: m for k, m in masks.items() if m is not None}
    tensors = [x, context, *images, *given.values()]
    if (
        torch.compiler.is_compiling()
        or any(symbolic(t, None) or seen_by_python(t, None, dispatch_modes=False) for t in tensors)
        or now.functorch
    ):
        raise UnsupportedBlockError(
            f"{now.where}: a block with an IP-Adapter cannot be traced (torch.compile, torch.export, "
            "FakeTensor) or run under a mode, with tensor subclasses or functorch transforms: the custom ops "
            "take no image embeddings; call it eagerly on plain tensors"
        )
    call = functools.partial(now.rust, ip_adapter=images, **given)
    return run_under_saved_tensor_hooks(call, "forward", x, context)


def takes_images(now: Optional[Carried]) -> bool:
    """Whether the block (``now``: None when it follows no module) carries an IP-Adapter on attn2
    now: then a tuple context is IP-Adapter's (:func:`forward_tuple`); otherwise it is a bad
    ``context`` (a ``TypeError`` naming it)."""
    return now is not None and bool(now.config.ip_adapter)


def forward_tuple(
    now: Carried, x: Tensor, pair: Any, masks: Mapping[str, Any], donate: Optional[bool] = None
) -> Tensor:
    """``encoder_hidden_states`` as diffusers' UNet passes it when an IP-Adapter is loaded
    (``encoder_hid_dim_type="ip_image_proj"``): ``(text embeddings, [image embeddings])``, for attn2's
    IP-Adapter processor. Without one, or malformed, refused naming the cause, never a TypeError from
    the boundary. ``donate``: from ``forward_owned`` (False: the same sums, grad off; True: refused)."""
    processor = type(getattr(now.modules.get("attn2"), "processor", None)).__name__
    where = now.where
    if not now.config.ip_adapter:
        raise UnsupportedBlockError(
            f"{where}: encoder_hidden_states is a {type(pair).__name__}, IP-Adapter's (text embeddings, image "
            f"embeddings) that diffusers' UNet passes when an IP-Adapter is loaded, but attn2's processor is "
            f"{processor}, which takes one tensor"
        )
    if len(pair) != 2 or not isinstance(pair[1], (tuple, list)):
        raise UnsupportedBlockError(
            f"{where}: encoder_hidden_states must be (text embeddings, [image embeddings per adapter]) for attn2's "
            f"{processor}"
        )
    if donate:
        raise UnsupportedBlockError(f"{where}: {IP_ADAPTER.undonatable}; pass donate=False")
    for i, image in enumerate(pair[1]):
        check_tensor(f"encoder_hidden_states[1][{i}]", image)
    with torch.no_grad() if donate is False else contextlib.nullcontext():
        return forward_ip(now, x, pair[0], masks, list(pair[1]))


class IPAdapter(Adapter):
    """IP-Adapter on attn2 (module docstring)."""

    name = "IP-Adapter"
    processors = IP_ADAPTER_PROCESSORS
    undonatable = "a donation takes no IP-Adapter image embeddings"

    def read_processor(self, r: Any, processor: Any, attn: str, widths: tuple) -> None:
        read_ip_adapter(r, processor, attn)

    def own_masks(self, processor: str) -> bool:
        return processor == "IPAdapterAttnProcessor2_0"  # SDPA's masks, as the Rust block's

    def untraceable(self, config: BlockConfig, casting: bool, lora_layers: Sequence[str]) -> Optional[str]:
        if config is not None and config.ip_adapter:  # the ops take no image embeddings
            return "a block with an IP-Adapter (attn2) cannot be traced"
        return None

    def hot(self, config: BlockConfig) -> bool:
        return not config.ip_adapter  # the image embeddings are an argument of the full path only

    def takes(self, now: Carried) -> bool:
        return bool(now.config.ip_adapter)

    def eager(self, now: Carried, x: Tensor, context: Any, masks: Mapping[str, Any]) -> Tensor:
        """diffusers' deprecated tensor ``encoder_hidden_states``: split as diffusers splits it
        (:func:`split_tensor_context`), for one adapter only; refused, naming the cause, otherwise."""
        config, where = now.config, now.where
        if context is None:
            raise UnsupportedBlockError(
                f"{where}: attn2 carries an IP-Adapter, whose processor needs encoder_hidden_states (text and image "
                "embeddings); got None"
            )
        tokens = now.reading.ip_tokens
        if len(config.ip_adapter) != 1 or tokens is None:
            raise UnsupportedBlockError(
                f"{where}: encoder_hidden_states is a tensor for {len(config.ip_adapter)} IP-Adapters on attn2: "
                "diffusers' deprecated tensor form feeds its last num_tokens[0] tokens to the first adapter only; "
                "pass (text embeddings, [image embeddings per adapter]) as diffusers' UNet does"
            )
        text, images = split_tensor_context(context, tokens)
        return forward_ip(now, x, text, masks, images)


IP_ADAPTER = IPAdapter()
