"""Findings as rustc prints them: ``error[E0596]: ...``, ``--> path:line:column``, the source line
(``linecache``) with a caret under the write, a note for the read (``E0382``) or for what autograd
saved (``E0502``), a one-line help naming the PyTorch fix and the Rust one, and a summary line.

:func:`build` turns audited calls into :class:`Diagnostic` records (the same write, seen again in
a loop or in another call, is one diagnostic with its count); :func:`render` prints them with
rich (colour only on a terminal), :mod:`.sarif` writes them as JSON or SARIF. Findings are read by
their attributes (``writer`` and ``column`` where a finding has them), so this module imports no
report class.
"""

from __future__ import annotations

import io
import linecache
import re
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, TextIO, Tuple

from rich.console import Console
from rich.text import Text

from .sites import Site, resolve

__all__ = ["RUST_HELP", "TITLES", "Diagnostic", "build", "not_audited_text", "render", "summary_line"]

TITLES: Dict[str, str] = {
    "E0596": "a module wrote into a tensor it only borrowed",
    "E0382": "a name read after a module wrote into its value (use after move)",
    "E0502": "a write into a tensor autograd saved for backward",
    "E0499": "two live names for one tensor, one written through, the other read",
}
RUST_HELP: Dict[str, str] = {
    "E0596": "in Rust: a move or `&mut`",
    "E0382": "in Rust: clone before the move",
    "E0502": "in Rust: autograd's `&` forbids `&mut`",
    "E0499": "in Rust: one `&mut` at a time",
}
_AUGMENTED = {"add_": "+", "sub_": "-", "mul_": "*", "div_": "/", "matmul_": "@", "pow_": "**"}
_ACTIVATIONS = ("relu_", "relu6_", "gelu_", "silu_", "elu_", "leaky_relu_", "hardtanh_", "threshold_", "celu_")
_ACTIVATIONS += ("selu_", "rrelu_", "hardswish_", "hardsigmoid_", "mish_", "dropout_", "feature_dropout_")
_COPIES = ("copy_", "fill_", "index_put_", "masked_fill_", "zero_", "set_")


class Diagnostic(NamedTuple):
    level: str  # "error", "warning" or "note"
    code: str  # E0596, E0382, E0502, E0499; "unused_allow"; "move"; "raised"
    title: str
    site: Optional[Site]
    label: str  # under the caret
    notes: Tuple[Tuple[str, Optional[Site]], ...]
    help: str
    count: int
    finding: Any  # the Finding, or None


def _base(op: str) -> Tuple[str, str]:
    """``aten.mul_.Tensor`` -> (``mul_``, ``Tensor``)."""
    parts = op.split(".")
    return (parts[1], parts[2] if len(parts) > 2 else "") if parts[0] == "aten" and len(parts) > 1 else (op, "")


def _source(site: Optional[Site]) -> str:
    if site is None:
        return ""
    linecache.checkcache(site.file)  # the file as it is now, not as an earlier run cached it
    return linecache.getline(site.file, site.line).rstrip("\n")


def _span(site: Site, line: str, op: str, name: Optional[str] = None) -> Tuple[int, int]:
    """The caret's columns (1-based, end exclusive): within the span Python gave for the write
    (when it gave one), the method call ``x.mul_``, ``x += ...``, ``inplace=True`` or ``out=``;
    for a read, the name; else Python's span, else the statement."""
    base, _ = _base(op)
    if name:
        patterns = [rf"\b{re.escape(name)}\b"]
    else:
        patterns = [rf"[A-Za-z_][\w.\[\]]*\.{re.escape(base)}\b"] if base else []
        if base in _AUGMENTED:
            patterns.append(rf"[A-Za-z_][\w.\[\]]*\s*{re.escape(_AUGMENTED[base])}=")
        patterns += [r"inplace\s*=\s*True", r"\bout\s*="]
    start, end = site.column, site.end_column
    lo = start - 1 if start else 0
    hi = end - 1 if start and end and end > start else len(line)
    for pattern in patterns:
        found = list(re.finditer(pattern, line[lo:hi]))
        if found:  # a name read after the write: its last use on the line (the call came first)
            m = found[-1] if name else found[0]
            return lo + m.start() + 1, lo + m.end() + 1
    if start and end and end > start:
        return start, end
    stripped = line.strip()
    first = len(line) - len(line.lstrip()) + 1
    return first, first + max(len(stripped), 1)


