"""``python -m plusequals report``: every residual strategy x PyTorch eager, torch.compile, the
CUDA-graph floor and Rust, timed in one run; writes DIR/results.json (every number),
DIR/REPORT.md (rendered from results.json alone) and DIR/*.png.

results.json is rewritten after every measurement, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import _rust, bench
from .bench import Shape, Stat

BATCHES = (2, 16)
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

    def add(self, key: str, row: dict) -> None:
        self.data.setdefault(key, []).append(row)
        self.flush()


def measure(v: bench.Variant, device: str, min_run_time: float, loop_n: int) -> dict:
    stat = bench.timeit(v.fn, min_run_time)
    reset_ms = bench.timeit(v.reset, min_run_time / 2).median_ms if v.reset else 0.0
    per = loop_n if v.name == "rust/loop" else 1
    row = {
        "variant": v.name,
        "family": v.family,
        "median_ms": (stat.median_ms - reset_ms) / per,
        "iqr_ms": stat.iqr_ms / per,
        "runs": stat.runs,
        "reset_ms": reset_ms,
        "note": v.note,
    }
    if v.name != "rust/loop":
        row["peak_mb"] = bench.peak_memory_mb(v.fn, device, v.prepare)
        host = bench.host_ms_per_call(v.fn, device)
        row["host_ms"] = None if host is None else host - (reset_ms if device == "cuda" and v.family != "graph" else 0.0)
    return row


def run(
    device: Optional[str] = None, quick: Optional[bool] = None, out: str = "report", unet: bool = True, compile: bool = True
) -> int:
    """``quick=None``: quick shapes on the CPU (SD v1 shapes are long on a small CPU), SD v1 shapes on CUDA."""
    console = Console()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    quick = (device == "cpu") if quick is None else quick
    if device == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda: no CUDA device is available[/]")
        return 2
    dtype = torch.float16 if device == "cuda" else torch.float32
    shapes = bench.QUICK_SHAPES if quick else bench.SD_V1_SHAPES
    context = bench.QUICK_CONTEXT if quick else bench.SD_V1_CONTEXT
    min_run_time = 0.2 if quick else (0.25 if device == "cuda" else 0.3)
    loop_n = 10 if quick else 50
    with_compile = compile and not (quick and device == "cpu")
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    rec = Recorder(
        outdir,
        {
            "schema": 1,
            "complete": False,
            "environment": environment(device),
            "config": {
                "device": device,
                "dtype": str(dtype).replace("torch.", ""),
                "quick": quick,
                "batches": list(BATCHES),
                "shapes": [s.__dict__ | {"label": s.label} for s in shapes],
                "context": list(context),
                "min_run_time_s": min_run_time,
                "rust_loop_n": loop_n,
                "torch_compile": with_compile,
                "seed_claim": {"commit": "Speedup from switch to +=", "before_it_per_s": 1.57, "after_it_per_s": 1.69, "speedup_pct": 7},
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

    n_variants = len(bench.STRATEGIES) + 4 + (2 if device == "cuda" else 0) + ((2 if device == "cuda" else 1) if with_compile else 0)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=False
    ) as progress:
        task = progress.add_task("measuring", total=len(BATCHES) * len(shapes) * (n_variants + 1))
        for batch in BATCHES:
            for shape in shapes:
                s = bench.make_setup(shape, batch, context, device, dtype)
                with torch.no_grad():
                    progress.update(task, description=f"batch {batch} {shape.label}: echo")
                    echo = bench.timeit(lambda: s.rust._block.echo(s.x, s.context), min_run_time)
                    rec.add("boundary", {"batch": batch, "shape": shape.label, "echo_us": echo.median_ms * 1e3, "echo_iqr_us": echo.iqr_ms * 1e3})
                    progress.advance(task)
                    variants = bench.eager_variants(s) + bench.rust_variants(s, loop_n)
                    if device == "cuda":
                        variants += bench.graph_variants(s)
                    compile_seconds: dict[str, float] = {}
                    if with_compile:
                        progress.update(task, description=f"batch {batch} {shape.label}: torch.compile")
                        cv, compile_seconds = bench.compile_variants(s)
                        variants += cv
                    for v in variants:
                        progress.update(task, description=f"batch {batch} {shape.label}: {v.name}")
                        row = measure(v, device, min_run_time, loop_n)
                        row |= {"batch": batch, "shape": shape.label}
                        if v.family == "compile":
                            row["compile_s"] = compile_seconds[v.name.split("/", 1)[1]]
                        rec.add("results", row)
                        progress.advance(task)
                if batch == BATCHES[0] and shape in (shapes[0], shapes[-1]):
                    progress.update(task, description=f"batch {batch} {shape.label}: torch.profiler")
                    with torch.no_grad():
                        for name, fn in (("eager/op_plus_x", lambda: s.block(s.x, s.context)), ("rust/forward", lambda: s.rust.forward(s.x, s.context))):
                            rec.add("profile", {"batch": batch, "shape": shape.label, "variant": name} | bench.profile_ops(fn, device))
                rec.add(
                    "per_shape",
                    {
                        "batch": batch,
                        "shape": shape.label,
                        "blocks_per_step": shape.blocks,
                        "gflop": bench.block_flops(shape, batch, *context) / 1e9,
                        "min_mb": bench.block_min_bytes(s.block, shape, batch, *context, s.x.element_size()) / 2**20,
                    },
                )
                del s
                if device == "cuda":
                    torch.cuda.empty_cache()

    if unet:
        from . import unet_bench

        with console.status("full UNet step"):
            rec.data["unet_step"] = unet_bench.measure(device, dtype, quick, min_run_time, rec.data, with_compile)
        rec.flush()

    summarize(rec.data)
    rec.data["elapsed_s"] = time.perf_counter() - t_start
    rec.data["complete"] = True
    rec.flush()
    (outdir / "REPORT.md").write_text(render(rec.data))
    plots(rec.data, outdir)
    console.print(f"wrote {outdir / 'REPORT.md'}, {outdir / 'results.json'} and plots in {rec.data['elapsed_s']:.0f} s")
    return 0


# ----------------------------------------------------------------------------- analysis
def _row(data: dict, batch: int, shape: str, variant: str) -> Optional[dict]:
    for r in data.get("results", []):
        if r["batch"] == batch and r["shape"] == shape and r["variant"] == variant:
            return r
    return None


def _ms(data: dict, batch: int, shape: str, variant: str) -> Optional[float]:
    r = _row(data, batch, shape, variant)
    return None if r is None else r["median_ms"]


def summarize(data: dict) -> None:
    """Ratios and per-step totals, computed from the rows and stored next to them."""
    shapes = [s["label"] for s in data["config"]["shapes"]]
    blocks = {s["label"]: s["blocks"] for s in data["config"]["shapes"]}
    ceil = data["ceilings"]
    variants = sorted({r["variant"] for r in data["results"]})
    ratios, steps, floors = [], [], []
    for batch in data["config"]["batches"]:
        for shape in shapes:
            base = _ms(data, batch, shape, "eager/op_plus_x")
            for v in variants:
                t = _ms(data, batch, shape, v)
                if base and t:
                    ratios.append({"batch": batch, "shape": shape, "variant": v, "vs_eager": t / base})
            ps = next(p for p in data["per_shape"] if p["batch"] == batch and p["shape"] == shape)
            floor_ms = max(ps["gflop"] * 1e9 / (ceil["gemm_tflops"] * 1e12), ps["min_mb"] * 2**20 / (ceil["copy_gbps"] * 1e9)) * 1e3
            floors.append({"batch": batch, "shape": shape, "roofline_ms": floor_ms})
        for v in variants:
            ts = [_ms(data, batch, sh, v) for sh in shapes]
            if all(t is not None for t in ts):
                total = sum(t * blocks[sh] for t, sh in zip(ts, shapes))
                steps.append({"batch": batch, "variant": v, "blocks_ms_per_step": total, "blocks_only_it_per_s": 1e3 / total})
    data["ratios"], data["per_step"], data["roofline"] = ratios, steps, floors
    noise = []
    for batch in data["config"]["batches"]:
        within = 0
        for sh in shapes:
            a, b = _row(data, batch, sh, "eager/iadd"), _row(data, batch, sh, "eager/op_plus_x")
            if a and b and abs(a["median_ms"] - b["median_ms"]) <= max(a["iqr_ms"], b["iqr_ms"]):
                within += 1
        noise.append({"batch": batch, "shapes_within_iqr": within, "shapes": len(shapes)})
    data["iadd_vs_op_plus_x"] = noise
    data["targets"] = targets(data)


def targets(data: dict) -> list[dict]:
    """The issue's performance targets (set for the H200), each with its measured value."""
    shapes = [s["label"] for s in data["config"]["shapes"]]
    on_target_device = data["config"]["device"] == TARGET_DEVICE and not data["config"]["quick"]
    out = []

    def add(name: str, value: Optional[float], limit: float, ok: Optional[bool], unit: str, detail: str) -> None:
        status = "not measurable here" if ok is None else ("met" if ok else "missed")
        if ok is not None and not on_target_device:
            status += " (informational: targets are for the H200, full shapes)"
        out.append({"target": name, "value": value, "limit": limit, "unit": unit, "status": status, "detail": detail})

    speedups = [(_ms(data, 2, sh, "eager/op_plus_x") or math.nan) / (_ms(data, 2, sh, "rust/forward") or math.nan) for sh in shapes]
    worst = min(speedups)
    add("Rust forward >= 2x faster than eager op_plus_x at every shape (batch 2)", worst, 2.0, worst >= 2.0, "x (worst shape)", "eager / rust/forward")
    graph = [_ms(data, 2, sh, "graph/op_plus_x") for sh in shapes]
    if all(g is not None for g in graph):
        over = max((_ms(data, 2, sh, "rust/forward") or math.nan) / g for sh, g in zip(shapes, graph))
        add("Rust forward within 1.3x of the CUDA-graph floor (batch 2)", over, 1.3, over <= 1.3, "x (worst shape)", "rust/forward / graph/op_plus_x")
    else:
        add("Rust forward within 1.3x of the CUDA-graph floor (batch 2)", None, 1.3, None, "x", "no CUDA graphs on this device")
    b16 = [(_ms(data, 16, sh, "rust/forward") or math.nan) / (_ms(data, 16, sh, "eager/op_plus_x") or math.nan) for sh in shapes]
    add("Rust forward within 1.02x of eager at batch 16", max(b16), 1.02, max(b16) <= 1.02, "x (worst shape)", "rust/forward / eager")
    mem = [(_row(data, 2, sh, "rust/forward_owned_donate") or {}).get("peak_mb") for sh in shapes]
    mem_iadd = [(_row(data, 2, sh, "eager/iadd") or {}).get("peak_mb") for sh in shapes]
    if all(m is not None for m in mem + mem_iadd):
        worst_mem = max(m / i for m, i in zip(mem, mem_iadd))
        add("forward_owned (donated) peak memory <= PyTorch iadd's", worst_mem, 1.0, worst_mem <= 1.0, "x (worst shape)", "peak MB ratio")
    else:
        add("forward_owned (donated) peak memory <= PyTorch iadd's", None, 1.0, None, "x", "no allocator statistics on the CPU")
    echo = max(b["echo_us"] for b in data["boundary"])
    add("Python -> Rust per-call overhead <= 10 us", echo, 10.0, echo <= 10.0, "us (worst shape)", "RustBlock echo(): unwrap, GIL release, wrap")
    return out


