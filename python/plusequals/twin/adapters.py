"""The eager calls of a block that carries IP-Adapter or Custom Diffusion (issue 34), for
``RustBlock`` and the swap's ``RustTransformerBlock``: what the custom ops cannot carry.

* IP-Adapter: the image embeddings are an argument of the Rust block's forward only, in eager
  calls on plain tensors (:func:`forward_ip`); a tensor context is split as diffusers splits its
  deprecated form (:func:`plusequals.twin.ip_adapter.split_tensor_context`).
* Custom Diffusion takes no masks (diffusers' processor hands the repeated mask to SDPA without
  viewing it per head).

Everything else is refused with an :class:`UnsupportedBlockError` naming the cause, never a
``TypeError`` or ``ValueError`` from the boundary. Imports no other twin module but ``arguments``,
``dispatch``, ``hooks`` and ``ip_adapter``; it takes the block as an argument.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..errors import UnsupportedBlockError
from .arguments import check_tensor
from .dispatch import seen_by_python, symbolic
from .hooks import run_under_saved_tensor_hooks
from .ip_adapter import split_tensor_context

__all__ = ["eager_extras", "forward_ip", "forward_tuple", "functorch_weights", "takes_images"]


def functorch_weights(block: Any) -> bool:
    """Whether a torch.func transform is active and ``block``'s weights are functorch-wrapped
    (``functional_call`` under ``grad``/``vmap``/``jvp``): they have no storage to build on."""
    if block._source is None or torch._C._functorch.peek_interpreter_stack() is None:
        return False
    return any(map(torch._C._functorch.is_functorch_wrapped_tensor, block.parameters()))


def forward_ip(block: Any, x: Tensor, context: Any, masks: Dict[str, Any], images: List[Tensor]) -> Tensor:
    """The block with IP-Adapter's image embeddings: eagerly, on plain tensors (the custom ops take none)."""
    check_tensor("encoder_hidden_states[0]", context)
    ip = block._config.ip_adapter if block._config is not None else ()
    if len(images) != len(ip):
        raise UnsupportedBlockError(
            f"{block._where()}: encoder_hidden_states carries {len(images)} image embeddings for {len(ip)} "
            "IP-Adapters on attn2: pass one per adapter (diffusers' UNet does, from added_cond_kwargs)"
        )
    given = {k: m for k, m in masks.items() if m is not None}
    tensors = [x, context, *images, *given.values()]
    if (
        torch.compiler.is_compiling()
        or any(symbolic(t, None) or seen_by_python(t, None, dispatch_modes=False) for t in tensors)
        or functorch_weights(block)
    ):
        raise UnsupportedBlockError(
            f"{block._where()}: a block with an IP-Adapter cannot be traced (torch.compile, torch.export, "
            "FakeTensor) or run under a mode, with tensor subclasses or functorch transforms: the custom ops "
            "take no image embeddings; call it eagerly on plain tensors"
        )
    call = functools.partial(block._call, ip_adapter=images, **given)
    return run_under_saved_tensor_hooks(call, "forward", x, context)


def takes_images(block: Any) -> bool:
    """Whether ``block`` follows a module whose attn2 carries an IP-Adapter now (read again if it
    changed): then a tuple context is IP-Adapter's (:func:`forward_tuple`); otherwise it is a bad
    ``context`` (a ``TypeError`` naming it)."""
    if block._source is None:
        return False
    block._ensure_current()
    return bool(block._config.ip_adapter)


def forward_tuple(block: Any, x: Tensor, pair: Any, masks: Dict[str, Any], donate: Optional[bool] = None) -> Tensor:
    """``encoder_hidden_states`` as diffusers' UNet passes it when an IP-Adapter is loaded
    (``encoder_hid_dim_type="ip_image_proj"``): ``(text embeddings, [image embeddings])``, for attn2's
    IP-Adapter processor. Without one, or malformed, refused naming the cause, never a TypeError from
    the boundary. ``donate``: from ``forward_owned`` (False: the same sums, grad off; True: refused)."""
    block._ensure_current()
    processor = type(getattr(block._modules.get("attn2"), "processor", None)).__name__
    where = block._where()
    if not block._config.ip_adapter:
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
        raise UnsupportedBlockError(f"{where}: a donation takes no IP-Adapter image embeddings; pass donate=False")
    for i, image in enumerate(pair[1]):
        check_tensor(f"encoder_hidden_states[1][{i}]", image)
    with torch.no_grad() if donate is False else contextlib.nullcontext():
        return forward_ip(block, x, pair[0], masks, list(pair[1]))


def eager_extras(block: Any, x: Tensor, context: Optional[Tensor], masks: Dict[str, Any]) -> Optional[Tensor]:
    """An eager call with a tensor (or no) context of a block that follows a module: the block read
    again if it changed, then IP-Adapter's deprecated tensor form computed, or what the Rust block
    cannot take refused, naming the cause; None when the plain call applies."""
    if block._source is None:
        return None
    block._ensure_current()
    config, where = block._config, block._where()
    if config.custom_diffusion and masks:
        attns = ", ".join(spec[0] for spec in config.custom_diffusion)
        raise UnsupportedBlockError(
            f"{where}: {' and '.join(masks)} with Custom Diffusion ({attns}): diffusers' "
            "CustomDiffusionAttnProcessor hands the mask, repeated per head over the batch, to the attention "
            "without viewing it per head, which the Rust block does not reproduce; call it without masks"
        )
    if not config.ip_adapter:
        return None
    if context is None:
        raise UnsupportedBlockError(
            f"{where}: attn2 carries an IP-Adapter, whose processor needs encoder_hidden_states (text and image "
            "embeddings); got None"
        )
    if len(config.ip_adapter) != 1 or block._ip_tokens is None:
        raise UnsupportedBlockError(
            f"{where}: encoder_hidden_states is a tensor for {len(config.ip_adapter)} IP-Adapters on attn2: "
            "diffusers' deprecated tensor form feeds its last num_tokens[0] tokens to the first adapter only; "
            "pass (text embeddings, [image embeddings per adapter]) as diffusers' UNet does"
        )
    text, images = split_tensor_context(context, block._ip_tokens)
    return forward_ip(block, x, text, masks, images)
