"""What an audit found: :class:`Finding` (one rule broken, with its lines) and :class:`AuditReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

__all__ = ["CODES", "AuditReport", "Finding"]

# rustc's error codes, and what each means for a module's tensors.
CODES: Dict[str, str] = {
    "E0596": (
        "a module wrote into a tensor it was given that outlives the call in other hands (a parameter, "
        "a buffer, a module's tensor attribute, an autograd.Function's input, or the audited call's own "
        "argument): it only borrowed it"
    ),
    "E0382": "a name that held a tensor before a module wrote into it was read afterwards (a use after move)",
    "E0502": "a write into a tensor that autograd saved for backward (borrowed until backward)",
    "E0499": "a tensor written through one name while another live name for it is read afterwards",
}


@dataclass(frozen=True)
class Finding:
    """One rule broken. ``module`` is the qualified name (``named_modules()``; ``""`` is the
    audited module itself); ``where`` is the ``path:line`` of the write, in the innermost frame
    outside torch and the audit; an ``E0382`` has ``read_at``, the line that read the moved name.
    ``count`` is how many times the same write (same code, module, line and op) was seen.
    ``writer``: torch's own module that wrote, as code writes it (``nn.ReLU(inplace=True)``),
    when the write happened inside one (``where`` is still the user's line that called it).
    A :attr:`AuditReport.moves` record has code ``"move"``."""

    code: str
    module: str
    where: str
    op: str
    message: str
    read_at: Optional[str] = None
    count: int = 1
    writer: Optional[str] = None

    def key(self) -> Tuple[str, str, str, str, Optional[str]]:
        return (self.code, self.module, self.where, self.op, self.read_at)


@dataclass
class AuditReport:
    """The findings of one audited call, in the order the writes happened, and what was watched:
    ``ops`` (aten ops dispatched: the forward's, and in backward those of the Python code that
    backward runs), ``modules`` (modules watched), ``calls`` (module calls).
    ``error`` / ``backward_error``: the first line of what the forward / backward raised, if
    anything (the audit never hides the model's own error; findings before it are kept).
    ``allowed``: the findings a ``# plusequals: allow(CODE)`` on their line silenced;
    ``unused_allows``: ``(path:line, code)`` of each allowed code that silenced nothing.
    ``backward_skipped``: why ``backward=True`` ran no backward (no output requires grad).
    ``moves``: writes into a temporary that nothing else held and no name read afterwards (code
    ``"move"``; Rust accepts them: the module took the value by value). Never findings.
    ``eager``: the compiler whose output was audited as the code it compiled, run eagerly
    (``"torch.compile"``), its compiled graph left untouched; None otherwise."""

    findings: List[Finding] = field(default_factory=list)
    ops: int = 0
    modules: int = 0
    calls: int = 0
    error: Optional[str] = None
    backward_error: Optional[str] = None
    allowed: List[Finding] = field(default_factory=list)
    unused_allows: List[Tuple[str, str]] = field(default_factory=list)
    backward_skipped: Optional[str] = None
    moves: List[Finding] = field(default_factory=list)
    eager: Optional[str] = None

    @property
    def codes(self) -> List[str]:
        """The codes found, each once, in the order first found."""
        return list(dict.fromkeys(f.code for f in self.findings))

    @property
    def clean(self) -> bool:
        return not self.findings

    def by_code(self, code: str) -> List[Finding]:
        return [f for f in self.findings if f.code == code]

    def to_dict(self) -> dict:
        return {**asdict(self), "codes": self.codes}

    def table(self, title: Optional[str] = None) -> "object":
        """The findings as a ``rich.table.Table`` (rich is imported only here)."""
        from rich.table import Table

        table = Table(title=title, show_lines=False)
        for column in ("code", "module", "where", "read at", "op", "message"):
            table.add_column(column, overflow="fold")
        for f in self.findings:
            table.add_row(f.code, f.module or "(root)", f.where, f.read_at or "", f.op, f.message)
        return table

    def summary(self) -> str:
        """One line: the codes found (or clean: never when the forward or backward raised), what
        was watched, and any error."""
        raised = self.error is not None or self.backward_error is not None
        found = ", ".join(f"{c}x{len(self.by_code(c))}" for c in self.codes)
        found = found or ("no findings before the error" if raised else "clean")
        line = f"{found} ({self.ops} ops, {self.modules} modules, {self.calls} calls watched)"
        if self.eager:
            line += f"; what {self.eager} compiled, audited eagerly (its compiled graph not run)"
        for label, err in (("forward raised", self.error), ("backward raised", self.backward_error)):
            if err:
                line += f"; {label}: {err if len(err) <= 110 else err[:109] + '…'}"
        return line

    def __str__(self) -> str:
        """The findings as rustc's diagnostics (no colour), then :meth:`summary`."""
        from .diagnostics import render

        return render([("", self)], self.unused_allows, color=False).rstrip("\n") + "\n" + self.summary()
