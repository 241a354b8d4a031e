"""``python -m plusequals report``: every residual strategy x PyTorch eager, torch.compile, the
CUDA-graph floor, Rust and C++ (and JAX / ONNX Runtime where installed), timed in one run; writes
DIR/results.json (every number), DIR/REPORT.md (rendered from results.json alone) and DIR/*.png,
then prints the summary (:mod:`.summary`).

results.json is rewritten after every measurement, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

import torch
from rich.console import Console

from ..bench import analyse, inductor, measure, render
from .summary import emit


def run(
    device: Optional[str] = None,
    quick: Optional[bool] = None,
    out: str = "report",
    unet: bool = True,
    compile: bool = True,
    compilers_flag: bool = True,
    output: str = "rich",
    audit_cost: bool = True,
    smoke: bool = False,
) -> int:
    """``quick=None``: quick shapes on the CPU (SD v1 shapes are long on a small CPU), SD v1 shapes on CUDA.
    ``output``: "rich" (progress, then the summary), "quiet" (REPORT.md's path alone) or "json"
    (the summary as JSON, alone on stdout)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    quick = (device == "cpu") if quick is None else quick
    if device == "cuda" and not torch.cuda.is_available():
        Console(stderr=True).print("[red]--device cuda: no CUDA device is available[/]")
        return 2
    console = Console(quiet=output != "rich")
    outdir = Path(out)
    plan = measure.plan(device, quick, unet, compile, compilers_flag, audit_cost, smoke)
    with stdout_to_stderr() if output == "json" else contextlib.nullcontext(), inductor_cache(plan) as plan:
        data = report(plan, outdir, console)
    emit(data, outdir, output, console)
    return 0


def report(plan: measure.Plan, outdir: Path, console: Console) -> dict:
    """Measures, analyses and marks results.json complete, then renders REPORT.md and the plots
    from it; returns results.json's contents."""
    t_start = time.perf_counter()
    rec = measure.measure(plan, outdir, console)
    analyse.summarize(rec.data)
    rec.finish(elapsed_s=time.perf_counter() - t_start)
    (outdir / "REPORT.md").write_text(render.render(rec.data))
    render.plots(rec.data, outdir)
    return rec.data


# Inductor's cache for a report run, unless TORCHINDUCTOR_CACHE_DIR names one: under the Rust
# build's git-ignored target/, so that a second `make report` finds its kernels compiled.
INDUCTOR_CACHE = Path("target") / "inductor-cache"


@contextlib.contextmanager
def inductor_cache(plan: measure.Plan) -> Iterator[measure.Plan]:
    """Runs the report with Inductor's cache in ``INDUCTOR_CACHE`` (or the one the environment
    names), the environment restored after; yields the plan with the directory and whether it was
    warm."""
    if not plan.torch_compile:
        yield plan
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # torch writes its default into the environment the first time it asks: that is not a choice
    where = Path(named) if named and named != default_cache_dir() else INDUCTOR_CACHE
    warm = where.is_dir() and any(where.iterdir())
    with temporary_cache_dir(str(where.absolute())), inductor.isa_checks_remembered():
        yield replace(plan, inductor_cache=str(where), inductor_cache_warm=warm)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While a ``--json`` run measures, whatever prints to stdout (Python or C) goes to stderr,
    so that stdout ends up holding the summary's JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