def _at(site: Optional[Site], op: str, name: Optional[str] = None) -> Optional[Site]:
    """``site`` with the caret's columns."""
    line = _source(site)
    if site is None or not line:
        return site
    start, end = _span(site, line, op, name)
    return site._replace(column=start, end_column=end)


def _under(site: Optional[Site]) -> str:
    """The text under the caret (the write itself, not another call on its line), else the line."""
    line = _source(site)
    if site is None or not site.column or not site.end_column or site.end_column <= site.column:
        return line
    return line[site.column - 1 : site.end_column - 1].strip() or line


def _receiver(line: str, op: str, fallback: str) -> str:
    base, _ = _base(op)
    for pattern in (rf"([A-Za-z_][\w.]*)\.{re.escape(base)}\b", r"([A-Za-z_][\w.]*)\s*[-+*/@]+=", r"([A-Za-z_]\w*)\["):
        m = re.search(pattern, line)
        if m:
            return m.group(1)
    return fallback


def pytorch_fix(code: str, op: str, line: str, name: str, writer: Optional[str] = None) -> str:
    """What to write instead, in PyTorch's terms."""
    base, overload = _base(op)
    if writer and "inplace=True" in writer:
        return f"build it as `{writer.replace('inplace=True', 'inplace=False')}`"
    if base in _ACTIVATIONS or "inplace=True" in line:
        return "pass `inplace=False`"
    if overload == "out" or re.search(r"\bout\s*=", line):
        return "drop `out=` and bind the result: `y = op(...)`"
    n = _receiver(line, op, name)
    if code == "E0382":
        return f"pass `{name}.clone()` to the call that writes"
    if code == "E0499":
        return f"write out of place (`y = x + ...`), or `.clone()` before `{name}` is kept"
    if base in _AUGMENTED:
        return f"write `{n} = {n} {_AUGMENTED[base]} ...`, or `.clone()` it first"
    if base in _COPIES:
        return f"write into a copy: `{n} = {n}.clone()` first"
    if base.endswith("_"):
        return f"write `{n} = {n}.{base[:-1]}(...)`, or `.clone()` it first"
    return f"write out of place into a new tensor, or `.clone()` `{n}` first"


def _backticked(message: str, after: str = "") -> Optional[str]:
    m = re.search(re.escape(after) + r"`([^`]+)`", message)
    return m.group(1) if m else None


def _module(root: str, module: str) -> str:
    return ".".join(p for p in (root, module) if p) or "(root)"


def _finding(root: str, f: Any, count: int) -> Diagnostic:
    site = resolve(f.where)
    if site is not None and getattr(f, "column", None):  # a finding that carries its own column
        site = site._replace(column=f.column, end_column=None)
    site = _at(site, f.op)
    writer = getattr(f, "writer", None)
    module = _module(root, f.module)
    arg = _backticked(f.message, "argument ") or _backticked(f.message) or "x"
    notes: List[Tuple[str, Optional[Site]]] = []
    if f.code == "E0382":
        title = f"`{arg}` is read after `{module}` wrote into its value"
        label = f"{f.op} writes into the value `{arg}` held"
        notes.append(("read again here, after the write", _at(resolve(f.read_at), "", arg)))
    elif f.code == "E0499":
        other = _backticked(f.message) or "x"
        title = f"`{other}` still names the tensor written here through another name"
        label = f"{f.op} writes into the tensor `{other}` also names"
        notes.append((f"`{other}` read here, after the write", _at(resolve(f.read_at), "", other)))
        arg = other
    elif f.code == "E0502":
        title = f"`{module}` overwrote a tensor autograd saved for backward"
        label = f"{f.op} writes into it here"
        saver = re.search(r"tensor that (\S+)(?: in `([^`]*)`)? saved for backward \(([^)]*)\)", f.message)
        if saver:
            where = f" in `{_module(root, saver.group(2))}`" if saver.group(2) is not None else ""
            notes.append((f"{saver.group(1)}{where} saved it for backward ({saver.group(3)})", None))
    else:
        cls = re.match(r"`[^`]*` \(([\w.]+)\)", f.message)
        named = f" ({cls.group(1)})" if cls and not re.search(r"[A-Za-z_]\w*$", module) else ""  # Sequential.1
        title = f"`{module}`{named} wrote into `{arg}`, which it only borrowed"
        label = f"{f.op} writes into `{arg}`" + (f", through {writer}" if writer else "")
    if count > 1:
        notes.append((f"the same write, seen {count} times", None))
    fix = pytorch_fix(f.code, f.op, _under(site), "x" if f.code == "E0502" else arg, writer)
    fix = fix.split(", or `.clone()`")[0] if f.code == "E0502" else fix  # one line, at 80 columns
    return Diagnostic("error", f.code, title, site, label, tuple(notes), f"{fix}; {RUST_HELP[f.code]}", count, f)


