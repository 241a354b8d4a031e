"""The command line: ``python -m plusequals demo | report | summary | audit | audit run``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .helptext import PhraseFormatter

_AUDIT_USAGE = (
    "python -m plusequals audit run [options] (SCRIPT | -m MODULE) [ARGS...]\n"
    "       python -m plusequals audit [--models] [--markdown] [--json]"
)


def _add_audit(sub: Any) -> None:
    audit = sub.add_parser(
        "audit",
        usage=_AUDIT_USAGE,
        formatter_class=PhraseFormatter,
        help="'audit run SCRIPT': rustc's verdicts on your PyTorch program; 'audit': on the project's code",
        description="python -m plusequals audit run [options] SCRIPT [ARGS...] (or -m MODULE) runs your program "
        "and audits every outermost nn.Module call it makes: see audit run --help. Without run: the borrow "
        "checker's verdicts on the project's own PyTorch code (plusequals.audit), with these options.",
    )
    audit.add_argument("--models", action="store_true", help="audit the real models, full size on the meta device")
    audit.add_argument(
        "--markdown", action="store_true", help="the README's table (of the strategies, or with --models of the models)"
    )
    audit.add_argument("--json", action="store_true", help="the strategies' reports as JSON on stdout")


def _hint_run(program: list[str]) -> int:
    """``audit train.py``: argparse's error, and the command that audits the program."""
    print(f"usage: {_AUDIT_USAGE}", file=sys.stderr)
    print(f"python -m plusequals audit: error: unrecognized arguments: {' '.join(program)}", file=sys.stderr)
    print(f"hint: to audit your program, run: python -m plusequals audit run {' '.join(program)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["audit", "run"]:  # the program's own options follow: not for this parser
        from .run import main as audit_run

        return audit_run(argv[2:])
    if argv[:1] == ["audit"] and len(argv) > 1 and not argv[1].startswith("-"):  # audit train.py
        return _hint_run(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m plusequals",
        description="The += block in PyTorch, Rust and C++: its bugs live, the report, the audit.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="each += bug live in PyTorch, each refused by rustc")
    demo.add_argument("--skip-compile-fail", action="store_true", help="do not run cargo on tests/ui")
    report = sub.add_parser("report", help="the benchmark report: REPORT.md, results.json, plots")
    report.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available, else cpu")
    size = report.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        default=None,
        help="small shapes, about two minutes on 2 CPU cores (the CPU default)",
    )
    size.add_argument(
        "--full", dest="quick", action="store_false", help="SD v1 shapes (the CUDA default; long on a CPU)"
    )
    report.add_argument(
        "--smoke",
        action="store_true",
        help="every section with the fewest rounds and one-call samples: checks that the report runs "
        "end to end (the tests use it); its numbers are not measurements",
    )
    report.add_argument("--out", default="report", help="output directory (default: ./report)")
    report.add_argument("--no-unet", action="store_true", help="skip the full-UNet-step comparison")
    report.add_argument(
        "--no-audit-cost", action="store_true", help="skip the audit's cost on each model family's train step"
    )
    report.add_argument(
        "--no-compile", action="store_true", help="skip torch.compile (its compile time dominates a GPU run)"
    )
    report.add_argument(
        "--no-compilers", action="store_true", help="skip the JAX and ONNX Runtime rows (extra plusequals[compilers])"
    )
    output = report.add_mutually_exclusive_group()
    output.add_argument(
        "--quiet",
        dest="output",
        action="store_const",
        const="quiet",
        help="no progress, no summary: print REPORT.md's path",
    )
    output.add_argument(
        "--json",
        dest="output",
        action="store_const",
        const="json",
        help="no progress: print the summary as JSON on stdout",
    )
    _add_audit(sub)
    summary = sub.add_parser("summary", help="the verdicts and targets of a finished report, again")
    summary.add_argument("dir", nargs="?", default="report", help="the report's directory (default: ./report)")
    summary.add_argument("--json", action="store_true", help="the summary as JSON on stdout")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(skip_compile_fail=args.skip_compile_fail)
    if args.command == "audit":
        from .audit import main as run_audit

        return run_audit(args.models, args.markdown, args.json)
    if args.command == "summary":
        from .summary import main as show_summary

        return show_summary(args.dir, args.json)
    from .report import run as run_report

    return run_report(
        device=args.device,
        quick=args.quick,
        out=args.out,
        unet=not args.no_unet,
        compile=not args.no_compile,
        compilers_flag=not args.no_compilers,
        audit_cost=not args.no_audit_cost,
        output=args.output or "rich",
        smoke=args.smoke,
    )
