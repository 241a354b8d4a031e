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
        env={**os.environ, "COLUMNS": "250"},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "UNEXPECTED" not in out
    for case in demo.read_cases():
        assert case.name in out and f"error[{case.code}]" in out
        for label in _labels(case.name):  # the whole diagnostic: every label rustc drew, the last one too
            assert label in out, (case.name, label)
    assert "MUTATED" in out and "modified by an inplace operation" in out


def test_demo_fails_when_an_expectation_fails(monkeypatch):
    """The demo's exit code can fail: flip one expectation and it must return 1."""
    from plusequals.model import bugs

    flipped = dict(bugs.EXPECTED)
    flipped["op_plus_x"] = bugs.Expected(True, None, None)
    monkeypatch.setattr(bugs, "EXPECTED", flipped)
    assert demo.run(skip_compile_fail=True) == 1


def test_an_installed_package_runs_every_section_but_rustcs_and_says_why(monkeypatch, tmp_path):
    """Installed, the package has no source checkout: the demo reads nothing from one, skips only
    rustc's section (it compiles tests/ui against the crate's source), says so, and exits 0."""
    from rich.console import Console

    assert demo.checkout()  # the tests run from a checkout
    monkeypatch.setattr(demo, "REPO", tmp_path / "site-packages")
    monkeypatch.setattr(demo, "UI", tmp_path / "site-packages" / "tests" / "ui")
    assert not demo.checkout()
    console = Console(width=120, record=True, color_system=None)
    assert demo.run(console=console) == 0
    text = " ".join(console.export_text().split())
    assert "skipped: rustc compiles the cases (tests/ui) against the crate's source, which only a source" in text
    assert "UNEXPECTED" not in text and "6. The borrow checker's verdict" in text


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
    from rich.text import Text

    from plusequals.cli.terminal import from_markdown

    live = [row.route for row in aliases.TABLE if row.run_time.startswith(("rust:", "py:"))]
    for name in [*bugs_strategies(), *(Text.from_markup(from_markdown(route)).plain for route in live)]:
        assert any(ln.startswith(name) and "as expected" in ln for ln in lines), name
    wide = Console(width=200, record=True, color_system=None)
    demo._alias_routes(wide, lambda ok, what: "as expected")
    assert "┃ route" in wide.export_text()  # the wide layout is still a table


def _labels(case: str) -> list[str]:
    """The text after each ``^``/``-`` marker of the case's expected diagnostic (tests/ui/*.stderr)."""
    import re

    stderr = (demo.UI / f"{case}.stderr").read_text()
    return [m.group(1).strip() for m in re.finditer(r"^\s*\|\s*[\^-]+ (.+)$", stderr, re.M)]


def _one_line(text: str) -> str:
    return " ".join(text.split())


def test_demo_shows_whole_error_lines_without_markdown():
    """Each PyTorch error's whole first line (never cut mid-word), no markdown markers, no
    README rows that were not run in the live catalogue."""
    from rich.console import Console

    from plusequals.model import bugs
    from plusequals.twin import aliases

    console = Console(width=80, record=True, color_system=None)
    assert demo.run(skip_compile_fail=True, console=console) == 0
    text = console.export_text()
    flat = _one_line(text)
    error = bugs.textual_inversion("iadd").error
    assert error and _one_line(demo.first_line(error)) in flat
    assert _one_line(demo.first_line(bugs.leaf_iadd())) in flat
    own = text.split("6. The borrow checker")[0].rsplit("\n", 1)[0]  # section 6: the audit's own messages
    assert "**" not in text and "`" not in own
    assert not [ln for ln in own.splitlines() if ln != ln.rstrip()], "trailing spaces"
    not_run = [row.route for row in aliases.TABLE if not row.run_time.startswith(("rust:", "py:"))]
    assert not_run and f"{len(not_run)} more routes" in flat
    shown = [ln for ln in text.splitlines() if "as expected" in ln]
    for route in not_run:
        assert not any(ln.startswith(route) for ln in shown), route


def test_narrow_rows_hang_their_wrapped_cells():
    """At 80 columns a cell that wraps continues under its value, not under its label."""
    from rich.console import Console

    from plusequals.cli.terminal import TerminalTable

    console = Console(width=80, record=True, color_system=None)
    rows = TerminalTable("name", "long cell", "check")
    rows.add_row("row", " ".join(f"word{i}" for i in range(40)), "ok")
    rows.print(console)
    lines = [ln for ln in console.export_text().splitlines() if ln.strip()]
    start = lines[1].index("word0")
    assert lines[1].startswith("    long cell:") and len(lines) > 3
    for ln in lines[2:]:
        assert ln[:start].strip() == "" and ln[start:].startswith("word"), ln


def test_markdown_cells_become_terminal_styles():
    from rich.text import Text

    from plusequals.cli.terminal import from_markdown

    markup = from_markdown("**tch API:** `f_*_out(.., out: &Tensor)` [x]")
    text = Text.from_markup(markup)
    assert text.plain == "tch API: f_*_out(.., out: &Tensor) [x]"
    assert {str(span.style) for span in text.spans} == {"bold", "cyan"}


def bugs_strategies():
    from plusequals.model.blocks import STRATEGIES

    return STRATEGIES


def test_help_is_plain_text(capsys):
    """``--help`` of the command and of each subcommand: no reStructuredText or markdown markers."""
    import pytest

    from plusequals.cli import main

    for argv in ([], ["demo"], ["report"], ["summary"], ["audit"], ["audit", "run"]):
        with pytest.raises(SystemExit) as exit:
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert exit.value.code == 0 and "usage: python -m plusequals" in out
        assert "`" not in out and "**" not in out, out


def _features(manifest: list[str], *flags: str) -> set[tuple[str, str]]:
    """(package, features) for every package cargo resolves (no build: ``cargo tree``); a package
    built for the host and for the target may appear twice."""
    cmd = ["cargo", "tree", "--prefix", "none", "--format", "{p}|{f}", "-e", "normal,build,dev", *flags, *manifest]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=demo.cargo_env())
    assert proc.returncode == 0, proc.stderr
    pairs = (ln.split("|", 1) for ln in proc.stdout.splitlines() if "|" in ln)
    return {(p.split(" (")[0], f.split(" (")[0]) for p, f in pairs if not p.startswith("plusequals")}


def test_the_demo_crate_resolves_the_features_clippy_checked(tmp_path):
    """The demo's cargo check reuses make lint's check of tch instead of making a second one:
    every package it shares with clippy's build (--all-targets --features python) is resolved
    with the same features (without the dev-dependencies, trybuild's serde turned serde_core's
    alloc on in one and off in the other, and tch was checked twice: 380 MB, about a minute)."""
    demo.scratch_crate(demo.read_cases(), tmp_path)
    ours = _features(["--manifest-path", str(tmp_path / "Cargo.toml")])
    clippy = _features(["--manifest-path", str(demo.REPO / "Cargo.toml")], "--all-targets", "--features", "python")
    shared = {p for p, _ in ours} & {p for p, _ in clippy}
    tch = demo._rust.TCH_VERSION
    assert {f"tch v{tch}", f"torch-sys v{tch}", "pyo3 v0.24.2"} <= shared, shared
    assert {pf for pf in ours if pf[0] in shared} == {pf for pf in clippy if pf[0] in shared}
