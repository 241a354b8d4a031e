"""Measuring: every implementation of the block behind one interface, timed with
torch.utils.benchmark (median, IQR), plus peak device memory, host time per call, the CUDA-graph
floor and the device's own ceilings (GEMM rate, copy bandwidth), all in one run.

Every variant is a zero-argument callable that runs one forward of the block under
``torch.no_grad()``. Variants that consume their input (``+=`` on the caller's tensor, a
donated tensor) first restore or re-create it; that reset is timed on its own and subtracted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils import benchmark

from .blocks import STRATEGIES, BasicTransformerBlock, randomize_
from .rust import RustBlock


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


@dataclass
class Variant:
    name: str  # e.g. "eager/iadd", "rust/forward", "graph/op_plus_x"
    family: str  # eager | compile | graph | rust
    fn: Callable[[], object]
    reset: Optional[Callable[[], object]] = None  # timed separately and subtracted
    note: str = ""
    # For peak memory: prepares the inputs (outside the measurement) and returns the call.
    prepare: Optional[Callable[[], Callable[[], object]]] = None


@dataclass
class Stat:
    median_ms: float
    iqr_ms: float
    runs: int


def timeit(fn: Callable[[], object], min_run_time: float) -> Stat:
    """torch.utils.benchmark's blocked_autorange: warm-up, CUDA synchronisation, median and IQR."""
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time
    )
    return Stat(m.median * 1e3, m.iqr * 1e3, len(m.times) * m.number_per_run)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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


def host_ms_per_call(fn: Callable[[], object], device: str, calls: int = 50) -> Optional[float]:
    """Host time per call without synchronising in between (CUDA: the launch cost)."""
    if device != "cuda":
        return None
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync(device)
    return (t1 - t0) / calls * 1e3


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
    gemm = timeit(lambda: a @ b, 0.2 if quick else 1.0)
    numel = (16 if quick else 64) * 2**20 // 4 if device == "cpu" else 2**30 // 2
    src = torch.empty(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy = timeit(lambda: dst.copy_(src), 0.2 if quick else 1.0)
    moved = 2 * src.numel() * src.element_size()
    return {
        "gemm_n": n,
        "gemm_tflops": 2 * n**3 / (gemm.median_ms * 1e-3) / 1e12,
        "copy_mib": src.numel() * src.element_size() / 2**20,
        "copy_gbps": moved / (copy.median_ms * 1e-3) / 1e9,
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


def eager_variants(s: Setup) -> list[Variant]:
    out = []
    work = s.x.clone()
    for name in STRATEGIES:
        if name in ("iadd", "iadd_clone", "copy_iadd"):  # these write into their input
            out.append(
                Variant(
                    f"eager/{name}",
                    "eager",
                    lambda name=name: (work.copy_(s.x), s.block(work, s.context, residual=name)),
                    reset=lambda: work.copy_(s.x),
                    note="input restored by copy_ each call; copy time subtracted",
                )
            )
        else:
            out.append(Variant(f"eager/{name}", "eager", lambda name=name: s.block(s.x, s.context, residual=name)))
    return out


def rust_variants(s: Setup, loop_n: int) -> list[Variant]:
    r, x, c = s.rust, s.x, s.context
    return [
        Variant("rust/forward", "rust", lambda: r.forward(x, c)),
        Variant("rust/forward_owned", "rust", lambda: r.forward_owned(x, c), note="donate=False: copies x inside Rust (counted)"),
        Variant(
            "rust/forward_owned_donate",
            "rust",
            lambda: r.forward_owned(x.clone(), c, donate=True),
            reset=lambda: x.clone(),
            note="a fresh clone donated each call; clone time subtracted",
            prepare=lambda: (lambda fresh=x.clone(): r.forward_owned(fresh, c, donate=True)),
        ),
        Variant(
            "rust/loop",
            "rust",
            lambda: r.forward_loop(x, c, n=loop_n),
            note=f"{loop_n} forwards inside Rust per call; time divided by {loop_n}",
        ),
    ]


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
        reset = None
        if name == "iadd":
            copy_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(copy_graph):
                static_x.copy_(s.x)
            s.graphs.append(copy_graph)
            reset = copy_graph.replay
        out.append(
            Variant(f"graph/{name}", "graph", graph.replay, reset=reset, note="CUDA graph replay" + (" (copy graph subtracted)" if reset else ""))
        )
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
        out.append(Variant(f"compile/{mode}", "compile", lambda fn=fn: fn(s.x, s.context)))
    return out, seconds


def profile_ops(fn: Callable[[], object], device: str, calls: int = 5) -> dict:
    """Where one call's time goes, per torch.profiler: how many aten ops run, their summed
    self CPU time (dispatch and CPU kernels) and, on CUDA, self CUDA time (the kernels); the
    ops that cost most. Rust's libtorch calls are recorded like Python's (same thread)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=activities) as prof:
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
