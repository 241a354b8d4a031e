"""Letting go of a parameter before torch swaps it: :func:`follow`.

With ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``.to()``, ``.double()`` and
``load_state_dict`` swap each parameter's TensorImpl in place (``torch.utils.swap_tensors``), which
refuses while anything but the Python object holds it (libtorch's use count). A twin made from a
module holds the module's parameters in its Rust block. Called on the twin, its own ``_apply`` lets
go first (``RustBlock._let_go_for_swap``); called on the PyTorch block it follows, which the user
still holds, nothing of the twin runs. So every call of ``torch.utils.swap_tensors`` (torch's
modules call it by that name) first asks each twin that holds one of the two tensors to let go:
it drops its Rust block and reads the module again, and builds again, on its next call.

The twins are held weakly (never the tensors: ``swap_tensors`` refuses a tensor with a weak
reference). With no twin holding either tensor, ``swap_tensors`` is torch's own, unchanged.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

__all__ = ["follow"]

_TWINS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _holds(twin: Any, t: Any) -> bool:
    weights = twin.__dict__.get("_weights")
    return weights is not None and any(w is t for w in weights)


def _letting_go(swap: Any) -> Any:
    @functools.wraps(swap)
    def swap_tensors(t1: Any, t2: Any) -> Any:
        for twin in list(_TWINS):
            if _holds(twin, t1) or _holds(twin, t2):
                twin._let_go()
        return swap(t1, t2)

    swap_tensors._plusequals_lets_go = True  # type: ignore[attr-defined]
    return swap_tensors


def follow(twin: Any) -> None:
    """Registers ``twin`` (a RustBlock following a module) to let go of its parameters before
    torch swaps one of them; installs the wrapper of ``torch.utils.swap_tensors`` once."""
    _TWINS.add(twin)
    if not getattr(torch.utils.swap_tensors, "_plusequals_lets_go", False):
        torch.utils.swap_tensors = _letting_go(torch.utils.swap_tensors)
