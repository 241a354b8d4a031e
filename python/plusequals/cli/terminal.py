"""Terminal layout shared by ``demo`` and the report's summary: tables that stay legible at 80
columns."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

#: Below this width the tables become one block per row: the row's name and verdict on a line,
#: then one indented "column: value" line per other cell, so nothing is squeezed a word a line.
WIDE = 140


class Rows:
    """A table that stays legible in any terminal: a rich Table when the console is wide, one
    block per row when it is narrow (80 columns)."""

    def __init__(self, *columns: str, key: tuple = (0, -1)) -> None:
        self.columns, self.key, self.rows = columns, key, []

    def add_row(self, *cells: str) -> None:
        self.rows.append(cells)

    def print(self, console: Console) -> None:
        if console.width >= WIDE:
            t = Table(*self.columns)
            for r in self.rows:
                t.add_row(*r)
            console.print(t)
            return
        key = [k % len(self.columns) for k in self.key]
        for r in self.rows:
            console.print("  ".join(r[k] for k in key if r[k]))
            for i, (column, cell) in enumerate(zip(self.columns, r)):
                if i not in key and cell:
                    console.print(f"    [dim]{column}:[/] {cell}")
        console.print()
