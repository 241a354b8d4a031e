"""The generated blocks of the guide's pages, which the tests compare with what the code gives now."""

from __future__ import annotations

from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide"


def guide_block(name: str, page: str = "audit.md") -> str:
    """The text between ``<!-- name -->`` and ``<!-- /name -->`` in docs/guide/``page``, without
    the line breaks next to the markers."""
    text = (GUIDE / page).read_text()
    start, end = f"<!-- {name} -->\n", f"\n<!-- /{name} -->"
    return text[text.index(start) + len(start) : text.index(end)]
