"""REPORT.md and the plots, rendered from a results.json alone (``render``, ``plots``): one
function per section, each reading the typed rows of :class:`.results.Results`; every number
printed with :func:`.results.fmt`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .analyse import EXTRA_PAIRS, verdict_items
from .results import (
    ANOMALY,
    AUDITED,
    BARE,
    EAGER,
    OBSERVED,
    AuditCost,
    AuditFamily,
    CellTiming,
    HostCost,
    Paired,
    Results,
    StepTiming,
    UnetRow,
    fmt,
)

# Marks a paired ratio whose interquartile interval contains 1.
NOISE_MARK = "≈"


# ----------------------------------------------------------------------------- cells
def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def time_cell(r: Optional[CellTiming]) -> str:
    return "-" if r is None else f"{fmt(r.median_ms)} ({fmt(r.iqr_ms)})"


def ratio(median: float, q1: float, q3: float, within_noise: bool) -> str:
    """median [Q1, Q3] of a paired ratio; NOISE_MARK when the interval contains 1."""
    return f"{fmt(median)} [{fmt(q1)}, {fmt(q3)}]" + (f" {NOISE_MARK}" if within_noise else "")


def ratio_cell(p: Optional[Paired]) -> str:
    return "-" if p is None else ratio(p.median, p.q1, p.q3, p.within_noise)


def step_ratio(r: Optional[StepTiming]) -> str:
    """A step's paired ratio to eager (``ratio``), or "-" where it was not timed."""
    return "-" if r is None else ratio(r.vs_eager, r.vs_eager_q1, r.vs_eager_q3, r.within_noise)


def unet_ratio_cell(r: UnetRow) -> str:
    return "reference" if r.name == "eager" else step_ratio(r)


def _or_dash(v: Optional[float]) -> str:
    return "-" if v is None else fmt(v)


# ----------------------------------------------------------------------------- sections
def _header(res: Results) -> list[str]:
    cfg, env = res.config, res.environment
    shapes = cfg["shapes_note"] if cfg["quick"] else cfg["model"] + " shapes at " + cfg["resolution"]
    md = [
        "# plusequals benchmark report",
        "",
        f"Device **{cfg['device']}** ({env.get('gpu', env['cpu'])}), dtype **{cfg['dtype']}**, "
        f"{shapes}; context {cfg['context'][0]} x {cfg['context'][1]}; "
        f"batches {', '.join(str(b) for b in cfg['batches'])}; every variant under {cfg['grad_mode']}. Run took "
        f"{fmt(res.elapsed_s)} s.",
        "",
        _method(cfg),
    ]
    if cfg.get("smoke"):
        md += [
            "",
            "> **A smoke run** (`--smoke`): every section ran with the fewest rounds and "
            "samples of one call, to check the report end to end. Its numbers are not "
            "measurements to read; `make report` makes the report.",
        ]
    if not cfg["torch_compile"]:
        md += ["", f"torch.compile was not measured: {cfg['torch_compile_skipped_reason']}."]
    elif cfg.get("inductor_cache"):
        warm = "warm (kept from an earlier run)" if cfg.get("inductor_cache_warm") else "cold (empty)"
        md += [
            "",
            "torch.compile (Inductor, default mode) compiles `op_plus_x` and `iadd` once per cell, static shapes, "
            f"at batch {', '.join(str(b) for b in cfg.get('torch_compile_batches') or cfg['batches'])}; "
            f"Inductor's cache is `{cfg['inductor_cache']}`, {warm} at the start of this run, so a second run skips "
            "Inductor's C++ compiles. Compile seconds (the first two calls), apart from the times: "
            + _compile_seconds(res)
            + ".",
        ]
    if cfg["device"] == "cpu":
        md += [
            "",
            "> A CPU run (here: "
            + f"{env['cpu_threads']} threads"
            + ") times libtorch's CPU kernels; it is no verdict on the GPU, where the seed's question lives.",
        ]
    return md


