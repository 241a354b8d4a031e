"""`python -m plusequals demo` runs every bug and every compile-fail case, and exits 0."""

import os
import subprocess
import sys

from plusequals.cli import demo


def test_demo_exits_zero_and_shows_every_case():
    proc = subprocess.run(
        [sys.executable, "-m", "plusequals", "demo"],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "COLUMNS": "250"},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "UNEXPECTED" not in out
    for case in demo.read_cases():
        assert case.name in out and f"error[{case.code}]" in out
    assert "MUTATED" in out and "modified by an inplace operation" in out


def test_demo_fails_when_an_expectation_fails(monkeypatch):
    """The demo's exit code can fail: flip one expectation and it must return 1."""
    from plusequals.model import bugs

    flipped = dict(bugs.EXPECTED)
    flipped["op_plus_x"] = bugs.Expected(True, None, None)
    monkeypatch.setattr(bugs, "EXPECTED", flipped)
    assert demo.run(skip_compile_fail=True) == 1


def test_demo_reads_at_80_columns():
    """At 80 columns every table becomes one block per row (name and verdict on one line, the
    other cells indented below), so no cell is squeezed to a word per line: no table borders, no
    line wider than the terminal, every row's name on a line with its verdict."""
    from rich.cells import cell_len
    from rich.console import Console

    from plusequals.twin import aliases

    console = Console(width=80, record=True, color_system=None)
    assert demo.run(skip_compile_fail=True, console=console) == 0
    lines = console.export_text().splitlines()
    assert not [ln for ln in lines if "│" in ln or "┃" in ln], "a table was drawn at 80 columns"
    assert max(cell_len(ln) for ln in lines) <= 80
    for name in [
        *bugs_strategies(),
        *(row.route for row in aliases.TABLE if row.run_time.startswith(("rust:", "py:"))),
    ]:
        assert any(ln.startswith(name) and "as expected" in ln for ln in lines), name
    wide = Console(width=200, record=True, color_system=None)
    demo._alias_routes(wide, lambda ok, what: "as expected")
    assert "┃ route" in wide.export_text()  # the wide layout is still a table


def bugs_strategies():
    from plusequals.model.blocks import STRATEGIES

    return STRATEGIES
