"""Which memory a tensor names, and which tensors an op writes: the facts the audit compares.

A tensor's memory is a :class:`Span`: its storage (the ``StorageImpl``'s address, so that views,
``copy.copy`` and ``.data`` of one buffer compare equal, on every device, meta included) and the
byte range its elements can reach. What an op writes is what its schema says: every argument
whose alias annotation is a write (``Tensor(a!)``), ``out=`` included.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

__all__ = ["WRITES", "Span", "Writes", "span", "tensors", "writes", "writes_of"]


class Span(NamedTuple):
    """The bytes ``[start, stop)`` of one storage that a tensor's elements can reach."""

    storage: int
    start: int
    stop: int

    def overlaps(self, other: "Span") -> bool:
        return self.storage == other.storage and self.start < other.stop and other.start < self.stop


def span(t: Tensor) -> Optional[Span]:
    """``t``'s memory; None for a tensor with no elements or no storage (a functorch wrapper,
    a sparse tensor, a wrapper subclass). Never seen by ``torch.jit.trace``: see :func:`_span`."""
    state = torch._C._get_tracing_state()
    if state is None:
        return _span(t)
    # Under the JIT tracer, numel() and its kin are recorded into the user's graph, and for a
    # tensor the trace has not seen that requires grad (a saved tensor autograd unpacked anew)
    # the tracer raises and leaves its thread state cleared: the trace's end then dereferences
    # it (SIGSEGV). The audit reads metadata; the trace is the user's.
    torch._C._set_tracing_state(None)
    try:
        return _span(t)
    finally:
        torch._C._set_tracing_state(state)


def _span(t: Tensor) -> Optional[Span]:
    try:
        numel = t.numel()
        if numel == 0:
            return None
        storage = t.untyped_storage()._cdata
        itemsize = t.element_size()
        # the elements reach one past the largest offset: numel for a contiguous tensor
        reach = numel if t.is_contiguous() else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    start = t.storage_offset() * itemsize
    return Span(storage, start, start + reach * itemsize)


def tensors(tree: Any) -> Iterator[Tensor]:
    """The tensors among ``tree``'s leaves (tuples, lists, dicts, nested)."""
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, Tensor))


class Writes(NamedTuple):
    """Where an op's written arguments are: positions and keyword names; whether it writes
    metadata only (``unsqueeze_``, ``t_``: torch's ``inplace_view`` tag)."""

    positions: Tuple[Tuple[int, str], ...]
    metadata_only: bool


WRITES: Dict[Any, Writes] = {}  # op -> where it writes: read directly on the hot path


def writes_of(func: Any) -> Writes:
    """Where ``func``'s schema says it writes (cached per op)."""
    found = WRITES.get(func)
    if found is None:
        schema = func._schema
        positions = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        found = WRITES[func] = Writes(positions, torch.Tag.inplace_view in func.tags)
    return found


def writes(func: Any, args: tuple, kwargs: dict) -> Tuple[List[Tensor], bool]:
    """The tensors ``func(*args, **kwargs)`` writes into, per its schema, and whether it writes
    their metadata only."""
    found = writes_of(func)
    if not found.positions:
        return [], False
    out: List[Tensor] = []
    for i, name in found.positions:
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(tensors(value))
    return out, found.metadata_only
