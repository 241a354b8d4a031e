"""The machine formats of audited calls: one JSON object (:func:`to_json`) and SARIF 2.1.0
(:func:`to_sarif`, what GitHub code scanning reads), both from :func:`.diagnostics.build`."""

from __future__ import annotations

import os
import subprocess
import urllib.parse
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .diagnostics import RUST_HELP, TITLES, Diagnostic, build, not_audited_text
from .report import CODES
from .sites import entry, is_library, resolve

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


SRCROOT = "%SRCROOT%"


def repository_root(start: Optional[str] = None) -> str:
    """The root that SARIF's URIs are relative to: the git work tree holding ``start`` (the
    working directory), else ``start`` itself."""
    start = os.path.abspath(start or os.getcwd())
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=start, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return start
    top = found.stdout.strip()
    return os.path.abspath(top) if found.returncode == 0 and top else start


def _uri(site: Any, root: str) -> Optional[Dict[str, str]]:
    """Relative to ``root`` (``%SRCROOT%``); None for a file outside it or in a library (never an
    absolute ``file://`` URI: code scanning shows only the repository's files)."""
    file = os.path.abspath(site.file if os.path.isabs(site.file) else os.path.join(os.getcwd(), site.path))
    if is_library(file) or not file.startswith(root.rstrip(os.sep) + os.sep):
        return None
    path = os.path.relpath(file, root)
    return {"uri": urllib.parse.quote(path.replace(os.sep, "/")), "uriBaseId": SRCROOT}


def _location(site: Any, root: str, message: Optional[str] = None, ident: Optional[int] = None) -> Dict[str, Any]:
    """A location in the repository; for a file outside it (a library), the message alone, which
    names the file and line."""
    out: Dict[str, Any] = {}
    uri = _uri(site, root)
    if uri is not None:
        region: Dict[str, Any] = {"startLine": site.line}
        if site.column:
            region["startColumn"] = site.column
            if site.end_column and site.end_column > site.column:
                region["endColumn"] = site.end_column
        out["physicalLocation"] = {"artifactLocation": uri, "region": region}
    elif message is not None:
        message = f"{message} ({site.path}:{site.line})"
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


def _result(d: Diagnostic, index: Dict[str, int], root: str) -> Dict[str, Any]:
    rule = d.code if d.code.startswith("E") else _UNUSED_ALLOW
    message = f"{d.title}: {d.label}" + (f". help: {d.help}" if d.help else "")
    result: Dict[str, Any] = {"ruleId": rule, "ruleIndex": index[rule], "level": d.level, "message": {"text": message}}
    related = [_location(s, root, text, i) for i, (text, s) in enumerate(d.notes) if s is not None]
    site = d.site
    called = resolve(entry(d.finding.where)) if site is not None and d.finding is not None else None
    if site is not None and called is not None and _uri(site, root) is None:
        # a write inside a library: at the user's line that called into it, the library's line
        # named beside it
        where = f"the write, in the library: {site.path}:{site.line}"
        related.append({"id": max((r["id"] for r in related), default=-1) + 1, "message": {"text": where}})
        site = called
    if site is not None:
        result["locations"] = [_location(site, root)]
    if related:
        result["relatedLocations"] = related
    if d.count > 1:
        result["properties"] = {"count": d.count}
    return result


def to_sarif(
    calls: Sequence[Tuple[str, Any]],
    unused: Iterable[Tuple[str, str]] = (),
    not_audited: Mapping[str, int] = {},
    root: Optional[str] = None,
    **invocation: Any,
) -> Dict[str, Any]:
    """A SARIF 2.1.0 log: one run, the rules E0596/E0382/E0502/E0499 (and unused allows), a result for
    each finding and warning; locations are relative to ``root`` (``%SRCROOT%``: by default the
    git work tree of the working directory, else the working directory)."""
    rules = _rules()
    index = {r["id"]: i for i, r in enumerate(rules)}
    root = os.path.abspath(root) if root else repository_root()
    results = [_result(d, index, root) for d in build(calls, unused) if d.level in ("error", "warning")]
    run: Dict[str, Any] = {
        "tool": {"driver": {"name": "plusequals", "version": _version(), "rules": rules}},
        "originalUriBaseIds": {SRCROOT: {"uri": "file://" + urllib.parse.quote(root.rstrip("/") + "/")}},
        "results": results,
    }
    skipped = not_audited_text(not_audited)
    if skipped:  # the calls that ran unaudited: a note on the run, never silently dropped
        note = {"level": "note", "message": {"text": skipped}, "descriptor": {"id": "not-audited"}}
        invocation = {**invocation, "toolExecutionNotifications": [note]}
    if invocation:
        run["invocations"] = [{"executionSuccessful": True, **invocation}]
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}
