"""Worker processes: the calls a scope's program makes in the processes it starts are audited
there and merged into the parent's report, never silently dropped.

A forked child (``multiprocessing``'s fork, ``DataLoader`` workers on Linux) inherits the open
scope: :func:`_after_fork` (``os.register_at_fork``) turns it into the child's own, which audits
the child's outermost calls and appends each to a file of its own in a directory the parent
owns. A spawned child (``multiprocessing``'s spawn) is a fresh
interpreter: while a scope is open, ``multiprocessing.spawn.get_command_line`` starts it with
``scope.child`` first, which opens a scope that does the same. The parent reads the files when the
scope closes (:meth:`Children.collect`). A line is written per call, whole, so a child that
ends by ``os._exit`` (as forked workers do) loses nothing; a child killed mid-call loses that
call.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing.context
import multiprocessing.spawn
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional

from . import sites
from .report import AuditReport, Finding

__all__ = ["Children", "dump", "load"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ORIGINAL_COMMAND_LINE: Callable[..., List[str]] = multiprocessing.spawn.get_command_line
_OPEN: List["Children"] = []  # the open scope's, in this process
_FORK_HOOKED = False


# A spawned child's first lines: the audit alone, under a bare ``plusequals`` package that is
# dropped at once (the whole package imports Dynamo: ten seconds a worker), then its scope.
_START = """\
import sys, types
_pe = "plusequals" not in sys.modules
if _pe:
    sys.modules["plusequals"] = types.ModuleType("plusequals")
    sys.modules["plusequals"].__path__ = [{root!r} + "/plusequals"]
from plusequals.auditing.scope import child
if _pe:
    del sys.modules["plusequals"]
child({dir!r}, {backward!r})
"""


def dump(path: str, kind: str, call: Any, files: List[str]) -> None:
    """Appends one call of a child (a ``scope.AuditedCall``) to its file, as one JSON line
    (written whole): an audited call's report, or with no report a call not audited (its
    ``module`` says why)."""
    record = {"kind": kind, "pid": os.getpid(), "module": call.module, "caller": call.caller, "files": files}
    record["transform"] = call.transform
    record["sites"] = {}
    if call.report is not None:
        record |= dataclasses.asdict(call.report)
        found = [*call.report.findings, *call.report.moves, *call.report.allowed]
        record["sites"] = sites.export([w for f in found for w in (f.where, f.read_at)])
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:  # the parent's scope has ended (a worker that outlived the program)
        pass


def load(line: str) -> Optional[Dict[str, Any]]:
    """A line of :func:`dump` back: ``kind``, ``pid``, ``module``, ``caller``, ``files``,
    ``sites`` (what the child knew of its findings' lines: :func:`.sites.export`) and the
    ``report`` (None for a call not audited); None for a line cut short (a child killed while
    writing)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    keys = ("kind", "pid", "module", "caller", "files", "transform", "sites")
    if "findings" not in record:
        return {**{k: record[k] for k in keys}, "report": None}
    fields = {f.name for f in dataclasses.fields(AuditReport)}
    report = AuditReport(**{k: v for k, v in record.items() if k in fields})
    report.findings = [Finding(**f) for f in record["findings"]]
    report.moves = [Finding(**f) for f in record["moves"]]
    report.allowed = [Finding(**f) for f in record["allowed"]]
    report.unused_allows = [tuple(u) for u in record["unused_allows"]]  # type: ignore[misc]
    return {**{k: record[k] for k in keys}, "report": report}


class Children:
    """The parent's side: the directory the children write into, and the spawn command line."""

    def __init__(self, backward: bool, on_fork: Callable[[str, str], None]) -> None:
        self.dir = ""
        self.backward = backward
        self.on_fork = on_fork  # in a forked child: the inherited scope becomes the child's
        # the processes a forkserver started: forked from a server that has no scope, so not
        # audited; counted, never silently dropped
        self.forkserver = 0
        self._popen: Any = None

    def __enter__(self) -> "Children":
        global _FORK_HOOKED
        self.dir = tempfile.mkdtemp(prefix="plusequals-audit-")
        if not _FORK_HOOKED:  # once per process: a registration cannot be undone
            os.register_at_fork(after_in_child=_after_fork)
            _FORK_HOOKED = True
        _OPEN.append(self)
        multiprocessing.spawn.get_command_line = self._command_line  # type: ignore[assignment]
        server = getattr(multiprocessing.context, "ForkServerProcess", None)
        if server is not None:
            self._popen = server.__dict__["_Popen"]
            original = self._popen.__func__

            def counted(process_obj: Any) -> Any:
                self.forkserver += 1
                return original(process_obj)

            server._Popen = staticmethod(counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        multiprocessing.spawn.get_command_line = _ORIGINAL_COMMAND_LINE  # type: ignore[assignment]
        if self._popen is not None:
            multiprocessing.context.ForkServerProcess._Popen = self._popen  # type: ignore[attr-defined]
            self._popen = None
        _OPEN.remove(self)

    def _command_line(self, **kwds: Any) -> List[str]:
        line = _ORIGINAL_COMMAND_LINE(**kwds)
        if "-c" in line:
            at = line.index("-c") + 1
            line[at] = _START.format(root=_PACKAGE_ROOT, dir=self.dir, backward=self.backward) + line[at]
        return line

    def collect(self) -> List[Dict[str, Any]]:
        """What the children audited (see :func:`load`), in the order each wrote; the directory
        is removed."""
        found: List[Dict[str, Any]] = []
        try:
            for name in sorted(os.listdir(self.dir)):
                with open(os.path.join(self.dir, name)) as f:
                    found += [r for line in f if (r := load(line)) is not None]
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        return found


def _after_fork() -> None:
    if _OPEN:
        _OPEN[-1].on_fork("fork", _OPEN[-1].dir)
