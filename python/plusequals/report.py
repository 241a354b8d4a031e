"""``python -m plusequals report``: every residual strategy x PyTorch eager, torch.compile, the
CUDA-graph floor and Rust, timed in one run; writes DIR/results.json (every number),
DIR/REPORT.md (rendered from results.json alone) and DIR/*.png.

results.json is rewritten after every measurement, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import _rust, bench, compilers

BATCHES = (2, 16)
# The first cell's round seed; cell i uses ROUND_SEED + i (each cell's seed is in results.json).
ROUND_SEED = 0
# Eager strategies that do op_plus_x's work, spelled differently: on a quiet machine or a noisy
# one, their paired ratios to op_plus_x should sit within this band.
SAME_WORK = ("eager/x_plus_op", "eager/iadd", "eager/first_out_of_place", "eager/preallocated")
SAME_WORK_BAND_PCT = 10
# Paired ratios reported besides "every variant / eager/op_plus_x".
# rust/loop / cpp/loop: what the tch layer costs (its C API, a heap handle per op) over ATen.
EXTRA_PAIRS = [("graph/iadd", "graph/op_plus_x"), ("rust/forward", "rust/loop"), ("rust/loop", "cpp/loop"), ("rust/forward", "cpp/forward")]
# A cell's rounds go on (up to max_rounds) until every paired ratio's IQR is at most this.
SETTLED_PAIRED_IQR = 0.1
# Marks a paired ratio whose interquartile interval contains 1.
NOISE_MARK = "≈"
# Where the targets of the report's issue apply: they were set for the H200.
TARGET_DEVICE = "cuda"


# ----------------------------------------------------------------------------- formatting
def fmt(v: Any) -> str:
    """The one number format of REPORT.md (tests check each printed number against results.json)."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a >= 0.01:
        return f"{v:.3f}"
    return f"{v:.2g}"


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
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            return out.stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return "unknown"


# ----------------------------------------------------------------------------- running
class Recorder:
    """Holds results.json in memory and rewrites it after every change."""

    def __init__(self, out: Path, data: dict) -> None:
        self.path = out / "results.json"
        self.data = data
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)

    def add(self, key: str, *rows: dict) -> None:
        self.data.setdefault(key, []).extend(rows)
        self.flush()


def variant_row(v: bench.Variant, rounds: bench.Rounds, device: str) -> dict:
    """One variant of one cell: its times (``timing_row``), and (CUDA) peak memory and host time
    per call."""
    row = timing_row(v, rounds)
    if v.per_call == 1:
        row["peak_mb"] = bench.peak_memory_mb(v.fn, device, v.prepare)
        # Host minus host: the reset's own unsynchronised host time, never a synchronised median.
        host = bench.host_ms_per_call(v.fn, device)
        row["host_ms"] = None if host is None else host - (bench.host_ms_per_call(v.reset, device) if v.reset else 0.0)
    return row


def timing_row(v: bench.Variant, rounds: bench.Rounds) -> dict:
    """A variant's per-round times in one cell (reset subtracted in each round), their median and
    IQR, and what the time includes."""
    ms = bench.variant_ms(rounds.raw_ms, v)
    sp = bench.spread(ms)
    reset = bench.reset_probe(v.name) if v.reset else None
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
        "reset_ms": bench.spread(rounds.raw_ms[reset]).median if reset else 0.0,
        "note": v.note,
    }


