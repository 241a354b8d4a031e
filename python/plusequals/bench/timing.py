"""The timer: interleaved, paired rounds on torch.utils.benchmark, so that a machine whose speed
drifts during a run cannot pick a winner.

Every probe of a cell (the variants and their resets) is warmed up once, then timed once per
round, in an order shuffled per round from a recorded seed. A comparison is made within each round
(a paired ratio) and summarised over the rounds (median, IQR). The round and pairing logic is a
handful of pure functions (``shuffled_orders``, ``interleaved_steps``, ``sequential_steps``,
``run_steps``, ``net_ms``, ``paired_ratios``, ``spread``) that the tests run against a drifting
fake clock.

A probe is a zero-argument callable; this module knows nothing of what it runs.
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
import timeit as stdlib_timeit
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence

import torch
from torch.utils import benchmark

Probes = Mapping[str, Callable[[], object]]
Clock = Callable[[], float]


@dataclass
class Stat:
    median_ms: float
    iqr_ms: float
    runs: int


def timeit(fn: Callable[[], object], min_run_time: float) -> Stat:
    """torch.utils.benchmark's blocked_autorange: warm-up, CUDA synchronisation, median and IQR.
    For the device ceilings only; comparisons are timed in rounds (``interleaved_rounds``)."""
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time
    )
    return Stat(m.median * 1e3, m.iqr * 1e3, len(m.times) * m.number_per_run)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- rounds
# A step is (round index, probe name); a design is the order of its steps.


def shuffled_orders(names: Sequence[str], rounds: int, seed: int) -> list[list[str]]:
    """One order of ``names`` per round, each shuffled by ``random.Random(seed)``."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def interleaved_steps(orders: Sequence[Sequence[str]]) -> list[tuple[int, str]]:
    """Round by round: every probe once per round, in that round's order."""
    return [(r, name) for r, order in enumerate(orders) for name in order]


def sequential_steps(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """Probe by probe: all of one probe's samples, then the next probe's (the design that lets a
    change in machine load between two probes read as a difference between them)."""
    return [(r, name) for name in names for r in range(rounds)]


def run_steps(steps: Iterable[tuple[int, str]], sample: Callable[[str], float]) -> dict[str, list[float]]:
    """Takes one sample per step, in order: {probe: [sample of round 0, round 1, ...]}."""
    out: dict[str, dict[int, float]] = {}
    for r, name in steps:
        out.setdefault(name, {})[r] = sample(name)
    return {name: [by_round[r] for r in sorted(by_round)] for name, by_round in out.items()}


def net_ms(
    raw: Mapping[str, Sequence[float]], name: str, reset: Optional[str] = None, per_call: int = 1
) -> list[float]:
    """A variant's time per block forward in each round: its sample, less its reset's sample
    from the same round, divided by the forwards per call."""
    resets = raw[reset] if reset else [0.0] * len(raw[name])
    return [(t - z) / per_call for t, z in zip(raw[name], resets, strict=True)]


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a / b within each round."""
    return [x / y for x, y in zip(a, b, strict=True)]


def paired_differences_us(a_ms: Sequence[float], b_ms: Sequence[float]) -> list[float]:
    """a - b within each round, ms in, µs out."""
    return [(x - y) * 1e3 for x, y in zip(a_ms, b_ms, strict=True)]


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of a set of samples (per-round times or paired ratios)."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the interquartile interval (for a ratio and 1: the two
        differ by less than the round-to-round noise)."""
        return self.q1 <= value <= self.q3


def spread(xs: Sequence[float]) -> Spread:
    """Median and quartiles (linear interpolation between order statistics, as numpy's default)."""
    if len(xs) < 2:
        return Spread(xs[0], xs[0], xs[0], len(xs))
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Spread(statistics.median(xs), q1, q3, len(xs))


# ----------------------------------------------------------------------------- samples
# A smoke run (the report's --smoke, the tests' report): every probe timed in the fewest rounds
# that still give a median and quartiles, in samples of one call (``prepare_samples``).
SMOKE_ROUNDS = 3
SMOKE_SAMPLE_S = 0.0


def make_timer(fn: Callable[[], object], clock: Optional[Clock] = None) -> benchmark.Timer:
    """torch.utils.benchmark's Timer on ``fn()``; its default clock synchronises CUDA, ``clock``
    replaces it (a fake clock in the tests)."""
    kw = {} if clock is None else {"timer": clock}
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), **kw)


