"""An audited run against a plain one from the same seed: the audit must observe and change nothing.

:func:`paired` builds a model from a seed, copies it, and runs each copy the same way, one plainly and
one through :func:`plusequals.audit`: a train step (forward, then a backward from the sum of the
outputs that need grad, as the audit's own) and then an eval forward under ``no_grad``. After each
phase it compares, bit for bit, the outputs, every parameter and its gradient, every buffer, and
the inputs (and their gradients); and the number of times each ATen op ran, counted by a dispatch
mode under both runs (so a fused kernel that a module hook would switch off, such as
``nn.TransformerEncoderLayer``'s, must run as often audited as plain). What differs is returned,
named; an empty list is a run the audit did not change.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..auditing import AuditReport, audit
from ..auditing.scope import backward_from

__all__ = ["OpCount", "Paired", "paired", "differences"]

Build = Callable[[], Tuple[nn.Module, tuple, dict]]


class OpCount(TorchDispatchMode):
    """How many times each ATen op ran (by its overload's name)."""

    def __init__(self) -> None:
        super().__init__()
        self.n: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.n[name] = self.n.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class Paired(NamedTuple):
    """The audited train step's and eval forward's reports, and what differed from the plain runs
    (``phase: what``); ``ops``: the ATen ops each phase ran (the same audited and plain when
    ``differences`` is empty)."""

    train: AuditReport
    eval: AuditReport
    differences: List[str]
    ops: Dict[str, Dict[str, int]]


class _Output:
    """Keeps the output of the outermost call of ``model`` through a global forward hook: one the
    model cannot see (its own hook dicts stay empty), registered in both runs alike."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.value = model, None

    def __enter__(self) -> "_Output":
        def keep(module: nn.Module, args: Any, out: Any) -> None:
            if module is self.model and self.value is None:
                self.value = out

        self.handle = torch_module.register_module_forward_hook(keep)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


def _tensors(tree: Any) -> List[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


# An integer dtype of each element width: a tensor viewed as it compares bit for bit (NaNs and
# signed zeros included), a whole element per comparison rather than a byte (4x fewer for float32)
_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: Tensor) -> Tensor:
    t = t.detach()
    if t.is_nested:
        t = torch.cat([u.flatten() for u in t.unbind()])
    return t.contiguous().flatten().view(_WIDTH.get(t.element_size(), torch.uint8))


def _same(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _named(model: nn.Module, args: tuple, kwargs: dict, out: Any) -> Iterator[Tuple[str, Optional[Tensor]]]:
    """Every tensor the comparison covers, by name: outputs, parameters and their gradients,
    buffers, inputs and their gradients."""
    for i, t in enumerate(_tensors(out)):
        yield f"output {i}", t
    for name, p in model.named_parameters():
        yield f"parameter {name}", p
        yield f"gradient of {name}", p.grad
    for name, b in model.named_buffers():
        yield f"buffer {name}", b
    for i, t in enumerate(_tensors((args, kwargs))):
        yield f"input {i}", t
        yield f"gradient of input {i}", t.grad


def differences(plain: List[Tuple[str, Optional[Tensor]]], audited: List[Tuple[str, Optional[Tensor]]]) -> List[str]:
    """The names whose tensors are not the same bits (or that only one run has)."""
    if [n for n, _ in plain] != [n for n, _ in audited]:
        return [f"the tensors: {len(plain)} plain, {len(audited)} audited"]
    return [n for (n, a), (_, b) in zip(plain, audited) if not _same(a, b)]


def _step(model: nn.Module, args: tuple, kwargs: dict, train: bool, audited: bool, seed: int) -> tuple:
    """One phase of one copy: (the report or None, the named tensors, the op counts)."""
    model.train(train)
    report = None
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(train), OpCount() as count, _Output(model) as out:
        torch.manual_seed(seed)
        if audited:
            report = audit(model, *args, backward=train, **kwargs)
        else:
            result = model(*args, **kwargs)
            if train:
                backward_from(result, keep=False)
    return report, list(_named(model, args, kwargs, out.value)), count.n


def _from_seed(build: Build, seed: int) -> Tuple[nn.Module, tuple, dict]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def paired(build: Build, seed: int = 0) -> Paired:
    """Builds the model from ``seed``, copies it, and runs each copy, plain and audited, in train
    mode with backward and then in eval mode under ``no_grad`` (each phase from the same seed)."""
    first = _from_seed(build, seed)
    copies = [first, copy.deepcopy(first)]  # the same bits as the first, without a second init
    reports: Dict[str, AuditReport] = {}
    found: List[str] = []
    ops: Dict[str, Dict[str, int]] = {}
    for phase, train in (("train", True), ("eval", False)):
        _, plain, plain_ops = _step(*copies[0], train=train, audited=False, seed=seed + 1)
        report, audited, audited_ops = _step(*copies[1], train=train, audited=True, seed=seed + 1)
        reports[phase] = report
        found += [f"{phase}: {d}" for d in differences(plain, audited)]
        if plain_ops != audited_ops:
            ops_differ = sorted(k for k in {*plain_ops, *audited_ops} if plain_ops.get(k) != audited_ops.get(k))
            found.append(f"{phase}: op counts of {', '.join(ops_differ[:4])}")
        ops[phase] = plain_ops
    return Paired(reports["train"], reports["eval"], found, ops)
