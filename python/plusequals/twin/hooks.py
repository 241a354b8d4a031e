"""Python exceptions from saved-tensor hooks, across a call into Rust."""

from __future__ import annotations

from typing import Any, List

import torch
from torch import Tensor

__all__ = ["run_under_saved_tensor_hooks"]


class _Unhooked:
    """A tensor saved after an outer pack hook raised (the recomputation stops there anyway)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def run_under_saved_tensor_hooks(fn, *args):
    """``fn(*args)`` (a call into Rust), with any exception an active saved-tensor pack hook
    raises delivered to Python with its own type once ``fn`` returns.

    Without this, an exception raised by a Python pack hook inside a libtorch op called from
    Rust is flattened by tch into ``RuntimeError('Internal torch error: ')``. That breaks
    non-reentrant ``torch.utils.checkpoint`` (diffusers' gradient checkpointing), whose
    recomputation stops early by raising ``_StopRecomputationError`` from its pack hook once
    every tensor it needs is recomputed. Here the outer hooks are wrapped: the first exception
    is held, the rest of ``fn`` runs without calling the outer pack hook again (what it saves
    then is discarded with the stopped recomputation), and the exception is raised after.
    """
    if not torch.is_grad_enabled() or not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return fn(*args)
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return fn(*args)
    outer_pack, outer_unpack = top
    raised: List[BaseException] = []

    def pack(t: Tensor) -> Any:
        if raised:
            return _Unhooked(t)
        try:
            return outer_pack(t)
        except BaseException as e:  # noqa: BLE001  (re-raised below, type intact)
            raised.append(e)
            return _Unhooked(t)

    def unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Unhooked) else outer_unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args)
    if raised:
        raise raised[0]
    return out
