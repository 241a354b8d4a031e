"""The report's terminal summary: `report --json` prints it, alone, on stdout; the rich one reads
at 80 columns with every verdict and target whole; `summary DIR` prints it again; and every
count in it is recomputed here from the paired ratios."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from plusequals.bench import analyse
from plusequals.bench.results import fmt
from plusequals.cli import summary


def _data(quick_report):
    return json.loads((quick_report / "results.json").read_text())


def test_json_stdout_is_the_summary_alone(quick_report_run):
    """`--json`: stdout parses as one JSON document, equal to the summary rebuilt from
    results.json; the run printed no progress and no warning or error line on stderr."""
    printed = json.loads(quick_report_run.stdout)
    rebuilt = summary.build(_data(quick_report_run.out), quick_report_run.out)
    assert printed == json.loads(json.dumps(rebuilt))
    assert printed["report"] == str(quick_report_run.out / "REPORT.md")
    assert printed["informational"] is True  # a CPU at quick shapes
    assert {v["question"] for v in printed["verdicts"]} >= {
        "Is `+=` faster?",
        "Is Python the bottleneck?",
        "Rust or tch?",
    }
    assert [t["target"] for t in printed["targets"]] == [t["target"] for t in _data(quick_report_run.out)["targets"]]
    noisy = [ln for ln in quick_report_run.stderr.splitlines() if any(w in ln.lower() for w in ("warning", "error"))]
    assert not noisy, noisy


def test_every_count_is_recomputed_from_the_paired_ratios(quick_report):
    """Each comparison's range and counts, from the per-cell paired medians and quartiles."""
    data = _data(quick_report)
    s = summary.build(data, quick_report)
    checked = 0
    for v in s["verdicts"]:
        for c in v["comparisons"]:
            host = v["question"].endswith("cost almost nothing?")  # the host-cost cell: one shape
            pool = data["host_cost"]["paired"] if host else data["paired"]
            ps = [p for p in pool if (p["batch"], p["variant"], p["vs"]) == (c["batch"], c["variant"], c["vs"])]
            assert len(ps) == c["cells"] == (1 if host else len(data["config"]["shapes"]))
            assert c["lo"] == min(p["median"] for p in ps) and c["hi"] == max(p["median"] for p in ps)
            assert c["faster"] == sum(p["q3"] < 1 for p in ps)
            assert c["slower"] == sum(p["q1"] > 1 for p in ps)
            assert c["within_noise"] == sum(p["q1"] <= 1 <= p["q3"] for p in ps)
            assert c["faster"] + c["slower"] + c["within_noise"] == c["cells"]
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize(
    "counts, said",
    [
        ((4, 0, 0), "faster in all 4 cells"),
        ((0, 4, 0), "slower in all 4 cells"),
        ((0, 0, 4), "same time within noise (all 4 cells)"),
        ((3, 0, 1), "faster in 3, within noise in 1 of 4 cells"),
        ((1, 2, 1), "faster in 1, slower in 2, within noise in 1 of 4 cells"),
    ],
)
def test_the_answer_says_what_the_counts_say(counts, said):
    f, s, w = counts
    assert analyse.answer({"cells": 4, "faster": f, "slower": s, "within_noise": w}) == said


