"""`python -m plusequals report --quick --device cpu`: files; every cell timed in seeded,
shuffled rounds; times and paired ratios recomputable from the raw rounds; each REPORT.md table
cell checked against its own row and column of results.json; results written as they come."""

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from conftest import SMOKE_REPORT, examples
from plusequals.bench import measure, timing
from plusequals.bench.results import NUMBER, fmt
from plusequals.bench.setup import HOST_THREADS
from plusequals.bench.variants import HOST_VARIANTS
from support.report_tokens import tokens


def test_a_smoke_run_says_so_and_a_real_run_keeps_its_rounds(quick_report_run):
    """The tests' report is a smoke run (conftest's QUICK_REPORT): its fewest rounds, with no
    extra, are written down, REPORT.md and the summary say what it is; a plan without --smoke has
    the real budgets."""
    out = quick_report_run.out
    cfg = json.loads((out / "results.json").read_text())["config"]
    assert cfg["smoke"] is True and cfg["rounds"] == cfg["max_rounds"] == timing.SMOKE_ROUNDS
    assert cfg["extra_rounds_s"] == 0 and cfg["sample_s"] == timing.SMOKE_SAMPLE_S
    assert cfg["host_rounds"] == cfg["host_max_rounds"] == timing.SMOKE_ROUNDS
    assert "**A smoke run** (`--smoke`)" in (out / "REPORT.md").read_text()
    assert json.loads(quick_report_run.stdout)["smoke"] is True
    for device, quick in (("cpu", True), ("cpu", False), ("cuda", False)):
        real = measure.plan(device, quick, compilers_flag=False)
        assert not real.smoke and real.rounds >= 5 and real.max_rounds == 3 * real.rounds
        assert real.extra_s > 0 and real.sample_s > timing.SMOKE_SAMPLE_S
        host = measure.host_rounds(real)
        assert host[0] >= measure.HOST_MIN_ROUNDS and host[1] == 3 * host[0]


def test_writes_report_results_and_plots(quick_report):
    assert (quick_report / "REPORT.md").stat().st_size > 1000
    assert (quick_report / "time_per_shape.png").stat().st_size > 10_000
    assert (quick_report / "ratios.png").stat().st_size > 10_000
    assert "![paired ratios to eager/op_plus_x](ratios.png)" in (quick_report / "REPORT.md").read_text()
    data = json.loads((quick_report / "results.json").read_text())
    assert data["complete"] is True
    variants = {r["variant"] for r in data["results"]}
    for v in ["eager/op_plus_x", "eager/iadd", "eager/iadd_clone", "eager/first_out_of_place", "eager/copy_iadd",
              "eager/preallocated", "eager/x_plus_op", "rust/forward", "rust/forward_owned", "cpp/forward", "cpp/loop",
              "rust/forward_owned_donate", "rust/loop"]:  # fmt: skip
        assert v in variants
    compiled = {v for v in variants if v.startswith("compile/")}  # timed at torch_compile_batches only
    at = data["config"]["torch_compile_batches"] or []
    per_batch = {b: len(variants - compiled) + len(compiled) * (b in at) for b in data["config"]["batches"]}
    assert len(data["results"]) == sum(per_batch.values()) * len(data["config"]["shapes"])
    for r in data["results"]:
        assert r["median_ms"] > 0 and r["iqr_ms"] >= 0 and len(r["rounds_ms"]) == r["rounds"], r
        assert r["rounds"] >= data["config"]["rounds"], r
    assert data["ceilings"]["gemm_tflops"] > 0 and data["ceilings"]["copy_gbps"] > 0
    assert {t["target"] for t in data["targets"]} and all(t["status"] for t in data["targets"])