def _merged(calls: Iterable[Tuple[str, Any]]) -> List[Tuple[str, Any, int]]:
    """``(root, finding, count)``: the same write (same outermost module and finding key) once,
    its counts summed over the calls."""
    found: Dict[tuple, List[Any]] = {}
    for root, report in calls:
        for f in report.findings:
            key = f.key() if hasattr(f, "key") else (f.code, f.module, f.where, f.op)  # a move record, maybe
            entry = found.setdefault((root, key), [root, f, 0])
            count = getattr(f, "count", 1)
            entry[2] += count if isinstance(count, int) else 1
    return [tuple(e) for e in found.values()]  # type: ignore[misc]


def _raised(calls: Sequence[Tuple[str, Any]]) -> List[Diagnostic]:
    seen: Dict[str, int] = {}
    for root, report in calls:
        for phase, err in (("forward", report.error), ("backward", report.backward_error)):
            if err:
                key = f"the {phase} of `{root or '(root)'}` raised {err}"
                seen[key] = seen.get(key, 0) + 1
    return [
        Diagnostic("note", "raised", k, None, "", (), "findings before it are shown", n, None) for k, n in seen.items()
    ]


def _moves(calls: Sequence[Tuple[str, Any]]) -> List[Diagnostic]:
    """The moves (a write into a temporary nothing else holds: no finding), as notes."""
    out = []
    for root, m, count in _merged((r, _MovesOnly(getattr(rep, "moves", []))) for r, rep in calls):
        writer = getattr(m, "writer", None)
        text = f"`{_module(root, m.module)}` moved its argument" + (f" ({writer})" if writer else "")
        label = f"{m.op}: a write into a temporary nothing else holds"
        notes = ((f"seen {count} times", None),) if count > 1 else ()
        out.append(Diagnostic("note", "move", text, _at(resolve(m.where), m.op), label, notes, "", count, m))
    return out


class _MovesOnly(NamedTuple):
    findings: List[Any]


def build(
    calls: Sequence[Tuple[str, Any]], unused: Iterable[Tuple[str, str]] = (), moves: bool = False
) -> List[Diagnostic]:
    """The diagnostics of audited calls (``(outermost module's class, report)``): the findings,
    the unused allows (warnings), the errors the program raised and, with ``moves``, the moves."""
    out = [_finding(root, f, count) for root, f, count in _merged(calls)]
    for where, code in unused:
        site = resolve(where)
        line = _source(site)
        if site is not None and "#" in line:
            site = site._replace(column=line.index("#") + 1, end_column=len(line.rstrip()) + 1)
        label = f"allow({code}) silenced nothing"
        out.append(
            Diagnostic("warning", "unused_allow", f"unused allow: {code}", site, label, (), "remove it", 1, None)
        )
    return out + (_moves(calls) if moves else []) + _raised(calls)


_STYLES = {"error": "bold red", "warning": "bold yellow", "note": "bold green"}


def _header(d: Diagnostic) -> Text:
    text = Text(d.level + (f"[{d.code}]" if d.code.startswith("E") else ""), _STYLES[d.level])
    text.append(": " + d.title + (f" ({d.count} times)" if d.code == "raised" and d.count > 1 else ""), "bold")
    return text


def _snippet(console: Console, site: Site, label: str, gutter: int, style: str, more: bool = False) -> None:
    """`` --> path:line:col``, then the source line and the caret with its label, as rustc."""
    column = f":{site.column}" if site.column else ""
    arrow = Text(" " * (gutter - 1) + "--> ", "bold blue") + Text(f"{site.path}:{site.line}{column}")
    console.print(arrow, soft_wrap=True)
    line = _source(site)
    if not line:
        return
    bar = Text(" " * gutter + "|", "bold blue")
    console.print(bar)
    console.print(Text(f"{site.line:>{gutter - 1}} | ", "bold blue") + Text(line), soft_wrap=True)
    start, end = (site.column or 1), (site.end_column or (site.column or 1) + 1)
    caret = Text(" " * (start - 1) + "^" * max(end - start, 1) + (" " + label if label else ""), style)
    console.print(bar + Text(" ") + caret, soft_wrap=True)
    if more:
        console.print(bar)


