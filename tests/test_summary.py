"""The report's terminal summary: `report --json` prints it, alone, on stdout; the rich one reads
at 80 columns with every verdict and target whole; `summary DIR` prints it again; and every
count in it is recomputed here from the paired ratios."""

import copy
import functools
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from conftest import examples
from plusequals.bench import analyse
from plusequals.bench.results import fmt
from plusequals.cli import summary
from plusequals.cli.terminal import print_trimmed


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


def _phrases(c: dict) -> list[str]:
    """What one comparison's cell says, phrase by phrase, from its numbers (not from the
    renderer): the range (one cell: median [Q1, Q3]), then each nonzero count."""
    n = c["cells"]
    if n == 1:
        word = "faster" if c["faster"] else "slower" if c["slower"] else "≈ within noise"
        return [fmt(c["lo"]), f"[{fmt(c['q1'])}, {fmt(c['q3'])}]", word]
    counts = [(c["faster"], "faster"), (c["slower"], "slower"), (c["within_noise"], "≈")]
    return [f"{fmt(c['lo'])}–{fmt(c['hi'])}"] + [f"{word} {k}/{n}" for k, word in counts if k]


# A cell's phrases as they can appear on a rendered line (a lone median: none): a phrase cut at
# a line's end leaves a bare "faster" / "≈" or half a range, matched as another or not at all.
PHRASE = re.compile(r"(?:faster|slower|≈) \d+/\d+|≈ within noise|faster|slower|≈|\[\S+, \S+\]|\S+–\S+")


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
            for phrase in _phrases(c):  # whichever way the verdict fell, each phrase on one line
                assert any(phrase in ln for ln in lines), (v["question"], phrase)
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


def test_summary_prints_a_finished_report_again_and_refuses_an_unfinished_one(quick_report, tmp_path, capsys):
    """``python -m plusequals summary``, as a process once (the text at 80 columns), then through the
    same entry point in this process (``plusequals.cli.main``: argv in, exit status out), which
    saves three interpreters that import torch: the JSON alone on stdout, and a missing or an
    interrupted report refused in one line with exit status 2."""
    from plusequals.cli import main

    py = [sys.executable, "-m", "plusequals", "summary"]
    again = subprocess.run(
        [*py, str(quick_report)], capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"}
    )
    assert again.returncode == 0, again.stderr
    assert "Verdicts" in again.stdout and "Targets" in again.stdout and "REPORT.md" in again.stdout
    capsys.readouterr()
    assert main(["summary", str(quick_report), "--json"]) == 0
    as_json = capsys.readouterr()
    assert json.loads(as_json.out) == json.loads(json.dumps(summary.build(_data(quick_report), quick_report)))
    assert main(["summary", str(tmp_path / "nowhere")]) == 2
    missing = capsys.readouterr()
    assert missing.out == "" and len(missing.err.strip().splitlines()) == 1
    assert "make report" in missing.err
    data = _data(quick_report) | {"complete": False}
    (tmp_path / "results.json").write_text(json.dumps(data))
    assert main(["summary", str(tmp_path)]) == 2
    unfinished = capsys.readouterr()
    assert "interrupted" in unfinished.err and len(unfinished.err.strip().splitlines()) == 1


@functools.cache
def _committed_once() -> dict:
    from pathlib import Path

    directory = Path(__file__).resolve().parents[1] / "docs" / "report-cpu"
    return summary.build(json.loads((directory / "results.json").read_text()), directory)


def _committed() -> dict:
    """The committed report's summary, built once per process; each caller gets its own copy."""
    return copy.deepcopy(_committed_once())


@pytest.mark.parametrize("width", [80, 120, 200])
def test_no_summary_line_ends_in_spaces(width):
    """rich pads table cells to their column; the summary trims them (logs and diffs show them)."""
    lines = _render(_committed(), width)
    assert not [ln for ln in lines if ln != ln.rstrip()]


VARIANTS = ["eager/iadd", "eager/x_plus_op", "rust/forward", "rust/forward_owned_donate", "cpp/loop", "compile/iadd"]
QUESTIONS = ["Is `+=` faster?", "Is Python the bottleneck?", "Rust or tch?", "Should a compiler do it?"]
NUMBERS = st.floats(1e-5, 1e5) | st.sampled_from([0.969, 1.0, 1.01, 99.99, 12345.6, 0.000123])


@st.composite
def comparisons(draw, batch: int, reference: str) -> dict:
    """One comparison at one batch: any split of 1 to 16 cells into faster, slower and within
    noise, and any medians from 1e-5 to 1e5."""
    n = draw(st.integers(1, 16))
    faster = draw(st.integers(0, n))
    slower = draw(st.integers(0, n - faster))
    lo, hi = sorted([draw(NUMBERS), draw(NUMBERS)])
    q1, q3 = (lo, hi) if n > 1 else sorted([draw(NUMBERS), draw(NUMBERS), lo])[::2]
    hi = lo if n == 1 else hi
    variant, vs = draw(st.sampled_from(VARIANTS)), draw(st.sampled_from([reference, reference, "cpp/loop"]))
    cells = dict(cells=n, faster=faster, slower=slower, within_noise=n - faster - slower)
    return dict(variant=variant, vs=vs, batch=batch, lo=lo, hi=hi, q1=q1, q3=q3, **cells)


