"""A user's program run as its own process, with faulthandler on (a crash prints its stack) and
this checkout's package first on its path: forked from a Python that has imported torch and
plusequals already (support.preloaded) with the same environment, or a fresh interpreter where the
fork cannot stand for one (another interpreter option, or ``fresh=True``)."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

PACKAGE = str(Path(__file__).resolve().parents[2] / "python")
SERVER = str(Path(__file__).resolve().with_name("preloaded.py"))
# Set by pytest for each test; the server's and the program's environments may differ in it alone.
PER_TEST = ("PYTEST_CURRENT_TEST",)


def package_path() -> str:
    """``PYTHONPATH`` with the checkout's package first."""
    return PACKAGE + os.pathsep + os.environ.get("PYTHONPATH", "")


def python(cwd: Path, *args: str, timeout: Optional[float] = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -X faulthandler *args`` in ``cwd``, its output captured as text; ``timeout``: as
    subprocess.run's. ``fresh``: a new interpreter even where the preloaded one could fork it
    (a program that must not find torch or plusequals imported)."""
    env = {**os.environ, "PYTHONPATH": package_path()}
    command = [sys.executable, "-X", "faulthandler", *args]
    if not fresh and _forkable(args):
        with _LOCK:  # one request at a time on the server's pipe
            return _server(env).run(command, list(args), Path(cwd), env, timeout)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _forkable(args: tuple[str, ...]) -> bool:
    """A script, ``-m module`` or ``-c code``, with no other interpreter option."""
    return bool(args) and (args[0] in ("-c", "-m") and len(args) > 1 or not args[0].startswith("-"))


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in PER_TEST} == {k: v for k, v in b.items() if k not in PER_TEST}


class _Server:
    """support/preloaded.py, started with ``env``: each run is one request on its control pipe."""

    def __init__(self, env: dict) -> None:
        self.env = env
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, env=env, bufsize=0,
        )  # fmt: skip
        if self.proc.stdout.readline() != b"ready\n":
            self.proc.wait()
            self.log.seek(0)
            raise RuntimeError(f"the preloaded Python did not start:\n{self.log.read().decode(errors='replace')}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(
        self, command: list, argv: list, cwd: Path, env: dict, timeout: Optional[float]
    ) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="program-") as d:
            out, err = Path(d, "stdout"), Path(d, "stderr")
            out.touch()
            err.touch()
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            pid = int(self.proc.stdout.readline())
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
                self.proc.stdout.readline()
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            code = int(self.proc.stdout.readline())
            return subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


_LOCK = threading.Lock()
_SERVERS: dict[int, _Server] = {}  # this process's server (a forked test process starts its own)


def _server(env: dict) -> _Server:
    """This process's server for ``env``, started on first use, and again when the environment
    changes (a test set a variable: Python, libgomp and torch read it when they start)."""
    server = _SERVERS.get(os.getpid())
    if server is not None and server.alive() and _same(server.env, env):
        return server
    if server is not None:
        server.close()
    server = _SERVERS[os.getpid()] = _Server(env)
    return server


@atexit.register
def _close() -> None:
    server = _SERVERS.pop(os.getpid(), None)
    if server is not None:
        server.close()


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
