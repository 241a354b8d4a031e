"""The measuring run: every (batch, shape) cell's variants timed together in interleaved rounds,
with the boundary's probes, torch.profiler's view and the work of a call; then the host-cost cell
and the whole UNet step. results.json is rewritten after every measurement (``ResultsFile``), so an
interrupted run keeps what it measured; the analysis (:mod:`.analyse`) completes it."""

from __future__ import annotations

import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import _rust
from . import audit_cost, compilers, inductor, timing, unet
from .results import Boundary, Cell, CellTiming, CompilerInfo, HostCost, PerShape, Profile, Results, ResultsFile, Timing
from .setup import (
    HOST_BATCH,
    HOST_CONTEXT,
    HOST_SHAPE,
    HOST_THREADS,
    QUICK_CONTEXT,
    QUICK_SHAPES,
    SD_V1_CONTEXT,
    SD_V1_SHAPES,
    Setup,
    Shape,
    block_flops,
    block_min_bytes,
    ceilings,
    host_ms_per_call,
    make_setup,
    peak_memory_mb,
    profile_ops,
)
from .variants import (
    REFERENCE,
    Variant,
    cpp_variants,
    differences_settled,
    eager_variants,
    echo_probes,
    graph_variants,
    host_variants,
    paired_iqr_settled,
    reset_probe,
    rust_variants,
    variant_ms,
    variant_probes,
)

BATCHES = (2, 16)
# The first cell's round seed; cell i uses ROUND_SEED + i (each cell's seed is in results.json).
ROUND_SEED = 0
# Eager strategies that do op_plus_x's work, spelled differently: on a quiet machine or a noisy
# one, their paired ratios to op_plus_x should sit within this band.
SAME_WORK = ("eager/x_plus_op", "eager/iadd", "eager/first_out_of_place", "eager/preallocated")
SAME_WORK_BAND_PCT = 10
# A cell's rounds go on (up to max_rounds) until every paired ratio's IQR is at most this.
SETTLED_PAIRED_IQR = 0.1
# The seed commit's claim, which the report's verdicts answer.
SEED_CLAIM = {
    "commit": "Speedup from switch to +=",
    "before_it_per_s": 1.57,
    "after_it_per_s": 1.69,
    "speedup_pct": 7,
    "step_time_ratio": 1.57 / 1.69,
}
# Families whose memory torch's allocator does not see: their peak is the runtime's own.
RUNTIMES = ("jax", "onnxruntime")
HOST_LOOP_N = 50
# The crossing's budgets, µs per call at the host-cost shape: what RustBlock's (CppBlock's)
# Python checks, its watch and the crossing may cost over the raw extension call, and over a loop
# inside Rust (C++). A donation is held to the same, against the raw donating call and the
# in-place loop.
CROSSING_BUDGETS = [
    ("rust/forward", "rust/raw", 3.0),
    ("rust/forward", "rust/loop", 5.0),
    ("cpp/forward", "cpp/raw", 3.0),
    ("cpp/forward", "cpp/loop", 5.0),
    ("rust/forward_owned_donate", "rust/raw_owned_donate", 3.0),
    ("rust/forward_owned_donate", "rust/loop_owned", 5.0),
]
# The host-cost cell runs at least HOST_MIN_ROUNDS rounds, then more (up to 3x, for at most
# HOST_EXTRA_S seconds) until each of those differences' IQR is at most HOST_SETTLED_IQR_US, so
# that two runs on a quiet machine agree on each within 2 µs.
HOST_MIN_ROUNDS = 25
HOST_EXTRA_S = 20.0
HOST_SETTLED_IQR_US = 1.5


# ----------------------------------------------------------------------------- the run's settings
@dataclass(frozen=True)
class Plan:
    """What one report run measures, and how long it times each cell: ``rounds`` rounds, more (up
    to ``max_rounds``, for at most ``extra_s`` seconds per cell) while a paired ratio's IQR
    exceeds SETTLED_PAIRED_IQR; one sample (one Timer.timeit) takes about ``sample_s``."""

    device: str
    quick: bool
    dtype: torch.dtype
    shapes: list[Shape]
    context: tuple[int, int]
    rounds: int
    max_rounds: int
    extra_s: float
    sample_s: float
    loop_n: int
    torch_compile: bool
    compile_skipped: Optional[str]  # why torch.compile is not measured
    compilers: bool
    unet: bool
    # Inductor's cache directory for this run (``None``: torch's default), and whether it held
    # anything when the run began (a warm cache skips Inductor's C++ compiles).
    inductor_cache: Optional[str] = None
    inductor_cache_warm: Optional[bool] = None
    compile_batches: tuple[int, ...] = BATCHES  # the batches whose cells time torch.compile
    audit_cost: bool = True  # the audit's cost on a train step of each model family (audit_cost.py)
    # --smoke: every section as in a real run, each timed with the fewest rounds it accepts and
    # one-call samples, no extra rounds: checks the whole report in a fraction of the time (the
    # tests' report); its numbers are not measurements to read, and REPORT.md says so.
    smoke: bool = False