# ----------------------------------------------------------------------------- rendering
def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(data: dict) -> str:
    cfg, env, ceil = data["config"], data["environment"], data["ceilings"]
    shapes = [s["label"] for s in cfg["shapes"]]
    variants = []
    for r in data["results"]:
        if r["variant"] not in variants:
            variants.append(r["variant"])
    md = ["# plusequals benchmark report", ""]
    md.append(
        f"Device **{cfg['device']}** ({env.get('gpu', env['cpu'])}), dtype **{cfg['dtype']}**, "
        f"{cfg['shapes_note'] if cfg['quick'] else cfg['model'] + ' shapes at ' + cfg['resolution']}; context {cfg['context'][0]} x {cfg['context'][1]}; "
        f"batches {', '.join(str(b) for b in cfg['batches'])}; every variant under {cfg['grad_mode']}. "
        f"Timer: torch.utils.benchmark blocked_autorange, min run time {fmt(cfg['min_run_time_s'])} s; "
        f"cells are median ms (IQR ms). Run took {fmt(data.get('elapsed_s', 0.0))} s."
    )
    if not cfg["torch_compile"]:
        md += ["", f"torch.compile was not measured: {cfg['torch_compile_skipped_reason']}."]
    if cfg["device"] == "cpu":
        md += ["", "> A CPU run (here: " + f"{env['cpu_threads']} threads" + ") times libtorch's CPU kernels; it is no verdict on the GPU, where the seed's question lives."]
    md += ["", "## Environment", ""]
    md.append(_table(["what", "value"], [[k, str(v)] for k, v in env.items()]))
    md += ["", "## Ceilings measured in this run", ""]
    md.append(
        _table(
            ["GEMM n", "GEMM TFLOP/s", "copy MiB", "copy GB/s"],
            [[fmt(ceil["gemm_n"]), fmt(ceil["gemm_tflops"]), fmt(ceil["copy_mib"]), fmt(ceil["copy_gbps"])]],
        )
    )
    for batch in cfg["batches"]:
        md += ["", f"## Time per block call, batch {batch}", ""]
        rows = []
        for v in variants:
            cells = []
            for sh in shapes:
                r = _row(data, batch, sh, v)
                cells.append("-" if r is None else f"{fmt(r['median_ms'])} ({fmt(r['iqr_ms'])})")
            rows.append([f"`{v}`"] + cells)
        floor = {f["shape"]: f["roofline_ms"] for f in data["roofline"] if f["batch"] == batch}
        rows.append(["roofline floor"] + [fmt(floor[sh]) for sh in shapes])
        md.append(_table(["variant"] + shapes, rows))
        md += ["", f"Ratio to `eager/op_plus_x` (batch {batch}; below one is faster):", ""]
        rrows = []
        for v in variants:
            cells = [next((fmt(x["vs_eager"]) for x in data["ratios"] if x["batch"] == batch and x["shape"] == sh and x["variant"] == v), "-") for sh in shapes]
            rrows.append([f"`{v}`"] + cells)
        md.append(_table(["variant"] + shapes, rrows))
        md += ["", f"Per UNet step (blocks per shape {', '.join(str(s['blocks']) for s in cfg['shapes'])}), transformer blocks only:", ""]
        srows = [
            [f"`{p['variant']}`", fmt(p["blocks_ms_per_step"]), fmt(p["blocks_only_it_per_s"])]
            for p in data["per_step"]
            if p["batch"] == batch
        ]
        md.append(_table(["variant", "ms per step", "it/s (blocks only)"], srows))
        if cfg["device"] == "cuda":
            md += ["", f"Peak memory and host time per call (batch {batch}):", ""]
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
    md += ["", "## The boundary", ""]
    md.append(
        _table(
            ["batch", "shape", "echo() us", "IQR us"],
            [[str(b["batch"]), b["shape"], fmt(b["echo_us"]), fmt(b["echo_iqr_us"])] for b in data["boundary"]],
        )
    )
    if "unet_step" in data:
        md += ["", "## A whole UNet step", "", data["unet_step"].get("what", "")]
        u = data["unet_step"]
        if u.get("rows"):
            md += ["", _table(["implementation", "median ms", "IQR ms", "vs eager"], [[r["name"], fmt(r["median_ms"]), fmt(r["iqr_ms"]), fmt(r["vs_eager"])] for r in u["rows"]])]
        if u.get("max_rel_err_rust") is not None:
            md += ["", f"Rust-block UNet output vs eager: relative error {fmt(u['max_rel_err_rust'])}."]
        if u.get("block_share") is not None:
            md += [f"Share of the eager step spent in the transformer blocks ({u['block_share_method']}): {fmt(u['block_share'])}."]
        if u.get("skipped"):
            md += ["", f"Skipped: {u['skipped']}"]
    md += ["", "## Verdicts (measured ratios)", ""]
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


