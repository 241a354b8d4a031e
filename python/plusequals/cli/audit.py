"""``python -m plusequals audit``: the borrow checker's verdicts on the project's PyTorch code.

The seven residual strategies in a UNet-skip harness, in textual-inversion training and under
CompVis checkpointing, checked against ``bugs.EXPECTED``; a small diffusers UNet with the seed's
``+=`` patched into its transformer blocks, and without it. ``--models``: the real models, full
size on the meta device. Exits non-zero if a verdict disagrees with what PyTorch does.
"""

from __future__ import annotations

import json
from typing import List, Optional, Tuple

from rich.console import Console

from ..auditing import AuditReport, Finding
from ..cases import project as C
from .terminal import TerminalTable


def _codes(report: AuditReport) -> str:
    found = ", ".join(f"{c} x{len(report.by_code(c))}" for c in report.codes)
    return found or ("no findings" if report.error or report.backward_error else "clean")


def _pytorch(strategy: str, setting: str) -> str:
    e = C.EXPECTED[strategy]
    if setting == "skip":
        return "mutates the caller's tensor" if e.caller_mutated else "caller's tensor intact"
    error = e.training_checkpointed if setting == "checkpointed" else e.training
    return error or "trains"


def strategies(console: Console, details: List[Tuple[str, Finding]]) -> int:
    """The 21 strategy audits; returns how many disagree with EXPECTED."""
    rows = TerminalTable("setting / strategy", "findings", "PyTorch alone", "verdict", key=(0, -1))
    bad = 0
    for setting, strategy, report, disagreement in C.all_strategy_audits():
        bad += disagreement is not None
        verdict = "[green]agrees[/]" if disagreement is None else f"[red]DISAGREES: {disagreement}[/]"
        rows.add_row(f"{setting} / {strategy}", _codes(report), _pytorch(strategy, setting), verdict)
        if strategy == "iadd":
            details += [(f"{setting} / {strategy}", f) for f in report.findings]
    console.rule("[bold]The residual strategies[/] (findings vs what PyTorch does, bugs.EXPECTED)")
    rows.print(console)
    return bad


def unets(console: Console, details: List[Tuple[str, Finding]]) -> int:
    """The small diffusers UNet, unpatched (must be clean) and with the seed's += (must give
    E0502 in training; in inference each += is a move: diffusers rebinds the block's output and
    never reads its input again); returns how many did not."""
    rows = TerminalTable("UNet2DConditionModel", "findings", "expected", "verdict", key=(0, -1))
    bad = 0
    for patched in (False, True):
        for training in (False, True):
            report = C.unet_audit(patched, training)
            want = {"E0502"} if patched and training else set()
            ok = set(report.codes) == want
            bad += not ok
            label = f"{'seed += patched' if patched else 'unpatched'}, {'training' if training else 'inference'}"
            rows.add_row(
                label, _codes(report), ", ".join(sorted(want)) or "clean", "[green]ok[/]" if ok else "[red]NO[/]"
            )
            if patched and training:
                details += [(label, f) for f in report.findings[:6]]
    console.rule("[bold]diffusers UNet2DConditionModel[/] (small config)")
    rows.print(console)
    return bad


def print_findings(console: Console, report: AuditReport) -> None:
    """One report's findings, legible at 80 columns (terminal.TerminalTable)."""
    rows = TerminalTable("code", "where", "module", "read at", "op", "message", key=(0, 1))
    for f in report.findings:
        rows.add_row(f.code, f.where, f.module or "(root)", f.read_at or "", f.op, f.message)
    rows.print(console)


def show_details(console: Console, details: List[Tuple[str, Finding]]) -> None:
    rows = TerminalTable("case", "code", "module", "where", "read at", "op", key=(0, 1))
    for case, f in details:
        rows.add_row(case, f.code, f.module or "(root)", f.where, f.read_at or "", f.op)
    console.rule("[bold]Findings, with their lines[/]")
    rows.print(console)