def plan(
    device: str,
    quick: bool,
    unet: bool = True,
    compile: bool = True,
    compilers_flag: bool = True,
    audit_cost_flag: bool = True,
    smoke: bool = False,
) -> Plan:
    """The run's settings for ``device`` at the quick or the SD v1 shapes; ``compile`` and
    ``compilers_flag``: measure torch.compile, and JAX / ONNX Runtime where installed;
    ``audit_cost_flag``: the audit's cost cell; ``smoke``: the fewest rounds (``Plan.smoke``)."""
    rounds = timing.SMOKE_ROUNDS if smoke else (11 if device == "cuda" else (9 if quick else 7))
    with_compile = compile
    skipped = "--no-compile"
    return Plan(
        device=device,
        quick=quick,
        dtype=torch.float16 if device == "cuda" else torch.float32,
        shapes=QUICK_SHAPES if quick else SD_V1_SHAPES,
        context=QUICK_CONTEXT if quick else SD_V1_CONTEXT,
        rounds=rounds,
        max_rounds=rounds if smoke else 3 * rounds,
        extra_s=0.0 if smoke else (6.0 if quick else 60.0),  # quick: the CPU report stays inside 2 minutes
        sample_s=timing.SMOKE_SAMPLE_S if smoke else (0.01 if (quick or device == "cuda") else 0.05),
        loop_n=5 if quick else 50,
        torch_compile=with_compile,
        compile_skipped=None if with_compile else skipped,
        compilers=compilers_flag and any(compilers.available().values()),
        unet=unet,
        # quick on the CPU: the seed's batch only (its 7 % is a batch-2 claim), since each cell's
        # two compiles cost seconds to tens of seconds on a small CPU (cold cache)
        compile_batches=BATCHES[:1] if (quick and device == "cpu") else BATCHES,
        audit_cost=audit_cost_flag,
        smoke=smoke,
    )


def host_rounds(p: Plan) -> tuple[int, int, float]:
    """The host-cost cell's (rounds, max_rounds, extra_s): more than a cell's (HOST_MIN_ROUNDS),
    but a smoke run's (its numbers are not read)."""
    if p.smoke:
        return p.rounds, p.rounds, 0.0
    rounds = max(p.rounds, HOST_MIN_ROUNDS)
    return rounds, 3 * rounds, max(p.extra_s, HOST_EXTRA_S)


def config(p: Plan) -> dict:
    """results.json's ``config``: the plan, and what the report's prose needs to say about it."""
    host = host_rounds(p)
    return {
        "device": p.device,
        "dtype": str(p.dtype).replace("torch.", ""),
        "quick": p.quick,
        "batches": list(BATCHES),
        "shapes": [s.record() for s in p.shapes],
        "context": list(p.context),
        "rounds": p.rounds,
        "max_rounds": p.max_rounds,
        "extra_rounds_s": p.extra_s,
        "settled_paired_iqr": SETTLED_PAIRED_IQR,
        "sample_s": p.sample_s,
        "smoke": p.smoke,
        "round_seed": ROUND_SEED,
        "reference": REFERENCE,
        "same_work": list(SAME_WORK),
        "same_work_band_pct": SAME_WORK_BAND_PCT,
        "rust_loop_n": p.loop_n,
        "crossing_budgets": [list(b) for b in CROSSING_BUDGETS],
        "host_rounds": host[0],
        "host_max_rounds": host[1],
        "host_extra_rounds_s": host[2],
        "host_settled_iqr_us": HOST_SETTLED_IQR_US,
        "torch_compile": p.torch_compile,
        "compilers": p.compilers,
        "compiler_versions": compilers.versions() if p.compilers else None,
        "seed_claim": SEED_CLAIM,
        "torch_compile_skipped_reason": p.compile_skipped,
        "torch_compile_shapes": "static, one compile per strategy per cell" if p.torch_compile else None,
        "torch_compile_batches": list(p.compile_batches) if p.torch_compile else None,
        "inductor_cache": p.inductor_cache,
        "inductor_cache_warm": p.inductor_cache_warm,
        "grad_mode": "torch.no_grad()",
        "model": "SD v1",
        "shapes_note": "quick shapes: SD v1 widths / 4, tokens / 16" if p.quick else "SD v1 shapes",
        "resolution": "512x512",
    }