def verdicts(data: dict) -> list[str]:
    """Sentences whose every number is a ratio or time from results.json."""
    shapes = [s["label"] for s in data["config"]["shapes"]]
    out = []

    def span(variant: str, batch: int) -> Optional[tuple[float, float]]:
        xs = [x["vs_eager"] for x in data["ratios"] if x["batch"] == batch and x["variant"] == variant]
        return (min(xs), max(xs)) if xs else None

    for batch in data["config"]["batches"]:
        sp = span("eager/iadd", batch)
        noise = next((n for n in data.get("iadd_vs_op_plus_x", []) if n["batch"] == batch), None)
        if sp and noise:
            out.append(
                f"- Is `+=` faster (batch {batch})? `eager/iadd` / `eager/op_plus_x` = {fmt(sp[0])} to {fmt(sp[1])} across shapes; "
                f"the difference is within one IQR at {noise['shapes_within_iqr']} of {noise['shapes']} shapes."
            )
        rs = span("rust/forward", batch)
        lp = span("rust/loop", batch)
        if rs and lp:
            out.append(
                f"- Is Python the bottleneck (batch {batch})? Rust called from Python costs {fmt(rs[0])} to {fmt(rs[1])} of eager; "
                f"Rust looping inside Rust {fmt(lp[0])} to {fmt(lp[1])}."
            )
        gp = span("graph/op_plus_x", batch)
        if gp:
            out.append(f"- The launch-free floor (batch {batch}): CUDA-graph replay costs {fmt(gp[0])} to {fmt(gp[1])} of eager.")
        for mode in ("default", "reduce-overhead"):
            cp = span(f"compile/{mode}", batch)
            if cp:
                out.append(f"- Should a compiler do it (batch {batch})? torch.compile ({mode}) costs {fmt(cp[0])} to {fmt(cp[1])} of eager.")
    steps = {(p["batch"], p["variant"]): p for p in data["per_step"]}
    seed = data["config"]["seed_claim"]
    a, b = steps.get((2, "eager/op_plus_x")), steps.get((2, "eager/iadd"))
    if a and b:
        out.append(
            f"- The seed's \"{fmt(seed['before_it_per_s'])} -> {fmt(seed['after_it_per_s'])} it/s\" (~{fmt(seed['speedup_pct'])}%), "
            f"for the blocks alone at batch 2: op_plus_x {fmt(a['blocks_only_it_per_s'])} it/s, "
            f"iadd {fmt(b['blocks_only_it_per_s'])} it/s."
        )
    return out


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