def _raised(report: AuditReport) -> str:
    """What the model raised, named by the substance bugs.py names it by."""
    substances = {
        C.VERSION_COUNTER: "version counter",
        C.VIEW_OF_LEAF: "view of a leaf",
        C.LEAF: "leaf",
        C.OUT_NO_AUTOGRAD: "`out=` under autograd",
    }
    for label, err in (("forward raises", report.error), ("backward raises", report.backward_error)):
        if err:
            return f"; {label}: " + next((v for k, v in substances.items() if k in err), err[:60])
    return ""


def strategies_markdown() -> str:
    """The README's table of the 21 strategy audits (``--markdown``)."""
    rows: dict = {}
    for setting, strategy, report, _ in C.all_strategy_audits():
        rows.setdefault(strategy, {})[setting] = _codes(report) + _raised(report)
    head = "| strategy | UNet skip, `no_grad` | textual inversion | CompVis checkpointing |"
    lines = [head, "|---|---|---|---|"]
    for strategy, cells in rows.items():
        lines.append(f"| `{strategy}` | " + " | ".join(cells[s] for s in C.SETTINGS) + " |")
    return "\n".join(lines)


def grouped(report: AuditReport) -> str:
    """Each code once: how many findings, in how many modules, at which lines."""
    parts = []
    for code in report.codes:
        found = report.by_code(code)
        modules = {f.module for f in found}
        wheres = ", ".join(sorted({f.where for f in found}))
        parts.append(f"{code} x{len(found)} in {len(modules)} module{'s' * (len(modules) > 1)}, at {wheres}")
    return "; ".join(parts) or "clean"


def models_markdown(reports: List[Tuple[C.RealModel, AuditReport]]) -> str:
    """The README's table of the real models (``--models --markdown``)."""
    lines = [
        "| model | audited | findings (forward and backward) | backward | ops | modules | module calls |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in reports:
        error = r.error or r.backward_error
        ran = "ran" if error is None else error.split(":")[0] + ": " + error.split(":")[1].strip()[:60] + "…"
        lines.append(f"| {m.name} | {m.source} | {grouped(r)} | {ran} | {r.ops} | {r.modules} | {r.calls} |")
    return "\n".join(lines)


def models(console: Console, markdown: bool) -> int:
    reports = [(m, C.real_model_audit(m)) for m in C.REAL_MODELS]
    if markdown:
        print(models_markdown(reports))
        return 0
    rows = TerminalTable("model", "findings", "what was watched", "verdict", key=(0, -1))
    bad = 0
    for m, r in reports:
        ok = set(r.codes) == m.expected and (m.expected or (r.error is None and r.backward_error is None))
        bad += not ok
        watched = f"{r.ops} ops, {r.modules} modules, {r.calls} calls (forward and backward)"
        rows.add_row(m.name, grouped(r), watched, "[green]as expected[/]" if ok else "[red]UNEXPECTED[/]")
    console.rule("[bold]Real models[/] (full size, meta device, forward and backward)")
    rows.print(console)
    return 1 if bad else 0


def main(show_models: bool = False, markdown: bool = False, as_json: bool = False) -> int:
    console = Console(highlight=False)
    if show_models:
        return models(console, markdown)
    if markdown:
        print(strategies_markdown())
        return 0
    if as_json:
        out = [
            {"setting": s, "strategy": st, "agrees": d is None, **r.to_dict()}
            for s, st, r, d in C.all_strategy_audits()
        ]
        print(json.dumps(out, indent=1))
        return sum(not o["agrees"] for o in out)
    details: List[Tuple[str, Finding]] = []
    bad = strategies(console, details) + unets(console, details)
    show_details(console, details)
    verdict: Optional[str] = None if bad == 0 else f"{bad} verdict(s) disagree"
    console.print("[green]Every verdict agrees with PyTorch.[/]" if verdict is None else f"[red]{verdict}[/]")
    return 0 if verdict is None else 1
