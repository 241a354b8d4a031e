"""Every implementation of the block behind one interface: a ``Variant`` is a zero-argument
callable that runs one forward of the block under ``torch.no_grad()``, with a note saying what its
time includes.

Variants that consume their input (``+=`` on the caller's tensor, a donated tensor) first restore
or re-create it; that reset is timed as a probe of its own in the same round and subtracted
(``variant_probes``, ``variant_ms``). The families: PyTorch eager (every residual strategy), Rust,
C++ and CUDA-graph replay; torch.compile's are in :mod:`.inductor`, JAX's and ONNX Runtime's in :mod:`.compilers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Mapping, Optional, Sequence

import torch

from ..model.blocks import STRATEGIES
from ..twin.block import CppBlock, RustBlock
from .setup import Setup
from .timing import net_ms, paired_differences_us, paired_ratios, spread

REFERENCE = "eager/op_plus_x"
HOST_VARIANTS = (
    "eager/op_plus_x",
    "eager/iadd",
    "rust/forward",
    "rust/raw",
    "rust/loop",
    "rust/forward_owned_donate",
    "rust/raw_owned_donate",
    "rust/loop_owned",
    "cpp/forward",
    "cpp/raw",
    "cpp/loop",
    "graph/op_plus_x",
)
RESTORED = "restoring the input ({how}) is timed in the same round and subtracted"


@dataclass
class Variant:
    name: str  # e.g. "eager/iadd", "rust/forward", "graph/op_plus_x"
    family: str  # eager | compile | graph | rust | cpp | jax | onnxruntime
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


# ----------------------------------------------------------------------------- in rounds
def variant_probes(variants: Sequence[Variant]) -> dict[str, Callable[[], object]]:
    """Each variant's call, and its reset under ``reset_probe(name)``."""
    probes: dict[str, Callable[[], object]] = {}
    for v in variants:
        probes[v.name] = v.fn
        if v.reset is not None:
            probes[reset_probe(v.name)] = v.reset
    return probes


def variant_ms(raw: Mapping[str, Sequence[float]], v: Variant) -> list[float]:
    """A variant's ms per block forward in each round (its reset subtracted)."""
    return net_ms(raw, v.name, reset_probe(v.name) if v.reset else None, v.per_call)


def paired_iqr_settled(
    variants: Sequence[Variant], max_iqr: float, reference: str = REFERENCE
) -> Callable[[Mapping[str, Sequence[float]]], bool]:
    """A stop rule for ``interleaved_rounds``: every variant's paired ratio to ``reference`` has
    an IQR of at most ``max_iqr`` (a noisy stretch of the run buys more rounds)."""
    ref = next(v for v in variants if v.name == reference)

    def settled(raw: Mapping[str, Sequence[float]]) -> bool:
        base = variant_ms(raw, ref)
        return all(spread(paired_ratios(variant_ms(raw, v), base)).iqr <= max_iqr for v in variants)

    return settled


def differences_settled(
    variants: Sequence[Variant], pairs: Sequence[tuple[str, str, float]], max_iqr_us: float
) -> Callable[[Mapping[str, Sequence[float]]], bool]:
    """A stop rule for ``interleaved_rounds``: each ``(a, b, _)`` of ``pairs`` whose variants are
    timed has a per-round difference ``a - b`` (µs per forward) whose IQR is at most ``max_iqr_us``."""
    by = {v.name: v for v in variants}
    timed = [(by[a], by[b]) for a, b, _ in pairs if a in by and b in by]

    def settled(raw: Mapping[str, Sequence[float]]) -> bool:
        for va, vb in timed:
            if spread(paired_differences_us(variant_ms(raw, va), variant_ms(raw, vb))).iqr > max_iqr_us:
                return False
        return True

    return settled


# ----------------------------------------------------------------------------- the families
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
            out.append(
                Variant(f"eager/{name}", "eager", lambda name=name: s.block(s.x, s.context, residual=name), notes[name])
            )
    return out


def rust_variants(s: Setup, loop_n: int) -> list[Variant]:
    r, x, c = s.rust, s.x, s.context
    return [
        Variant(
            "rust/forward",
            "rust",
            lambda: r.forward(x, c),
            "one forward in Rust, with RustBlock's Python checks and the crossing",
        ),
        Variant(
            "rust/forward_owned",
            "rust",
            lambda: r.forward_owned(x, c),
            "one forward in Rust on a copy of x made inside Rust (the copy is included)",
        ),
        Variant(
            "rust/forward_owned_donate",
            "rust",
            lambda: r.forward_owned(x.clone(), c, donate=True),
            "one forward in Rust, += into a donated fresh clone of x; the clone is timed in the same round and "
            "subtracted",
            reset=lambda: x.clone(),
            prepare=lambda: lambda fresh=x.clone(): r.forward_owned(fresh, c, donate=True),
        ),
        Variant(
            "rust/loop",
            "rust",
            lambda: r.forward_loop(x, c, n=loop_n),
            f"{loop_n} forwards inside one Rust call, divided by {loop_n} (one crossing per {loop_n} forwards)",
            per_call=loop_n,
        ),
    ]


