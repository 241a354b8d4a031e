"""The seed's bugs under torch.compile (Inductor, default mode, on the CPU): for each residual
strategy, what the compiled block does to the caller's tensor (inference), to a
textual-inversion step (does it raise, and when: while compiling, in the compiled forward, in
backward, or never), and to a UNet level that keeps the block's input for its skip.

``COMPILED`` states what was measured with torch 2.11.0; ``tests/test_compiled_bugs.py``
derives each outcome again and compares, and the README's torch.compile cells are rendered from
it (:func:`markdown`). The harnesses are ``plusequals.model.bugs``' and
``plusequals.cases.project.SkipHarness``, the same ones the eager tests and the audit use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..model.blocks import STRATEGIES
from ..model.bugs import EXPECTED, LEAF, OUT_NO_AUTOGRAD, VERSION_COUNTER, VIEW_OF_LEAF, small_block
from .project import SkipHarness

# When a compiled textual-inversion step raises.
NEVER, COMPILE, FORWARD, BACKWARD = "never", "compile", "forward", "backward"


@dataclass(frozen=True)
class Compiled:
    """What the compiled block does: ``caller_mutated`` (inference, grad off), ``raises`` (one of
    NEVER, COMPILE, FORWARD, BACKWARD: when a textual-inversion step fails), ``error`` (the
    substance of autograd's message, None when it trains) and ``skip_reads_output`` (the UNet
    level's skip holds the block's output instead of its input)."""

    caller_mutated: bool
    raises: str
    error: Optional[str]
    skip_reads_output: bool


COMPILED: dict[str, Compiled] = {
    "op_plus_x": Compiled(False, NEVER, None, False),
    "x_plus_op": Compiled(False, NEVER, None, False),
    # AOTAutograd keeps the input mutation (the caller's x is written, as in eager); tracing the
    # joint graph runs autograd on fake tensors, so the version counter fails while compiling
    "iadd": Compiled(True, COMPILE, VERSION_COUNTER, True),
    "iadd_clone": Compiled(True, NEVER, None, True),
    "first_out_of_place": Compiled(False, COMPILE, VERSION_COUNTER, False),
    "copy_iadd": Compiled(True, COMPILE, VERSION_COUNTER, True),
    # Dynamo's fake-tensor call of add(out=...) refuses under autograd, as eager's forward does
    "preallocated": Compiled(False, COMPILE, OUT_NO_AUTOGRAD, False),
}
assert set(COMPILED) == set(STRATEGIES)


def compiled(fn: Callable) -> Callable:
    """``fn`` under torch.compile: Inductor, default mode, static shapes (one compile per harness)."""
    return torch.compile(fn, backend="inductor", mode="default", dynamic=False)


KNOWN = (VERSION_COUNTER, OUT_NO_AUTOGRAD, LEAF, VIEW_OF_LEAF)


def substance(e: BaseException) -> str:
    """The substance of autograd's message inside what torch.compile raised: Dynamo wraps it
    (``BackendCompilerFailed.inner_exception``, ``__cause__``, or its own text), so the whole
    chain is searched; the first line of ``e`` when none is known."""
    text, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text.append(str(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    found = [k for k in KNOWN if any(k in t for t in text)]
    return found[0] if found else (text[0].strip().splitlines() or [""])[0]


def is_compile_error(e: BaseException) -> bool:
    """Raised by torch.compile itself (Dynamo's tracing, AOTAutograd, Inductor), not by the
    compiled code running."""
    return isinstance(e, torch._dynamo.exc.TorchDynamoException)


@dataclass
class Inference:
    caller_mutated: bool  # the caller's x changed
    skip_reads_output: bool  # the level's output is 2 * block(x): its skip held the block's output
    same_as_eager: bool  # the compiled level's output is eager's, bug for bug


def inference(strategy: str, seed: int = 0) -> Inference:
    """A UNet level (``project.SkipHarness`` with the caller's ``x`` fed straight to the
    block, so ``skip = x``: ``return block(x) + skip``) compiled as a whole, grad off: one
    compile answers whether the caller's tensor is written and what the skip reads. Compared
    with the same level run eagerly on a copy."""
    block = small_block(seed)
    block.residual = strategy
    level = SkipHarness(block).eval()
    level.proj_in = nn.Identity()
    g = torch.Generator().manual_seed(seed + 1)
    x, context = torch.randn(2, 16, 32, generator=g), torch.randn(2, 7, 24, generator=g)
    snapshot = x.clone()
    with torch.no_grad():
        y = block(x.clone(), context)
        eager = level(x.clone(), context)
        out = compiled(level)(x, context)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    return Inference(not torch.equal(x, snapshot), close(out, 2 * y), close(out, eager))


@dataclass
class Training:
    raises: str
    error: Optional[str]
    error_type: Optional[str]
    embedding_moved: bool


def training(strategy: str, steps: int = 2, seed: int = 0) -> Training:
    """``bugs.textual_inversion`` (no checkpointing) with the block's call compiled: a frozen
    block, a learnable context, SGD. Says when it raises."""
    block = small_block(seed).requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 1)
    proj_in = nn.Linear(16, 32).requires_grad_(False)
    embedding = nn.Parameter(torch.randn(1, 7, 24, generator=g))
    latent, target = torch.randn(2, 16, 16, generator=g), torch.randn(2, 16, 32, generator=g)
    start = embedding.detach().clone()
    opt = torch.optim.SGD([embedding], lr=0.1)
    fn = compiled(lambda x, c: block(x, c, residual=strategy))
    with torch.enable_grad():
        for _ in range(steps):
            try:
                y = fn(proj_in(latent), embedding.expand(2, -1, -1))
            except Exception as e:  # noqa: BLE001 - classified and returned: the caller compares
                return Training(COMPILE if is_compile_error(e) else FORWARD, substance(e), type(e).__name__, False)
            opt.zero_grad()
            try:
                nn.functional.mse_loss(y, target).backward()
            except RuntimeError as e:
                return Training(BACKWARD, substance(e), type(e).__name__, False)
            opt.step()
    return Training(NEVER, None, None, not torch.equal(embedding.detach(), start))


def fresh() -> None:
    """Forget every compiled graph (between strategies: no recompile limit, no cached guard)."""
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the README's cells
def eager_raises(strategy: str) -> str:
    """When the eager textual-inversion step raises (``bugs.EXPECTED``): ``out=`` in forward, the
    version counter in backward."""
    error = EXPECTED[strategy].training
    return NEVER if error is None else (FORWARD if error == OUT_NO_AUTOGRAD else BACKWARD)


SUBSTANCE = {VERSION_COUNTER: "version counter", OUT_NO_AUTOGRAD: "`out=` under autograd"}


def training_cell(c: Compiled) -> str:
    if c.raises == NEVER:
        return "trains"
    where = {COMPILE: "while compiling", FORWARD: "in forward", BACKWARD: "in backward"}[c.raises]
    return f"raises {where}: {SUBSTANCE.get(c.error, c.error)}"


def markdown() -> str:
    """The README's table of the seven strategies, eager against torch.compile, from ``EXPECTED``
    and ``COMPILED``."""
    lines = [
        "| strategy | caller's `x` written: eager | compiled | textual inversion: eager | compiled "
        "| UNet skip reads the output: eager | compiled |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in STRATEGIES:
        e, c = EXPECTED[name], COMPILED[name]
        eager_training = training_cell(Compiled(e.caller_mutated, eager_raises(name), e.training, False))
        lines.append(
            f"| `{name}` | {_yes(e.caller_mutated)} | {_yes(c.caller_mutated)} | {eager_training} "
            f"| {training_cell(c)} | {_yes(e.caller_mutated)} | {_yes(c.skip_reads_output)} |"
        )
    return "\n".join(lines)


def _yes(b: bool) -> str:
    return "yes" if b else "no"


def bug_cells() -> dict[str, str]:
    """The torch.compile column of the README's "## The bugs" table, per bug (its first cell),
    from ``COMPILED`` (the rows the harnesses here do not exercise say so)."""
    iadd = COMPILED["iadd"]
    training = f"compiled `iadd` {training_cell(iadd)}, before the first step runs"
    return {
        "`+=` writes through the caller's tensor": "compiled `iadd` "
        + ("still writes the caller's `x`: AOTAutograd keeps input mutations" if iadd.caller_mutated else "does not"),
        "the caller reads `x` after the block mutated it": "the compiled UNet level's skip "
        + ("holds the block's output, as eager's does" if iadd.skip_reads_output else "holds the block's input"),
        "a hook's saved activation is rewritten": "not measured",
        "two names, one tensor (`h = x; x += a; h += b`)": "not measured",
        "`+=` while autograd holds `x` for backward": training,
        "the in-place forward inside a training step": training,
        "no-grad ends, the in-place forward runs anyway": "same",
    }
