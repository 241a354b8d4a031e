"""Measuring: every implementation of the block behind one interface, timed with
torch.utils.benchmark, plus peak device memory, host time per call, the CUDA-graph floor and the
device's own ceilings (GEMM rate, copy bandwidth), all in one run.

Every variant is a zero-argument callable that runs one forward of the block under
``torch.no_grad()``. Variants that consume their input (``+=`` on the caller's tensor, a
donated tensor) first restore or re-create it; that reset is timed as a probe of its own in the
same round and subtracted.

Timing is interleaved and paired, so that a machine whose speed drifts during a run cannot pick
a winner: every probe of a cell (the variants and their resets) is warmed up once, then timed
once per round, in an order shuffled per round from a recorded seed. A comparison is made
within each round (a paired ratio) and summarised over the rounds (median, IQR). The round and
pairing logic is a handful of pure functions (``shuffled_orders``, ``interleaved_steps``,
``sequential_steps``, ``run_steps``, ``net_ms``, ``paired_ratios``, ``spread``) that the tests
run against a drifting fake clock.
"""

from __future__ import annotations

import math
import random
import statistics
import os
import time
import timeit as _timeit
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch.utils import benchmark

from .model.blocks import STRATEGIES, BasicTransformerBlock, randomize_
from .twin.block import CppBlock, RustBlock


@dataclass(frozen=True)
class Shape:
    """One SD v1 transformer-block shape: tokens x dim, heads x head dim; ``blocks`` is how many
    blocks of this shape one UNet step runs."""

    tokens: int
    dim: int
    heads: int
    d_head: int
    blocks: int

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.dim}"


# SD v1 at 512x512 (latent 64x64): 16 blocks per UNet step, (5, 5, 5, 1) per shape.
SD_V1_SHAPES = [Shape(4096, 320, 8, 40, 5), Shape(1024, 640, 8, 80, 5), Shape(256, 1280, 8, 160, 5), Shape(64, 1280, 8, 160, 1)]
SD_V1_CONTEXT = (77, 768)
# --quick: widths / 4, tokens / 16, same heads and block counts.
QUICK_SHAPES = [Shape(256, 80, 8, 10, 5), Shape(64, 160, 8, 20, 5), Shape(16, 320, 8, 40, 5), Shape(4, 320, 8, 40, 1)]
QUICK_CONTEXT = (77, 192)

REFERENCE = "eager/op_plus_x"

# Where kernels cost almost nothing (batch 1, 4 tokens of width 32 in 4 heads of 8, a context of
# 4 x 32, one intra-op thread): what is left of a block call is its host cost (Python's dispatch,
# the binding, tch, ATen). At the quick shapes the kernels hide it; on a GPU at SD batch 2 it decides.
HOST_SHAPE = Shape(4, 32, 4, 8, 0)
HOST_BATCH = 1
HOST_CONTEXT = (4, 32)
HOST_THREADS = 1
HOST_VARIANTS = ("eager/op_plus_x", "eager/iadd", "rust/forward", "rust/loop", "cpp/forward", "cpp/loop", "graph/op_plus_x")


@dataclass
class Variant:
    name: str  # e.g. "eager/iadd", "rust/forward", "graph/op_plus_x"
    family: str  # eager | compile | graph | rust
    fn: Callable[[], object]
    # What one time of this variant includes, shown next to it in REPORT.md.
    note: str
    reset: Optional[Callable[[], object]] = None  # timed in the same round and subtracted
    per_call: int = 1  # block forwards per fn() call; its times are divided by it
    # For peak memory: prepares the inputs (outside the measurement) and returns the call.
    prepare: Optional[Callable[[], Callable[[], object]]] = None


def reset_probe(variant: str) -> str:
    """The name under which a variant's reset is timed in its rounds."""
    return f"reset:{variant}"


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