def _compile_seconds(res: Results) -> str:
    """Each compiled row's compile seconds, cell by cell (``compile_s`` in results.json)."""
    cells = [
        f"`{r.variant}` {fmt(r.compile_s)} s (batch {r.batch}, {r.shape})"
        for r in res.rows.values()
        if r.compile_s is not None
    ]
    return "; ".join(cells) or "none measured"


def _method(cfg: dict) -> str:
    return (
        "**Method.** The variants of a (batch, shape) cell are timed together, in rounds, after one warm-up of each. "
        "Each round times every variant once, and every reset that a variant subtracts, in an order shuffled per round "
        "(each cell's seed, orders and raw times are in results.json). "
        f"A cell runs {cfg['rounds']} rounds, and more (up to {cfg['max_rounds']}, for at most "
        f"{fmt(cfg['extra_rounds_s'])} s) "
        f"while the IQR of any of its paired ratios to `{cfg['reference']}` exceeds {fmt(cfg['settled_paired_iqr'])}. "
        + (
            "One sample is one torch.utils.benchmark `Timer.timeit(number)`, "
            f"with `number` set at warm-up so that a sample takes about {fmt(cfg['sample_s'])} s. "
            if cfg["sample_s"] > 0
            else "One sample is one call, after one warm-up call (a smoke run). "
        )
        + "A time is the median over the rounds (IQR over the rounds), in ms per block forward. "
        "A ratio is paired: it is computed within each round, then summarised as median [first quartile, third "
        "quartile] over the rounds. "
        f"{NOISE_MARK} marks a ratio whose interquartile interval contains 1: that difference is within the "
        "round-to-round noise. "
        "A change in machine load during the run moves the variants of a round together, so it cancels in their ratio."
    )


def _machine(res: Results) -> list[str]:
    ceil = res.ceilings
    return [
        "",
        "## Environment",
        "",
        table(["what", "value"], [[k, str(v)] for k, v in res.environment.items()]),
        "",
        "## Ceilings measured in this run",
        "",
        f"torch.utils.benchmark blocked_autorange, min run time {fmt(ceil['min_run_time_s'])} s:",
        "",
        table(
            ["GEMM n", "GEMM TFLOP/s", "copy MiB", "copy GB/s"],
            [[fmt(ceil["gemm_n"]), fmt(ceil["gemm_tflops"]), fmt(ceil["copy_mib"]), fmt(ceil["copy_gbps"])]],
        ),
    ]


def _batch(res: Results, batch: int) -> list[str]:
    """The section of one batch: times, paired ratios, drift, per step and (CUDA) memory."""
    md = (
        ["", f"## Time per block call, batch {batch}", ""]
        + _times(res, batch)
        + _ratios(res, batch)
        + _drift(res, batch)
        + _per_step(res, batch)
    )
    return md + (_memory(res, batch) if res.config["device"] == "cuda" else [])


def _timed(res: Results, batch: int) -> list[str]:
    """The variants with a row at ``batch`` (the quick CPU run compiles at batch 2 only)."""
    return [v for v in res.variants if any(res.row(batch, sh, v) for sh in res.shapes)]


def _times(res: Results, batch: int) -> list[str]:
    shapes = res.shapes
    notes = {r.variant: r.note for r in res.rows.values()}
    rows = [[f"`{v}`"] + [time_cell(res.row(batch, sh, v)) for sh in shapes] + [notes[v]] for v in _timed(res, batch)]
    rows.append(
        ["roofline floor"]
        + [fmt(res.roofline[batch, sh].roofline_ms) for sh in shapes]
        + ["GEMM rate and copy bandwidth above"]
    )
    rows.append(
        ["rounds"] + [fmt(res.cells[batch, sh].rounds) for sh in shapes] + ["samples behind each cell of this column"]
    )
    return [
        f"Median ms (IQR ms) over the cell's rounds (batch {batch}):",
        "",
        table(["variant"] + shapes + ["the time includes"], rows),
    ]


