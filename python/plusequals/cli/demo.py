"""``python -m plusequals demo``: each bug live in PyTorch, each refused by rustc.

Exits non-zero if anything differs from ``bugs.EXPECTED`` or from ``tests/ui/cases.txt``. Every
section runs from the installed package but rustc's (section 3): it compiles ``tests/ui``'s cases
against the crate's source, which only a source checkout has. Without one it says so and skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console
from rich.markup import escape

from .. import _rust
from ..model import bugs
from ..model.blocks import STRATEGIES
from ..twin import aliases
from ..twin.block import RustBlock
from .terminal import TerminalTable, from_markdown, say

REPO = Path(__file__).resolve().parents[3]
UI = REPO / "tests" / "ui"
# what rustc's section reads from a source checkout (an installed package has none of it)
CHECKOUT = ("Cargo.toml", "Cargo.lock", "rust/lib.rs", "tests/ui/cases.txt")


def checkout() -> bool:
    """Whether the package runs from a source checkout, where rustc's section can compile the cases."""
    return all((REPO / p).is_file() for p in CHECKOUT)


@dataclass
class Case:
    name: str
    code: str
    mirrors: str


def first_line(message: str) -> str:
    """An error's first line, whole: the demo never cuts a message mid-word."""
    lines = message.strip().splitlines()
    return lines[0] if lines else ""