def _print(console: Console, d: Diagnostic) -> None:
    console.print(_header(d))
    sites = [d.site] + [s for _, s in d.notes if s is not None]
    gutter = max((len(str(s.line)) for s in sites if s is not None), default=1) + 1
    if d.site is not None:
        _snippet(console, d.site, d.label, gutter, _STYLES[d.level], more=any(s is None for _, s in d.notes))
    for text, site in d.notes:
        if site is None:
            console.print(Text(" " * gutter + "= ", "bold blue") + Text("note", "bold") + Text(": " + text))
    for text, site in d.notes:
        if site is not None:
            console.print(Text("note", "bold green") + Text(": " + text))
            _snippet(console, site, "", gutter, "bold green")
    if d.help:
        console.print(Text("help", "bold cyan") + Text(": " + d.help))
    console.print()


def _calls(n: int) -> str:
    return f"{n} call{'s' * (n != 1)}"


def not_audited_text(not_audited: Mapping[str, int], detail: bool = True) -> str:
    """The calls that ran but were not audited, by why (``under a tracer (torch.jit.trace)``):
    ``1 call under a tracer (torch.jit.trace) not audited``; without ``detail``, summed by what
    precedes the parenthesis (``1 call under a tracer not audited``). Empty when none."""
    counts: Dict[str, int] = {}
    for why, n in not_audited.items():
        key = why if detail else why.split(" (")[0]
        counts[key] = counts.get(key, 0) + n
    return "; ".join(f"{_calls(n)} {why} not audited" for why, n in counts.items() if n)


def summary_line(diagnostics: Sequence[Diagnostic], calls: int, not_audited: Mapping[str, int] = {}) -> Text:
    """rustc's last line: how many errors (and warnings), in how many audited calls; and the
    calls that ran but were not audited (never silently dropped)."""
    errors = [d for d in diagnostics if d.level == "error"]
    warnings = sum(d.level == "warning" for d in diagnostics)
    raised = any(d.code == "raised" for d in diagnostics)
    where = f" in {calls} audited call{'s' * (calls != 1)}"
    if errors:
        codes = ", ".join(c + (f" x{n}" if n > 1 else "") for c, n in _counts(errors))
        text = Text("error", "bold red") + Text(f": {len(errors)} error{'s' * (len(errors) > 1)} ({codes}){where}")
    else:
        text = Text("no errors" + (" before the program raised" if raised else "") + where, "bold green")
    if warnings:
        text.append(f"; {warnings} warning{'s' * (warnings > 1)} emitted")
    skipped = not_audited_text(not_audited, detail=False)
    if skipped:
        text.append("; " + skipped, "bold yellow")
    return text


def _counts(diagnostics: Sequence[Diagnostic]) -> List[Tuple[str, int]]:
    counts: Dict[str, int] = {}
    for d in diagnostics:
        counts[d.code] = counts.get(d.code, 0) + 1
    return list(counts.items())


def render(
    calls: Sequence[Tuple[str, Any]],
    unused: Iterable[Tuple[str, str]] = (),
    moves: bool = False,
    file: Optional[TextIO] = None,
    color: Optional[bool] = None,
    not_audited: Mapping[str, int] = {},
    notes: Sequence[str] = (),
) -> str:
    """Prints the diagnostics of ``calls`` and the summary line to ``file`` (rich: colour only
    on a terminal, unless ``color`` says); with no ``file``, returns the text (80 columns).
    ``not_audited``: the calls that ran unaudited, by why (the summary line names them);
    ``notes``: printed as notes before it (the worker processes whose calls were merged)."""
    buffer = io.StringIO() if file is None else None
    console = Console(
        file=buffer or file,
        width=80 if buffer is not None else None,
        highlight=False,
        force_terminal=color if color else None,
        no_color=color is False,
        color_system=None if buffer is not None or color is False else "auto",
    )
    diagnostics = build(calls, unused, moves)
    for d in diagnostics:
        _print(console, d)
    for text in [*notes, *(not_audited_text({why: n}) for why, n in not_audited.items())]:
        console.print(Text("note", "bold green") + Text(f": {text}"))
    console.print(summary_line(diagnostics, sum(1 for root, _ in calls if root is not None), not_audited))
    return buffer.getvalue() if buffer is not None else ""
