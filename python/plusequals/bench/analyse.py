"""The analysis: from a results.json's rows to what the report concludes. ``summarize`` adds the
paired ratios, drift, per-step totals, roofline floors, the same-work band and the targets to
results.json; ``compare`` sums a paired ratio up over the shapes of a batch, and
``verdict_items`` asks the report's questions with it. Every comparison is a paired ratio
(``timing.paired_ratios``) summarised by its median and quartiles over the rounds."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable, Optional

from .comparisons import Verdict, across, compare, one_cell, verdict
from .comparisons import answer as answer  # re-exported: analyse.answer is the comparisons' words
from .results import ANOMALY, AUDITED, Difference, Drift, Floor, Paired, Results, SameWork, Step, Target, Timing, fmt
from .timing import paired_differences_us, paired_ratios, spread

# Paired ratios reported besides "every variant / the reference".
# rust/loop / cpp/loop: what the tch layer costs (its C API, a heap handle per op) over ATen.
EXTRA_PAIRS = [
    ("graph/iadd", "graph/op_plus_x"),
    ("rust/forward", "rust/loop"),
    ("rust/loop", "cpp/loop"),
    ("rust/forward", "cpp/forward"),
    ("compile/iadd", "compile/op_plus_x"),  # the seed's += once Inductor has compiled both
]
# Where the report's performance targets apply: they are set for the H200.
TARGET_DEVICE = "cuda"
INFORMATIONAL = "informational: targets are for the H200, full shapes"


# ----------------------------------------------------------------------------- paired ratios
def pair_rows(ra: Optional[Timing], rb: Optional[Timing], batch: int, shape: str) -> Optional[Paired]:
    """The paired ratio of two rows of one cell (None if either is missing)."""
    if ra is None or rb is None:
        return None
    ratios = paired_ratios(ra.rounds_ms, rb.rounds_ms)
    sp = spread(ratios)
    return Paired(
        batch=batch,
        shape=shape,
        variant=ra.variant,
        vs=rb.variant,
        median=sp.median,
        q1=sp.q1,
        q3=sp.q3,
        iqr=sp.iqr,
        rounds=sp.n,
        within_noise=sp.contains(1.0),
        ratios=ratios,
    )


def pair(results: Results, batch: int, shape: str, a: str, b: str) -> Optional[Paired]:
    """``a / b`` of one cell, paired within each round, summarised over the rounds."""
    return pair_rows(results.row(batch, shape, a), results.row(batch, shape, b), batch, shape)


def paired_cells(results: Results) -> list[Paired]:
    """In every cell: each variant / the reference, and the ``EXTRA_PAIRS``."""
    ref = results.reference
    pairs = [(v, ref) for v in results.variants if v != ref] + EXTRA_PAIRS
    return [
        p
        for batch in results.batches
        for shape in results.shapes
        for a, b in pairs
        if (p := pair(results, batch, shape, a, b))
    ]


def host_cost_pairs(results: Results) -> list[Paired]:
    """The host-cost cell: each variant / the reference, and rust/loop / cpp/loop."""
    hc = results.host_cost
    if hc is None:
        return []
    by = {r.variant: r for r in hc.rows}
    pairs = [(v, results.reference) for v in by if v != results.reference] + [("rust/loop", "cpp/loop")]
    return [p for a, b in pairs if (p := pair_rows(by.get(a), by.get(b), hc.batch, hc.shape["label"]))]


def difference_rows(ra: Timing, rb: Timing, budget_us: float) -> Difference:
    """``ra - rb`` in µs per call within each round, summarised over the rounds."""
    diffs = paired_differences_us(ra.rounds_ms, rb.rounds_ms)
    sp = spread(diffs)
    return Difference(
        variant=ra.variant,
        vs=rb.variant,
        median_us=sp.median,
        q1_us=sp.q1,
        q3_us=sp.q3,
        iqr_us=sp.iqr,
        rounds=sp.n,
        budget_us=budget_us,
        within_budget=sp.median <= budget_us,
        differences_us=diffs,
    )


def host_cost_differences(results: Results) -> list[Difference]:
    """The host-cost cell's differences that the config's ``crossing_budgets`` name (``variant``,
    ``vs``, budget in µs), where the cell has both rows."""
    hc = results.host_cost
    if hc is None:
        return []
    by = {r.variant: r for r in hc.rows}
    budgets = results.config.get("crossing_budgets", [])
    return [difference_rows(by[a], by[b], us) for a, b, us in budgets if a in by and b in by]


# ----------------------------------------------------------------------------- per cell, per step
def drift(results: Results) -> list[Drift]:
    """The reference's time in each round of each cell, and its largest over its smallest."""
    out = []
    for batch in results.batches:
        for shape in results.shapes:
            if ref := results.row(batch, shape, results.reference):
                ms = ref.rounds_ms
                out.append(
                    Drift(batch=batch, shape=shape, variant=ref.variant, rounds_ms=ms, max_over_min=max(ms) / min(ms))
                )
    return out