def _ratios(res: Results, batch: int) -> list[str]:
    shapes, ref = res.shapes, res.reference
    rows = [
        [f"`{v}`"] + [ratio_cell(res.paired.get((batch, sh, v, ref))) for sh in shapes]
        for v in _timed(res, batch)
        if v != ref
    ]
    md = [
        "",
        f"Paired ratio to `{ref}` (batch {batch}): median [Q1, Q3] over rounds; below one is faster; {NOISE_MARK}: "
        "within noise:",
        "",
    ]
    md.append(table(["variant"] + shapes, rows))
    extra = [(a, b) for a, b in EXTRA_PAIRS if any((batch, sh, a, b) in res.paired for sh in shapes)]
    if extra:
        rows = [[f"`{a}` / `{b}`"] + [ratio_cell(res.paired.get((batch, sh, a, b))) for sh in shapes] for a, b in extra]
        md += ["", f"Other paired ratios (batch {batch}):", "", table(["ratio"] + shapes, rows)]
    return md


def _drift(res: Results, batch: int) -> list[str]:
    rows = [
        [d.shape, ", ".join(fmt(t) for t in d.rounds_ms), fmt(d.max_over_min)]
        for d in res.drift.values()
        if d.batch == batch
    ]
    return [
        "",
        f"Drift: `{res.reference}` in each round, in time order (batch {batch}; ms):",
        "",
        table(["shape", "ms per round", "max / min"], rows),
    ]


def _per_step(res: Results, batch: int) -> list[str]:
    ref, blocks = res.reference, res.blocks.values()
    rows = [
        [f"`{p.variant}`", fmt(p.blocks_ms_per_step), fmt(p.blocks_only_it_per_s), _or_dash(p.vs_reference)]
        for p in res.per_step.values()
        if p.batch == batch
    ]
    return [
        "",
        f"Per UNet step (batch {batch}; blocks per shape {', '.join(str(n) for n in blocks)}), transformer blocks "
        "only: "
        f"the sum of the medians, and the paired ratios to `{ref}` weighted by each shape's share of its step:",
        "",
        table(["variant", "ms per step", "it/s (blocks only)", f"vs `{ref}` (paired)"], rows),
    ]


def _memory(res: Results, batch: int) -> list[str]:
    def cell(r: Optional[CellTiming]) -> str:
        peak, host = (None, None) if r is None else (r.peak_mb, r.host_ms)
        return f"{_or_dash(peak)} MB / {_or_dash(host)} ms"

    rows = [[f"`{v}`"] + [cell(res.row(batch, sh, v)) for sh in res.shapes] for v in _timed(res, batch)]
    return [
        "",
        f"Peak memory and host time per call (batch {batch}; host time: unsynchronised, the reset's host time "
        "subtracted):",
        "",
        table(["variant"] + res.shapes, rows),
    ]


def _profile(res: Results) -> list[str]:
    if not res.profile:
        return []
    unit = "CUDA" if res.config["device"] == "cuda" else "CPU"
    rows = [
        [
            str(p.batch),
            p.shape,
            f"`{p.variant}`",
            fmt(p.aten_ops_per_call),
            fmt(p.self_cpu_ms_per_call),
            _or_dash(p.self_cuda_ms_per_call),
            ", ".join(f"{t.op[6:]} {fmt(t.ms_per_call)}" for t in p.top[:3]),
        ]
        for p in res.profile
    ]
    return [
        "",
        "## Where the time goes (torch.profiler, per call; the profiler adds overhead of its own)",
        "",
        table(
            [
                "batch",
                "shape",
                "variant",
                "aten ops (incl. nested)",
                "self CPU ms",
                "self CUDA ms",
                f"top ops by self {unit} ms",
            ],
            rows,
        ),
        "",
        "The wall time of a call that the profiler does not attribute to aten ops is the caller's own: "
        "Python (eager) or the binding (Rust), plus launch latency on CUDA.",
    ]