@st.composite
def verdict_mixes(draw) -> dict:
    """The committed summary with its per-batch verdicts replaced by generated ones: one to
    four questions, each at batch 2, 16 or both, with one to three comparisons (one row each).
    The answer-only rows and the verdicts asked once stay the committed ones."""
    s = _committed()
    kept = [v for v in s["verdicts"] if v["answer_only"] or v["batch"] not in s["batches"]]
    made = []
    for question in draw(st.lists(st.sampled_from(QUESTIONS), min_size=1, max_size=4, unique=True)):
        for batch in draw(st.sampled_from([[2], [16], [2, 16]])):
            cs = draw(st.lists(comparisons(batch, s["reference"]), min_size=1, max_size=3))
            unique = list({summary._label(c, s["reference"]): c for c in cs}.values())
            made.append(dict(question=question, batch=batch, comparisons=unique, answer="", answer_only=False))
    return s | {"verdicts": made + kept}


@pytest.mark.parametrize("width", [80, 100])
@settings(max_examples=examples(150), deadline=None)
@given(s=verdict_mixes())
def test_no_verdict_cell_wraps_mid_phrase_and_no_line_is_too_wide(width, s):
    """Any verdict mix (faster / slower / ≈ in every combination and count, long numbers), at 80
    and 100 columns: no line of the summary wider than the terminal and nothing cut; in the
    verdict table every phrase ("faster 2/4", "≈ 1/4", "0.969–1.01", "[0.951, 1.02]") on
    one line, as many of each as the numbers say, and no bare "faster" or "≈" left at a line's
    end."""
    lines = _render(s, width)
    assert max(cell_len(ln) for ln in lines) <= width
    assert "…" not in "\n".join(lines)
    console = Console(width=width, record=True, color_system=None)
    print_trimmed(console, summary.verdict_table(s, console)[0])
    table = console.export_text().splitlines()
    assert max(cell_len(ln) for ln in table) <= width
    said = [p for v in s["verdicts"] if not v["answer_only"] for c in v["comparisons"] for p in _phrases(c)]
    for v in s["verdicts"]:  # the same-work row: its answers' own phrases ("≈ 16/16")
        if v["answer_only"] and v["batch"] in s["batches"]:
            said += v["answer"].split("; ")
    expected = Counter(p for phrase in said for p in PHRASE.findall(phrase))
    questions = {v["question"].replace("`", "") for v in s["verdicts"]}  # "Is += faster?": a heading
    found = Counter(p for ln in table if ln.strip() not in questions for p in PHRASE.findall(ln))
    assert found == expected, "\n".join(table)


def test_phrases_wrap_between_phrases_only():
    """A Phrases cell in a column too narrow for its line: broken between phrases, each whole."""
    from plusequals.cli.terminal import Phrases

    console = Console(width=12, record=True, color_system=None)
    console.print(Phrases(["0.969–1.01"], ["faster 2/4", "slower 1/4", "≈ 1/4"]))
    assert console.export_text().splitlines() == ["0.969–1.01", "faster 2/4", "slower 1/4", "≈ 1/4"]
    wide = Console(width=40, record=True, color_system=None)
    wide.print(Phrases(["faster 2/4", "slower 1/4", "≈ 1/4"]))
    assert wide.export_text().splitlines() == ["faster 2/4 slower 1/4 ≈ 1/4"]


def test_the_same_work_row_names_what_it_compares():
    s = _committed()
    same = [v for v in s["verdicts"] if v["question"] == "Same work, spelled differently"]
    flat = " ".join(" ".join(_render(s, 80)).split())
    names = [c["variant"] for c in same[0]["comparisons"]]
    assert names and all(n.split("/")[-1] in flat for n in names)
    assert summary._compared(same).startswith("eager/")


@st.composite
def target_mixes(draw):
    """The committed summary with its targets' values, limits and states drawn anew: whichever
    way each target fell, with numbers of any length (a measured value decides the widest cell)."""
    s = _committed()
    targets = []
    for t in s["targets"]:
        value = draw(st.none() | NUMBERS)
        state = "not measurable here" if value is None else draw(st.sampled_from(["met", "missed"]))
        targets.append(t | {"value": value, "limit": draw(NUMBERS), "state": state})
    return s | {"targets": targets}


@settings(max_examples=examples(60), deadline=None)
@given(s=target_mixes(), width=st.integers(80, 200))
def test_every_target_reads_whole_at_any_width(s, width):
    """The Targets table at any width and any measured values: no line wider than the terminal,
    no cell cut, each target's state heading its line, its words, value and limit all shown."""
    lines = _render(s, width)
    text = "\n".join(lines)
    flat = " ".join(text.split())
    assert max(cell_len(ln) for ln in lines) <= width
    assert "…" not in text, "a cell cut at this width"
    for t in s["targets"]:
        assert t["target"] in flat, t["target"]
        assert any(ln.startswith(t["state"] + "  ") or ln.startswith(t["state"] + " ") for ln in lines), t
        measured, limit = summary._measured(t), summary._limit(t)
        assert measured in flat and limit in flat, (measured, limit)


@given(st.floats(0.001, 1000), st.floats(0.001, 1000))
@example(0.001, 0.0010000000000000002)  # adjacent floats: "0.001" twice, before the limit took the value's digits
@example(1.0, 0.99999)  # "1.00" and "1.000": different strings, the same number, at their own precisions
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