def roofline(results: Results) -> list[Floor]:
    """Each cell's floor: its FLOPs at the measured GEMM rate or its bytes at the copy bandwidth."""
    ceil = results.ceilings
    out = []
    for batch in results.batches:
        for shape in results.shapes:
            ps = results.per_shape[batch, shape]
            floor_ms = (
                max(ps.gflop * 1e9 / (ceil["gemm_tflops"] * 1e12), ps.min_mb * 2**20 / (ceil["copy_gbps"] * 1e9)) * 1e3
            )
            out.append(Floor(batch=batch, shape=shape, roofline_ms=floor_ms))
    return out


def per_step(results: Results) -> list[Step]:
    """Each variant's transformer blocks per UNet step, at every batch where it has every shape."""
    return [step for batch in results.batches for v in results.variants if (step := _step(results, batch, v))]


def _step(results: Results, batch: int, v: str) -> Optional[Step]:
    """The sum of ``v``'s medians over one step's blocks, and (every shape paired) its ratio to
    the reference: each shape's paired ratio, weighted by its share of the reference's step."""
    shapes, blocks, ref = results.shapes, results.blocks, results.reference
    rows = [results.row(batch, sh, v) for sh in shapes]
    if any(r is None for r in rows):
        return None
    total = sum(r.median_ms * blocks[sh] for r, sh in zip(rows, shapes))
    step = Step(batch=batch, variant=v, blocks_ms_per_step=total, blocks_only_it_per_s=1e3 / total)
    ratios = {sh: p.median for sh in shapes if (p := results.paired.get((batch, sh, v, ref)))}
    if v != ref and len(ratios) < len(shapes):
        return step
    weight = {sh: results.rows[batch, sh, ref].median_ms * blocks[sh] for sh in shapes}
    return replace(step, vs_reference=sum(ratios.get(sh, 1.0) * weight[sh] for sh in shapes) / sum(weight.values()))


def same_work(results: Results, batch: int) -> SameWork:
    """The eager strategies that do op_plus_x's work, spelled differently: how far their paired
    ratios to op_plus_x stray, and in how many cells the difference is within noise."""
    cfg = results.config
    ps = [
        p
        for v in cfg["same_work"]
        for sh in results.shapes
        if (p := results.paired.get((batch, sh, v, results.reference)))
    ]
    band = cfg["same_work_band_pct"] / 100
    return SameWork(
        batch=batch,
        cells=len(ps),
        min=min(p.median for p in ps),
        max=max(p.median for p in ps),
        inside_band=sum(abs(p.median - 1) <= band for p in ps),
        within_noise=sum(p.within_noise for p in ps),
        outside_noise=[f"{p.variant} at {p.shape}" for p in ps if not p.within_noise],
    )


# ----------------------------------------------------------------------------- targets
def on_target(results: Results) -> bool:
    """Whether the run is one the targets were set for: the H200's device at SD v1 shapes."""
    return results.config["device"] == TARGET_DEVICE and not results.config["quick"]


def targets(results: Results) -> list[Target]:
    """The report's performance targets (set for the H200), each with its measured value; every
    comparison is a paired ratio (median over rounds)."""
    informational = not on_target(results)

    def target(name: str, value: Optional[float], limit: float, ok: Optional[bool], unit: str, detail: str) -> Target:
        status = "not measurable here" if ok is None else ("met" if ok else "missed")
        if ok is not None and informational:
            status += f" ({INFORMATIONAL})"
        return Target(target=name, value=value, limit=limit, unit=unit, status=status, detail=detail)

    speed = _speed_targets(results, target) + [_memory_target(results, target)]
    return speed + _boundary_targets(results, target) + _crossing_targets(results) + audit_cost_targets(results)


