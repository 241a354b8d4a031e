"""README.md is a front page: at most 200 lines; its quick start runs as written; its
excerpts of what the two commands print are real; every relative link and anchor in README.md and
docs/ resolves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _between(text: str, marker: str) -> str:
    start = text.index(f"<!-- {marker} -->") + len(f"<!-- {marker} -->")
    return text[start : text.index(f"<!-- /{marker} -->", start)]


def _fenced(block: str) -> str:
    return block.split("```", 2)[1].split("\n", 1)[1]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.+)", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_the_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not this test's business
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_quick_start_runs_as_written(tmp_path):
    """The README's Python quick start, run as a script in a fresh interpreter (outside the repo)."""
    code = _fenced(_between(README.read_text(), "quick-start"))
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = [sys.executable, str(script)]
    proc = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    said = _fenced(_between(README.read_text(), "quick-start-output"))
    assert proc.stdout.strip().splitlines() == said.strip().splitlines()


def test_the_report_excerpt_is_what_the_summary_prints():
    """The README's excerpt of `make report`'s summary: lines of `python -m plusequals summary
    docs/report-cpu` at 80 columns (the committed report's)."""
    import json

    from rich.console import Console

    from plusequals.cli import summary

    directory = REPO / "docs" / "report-cpu"
    console = Console(width=80, record=True, color_system=None)
    summary.show(summary.build(json.loads((directory / "results.json").read_text()), directory), console)
    printed = console.export_text().splitlines()
    excerpt = [ln for ln in _fenced(_between(README.read_text(), "report-excerpt")).splitlines() if ln != "..."]
    assert excerpt and [ln for ln in excerpt if ln not in printed] == []


def _step_labels() -> list[re.Pattern]:
    """The set-up steps' one-line labels (scripts/step.sh's first argument) in the Makefile and
    scripts/test_install.sh, a variable matching anything."""
    labels = re.findall(r'step\.sh "([^"]+)"', (REPO / "Makefile").read_text())
    labels += re.findall(r'^\s*step "(.+?)" "\$log"', (REPO / "scripts/test_install.sh").read_text(), re.M)
    wildcard = re.compile(r"\\\$\\\(.*?\\\)|\\\$\w+")
    return [re.compile(wildcard.sub(".+", re.escape(label)) + "$") for label in labels]


def test_the_test_excerpt_shows_the_makefiles_steps():
    """The README's excerpt of `make test`: each line is one of the set-up steps, as step.sh prints it."""
    shown = [ln for ln in _fenced(_between(README.read_text(), "test-excerpt")).splitlines() if ln.strip()]
    labels = _step_labels()
    assert shown and len(labels) >= 6
    for line in shown:
        label, _, status = line.partition(" ... ")
        assert status.startswith("ok") and any(p.match(label) for p in labels), line