def environment(device: str) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tch": _rust.TCH_VERSION,
        "rustc": _rust.RUSTC_VERSION,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["cuda"] = torch.version.cuda
        env["driver"] = _nvidia_driver()
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _nvidia_driver() -> str:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            return out.stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return "unknown"


# ----------------------------------------------------------------------------- rows
def _timing_fields(v: Variant, rounds: timing.Rounds) -> dict[str, Any]:
    ms = variant_ms(rounds.raw_ms, v)
    sp = timing.spread(ms)
    reset = reset_probe(v.name) if v.reset else None
    return {
        "variant": v.name,
        "family": v.family,
        "median_ms": sp.median,
        "iqr_ms": sp.iqr,
        "q1_ms": sp.q1,
        "q3_ms": sp.q3,
        "rounds": sp.n,
        "rounds_ms": ms,
        "calls_per_sample": rounds.numbers[v.name],
        "forwards_per_call": v.per_call,
        "reset_probe": reset,
        "reset_ms": timing.spread(rounds.raw_ms[reset]).median if reset else 0.0,
        "note": v.note,
    }


def timing_row(v: Variant, rounds: timing.Rounds) -> Timing:
    """A variant's per-round times in one cell (reset subtracted in each round), their median and
    IQR, and what the time includes."""
    return Timing(**_timing_fields(v, rounds))


def call_costs(v: Variant, device: str, compiler_info: dict) -> tuple[Optional[float], Optional[float]]:
    """(Peak memory MB, host ms) of one call of ``v`` (CUDA; None elsewhere). JAX and ONNX
    Runtime: the runtime's own peak, no host time. Measured only where one call is one forward."""
    if v.per_call != 1:
        return None, None
    if v.family in RUNTIMES:
        return compiler_info.get(v.family, {}).get("peak_mb", {}).get(v.name), None
    peak = peak_memory_mb(v.fn, device, v.prepare)
    # Host minus host: the reset's own unsynchronised host time, never a synchronised median.
    host = host_ms_per_call(v.fn, device)
    return peak, None if host is None else host - (host_ms_per_call(v.reset, device) if v.reset else 0.0)


def variant_row(v: Variant, rounds: timing.Rounds, batch: int, shape: str, device: str, cv: CellVariants) -> CellTiming:
    """One variant of one cell: its times (``timing_row``), its call's costs (``call_costs``)
    and, for torch.compile, its compile seconds."""
    peak, host = call_costs(v, device, cv.compiler_info)
    compile_s = cv.compile_s[v.name.split("/", 1)[1]] if v.family == "compile" else None
    return CellTiming(
        batch=batch, shape=shape, **_timing_fields(v, rounds), peak_mb=peak, host_ms=host, compile_s=compile_s
    )


def boundary_row(rounds: timing.Rounds, batch: int, shape: str) -> Boundary:
    raw = {k: timing.spread([t * 1e3 for t in rounds.raw_ms[k]]) for k in ("echo", "echo_checked", "donation_check")}
    checks = timing.spread(timing.paired_ratios(rounds.raw_ms["echo_checked"], rounds.raw_ms["echo"]))
    # The ownership checks' own cost: donation_check minus echo, within each round.
    ownership = timing.spread([(d - e) * 1e3 for d, e in zip(rounds.raw_ms["donation_check"], rounds.raw_ms["echo"])])
    return Boundary(
        batch=batch,
        shape=shape,
        donation_check_us=raw["donation_check"].median,
        donation_check_iqr_us=raw["donation_check"].iqr,
        ownership_check_us=ownership.median,
        ownership_check_iqr_us=ownership.iqr,
        echo_us=raw["echo"].median,
        echo_iqr_us=raw["echo"].iqr,
        echo_checked_us=raw["echo_checked"].median,
        echo_checked_iqr_us=raw["echo_checked"].iqr,
        checked_over_echo=checks.median,
        rounds=checks.n,
    )


def _jsonable(obj: Any) -> Any:
    """A builder's info as JSON: numbers, strings and containers kept, anything else as its str."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


# ----------------------------------------------------------------------------- cells
@dataclass
class CellVariants:
    """A cell's variants, with torch.compile's compile seconds per mode and the JAX / ONNX
    Runtime builders' info."""

    variants: list[Variant]
    compile_s: dict[str, float]
    compiler_info: dict[str, Any]