def audit_cost_target_name(model: str, target: float) -> str:
    return f"plusequals.audit <= {fmt(target)}x an eager train step ({model}, CPU)"


def audit_cost_targets(results: Results) -> list[Target]:
    """The audit within ``target`` times an eager train step, one target per model family of the
    audit's cost cell: met or missed on any device, since the cell runs on the CPU; not
    measurable where the family was skipped (its library is not installed)."""
    ac = results.audit_cost
    out: list[Target] = []
    for f in ac.families if ac is not None else ():
        audited, anomaly = f.row(AUDITED), f.row(ANOMALY)
        name = audit_cost_target_name(f.model, ac.target)
        if audited is None:
            why = f.skipped or "not measured"
            out.append(Target(name, None, ac.target, "x", "not measurable here", why))
            continue
        beside = "" if anomaly is None else f"; anomaly mode {fmt(anomaly.vs_eager)}"
        out.append(
            Target(
                target=name,
                value=audited.vs_eager,
                limit=ac.target,
                unit="x",
                status="met" if audited.vs_eager <= ac.target else "missed",
                detail=f"paired within rounds: median [{fmt(audited.vs_eager_q1)}, {fmt(audited.vs_eager_q3)}]{beside}",
            )
        )
    return out


def _crossing_targets(results: Results) -> list[Target]:
    """The crossing's budgets (config ``crossing_budgets``): met or missed on any device, since host
    cost is the host's."""
    out = []
    for d in host_cost_differences(results):
        out.append(
            Target(
                target=f"{d.variant} - {d.vs} <= {fmt(d.budget_us)} us (host-cost cell)",
                value=d.median_us,
                limit=d.budget_us,
                unit="us",
                status="met" if d.within_budget else "missed",
                detail=f"paired within rounds: median [{fmt(d.q1_us)}, {fmt(d.q3_us)}] over {d.rounds}",
            )
        )
    return out


Judge = Callable[[str, Optional[float], float, Optional[bool], str, str], Target]


def _worst(results: Results, batch: int, a: str, b: str, pick: Callable[[Iterable[float]], float]) -> Optional[float]:
    ps = [pair(results, batch, sh, a, b) for sh in results.shapes]
    return None if any(p is None for p in ps) else pick(p.median for p in ps)


def _speed_targets(results: Results, target: Judge) -> list[Target]:
    ref = results.reference
    # time ratios, as the verdicts give them (below 1 is faster): "2x faster" is a ratio <= 0.5
    ratio = _worst(results, 2, "rust/forward", ref, max)
    out = [
        target(
            "Rust forward's time <= 0.5x eager op_plus_x's (2x faster) at every shape (batch 2)",
            ratio,
            0.5,
            None if ratio is None else ratio <= 0.5,
            "x (worst shape)",
            "rust/forward / eager, paired",
        )
    ]
    name = "Rust forward within 1.3x of the CUDA-graph floor (batch 2)"
    over = _worst(results, 2, "rust/forward", "graph/op_plus_x", max)
    if over is not None:
        out.append(target(name, over, 1.3, over <= 1.3, "x (worst shape)", "rust/forward / graph/op_plus_x, paired"))
    else:
        out.append(target(name, None, 1.3, None, "x", "no CUDA graphs on this device"))
    b16 = _worst(results, 16, "rust/forward", ref, max)
    out.append(
        target(
            "Rust forward within 1.02x of eager at batch 16",
            b16,
            1.02,
            b16 <= 1.02,
            "x (worst shape)",
            "rust/forward / eager, paired",
        )
    )
    return out


def _memory_target(results: Results, target: Judge) -> Target:
    name = "forward_owned (donated) peak memory <= PyTorch iadd's"
    mem = [_peak_mb(results, 2, sh, "rust/forward_owned_donate") for sh in results.shapes]
    mem_iadd = [_peak_mb(results, 2, sh, "eager/iadd") for sh in results.shapes]
    if any(m is None for m in mem + mem_iadd):
        return target(name, None, 1.0, None, "x", "no allocator statistics on the CPU")
    worst = max(m / i for m, i in zip(mem, mem_iadd))
    return target(name, worst, 1.0, worst <= 1.0, "x (worst shape)", "peak MB ratio")