def _boundary(res: Results) -> list[str]:
    rows = [
        [
            str(b.batch),
            b.shape,
            f"{fmt(b.echo_us)} ({fmt(b.echo_iqr_us)})",
            f"{fmt(b.echo_checked_us)} ({fmt(b.echo_checked_iqr_us)})",
            fmt(b.checked_over_echo),
            f"{fmt(b.donation_check_us)} ({fmt(b.donation_check_iqr_us)})",
            f"{fmt(b.ownership_check_us)} ({fmt(b.ownership_check_iqr_us)})",
        ]
        for b in res.boundary
    ]
    header = [
        "batch",
        "shape",
        "raw echo() us",
        "through RustBlock's full path us",
        "checked / raw (paired)",
        "donation_check us",
        "checks alone us (paired)",
    ]
    return [
        "",
        "## The boundary",
        "",
        "`echo()` crosses into Rust and back with no op: the raw binding `RustBlock._block.echo(x, context)` "
        "(unwrap, GIL release, wrap), "
        "and the same call through `RustBlock.forward`'s full path (its Python checks, taken under modes, with "
        "tensor subclasses or saved-tensor hooks; the common call's hot path is the host-cost cell's `rust/forward` - "
        "`rust/raw`). "
        "`donation_check` runs a donation's checks without the move: shapes, dtype, device and libtorch's ownership "
        "counts "
        "(rust/ownership.rs); the ownership checks cost its time minus the raw echo, paired within each round. "
        "Timed in the cells' rounds; median (IQR) over rounds:",
        "",
        table(header, rows),
    ]


def _host_cost(res: Results) -> list[str]:
    hc, ref = res.host_cost, res.reference
    if hc is None:
        return []
    sh = hc.shape
    paired = {(p.variant, p.vs): p for p in hc.paired or []}
    rows = [
        [
            f"`{r.variant}`",
            f"{fmt(r.median_ms * 1e3)} ({fmt(r.iqr_ms * 1e3)})",
            ratio_cell(paired.get((r.variant, ref))),
            r.note,
        ]
        for r in hc.rows
    ]
    md = [
        "",
        "## Host cost, where kernels cost almost nothing",
        "",
        "At the quick shapes the kernels hide what a call costs the host. Here they cost almost nothing: batch "
        f"{hc.batch}, "
        f"{sh['tokens']} tokens of width {sh['dim']} ({sh['heads']} heads of {sh['d_head']}), context "
        f"{hc.context[0]}x{hc.context[1]}, {hc.threads} intra-op thread. What is left is Python's dispatch (eager), "
        "the binding and tch (Rust), or ATen alone (C++). Timed in interleaved rounds like the cells above.",
        "",
        f"Host cost: us per call, median (IQR) over {hc.cell['rounds']} rounds; paired ratio to `{ref}`, median [Q1, "
        "Q3]:",
        "",
        table(["variant", "us per call", f"/ `{ref}` (paired)", "the time includes"], rows),
    ]
    if tch := paired.get(("rust/loop", "cpp/loop")):
        md += ["", f"The tch layer here: `rust/loop` / `cpp/loop`, paired: {ratio_cell(tch)}."]
    return md + _crossing(hc)


def _crossing(hc: HostCost) -> list[str]:
    """What RustBlock's (CppBlock's) checks and the crossing cost over the raw extension call and
    over a loop inside Rust (C++): paired differences and their budgets."""
    if not hc.differences:
        return []
    rows = [
        [
            f"`{d.variant}` - `{d.vs}`",
            f"{fmt(d.median_us)} [{fmt(d.q1_us)}, {fmt(d.q3_us)}]",
            f"<= {fmt(d.budget_us)}",
            "within" if d.within_budget else "over",
        ]
        for d in hc.differences
    ]
    return [
        "",
        "What RustBlock's checks (the watch of its last reading, the weights, the inputs) and the crossing cost: "
        "each difference is taken within a round, then summarised over the rounds.",
        "",
        "The crossing: us per call, paired difference, median [Q1, Q3], and its budget:",
        "",
        table(["difference", "us per call", "budget (us)", ""], rows),
    ]