def read_cases(ui: Path = UI) -> list[Case]:
    cases = []
    for line in (ui / "cases.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, code, mirrors = line.split(maxsplit=2)
            cases.append(Case(name, code, mirrors))
    return cases


def build_cache() -> Path:
    """The build caches every clone on this machine shares: the Makefile's CACHE, the same rule."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plusequals"


def cargo_env() -> dict[str, str]:
    """What torch-sys's build script needs to find this interpreter's torch, with make's target
    dir and its stable link to this venv (the Makefile's top), so that the dependencies make's
    builds compiled (torch-sys's C++ above all) are reused, not rebuilt."""
    env = dict(os.environ)
    env["LIBTORCH_USE_PYTORCH"] = "1"
    here = Path(sys.prefix).resolve()
    venv = next((v for v in (env.get("VIRTUAL_ENV"), build_cache() / "venv") if v and Path(v).resolve() == here), None)
    env["VIRTUAL_ENV"] = str(venv or sys.prefix)
    env["PATH"] = f"{Path(env['VIRTUAL_ENV']) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("CARGO_TARGET_DIR", str(build_cache() / "target"))
    return env


def _dev_dependencies() -> list[str]:
    """The crate's dev-dependencies, as dependencies of the scratch crate. clippy's check (make
    lint: --all-targets) builds with them, and they add features to shared crates (trybuild's serde
    turns on serde_core's ``alloc``, which changes serde, safetensors and tch): with the same
    features the scratch crate reuses clippy's check of tch instead of checking it again."""
    import tomllib

    manifest = tomllib.loads((REPO / "Cargo.toml").read_text())
    # Not the crate itself (its own dev-dependency, for the fail points): the scratch crate has it.
    deps = manifest.get("dev-dependencies", {}).items()
    return [f"{name} = {_toml_value(spec)}" for name, spec in deps if name != "plusequals"]


def _toml_value(spec) -> str:
    if isinstance(spec, dict):  # an inline table; strings, booleans and lists of strings read the same in JSON
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in spec.items()) + " }"
    return json.dumps(spec)


def scratch_crate(cases: list[Case], project: Path) -> list[str]:
    """Writes the scratch crate whose binaries are the cases and their ``_fixed`` twins, depending
    on this one; returns the binaries' names."""
    project.mkdir(parents=True, exist_ok=True)
    bins = [c.name for c in cases] + [f"{c.name}_fixed" for c in cases]
    manifest = [
        "[package]",
        'name = "plusequals-demo-cases"',
        'version = "0.0.0"',
        'edition = "2021"',
        "publish = false",
        "",
        "[workspace]",
        "",
        "[dependencies]",
        # The python feature and the dev-dependencies, as in make lint's clippy: the dependencies'
        # check (tch's above all) is then the one clippy already made, in the same target dir.
        f'plusequals = {{ path = {json.dumps(str(REPO))}, features = ["python"] }}',
        f'tch = "={_rust.TCH_VERSION}"',
        *_dev_dependencies(),
    ]
    for b in bins:
        manifest += ["", "[[bin]]", f'name = "{b}"', f"path = {json.dumps(str(UI / (b + '.rs')))}"]
    (project / "Cargo.toml").write_text("\n".join(manifest) + "\n")
    shutil.copy(REPO / "Cargo.lock", project / "Cargo.lock")
    return bins


def check_cases(cases: list[Case], console: Console) -> dict[str, tuple[list[str], str]]:
    """``cargo check`` every case and its ``_fixed`` twin as binaries of a scratch crate that
    depends on this one. Returns, per binary, its error codes and its first rendered error."""
    project = REPO / "target" / "demo-compile-fail"
    bins = scratch_crate(cases, project)
    cmd = [
        "cargo",
        "check",
        "--bins",
        "--keep-going",
        "--message-format=json",
        "--manifest-path",
        str(project / "Cargo.toml"),
    ]
    with console.status("cargo check on the compile-fail cases (after make lint: the cases alone, seconds)"):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=cargo_env())
    found: dict[str, tuple[list[str], str]] = {b: ([], "") for b in bins}
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        if msg.get("reason") != "compiler-message" or msg["target"]["name"] not in found:
            continue
        m = msg["message"]
        if m["level"] == "error" and m.get("code"):
            codes, first = found[msg["target"]["name"]]
            codes.append(m["code"]["code"])
            if not first:
                found[msg["target"]["name"]] = (codes, m["rendered"])
    if not any(codes for codes, _ in found.values()) and proc.returncode != 0:
        console.print(proc.stderr[-3000:])
    return found


def run(skip_compile_fail: bool = False, console: Optional[Console] = None) -> int:
    """Every section in turn; 1 if any expectation failed (each check is named in the output)."""
    console = console or Console()
    failures: list[str] = []

    def verdict(ok: bool, what: str) -> str:
        if not ok:
            failures.append(what)
        return "[green]as expected[/]" if ok else "[bold red]UNEXPECTED[/]"

    console.rule("[bold]1. The caller's tensor (inference)")
    _caller_aliasing(console, verdict)
    console.rule("[bold]2. Autograd (a textual-inversion loop)")
    _training(console, verdict)
    console.rule("[bold]3. The same bugs in Rust: refused by rustc")
    if skip_compile_fail:
        say(console, "[yellow]skipped (--skip-compile-fail)[/]")
    elif not checkout():
        say(
            console,
            "[yellow]skipped: rustc compiles the cases (tests/ui) against the crate's source, which only a "
            "source checkout has; run the demo in a clone to see this section[/]",
        )
    elif shutil.which("cargo") is None:
        say(console, "[bold red]needs cargo on PATH[/]")
        failures.append("compile-fail: no cargo")
    else:
        _compile_fail(console, verdict)
    console.rule("[bold]4. The runtime mirror at the Python boundary (RustBlock)")
    _runtime_mirror(console, verdict)
    console.rule("[bold]5. Every alias route: PyTorch, rustc, run time (live)")
    _alias_routes(console, verdict)
    console.rule("[bold]6. The borrow checker's verdict on the PyTorch code (plusequals.audit)")
    _audit(console, verdict)

    console.rule()
    if failures:
        say(console, f"[bold red]{len(failures)} expectation(s) failed:[/] {', '.join(failures)}")
        return 1
    say(console, "[bold green]every bug reproduced in PyTorch and refused in Rust, as expected[/]")
    return 0


def _caller_aliasing(console: Console, verdict) -> None:
    say(console, "A caller keeps [cyan]skip = x[/], calls the block, then reads [cyan]skip[/].\n")
    t = TerminalTable("strategy", "caller's x after the call", "max |change|", "check")
    for s in STRATEGIES:
        r = bugs.caller_aliasing(s)
        seen = "[red]MUTATED[/]" if r.caller_mutated else "unchanged"
        ok = r.caller_mutated == bugs.EXPECTED[s].caller_mutated
        t.add_row(s, seen, f"{r.max_change:.3g}", verdict(ok, f"aliasing/{s}"))
    t.print(console)
    shares = bugs.copy_copy_shares_storage()
    say(console, f"copy.copy(x) shares x's storage: [bold]{shares}[/] ({verdict(shares, 'copy.copy')})\n")


def _training(console: Console, verdict) -> None:
    say(
        console,
        "learnable embedding -> block -> MSE -> backward -> SGD step, 3 steps; then with CompVis checkpointing.\n",
    )
    t = TerminalTable("strategy", "checkpoint", "result", "check", key=(0, 1, -1))
    for ckpt in (False, True):
        for s in STRATEGIES:
            r = bugs.textual_inversion(s, checkpoint=ckpt)
            e = bugs.EXPECTED[s]
            want = e.training_checkpointed if ckpt else e.training
            ok = (r.error is None and r.embedding_moved) if want is None else (r.error or "").startswith(want)
            shown = "[green]trains[/]" if r.error is None else f"[red]{escape(first_line(r.error))}[/]"
            t.add_row(s, "checkpointed" if ckpt else "plain", shown, verdict(ok, f"training/{s}/checkpoint={ckpt}"))
    t.print(console)
    msg = bugs.leaf_iadd()
    ok = verdict(msg.startswith(bugs.LEAF), "leaf")
    say(console, f"iadd on a leaf that requires grad: [red]{escape(first_line(msg))}[/] ({ok})\n")


def _compile_fail(console: Console, verdict) -> None:
    cases = read_cases()
    found = check_cases(cases, console)
    cpp = {name: (happened, what) for name, happened, what in _rust.cpp_gallery()}
    columns = ("case (tests/ui/)", "PyTorch bug it mirrors", "expected", "rustc said", "fixed twin")
    t = TerminalTable(*columns, "C++ (cpp/gallery.cpp)", "check")
    for c in cases:
        codes, _ = found[c.name]
        twin_codes, _ = found[f"{c.name}_fixed"]
        happened, _ = cpp.get(c.name, (False, "missing"))
        ok = codes[:1] == [c.code] and not twin_codes and happened
        cpp_cell = "compiles; bug at run time" if happened else "[red]no bug?[/]"
        twin = "compiles" if not twin_codes else ", ".join(twin_codes)
        t.add_row(
            c.name, c.mirrors, c.code, ", ".join(codes) or "compiled!", twin, cpp_cell, verdict(ok, f"rustc/{c.name}")
        )
    t.print(console)
    for c in cases:
        codes, rendered = found[c.name]
        if rendered:  # whole, as rustc prints it: the use after the move is the diagnostic's last label
            say(console, f"[bold]{c.name}.rs[/]")
            console.print(rendered.rstrip(), markup=False, highlight=False, soft_wrap=True)
    say(
        console,
        "\nrustc sees Rust values and borrows only. A second handle made by tch (shallow_clone, detach, a view), "
        "autograd's saved tensors and memory owned by numpy are invisible to it: section 5 shows run time taking over.",
    )


def _alias_routes(console: Console, verdict) -> None:
    say(
        console,
        "Each way to reach x's memory through a second name that this demo runs. Run time: what "
        "forward_owned / add_in_place / a donation did just now (rust/aliases.rs, plusequals.twin.aliases).\n",
    )
    t = TerminalTable("route", "PyTorch +=", "rustc", "run time (now)", "check")
    not_run = 0
    for stated, row in zip(aliases.TABLE, aliases.table_rows()):
        if not stated.run_time.startswith(("rust:", "py:")):
            not_run += 1
            continue
        check = verdict(aliases.expected_outcome(row, row.run_time), f"alias/{row.route}")
        cells = (from_markdown(cell) for cell in (row.route, row.pytorch, row.rustc, row.run_time))
        t.add_row(*cells, check)
    t.print(console)
    say(
        console,
        f"{not_run} more routes (autograd, functorch, dispatch modes, ...) are checked by their tests, not run "
        'here: README.md, "The alias catalogue".',
    )


def _audit(console: Console, verdict) -> None:
    from ..cases import project as cases
    from .audit import print_findings

    say(
        console,
        "plusequals.audit(model, *args) runs the PyTorch model once and names, with rustc's codes, each write "
        "into a tensor a module was given that someone else still holds (E0596), each read of a name after that "
        "write moved its value (E0382) and each write into a tensor autograd saved (E0502); a write into a "
        "temporary nothing else holds is a move, as in Rust, not a finding. The seed's iadd in a UNet level "
        "that keeps the block's input for its skip, then in textual-inversion training:\n",
    )
    for setting in ("skip", "training"):
        report = cases.strategy_audit("iadd", setting)
        say(console, f"[bold]iadd, {setting}[/]: {report.summary()}")
        print_findings(console, report)
        ok = cases.agreement("iadd", setting, report) is None
        say(console, f"agrees with what PyTorch does (bugs.EXPECTED): {verdict(ok, f'audit/iadd/{setting}')}\n")
    clean = cases.strategy_audit("op_plus_x", "training")
    say(console, f"op_plus_x, training: {clean.summary()} ({verdict(clean.clean, 'audit/op_plus_x')})")
    say(console, "All strategies, checkpointing and a diffusers UNet: [cyan]python -m plusequals audit[/].")


def _runtime_mirror(console: Console, verdict) -> None:
    block = bugs.small_block()
    rust = RustBlock.from_torch(block)
    x, c = torch.randn(2, 16, 32), torch.randn(2, 7, 24)
    try:
        rust.forward_owned(x.clone().requires_grad_(True), c)
        ok, text = False, "accepted!"
    except RuntimeError as e:
        ok, text = "requires grad while grad mode is on" in str(e), str(e)
    say(
        console, f"forward_owned(x requiring grad) -> [red]{escape(first_line(text))}[/] ({verdict(ok, 'mirror/grad')})"
    )
    with torch.no_grad():
        keep = x.clone()
        rust.forward_owned(x, c)
        say(
            console,
            f"forward_owned(x, donate=False): caller's x unchanged: {torch.equal(x, keep)} "
            f"({verdict(torch.equal(x, keep), 'mirror/copy')})",
        )
        rust.forward_owned(x, c, donate=True)
        try:
            x.sum()
            ok, text = False, "x still usable!"
        except RuntimeError as e:
            ok, text = "donated" in str(e), str(e)
    say(console, f"x.sum() after donate=True -> [red]{escape(first_line(text))}[/] ({verdict(ok, 'mirror/donate')})")
