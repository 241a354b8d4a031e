"""The report's comparisons: ``compare`` sums a paired ratio up over the shapes of a batch,
``answer`` says in words what its counts say, and a ``Verdict`` is one of the report's questions
with its comparisons and REPORT.md's sentence (asked by :func:`.analyse.verdict_items`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .results import Paired, Record, Results, fmt


@dataclass(frozen=True, kw_only=True)
class Comparison(Record):
    """``variant / vs`` over the shapes of one batch: the paired medians' range, and in how many
    cells ``variant`` is faster (Q3 < 1), slower (Q1 > 1) or within noise (the interval holds 1).
    A single cell's comparison carries its quartiles too."""

    variant: str
    vs: str
    batch: int
    lo: float
    hi: float
    q1: Optional[float] = None
    q3: Optional[float] = None
    cells: int
    within_noise: int
    faster: int
    slower: int

    def to_json(self) -> dict:
        return {k: v for k, v in super().to_json().items() if v is not None or k not in ("q1", "q3")}


def compare(results: Results, batch: int, variant: str, vs: str) -> Optional[Comparison]:
    """``variant / vs`` across the shapes of one batch (None where no cell has both)."""
    ps = [p for sh in results.shapes if (p := results.paired.get((batch, sh, variant, vs)))]
    if not ps:
        return None
    return Comparison(
        variant=variant,
        vs=vs,
        batch=batch,
        lo=min(p.median for p in ps),
        hi=max(p.median for p in ps),
        cells=len(ps),
        within_noise=sum(p.within_noise for p in ps),
        faster=sum(p.q3 < 1 for p in ps),
        slower=sum(p.q1 > 1 for p in ps),
    )


def one_cell(p: Paired) -> Comparison:
    """A paired ratio of a single cell as a comparison (with its quartiles)."""
    return Comparison(
        variant=p.variant,
        vs=p.vs,
        batch=p.batch,
        lo=p.median,
        hi=p.median,
        q1=p.q1,
        q3=p.q3,
        cells=1,
        within_noise=int(p.within_noise),
        faster=int(p.q3 < 1),
        slower=int(p.q1 > 1),
    )


def answer(c: Mapping[str, Any]) -> str:
    """What a comparison says, in words a reader can act on; counts only (a comparison's
    ``cells``, ``faster``, ``slower`` and ``within_noise``, as its JSON has them)."""
    n, f, s, w = c["cells"], c["faster"], c["slower"], c["within_noise"]
    if w == n:
        return f"same time within noise (all {n} cells)"
    if f == n or s == n:
        return f"{'faster' if f else 'slower'} in all {n} cells"
    parts = [f"{what} in {k}" for what, k in (("faster", f), ("slower", s), ("within noise", w)) if k]
    return ", ".join(parts) + f" of {n} cells"


def across(c: Comparison) -> str:
    return f"{fmt(c.lo)} to {fmt(c.hi)} across shapes, within noise at {c.within_noise} of {c.cells}"


@dataclass(frozen=True)
class Verdict(Record):
    """One of the report's questions at one batch: its comparisons, a short answer (the first
    comparison's, or a sentence of its own: ``answer_only``) and REPORT.md's sentence."""

    question: str
    batch: Optional[int]
    comparisons: list[Comparison]
    answer: str
    answer_only: bool
    text: str

    def to_json(self) -> dict:
        return super().to_json() | {"comparisons": [c.to_json() for c in self.comparisons]}


def verdict(
    question: str, batch: Optional[int], comparisons: list[Comparison], text: str, answer_text: Optional[str] = None
) -> Verdict:
    """A question answered by its first comparison's counts, unless ``answer_text`` answers it."""
    head = comparisons[0] if comparisons else None
    said = answer_text or (f"`{head.variant}` {answer(head.to_json())}" if head else "")
    return Verdict(question, batch, comparisons, said, answer_text is not None, text)
