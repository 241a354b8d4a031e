"""Where a call of a ``RustBlock`` goes once the hot path (one call into Rust) handed it back,
decided once per call: :func:`route` (``forward``) and :func:`route_owned` (``forward_owned``)
return a :class:`Route`, or raise the refusal.

The paths, in the order they are tried:

* a user's TorchFunctionMode is active, or (where the twin follows a PyTorch block) an input is a
  tensor subclass with its own ``__torch_function__`` or ``__torch_dispatch__``: the PyTorch
  block runs in the twin's place (:mod:`plusequals.twin.delegate`);
* IP-Adapter's ``(text, [images])`` context (:mod:`plusequals.twin.ip_adapter`);
* traced or fake (``torch.compile``, ``torch.export``, FakeTensor): the custom ops
  (:mod:`plusequals.twin.ops`), which take the weights as arguments;
* functorch-wrapped weights: the custom op where the transform has a rule for it, else refused;
* a tensor subclass would see the ops (one that converts results, or any where the twin follows
  no PyTorch block): the custom ops, eagerly; a TorchDispatchMode sees the Rust
  block's own ops (``forward_owned`` computes as ``forward`` then, grad off, writing nothing in place);
* an adapter computes it, or refuses it (:mod:`plusequals.twin.adapter`);
* ``forward_owned(donate=True)``: the donation's transaction;
* otherwise the Rust block, eagerly.

It sees the block only through what it is given: ``follows`` (whether it follows a PyTorch
block), ``current`` (the block read again if it changed, as an adapter sees it; None when it
follows no module), ``functorch`` (whether its weights are
functorch-wrapped now) and the adapters.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..errors import UnsupportedBlockError
from .adapter import Adapter, Carried
from .arguments import check_tensor, pair, refuse_grad, seen
from .delegate import why_delegated
from .dispatch import seen_by_python, symbolic
from .ip_adapter import takes_images

__all__ = ["Path", "Route", "route", "route_owned"]


class Path(enum.Enum):
    DELEGATE = "delegate"  # a user's TorchFunctionMode, or an input subclass: the PyTorch block runs (Route.why)
    IMAGES = "images"  # IP-Adapter's (text, [images]) context (Route.now)
    TRACED = "traced"  # traced or fake: the custom ops
    FUNCTORCH = "functorch"  # functorch-wrapped weights: the custom op, or refused
    SEEN = "seen"  # a tensor subclass would see the ops: the custom ops, eagerly
    ADAPTER = "adapter"  # an adapter computes it (Route.adapter, Route.now)
    FORWARD = "forward"  # forward_owned as forward, grad off: an adapter's inputs, or a TorchDispatchMode
    DONATE = "donate"  # forward_owned(donate=True): the donation's transaction
    RUST = "rust"  # the Rust block, eagerly


class Route(NamedTuple):
    """Where a call goes (:class:`Path`), with what that path needs."""

    path: Path
    why: str = ""  # DELEGATE: why the PyTorch block runs (twin/delegate.py)
    now: Optional[Carried] = None  # IMAGES, ADAPTER: the block as the adapter sees it
    adapter: Optional[Adapter] = None  # ADAPTER: the adapter that computes it


Current = Callable[[], Optional[Carried]]


def _traced(x: Tensor, context: Any, masks: Dict[str, Tensor]) -> bool:
    return torch.compiler.is_compiling() or symbolic(x, context) or (bool(masks) and symbolic(*pair(masks)))


def _images(context: Any, current: Current) -> Optional[Route]:
    """IP-Adapter's (text, [images]) context, where the block carries one now (a tuple context is a
    bad ``context`` otherwise: a ``TypeError`` naming it)."""
    if isinstance(context, (tuple, list)):
        now = current()
        if takes_images(now):
            return Route(Path.IMAGES, now=now)
    return None


def _taker(now: Carried, adapters: Sequence[Adapter]) -> Optional[Adapter]:
    return next((a for a in adapters if a.takes(now)), None)


def route(
    x: Tensor,
    context: Any,
    masks: Dict[str, Tensor],
    *,
    follows: bool,
    current: Current,
    functorch: Callable[[], bool],
    adapters: Sequence[Adapter],
) -> Route:
    """``forward``'s route (module docstring)."""
    why = why_delegated(x, context, masks, follows)  # Python code would see the PyTorch block's calls: it runs
    if why is not None:
        return Route(Path.DELEGATE, why)
    images = _images(context, current)
    if images is not None:
        return images
    if _traced(x, context, masks):
        return Route(Path.TRACED)
    if functorch():
        return Route(Path.FUNCTORCH)
    check_tensor("x", x)
    check_tensor("context", context, optional=True)
    if seen_by_python(x, context, dispatch_modes=False) or (masks and seen(masks, dispatch_modes=False)):
        return Route(Path.SEEN)
    now = current()
    if now is not None:
        for adapter in adapters:  # what the Rust block cannot take with an adapter: refused
            adapter.check(now, masks)
        taker = _taker(now, adapters)
        if taker is not None:
            return Route(Path.ADAPTER, now=now, adapter=taker)
    return Route(Path.RUST)


def route_owned(
    x: Tensor,
    context: Any,
    masks: Dict[str, Tensor],
    donate: bool,
    *,
    where: str,
    follows: bool,
    current: Current,
    functorch: Callable[[], bool],
    adapters: Sequence[Adapter],
) -> Route:
    """``forward_owned``'s route (module docstring): grad off, and a donation refused wherever it
    cannot be one transaction."""
    why = None if donate else why_delegated(x, context, masks, follows)  # a donation there: refused (_donate)
    if why is not None:
        refuse_grad(x, context if isinstance(context, Tensor) else None)
        return Route(Path.DELEGATE, why)
    images = _images(context, current)  # forward's sums, grad off
    if images is not None:
        return images
    traced = _traced(x, context, masks)
    if not traced and functorch():
        raise UnsupportedBlockError(
            f"{where}: forward_owned cannot run on functorch-wrapped weights (torch.func.grad, vmap or "
            "jvp over functional_call): the in-place forward needs the weights' storage"
        )
    check_tensor("x", x)
    check_tensor("context", context, optional=True)
    refuse_grad(x, context)
    now = None if traced else current()
    if now is not None:
        taker = _taker(now, adapters)
        if taker is not None:  # its inputs are forward's: the same sums
            if donate:
                raise UnsupportedBlockError(f"{now.where}: {taker.undonatable}")
            return Route(Path.FORWARD)
        for adapter in adapters:
            adapter.check(now, masks)
    if donate:
        if traced:
            raise RuntimeError(
                "forward_owned(donate=True) cannot be traced (torch.compile, torch.export, FakeTensor): a donated "
                "tensor is invalidated in Python, which a graph cannot express; pass donate=False (the compiler "
                "may still reuse the buffer)"
            )
        return Route(Path.DONATE)
    if traced:
        return Route(Path.TRACED)
    return Route(_eager_owned(x, context, masks))


def _eager_owned(x: Tensor, context: Any, masks: Dict[str, Tensor]) -> Path:
    """An eager ``forward_owned``'s path: the custom ops where a tensor subclass would see the call;
    under a TorchDispatchMode, which sees the Rust block's ops out of place as ``forward``'s (the
    PyTorch block's), ``forward`` grad off, with no x to write; otherwise the Rust block in place."""
    if seen_by_python(x, context, dispatch_modes=False) or (masks and seen(masks, dispatch_modes=False)):
        return Path.SEEN
    if seen_by_python(x, context, dispatch_modes=True):
        return Path.FORWARD
    return Path.RUST
