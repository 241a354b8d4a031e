"""Under a user's TorchFunctionMode, the PyTorch block's own forward runs in place of the twin:
:func:`under_function_mode` and :func:`delegated`.

A TorchFunctionMode sees the torch calls made from Python: the PyTorch block's ``F.linear``,
``layer_norm``, ``scaled_dot_product_attention``, ... It may change them (a mode that adds 1 to
every ``F.linear``), and then the PyTorch block computes something else. The twin is one call (the
custom op, or Rust itself): the mode would see that call, not the ops inside it, and could not
change them, so the twin would be stale. Under such a mode the block the twin follows runs
instead, on the same submodules, and the mode sees and changes what it would have; once the mode
exits, the twin runs again. A block with no PyTorch block to run (``from_state_dict``), or one
whose submodules were replaced on the twin and not on the block, is refused, naming the mode.
``torch.device(...)`` as a context manager is a function mode too, but only picks the device of
factory calls: the twin keeps running under it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from ..errors import UnsupportedBlockError
from .dispatch import _user_function_modes, symbolic
from .follow import Follow

__all__ = ["delegated", "delegated_call", "under_function_mode"]


def under_function_mode(x: Any, context: Any) -> List[str]:
    """The names of the user's active TorchFunctionModes where an eager call must run the PyTorch
    block (empty while tracing or fake: the custom ops run there, as the graph's op)."""
    modes = _user_function_modes()
    if not modes or torch.compiler.is_compiling() or symbolic(x, context if isinstance(context, Tensor) else None):
        return []
    return [type(m).__qualname__ for m in modes]


def _source(follow: Optional[Follow], where: str, modes: List[str]) -> Any:
    """The PyTorch block whose forward is the twin's (named ``where``), which ``follow`` follows,
    or a refusal naming the modes."""
    why = f"a TorchFunctionMode is active ({', '.join(modes)}), which sees the PyTorch block's torch calls and may "
    why += "change them, while the twin's ops are one call it cannot change"
    if follow is None:
        raise UnsupportedBlockError(
            f"{where}: {why}; this {where} has no PyTorch block to run in its place (built "
            "from a state dict): call it outside the mode, or build it with from_torch"
        )
    replaced = follow.replaced()
    if replaced:
        raise UnsupportedBlockError(
            f"{where}: {why}; its {', '.join(replaced)} was replaced here and not on the PyTorch block it "
            "follows, whose forward would run another module: call it outside the mode"
        )
    return follow.source


def delegated(
    follow: Optional[Follow],
    where: str,
    modes: List[str],
    x: Tensor,
    context: Any,
    masks: Dict[str, Any],
    owned: Optional[bool] = None,
) -> Tensor:
    """The twin's result from the PyTorch block it follows (:func:`_source`), called as the
    library calls it, under the active modes. ``owned``: from ``forward_owned`` (grad off, and
    the caller's ``x`` only read: the PyTorch forward is out of place)."""
    source = _source(follow, where, modes)
    masks = {k: v for k, v in masks.items() if v is not None}
    with torch.no_grad() if owned else contextlib.nullcontext():
        if type(source).__module__.startswith("diffusers."):
            return source(x, encoder_hidden_states=context, **masks)
        if isinstance(context, (tuple, list)):  # IP-Adapter's (text, [images]): the CompVis block's keyword
            return source(x, context[0], ip_adapter=list(context[1]), **masks)
        return source(x, context, **masks)


def delegated_call(
    follow: Optional[Follow], where: str, modes: List[str], args: tuple, kwargs: Dict[str, Any]
) -> Tensor:
    """The swap's: the library's block called with the arguments its replacement was given."""
    return _source(follow, where, modes)(*args, **kwargs)
