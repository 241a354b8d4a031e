"""Where Python code would see the PyTorch block's torch calls, the PyTorch block's own forward
runs in place of the twin: :func:`why_delegated` and :func:`delegated`.

A TorchFunctionMode sees the torch calls made from Python: the PyTorch block's ``F.linear``,
``layer_norm``, ``scaled_dot_product_attention``, ... It may change them (a mode that adds 1 to
every ``F.linear``), and then the PyTorch block computes something else. So may an input tensor
subclass with its own ``__torch_function__`` (every torch call it takes part in) or
``__torch_dispatch__`` (every ATen op). The twin is one call (the custom op, or Rust itself): the
mode or subclass would see that call, not the ops inside it, and could not change them, so the
twin would be stale. Under such a mode, or with such an input, the block the twin follows runs
instead, on the same submodules, and the mode or subclass sees and changes what it would have;
once the mode exits, or with plain inputs, the twin runs again. Under a mode, a block with no
PyTorch block to run (``from_state_dict``), or one whose submodules were replaced on the twin and
not on the block, is refused, naming the mode; with such an input the twin is the only block
there is, and runs as the custom op, which the subclass sees as one op. ``torch.device(...)`` as
a context manager is a function mode too, but only picks the device of factory calls: the twin
keeps running under it; and a subclass whose torch calls are libtorch's own (``nn.Parameter``, or
one that only adds attributes) takes the custom op, which converts the result to its class.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from ..errors import UnsupportedBlockError
from .dispatch import _user_function_modes, own_hook, symbolic, tracing_tensor
from .donated import DonatedTensor
from .follow import Follow

__all__ = ["delegated", "delegated_call", "why_delegated"]

_CANNOT = "and may change them, while the twin's ops are one call it cannot change"


def why_delegated(x: Any, context: Any, masks: Dict[str, Any], follows: bool) -> Optional[str]:
    """Why an eager call must run the PyTorch block in the twin's place (module docstring), or
    None: a user's TorchFunctionMode is active, or, where the twin ``follows`` a PyTorch block, an
    input is a tensor subclass with its own ``__torch_function__`` or ``__torch_dispatch__``. None
    while tracing or fake: the custom ops run there, as the graph's op."""
    tensor_context = context if isinstance(context, Tensor) else None
    if torch.compiler.is_compiling() or symbolic(x, tensor_context) or any(map(tracing_tensor, masks.values())):
        return None
    modes = _user_function_modes()
    if modes:
        names = ", ".join(type(m).__qualname__ for m in modes)
        return f"a TorchFunctionMode is active ({names}), which sees the PyTorch block's torch calls {_CANNOT}"
    if not follows:
        return None
    for name, t in (("x", x), ("context", tensor_context), *masks.items()):
        if isinstance(t, DonatedTensor):
            continue  # no tensor to run on: refused by the route (arguments.check_tensor)
        hook = own_hook(type(t))
        if hook is not None:
            ops = "ATen ops" if hook == "__torch_dispatch__" else "torch calls"
            what = f"{name} is a {type(t).__qualname__}, a tensor subclass whose {hook}"
            return f"{what} sees the PyTorch block's {ops} {_CANNOT}"
    return None


def _source(follow: Optional[Follow], where: str, why: str) -> Any:
    """The PyTorch block whose forward is the twin's (named ``where``), which ``follow`` follows,
    or a refusal saying ``why`` it must run (:func:`why_delegated`)."""
    if follow is None:
        raise UnsupportedBlockError(
            f"{where}: {why}; this {where} has no PyTorch block to run in its place (built "
            "from a state dict): call it outside the mode, or build it with from_torch"
        )
    replaced = follow.replaced()
    if replaced:
        raise UnsupportedBlockError(
            f"{where}: {why}; its {', '.join(replaced)} was replaced here and not on the PyTorch block it "
            "follows, whose forward would run another module: call it with plain tensors, outside the mode"
        )
    return follow.source


def delegated(
    follow: Optional[Follow],
    where: str,
    why: str,
    x: Tensor,
    context: Any,
    masks: Dict[str, Any],
    owned: Optional[bool] = None,
) -> Tensor:
    """The twin's result from the PyTorch block it follows (:func:`_source`), called as the
    library calls it, under the active modes and on the inputs given. ``owned``: from ``forward_owned`` (grad off, and
    the caller's ``x`` only read: the PyTorch forward is out of place)."""
    source = _source(follow, where, why)
    masks = {k: v for k, v in masks.items() if v is not None}
    with torch.no_grad() if owned else contextlib.nullcontext():
        if type(source).__module__.startswith("diffusers."):
            return source(x, encoder_hidden_states=context, **masks)
        if isinstance(context, (tuple, list)):  # IP-Adapter's (text, [images]): the CompVis block's keyword
            return source(x, context[0], ip_adapter=list(context[1]), **masks)
        return source(x, context, **masks)


def delegated_call(follow: Optional[Follow], where: str, why: str, args: tuple, kwargs: Dict[str, Any]) -> Tensor:
    """The swap's: the library's block called with the arguments its replacement was given."""
    return _source(follow, where, why)(*args, **kwargs)
