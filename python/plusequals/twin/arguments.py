"""The arguments of a ``RustBlock`` call, as Python checks them before choosing a path: tensors,
not donated ones; ``forward_owned``'s grad rule; the masks by the Rust block's keyword names. Rust
checks the rest (layout, shape, dtype, device, named as torch names them)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .dispatch import seen_by_python
from .donated import DonatedTensor

__all__ = ["check_tensor", "masks_of", "pair", "refuse_grad", "seen"]


def check_tensor(name: str, t: object, optional: bool = False) -> None:
    """What Python checks of an argument before choosing a path: a tensor, not a donated one.
    Rust checks the rest (layout, shape, dtype, device, named as torch names them)."""
    if optional and t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, DonatedTensor):
        raise RuntimeError(
            f"{name} is a donated tensor: it was moved into RustBlock.forward_owned(..., donate=True); "
            "use the tensor that call returned, or pass donate=False to keep the input"
        )


def refuse_grad(x: Tensor, context: Optional[Tensor]) -> None:
    """``forward_owned``'s refusal of an input that requires grad while grad mode is on."""
    if torch.is_grad_enabled():
        for name, t in (("x", x), ("context", context)):
            if t is not None and t.requires_grad:
                raise RuntimeError(
                    f"forward_owned refuses {name}: it requires grad while grad mode is on. forward_owned adds "
                    "the residuals in place, which would overwrite activations autograd saved for backward "
                    "(the textual-inversion bug). Use forward() to train, or call forward_owned under "
                    "torch.no_grad() / torch.inference_mode()."
                )


def masks_of(attention_mask: object, encoder_attention_mask: object) -> Dict[str, Tensor]:
    """The masks given (tensors, not donated ones), by the Rust block's keyword names."""
    masks = {}
    for name, m in (("attention_mask", attention_mask), ("encoder_attention_mask", encoder_attention_mask)):
        check_tensor(name, m, optional=True)
        if m is not None:
            masks[name] = m
    return masks


def pair(masks: Dict[str, Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    return masks.get("attention_mask"), masks.get("encoder_attention_mask")


def seen(masks: Dict[str, Tensor], dispatch_modes: bool) -> bool:
    """Whether Python code must see a call with these masks (a subclass, a mode): see ``seen_by_python``."""
    return seen_by_python(*pair(masks), dispatch_modes=dispatch_modes)
