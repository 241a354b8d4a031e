"""What a cell measures on, and what the device allows: the SD v1 block shapes, one (batch,
shape)'s block and inputs (``Setup``), the work of one block call (FLOPs, minimum bytes), the
device's own ceilings (GEMM rate, copy bandwidth), and the one-off measures of a call: peak device
memory, host time per call, and where its time goes (torch.profiler)."""

from __future__ import annotations

import os
import statistics
import timeit as _timeit
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch.utils import benchmark

from ..model.blocks import BasicTransformerBlock, randomize_
from ..twin.block import RustBlock
from .timing import sync, timeit


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

    def record(self) -> dict:
        """The shape as results.json keeps it."""
        return asdict(self) | {"label": self.label}


# SD v1 at 512x512 (latent 64x64): 16 blocks per UNet step, (5, 5, 5, 1) per shape.
SD_V1_SHAPES = [
    Shape(4096, 320, 8, 40, 5),
    Shape(1024, 640, 8, 80, 5),
    Shape(256, 1280, 8, 160, 5),
    Shape(64, 1280, 8, 160, 1),
]
SD_V1_CONTEXT = (77, 768)
# --quick: widths / 4, tokens / 16, same heads and block counts.
QUICK_SHAPES = [Shape(256, 80, 8, 10, 5), Shape(64, 160, 8, 20, 5), Shape(16, 320, 8, 40, 5), Shape(4, 320, 8, 40, 1)]
QUICK_CONTEXT = (77, 192)

# Where kernels cost almost nothing (batch 1, 4 tokens of width 32 in 4 heads of 8, a context of
# 4 x 32, one intra-op thread): what is left of a block call is its host cost (Python's dispatch,
# the binding, tch, ATen). At the quick shapes the kernels hide it; on a GPU at SD batch 2 it decides.
HOST_SHAPE = Shape(4, 32, 4, 8, 0)
HOST_BATCH = 1
HOST_CONTEXT = (4, 32)
HOST_THREADS = 1


@dataclass
class Setup:
    block: BasicTransformerBlock
    rust: RustBlock
    x: torch.Tensor
    context: torch.Tensor
    device: str
    graphs: list = field(default_factory=list)  # keep captured graphs alive


def random_block(
    shape: Shape, context_dim: int, device: str, dtype: torch.dtype, seed: int = 0
) -> BasicTransformerBlock:
    """A block with non-trivial random weights (LayerNorm affine too)."""
    block = BasicTransformerBlock(shape.dim, shape.heads, shape.d_head, context_dim=context_dim)
    return randomize_(block, seed).to(device, dtype).eval()


def make_setup(shape: Shape, batch: int, context: tuple[int, int], device: str, dtype: torch.dtype) -> Setup:
    block = random_block(shape, context[1], device, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, shape.tokens, shape.dim, generator=g).to(device, dtype)
    c = torch.randn(batch, context[0], context[1], generator=g).to(device, dtype)
    return Setup(block, RustBlock.from_torch(block), x, c, device)


# ----------------------------------------------------------------------------- the work of a call
def block_flops(shape: Shape, batch: int, ctx_tokens: int, ctx_dim: int) -> float:
    """Multiply-adds x 2 of one block call: projections, attention scores and mixing, FF."""
    b, n, d, m = batch, shape.tokens, shape.dim, ctx_tokens
    i = shape.heads * shape.d_head
    attn1 = 2 * b * n * d * i * 3 + 2 * 2 * b * n * n * i + 2 * b * n * i * d
    attn2 = 2 * b * n * d * i + 2 * b * m * ctx_dim * i * 2 + 2 * 2 * b * n * m * i + 2 * b * n * i * d
    ff = 2 * b * n * d * 8 * d + 2 * b * n * 4 * d * d
    return float(attn1 + attn2 + ff)


def block_min_bytes(
    block: BasicTransformerBlock, shape: Shape, batch: int, ctx_tokens: int, ctx_dim: int, itemsize: int
) -> float:
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


# ----------------------------------------------------------------------------- one-off measures
def peak_memory_mb(
    fn: Callable[[], object], device: str, prepare: Optional[Callable[[], Callable[[], object]]] = None
) -> Optional[float]:
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
            {
                "op": e.key,
                "count_per_call": e.count / calls,
                "ms_per_call": (cuda_us(e) if device == "cuda" else e.self_cpu_time_total) / calls / 1e3,
            }
            for e in top
        ],
    }
