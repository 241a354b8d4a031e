"""The numbers that README.md and the guide (docs/guide/) give about the committed CPU report all
come from its results.json."""

import json
import re
from pathlib import Path

import pytest

from plusequals.bench.results import NUMBER, fmt
from support.report_tokens import tokens

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- numbers: (\S+) .*?-->(.*?)<!-- /numbers -->", re.S)


PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_number_in_a_numbers_block_is_in_its_results_json(page):
    blocks = BLOCK.findall(page.read_text())
    if page.name == "README.md":
        assert blocks, "no <!-- numbers: ... --> block in README.md"
    for source, text in blocks:
        allowed = tokens(json.loads((REPO / source).read_text()), set(), us=True)
        prose = re.sub(r"`[^`]*`", "", text)  # variant names (eager/op_plus_x, cpp/loop) are not numbers
        stray = [n for n in NUMBER.findall(prose) if n not in allowed]
        assert not stray, f"README numbers not in {source}: {stray}"


def test_the_guides_audit_cost_sentence_is_what_the_committed_report_says():
    """docs/guide/audit.md's cost sentence is generated from docs/report-cpu/results.json (after
    `make report`: `python scripts/audit_tables.py cost`): per model family, the audit's and
    anomaly mode's paired ratios to an eager train step and the target met or missed, or, for a
    report that predates the cell, that it has none; every number in it is one results.json holds."""
    from plusequals.bench.render import audit_cost_claim
    from plusequals.bench.results import Results

    data = json.loads((REPO / "docs/report-cpu/results.json").read_text())
    page = (REPO / "docs/guide/audit.md").read_text()
    opening = page.index("<!-- audit-cost: ")
    said = page[page.index("\n", opening) + 1 : page.index("\n<!-- /audit-cost -->")]
    assert said == audit_cost_claim(data), "rerun `python scripts/audit_tables.py cost`"
    prose = re.sub(r"`[^`]*`", "", said)
    allowed = tokens(data, set())
    assert [n for n in NUMBER.findall(prose) if n not in allowed] == []
    cell = Results.load(data).audit_cost
    for f in cell.families if cell is not None else ():
        audited = f.row("plusequals.audit")
        if audited is not None:
            verdict = "met" if audited.vs_eager <= cell.target else "missed"
            ratio = f"{fmt(audited.vs_eager)} [{fmt(audited.vs_eager_q1)}, "
            assert f"{f.model} ({f.family}): the audit costs {ratio}" in said and f"{verdict} on " in said


def test_the_readme_says_which_crossing_budgets_the_committed_report_met():
    """The crossing sentence gives every difference of docs/report-cpu's host-cost cell, in the
    report's order, with its median, and "within" or "over" its budget as results.json says."""
    data = json.loads((REPO / "docs/report-cpu/results.json").read_text())
    readme = (REPO / "README.md").read_text()
    said = readme[readme.index("* **What do RustBlock's checks and the crossing cost?**") :]
    said = " ".join(said[: said.index("<!-- /numbers -->")].split())
    found = re.findall(r"([0-9.]+) \[[^\]]*\] µs \((within|over) ([0-9.]+)\)", said)
    wanted = [
        (fmt(d["median_us"]), "within" if d["within_budget"] else "over", fmt(d["budget_us"]))
        for d in data["host_cost"]["differences"]
    ]
    assert found == wanted
    assert said.startswith("* **What do RustBlock's checks and the crossing cost?** Within budget") == any(
        w[1] == "within" for w in wanted
    )
