"""Regenerates the audit corpus and sweep tables of the guide's audit page.

    python scripts/audit_tables.py            # all (the full sweep: about 11 CPU minutes, one thread)
    python scripts/audit_tables.py corpus     # only the corpus
    python scripts/audit_tables.py cost       # only the cost sentence, from docs/report-cpu/results.json

tests/test_audit_corpus.py and tests/test_audit_sweep.py check the tables are current, and
tests/test_readme.py the cost sentence (rerun ``cost`` after regenerating docs/report-cpu).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "audit.md"


REPORT = PAGE.parents[2] / "docs" / "report-cpu" / "results.json"


def replace_block(text: str, name: str, body: str) -> str:
    """The lines between ``<!-- name ... -->`` and ``<!-- /name -->`` replaced by ``body``."""
    opening = text.index(f"<!-- {name} -->") if f"<!-- {name} -->" in text else text.index(f"<!-- {name}: ")
    i, j = text.index("\n", opening) + 1, text.index(f"<!-- /{name} -->")
    return text[:i] + body + "\n" + text[j:]


def main(which: list) -> None:
    from plusequals.cases import corpus, sweep

    text = PAGE.read_text()
    if not which or "corpus" in which:
        text = replace_block(text, "audit-corpus", corpus.markdown(corpus.results() + corpus.results(corpus.MISSED)))
    if not which or "cost" in which:
        from plusequals.bench.render import audit_cost_claim

        text = replace_block(text, "audit-cost", audit_cost_claim(json.loads(REPORT.read_text())))
    if not which or "sweep" in which:
        rows = [sweep.run(e) for family in sweep.families() for e in sweep.entries(family)]
        text = replace_block(text, "audit-sweep", sweep.markdown(rows))
    PAGE.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