def cell_variants(
    rec: ResultsFile, p: Plan, s: Setup, batch: int, shape: str, say: Callable[[str], None]
) -> CellVariants:
    """Every variant this run measures on ``s``; records the compilers' info (and, on the first
    cell, their verdict)."""
    cv = CellVariants(eager_variants(s) + rust_variants(s, p.loop_n) + cpp_variants(s, p.loop_n), {}, {})
    if p.device == "cuda":
        cv.variants += graph_variants(s)
    residual: dict = {}
    first = "compiler_verdict" not in rec.data  # the verdict is judged on the first cell's measurements
    if p.torch_compile and batch in p.compile_batches:
        say("torch.compile")
        compiled, cv.compile_s, residual = inductor.compile_variants(s, read=first)
        cv.variants += compiled
    if p.compilers:
        say("JAX / ONNX Runtime")
        built, cv.compiler_info = compilers.compiler_variants(s)
        cv.variants += built
        rec.add("compilers", CompilerInfo(batch=batch, shape=shape, info=_jsonable(cv.compiler_info)))
    if first and (p.compilers or residual):
        verdict = compilers.verdict(cv.compiler_info.get("jax"), cv.compiler_info.get("onnxruntime"), residual)
        rec.set("compiler_verdict", {"batch": batch, "shape": shape} | _jsonable(verdict))
    return cv


def time_rounds(rec: ResultsFile, p: Plan, s: Setup, cv: CellVariants, seed: int, batch: int, shape: str) -> None:
    """The cell's variants and the boundary's probes in interleaved rounds; records the rounds,
    a row per variant and the boundary's row."""
    probes = variant_probes(cv.variants) | echo_probes(s)
    t0 = time.perf_counter()
    settled = paired_iqr_settled(cv.variants, SETTLED_PAIRED_IQR)
    timed = timing.interleaved_rounds(
        probes, p.rounds, seed, p.sample_s, settled=settled, max_rounds=p.max_rounds, extra_s=p.extra_s
    )
    rec.add("cells", Cell(batch=batch, shape=shape, **timed.record(), seconds=time.perf_counter() - t0))
    rec.add("results", *[variant_row(v, timed, batch, shape, p.device, cv) for v in cv.variants])
    rec.add("boundary", boundary_row(timed, batch, shape))


def profile_cell(rec: ResultsFile, s: Setup, batch: int, shape: str) -> None:
    """torch.profiler's view of one call of eager op_plus_x and of rust/forward."""
    calls = (
        ("eager/op_plus_x", lambda: s.block(s.x, s.context)),
        ("rust/forward", lambda: s.rust.forward(s.x, s.context)),
    )
    for name, fn in calls:
        rec.add(
            "profile", Profile.from_json({"batch": batch, "shape": shape, "variant": name} | profile_ops(fn, s.device))
        )


def measure_cell(rec: ResultsFile, p: Plan, index: int, batch: int, shape: Shape, say: Callable[[str], None]) -> None:
    """One (batch, shape) cell: its variants timed, the first batch's first and last shapes
    profiled, and the work of one block call."""
    s = make_setup(shape, batch, p.context, p.device, p.dtype)
    with torch.no_grad():
        cv = cell_variants(rec, p, s, batch, shape.label, say)
        say("rounds")
        time_rounds(rec, p, s, cv, ROUND_SEED + index, batch, shape.label)
        if batch == BATCHES[0] and shape in (p.shapes[0], p.shapes[-1]):
            say("torch.profiler")
            profile_cell(rec, s, batch, shape.label)
    gflop = block_flops(shape, batch, *p.context) / 1e9
    min_mb = block_min_bytes(s.block, shape, batch, *p.context, s.x.element_size()) / 2**20
    rec.add(
        "per_shape", PerShape(batch=batch, shape=shape.label, blocks_per_step=shape.blocks, gflop=gflop, min_mb=min_mb)
    )


