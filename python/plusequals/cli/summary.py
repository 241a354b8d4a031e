"""The report's answers in the terminal: the verdicts (each a paired ratio with its spread over
the shapes and how many cells are within noise), the targets with their statuses, and where
REPORT.md is. ``build`` makes it from results.json alone; ``show`` prints it with rich;
``--json`` prints ``build``'s dict instead; ``emit`` does either at the end of a report run.

``python -m plusequals summary [DIR]`` (``main``) prints it again for a finished report.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from ..bench.analyse import INFORMATIONAL, on_target, verdict_items
from ..bench.results import Results, fmt
from .terminal import Phrases, fit_columns, print_trimmed, say

SCHEMA = 1
STATUS_STYLE = {"met": "green", "missed": "red", "not measurable here": "dim"}


class IncompleteReport(Exception):
    """results.json is from a run that did not finish: it has rows but no verdicts."""


def build(data: dict, outdir: Path) -> dict:
    """The summary of one report, every number taken from ``data`` (results.json)."""
    if not data.get("complete"):
        raise IncompleteReport(
            f"{outdir / 'results.json'} is from an interrupted run (no verdicts yet): run `make report` again"
        )
    results = Results.load(data)
    cfg, env = results.config, results.environment
    return {
        "schema": SCHEMA,
        "report": str(outdir / "REPORT.md"),
        "results": str(outdir / "results.json"),
        "plots": sorted(str(p) for p in outdir.glob("*.png")),
        "device": cfg["device"],
        "machine": env.get("gpu") or f"{env['cpu']}, {env['cpu_threads']} threads",
        "dtype": cfg["dtype"],
        "quick": cfg["quick"],
        "smoke": bool(cfg.get("smoke")),
        "informational": not on_target(results),
        "elapsed_s": data.get("elapsed_s"),
        "reference": cfg["reference"],
        "batches": cfg["batches"],
        "verdicts": [v.to_json() for v in verdict_items(results)],
        "targets": [t.to_json() | {"state": t.status.split(" (")[0]} for t in results.targets],
    }


def _md(text: str) -> str:
    """REPORT.md's `code` spans as rich markup, everything else escaped."""
    return re.sub(r"`([^`]+)`", r"[cyan]\1[/]", escape(text))


def _cell(c: dict) -> list[list[str]]:
    """One comparison at one batch, on two lines of phrases: the paired medians' range over the
    shapes (a single cell: its median [Q1, Q3]), then in how many cells the first is faster,
    slower, or the same within noise. A narrow column wraps a line between its phrases only
    (:class:`~plusequals.cli.terminal.Phrases`)."""
    n = c["cells"]
    if n == 1:
        word = "[green]faster[/]" if c["faster"] else ("[red]slower[/]" if c["slower"] else "≈ within noise")
        return [[fmt(c["lo"]), f"[{fmt(c['q1'])}, {fmt(c['q3'])}]"], [word]]
    counts = [
        f"[green]faster {c['faster']}/{n}[/]" if c["faster"] else "",
        f"[red]slower {c['slower']}/{n}[/]" if c["slower"] else "",
        f"≈ {c['within_noise']}/{n}" if c["within_noise"] else "",
    ]
    return [[f"{fmt(c['lo'])}–{fmt(c['hi'])}"], [x for x in counts if x]]


def _measured(g: dict) -> str:
    if g["value"] is None:
        return "-"
    return f"{_numbers(g['value'], g['limit'])[0]} {g['unit'].replace(' (worst shape)', '')}"


def _limit(g: dict) -> str:
    return fmt(g["limit"]) if g["value"] is None else _numbers(g["value"], g["limit"])[1]


def _numbers(value: float, limit: float) -> tuple[str, str]:
    """``value`` and ``limit`` with the digits that tell them apart: 1.0204 against 1.02 is
    "1.0204" and "1.02", never "1.02" twice beside a "missed", nor 1.0 as "1.00" beside 0.99999's
    "1.000" (each rounded at its own precision: equal, or out of order)."""
    shown, shown_limit = fmt(value), fmt(limit)
    apart = float(shown) != float(shown_limit) and (float(shown) <= float(shown_limit)) == (value <= limit)
    if value == limit or apart:
        return shown, shown_limit
    for digits in range(4, 18):  # both at the same precision: rounding keeps their order
        shown, shown_limit = f"{value:.{digits}g}", f"{limit:.{digits}g}"
        if shown != shown_limit:
            return shown, shown_limit
    return repr(value), repr(limit)


def _label(c: dict, reference: str) -> str:
    return c["variant"] if c["vs"] == reference else f"{c['variant']} / {c['vs']}"


def _compared(items: list[dict]) -> str:
    """What an answer-only verdict compares, by name: ``eager/x_plus_op, iadd_clone, ...``."""
    names = list(dict.fromkeys(c["variant"] for v in items for c in v["comparisons"]))
    prefix = (
        names[0].split("/")[0] + "/" if names and all(n.startswith(names[0].split("/")[0] + "/") for n in names) else ""
    )
    return prefix + ", ".join(n[len(prefix) :] for n in names) if names else ""