def _render(s: dict, width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    summary.show(s, console)
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_the_summary_reads_at_80_columns_with_every_verdict_and_target_whole(quick_report, width):
    """No line wider than the terminal, no table border; every comparison's range and counts, every
    verdict sentence, every target's status and value, and REPORT.md's path, all printed whole."""
    s = summary.build(_data(quick_report), quick_report)
    lines = _render(s, width)
    text = "\n".join(lines)
    flat = " ".join(text.split())  # wrapped sentences, joined again
    assert max(cell_len(ln) for ln in lines) <= width
    assert "…" not in text, "a cell cut at this width"
    assert not [ln for ln in lines if set(ln) & set("│┃┏━")], "a table border at this width"
    for v in s["verdicts"]:
        assert v["question"].replace("`", "") in flat, v["question"]
        for c in [] if v["answer_only"] else v["comparisons"]:
            rng, counts = summary._cell(c).split("\n")
            assert any(rng in ln for ln in lines), (v["question"], rng)
            plain = Console(width=200, record=True, color_system=None)
            plain.print(counts)
            assert plain.export_text().strip() in text, (v["question"], counts)
        if v["answer_only"]:
            for part in v["answer"].replace("`", "").split("; "):
                assert part in flat, part
    for t in s["targets"]:
        assert t["target"] in flat, t["target"]
        assert any(ln.startswith(t["state"]) for ln in lines), t
        if t["value"] is not None:
            assert fmt(t["value"]) in text
    assert s["report"] in flat
    # Nothing squeezed to a word per line: no three lines in a row hold a single word each.
    single = [len(ln.split()) == 1 for ln in lines]
    assert not any(all(single[i : i + 3]) for i in range(len(lines) - 2)), text


def test_summary_prints_a_finished_report_again_and_refuses_an_unfinished_one(quick_report, tmp_path):
    py = [sys.executable, "-m", "plusequals", "summary"]
    again = subprocess.run(
        [*py, str(quick_report)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"}, timeout=120
    )
    assert again.returncode == 0, again.stderr
    assert "Verdicts" in again.stdout and "Targets" in again.stdout and "REPORT.md" in again.stdout
    as_json = subprocess.run([*py, str(quick_report), "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(as_json.stdout) == json.loads(json.dumps(summary.build(_data(quick_report), quick_report)))
    missing = subprocess.run([*py, str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stdout == "" and len(missing.stderr.strip().splitlines()) == 1
    assert "make report" in missing.stderr
    data = _data(quick_report) | {"complete": False}
    (tmp_path / "results.json").write_text(json.dumps(data))
    unfinished = subprocess.run([*py, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert (
        unfinished.returncode == 2
        and "interrupted" in unfinished.stderr
        and len(unfinished.stderr.strip().splitlines()) == 1
    )


def _committed():
    from pathlib import Path

    directory = Path(__file__).resolve().parents[1] / "docs" / "report-cpu"
    return summary.build(json.loads((directory / "results.json").read_text()), directory)


@pytest.mark.parametrize("width", [80, 120, 200])
def test_no_summary_line_ends_in_spaces(width):
    """rich pads table cells to their column; the summary trims them (logs and diffs show them)."""
    lines = _render(_committed(), width)
    assert not [ln for ln in lines if ln != ln.rstrip()]


def test_the_same_work_row_names_what_it_compares():
    s = _committed()
    same = [v for v in s["verdicts"] if v["question"] == "Same work, spelled differently"]
    flat = " ".join(" ".join(_render(s, 80)).split())
    names = [c["variant"] for c in same[0]["comparisons"]]
    assert names and all(n.split("/")[-1] in flat for n in names)
    assert summary._compared(same).startswith("eager/")


@given(st.floats(0.001, 1000), st.floats(0.001, 1000))
def test_a_target_shows_the_digits_that_tell_its_value_from_its_limit(value, limit):
    """measured "1.0204" against limit "1.02", never "1.02" twice beside "missed"; and the shown
    value lies on the same side of the limit as the value itself."""
    shown, shown_limit = summary._numbers(value, limit)
    if value != limit:
        assert shown != shown_limit
        assert (float(shown) <= float(shown_limit)) == (value <= limit)


def test_every_ratio_target_reads_as_a_time_ratio_at_most_its_limit():
    """The targets in the verdicts' direction: a time over the reference (below 1 is faster), met
    when it is at most the limit, as every verdict reads."""
    from pathlib import Path

    from plusequals.bench.results import Results

    data = json.loads((Path(__file__).resolve().parents[1] / "docs/report-cpu/results.json").read_text())
    checked = 0
    for t in analyse.targets(Results.load(data)):
        if t.value is not None and t.unit.startswith("x"):
            assert t.status.startswith("met") == (t.value <= t.limit), t
            assert "faster than" not in t.target, t
            checked += 1
    assert checked >= 2
