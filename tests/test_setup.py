"""What a newcomer is told when `make` cannot set up: scripts/preflight.sh and scripts/step.sh
each end in one line that says what is missing and how to get it. Simulated with a PATH that
lacks the tool, a fake interpreter, a fake venv, and a fake pip that cannot reach PyPI."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PREFLIGHT = REPO / "scripts" / "preflight.sh"
STEP = REPO / "scripts" / "step.sh"


def fake_bin(tmp_path: Path, have=("python3", "cargo", "g++"), scripts=None) -> Path:
    """A bin dir holding only `have` (linked to the real tools) and `scripts` (name -> bash)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "tail", "sed", "grep", "mkdir", *have):
        # python3: the real interpreter behind this venv (a pyenv shim needs pyenv on PATH)
        real = os.path.realpath(sys.executable) if tool == "python3" else shutil.which(tool)
        if real:
            (bin_dir / tool).symlink_to(real)
    for name, body in (scripts or {}).items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def preflight(tmp_path, bin_dir, venv=None, **env):
    venv = venv or tmp_path / "no-venv"
    proc = subprocess.run(
        [str(bin_dir / "bash"), str(PREFLIGHT), str(venv)],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir), **env},
    )
    return proc.returncode, proc.stderr.strip().splitlines()


def test_a_healthy_machine_passes(tmp_path):
    assert preflight(tmp_path, fake_bin(tmp_path)) == (0, [])


@pytest.mark.parametrize(
    "missing, words",
    [("cargo", ["Rust toolchain", "rustup"]), ("g++", ["C++ compiler", "apt-get install g++"])],
)
def test_a_missing_tool_is_one_line_saying_how_to_get_it(tmp_path, missing, words):
    have = [t for t in ("python3", "cargo", "g++") if t != missing]
    rc, lines = preflight(tmp_path, fake_bin(tmp_path, have=have))
    assert rc == 1 and len(lines) == 1, lines
    assert all(w in lines[0] for w in words), lines


def test_an_old_python_is_named_with_its_version(tmp_path):
    bin_dir = fake_bin(tmp_path, have=("cargo", "g++"), scripts={"python3": "echo 3.9; exit 0"})
    rc, lines = preflight(tmp_path, bin_dir)
    assert rc == 1 and len(lines) == 1 and "Python 3.9" in lines[0] and ">= 3.11" in lines[0], lines


def test_another_torch_in_the_venv_says_how_to_fix_it(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/bash\necho 2.10.0\n")
    (venv / "bin" / "python").chmod(0o755)
    rc, lines = preflight(tmp_path, fake_bin(tmp_path), venv=venv)
    assert rc == 1 and len(lines) == 1 and "torch 2.10.0" in lines[0] and "make clean" in lines[0], lines


def test_no_network_for_pip_is_diagnosed_in_one_line(tmp_path):
    pip = "echo \"WARNING: Retrying ... NewConnectionError('Failed to establish a new connection')\" >&2; exit 1"
    bin_dir = fake_bin(tmp_path, scripts={"pip": pip})
    log = tmp_path / "setup.log"
    proc = subprocess.run(
        [str(bin_dir / "bash"), str(STEP), "venv: pip install torch", str(log), "pip", "install", "torch"],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir)},
    )
    assert proc.returncode == 1
    diagnosis = [ln for ln in proc.stdout.splitlines() if ln.startswith("make: no network")]
    assert len(diagnosis) == 1 and "PyPI" in diagnosis[0], proc.stdout
    assert f"the whole log is {log}" in proc.stdout and "NewConnectionError" in log.read_text()


def test_a_step_that_works_prints_one_line(tmp_path):
    bin_dir = fake_bin(tmp_path, scripts={"work": "echo lots of output; echo more"})
    proc = subprocess.run(
        [str(bin_dir / "bash"), str(STEP), "build: something", str(tmp_path / "log"), "work"],
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir)},
    )
    assert proc.returncode == 0 and proc.stdout.startswith("build: something ... ok") and proc.stdout.count("\n") == 1
    assert os.path.exists(tmp_path / "log")


@pytest.mark.parametrize("xdg", [True, False], ids=["XDG_CACHE_HOME", "HOME"])
def test_make_and_the_demo_share_one_build_cache(tmp_path, monkeypatch, xdg):
    """The Makefile's CACHE (cargo's target dir, ccache, the venv link) and the demo's cargo runs
    (plusequals.cli.demo.build_cache) follow one rule, so pytest's cargo runs reuse make's builds."""
    from plusequals.cli import demo

    env = {k: v for k, v in os.environ.items() if k not in ("CARGO_TARGET_DIR", "CCACHE_DIR", "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path / "home")
    if xdg:
        env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    printed = subprocess.run(
        [
            "make",
            "-s",
            "--no-print-directory",
            "--eval",
            "print-cache: ; @echo $(CACHE) $(CARGO_TARGET_DIR)",
            "print-cache",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for key in ("HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
        if key in env:
            monkeypatch.setenv(key, env[key])
    monkeypatch.delenv("CARGO_TARGET_DIR", raising=False)
    assert printed == [str(demo.build_cache()), str(demo.build_cache() / "target")]
    assert demo.cargo_env()["CARGO_TARGET_DIR"] == printed[1]