def _peak_mb(results: Results, batch: int, shape: str, variant: str) -> Optional[float]:
    row = results.row(batch, shape, variant)
    return None if row is None else row.peak_mb


def _boundary_targets(results: Results, target: Judge) -> list[Target]:
    checks = max(b.ownership_check_us for b in results.boundary)
    echo = max(b.echo_checked_us for b in results.boundary)
    return [
        target(
            "Ownership checks <= 2 us per call",
            checks,
            2.0,
            checks <= 2.0,
            "us (worst shape)",
            "donation_check - raw echo, paired (rust/ownership.rs: libtorch's counts, grad mode, overlap)",
        ),
        target(
            "Python -> Rust per-call overhead <= 10 us",
            echo,
            10.0,
            echo <= 10.0,
            "us (worst shape)",
            "echo() through RustBlock.forward's full path (modes, subclasses, hooks: the boundary table)",
        ),
    ]


def summarize(data: dict) -> None:
    """Paired ratios, drift, per-step totals, roofline floors, the same-work band and the
    targets, computed from the rows of ``data`` (results.json) and stored next to them."""
    results = Results.load(data)
    paired = paired_cells(results)
    results = replace(results, paired={(p.batch, p.shape, p.variant, p.vs): p for p in paired})
    data["paired"] = [p.to_json() for p in paired]
    data["drift"] = [d.to_json() for d in drift(results)]
    data["per_step"] = [s.to_json() for s in per_step(results)]
    data["step_ratios"] = [
        {"batch": batch, "variant": v, "vs": vs, "ratio": r}
        for batch in results.batches
        for v, vs in STEP_PAIRS
        if (r := step_ratio(results, batch, v, vs)) is not None
    ]
    data["roofline"] = [f.to_json() for f in roofline(results)]
    if results.host_cost is not None:
        data["host_cost"]["paired"] = [p.to_json() for p in host_cost_pairs(results)]
        data["host_cost"]["differences"] = [d.to_json() for d in host_cost_differences(results)]
    data["same_work"] = [same_work(results, batch).to_json() for batch in results.batches]
    data["targets"] = [t.to_json() for t in targets(results)]


# ----------------------------------------------------------------------------- verdicts
def verdict_items(results: Results) -> list[Verdict]:
    """The report's questions, each with its paired comparisons (``compare``) and the sentence
    REPORT.md prints; every number is a paired ratio or a count from results.json."""
    out = [v for batch in results.batches for v in _batch_verdicts(results, batch)]
    once = (_host_cost_verdict(results), _crossing_verdict(results), _compiler_verdict(results), _seed_verdict(results))
    return out + [v for v in once if v is not None]


def _batch_verdicts(results: Results, batch: int) -> list[Verdict]:
    asked = [_iadd(results, batch), _same_work(results, batch), _python(results, batch), _rust_or_tch(results, batch)]
    asked += [_launch_floor(results, batch), _graph_iadd(results, batch), _compiled_iadd(results, batch)]
    return [v for v in asked if v is not None] + _compilers(results, batch)


def _iadd(results: Results, batch: int) -> Optional[Verdict]:
    ref = results.reference
    if ia := compare(results, batch, "eager/iadd", ref):
        return verdict(
            "Is `+=` faster?", batch, [ia], f"- Is `+=` faster (batch {batch})? `eager/iadd` / `{ref}`: {across(ia)}."
        )
    return None


def _same_work(results: Results, batch: int) -> Optional[Verdict]:
    sw, cfg, ref = results.same_work.get(batch), results.config, results.reference
    if sw is None:
        return None
    strays = "; outside noise: " + ", ".join(sw.outside_noise) if sw.outside_noise else ""
    band = f"inside ±{cfg['same_work_band_pct']}%"
    return verdict(
        "Same work, spelled differently",
        batch,
        [c for v in cfg["same_work"] if (c := compare(results, batch, v, ref))],
        f"- Same work, spelled differently (batch {batch}): {', '.join(f'`{v}`' for v in cfg['same_work'])} / `{ref}`: "
        f"{fmt(sw.min)} to {fmt(sw.max)}; {band} in {sw.inside_band} of {sw.cells} cells, "
        f"within noise in {sw.within_noise} of {sw.cells}{strays}.",
        f"{band}: {sw.inside_band}/{sw.cells}; ≈ {sw.within_noise}/{sw.cells}",
    )