def net_ms(raw: Mapping[str, Sequence[float]], name: str, reset: Optional[str] = None, per_call: int = 1) -> list[float]:
    """A variant's time per block forward in each round: its sample, less its reset's sample
    from the same round, divided by the forwards per call."""
    resets = raw[reset] if reset else [0.0] * len(raw[name])
    return [(t - z) / per_call for t, z in zip(raw[name], resets, strict=True)]


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a / b within each round."""
    return [x / y for x, y in zip(a, b, strict=True)]


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


def make_timer(fn: Callable[[], object], clock: Optional[Callable[[], float]] = None) -> benchmark.Timer:
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
    probes: Mapping[str, Callable[[], object]], sample_s: float, clock: Optional[Callable[[], float]] = None
) -> tuple[dict[str, int], Callable[[str], float]]:
    """Warms every probe up once, calibrating its calls per sample. Returns (calls per sample,
    ``sample(name)``: one ``Timer.timeit(number)`` of that probe, in ms per call)."""
    timers = {name: make_timer(fn, clock) for name, fn in probes.items()}
    numbers = {name: calibrate(t, sample_s) for name, t in timers.items()}
    return numbers, lambda name: timers[name].timeit(numbers[name]).median * 1e3


def measure_steps(
    probes: Mapping[str, Callable[[], object]],
    steps: Sequence[tuple[int, str]],
    sample_s: float,
    clock: Optional[Callable[[], float]] = None,
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
        return {"seed": self.seed, "rounds": len(self.orders), "orders": self.orders, "calls_per_sample": self.numbers, "raw_ms": self.raw_ms}


def interleaved_rounds(
    probes: Mapping[str, Callable[[], object]],
    rounds: int,
    seed: int,
    sample_s: float,
    clock: Optional[Callable[[], float]] = None,
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


def variant_probes(variants: Sequence[Variant]) -> dict[str, Callable[[], object]]:
    """Each variant's call, and its reset under ``reset_probe(name)``."""
    probes: dict[str, Callable[[], object]] = {}
    for v in variants:
        probes[v.name] = v.fn
        if v.reset is not None:
            probes[reset_probe(v.name)] = v.reset
    return probes


def variant_ms(raw: Mapping[str, Sequence[float]], v: Variant) -> list[float]:
    return net_ms(raw, v.name, reset_probe(v.name) if v.reset else None, v.per_call)


def paired_iqr_settled(variants: Sequence[Variant], max_iqr: float, reference: str = REFERENCE) -> Callable[[Mapping[str, Sequence[float]]], bool]:
    """A stop rule for ``interleaved_rounds``: every variant's paired ratio to ``reference`` has
    an IQR of at most ``max_iqr`` (a noisy stretch of the run buys more rounds)."""
    ref = next(v for v in variants if v.name == reference)

    def settled(raw: Mapping[str, Sequence[float]]) -> bool:
        base = variant_ms(raw, ref)
        return all(spread(paired_ratios(variant_ms(raw, v), base)).iqr <= max_iqr for v in variants)

    return settled


# ----------------------------------------------------------------------------- one-off measures
def peak_memory_mb(fn: Callable[[], object], device: str, prepare: Optional[Callable[[], Callable[[], object]]] = None) -> Optional[float]:
    """Peak allocated device memory during one call, above what was allocated before it
    (``prepare``, if given, makes the call's inputs first, outside the measurement)."""
    if device != "cuda":
        return None
    if prepare is not None:
        fn = prepare()
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def host_ms_per_call(fn: Callable[[], object], device: str, calls: int = 2, samples: int = 7) -> Optional[float]:
    """CUDA: host time per call, the launch cost. Each sample times ``calls`` calls on an
    unsynchronised clock, after a synchronisation outside the timing (few calls, so the launch
    queue does not fill and make the host wait for the device); the median of ``samples``."""
    if device != "cuda":
        return None
    timer = benchmark.Timer(
        stmt="fn()",
        setup="sync()",
        globals={"fn": fn, "sync": torch.cuda.synchronize},
        timer=_timeit.default_timer,
        num_threads=torch.get_num_threads(),
    )
    return statistics.median(timer.timeit(calls).median for _ in range(samples)) * 1e3


def random_block(shape: Shape, context_dim: int, device: str, dtype: torch.dtype, seed: int = 0) -> BasicTransformerBlock:
    """A block with non-trivial random weights (LayerNorm affine too)."""
    block = BasicTransformerBlock(shape.dim, shape.heads, shape.d_head, context_dim=context_dim)
    return randomize_(block, seed).to(device, dtype).eval()


def block_flops(shape: Shape, batch: int, ctx_tokens: int, ctx_dim: int) -> float:
    """Multiply-adds x 2 of one block call: projections, attention scores and mixing, FF."""
    b, n, d, m = batch, shape.tokens, shape.dim, ctx_tokens
    i = shape.heads * shape.d_head
    attn1 = 2 * b * n * d * i * 3 + 2 * 2 * b * n * n * i + 2 * b * n * i * d
    attn2 = 2 * b * n * d * i + 2 * b * m * ctx_dim * i * 2 + 2 * 2 * b * n * m * i + 2 * b * n * i * d
    ff = 2 * b * n * d * 8 * d + 2 * b * n * 4 * d * d
    return float(attn1 + attn2 + ff)


def block_min_bytes(block: BasicTransformerBlock, shape: Shape, batch: int, ctx_tokens: int, ctx_dim: int, itemsize: int) -> float:
    """Bytes a perfectly fused block must move: weights once, x and context in, output out."""
    weights = sum(p.numel() for p in block.parameters())
    acts = 2 * batch * shape.tokens * shape.dim + batch * ctx_tokens * ctx_dim
    return float((weights + acts) * itemsize)