def host_cost(
    device: str, dtype: torch.dtype, rounds: int, max_rounds: int, extra_s: float, sample_s: float, seed: int
) -> dict:
    """The host-cost cell: ``variants.HOST_VARIANTS`` at ``setup.HOST_SHAPE``, batch 1, on one
    intra-op thread (restored after), timed in interleaved rounds like every other cell. Returns
    results.json's ``host_cost``."""
    with timing.intra_op_threads(HOST_THREADS):
        s = make_setup(HOST_SHAPE, HOST_BATCH, HOST_CONTEXT, device, dtype)
        with torch.no_grad():
            variants = host_variants(s, HOST_LOOP_N)
            ratios = paired_iqr_settled(variants, SETTLED_PAIRED_IQR)
            diffs = differences_settled(variants, CROSSING_BUDGETS, HOST_SETTLED_IQR_US)
            timed = timing.interleaved_rounds(
                variant_probes(variants),
                rounds,
                seed,
                sample_s,
                settled=lambda raw: ratios(raw) and diffs(raw),
                max_rounds=max_rounds,
                extra_s=extra_s,
            )
    return HostCost(
        batch=HOST_BATCH,
        shape=HOST_SHAPE.record(),
        context=list(HOST_CONTEXT),
        threads=HOST_THREADS,
        rust_loop_n=HOST_LOOP_N,
        cell=timed.record(),
        rows=[timing_row(v, timed) for v in variants],
    ).to_json()


def eager_blocks_ms(data: dict) -> Optional[float]:
    """The reference's transformer blocks per UNet step at the UNet's batch, measured in the cells
    (None if a shape has no row)."""
    results = Results.load(data)
    rows = [results.row(unet.BATCH, sh, REFERENCE) for sh in results.shapes]
    return None if any(r is None for r in rows) else sum(r.median_ms * results.blocks[r.shape] for r in rows)


# ----------------------------------------------------------------------------- the run
def measure(p: Plan, outdir: Path, console: Console) -> ResultsFile:
    """Every cell, the host-cost cell, (``p.unet``) the whole UNet step and (``p.audit_cost``) the
    audit's cost, written to ``outdir``/results.json as they are measured; the returned
    ``ResultsFile`` holds it."""
    outdir.mkdir(parents=True, exist_ok=True)
    rec = ResultsFile(
        outdir, {"schema": 2, "complete": False, "environment": environment(p.device), "config": config(p)}
    )
    console.print(
        f"[bold]plusequals report[/] on {p.device} ({rec.data['config']['dtype']}), quick={p.quick}, writing {outdir}/"
    )
    rec.set("ceilings", ceilings(p.device, p.dtype, p.quick))
    cells = [(batch, shape) for batch in BATCHES for shape in p.shapes]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # No refresh thread (auto_refresh off; each update draws once): a thread that wakes ten times a
    # second to draw would take the GIL and a core from the rounds it interrupts.
    with Progress(*columns, console=console, transient=False, auto_refresh=False) as progress:
        task = progress.add_task("measuring", total=len(cells) + 1)
        # The host-cost cell first: a measure of microseconds per call, taken before the cells
        # (two threads, JAX, ONNX Runtime, MB-sized activations) have grown the process's heap.
        # Measured once, after one quick cell: its differences' IQRs 7-12 µs, against 1.5-3.4 µs first.
        progress.update(task, description=f"host cost: batch {HOST_BATCH} {HOST_SHAPE.label}, one thread", refresh=True)
        seed = ROUND_SEED + len(cells) + 1
        rounds, max_rounds, extra_s = host_rounds(p)
        rec.set("host_cost", host_cost(p.device, p.dtype, rounds, max_rounds, extra_s, p.sample_s, seed))
        progress.advance(task)
        progress.refresh()
        for index, (batch, shape) in enumerate(cells):
            where = f"batch {batch} {shape.label}"
            measure_cell(
                rec,
                p,
                index,
                batch,
                shape,
                lambda what: progress.update(task, description=f"{where}: {what}", refresh=True),
            )
            progress.advance(task)
            progress.refresh()
            if p.device == "cuda":
                torch.cuda.empty_cache()
        progress.update(task, description="measured", refresh=True)
    if p.unet:
        console.print("full UNet step ...")  # a line, not a spinner: no drawing thread while it is timed
        step = unet.measure(
            p.device,
            p.dtype,
            p.quick,
            p.rounds,
            p.sample_s,
            ROUND_SEED + len(cells),
            eager_blocks_ms(rec.data),
            p.torch_compile,
        )
        rec.set("unet_step", step)
    if p.audit_cost:
        console.print("the audit's cost on a train step of each model family ...")

        def say(model: str) -> None:
            console.print(f"  {model} ...")  # a line each, no spinner: no drawing thread while it is timed

        rec.set("audit_cost", audit_cost.measure(p.sample_s, ROUND_SEED + len(cells) + 2, smoke=p.smoke, say=say))
    return rec
