"""The machine formats of audited calls: one JSON object (:func:`to_json`) and SARIF 2.1.0
(:func:`to_sarif`, what GitHub code scanning reads), both from :func:`.diagnostics.build`."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .diagnostics import RUST_HELP, TITLES, Diagnostic, build, not_audited_text
from .report import CODES
from .sites import relative

__all__ = ["to_json", "to_sarif"]

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_RULE_NAMES = {
    "E0596": "WriteIntoBorrowed",
    "E0382": "UseAfterMove",
    "E0502": "WriteIntoSavedForBackward",
    "E0499": "TwoMutableNames",
}
_UNUSED_ALLOW = "unused-allow"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plusequals")
    except PackageNotFoundError:
        return "0.1.0"


def _where(site: Any) -> Optional[str]:
    return f"{site.path}:{site.line}" if site is not None else None


def _finding(d: Diagnostic) -> Dict[str, Any]:
    f = d.finding
    read = next((s for _, s in d.notes if s is not None), None)
    return {
        "code": d.code,
        "level": d.level,
        "title": d.title,
        "module": f.module,
        "path": d.site.path if d.site else None,
        "line": d.site.line if d.site else None,
        "column": d.site.column if d.site else None,
        "where": f.where,
        "read_at": f.read_at,
        "read_column": read.column if read else None,
        "op": f.op,
        "writer": getattr(f, "writer", None),
        "message": f.message,
        "count": d.count,
        "help": d.help,
    }


def to_json(
    calls: Sequence[Tuple[str, Any]], unused: Iterable[Tuple[str, str]] = (), moves: bool = False, **extra: Any
) -> Dict[str, Any]:
    """One object: the findings (merged as in the text), the warnings, what each call raised, the
    moves (with ``moves``) and what was watched; ``extra`` (e.g. the program's exit status) added."""
    diagnostics = build(calls, unused, moves)
    reports = [r for _, r in calls]
    return {
        "tool": "plusequals",
        "version": _version(),
        "findings": [_finding(d) for d in diagnostics if d.level == "error"],
        "warnings": [
            {"code": d.code, "path": d.site.path if d.site else None, "line": d.site.line if d.site else None}
            | {"message": d.title}
            for d in diagnostics
            if d.level == "warning"
        ],
        "raised": [{"message": d.title, "count": d.count} for d in diagnostics if d.code == "raised"],
        "moves": [
            {"module": d.finding.module, "where": d.finding.where, "op": d.finding.op, "count": d.count}
            | {"writer": d.finding.writer}
            for d in diagnostics
            if d.code == "move"
        ],
        "watched": {
            "calls": len(reports),
            "ops": sum(r.ops for r in reports),
            "modules": sum(r.modules for r in reports),
            "module_calls": sum(r.calls for r in reports),
        },
        **extra,
    }


def _uri(site: Any) -> Dict[str, str]:
    """Relative to the working directory (``SRCROOT``) when the file is under it, else absolute."""
    path = relative(site.file) if os.path.isabs(site.file) else site.path
    if os.path.isabs(path):
        return {"uri": "file://" + urllib.parse.quote(path)}
    return {"uri": urllib.parse.quote(path.replace(os.sep, "/")), "uriBaseId": "SRCROOT"}


def _location(site: Any, message: Optional[str] = None, ident: Optional[int] = None) -> Dict[str, Any]:
    region: Dict[str, Any] = {"startLine": site.line}
    if site.column:
        region["startColumn"] = site.column
        if site.end_column and site.end_column > site.column:
            region["endColumn"] = site.end_column
    out: Dict[str, Any] = {"physicalLocation": {"artifactLocation": _uri(site), "region": region}}
    if message is not None:
        out["message"] = {"text": message}
    if ident is not None:
        out["id"] = ident
    return out


def _rules() -> List[Dict[str, Any]]:
    rules = [
        {
            "id": code,
            "name": _RULE_NAMES[code],
            "shortDescription": {"text": TITLES[code]},
            "fullDescription": {"text": CODES[code]},
            "help": {"text": RUST_HELP[code]},
            "defaultConfiguration": {"level": "error"},
        }
        for code in _RULE_NAMES
    ]
    rules.append(
        {
            "id": _UNUSED_ALLOW,
            "name": "UnusedAllow",
            "shortDescription": {"text": "a `# plusequals: allow(CODE)` that silenced nothing"},
            "help": {"text": "remove the allow, or the code it names"},
            "defaultConfiguration": {"level": "warning"},
        }
    )
    return rules


def _result(d: Diagnostic, index: Dict[str, int]) -> Dict[str, Any]:
    rule = d.code if d.code.startswith("E") else _UNUSED_ALLOW
    message = f"{d.title}: {d.label}" + (f". help: {d.help}" if d.help else "")
    result: Dict[str, Any] = {"ruleId": rule, "ruleIndex": index[rule], "level": d.level, "message": {"text": message}}
    if d.site is not None:
        result["locations"] = [_location(d.site)]
    related = [_location(s, text, i) for i, (text, s) in enumerate(d.notes) if s is not None]
    if related:
        result["relatedLocations"] = related
    if d.count > 1:
        result["properties"] = {"count": d.count}
    return result


def to_sarif(
    calls: Sequence[Tuple[str, Any]],
    unused: Iterable[Tuple[str, str]] = (),
    not_audited: Mapping[str, int] = {},
    **invocation: Any,
) -> Dict[str, Any]:
    """A SARIF 2.1.0 log: one run, the rules E0596/E0382/E0502/E0499 (and unused allows), a result for
    each finding and warning; locations are relative to the working directory (``SRCROOT``)."""
    rules = _rules()
    index = {r["id"]: i for i, r in enumerate(rules)}
    results = [_result(d, index) for d in build(calls, unused) if d.level in ("error", "warning")]
    run: Dict[str, Any] = {
        "tool": {"driver": {"name": "plusequals", "version": _version(), "rules": rules}},
        "originalUriBaseIds": {"SRCROOT": {"uri": "file://" + urllib.parse.quote(os.getcwd().rstrip("/") + "/")}},
        "results": results,
    }
    skipped = not_audited_text(not_audited)
    if skipped:  # the calls that ran unaudited: a note on the run, never silently dropped
        note = {"level": "note", "message": {"text": skipped}, "descriptor": {"id": "not-audited"}}
        invocation = {**invocation, "toolExecutionNotifications": [note]}
    if invocation:
        run["invocations"] = [{"executionSuccessful": True, **invocation}]
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}