def _python(results: Results, batch: int) -> Optional[Verdict]:
    ref = results.reference
    rs, lp = compare(results, batch, "rust/forward", ref), compare(results, batch, "rust/loop", ref)
    if not (rs and lp):
        return None
    return verdict(
        "Is Python the bottleneck?",
        batch,
        [rs, lp],
        f"- Is Python the bottleneck (batch {batch})? `rust/forward` / `{ref}`: {across(rs)}; `rust/loop` / "
        f"`{ref}`: {across(lp)}.",
    )


def _rust_or_tch(results: Results, batch: int) -> Optional[Verdict]:
    ref = results.reference
    cf, cl = compare(results, batch, "cpp/forward", ref), compare(results, batch, "cpp/loop", ref)
    tch = compare(results, batch, "rust/loop", "cpp/loop")
    if not (cf and cl and tch):
        return None
    return verdict(
        "Rust or tch?",
        batch,
        [tch, cf, cl],
        f"- Rust or tch (batch {batch})? `cpp/forward` / `{ref}`: {across(cf)}; `cpp/loop` / `{ref}`: {across(cl)}. "
        f"The tch layer (its C API, a heap handle per op): `rust/loop` / `cpp/loop`: {across(tch)}.",
    )


def _launch_floor(results: Results, batch: int) -> Optional[Verdict]:
    ref = results.reference
    if gp := compare(results, batch, "graph/op_plus_x", ref):
        return verdict(
            "The launch-free floor",
            batch,
            [gp],
            f"- The launch-free floor (batch {batch}): `graph/op_plus_x` / `{ref}`: {across(gp)}.",
        )
    return None


def _graph_iadd(results: Results, batch: int) -> Optional[Verdict]:
    if gi := compare(results, batch, "graph/iadd", "graph/op_plus_x"):
        return verdict(
            "`+=` without launch overhead?",
            batch,
            [gi],
            f"- `+=` without launch overhead (batch {batch}): `graph/iadd` / `graph/op_plus_x`: {across(gi)}.",
        )
    return None


def _compiled_iadd(results: Results, batch: int) -> Optional[Verdict]:
    if ci := compare(results, batch, "compile/iadd", "compile/op_plus_x"):
        return verdict(
            "Is `+=` faster compiled?",
            batch,
            [ci],
            f"- Is `+=` faster once torch.compile (Inductor) has compiled both (batch {batch})? "
            f"`compile/iadd` / `compile/op_plus_x`: {across(ci)}.",
        )
    return None


def _compilers(results: Results, batch: int) -> list[Verdict]:
    ref = results.reference
    names = ("compile/op_plus_x", "compile/default", "compile/reduce-overhead")  # compile/default: older reports
    cps = [c for name in names if (c := compare(results, batch, name, ref))]
    return [
        verdict(
            "Should a compiler do it?",
            batch,
            [cp],
            f"- Should a compiler do it (batch {batch})? `{cp.variant}` / `{ref}`: {across(cp)}.",
        )
        for cp in cps
    ]


def _host_cost_verdict(results: Results) -> Optional[Verdict]:
    hc = results.host_cost
    if hc is None:
        return None
    cs = [one_cell(p) for p in hc.paired or []]
    us = {r.variant: r.median_ms * 1e3 for r in hc.rows}
    where = f"batch {hc.batch}, {hc.shape['label']}, {hc.threads} thread"
    return verdict(
        "Is Python the bottleneck where kernels cost almost nothing?",
        hc.batch,
        cs,
        f"- Is Python the bottleneck where kernels cost almost nothing ({where})? "
        + "; ".join(f"`{c.variant}` / `{c.vs}`: {fmt(c.lo)} [{fmt(c.q1)}, {fmt(c.q3)}]" for c in cs)
        + ".",
        f"{where}, µs per call: " + ", ".join(f"`{v}` {fmt(t)}" for v, t in us.items()),
    )


