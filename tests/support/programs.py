"""A user's program run as its own process: a fresh interpreter, with faulthandler on (a crash
prints its stack) and this checkout's package first on its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PACKAGE = str(Path(__file__).resolve().parents[2] / "python")


def package_path() -> str:
    """``PYTHONPATH`` with the checkout's package first."""
    return PACKAGE + os.pathsep + os.environ.get("PYTHONPATH", "")


def python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -X faulthandler *args`` in ``cwd``, its output captured as text."""
    env = {**os.environ, "PYTHONPATH": package_path()}
    command = [sys.executable, "-X", "faulthandler", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)


# The seed's bug in a user's program: a module whose forward adds its residual into its input
# (E0596 at line 11), which the programs the audit runs define first.
RESIDUAL = """\
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x += self.lin(x)
        return x
"""
