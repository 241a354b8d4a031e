"""The seed's two bugs, reproduced in PyTorch: what the caller sees, and what autograd raises.

Shared by ``python -m plusequals demo`` and ``tests/test_bugs.py``. ``EXPECTED`` states, per
residual strategy, what was measured with torch 2.11.0; the demo fails if anything differs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .blocks import STRATEGIES, BasicTransformerBlock

# Substances of PyTorch's error messages (the start of each message).
VERSION_COUNTER = "one of the variables needed for gradient computation has been modified by an inplace operation"
LEAF = "a leaf Variable that requires grad is being used in an in-place operation"
VIEW_OF_LEAF = "a view of a leaf Variable that requires grad is being used in an in-place operation"
OUT_NO_AUTOGRAD = "add(): functions with out=... arguments don't support automatic differentiation"


@dataclass(frozen=True)
class Expected:
    """What a strategy does: to the caller's tensor, and to a textual-inversion step without and
    with CompVis activation checkpointing (``None``: it trains; else the error's substance)."""

    caller_mutated: bool
    training: Optional[str]
    training_checkpointed: Optional[str]


EXPECTED: dict[str, Expected] = {
    "op_plus_x": Expected(False, None, None),
    "x_plus_op": Expected(False, None, None),
    # the commit: mutates the caller's x; LayerNorm's saved input is overwritten
    "iadd": Expected(True, VERSION_COUNTER, VIEW_OF_LEAF),
    # the re-land: trains without checkpointing, but the first += still writes into the caller's
    # x, and under CompVis checkpointing the recomputation writes into a view of a leaf
    "iadd_clone": Expected(True, None, VIEW_OF_LEAF),
    # caller safe (x is fresh after line 1), but norm2/norm3 saved the tensor the += rewrites
    "first_out_of_place": Expected(False, VERSION_COUNTER, VERSION_COUNTER),
    # copy.copy makes a new tensor object on the *same storage*
    "copy_iadd": Expected(True, VERSION_COUNTER, LEAF),
    "preallocated": Expected(False, OUT_NO_AUTOGRAD, OUT_NO_AUTOGRAD),
}
assert set(EXPECTED) == set(STRATEGIES)


def small_block(seed: int = 0, checkpoint: bool = False, context_dim: int = 24) -> BasicTransformerBlock:
    torch.manual_seed(seed)
    return BasicTransformerBlock(32, 4, 8, context_dim=context_dim, checkpoint=checkpoint).eval()


@dataclass
class AliasingResult:
    strategy: str
    caller_mutated: bool
    max_change: float
    returned_callers_tensor: bool


def caller_aliasing(strategy: str, seed: int = 0) -> AliasingResult:
    """A caller keeps a reference to the block's input (the UNet's skip input, a hook's saved
    activation) and looks at it after the block ran (inference, grad off)."""
    block = small_block(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 16, 32, generator=g)
    context = torch.randn(2, 7, 24, generator=g)
    skip = x  # the caller's reference
    snapshot = x.clone()
    with torch.no_grad():
        y = block(x, context, residual=strategy)
    change = (skip - snapshot).abs().max().item()
    return AliasingResult(strategy, not torch.equal(skip, snapshot), change, y is skip)


@dataclass
class TrainingResult:
    strategy: str
    checkpoint: bool
    error: Optional[str]  # None: every step ran forward, backward and the optimizer
    embedding_moved: bool


def textual_inversion(strategy: str, checkpoint: bool = False, steps: int = 3, seed: int = 0) -> TrainingResult:
    """A textual-inversion loop: a learnable token embedding is the block's context; the latent
    goes through a frozen ``proj_in`` into the block; MSE loss; backward; SGD on the embedding.

    Without checkpointing the block is frozen, as in textual inversion. CompVis's checkpoint
    asks autograd for every parameter's gradient, which fails on frozen parameters whatever the
    strategy ("One of the differentiated Tensors does not require grad"); the checkpointed loop
    therefore leaves the block's parameters trainable but steps only the embedding.
    """
    block = small_block(seed, checkpoint=checkpoint)
    block.requires_grad_(checkpoint)
    g = torch.Generator().manual_seed(seed + 1)
    proj_in = nn.Linear(16, 32).requires_grad_(False)
    embedding = nn.Parameter(torch.randn(1, 7, 24, generator=g))
    latent = torch.randn(2, 16, 16, generator=g)
    target = torch.randn(2, 16, 32, generator=g)
    start = embedding.detach().clone()
    opt = torch.optim.SGD([embedding], lr=0.1)
    try:
        for _ in range(steps):
            x = proj_in(latent)
            y = block(x, embedding.expand(2, -1, -1), residual=strategy)
            loss = nn.functional.mse_loss(y, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    except RuntimeError as e:
        return TrainingResult(strategy, checkpoint, str(e).splitlines()[0], False)
    return TrainingResult(strategy, checkpoint, None, not torch.equal(embedding.detach(), start))


def leaf_iadd() -> str:
    """``iadd`` on a leaf that requires grad: PyTorch refuses at once. Returns the message."""
    block = small_block()
    x = torch.randn(2, 16, 32, requires_grad=True)
    try:
        block(x, torch.randn(2, 7, 24), residual="iadd")
    except RuntimeError as e:
        return str(e).splitlines()[0]
    raise AssertionError("iadd on a leaf that requires grad did not raise")


def copy_copy_shares_storage() -> bool:
    """Does ``copy.copy(x)`` copy the data? (No: a new tensor object on the same storage.)"""
    x = torch.randn(4)
    c = copy.copy(x)
    return c is not x and c.data_ptr() == x.data_ptr()