# ----------------------------------------------------------------------------- rounds in results.json
def test_every_cell_was_timed_in_seeded_shuffled_rounds(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    cells = data["cells"]
    assert len(cells) == len(data["config"]["shapes"]) * len(data["config"]["batches"])
    assert len({c["seed"] for c in cells}) == len(cells)
    for c in cells:
        probes = set(c["raw_ms"])
        assert data["config"]["max_rounds"] >= c["rounds"] >= data["config"]["rounds"] >= timing.SMOKE_ROUNDS
        assert len(c["orders"]) == c["rounds"] and all(set(o) == probes and len(o) == len(probes) for o in c["orders"])
        assert len({tuple(o) for o in c["orders"]}) > 1, "one order for every round: not shuffled"
        assert (
            c["orders"]
            == timing.shuffled_orders(list(c["raw_ms"]), data["config"]["max_rounds"], c["seed"])[: c["rounds"]]
        )
        assert all(len(ts) == c["rounds"] for ts in c["raw_ms"].values())
        assert {
            "echo",
            "echo_checked",
            "eager/op_plus_x",
            "reset:eager/iadd",
            "reset:rust/forward_owned_donate",
        } <= probes


def test_times_and_ratios_are_recomputable_from_the_raw_rounds(quick_report):
    """Each row's per-round times are its raw samples less its reset's sample from the same round
    (divided by the forwards per call); its median and IQR are theirs; each paired ratio is the
    median of the per-round ratios."""
    data = json.loads((quick_report / "results.json").read_text())
    cells = {(c["batch"], c["shape"]): c for c in data["cells"]}
    rows = {(r["batch"], r["shape"], r["variant"]): r for r in data["results"]}
    for r in data["results"]:
        raw = cells[r["batch"], r["shape"]]["raw_ms"]
        reset = raw[r["reset_probe"]] if r["reset_probe"] else [0.0] * r["rounds"]
        want = [(t - z) / r["forwards_per_call"] for t, z in zip(raw[r["variant"]], reset)]
        assert r["rounds_ms"] == pytest.approx(want)
        q1, q3 = np.quantile(want, [0.25, 0.75])
        assert (r["median_ms"], r["iqr_ms"]) == pytest.approx((np.median(want), q3 - q1))
    assert data["paired"]
    for p in data["paired"]:
        a, b = rows[p["batch"], p["shape"], p["variant"]], rows[p["batch"], p["shape"], p["vs"]]
        ratios = np.array(a["rounds_ms"]) / np.array(b["rounds_ms"])
        q1, q3 = np.quantile(ratios, [0.25, 0.75])
        assert (p["median"], p["q1"], p["q3"]) == pytest.approx((np.median(ratios), q1, q3))
        assert p["within_noise"] == (q1 <= 1 <= q3)


def test_the_host_cost_cell_ran_on_one_thread_at_the_tiny_shape_in_seeded_rounds(quick_report):
    """batch 1, 4 tokens x width 32, one intra-op thread: every variant of HOST_VARIANTS
    the device has, in shuffled rounds whose times and paired ratios recompute from the raw
    samples; and the thread count is restored for what follows."""
    data = json.loads((quick_report / "results.json").read_text())
    hc = data["host_cost"]
    assert (hc["batch"], hc["shape"]["label"], hc["context"], hc["threads"]) == (1, "4x32", [4, 32], 1)
    cell = hc["cell"]
    assert {r["variant"] for r in hc["rows"]} == set(HOST_VARIANTS) - {"graph/op_plus_x"}  # no CUDA graphs on the CPU
    assert (
        cell["orders"]
        == timing.shuffled_orders(list(cell["raw_ms"]), data["config"]["host_max_rounds"], cell["seed"])[
            : cell["rounds"]
        ]
    )
    assert data["config"]["host_max_rounds"] >= cell["rounds"] >= data["config"]["host_rounds"] >= timing.SMOKE_ROUNDS
    assert cell["seed"] not in {c["seed"] for c in data["cells"]}
    rows = {r["variant"]: r for r in hc["rows"]}
    for r in hc["rows"]:
        reset = cell["raw_ms"].get(f"reset:{r['variant']}", [0.0] * cell["rounds"])
        per_call = hc["rust_loop_n"] if "/loop" in r["variant"] else 1
        assert r["forwards_per_call"] == per_call
        assert r["rounds_ms"] == pytest.approx(
            [(t - z) / per_call for t, z in zip(cell["raw_ms"][r["variant"]], reset)]
        )
    for p in hc["paired"]:
        ratios = np.array(rows[p["variant"]]["rounds_ms"]) / np.array(rows[p["vs"]]["rounds_ms"])
        assert p["median"] == pytest.approx(np.median(ratios))
    assert {(p["variant"], p["vs"]) for p in hc["paired"]} >= {
        ("rust/forward", "eager/op_plus_x"),
        ("cpp/loop", "eager/op_plus_x"),
        ("rust/loop", "cpp/loop"),
    }


def test_the_crossing_differences_recompute_from_the_rounds_and_are_judged_by_their_budgets(quick_report):
    """Each budgeted difference (config crossing_budgets) is the per-round difference of its two
    rows in µs, summarised by median and quartiles; its target says met exactly when the median
    is within the budget."""
    data = json.loads((quick_report / "results.json").read_text())
    hc = data["host_cost"]
    rows = {r["variant"]: r for r in hc["rows"]}
    budgets = {(a, b): us for a, b, us in data["config"]["crossing_budgets"]}
    assert {(d["variant"], d["vs"]) for d in hc["differences"]} == set(budgets)
    assert ("rust/forward", "rust/raw") in budgets and ("cpp/forward", "cpp/loop") in budgets
    targets = {t["target"]: t for t in data["targets"]}
    for d in hc["differences"]:
        want = (np.array(rows[d["variant"]]["rounds_ms"]) - np.array(rows[d["vs"]]["rounds_ms"])) * 1e3
        q1, q3 = np.quantile(want, [0.25, 0.75])
        assert d["differences_us"] == pytest.approx(want.tolist())
        assert (d["median_us"], d["q1_us"], d["q3_us"]) == pytest.approx((np.median(want), q1, q3))
        assert d["budget_us"] == budgets[d["variant"], d["vs"]]
        assert d["within_budget"] == (d["median_us"] <= d["budget_us"])
        t = targets[f"{d['variant']} - {d['vs']} <= {fmt(d['budget_us'])} us (host-cost cell)"]
        assert t["value"] == d["median_us"] and t["status"] == ("met" if d["within_budget"] else "missed")


def test_the_host_cost_cell_settles_on_the_crossing_differences():
    """The stop rule asks for more rounds while a budgeted difference's IQR is wider than allowed,
    and ignores pairs the cell does not time."""
    from plusequals.bench.variants import Variant, differences_settled

    a, b = Variant("a", "rust", lambda: None, ""), Variant("b", "rust", lambda: None, "")
    rule = differences_settled([a, b], [("a", "b", 3.0), ("a", "missing", 5.0)], max_iqr_us=1.0)
    steady = {"a": [0.010, 0.0101, 0.0099, 0.010], "b": [0.008, 0.0081, 0.0079, 0.008]}  # 2 µs apart each round
    noisy = {"a": [0.010, 0.014, 0.009, 0.016], "b": [0.008, 0.008, 0.008, 0.008]}
    assert rule(steady) and not rule(noisy)


def test_the_host_cost_cell_times_on_one_thread_and_restores_the_count(monkeypatch):
    from plusequals.bench import measure

    seen = []
    real = timing.interleaved_rounds

    def spy(*args, **kw):
        seen.append(torch.get_num_threads())
        return real(*args, **kw)

    monkeypatch.setattr(timing, "interleaved_rounds", spy)
    before = torch.get_num_threads()
    hc = measure.host_cost("cpu", torch.float32, rounds=3, max_rounds=3, extra_s=0.0, sample_s=0.002, seed=7)
    assert seen == [HOST_THREADS] and torch.get_num_threads() == before
    assert hc["cell"]["rounds"] == 3 and len(hc["rows"]) == len(HOST_VARIANTS) - 1


# ----------------------------------------------------------------------------- REPORT.md, cell by cell
def tables(md: str) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """Every markdown table: (section heading, the line of text just above it, header, rows)."""
    out, heading, caption = [], "", ""
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append([c.strip() for c in lines[i].strip().strip("|").split(" | ")])
                i += 1
            out.append((heading, caption, block[0], block[2:]))
            continue
        if lines[i].startswith("#"):
            heading = caption = lines[i].lstrip("# ")
        elif lines[i].strip():
            caption = lines[i]
        i += 1
    return out


def _ratio(median: float, q1: float, q3: float) -> str:
    return f"{fmt(median)} [{fmt(q1)}, {fmt(q3)}]" + (" ≈" if q1 <= 1 <= q3 else "")


class Seen:
    """One row of a REPORT.md table, with what its cells are looked up by in results.json."""

    def __init__(self, data: dict, heading: str, caption: str, header: list[str], row: list[str]) -> None:
        self.data, self.heading, self.caption, self.header, self.row = data, heading, caption, header, row
        self.label = row[0].strip("`")
        self.batch = int(m.group(1)) if (m := re.search(r"batch (\d+)", caption)) else None
        self.rows = {(r["batch"], r["shape"], r["variant"]): r for r in data["results"]}
        self.paired = {(p["batch"], p["shape"], p["variant"], p["vs"]): p for p in data["paired"]}
        self.ref = data["config"]["reference"]


def _environment(s: Seen) -> list[str]:
    return [s.label, str(s.data["environment"][s.label])]


def _ceilings(s: Seen) -> list[str]:
    c = s.data["ceilings"]
    return [fmt(c["gemm_n"]), fmt(c["gemm_tflops"]), fmt(c["copy_mib"]), fmt(c["copy_gbps"])]


def _medians(s: Seen) -> list[str]:
    shapes, batch, row = s.header[1:-1], s.batch, s.row
    if s.label == "rounds":
        n = {(c["batch"], c["shape"]): c["rounds"] for c in s.data["cells"]}
        return [row[0]] + [str(n[batch, sh]) for sh in shapes] + ["samples behind each cell of this column"]
    if s.label == "roofline floor":
        floor = {(f["batch"], f["shape"]): f["roofline_ms"] for f in s.data["roofline"]}
        return [row[0]] + [fmt(floor[batch, sh]) for sh in shapes] + ["GEMM rate and copy bandwidth above"]
    cells = [s.rows[batch, sh, s.label] for sh in shapes]
    return [row[0]] + [f"{fmt(r['median_ms'])} ({fmt(r['iqr_ms'])})" for r in cells] + [cells[0]["note"]]


def _ratios_to_reference(s: Seen) -> list[str]:
    quartiles = (s.paired[s.batch, sh, s.label, s.ref] for sh in s.header[1:])
    return [s.row[0]] + [_ratio(p["median"], p["q1"], p["q3"]) for p in quartiles]


def _other_ratios(s: Seen) -> list[str]:
    a, b = (x.strip("`") for x in s.row[0].split(" / "))
    quartiles = (s.paired[s.batch, sh, a, b] for sh in s.header[1:])
    return [s.row[0]] + [_ratio(p["median"], p["q1"], p["q3"]) for p in quartiles]


def _drift(s: Seen) -> list[str]:
    ms = s.rows[s.batch, s.label, s.ref]["rounds_ms"]
    return [s.label, ", ".join(fmt(t) for t in ms), fmt(max(ms) / min(ms))]


def _per_unet_step(s: Seen) -> list[str]:
    blocks = {sh["label"]: sh["blocks"] for sh in s.data["config"]["shapes"]}
    total = sum(s.rows[s.batch, sh, s.label]["median_ms"] * n for sh, n in blocks.items())
    weight = {sh: s.rows[s.batch, sh, s.ref]["median_ms"] * n for sh, n in blocks.items()}
    ratio = {sh: 1.0 if s.label == s.ref else s.paired[s.batch, sh, s.label, s.ref]["median"] for sh in blocks}
    weighted = sum(ratio[sh] * weight[sh] for sh in blocks) / sum(weight.values())
    return [s.row[0], fmt(total), fmt(1e3 / total), fmt(weighted)]


def _peak_memory(s: Seen) -> list[str]:
    out = [s.row[0]]
    for sh in s.header[1:]:
        r = s.rows[s.batch, sh, s.label]
        pk, host = r.get("peak_mb"), r.get("host_ms")
        out.append(f"{fmt(pk) if pk is not None else '-'} MB / {fmt(host) if host is not None else '-'} ms")
    return out


def _profile(s: Seen) -> list[str]:
    row = s.row
    p = next(p for p in s.data["profile"] if (str(p["batch"]), p["shape"], f"`{p['variant']}`") == tuple(row[:3]))
    cuda = "-" if p["self_cuda_ms_per_call"] is None else fmt(p["self_cuda_ms_per_call"])
    top = ", ".join(f"{t['op'][6:]} {fmt(t['ms_per_call'])}" for t in p["top"][:3])
    return row[:3] + [fmt(p["aten_ops_per_call"]), fmt(p["self_cpu_ms_per_call"]), cuda, top]


def _host_cost(s: Seen) -> list[str]:
    hc = s.data["host_cost"]
    r = next(r for r in hc["rows"] if r["variant"] == s.label)
    p = next((p for p in hc["paired"] if (p["variant"], p["vs"]) == (s.label, s.ref)), None)
    ratio = "-" if p is None else _ratio(p["median"], p["q1"], p["q3"])
    return [s.row[0], f"{fmt(r['median_ms'] * 1e3)} ({fmt(r['iqr_ms'] * 1e3)})", ratio, r["note"]]


def _crossing(s: Seen) -> list[str]:
    a, b = (x.strip("`") for x in s.row[0].split(" - "))
    d = next(d for d in s.data["host_cost"]["differences"] if (d["variant"], d["vs"]) == (a, b))
    return [
        s.row[0],
        f"{fmt(d['median_us'])} [{fmt(d['q1_us'])}, {fmt(d['q3_us'])}]",
        f"<= {fmt(d['budget_us'])}",
        "within" if d["within_budget"] else "over",
    ]


def _boundary(s: Seen) -> list[str]:
    b = next(b for b in s.data["boundary"] if (str(b["batch"]), b["shape"]) == tuple(s.row[:2]))
    return s.row[:2] + [
        f"{fmt(b['echo_us'])} ({fmt(b['echo_iqr_us'])})",
        f"{fmt(b['echo_checked_us'])} ({fmt(b['echo_checked_iqr_us'])})",
        fmt(b["checked_over_echo"]),
        f"{fmt(b['donation_check_us'])} ({fmt(b['donation_check_iqr_us'])})",
        f"{fmt(b['ownership_check_us'])} ({fmt(b['ownership_check_iqr_us'])})",
    ]


def _against_eager(section: str):
    """A table of whole steps (a UNet step), each against eager's."""

    def expected(s: Seen) -> list[str]:
        u = next(u for u in s.data[section]["rows"] if u["name"] == s.row[0])
        vs = "reference" if u["name"] == "eager" else _ratio(u["vs_eager"], u["vs_eager_q1"], u["vs_eager_q3"])
        return [u["name"], fmt(u["median_ms"]), fmt(u["iqr_ms"]), vs]

    return expected


def _audit_cost(s: Seen) -> list[str]:
    """The audit's cost: a row per (model family, step), each step against that family's eager."""
    family = next(f for f in s.data["audit_cost"]["families"] if f["model"] == s.row[0])
    u = next(u for u in family["rows"] if u["name"] == s.row[1])
    vs = "reference" if u["name"] == "eager" else _ratio(u["vs_eager"], u["vs_eager_q1"], u["vs_eager_q3"])
    return [family["model"], u["name"], fmt(u["median_ms"]), fmt(u["iqr_ms"]), vs]


def _targets(s: Seen) -> list[str]:
    t = next(t for t in s.data["targets"] if t["target"] == s.row[0])
    value = "-" if t["value"] is None else f"{fmt(t['value'])} {t['unit']}"
    return [t["target"], value, fmt(t["limit"]), t["status"], t["detail"]]


# Which table a row is in, first match wins (by its section heading or the line above it), and
# how its cells are derived from results.json.
TABLES = [
    (lambda s: s.heading == "Environment", _environment),
    (lambda s: s.heading.startswith("Ceilings"), _ceilings),
    (lambda s: s.caption.startswith("Median ms (IQR ms)"), _medians),
    (lambda s: s.caption.startswith(f"Paired ratio to `{s.ref}`"), _ratios_to_reference),
    (lambda s: s.caption.startswith("Other paired ratios"), _other_ratios),
    (lambda s: s.caption.startswith("Drift"), _drift),
    (lambda s: s.caption.startswith("Per UNet step"), _per_unet_step),
    (lambda s: s.caption.startswith("Peak memory"), _peak_memory),
    (lambda s: s.heading.startswith("Where the time goes"), _profile),
    (lambda s: s.caption.startswith("Host cost"), _host_cost),
    (lambda s: s.caption.startswith("The crossing"), _crossing),
    (lambda s: s.heading == "The boundary", _boundary),
    (lambda s: s.heading == "A whole UNet step", _against_eager("unet_step")),
    (lambda s: s.heading == "The audit's cost on a training step", _audit_cost),
    (lambda s: s.heading == "Targets", _targets),
]


def expected_row(data: dict, heading: str, caption: str, header: list[str], row: list[str]) -> list[str]:
    """The row REPORT.md should show, looked up in results.json by this row's own label(s) and the
    table's column labels (KeyError / StopIteration: the row should not be there)."""
    seen = Seen(data, heading, caption, header, row)
    for matches, expected in TABLES:
        if matches(seen):
            return expected(seen)
    raise AssertionError(f"a table no check knows: {heading!r} / {caption!r}")


def misplaced_cells(md: str, data: dict) -> list[str]:
    """Every table cell of REPORT.md that differs from its own row and column in results.json."""
    bad = []
    for heading, caption, header, rows in tables(md):
        for row in rows:
            try:
                want = expected_row(data, heading, caption, header, row)
            except (KeyError, StopIteration) as e:
                bad.append(f"{caption}: row {row[0]} is in no results.json entry ({e!r})")
                continue
            bad += [
                f"{caption}: row {row[0]}, column {h}: {got!r}, results.json says {w!r}"
                for h, got, w in zip(header, row, want)
                if got != w
            ]
            if len(row) != len(want):
                bad.append(f"{caption}: row {row[0]} has {len(row)} cells, not {len(want)}")
    return bad


def test_every_table_cell_matches_its_row_and_column_in_results_json(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    md = (quick_report / "REPORT.md").read_text()
    found = tables(md)
    captions = " ".join(f"{h} {c}" for h, c, _, _ in found)
    for must in (
        "Median ms (IQR ms)",
        "Paired ratio to",
        "Drift",
        "Per UNet step",
        "The boundary",
        "Host cost: us per call",
        "The crossing: us per call",
        "The audit's cost on a training step",
        "Targets",
    ):
        assert must in captions, must
    for _, caption, _, rows in found:
        if caption.startswith(("Median ms", "Per UNet step")):
            batch = int(re.search(r"batch (\d+)", caption).group(1))
            # every variant timed at this batch (the quick CPU run compiles at batch 2 only)
            variants = {f"`{r['variant']}`" for r in data["results"] if r["batch"] == batch}
            assert {r[0] for r in rows} - {"roofline floor", "rounds"} == variants, caption
    assert misplaced_cells(md, data) == []


def test_the_cell_check_catches_a_swapped_or_invented_cell(quick_report):
    data = json.loads((quick_report / "results.json").read_text())
    md = (quick_report / "REPORT.md").read_text()
    lines = md.splitlines()
    a = next(i for i, line in enumerate(lines) if line.startswith("| `rust/forward` |"))
    b = next(i for i, line in enumerate(lines) if line.startswith("| `eager/op_plus_x` |"))
    cells_a, cells_b = lines[a].split(" | "), lines[b].split(" | ")
    col = next(j for j in range(1, len(cells_a) - 1) if cells_a[j] != cells_b[j])  # a shape column where they differ
    swapped = list(lines)
    swapped[a] = " | ".join(cells_a[:col] + [cells_b[col]] + cells_a[col + 1 :])
    swapped[b] = " | ".join(cells_b[:col] + [cells_a[col]] + cells_b[col + 1 :])
    assert len(misplaced_cells("\n".join(swapped), data)) == 2
    invented = list(lines)
    invented[a] = " | ".join(cells_a[:col] + ["3.14 (0.159)"] + cells_a[col + 1 :])
    assert len(misplaced_cells("\n".join(invented), data)) == 1


def test_every_number_outside_the_tables_is_in_results_json(quick_report):
    """The prose (method, verdicts, notes) has no row and column: its numbers must at least be
    numbers results.json holds."""
    data = json.loads((quick_report / "results.json").read_text())
    allowed = tokens(data, set())
    prose = "\n".join(
        line for line in (quick_report / "REPORT.md").read_text().splitlines() if not line.startswith("|")
    )
    stray = [n for n in NUMBER.findall(prose) if n not in allowed]
    assert not stray, f"numbers in REPORT.md not in results.json: {sorted(set(stray))[:20]}"


def test_the_seed_verdicts_compiled_step_ratio_is_the_one_results_json_holds(quick_report):
    """A per-step ratio the prose computes (compile/iadd / compile/op_plus_x, weighted over one
    step's blocks) is stored too: the check above passed only where it happened to equal another
    stored number."""
    data = json.loads((quick_report / "results.json").read_text())
    (stored,) = [
        r
        for r in data["step_ratios"]
        if (r["batch"], r["variant"], r["vs"]) == (2, "compile/iadd", "compile/op_plus_x")
    ]
    assert (
        f"`compile/iadd` / `compile/op_plus_x` per step: {fmt(stored['ratio'])}."
        in (quick_report / "REPORT.md").read_text()
    )


def test_the_report_says_what_each_time_includes_and_how_noisy_the_machine_was(quick_report):
    md = (quick_report / "REPORT.md").read_text()
    row = {}  # each variant's first row: the time table of batch 2
    for line in md.splitlines():
        if line.startswith("| `"):
            row.setdefault(line.split(" | ")[0][2:], line)
    for v in ("eager/iadd", "eager/iadd_clone", "eager/copy_iadd", "rust/forward_owned_donate"):
        assert "subtracted" in row[f"`{v}`"], v
    assert "copy is included" in row["`rust/forward_owned`"]
    assert "Drift: `eager/op_plus_x` in each round" in md
    assert "through `RustBlock.forward`'s full path" in md and "The crossing: us per call" in md
    assert "within noise" in md


def test_results_are_written_as_they_come(tmp_path):
    """Interrupt a run once it has measured something: results.json holds those rows. The run is
    --quiet: until it ends it prints nothing at all. Without the sections that compile (the
    first cell's torch.compile, JAX and ONNX Runtime), whose set-up comes before its first rows."""
    proc = subprocess.Popen(
        [
            *SMOKE_REPORT,
            "--out",
            str(tmp_path),
            "--no-unet",
            "--no-compile",
            "--no-compilers",
            "--no-audit-cost",
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    path = tmp_path / "results.json"
    try:
        while proc.poll() is None:  # until it has measured three rows (pytest-timeout bounds a hang)
            if path.exists():
                try:
                    rows = json.loads(path.read_text()).get("results", [])
                except json.JSONDecodeError:  # pragma: no cover - replaced atomically
                    rows = []
                if len(rows) >= 3:
                    break
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        printed = proc.communicate()
    assert printed == (b"", b""), printed
    data = json.loads(path.read_text())
    assert data["complete"] is False
    assert len(data["results"]) >= 3


def test_the_ratio_figure_draws_every_paired_ratio_to_the_reference():
    """ratios.png's points are exactly results.json's paired ratios to the reference, batch by
    batch (the committed CPU report), with the noise mark where the IQR contains 1."""
    from pathlib import Path

    from plusequals.bench.render import ratio_points
    from plusequals.bench.results import Results

    data = json.loads((Path(__file__).resolve().parents[1] / "docs/report-cpu/results.json").read_text())
    res = Results.load(data)
    ref = res.reference
    for batch in res.batches:
        drawn = {(v, sh): p for v, sh, p in ratio_points(res, batch)}
        stored = [p for p in data["paired"] if p["batch"] == batch and p["vs"] == ref]
        assert stored and len(drawn) == len(stored)
        for p in stored:
            point = drawn[(p["variant"], p["shape"])]
            assert (point.median, point.q1, point.q3) == (p["median"], p["q1"], p["q3"])
            assert point.within_noise == (p["q1"] <= 1.0 <= p["q3"])


def test_the_audit_cost_section_says_met_or_missed_as_its_numbers_do():
    """The audit's cost cell in words (REPORT.md and the guide's sentence): per model family, the
    audit's, anomaly mode's and the two floors' paired ratios, and the target met exactly when the
    audit's median is within it; a skipped family is said to be, and its target is not measurable.
    The families whose floor of observing alone (a dispatch mode and module hooks that do nothing)
    is over the target are named, exactly those."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from plusequals.bench.analyse import audit_cost_targets
    from plusequals.bench.audit_cost import FAMILIES
    from plusequals.bench.render import audit_cost_claim, audit_cost_sentences
    from plusequals.bench.results import AUDIT_PROBES, AuditCost, AuditFamily, AuditRow, Results

    def row(name: str, ratio: float) -> AuditRow:
        return AuditRow(name, 60.0 * ratio, 1.0, ratio, ratio - 0.05, ratio + 0.05, ratio - 0.05 <= 1 <= ratio + 0.05)

    ratios = st.tuples(st.floats(1.0, 2.0), st.floats(1.0, 2.0), st.floats(1.0, 1.2), st.floats(1.0, 1.5))

    @settings(max_examples=examples(40), deadline=None)
    @given(st.lists(st.one_of(st.none(), ratios), min_size=len(FAMILIES), max_size=len(FAMILIES)))
    def check(measured: list) -> None:
        families = [
            AuditFamily(f.family, f.model, f.what, skipped="not installed")
            if m is None
            else AuditFamily(
                f.family, f.model, f.what, [row(n, r) for n, r in zip(AUDIT_PROBES, (1.0, m[1], m[0], *m[2:]))]
            )
            for f, m in zip(FAMILIES, measured)
        ]
        cell = AuditCost(what="steps", target=1.25, families=families)
        said = " ".join(audit_cost_sentences(cell))
        data = {"config": {"device": "cpu", "quick": True}, "environment": {}, "ceilings": {}}
        data["audit_cost"] = cell.to_json()
        assert Results.load(data).audit_cost == cell
        found = {t.target: t for t in audit_cost_targets(Results.load(data))}
        assert len(found) == len(FAMILIES)
        for f, m in zip(FAMILIES, measured):
            t = found[f"plusequals.audit <= 1.25x an eager train step ({f.model}, CPU)"]
            if m is None:
                assert f"{f.model} ({f.family}): not measured (not installed)." in said
                assert t.value is None and t.status == "not measurable here"
                continue
            audited, anomaly, bare, observed = m
            verdict = "met" if audited <= 1.25 else "missed"
            assert f"{f.model} ({f.family}): the audit costs {fmt(audited)} [" in said
            assert f"anomaly mode {fmt(anomaly)} [" in said and f"does nothing {fmt(bare)} [" in said
            assert f"global module hooks that do nothing {fmt(observed)} [" in said
            (own,) = [s for s in audit_cost_sentences(cell) if s.startswith(f"{f.model} ({f.family}): ")]
            assert own.endswith(f": {verdict}.")
            assert t.value == audited and t.status == verdict
        over = [f.model for f, m in zip(FAMILIES, measured) if m is not None and m[3] > 1.25]
        floor = [s for s in audit_cost_sentences(cell) if "doing nothing, costs more than the target" in s]
        assert len(floor) == (1 if over else 0)
        assert not over or floor[0].endswith(f"on {', '.join(over)}.")
        claim = audit_cost_claim(data)
        if all(m is None for m in measured):
            assert "predates" in claim
        else:
            first = next(m for m in measured if m is not None)
            assert said in claim and f"{fmt(60.0 * first[0])} ms through `audit()`" in claim

    check()
    assert "predates" in audit_cost_claim({"config": {}, "environment": {}, "ceilings": {}})


def test_a_results_json_from_before_the_families_reads_as_resnet18_alone():
    """A results.json whose audit cost timed resnet18 alone (its rows at the cell's top) reads as
    that one family, and its target keeps its name."""
    from plusequals.bench.analyse import audit_cost_targets
    from plusequals.bench.results import Results

    rows = [
        {"name": n, "median_ms": 50.0, "iqr_ms": 1.0, "vs_eager": r, "vs_eager_q1": r, "vs_eager_q3": r,
         "within_noise": r == 1.0}
        for n, r in (("eager", 1.0), ("anomaly mode", 1.4), ("plusequals.audit", 1.2))
    ]  # fmt: skip
    data = {"config": {"device": "cpu", "quick": True}, "environment": {}, "ceilings": {}}
    data["audit_cost"] = {"what": "resnet18", "threads": 1, "target": 1.25, "rows": rows, "audit": "clean"}
    cell = Results.load(data).audit_cost
    assert [(f.model, f.audit, len(f.rows)) for f in cell.families] == [("resnet18", "clean", 3)]
    (t,) = [t for t in audit_cost_targets(Results.load(data))]
    assert t.target == "plusequals.audit <= 1.25x an eager train step (resnet18, CPU)" and t.status == "met"