def calibrate(timer: benchmark.Timer, sample_s: float) -> int:
    """Warms the probe up and returns the number of calls one sample of about ``sample_s`` takes
    (from the faster of two timings, so that a stall during warm-up does not shrink samples)."""
    number = 1
    while True:
        per_call = timer.timeit(number).median
        if per_call * number >= sample_s / 10 or number >= 10**8:
            per_call = min(per_call, timer.timeit(number).median)
            return max(1, round(sample_s / per_call))
        number *= 10


def prepare_samples(
    probes: Probes, sample_s: float, clock: Optional[Clock] = None
) -> tuple[dict[str, int], Callable[[str], float]]:
    """Warms every probe up once, calibrating its calls per sample. Returns (calls per sample,
    ``sample(name)``: one ``Timer.timeit(number)`` of that probe, in ms per call).

    ``sample_s`` 0 (``SMOKE_SAMPLE_S``, a smoke run, whose numbers are not read): no calibration;
    one warm-up call per probe here, then samples of one call each, on the standard library's
    Timer with torch's clock (``benchmark.timer``: CUDA synchronised): torch's Timer.timeit warms
    its statement up with two calls before each sample, two thirds of a smoke run's calls."""
    if sample_s <= 0:
        for fn in probes.values():
            fn()
        once = {name: stdlib_timeit.Timer(fn, timer=clock or benchmark.timer) for name, fn in probes.items()}
        return dict.fromkeys(probes, 1), lambda name: once[name].timeit(1) * 1e3
    timers = {name: make_timer(fn, clock) for name, fn in probes.items()}
    numbers = {name: calibrate(t, sample_s) for name, t in timers.items()}
    return numbers, lambda name: timers[name].timeit(numbers[name]).median * 1e3


def measure_steps(
    probes: Probes, steps: Sequence[tuple[int, str]], sample_s: float, clock: Optional[Clock] = None
) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Warm-up, then one sample per step: (calls per sample, ms per call per round)."""
    numbers, sample = prepare_samples(probes, sample_s, clock)
    return numbers, run_steps(steps, sample)


@dataclass
class Rounds:
    seed: int
    orders: list[list[str]]  # the probes' order in each round
    numbers: dict[str, int]  # calls per sample
    raw_ms: dict[str, list[float]]  # ms per call, one per round

    def record(self) -> dict:
        """The rounds as results.json keeps them."""
        return {
            "seed": self.seed,
            "rounds": len(self.orders),
            "orders": self.orders,
            "calls_per_sample": self.numbers,
            "raw_ms": self.raw_ms,
        }


def interleaved_rounds(
    probes: Probes,
    rounds: int,
    seed: int,
    sample_s: float,
    clock: Optional[Clock] = None,
    settled: Optional[Callable[[dict[str, list[float]]], bool]] = None,
    max_rounds: Optional[int] = None,
    extra_s: float = math.inf,
) -> Rounds:
    """The report's design: every probe once per round, in an order shuffled per round. After
    ``rounds`` rounds, further rounds run until ``settled(raw_ms)``, up to ``max_rounds`` and
    while less than ``extra_s`` seconds (on ``clock``) have gone into them."""
    max_rounds = max(rounds, max_rounds or rounds)
    now = clock or time.perf_counter
    orders = shuffled_orders(list(probes), max_rounds, seed)
    numbers, sample = prepare_samples(probes, sample_s, clock)
    raw: dict[str, list[float]] = {name: [] for name in probes}
    done, extra_since = 0, math.inf

    def more() -> bool:
        if done < rounds:
            return True
        return settled is not None and done < max_rounds and now() - extra_since < extra_s and not settled(raw)

    while more():
        for name, times in run_steps(interleaved_steps(orders[done : done + 1]), sample).items():
            raw[name] += times
        done += 1
        if done == rounds:
            extra_since = now()
    return Rounds(seed, orders[:done], numbers, raw)


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """libtorch's intra-op thread count set to ``n`` inside the block, and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
