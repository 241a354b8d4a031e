"""What autograd saved for backward, seen from below autograd: the write watch (:mod:`.mode`)
hands :meth:`SavedTensors.note` the autograd node of each op's outputs once autograd has
attached it (at the next op), and it walks the nodes it has not seen and notes each saved
tensor's memory and version. A write into that memory before backward is ``E0502``: autograd
holds a shared borrow until backward, and the version counter will refuse the graph then.

Saved-tensors hooks are left alone: tensors saved while such hooks are active are packed by
them (autograd no longer checks their versions), and unpacking them would run the hooks.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Set

import torch
from torch import Tensor
from torch.nn import Parameter

from .memory import Span, span

__all__ = ["Saved", "SavedTensors", "hooks_active", "overwritten", "reachable"]


class Saved(NamedTuple):
    node: Any  # the autograd node (kept alive for the audit: nodes take no weak references)
    attr: str  # its attribute that returns the tensor (``_saved_input``, ``saved_tensors``)
    tensor: Tensor
    version: int  # the tensor's version when saved
    span: Span
    module: str  # the innermost module running when it was saved


# Per autograd node class, its saved attributes that may hold a tensor (``_saved_input``,
# ``saved_tensors``): those found to hold a size, a scalar or a dtype are dropped the first time
# (the same for every node of the class). Keyed by autograd's node classes, which live as long as torch.
_ATTRS: Dict[type, List[str]] = {}


def _saved_attrs(cls: type) -> List[str]:
    found = _ATTRS.get(cls)
    if found is None:
        names = [a for a in dir(cls) if a.startswith("_saved_")]
        if hasattr(cls, "saved_tensors") and hasattr(cls, "_raw_saved_tensors"):  # autograd.Function nodes
            names.append("saved_tensors")
        found = _ATTRS[cls] = names
    return found


def _scalar(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(isinstance(v, (int, float, bool, torch.SymInt)) for v in value)
    return isinstance(value, (int, float, bool, str, torch.dtype, torch.device))


def hooks_active() -> bool:
    """Whether saved-tensors hooks are active (what autograd saves now, they pack)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class SavedTensors:
    """The tensors autograd saved, as :meth:`note` is shown their nodes; ``saving(span)``
    answers which saved tensors a write into ``span`` would overwrite."""

    def __init__(self) -> None:
        self.seen: Set[Any] = set()
        self._by_storage: Dict[int, List[Saved]] = {}
        self._params: List[Saved] = []  # the saved tensors that are parameters

    def note(self, node: Any, quiet: bool, module: str, at_op: Optional[Dict[int, Optional[Span]]] = None) -> None:
        """Walks the nodes behind ``node`` not seen yet, noting what each saved (nothing when
        ``quiet``: saved under saved-tensors hooks); ``module`` was running when they were;
        ``at_op``: the memory of the parameters the op was given, by id, as it used them."""
        seen = self.seen
        if node is None or node in seen:
            return
        stack = [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if not quiet:
                attrs = _ATTRS.get(type(n))
                if attrs is None:
                    attrs = _saved_attrs(type(n))
                if attrs:  # a node that saves nothing (AccumulateGrad, a view's) costs no call
                    self._note_saved(n, attrs, module, at_op)
            for next_node, _ in n.next_functions:
                if next_node is not None and next_node not in seen:
                    stack.append(next_node)

    def _note_saved(self, node: Any, attrs: List[str], module: str, at_op: Optional[Dict[int, Optional[Span]]]) -> None:
        scalars = None
        for attr in attrs:
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed, or saved as undefined
                continue
            if isinstance(value, Tensor):
                self._note_tensor(node, attr, value, module, at_op)
            elif _scalar(value):  # an int, a size, a dtype: never a tensor for this node class
                scalars = [attr] if scalars is None else [*scalars, attr]
            elif isinstance(value, (tuple, list)):
                for t in value:
                    if isinstance(t, Tensor):
                        self._note_tensor(node, attr, t, module, at_op)
        for attr in scalars or ():
            attrs.remove(attr)

    def _note_tensor(
        self, node: Any, attr: str, t: Tensor, module: str, at_op: Optional[Dict[int, Optional[Span]]]
    ) -> None:
        s = at_op[id(t)] if at_op is not None and id(t) in at_op else span(t)
        if s is not None:
            entry = Saved(node, attr, t, t._version, s, module)
            self._by_storage.setdefault(s.storage, []).append(entry)
            if type(t) is Parameter:
                self._params.append(entry)

    def saving(self, written: Span) -> List[Saved]:
        """The saved tensors, not yet overwritten since saved, whose memory ``written`` overlaps.
        Whether the write broke them is known only once the op has returned through autograd,
        which bumps the version counter (BatchNorm's running statistics are written without a
        bump, and backward accepts them): see :func:`overwritten`."""
        return [
            e
            for e in self._by_storage.get(written.storage, ())
            if e.span.overlaps(written) and e.tensor._version == e.version
        ]

    def swapped(self) -> List[Saved]:
        """The saved parameters whose memory is no longer what autograd saved (``.data =`` or
        ``set_`` swapped it since), each once; reported once."""
        found, kept = [], []
        for e in self._params:
            s = span(e.tensor)
            (found if s is not None and s.storage != e.span.storage else kept).append(e)
        self._params = kept
        return found


def overwritten(entries: Iterable[Saved]) -> List[Saved]:
    """The entries whose tensor's version moved since it was saved: backward through their
    node would raise."""
    return [e for e in entries if e.tensor._version != e.version]


def reachable(roots: Iterable[Any]) -> Set[Any]:
    """The autograd nodes reachable from ``roots`` (the graph a backward from them would run)."""
    seen: Set[Any] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(next_node for next_node, _ in n.next_functions)
    return seen
