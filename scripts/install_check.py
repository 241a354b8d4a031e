"""What a user does with an installed plusequals, run by scripts/test_install.sh in a fresh venv
(the wheel, then `pip install <repo>`), from a directory outside the repository.

1. The package imported is the installed one, and its extension runs on that venv's libtorch:
   every libtorch library mapped into the process lies under the venv's torch/lib, and so does
   every one that `ldd` finds through the extension's rpath alone.
2. The audit on a user's own script (written here into the working directory), through
   plusequals.audit and through `python -m plusequals audit run`: E0596 and E0502, both at the
   script's line that writes into the tensor it was given.
3. RustBlock against the PyTorch block, fp32 on the CPU, relative error <= 1e-5.
4. The README's quick start, as pasted, after the install the README names (the `diffusers`
   extra): it runs and prints the README's output.

Usage: python install_check.py [--same-as WHEEL]   (exit status 0 when every check holds; each
prints one line). ``--same-as``: where the installed extension is WHEEL's to the byte (a source
install that reused the wheel's build), 2 and 4's second Python processes would run the same
bytes again, and are left out; any other extension gets every check.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import zipfile

import torch

import plusequals
from plusequals import BasicTransformerBlock, RustBlock
from plusequals.model.blocks import randomize_

TOL = 1e-5

# The user's program: a gate that multiplies its input in place, a borrow it does not own.
USER_SCRIPT = """\
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, h):
        h.mul_(torch.sigmoid(self.proj(h)))
        return h


if __name__ == "__main__":
    Gate()(torch.randn(2, 8))
"""
WRITE_LINE = 11  # h.mul_(...) in USER_SCRIPT


def in_dir(path: str | pathlib.Path, folder: pathlib.Path) -> bool:
    return pathlib.Path(path).resolve().is_relative_to(folder)


def check_installed() -> None:
    site = pathlib.Path(torch.__file__).resolve().parent.parent
    package = pathlib.Path(plusequals.__file__).resolve()
    assert package.is_relative_to(site), f"plusequals from {package}, not from this venv's {site}"
    extension = pathlib.Path(plusequals._rust.__file__).resolve()
    maps = pathlib.Path("/proc/self/maps").read_text()
    loaded = {pathlib.Path(p).resolve() for p in re.findall(r"(/\S*/lib(?:torch|c10)\S*\.so\S*)", maps)}
    lib = site / "torch" / "lib"
    stray = sorted(str(p) for p in loaded if not in_dir(p, lib))
    assert loaded and not stray, f"libtorch libraries from outside {lib}: {stray}"
    # Loaded alone (no torch imported first), the extension's rpath finds this venv's libtorch.
    ldd = subprocess.run(["ldd", str(extension)], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"^\s*(lib(?:torch|c10)\S*\.so) => (\S+)", ldd, re.M))
    elsewhere = sorted(f"{name} => {path}" for name, path in found.items() if not in_dir(path, lib))
    assert "libtorch.so" in found and not elsewhere, f"the rpath resolves outside {lib}: {elsewhere or ldd}"
    print(f"installed: {package.parent} (extension {extension.name}), {len(loaded)} libtorch libraries from {lib}")


def check_audit(workdir: pathlib.Path) -> None:
    """The audit on the user's script through the API: its module imported, its model audited
    with plusequals.audit(model, x)."""
    script = workdir / "user_model.py"
    script.write_text(USER_SCRIPT)
    sys.path.insert(0, str(workdir))
    try:
        import user_model
    finally:
        sys.path.remove(str(workdir))
    report = plusequals.audit(user_model.Gate(), torch.randn(2, 8))
    found = sorted((f.code, pathlib.Path(f.where).name) for f in report.findings)
    # E0596: the write into the borrowed h; E0502: into h after nn.Linear saved it for backward.
    wanted = [(code, f"{script.name}:{WRITE_LINE}") for code in ("E0502", "E0596")]
    assert found == wanted, f"audit found {found}, wanted {wanted}"
    print(f"audit: {', '.join(code for code, _ in found)} at {script.name}:{WRITE_LINE}")


def check_audit_run(workdir: pathlib.Path) -> None:
    """The same script run by `python -m plusequals audit run`: exit 1, with both errors at the write."""
    script = workdir / "user_model.py"
    script.write_text(USER_SCRIPT)
    argv = [sys.executable, "-m", "plusequals", "audit", "run", script.name]
    run = subprocess.run(argv, cwd=workdir, text=True, capture_output=True)
    said = run.stdout + run.stderr
    assert run.returncode == 1, f"audit run exited {run.returncode} (1: findings):\n{said}"
    for code in ("E0596", "E0502"):
        assert f"error[{code}]" in said, f"no {code}:\n{said}"
    assert f"{script.name}:{WRITE_LINE}" in said, f"not at line {WRITE_LINE}:\n{said}"
    print(f"audit run: E0502, E0596 at {script.name}:{WRITE_LINE}, exit 1")


def check_parity() -> None:
    block = randomize_(BasicTransformerBlock(80, 8, 10, context_dim=192), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(2, 64, 80, generator=g), torch.randn(2, 77, 192, generator=g)
    with torch.no_grad():
        expected = block(x, c)
        got = RustBlock.from_torch(block).forward(x, c)
    err = ((got - expected).norm() / expected.norm()).item()
    assert err <= TOL, f"RustBlock vs PyTorch: relative error {err:.2e} > {TOL}"
    print(f"parity: RustBlock vs BasicTransformerBlock, relative error {err:.1e} <= {TOL}")


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def between(text: str, name: str) -> str:
    """The fenced block between ``<!-- name -->`` and ``<!-- /name -->``."""
    block = text.split(f"<!-- {name} -->", 1)[1].split(f"<!-- /{name} -->", 1)[0]
    return block.split("```", 2)[1].split("\n", 1)[1]


def check_quick_start(workdir: pathlib.Path) -> None:
    """The README's quick start, pasted into a file of the user's and run with this venv's Python."""
    text = README.read_text()
    script = workdir / "quick_start.py"
    script.write_text(between(text, "quick-start"))
    run = subprocess.run([sys.executable, script.name], cwd=workdir, text=True, capture_output=True)
    assert run.returncode == 0, f"the quick start failed (exit {run.returncode}):\n{run.stdout}{run.stderr[-3000:]}"
    assert run.stdout == between(text, "quick-start-output"), f"printed:\n{run.stdout}"
    print(f"quick start: runs as pasted, prints the README's {len(run.stdout.splitlines())} lines")


def same_extension(wheel: pathlib.Path) -> bool:
    """Whether the installed extension is byte for byte the one in ``wheel``."""
    installed = pathlib.Path(plusequals._rust.__file__).resolve()
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/" + installed.name)]
        same = z.read(name) == installed.read_bytes()
    print(f"extension: {'the same bytes as' if same else 'not'} {wheel.name}'s {name}")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--same-as", type=pathlib.Path, help="the wheel whose extension makes 2 and 4 repeats")
    args = parser.parse_args()
    check_installed()
    repeat = args.same_as is not None and same_extension(args.same_as)
    check_audit(pathlib.Path.cwd())
    if not repeat:
        check_audit_run(pathlib.Path.cwd())
    check_parity()
    if not repeat:
        check_quick_start(pathlib.Path.cwd())


if __name__ == "__main__":
    main()