def _crossing_verdict(results: Results) -> Optional[Verdict]:
    diffs = host_cost_differences(results)
    if not diffs:
        return None
    said = "; ".join(
        f"`{d.variant}` - `{d.vs}` {fmt(d.median_us)} [{fmt(d.q1_us)}, {fmt(d.q3_us)}] µs "
        f"({'within' if d.within_budget else 'over'} {fmt(d.budget_us)})"
        for d in diffs
    )
    return verdict(
        "What do RustBlock's checks and the crossing cost per call?",
        results.host_cost.batch,
        [],
        f"- What do RustBlock's checks and the crossing cost per call (the host-cost cell, paired within rounds)? "
        f"{said}.",
        said,
    )


# Where Inductor's code stores the last residual sum (bench.inductor's destinations), in words.
INTO = {"caller's x": "the caller's x", "reused buffer": "a buffer it reused", "new buffer": "a new buffer"}


def _compiler_verdict(results: Results) -> Optional[Verdict]:
    cv = results.compiler_verdict
    if not cv:
        return None
    in_place = ", ".join(f"`{v}`" for v in cv.get("in_place", [])) or "none"
    reuse = ", ".join(f"`{v}`" for v in cv.get("reuses_buffers", [])) or "none"
    code = [
        f"`{name}` stores the last sum into {INTO.get(row['residual_destination'], row['residual_destination'])} "
        f"(`{row['kernel']}`)"
        for name, row in cv.get("rows", {}).items()
        if row.get("residual_destination")
    ]
    inductor = f" Inductor's generated code: {'; '.join(code)}." if code else ""
    return verdict(
        "Which compiler makes the residual add in place?",
        cv["batch"],
        [],
        f"- Which compiler turns `x = op(norm(x)) + x` into an in-place add (measured at batch {cv['batch']}, "
        f"{cv['shape']})? "
        f"Output written into x's own buffer: {in_place}. Residual sums into buffers the plan already held: {reuse}."
        + inductor,
        f"writes into x's buffer: {in_place}; reuses its own buffers: {reuse} ({cv['shape']})",
    )


# The per-step ratios the verdicts quote besides those to the reference (Step.vs_reference):
# stored in results.json's step_ratios, as every number of REPORT.md is.
STEP_PAIRS = (("compile/iadd", "compile/op_plus_x"),)


def step_ratio(results: Results, batch: int, v: str, vs: str) -> Optional[float]:
    """``v / vs`` for one UNet step's blocks: each shape's paired ratio weighted by its share of
    ``vs``'s step (None unless every shape has the pair)."""
    shapes, blocks = results.shapes, results.blocks
    ps = [results.paired.get((batch, sh, v, vs)) for sh in shapes]
    rows = [results.rows.get((batch, sh, vs)) for sh in shapes]
    if any(p is None for p in ps) or any(r is None for r in rows):
        return None
    weight = [r.median_ms * blocks[sh] for r, sh in zip(rows, shapes)]
    return sum(p.median * w for p, w in zip(ps, weight)) / sum(weight)


def _seed_verdict(results: Results) -> Optional[Verdict]:
    step, seed, ref = results.per_step.get((2, "eager/iadd")), results.config["seed_claim"], results.reference
    if step is None or step.vs_reference is None:
        return None
    compiled = step_ratio(results, 2, "compile/iadd", "compile/op_plus_x")
    also = "" if compiled is None else f"; compiled, `compile/iadd` / `compile/op_plus_x` per step: {fmt(compiled)}"
    return verdict(
        "The seed's ~7%?",
        2,
        [],
        f'- The seed\'s "{fmt(seed["before_it_per_s"])} -> {fmt(seed["after_it_per_s"])} it/s" '
        f"(~{fmt(seed['speedup_pct'])}%) "
        f"is a step time ratio of {fmt(seed['step_time_ratio'])}. For the blocks alone at batch 2, `eager/iadd` / "
        f"`{ref}` per step, "
        f"paired: {fmt(step.vs_reference)}{also}.",
        f"claimed step ratio {fmt(seed['step_time_ratio'])}; blocks per step here, `eager/iadd` / `{ref}`: "
        f"{fmt(step.vs_reference)}{also}",
    )