def ceilings(device: str, dtype: torch.dtype, quick: bool) -> dict:
    """The device's GEMM rate and copy bandwidth, measured now with the same timer."""
    n = (1024 if quick else 2048) if device == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    min_run_time = 0.2 if quick else 1.0
    gemm = timeit(lambda: a @ b, min_run_time)
    numel = (16 if quick else 64) * 2**20 // 4 if device == "cpu" else 2**30 // 2
    src = torch.empty(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy = timeit(lambda: dst.copy_(src), min_run_time)
    moved = 2 * src.numel() * src.element_size()
    return {
        "gemm_n": n,
        "gemm_tflops": 2 * n**3 / (gemm.median_ms * 1e-3) / 1e12,
        "copy_mib": src.numel() * src.element_size() / 2**20,
        "copy_gbps": moved / (copy.median_ms * 1e-3) / 1e9,
        "min_run_time_s": min_run_time,
    }


@dataclass
class Setup:
    block: BasicTransformerBlock
    rust: RustBlock
    x: torch.Tensor
    context: torch.Tensor
    device: str
    graphs: list = field(default_factory=list)  # keep captured graphs alive


def make_setup(shape: Shape, batch: int, context: tuple[int, int], device: str, dtype: torch.dtype) -> Setup:
    block = random_block(shape, context[1], device, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, shape.tokens, shape.dim, generator=g).to(device, dtype)
    c = torch.randn(batch, context[0], context[1], generator=g).to(device, dtype)
    return Setup(block, RustBlock.from_torch(block), x, c, device)


RESTORED = "restoring the input ({how}) is timed in the same round and subtracted"


def eager_variants(s: Setup) -> list[Variant]:
    notes = {
        "op_plus_x": "one forward, out of place (the reference)",
        "x_plus_op": "one forward, out of place",
        "iadd": "one forward, += into its input; " + RESTORED.format(how="copy_"),
        "iadd_clone": "one forward and its three x.clone(), += into its input; " + RESTORED.format(how="copy_"),
        "first_out_of_place": "one forward, first sum out of place",
        "copy_iadd": "one forward and copy.copy(x), += into its input; " + RESTORED.format(how="copy_"),
        "preallocated": "one forward into the block's kept buffer",
    }
    out = []
    work = s.x.clone()
    for name in STRATEGIES:
        if name in ("iadd", "iadd_clone", "copy_iadd"):  # these write into their input
            fn = lambda name=name: (work.copy_(s.x), s.block(work, s.context, residual=name))  # noqa: E731
            out.append(Variant(f"eager/{name}", "eager", fn, notes[name], reset=lambda: work.copy_(s.x)))
        else:
            out.append(Variant(f"eager/{name}", "eager", lambda name=name: s.block(s.x, s.context, residual=name), notes[name]))
    return out


def rust_variants(s: Setup, loop_n: int) -> list[Variant]:
    r, x, c = s.rust, s.x, s.context
    return [
        Variant("rust/forward", "rust", lambda: r.forward(x, c), "one forward in Rust, with RustBlock's Python checks and the crossing"),
        Variant("rust/forward_owned", "rust", lambda: r.forward_owned(x, c), "one forward in Rust on a copy of x made inside Rust (the copy is included)"),
        Variant(
            "rust/forward_owned_donate",
            "rust",
            lambda: r.forward_owned(x.clone(), c, donate=True),
            "one forward in Rust, += into a donated fresh clone of x; the clone is timed in the same round and subtracted",
            reset=lambda: x.clone(),
            prepare=lambda: (lambda fresh=x.clone(): r.forward_owned(fresh, c, donate=True)),
        ),
        Variant(
            "rust/loop",
            "rust",
            lambda: r.forward_loop(x, c, n=loop_n),
            f"{loop_n} forwards inside one Rust call, divided by {loop_n} (one crossing per {loop_n} forwards)",
            per_call=loop_n,
        ),
    ]


def cpp_variants(s: Setup, loop_n: int) -> list[Variant]:
    """The C++ twin (cpp/block.cpp): called from Python, and looping inside C++ (no Python, no
    tch: the floor for host cost per call without CUDA graphs)."""
    cpp, x, c = CppBlock.from_torch(s.block), s.x, s.context
    return [
        Variant("cpp/forward", "cpp", lambda: cpp.forward(x, c), "one forward in C++ (ATen), with CppBlock's Python checks and the crossing"),
        Variant(
            "cpp/loop",
            "cpp",
            lambda: cpp.forward_loop(x, c, n=loop_n),
            f"{loop_n} forwards inside one C++ call, divided by {loop_n} (ATen directly, no tch layer)",
            per_call=loop_n,
        ),
    ]


def host_variants(s: Setup, loop_n: int) -> list[Variant]:
    """The host-cost cell's variants (``HOST_VARIANTS``; the CUDA-graph one on CUDA only)."""
    every = eager_variants(s) + rust_variants(s, loop_n) + cpp_variants(s, loop_n)
    if s.device == "cuda":
        every += graph_variants(s)
    return [v for v in every if v.name in HOST_VARIANTS]


def echo_probes(s: Setup) -> dict[str, Callable[[], object]]:
    """The boundary with no op: ``echo`` raw (unwrap, GIL release, wrap), the same call through
    ``RustBlock.forward``'s own checks (a RustBlock whose Rust ``forward`` is ``echo``), and a
    donation's checks without the move (``donation_check``: shapes, dtype, libtorch's
    ownership counts; their cost is this minus the raw echo)."""
    checked = RustBlock(SimpleNamespace(forward=s.rust._block.echo), s.rust._device)  # type: ignore[arg-type]
    x, c = s.x, s.context
    owned = x.clone()  # a tensor only this probe holds: s.x is shared with JAX/ONNX Runtime rows
    return {
        "echo": lambda: s.rust._block.echo(x, c),
        "echo_checked": lambda: checked.forward(x, c),
        "donation_check": lambda: s.rust._block.donation_check(owned, c),
    }


def graph_variants(s: Setup) -> list[Variant]:
    """CUDA-graph replay of eager op_plus_x and iadd: the same kernels without launch cost."""
    out = []
    for name in ("op_plus_x", "iadd"):
        static_x = s.x.clone()

        def step(name=name, static_x=static_x):
            if name == "iadd":
                static_x.copy_(s.x)
            return s.block(static_x, s.context, residual=name)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        s.graphs.append(graph)
        if name == "iadd":
            copy_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(copy_graph):
                static_x.copy_(s.x)
            s.graphs.append(copy_graph)
            note = "one CUDA-graph replay of the eager forward and its input copy_; " + RESTORED.format(how="the copy_ graph")
            out.append(Variant(f"graph/{name}", "graph", graph.replay, note, reset=copy_graph.replay))
        else:
            out.append(Variant(f"graph/{name}", "graph", graph.replay, "one CUDA-graph replay of the eager forward (no launches)"))
    return out


def compile_variants(s: Setup) -> tuple[list[Variant], dict[str, float]]:
    """torch.compile of op_plus_x, default and reduce-overhead; returns compile seconds too."""
    out, seconds = [], {}
    modes = ["default", "reduce-overhead"] if s.device == "cuda" else ["default"]
    torch._dynamo.reset()  # one cache per setup: no recompile limit across shapes
    for mode in modes:
        fn = torch.compile(lambda x, c: s.block(x, c, residual="op_plus_x"), mode=mode, dynamic=False)
        t0 = time.perf_counter()
        for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
            fn(s.x, s.context)
        sync(s.device)
        seconds[mode] = time.perf_counter() - t0
        note = f"one compiled op_plus_x forward ({mode}); compile time is not included (compile_s)"
        out.append(Variant(f"compile/{mode}", "compile", lambda fn=fn: fn(s.x, s.context), note))
    return out, seconds


def profile_ops(fn: Callable[[], object], device: str, calls: int = 5) -> dict:
    """Where one call's time goes, per torch.profiler: how many aten ops run, their summed
    self CPU time (dispatch and CPU kernels) and, on CUDA, self CUDA time (the kernels); the
    ops that cost most. Rust's libtorch calls are recorded like Python's (same thread)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    # Kineto probes for a GPU when it starts and logs an ERROR line on a machine without one;
    # its log level is read from the environment once, at that start (5: fatal only).
    if device != "cuda":
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    fn()
    sync(device)
    # acc_events: one cycle is all this records; without it torch.profiler warns that it clears
    # events at the end of each cycle.
    with profile(activities=activities, acc_events=True) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    cuda_us = lambda e: getattr(e, "self_device_time_total", 0.0)  # noqa: E731
    top = sorted(events, key=lambda e: cuda_us(e) if device == "cuda" else e.self_cpu_time_total, reverse=True)[:5]
    return {
        "aten_ops_per_call": sum(e.count for e in events) / calls,
        "self_cpu_ms_per_call": sum(e.self_cpu_time_total for e in events) / calls / 1e3,
        "self_cuda_ms_per_call": sum(cuda_us(e) for e in events) / calls / 1e3 if device == "cuda" else None,
        "top": [
            {"op": e.key, "count_per_call": e.count / calls, "ms_per_call": (cuda_us(e) if device == "cuda" else e.self_cpu_time_total) / calls / 1e3}
            for e in top
        ],
    }