def verdict_table(s: dict, console: Console) -> tuple[Table, list[dict]]:
    """The verdicts asked at every batch: one row per comparison, a column per batch, fitted to
    the console's width (:func:`~plusequals.cli.terminal.fit_columns`). The ones asked once
    (their answers are sentences) are returned to be printed on lines of their own."""
    batches = s["batches"]
    asked: dict[str, list[dict]] = {}
    for v in s["verdicts"]:
        asked.setdefault(v["question"], []).append(v)
    t = Table(box=None, padding=(0, 1), pad_edge=False)
    t.add_column("", width=30)
    for b in batches:
        t.add_column(f"batch {b}")
    once = []
    for question, items in asked.items():
        if len(items) == 1 and (items[0]["answer_only"] or items[0]["batch"] not in batches):
            once += items
            continue
        t.add_row(f"[bold]{_md(question)}[/]", *[""] * len(batches))
        if items[0]["answer_only"]:
            answers = {v["batch"]: Phrases(*([p] for p in _md(v["answer"]).split("; "))) for v in items}
            t.add_row(Padding(escape(_compared(items)), (0, 0, 0, 2)), *[answers.get(b, "-") for b in batches])
            continue
        rows: dict[str, dict[int, dict]] = {}
        for v in items:
            for c in v["comparisons"]:
                rows.setdefault(_label(c, s["reference"]), {})[v["batch"]] = c
        for label, at in rows.items():
            cells = [Phrases(*_cell(at[b])) if b in at else "-" for b in batches]
            t.add_row(Padding(escape(label), (0, 0, 0, 2)), *cells)
    fit_columns(t, console, console.width)
    return t, once


def show(s: dict, console: Console) -> None:
    """The summary: legible at 80 columns, no table borders."""
    shapes = "quick shapes" if s["quick"] else "SD v1 shapes"
    console.rule(f"[bold]plusequals report[/]: {s['device']} {s['dtype']}, {shapes}")
    say(console, f"[dim]{escape(s['machine'])}[/]")
    if s["informational"]:
        where = " at ".join(
            w for w in ("a CPU" if s["device"] == "cpu" else "", "quick shapes" if s["quick"] else "") if w
        )
        say(
            console,
            f"[yellow]Informational:[/] times from {where}. The targets are for the H200 at SD v1 shapes; "
            "here the ratios show the method, not the verdict.",
        )
    if s.get("smoke"):
        say(console, "[yellow]A smoke run[/] (--smoke): the fewest rounds, to check the report runs; not measurements.")
    console.print()
    say(
        console,
        f"[bold]Verdicts[/] [dim]time / {s['reference']} (or a / b), paired in each round: the lowest–highest median "
        "over the shapes, then in how many cells it is faster or slower ([Q1, Q3] below or above 1) or ≈ (within "
        "noise)[/]",
    )
    table, once = verdict_table(s, console)
    print_trimmed(console, table)
    for v in once:
        say(console, f"[bold]{_md(v['question'])}[/]")
        print_trimmed(console, Padding(_md(v["answer"]), (0, 0, 0, 2)))
        if v["comparisons"]:  # one cell each: its median [Q1, Q3]
            t = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
            for _ in range(3):
                t.add_column(no_wrap=True)
            for c in v["comparisons"]:
                t.add_row(f"  {escape(_label(c, s['reference']))}", *(" ".join(line) for line in _cell(c)))
            print_trimmed(console, t)
    console.print()
    targets = [
        (
            f"[{STATUS_STYLE.get(g['state'], 'default')}]{g['state']}[/]",
            escape(g["target"]),
            _measured(g),
            _limit(g),
        )
        for g in s["targets"]
    ]
    t = Table(box=None, padding=(0, 1), pad_edge=False)
    for name, justify in (("[bold]Targets[/]", "left"), ("", "left"), ("measured", "right"), ("limit", "right")):
        t.add_column(name, no_wrap=True, justify=justify)
    for row in targets:
        t.add_row(*row)
    if console.measure(t, options=console.options.update_width(10_000)).maximum <= console.width:  # unclamped
        print_trimmed(console, t)
    else:  # narrow: each target on its own line, its numbers below, so that no cell is cut
        say(console, "[bold]Targets[/]")
        for state, target, measured, limit in targets:
            say(console, f"{state}  {target}")
            say(console, f"    [dim]measured[/] {measured}[dim], limit[/] {limit}")
    if s["informational"]:
        say(console, f"[dim]({INFORMATIONAL}; measured: the worst shape)[/]")
    took = f" in {s['elapsed_s']:.0f} s" if s.get("elapsed_s") else ""
    say(console, f"Full report{took}: [bold]{escape(s['report'])}[/] [dim](every number: {escape(s['results'])})[/]")


def emit(data: dict, outdir: Path, output: str, console: Console) -> None:
    """The end of a report run: the rich summary, the REPORT.md path alone (quiet), or the
    summary as JSON on stdout."""
    if output == "quiet":
        print(outdir / "REPORT.md")
        return
    s = build(data, outdir)
    if output == "json":
        print(json.dumps(s, indent=2, ensure_ascii=False))
    else:
        show(s, console)


def main(directory: str, as_json: bool) -> int:
    """``python -m plusequals summary``: the summary of the report in ``directory``, again."""
    outdir = Path(directory)
    path = outdir / "results.json"
    if not path.exists():
        print(
            f"{path}: no report there: run `make report` (or `python -m plusequals report --out {outdir}`)",
            file=sys.stderr,
        )
        return 2
    try:
        emit(json.loads(path.read_text()), outdir, "json" if as_json else "rich", Console())
    except IncompleteReport as e:
        print(e, file=sys.stderr)
        return 2
    return 0
