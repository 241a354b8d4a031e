"""``python -m plusequals audit run [options] SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``):
runs a program as ``__main__`` with its own ``sys.argv``, as ``python -m cProfile`` does, and
audits every outermost ``nn.Module`` call it makes (:class:`plusequals.auditing.scope.AuditScope`).

The program's output is its own; the audit's goes to ``--output FILE`` or to stderr. The exit
status: the program's own when it failed (a nonzero ``sys.exit``, or 1 when it raised: its
traceback is printed and the findings up to the error are reported), else 1 when the audit
found errors, else 0 (an unused allow is a warning: it does not fail the run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
import traceback
from types import TracebackType
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..auditing.diagnostics import build, render
from ..auditing.sarif import to_json, to_sarif
from ..auditing.scope import AuditScope
from .helptext import PhraseFormatter

_VALUED = ("--format", "--output", "-o", "--root")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m plusequals audit run",
        usage="%(prog)s [options] (SCRIPT | -m MODULE) [ARGS...]",
        formatter_class=PhraseFormatter,
        description="Runs a program as __main__ with its own sys.argv (as python -m cProfile does) and audits "
        "every outermost nn.Module call it makes: rustc's verdicts E0596, E0382, E0502, E0499, with their lines.",
        epilog="The program's output is its own; the audit's goes to --output FILE, else to stderr. Exit status: "
        "the program's own if it failed (1 if it raised), else 1 when the audit found errors, else 0.",
    )
    p.add_argument("--backward", action="store_true", help="also a backward from each call's outputs that need grad")
    p.add_argument("--format", choices=["text", "json", "sarif"], default="text", help="default: text (rustc's)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the audit's output here (default: stderr)")
    p.add_argument("--moves", action="store_true", help="also list the moves (writes into temporaries)")
    p.add_argument(
        "--root", metavar="DIR", help="SARIF: URIs relative to DIR (default: the git work tree, else the cwd)"
    )
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module as python -m MODULE does")
    return p


def split(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """The audit's options, and the program: ``[SCRIPT, *ARGS]`` or ``[-m, MODULE, *ARGS]``
    (everything after the script or module is the program's, as for ``python``)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if argv[i] == "-m":
            return list(argv[:i]), list(argv[i:])
        i += 2 if argv[i] in _VALUED else 1
    return list(argv[:i]), list(argv[i:])


def _trimmed(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """The traceback from the program's first frame on (runpy's and the audit's left out)."""
    here = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(runpy.__file__))
    here += ("<frozen runpy>",)
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(here):
        tb = tb.tb_next
    return tb


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_program(scope: AuditScope, program: List[str]) -> int:
    """Runs the program under ``scope``; its exit status (1 when it raised, as ``python`` does)."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    module = program[1] if program[0] == "-m" else None
    sys.argv = program[1:] if module else program[:]
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(program[0])))
    try:
        with scope:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(os.path.abspath(program[0]), run_name="__main__")
        return 0
    except SystemExit as e:
        return _exit_status(e.code)
    except BaseException as e:  # the program's own error: printed as python prints it
        traceback.print_exception(type(e), e, _trimmed(e.__traceback__))
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def program_files(program: List[str]) -> List[str]:
    """The script's file, or the module's (its ``__main__`` for a package): allows there count."""
    if program[0] != "-m":
        return [os.path.abspath(program[0])]
    try:
        spec = importlib.util.find_spec(program[1])
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(program[1] + ".__main__")
    except (ImportError, ValueError):
        return []
    return [spec.origin] if spec is not None and spec.origin else []


def _watched(scope: AuditScope) -> Dict[str, Any]:
    """What the JSON adds about the calls: those not audited, the workers', the transforms'."""
    workers = {kind: {"processes": len(pids)} for kind, pids in scope.workers.items()}
    for c in scope.calls:
        if c.worker is not None:
            workers[c.worker]["calls"] = workers[c.worker].get("calls", 0) + 1
    transforms = sum(c.transform for c in scope.calls)
    return {"not_audited": scope.not_audited, "workers": workers, "transform_calls": transforms}


def write(
    options: argparse.Namespace,
    calls: List[Tuple[str, Any]],
    unused: List[Tuple[str, str]],
    statuses: Tuple[int, int],
    scope: AuditScope,
) -> None:
    """The audit's output; ``statuses``: the program's exit status and the audit's own (what
    ``audit run`` exits with)."""
    not_audited = scope.not_audited
    program, tool = statuses
    out = open(options.output, "w") if options.output else sys.stderr
    try:
        if options.format == "text":
            color = None if not options.output else False
            render(calls, unused, options.moves, file=out, color=color, not_audited=not_audited, notes=scope.notes())
        elif options.format == "json":
            extra = {"program_exit_status": program, "audit_exit_status": tool, **_watched(scope)}
            out.write(json.dumps(to_json(calls, unused, options.moves, **extra), indent=1) + "\n")
        else:  # SARIF's exitCode is the tool's; the program's is a property of the invocation
            invocation = {"exitCode": tool, "properties": {"programExitCode": program}}
            log = to_sarif(calls, unused, not_audited, root=options.root, **invocation)
            out.write(json.dumps(log, indent=1) + "\n")
    finally:
        if options.output:
            out.close()


def main(argv: Sequence[str]) -> int:
    mine, program = split(argv)
    p = parser()
    options = p.parse_args(mine + (program[:2] if program[:1] == ["-m"] else []))
    if not program or (program[0] == "-m" and len(program) < 2):
        p.error("a SCRIPT or -m MODULE to run is required")
    if not options.module and program[0] != "-m" and not os.path.exists(program[0]):
        p.error(f"no such file: {program[0]}")
    scope = AuditScope(backward=options.backward)
    status = run_program(scope, program)
    unused = scope.finish(program_files(program))
    calls = [(c.module, c.report) for c in scope.calls]
    errors = any(d.level == "error" for d in build(calls, unused))
    tool = status if status != 0 else (1 if errors else 0)
    write(options, calls, unused, (status, tool), scope)
    return tool