def _unet(res: Results) -> list[str]:
    u = res.unet_step
    if u is None:
        return []
    md = ["", "## A whole UNet step", "", u.what]
    if u.rows:
        rows = [[r.name, fmt(r.median_ms), fmt(r.iqr_ms), unet_ratio_cell(r)] for r in u.rows]
        md += ["", table(["implementation", "median ms", "IQR ms", "vs eager (paired)"], rows)]
    if u.max_rel_err_rust is not None:
        md += ["", f"Rust-block UNet output vs eager: relative error {fmt(u.max_rel_err_rust)}."]
    if u.audit is not None:
        md += [f"`plusequals.audit` of the eager step: {u.audit}."]
    if u.block_share is not None:
        md += [
            f"Share of the eager step spent in the transformer blocks ({u.block_share_method}): {fmt(u.block_share)}."
        ]
    if u.skipped:
        md += ["", f"Skipped: {u.skipped}"]
    return md


AUDIT_COST = "The audit's cost on a training step"
AUDIT_COST_TABLE = "Each family's train step"  # the caption of the section's table


def audit_family_sentence(f: AuditFamily, target: float) -> str:
    """One family's verdict: the audit's and anomaly mode's paired ratios to eager, and the
    target met or missed (or why the family was not measured)."""
    audited = f.row(AUDITED)
    if audited is None:
        return f"{f.model} ({f.family}): not measured ({f.skipped or 'no rows'})."
    floor, observed = f.row(BARE), f.row(OBSERVED)
    beside = "" if floor is None else f", a dispatch mode that does nothing {step_ratio(floor)}"
    if observed is not None:
        beside += f", that mode and global module hooks that do nothing {step_ratio(observed)}"
    verdict = "met" if audited.vs_eager <= target else "missed"
    return (
        f"{f.model} ({f.family}): the audit costs {step_ratio(audited)} times an eager step, anomaly mode "
        f"{step_ratio(f.row(ANOMALY))}{beside}: {verdict}."
    )


def audit_cost_sentences(ac: AuditCost) -> list[str]:
    """What the cell says: per family, the audit's and anomaly mode's paired ratios to eager and
    the target (the audit within it) met or missed; then where the time goes."""
    measured = [f for f in ac.families if f.row(AUDITED) is not None]
    said = []
    if measured:
        met = [f.model for f in measured if f.row(AUDITED).vs_eager <= ac.target]
        missed = [f.model for f in measured if f.model not in met]
        verdicts = [f"met on {', '.join(met)}" if met else "", f"missed on {', '.join(missed)}" if missed else ""]
        said.append(
            f"`plusequals.audit(model, x, backward=True)` against its target (within {fmt(ac.target)} times an "
            f"eager train step, paired): {'; '.join(v for v in verdicts if v)}."
        )
    said += [audit_family_sentence(f, ac.target) for f in ac.families]
    if any(f.row(BARE) is not None for f in measured):
        said.append(
            "Where the time goes: a TorchDispatchMode that does nothing, over the forward alone, is the floor under "
            "any such mode (torch's Python dispatch of each aten op); the rest is the audit's own Python: a hook pair "
            "per module call, each op's outputs noted for what autograd saves, and each write's checks. In backward "
            "only the Python code that backward runs is dispatched."
        )
    over = [f.model for f in measured if (o := f.row(OBSERVED)) is not None and o.vs_eager > ac.target]
    if over:
        said.append(
            "The audit must see every op of the forward and every module call; through PyTorch's Python extension "
            "points (a TorchDispatchMode, torch's global module hooks) that alone, doing nothing, costs more than the "
            f"target on {', '.join(over)}."
        )
    return said