def _jsonable(obj: Any) -> Any:
    """A builder's info as JSON: numbers, strings and containers kept, anything else as its str."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def boundary_row(rounds: bench.Rounds) -> dict:
    raw = {k: bench.spread([t * 1e3 for t in rounds.raw_ms[k]]) for k in ("echo", "echo_checked", "donation_check")}
    checks = bench.spread(bench.paired_ratios(rounds.raw_ms["echo_checked"], rounds.raw_ms["echo"]))
    # The ownership checks' own cost: donation_check minus echo, within each round.
    ownership = bench.spread([(d - e) * 1e3 for d, e in zip(rounds.raw_ms["donation_check"], rounds.raw_ms["echo"])])
    return {
        "donation_check_us": raw["donation_check"].median,
        "donation_check_iqr_us": raw["donation_check"].iqr,
        "ownership_check_us": ownership.median,
        "ownership_check_iqr_us": ownership.iqr,
        "echo_us": raw["echo"].median,
        "echo_iqr_us": raw["echo"].iqr,
        "echo_checked_us": raw["echo_checked"].median,
        "echo_checked_iqr_us": raw["echo_checked"].iqr,
        "checked_over_echo": checks.median,
        "rounds": checks.n,
    }


def host_cost(device: str, dtype: torch.dtype, rounds: int, max_rounds: int, extra_s: float, sample_s: float, seed: int) -> dict:
    """The host-cost cell: ``bench.HOST_VARIANTS`` at ``bench.HOST_SHAPE``, batch 1, on one
    intra-op thread (restored after), timed in interleaved rounds like every other cell."""
    shape, batch, loop_n = bench.HOST_SHAPE, bench.HOST_BATCH, 50
    threads = torch.get_num_threads()
    torch.set_num_threads(bench.HOST_THREADS)
    try:
        s = bench.make_setup(shape, batch, bench.HOST_CONTEXT, device, dtype)
        with torch.no_grad():
            variants = bench.host_variants(s, loop_n)
            settled = bench.paired_iqr_settled(variants, SETTLED_PAIRED_IQR)
            timed = bench.interleaved_rounds(bench.variant_probes(variants), rounds, seed, sample_s, settled=settled, max_rounds=max_rounds, extra_s=extra_s)
    finally:
        torch.set_num_threads(threads)
    rows = [timing_row(v, timed) for v in variants]
    return {
        "batch": batch,
        "shape": shape.__dict__ | {"label": shape.label},
        "context": list(bench.HOST_CONTEXT),
        "threads": bench.HOST_THREADS,
        "rust_loop_n": loop_n,
        "cell": timed.record(),
        "rows": rows,
    }


def run(
    device: Optional[str] = None,
    quick: Optional[bool] = None,
    out: str = "report",
    unet: bool = True,
    compile: bool = True,
    compilers_flag: bool = True,
    output: str = "rich",
) -> int:
    """``quick=None``: quick shapes on the CPU (SD v1 shapes are long on a small CPU), SD v1 shapes on CUDA.
    ``output``: "rich" (progress, then the summary), "quiet" (REPORT.md's path alone) or "json"
    (the summary as JSON, alone on stdout)."""
    from . import summary

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    quick = (device == "cpu") if quick is None else quick
    if device == "cuda" and not torch.cuda.is_available():
        Console(stderr=True).print("[red]--device cuda: no CUDA device is available[/]")
        return 2
    console = Console(quiet=output != "rich")
    with summary.stdout_to_stderr() if output == "json" else contextlib.nullcontext():
        data, outdir = _measure(device, quick, out, unet, compile, compilers_flag, console)
    summary.emit(data, outdir, output, console)
    return 0


def _measure(device: str, quick: bool, out: str, unet: bool, compile: bool, compilers_flag: bool, console: Console) -> tuple[dict, Path]:
    dtype = torch.float16 if device == "cuda" else torch.float32
    shapes = bench.QUICK_SHAPES if quick else bench.SD_V1_SHAPES
    context = bench.QUICK_CONTEXT if quick else bench.SD_V1_CONTEXT
    # Rounds per cell; more (up to max_rounds, for at most extra_s seconds per cell) while a
    # paired ratio's IQR exceeds SETTLED_PAIRED_IQR; the length of one sample (one Timer.timeit).
    rounds = 11 if device == "cuda" else (9 if quick else 7)
    max_rounds = 3 * rounds
    extra_s = 6.0 if quick else 60.0  # quick: the CPU report stays inside 2 minutes
    sample_s = 0.01 if (quick or device == "cuda") else 0.05
    loop_n = 5 if quick else 50
    with_compile = compile and not (quick and device == "cpu")
    with_compilers = compilers_flag and any(compilers.available().values())
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    rec = Recorder(
        outdir,
        {
            "schema": 2,
            "complete": False,
            "environment": environment(device),
            "config": {
                "device": device,
                "dtype": str(dtype).replace("torch.", ""),
                "quick": quick,
                "batches": list(BATCHES),
                "shapes": [s.__dict__ | {"label": s.label} for s in shapes],
                "context": list(context),
                "rounds": rounds,
                "max_rounds": max_rounds,
                "extra_rounds_s": extra_s,
                "settled_paired_iqr": SETTLED_PAIRED_IQR,
                "sample_s": sample_s,
                "round_seed": ROUND_SEED,
                "reference": bench.REFERENCE,
                "same_work": list(SAME_WORK),
                "same_work_band_pct": SAME_WORK_BAND_PCT,
                "rust_loop_n": loop_n,
                "torch_compile": with_compile,
                "compilers": with_compilers,
                "compiler_versions": compilers.versions() if with_compilers else None,
                "seed_claim": {
                    "commit": "Speedup from switch to +=",
                    "before_it_per_s": 1.57,
                    "after_it_per_s": 1.69,
                    "speedup_pct": 7,
                    "step_time_ratio": 1.57 / 1.69,
                },
                "torch_compile_skipped_reason": None
                if with_compile
                else ("--no-compile" if not compile else "--quick on the CPU: inductor's C++ compile alone exceeds the quick budget"),
                "grad_mode": "torch.no_grad()",
                "model": "SD v1",
                "shapes_note": "quick shapes: SD v1 widths / 4, tokens / 16" if quick else "SD v1 shapes",
                "resolution": "512x512",
            },
        },
    )
    console.print(f"[bold]plusequals report[/] on {device} ({rec.data['config']['dtype']}), quick={quick}, writing {outdir}/")
    rec.data["ceilings"] = bench.ceilings(device, dtype, quick)
    rec.flush()

    cells = [(batch, shape) for batch in BATCHES for shape in shapes]
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False
    ) as progress:
        task = progress.add_task("measuring", total=len(cells) + 1)
        for index, (batch, shape) in enumerate(cells):
            s = bench.make_setup(shape, batch, context, device, dtype)
            where = {"batch": batch, "shape": shape.label}
            with torch.no_grad():
                variants = bench.eager_variants(s) + bench.rust_variants(s, loop_n) + bench.cpp_variants(s, loop_n)
                if device == "cuda":
                    variants += bench.graph_variants(s)
                compile_seconds: dict[str, float] = {}
                if with_compile:
                    progress.update(task, description=f"batch {batch} {shape.label}: torch.compile")
                    cv, compile_seconds = bench.compile_variants(s)
                    variants += cv
                if with_compilers:
                    progress.update(task, description=f"batch {batch} {shape.label}: JAX / ONNX Runtime")
                    xv, compiler_info = compilers.compiler_variants(s)
                    variants += xv
                    rec.add("compilers", where | {"info": _jsonable(compiler_info)})
                    if "compiler_verdict" not in rec.data:  # judged on the first cell's measurements
                        verdict = compilers.verdict(compiler_info.get("jax"), compiler_info.get("onnxruntime"))
                        rec.data["compiler_verdict"] = where | _jsonable(verdict)
                progress.update(task, description=f"batch {batch} {shape.label}: rounds")
                probes = bench.variant_probes(variants) | bench.echo_probes(s)
                t0 = time.perf_counter()
                settled = bench.paired_iqr_settled(variants, SETTLED_PAIRED_IQR)
                timed = bench.interleaved_rounds(
                    probes, rounds, ROUND_SEED + index, sample_s, settled=settled, max_rounds=max_rounds, extra_s=extra_s
                )
                rec.data.setdefault("cells", []).append(where | timed.record() | {"seconds": time.perf_counter() - t0})
                rows = []
                for v in variants:
                    row = where | variant_row(v, timed, device)
                    if v.family in ("jax", "onnxruntime"):  # torch's allocator sees neither runtime
                        row["peak_mb"] = compiler_info.get(v.family, {}).get("peak_mb", {}).get(v.name)
                        row["host_ms"] = None
                    if v.family == "compile":
                        row["compile_s"] = compile_seconds[v.name.split("/", 1)[1]]
                    rows.append(row)
                rec.add("results", *rows)
                rec.add("boundary", where | boundary_row(timed))
            if batch == BATCHES[0] and shape in (shapes[0], shapes[-1]):
                progress.update(task, description=f"batch {batch} {shape.label}: torch.profiler")
                with torch.no_grad():
                    for name, fn in (("eager/op_plus_x", lambda: s.block(s.x, s.context)), ("rust/forward", lambda: s.rust.forward(s.x, s.context))):
                        rec.add("profile", where | {"variant": name} | bench.profile_ops(fn, device))
            rec.add(
                "per_shape",
                where
                | {
                    "blocks_per_step": shape.blocks,
                    "gflop": bench.block_flops(shape, batch, *context) / 1e9,
                    "min_mb": bench.block_min_bytes(s.block, shape, batch, *context, s.x.element_size()) / 2**20,
                },
            )
            progress.advance(task)
            del s
            if device == "cuda":
                torch.cuda.empty_cache()
        progress.update(task, description=f"host cost: batch {bench.HOST_BATCH} {bench.HOST_SHAPE.label}, one thread")
        rec.data["host_cost"] = host_cost(device, dtype, rounds, max_rounds, extra_s, sample_s, ROUND_SEED + len(cells) + 1)
        rec.flush()
        progress.update(task, description="measured")
        progress.advance(task)

    if unet:
        from . import unet_bench

        with console.status("full UNet step"):
            rec.data["unet_step"] = unet_bench.measure(device, dtype, quick, rounds, sample_s, ROUND_SEED + len(cells), rec.data, with_compile)
        rec.flush()

    summarize(rec.data)
    rec.data["elapsed_s"] = time.perf_counter() - t_start
    rec.data["complete"] = True
    rec.flush()
    (outdir / "REPORT.md").write_text(render(rec.data))
    plots(rec.data, outdir)
    return rec.data, outdir


# ----------------------------------------------------------------------------- analysis
def _row(data: dict, batch: int, shape: str, variant: str) -> Optional[dict]:
    for r in data.get("results", []):
        if r["batch"] == batch and r["shape"] == shape and r["variant"] == variant:
            return r
    return None


def _ms(data: dict, batch: int, shape: str, variant: str) -> Optional[float]:
    r = _row(data, batch, shape, variant)
    return None if r is None else r["median_ms"]


def _variants(data: dict) -> list[str]:
    """The variants in the order they were measured."""
    out: list[str] = []
    for r in data["results"]:
        if r["variant"] not in out:
            out.append(r["variant"])
    return out


def pair(data: dict, batch: int, shape: str, a: str, b: str) -> Optional[dict]:
    """``a / b`` of one cell, paired within each round, summarised over the rounds."""
    return pair_rows(_row(data, batch, shape, a), _row(data, batch, shape, b), batch, shape)


def pair_rows(ra: Optional[dict], rb: Optional[dict], batch: int, shape: str) -> Optional[dict]:
    """The paired ratio of two rows of one cell (None if either is missing)."""
    if ra is None or rb is None:
        return None
    a, b = ra["variant"], rb["variant"]
    ratios = bench.paired_ratios(ra["rounds_ms"], rb["rounds_ms"])
    sp = bench.spread(ratios)
    return {
        "batch": batch,
        "shape": shape,
        "variant": a,
        "vs": b,
        "median": sp.median,
        "q1": sp.q1,
        "q3": sp.q3,
        "iqr": sp.iqr,
        "rounds": sp.n,
        "within_noise": sp.contains(1.0),
        "ratios": ratios,
    }


def _paired(data: dict, batch: int, shape: str, a: str, b: str = bench.REFERENCE) -> Optional[dict]:
    return next((p for p in data["paired"] if (p["batch"], p["shape"], p["variant"], p["vs"]) == (batch, shape, a, b)), None)


def summarize(data: dict) -> None:
    """Paired ratios, drift, per-step totals and verdict counts, computed from the rows and
    stored next to them."""
    cfg = data["config"]
    shapes = [s["label"] for s in cfg["shapes"]]
    blocks = {s["label"]: s["blocks"] for s in cfg["shapes"]}
    ceil = data["ceilings"]
    variants = _variants(data)
    paired, drift, steps, floors = [], [], [], []
    for batch in cfg["batches"]:
        for shape in shapes:
            pairs = [(v, bench.REFERENCE) for v in variants if v != bench.REFERENCE] + EXTRA_PAIRS
            paired += [p for a, b in pairs if (p := pair(data, batch, shape, a, b))]
            ref = _row(data, batch, shape, bench.REFERENCE)
            if ref:
                ms = ref["rounds_ms"]
                drift.append({"batch": batch, "shape": shape, "variant": bench.REFERENCE, "rounds_ms": ms, "max_over_min": max(ms) / min(ms)})
            ps = next(p for p in data["per_shape"] if p["batch"] == batch and p["shape"] == shape)
            floor_ms = max(ps["gflop"] * 1e9 / (ceil["gemm_tflops"] * 1e12), ps["min_mb"] * 2**20 / (ceil["copy_gbps"] * 1e9)) * 1e3
            floors.append({"batch": batch, "shape": shape, "roofline_ms": floor_ms})
        ref_ms = {sh: _ms(data, batch, sh, bench.REFERENCE) for sh in shapes}
        for v in variants:
            ts = [_ms(data, batch, sh, v) for sh in shapes]
            if all(t is not None for t in ts):
                total = sum(t * blocks[sh] for t, sh in zip(ts, shapes))
                step = {"batch": batch, "variant": v, "blocks_ms_per_step": total, "blocks_only_it_per_s": 1e3 / total}
                ratios = {p["shape"]: p["median"] for p in paired if (p["batch"], p["variant"], p["vs"]) == (batch, v, bench.REFERENCE)}
                if v == bench.REFERENCE or len(ratios) == len(shapes):
                    # The step's paired ratio: each shape's paired ratio, weighted by its share of the reference's step.
                    weight = {sh: ref_ms[sh] * blocks[sh] for sh in shapes}
                    step["vs_reference"] = sum(ratios.get(sh, 1.0) * weight[sh] for sh in shapes) / sum(weight.values())
                steps.append(step)
    data["paired"], data["drift"], data["per_step"], data["roofline"] = paired, drift, steps, floors
    if hc := data.get("host_cost"):
        by = {r["variant"]: r for r in hc["rows"]}
        pairs = [(v, bench.REFERENCE) for v in by if v != bench.REFERENCE] + [("rust/loop", "cpp/loop")]
        hc["paired"] = [p for a, b in pairs if (p := pair_rows(by.get(a), by.get(b), hc["batch"], hc["shape"]["label"]))]
    data["same_work"] = [same_work(data, batch) for batch in cfg["batches"]]
    data["targets"] = targets(data)


def same_work(data: dict, batch: int) -> dict:
    """The eager strategies that do op_plus_x's work, spelled differently: how far their paired
    ratios to op_plus_x stray, and in how many cells the difference is within noise."""
    cfg = data["config"]
    ps = [p for v in cfg["same_work"] for sh in [s["label"] for s in cfg["shapes"]] if (p := _paired(data, batch, sh, v))]
    band = cfg["same_work_band_pct"] / 100
    return {
        "batch": batch,
        "cells": len(ps),
        "min": min(p["median"] for p in ps),
        "max": max(p["median"] for p in ps),
        "inside_band": sum(abs(p["median"] - 1) <= band for p in ps),
        "within_noise": sum(p["within_noise"] for p in ps),
        "outside_noise": [f"{p['variant']} at {p['shape']}" for p in ps if not p["within_noise"]],
    }


def targets(data: dict) -> list[dict]:
    """The issue's performance targets (set for the H200), each with its measured value; every
    comparison is a paired ratio (median over rounds)."""
    shapes = [s["label"] for s in data["config"]["shapes"]]
    on_target_device = data["config"]["device"] == TARGET_DEVICE and not data["config"]["quick"]
    out = []

    def add(name: str, value: Optional[float], limit: float, ok: Optional[bool], unit: str, detail: str) -> None:
        status = "not measurable here" if ok is None else ("met" if ok else "missed")
        if ok is not None and not on_target_device:
            status += " (informational: targets are for the H200, full shapes)"
        out.append({"target": name, "value": value, "limit": limit, "unit": unit, "status": status, "detail": detail})

    def worst(batch: int, a: str, b: str, pick) -> Optional[float]:
        ps = [pair(data, batch, sh, a, b) for sh in shapes]
        return None if any(p is None for p in ps) else pick(p["median"] for p in ps)

    speedup = worst(2, bench.REFERENCE, "rust/forward", min)
    add("Rust forward >= 2x faster than eager op_plus_x at every shape (batch 2)", speedup, 2.0, speedup >= 2.0, "x (worst shape)", "eager / rust/forward, paired")
    name = "Rust forward within 1.3x of the CUDA-graph floor (batch 2)"
    over = worst(2, "rust/forward", "graph/op_plus_x", max)
    if over is not None:
        add(name, over, 1.3, over <= 1.3, "x (worst shape)", "rust/forward / graph/op_plus_x, paired")
    else:
        add(name, None, 1.3, None, "x", "no CUDA graphs on this device")
    b16 = worst(16, "rust/forward", bench.REFERENCE, max)
    add("Rust forward within 1.02x of eager at batch 16", b16, 1.02, b16 <= 1.02, "x (worst shape)", "rust/forward / eager, paired")
    mem = [(_row(data, 2, sh, "rust/forward_owned_donate") or {}).get("peak_mb") for sh in shapes]
    mem_iadd = [(_row(data, 2, sh, "eager/iadd") or {}).get("peak_mb") for sh in shapes]
    if all(m is not None for m in mem + mem_iadd):
        worst_mem = max(m / i for m, i in zip(mem, mem_iadd))
        add("forward_owned (donated) peak memory <= PyTorch iadd's", worst_mem, 1.0, worst_mem <= 1.0, "x (worst shape)", "peak MB ratio")
    else:
        add("forward_owned (donated) peak memory <= PyTorch iadd's", None, 1.0, None, "x", "no allocator statistics on the CPU")
    checks = max(b["ownership_check_us"] for b in data["boundary"])
    add(
        "Ownership checks <= 2 us per call",
        checks,
        2.0,
        checks <= 2.0,
        "us (worst shape)",
        "donation_check - raw echo, paired (rust/ownership.rs: libtorch's counts, grad mode, overlap)",
    )
    echo = max(b["echo_checked_us"] for b in data["boundary"])
    add(
        "Python -> Rust per-call overhead <= 10 us",
        echo,
        10.0,
        echo <= 10.0,
        "us (worst shape)",
        "echo() through RustBlock.forward's checks (the raw binding: the boundary table)",
    )
    return out


# ----------------------------------------------------------------------------- rendering
def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def time_cell(r: Optional[dict]) -> str:
    return "-" if r is None else f"{fmt(r['median_ms'])} ({fmt(r['iqr_ms'])})"


def ratio_cell(p: Optional[dict]) -> str:
    """median [Q1, Q3] of a paired ratio; NOISE_MARK when the interval contains 1."""
    if p is None:
        return "-"
    return f"{fmt(p['median'])} [{fmt(p['q1'])}, {fmt(p['q3'])}]" + (f" {NOISE_MARK}" if p["within_noise"] else "")


def unet_ratio_cell(r: dict) -> str:
    if r["name"] == "eager":
        return "reference"
    return ratio_cell({"median": r["vs_eager"], "q1": r["vs_eager_q1"], "q3": r["vs_eager_q3"], "within_noise": r["within_noise"]})


def render(data: dict) -> str:
    cfg, env, ceil = data["config"], data["environment"], data["ceilings"]
    shapes = [s["label"] for s in cfg["shapes"]]
    variants = _variants(data)
    ref = cfg["reference"]
    md = ["# plusequals benchmark report", ""]
    md.append(
        f"Device **{cfg['device']}** ({env.get('gpu', env['cpu'])}), dtype **{cfg['dtype']}**, "
        f"{cfg['shapes_note'] if cfg['quick'] else cfg['model'] + ' shapes at ' + cfg['resolution']}; context {cfg['context'][0]} x {cfg['context'][1]}; "
        f"batches {', '.join(str(b) for b in cfg['batches'])}; every variant under {cfg['grad_mode']}. Run took {fmt(data.get('elapsed_s', 0.0))} s."
    )
    md += [
        "",
        f"**Method.** The variants of a (batch, shape) cell are timed together, in rounds, after one warm-up of each. "
        "Each round times every variant once, and every reset that a variant subtracts, in an order shuffled per round "
        "(each cell's seed, orders and raw times are in results.json). "
        f"A cell runs {cfg['rounds']} rounds, and more (up to {cfg['max_rounds']}, for at most {fmt(cfg['extra_rounds_s'])} s) "
        f"while the IQR of any of its paired ratios to `{cfg['reference']}` exceeds {fmt(cfg['settled_paired_iqr'])}. "
        f"One sample is one torch.utils.benchmark `Timer.timeit(number)`, with `number` set at warm-up so that a sample takes about {fmt(cfg['sample_s'])} s. "
        "A time is the median over the rounds (IQR over the rounds), in ms per block forward. "
        "A ratio is paired: it is computed within each round, then summarised as median [first quartile, third quartile] over the rounds. "
        f"{NOISE_MARK} marks a ratio whose interquartile interval contains 1: that difference is within the round-to-round noise. "
        "A change in machine load during the run moves the variants of a round together, so it cancels in their ratio.",
    ]
    if not cfg["torch_compile"]:
        md += ["", f"torch.compile was not measured: {cfg['torch_compile_skipped_reason']}."]
    if cfg["device"] == "cpu":
        md += ["", "> A CPU run (here: " + f"{env['cpu_threads']} threads" + ") times libtorch's CPU kernels; it is no verdict on the GPU, where the seed's question lives."]
    md += ["", "## Environment", ""]
    md.append(_table(["what", "value"], [[k, str(v)] for k, v in env.items()]))
    md += ["", "## Ceilings measured in this run", "", f"torch.utils.benchmark blocked_autorange, min run time {fmt(ceil['min_run_time_s'])} s:", ""]
    md.append(
        _table(
            ["GEMM n", "GEMM TFLOP/s", "copy MiB", "copy GB/s"],
            [[fmt(ceil["gemm_n"]), fmt(ceil["gemm_tflops"]), fmt(ceil["copy_mib"]), fmt(ceil["copy_gbps"])]],
        )
    )
    for batch in cfg["batches"]:
        md += ["", f"## Time per block call, batch {batch}", ""]
        md += [f"Median ms (IQR ms) over the cell's rounds (batch {batch}):", ""]
        notes = {r["variant"]: r["note"] for r in data["results"]}
        rows = [[f"`{v}`"] + [time_cell(_row(data, batch, sh, v)) for sh in shapes] + [notes[v]] for v in variants]
        floor = {f["shape"]: f["roofline_ms"] for f in data["roofline"] if f["batch"] == batch}
        rows.append(["roofline floor"] + [fmt(floor[sh]) for sh in shapes] + ["GEMM rate and copy bandwidth above"])
        n = {c["shape"]: c["rounds"] for c in data["cells"] if c["batch"] == batch}
        rows.append(["rounds"] + [fmt(n[sh]) for sh in shapes] + ["samples behind each cell of this column"])
        md.append(_table(["variant"] + shapes + ["the time includes"], rows))
        md += ["", f"Paired ratio to `{ref}` (batch {batch}): median [Q1, Q3] over rounds; below one is faster; {NOISE_MARK}: within noise:", ""]
        rrows = [[f"`{v}`"] + [ratio_cell(_paired(data, batch, sh, v, ref)) for sh in shapes] for v in variants if v != ref]
        md.append(_table(["variant"] + shapes, rrows))
        extra = [(a, b) for a, b in EXTRA_PAIRS if any(_paired(data, batch, sh, a, b) for sh in shapes)]
        if extra:
            md += ["", f"Other paired ratios (batch {batch}):", ""]
            md.append(_table(["ratio"] + shapes, [[f"`{a}` / `{b}`"] + [ratio_cell(_paired(data, batch, sh, a, b)) for sh in shapes] for a, b in extra]))
        md += ["", f"Drift: `{ref}` in each round, in time order (batch {batch}; ms):", ""]
        md.append(
            _table(
                ["shape", "ms per round", "max / min"],
                [[d["shape"], ", ".join(fmt(t) for t in d["rounds_ms"]), fmt(d["max_over_min"])] for d in data["drift"] if d["batch"] == batch],
            )
        )
        md += [
            "",
            f"Per UNet step (batch {batch}; blocks per shape {', '.join(str(s['blocks']) for s in cfg['shapes'])}), transformer blocks only: "
            f"the sum of the medians, and the paired ratios to `{ref}` weighted by each shape's share of its step:",
            "",
        ]
        srows = [
            [f"`{p['variant']}`", fmt(p["blocks_ms_per_step"]), fmt(p["blocks_only_it_per_s"]), fmt(p["vs_reference"]) if "vs_reference" in p else "-"]
            for p in data["per_step"]
            if p["batch"] == batch
        ]
        md.append(_table(["variant", "ms per step", "it/s (blocks only)", f"vs `{ref}` (paired)"], srows))
        if cfg["device"] == "cuda":
            md += ["", f"Peak memory and host time per call (batch {batch}; host time: unsynchronised, the reset's host time subtracted):", ""]
            prow = []
            for v in variants:
                cells = []
                for sh in shapes:
                    r = _row(data, batch, sh, v) or {}
                    pk, host = r.get("peak_mb"), r.get("host_ms")
                    cells.append(f"{fmt(pk) if pk is not None else '-'} MB / {fmt(host) if host is not None else '-'} ms")
                prow.append([f"`{v}`"] + cells)
            md.append(_table(["variant"] + shapes, prow))
    if data.get("profile"):
        md += ["", "## Where the time goes (torch.profiler, per call; the profiler adds overhead of its own)", ""]
        unit = "CUDA" if cfg["device"] == "cuda" else "CPU"
        md.append(
            _table(
                ["batch", "shape", "variant", "aten ops (incl. nested)", "self CPU ms", "self CUDA ms", f"top ops by self {unit} ms"],
                [
                    [
                        str(p["batch"]),
                        p["shape"],
                        f"`{p['variant']}`",
                        fmt(p["aten_ops_per_call"]),
                        fmt(p["self_cpu_ms_per_call"]),
                        "-" if p["self_cuda_ms_per_call"] is None else fmt(p["self_cuda_ms_per_call"]),
                        ", ".join(f"{t['op'][6:]} {fmt(t['ms_per_call'])}" for t in p["top"][:3]),
                    ]
                    for p in data["profile"]
                ],
            )
        )
        md += [
            "",
            "The wall time of a call that the profiler does not attribute to aten ops is the caller's own: "
            "Python (eager) or the binding (Rust), plus launch latency on CUDA.",
        ]
    md += [
        "",
        "## The boundary",
        "",
        "`echo()` crosses into Rust and back with no op: the raw binding `RustBlock._block.echo(x, context)` (unwrap, GIL release, wrap), "
        "and the same call through `RustBlock.forward`'s Python checks (what a caller of `RustBlock` pays). "
        "`donation_check` runs a donation's checks without the move: shapes, dtype, device and libtorch's ownership counts "
        "(rust/ownership.rs); the ownership checks cost its time minus the raw echo, paired within each round. "
        "Timed in the cells' rounds; median (IQR) over rounds:",
        "",
    ]
    md.append(
        _table(
            ["batch", "shape", "raw echo() us", "through RustBlock's checks us", "checked / raw (paired)", "donation_check us", "checks alone us (paired)"],
            [
                [
                    str(b["batch"]),
                    b["shape"],
                    f"{fmt(b['echo_us'])} ({fmt(b['echo_iqr_us'])})",
                    f"{fmt(b['echo_checked_us'])} ({fmt(b['echo_checked_iqr_us'])})",
                    fmt(b["checked_over_echo"]),
                    f"{fmt(b['donation_check_us'])} ({fmt(b['donation_check_iqr_us'])})",
                    f"{fmt(b['ownership_check_us'])} ({fmt(b['ownership_check_iqr_us'])})",
                ]
                for b in data["boundary"]
            ],
        )
    )
    if hc := data.get("host_cost"):
        sh = hc["shape"]
        md += [
            "",
            "## Host cost, where kernels cost almost nothing",
            "",
            f"At the quick shapes the kernels hide what a call costs the host. Here they cost almost nothing: batch {hc['batch']}, "
            f"{sh['tokens']} tokens of width {sh['dim']} ({sh['heads']} heads of {sh['d_head']}), context "
            f"{hc['context'][0]}x{hc['context'][1]}, {hc['threads']} intra-op thread. What is left is Python's dispatch (eager), "
            "the binding and tch (Rust), or ATen alone (C++). Timed in interleaved rounds like the cells above.",
            "",
            f"Host cost: us per call, median (IQR) over {hc['cell']['rounds']} rounds; paired ratio to `{ref}`, median [Q1, Q3]:",
            "",
        ]
        paired = {(p["variant"], p["vs"]): p for p in hc["paired"]}
        md.append(
            _table(
                ["variant", "us per call", f"/ `{ref}` (paired)", "the time includes"],
                [
                    [f"`{r['variant']}`", f"{fmt(r['median_ms'] * 1e3)} ({fmt(r['iqr_ms'] * 1e3)})", ratio_cell(paired.get((r["variant"], ref))), r["note"]]
                    for r in hc["rows"]
                ],
            )
        )
        if tch := paired.get(("rust/loop", "cpp/loop")):
            md += ["", f"The tch layer here: `rust/loop` / `cpp/loop`, paired: {ratio_cell(tch)}."]
    if "unet_step" in data:
        md += ["", "## A whole UNet step", "", data["unet_step"].get("what", "")]
        u = data["unet_step"]
        if u.get("rows"):
            md += [
                "",
                _table(
                    ["implementation", "median ms", "IQR ms", "vs eager (paired)"],
                    [[r["name"], fmt(r["median_ms"]), fmt(r["iqr_ms"]), unet_ratio_cell(r)] for r in u["rows"]],
                ),
            ]
        if u.get("max_rel_err_rust") is not None:
            md += ["", f"Rust-block UNet output vs eager: relative error {fmt(u['max_rel_err_rust'])}."]
        if u.get("block_share") is not None:
            md += [f"Share of the eager step spent in the transformer blocks ({u['block_share_method']}): {fmt(u['block_share'])}."]
        if u.get("skipped"):
            md += ["", f"Skipped: {u['skipped']}"]
    md += ["", "## Verdicts (paired ratios)", ""]
    md += verdicts(data)
    md += ["", "## Targets", ""]
    md.append(
        _table(
            ["target", "measured", "limit", "status", "how"],
            [[t["target"], "-" if t["value"] is None else f"{fmt(t['value'])} {t['unit']}", fmt(t["limit"]), t["status"], t["detail"]] for t in data["targets"]],
        )
    )
    md += ["", "## Plots", "", "![time per shape](time_per_shape.png)"]
    if cfg["device"] == "cuda":
        md.append("![peak memory](peak_memory.png)")
    else:
        md.append("(No peak-memory plot: the CPU allocator keeps no statistics.)")
    md += ["", "Every number above is in results.json beside this file."]
    return "\n".join(md) + "\n"


def compare(data: dict, batch: int, variant: str, vs: str) -> Optional[dict]:
    """``variant / vs`` across the shapes of one batch: the paired medians' range, and in how many
    cells ``variant`` is faster (Q3 < 1), slower (Q1 > 1) or within noise (the interval holds 1)."""
    shapes = [s["label"] for s in data["config"]["shapes"]]
    ps = [p for sh in shapes if (p := _paired(data, batch, sh, variant, vs))]
    if not ps:
        return None
    return {
        "variant": variant,
        "vs": vs,
        "batch": batch,
        "lo": min(p["median"] for p in ps),
        "hi": max(p["median"] for p in ps),
        "cells": len(ps),
        "within_noise": sum(p["within_noise"] for p in ps),
        "faster": sum(p["q3"] < 1 for p in ps),
        "slower": sum(p["q1"] > 1 for p in ps),
    }


def _one_cell(p: dict) -> dict:
    """A paired ratio of a single cell as a ``compare`` result (with its quartiles)."""
    return {
        "variant": p["variant"],
        "vs": p["vs"],
        "batch": p["batch"],
        "lo": p["median"],
        "hi": p["median"],
        "q1": p["q1"],
        "q3": p["q3"],
        "cells": 1,
        "within_noise": int(p["within_noise"]),
        "faster": int(p["q3"] < 1),
        "slower": int(p["q1"] > 1),
    }


def answer(c: dict) -> str:
    """What a comparison says, in words a reader can act on; counts only, from ``compare``."""
    n, f, s, w = c["cells"], c["faster"], c["slower"], c["within_noise"]
    if w == n:
        return f"same time within noise (all {n} cells)"
    if f == n or s == n:
        return f"{'faster' if f else 'slower'} in all {n} cells"
    parts = [f"{what} in {k}" for what, k in (("faster", f), ("slower", s), ("within noise", w)) if k]
    return ", ".join(parts) + f" of {n} cells"


def _across(c: dict) -> str:
    return f"{fmt(c['lo'])} to {fmt(c['hi'])} across shapes, within noise at {c['within_noise']} of {c['cells']}"


def verdict_items(data: dict) -> list[dict]:
    """The report's questions, each with its paired comparisons (``compare``) and the sentence
    REPORT.md prints; every number is a paired ratio or a count from results.json."""
    cfg = data["config"]
    ref = cfg["reference"]
    out: list[dict] = []

    def item(question: str, batch: Optional[int], comparisons: list[dict], text: str, answer_text: Optional[str] = None) -> None:
        head = comparisons[0] if comparisons else None
        out.append(
            {
                "question": question,
                "batch": batch,
                "comparisons": comparisons,
                "answer": answer_text or (f"`{head['variant']}` {answer(head)}" if head else ""),
                "answer_only": answer_text is not None,
                "text": text,
            }
        )

    for batch in cfg["batches"]:
        if ia := compare(data, batch, "eager/iadd", ref):
            item("Is `+=` faster?", batch, [ia], f"- Is `+=` faster (batch {batch})? `eager/iadd` / `{ref}`: {_across(ia)}.")
        sw = next((w for w in data.get("same_work", []) if w["batch"] == batch), None)
        if sw:
            strays = "; outside noise: " + ", ".join(sw["outside_noise"]) if sw["outside_noise"] else ""
            item(
                "Same work, spelled differently",
                batch,
                [c for v in cfg["same_work"] if (c := compare(data, batch, v, ref))],
                f"- Same work, spelled differently (batch {batch}): {', '.join(f'`{v}`' for v in cfg['same_work'])} / `{ref}`: "
                f"{fmt(sw['min'])} to {fmt(sw['max'])}; inside ±{cfg['same_work_band_pct']}% in {sw['inside_band']} of {sw['cells']} cells, "
                f"within noise in {sw['within_noise']} of {sw['cells']}{strays}.",
                f"inside ±{cfg['same_work_band_pct']}%: {sw['inside_band']}/{sw['cells']}; ≈ {sw['within_noise']}/{sw['cells']}",
            )
        rs, lp = compare(data, batch, "rust/forward", ref), compare(data, batch, "rust/loop", ref)
        if rs and lp:
            item(
                "Is Python the bottleneck?",
                batch,
                [rs, lp],
                f"- Is Python the bottleneck (batch {batch})? `rust/forward` / `{ref}`: {_across(rs)}; `rust/loop` / `{ref}`: {_across(lp)}.",
            )
        cf, cl, tch = compare(data, batch, "cpp/forward", ref), compare(data, batch, "cpp/loop", ref), compare(data, batch, "rust/loop", "cpp/loop")
        if cf and cl and tch:
            item(
                "Rust or tch?",
                batch,
                [tch, cf, cl],
                f"- Rust or tch (batch {batch})? `cpp/forward` / `{ref}`: {_across(cf)}; `cpp/loop` / `{ref}`: {_across(cl)}. "
                f"The tch layer (its C API, a heap handle per op): `rust/loop` / `cpp/loop`: {_across(tch)}.",
            )
        if gp := compare(data, batch, "graph/op_plus_x", ref):
            item("The launch-free floor", batch, [gp], f"- The launch-free floor (batch {batch}): `graph/op_plus_x` / `{ref}`: {_across(gp)}.")
        if gi := compare(data, batch, "graph/iadd", "graph/op_plus_x"):
            item("`+=` without launch overhead?", batch, [gi], f"- `+=` without launch overhead (batch {batch}): `graph/iadd` / `graph/op_plus_x`: {_across(gi)}.")
        cps = [c for mode in ("default", "reduce-overhead") if (c := compare(data, batch, f"compile/{mode}", ref))]
        for cp in cps:
            item("Should a compiler do it?", batch, [cp], f"- Should a compiler do it (batch {batch})? `{cp['variant']}` / `{ref}`: {_across(cp)}.")
    if hc := data.get("host_cost"):
        cs = [_one_cell(p) for p in hc["paired"]]
        us = {r["variant"]: r["median_ms"] * 1e3 for r in hc["rows"]}
        item(
            "Is Python the bottleneck where kernels cost almost nothing?",
            hc["batch"],
            cs,
            f"- Is Python the bottleneck where kernels cost almost nothing (batch {hc['batch']}, {hc['shape']['label']}, "
            f"{hc['threads']} thread)? "
            + "; ".join(f"`{c['variant']}` / `{c['vs']}`: {fmt(c['lo'])} [{fmt(c['q1'])}, {fmt(c['q3'])}]" for c in cs)
            + ".",
            f"batch {hc['batch']}, {hc['shape']['label']}, {hc['threads']} thread, µs per call: "
            + ", ".join(f"`{v}` {fmt(t)}" for v, t in us.items()),
        )
    if cv := data.get("compiler_verdict"):
        in_place = ", ".join(f"`{v}`" for v in cv.get("in_place", [])) or "none"
        reuse = ", ".join(f"`{v}`" for v in cv.get("reuses_buffers", [])) or "none"
        item(
            "Which compiler makes the residual add in place?",
            cv["batch"],
            [],
            f"- Which compiler turns `x = op(norm(x)) + x` into an in-place add (measured at batch {cv['batch']}, {cv['shape']})? "
            f"Output written into x's own buffer: {in_place}. Residual sums into buffers the plan already held: {reuse}.",
            f"writes into x's buffer: {in_place}; reuses its own buffers: {reuse} ({cv['shape']})",
        )
    steps = {(p["batch"], p["variant"]): p for p in data["per_step"]}
    seed = cfg["seed_claim"]
    b = steps.get((2, "eager/iadd"), {})
    if "vs_reference" in b:
        item(
            "The seed's ~7%?",
            2,
            [],
            f"- The seed's \"{fmt(seed['before_it_per_s'])} -> {fmt(seed['after_it_per_s'])} it/s\" (~{fmt(seed['speedup_pct'])}%) "
            f"is a step time ratio of {fmt(seed['step_time_ratio'])}. For the blocks alone at batch 2, `eager/iadd` / `{ref}` per step, "
            f"paired: {fmt(b['vs_reference'])}.",
            f"claimed step ratio {fmt(seed['step_time_ratio'])}; blocks per step here, `eager/iadd` / `{ref}`: {fmt(b['vs_reference'])}",
        )
    return out


def verdicts(data: dict) -> list[str]:
    """REPORT.md's verdict sentences."""
    return [v["text"] for v in verdict_items(data)]


def plots(data: dict, outdir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = data["config"]
    shapes = [s["label"] for s in cfg["shapes"]]
    variants = []
    for r in data["results"]:
        if r["variant"] not in variants:
            variants.append(r["variant"])
    fig, axes = plt.subplots(1, len(cfg["batches"]), figsize=(7 * len(cfg["batches"]), 5.5), squeeze=False)
    width = 0.8 / len(variants)
    for ax, batch in zip(axes[0], cfg["batches"]):
        for i, v in enumerate(variants):
            ys = [(_row(data, batch, sh, v) or {}).get("median_ms", float("nan")) for sh in shapes]
            errs = [(_row(data, batch, sh, v) or {}).get("iqr_ms", 0.0) for sh in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], ys, width, yerr=errs, label=v, color=plt.cm.tab20(i % 20))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        ax.set_yscale("log")
        ax.set_ylabel("ms per block call (median, IQR bars)")
        ax.set_title(f"{cfg['device']} {cfg['dtype']}, batch {batch}")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(outdir / "time_per_shape.png", dpi=110)
    plt.close(fig)
    if cfg["device"] == "cuda":
        fig, ax = plt.subplots(figsize=(9, 5))
        mem_variants = [v for v in variants if v.startswith(("eager/", "rust/forward"))]
        for i, v in enumerate(mem_variants):
            ys = [(_row(data, 2, sh, v) or {}).get("peak_mb") or float("nan") for sh in shapes]
            ax.bar([j + i * (0.8 / len(mem_variants)) for j in range(len(shapes))], ys, 0.8 / len(mem_variants), label=v, color=plt.cm.tab20(i % 20))
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_ylabel("peak MB above inputs, batch 2")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(outdir / "peak_memory.png", dpi=110)
        plt.close(fig)


NUMBER = re.compile(r"\d+(?:\.\d+)?")