def cpp_variants(s: Setup, loop_n: int, cpp: Optional[CppBlock] = None) -> list[Variant]:
    """The C++ twin (cpp/block.cpp): called from Python, and looping inside C++ (no Python, no
    tch: the floor for host cost per call without CUDA graphs). ``cpp``: the CppBlock to time
    (one made from ``s.block`` by default)."""
    cpp, x, c = cpp or CppBlock.from_torch(s.block), s.x, s.context
    return [
        Variant(
            "cpp/forward",
            "cpp",
            lambda: cpp.forward(x, c),
            "one forward in C++ (ATen), with CppBlock's Python checks and the crossing",
        ),
        Variant(
            "cpp/loop",
            "cpp",
            lambda: cpp.forward_loop(x, c, n=loop_n),
            f"{loop_n} forwards inside one C++ call, divided by {loop_n} (ATen directly, no tch layer)",
            per_call=loop_n,
        ),
    ]


def crossing_variants(s: Setup, loop_n: int, cpp_block: CppBlock) -> list[Variant]:
    """What the crossing costs alone (the host-cost cell): the extension's own calls
    (``plusequals._rust.Block``) of ``s.rust`` and ``cpp_block``, with none of RustBlock's or
    CppBlock's Python checks and no watch, and the in-place loop that a donation is measured against."""
    rust, cpp, x, c = s.rust._block, cpp_block._block, s.x, s.context
    return [
        Variant(
            "rust/raw", "rust", lambda: rust.forward(x, c), "one forward through the raw extension call, unchecked"
        ),
        Variant("cpp/raw", "cpp", lambda: cpp.forward(x, c), "one forward through the raw extension call, unchecked"),
        Variant(
            "rust/raw_owned_donate",
            "rust",
            lambda: rust.forward_owned(x.clone(), c, True),
            "one raw extension call, += into a donated fresh clone of x; the clone is timed in the same round and "
            "subtracted",
            reset=lambda: x.clone(),
        ),
        Variant(
            "rust/loop_owned",
            "rust",
            lambda: rust.forward_loop(x, c, n=loop_n, owned=True),
            f"{loop_n} in-place forwards inside one Rust call, each on x copied into the last output's buffer (the "
            f"copy_ included), divided by {loop_n}",
            per_call=loop_n,
        ),
    ]


def host_variants(s: Setup, loop_n: int) -> list[Variant]:
    """The host-cost cell's variants (``HOST_VARIANTS``; the CUDA-graph one on CUDA only)."""
    cpp = CppBlock.from_torch(s.block)  # cpp/raw is the raw call of cpp/forward's own block
    every = (
        eager_variants(s) + rust_variants(s, loop_n) + cpp_variants(s, loop_n, cpp) + crossing_variants(s, loop_n, cpp)
    )
    if s.device == "cuda":
        every += graph_variants(s)
    by = {v.name: v for v in every}
    return [by[name] for name in HOST_VARIANTS if name in by]


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
    return [_graph_op_plus_x(s), _graph_iadd(s)]


def _captured(s: Setup, step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``step`` warmed up on a side stream, then captured in a CUDA graph (kept alive by ``s``)."""
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
    return graph


def _graph_op_plus_x(s: Setup) -> Variant:
    static_x = s.x.clone()
    graph = _captured(s, lambda: s.block(static_x, s.context, residual="op_plus_x"))
    return Variant("graph/op_plus_x", "graph", graph.replay, "one CUDA-graph replay of the eager forward (no launches)")


def _graph_iadd(s: Setup) -> Variant:
    static_x = s.x.clone()

    def step() -> object:
        static_x.copy_(s.x)
        return s.block(static_x, s.context, residual="iadd")

    graph = _captured(s, step)
    copy_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(copy_graph):
        static_x.copy_(s.x)
    s.graphs.append(copy_graph)
    note = "one CUDA-graph replay of the eager forward and its input copy_; " + RESTORED.format(how="the copy_ graph")
    return Variant("graph/iadd", "graph", graph.replay, note, reset=copy_graph.replay)