def _audit_cost(res: Results) -> list[str]:
    ac = res.audit_cost
    if ac is None:
        return []
    md = ["", f"## {AUDIT_COST}", ""]
    if ac.skipped:
        return md + [f"Skipped: {ac.skipped}"]
    md += [ac.what, ""]
    rows = [[f.model, r.name, fmt(r.median_ms), fmt(r.iqr_ms), unet_ratio_cell(r)] for f in ac.families for r in f.rows]
    md += [f"{AUDIT_COST_TABLE} (median over the rounds; the ratios paired within rounds):", ""]
    md += [table(["model", "step", "median ms", "IQR ms", "vs eager (paired)"], rows), ""]
    md += ["The models: " + "; ".join(f"{f.model}, {f.family}: {f.what}" for f in ac.families) + "."]
    md += ["", " ".join(audit_cost_sentences(ac))]
    found = [f"{f.model}: {f.audit}" for f in ac.families if f.audit is not None]
    if found:
        md += ["", f"What the audit found in each step: {'; '.join(found)}."]
    return md


def audit_cost_claim(data: dict) -> str:
    """The guide's sentence on the audit's cost (docs/guide/audit.md, checked against the
    committed results.json by tests/test_readme.py)."""
    ac = Results.load(data).audit_cost
    measured = [] if ac is None or ac.skipped else [f for f in ac.families if f.row(AUDITED) is not None]
    if not measured:
        return (
            "The committed CPU report predates the audit's cost cell (a train step per model family, eager beside "
            "anomaly mode and the audit): `python -m plusequals report` measures it."
        )
    steps = "; ".join(
        f"{f.model} {fmt(eager.median_ms)} ms eager, {fmt(f.row(AUDITED).median_ms)} ms through `audit()`"
        for f in measured
        if (eager := f.row(EAGER)) is not None
    )
    return f"In the committed CPU report (a train step, batch 2, one thread): {steps}. " + " ".join(
        audit_cost_sentences(ac)
    )


def _conclusions(res: Results) -> list[str]:
    rows = [
        [t.target, "-" if t.value is None else f"{fmt(t.value)} {t.unit}", fmt(t.limit), t.status, t.detail]
        for t in res.targets
    ]
    md = ["", "## Verdicts (paired ratios)", ""] + [v.text for v in verdict_items(res)]
    md += ["", "## Targets", "", table(["target", "measured", "limit", "status", "how"], rows)]
    md += ["", "## Plots", "", f"![paired ratios to {res.reference}](ratios.png)", "", RATIO_PLOT_NOTE, ""]
    md += ["![time per shape](time_per_shape.png)"]
    if res.config["device"] == "cuda":
        md.append("![peak memory](peak_memory.png)")
    else:
        md.append("(No peak-memory plot: the CPU allocator keeps no statistics.)")
    return md + ["", "Every number above is in results.json beside this file."]


def render(data: dict) -> str:
    """REPORT.md from a results.json (``data``) alone."""
    res = Results.load(data)
    md = _header(res) + _machine(res)
    for batch in res.batches:
        md += _batch(res, batch)
    md += _profile(res) + _boundary(res) + _host_cost(res) + _unet(res) + _audit_cost(res) + _conclusions(res)
    return "\n".join(md) + "\n"


# ----------------------------------------------------------------------------- plots
RATIO_PLOT_NOTE = (
    "ratios.png: each variant's paired ratio to the reference, per shape (a dot at the median, a whisker "
    "from Q1 to Q3; left of the line at 1 is faster). A hollow dot is a cell whose interval contains 1 "
    f"(marked {NOISE_MARK} in the tables)."
)


def ratio_points(res: Results, batch: int) -> list[tuple[str, str, Paired]]:
    """(variant, shape, its paired ratio to the reference) for every measured cell of ``batch``,
    variants in the order measured: what ratios.png draws."""
    ref = res.reference
    return [
        (v, sh, p)
        for v in res.variants
        if v != ref
        for sh in res.shapes
        if (p := res.paired.get((batch, sh, v, ref))) is not None
    ]


