"""Letting go of a parameter before torch swaps it: :func:`follow`.

With ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``.to()``, ``.double()`` and
``load_state_dict`` swap each parameter's TensorImpl in place (``torch.utils.swap_tensors``), which
refuses while anything but the Python object holds it (libtorch's use count). A twin made from a
module holds the module's parameters in its Rust block. Called on the twin, its own ``_apply`` lets
go first (``RustBlock._let_go_for_swap``); called on the PyTorch block it follows, which the user
still holds, nothing of the twin runs. So every call of ``torch.utils.swap_tensors`` (torch's
modules call it by that name) first asks each twin's :class:`~plusequals.twin.follow.Follow` that
holds one of the two tensors to let go: the twin drops its Rust block and reads the module again,
and builds again, on its next call.

The followers are held weakly (never the tensors: ``swap_tensors`` refuses a tensor with a weak
reference). With none holding either tensor, ``swap_tensors`` is torch's own, unchanged.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

__all__ = ["follow"]

_FOLLOWS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # twin/follow.py's Follow: holds(t), let_go()


def _letting_go(swap: Any) -> Any:
    @functools.wraps(swap)
    def swap_tensors(t1: Any, t2: Any) -> Any:
        for f in list(_FOLLOWS):
            if f.holds(t1) or f.holds(t2):
                f.let_go()
        return swap(t1, t2)

    swap_tensors._plusequals_lets_go = True  # type: ignore[attr-defined]
    return swap_tensors


def follow(f: Any) -> None:
    """Registers ``f`` (a twin following a module) to let go of its parameters before torch swaps
    one of them; installs the wrapper of ``torch.utils.swap_tensors`` once."""
    _FOLLOWS.add(f)
    if not getattr(torch.utils.swap_tensors, "_plusequals_lets_go", False):
        torch.utils.swap_tensors = _letting_go(torch.utils.swap_tensors)
