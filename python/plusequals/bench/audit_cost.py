"""What ``plusequals.audit`` costs on a training step: torchvision's resnet18, batch 2,
64 x 64 images, train mode, each step a forward, the sum of the logits and a backward, on the
CPU with one intra-op thread (restored after, as the host-cost cell). Four probes, timed in
interleaved rounds like every other cell and each compared with eager within each round:

* eager;
* eager under anomaly mode (``torch.autograd.detect_anomaly(check_nan=False)``), PyTorch's own
  debugging aid and the yardstick of the report's target (the audit within 1.25x of eager);
* ``plusequals.audit(model, x, backward=True)``: hooks, the write watch and its checks, included;
* eager with a TorchDispatchMode that does nothing over the forward: what any dispatch mode costs,
  the floor under the audit's own work (where the time goes).

Needs torchvision (the ``test`` extra); without it the cell is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .results import AuditCost
from .timing import interleaved_rounds, paired_ratios, spread
from .unet import step_row

BATCH, SIZE, CLASSES = 2, 64, 10
THREADS = 1
TARGET = 1.25  # the report's: the audit within 1.25x of an eager train step, as anomaly mode
ROUNDS = 15
SETTLED_IQR = 0.1  # more rounds (up to 3x, for at most EXTRA_S) while a paired ratio's IQR is wider
EXTRA_S = 5.0
EAGER, ANOMALY, AUDITED, BARE = (
    "eager",
    "anomaly mode",
    "plusequals.audit",
    "a TorchDispatchMode that does nothing (forward)",
)


class _Bare(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def probes(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The four steps, each dropping the gradients of the one before."""
    from ..auditing import audit

    def eager() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    def anomaly() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autograd.detect_anomaly(check_nan=False):
            model(x).sum().backward()

    def audited() -> None:
        model.zero_grad(set_to_none=True)
        audit(model, x, backward=True)

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        with _Bare():
            y = model(x).sum()
        y.backward()

    return {EAGER: eager, ANOMALY: anomaly, AUDITED: audited, BARE: bare}


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _settled(raw: dict[str, list[float]]) -> bool:
    return all(spread(paired_ratios(ts, raw[EAGER])).iqr <= SETTLED_IQR for name, ts in raw.items() if name != EAGER)


def measure(sample_s: float, seed: int, smoke: bool = False) -> dict:
    """The cell; returns results.json's ``audit_cost``. ``smoke``: ROUNDS rounds, no more."""
    try:
        import torchvision
    except ImportError as e:
        return AuditCost(skipped=f"torchvision is not installed ({e}); `pip install plusequals[test]`").to_json()
    from ..auditing import audit

    with _one_thread(), torch.random.fork_rng():
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=CLASSES).train()
        x = torch.randn(BATCH, 3, SIZE, SIZE)
        found = audit(model, x, backward=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # anomaly mode warns that it is on, each time
            rounds = interleaved_rounds(
                probes(model, x),
                ROUNDS,
                seed,
                sample_s,
                settled=_settled,
                max_rounds=ROUNDS if smoke else 3 * ROUNDS,
                extra_s=0.0 if smoke else EXTRA_S,
            )
    what = (
        f"torchvision resnet18 ({CLASSES} classes), train mode, batch {BATCH}, {SIZE} x {SIZE} images, float32, "
        f"CPU, {THREADS} intra-op thread; a step is a forward, the sum of the logits and a backward (gradients "
        "dropped before each). Timed in interleaved rounds like the cells; each ratio to eager is paired per round."
    )
    moves = sum(m.count for m in found.moves)
    return AuditCost(
        what=what,
        threads=THREADS,
        target=TARGET,
        rows=[step_row(name, rounds.raw_ms) for name in rounds.raw_ms],
        audit=f"{found.summary()}, {moves} moves",
        rounds=rounds.record(),
    ).to_json()