def plots(data: dict, outdir: Path) -> None:
    """ratios.png (paired ratios to the reference), time_per_shape.png (every variant, every
    batch) and, on CUDA, peak_memory.png (batch 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = Results.load(data)
    cfg, shapes, variants = res.config, res.shapes, res.variants
    fig, axes = plt.subplots(1, len(res.batches), figsize=(7 * len(res.batches), 5.5), squeeze=False)
    width = 0.8 / len(variants)
    for ax, batch in zip(axes[0], res.batches):
        for i, v in enumerate(variants):
            rows = [res.row(batch, sh, v) for sh in shapes]
            ys = [float("nan") if r is None else r.median_ms for r in rows]
            errs = [0.0 if r is None else r.iqr_ms for r in rows]
            ax.bar(
                [j + i * width for j in range(len(shapes))], ys, width, yerr=errs, label=v, color=plt.cm.tab20(i % 20)
            )
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        ax.set_yscale("log")
        ax.set_ylabel("ms per block call (median, IQR bars)")
        ax.set_title(f"{cfg['device']} {cfg['dtype']}, batch {batch}")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(outdir / "time_per_shape.png", dpi=110)
    plt.close(fig)
    _ratio_plot(res, outdir, plt)
    if cfg["device"] == "cuda":
        _memory_plot(res, outdir, plt)


def _ratio_plot(res: Results, outdir: Path, plt) -> None:
    """Who is faster, as the verdicts say it: one row per variant, one dot per shape."""
    variants = [v for v in res.variants if v != res.reference]
    shapes = res.shapes
    fig, axes = plt.subplots(
        1, len(res.batches), figsize=(6.5 * len(res.batches), 0.9 + 0.32 * len(variants)), squeeze=False
    )
    offset = {sh: (i - (len(shapes) - 1) / 2) * 0.18 for i, sh in enumerate(shapes)}
    for ax, batch in zip(axes[0], res.batches):
        for v, sh, p in ratio_points(res, batch):
            y, colour = variants.index(v) + offset[sh], plt.cm.tab10(shapes.index(sh) % 10)
            ax.plot([p.q1, p.q3], [y, y], color=colour, linewidth=1.2)
            face = "none" if p.within_noise else colour
            ax.plot([p.median], [y], "o", markersize=4.5, markerfacecolor=face, markeredgecolor=colour)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plt.FormatStrFormatter("%.2g"))
        ax.xaxis.set_minor_formatter(plt.FormatStrFormatter("%.2g"))
        ax.tick_params(axis="x", which="both", labelsize=7)
        ax.set_yticks(range(len(variants)), variants, fontsize=7)
        ax.set_ylim(len(variants) - 0.5, -0.5)
        ax.set_xlabel(f"time / {res.reference} (paired, median and IQR; < 1 is faster)")
        ax.set_title(f"{res.config['device']} {res.config['dtype']}, batch {batch}")
        ax.grid(axis="x", which="both", alpha=0.25)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=plt.cm.tab10(i % 10)) for i in range(len(shapes))]
    fig.legend(handles, [f"shape {sh}" for sh in shapes], fontsize=7, loc="upper center", ncol=len(shapes))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(outdir / "ratios.png", dpi=110)
    plt.close(fig)


def _memory_plot(res: Results, outdir: Path, plt) -> None:
    shapes = res.shapes
    fig, ax = plt.subplots(figsize=(9, 5))
    mem_variants = [v for v in res.variants if v.startswith(("eager/", "rust/forward"))]
    for i, v in enumerate(mem_variants):
        ys = [(r.peak_mb if (r := res.row(2, sh, v)) else None) or float("nan") for sh in shapes]
        ax.bar(
            [j + i * (0.8 / len(mem_variants)) for j in range(len(shapes))],
            ys,
            0.8 / len(mem_variants),
            label=v,
            color=plt.cm.tab20(i % 20),
        )
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylabel("peak MB above inputs, batch 2")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(outdir / "peak_memory.png", dpi=110)
    plt.close(fig)
