"""Terminal layout shared by ``demo`` and the report's summary: tables that stay legible at 80
columns, and README-style cells (``**bold**``, ```code```) shown as terminal styles, not as
markdown."""

from __future__ import annotations

import re

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.padding import Padding
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

#: Below this width the tables become one block per row: the row's name and verdict on a line,
#: then one indented "column: value" line per other cell, so nothing is squeezed a word a line.
WIDE = 140

_MARKDOWN = re.compile(r"\*\*(?P<bold>.+?)\*\*|`(?P<code>[^`]+)`")


def from_markdown(text: str) -> str:
    """A README cell as rich markup: ``**x**`` bold, ```x``` cyan, every other character as
    written (square brackets escaped, so a cell never reads as markup)."""
    out, end = [], 0
    for m in _MARKDOWN.finditer(text):
        out.append(escape(text[end : m.start()]))
        out.append(f"[bold]{escape(m['bold'])}[/]" if m["bold"] is not None else f"[cyan]{escape(m['code'])}[/]")
        end = m.end()
    out.append(escape(text[end:]))
    return "".join(out)


def print_trimmed(console: Console, renderable: RenderableType) -> None:
    """Prints ``renderable`` with no trailing spaces on any line (rich pads a grid's cells to the
    column's width; a terminal shows nothing there, but a log or a diff does)."""
    out = []
    for line in console.render_lines(renderable, pad=False):
        while line and not line[-1].text.rstrip() and not line[-1].control:
            line.pop()
        if line and line[-1].text != line[-1].text.rstrip():
            last = line.pop()
            line.append(Segment(last.text.rstrip(), last.style))
        out += [*line, Segment.line()]
    console.print(Segments(out), end="")


def say(console: Console, markup: str) -> None:
    """``console.print(markup)``, wrapped without trailing spaces."""
    print_trimmed(console, Text.from_markup(markup))


class Rows:
    """A table that stays legible in any terminal: a rich Table when the console is wide, one
    block per row when it is narrow (80 columns). In a block, the key cells head the row and
    every other cell is a ``column: value`` line whose wrapped lines hang under the value."""

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
            head = Table.grid(padding=(0, 2))
            head.add_row(*(r[k] for k in key if r[k]))
            print_trimmed(console, head)
            cells = Table.grid(padding=(0, 1))
            cells.add_column(style="dim", no_wrap=True)
            cells.add_column(overflow="fold")
            for i, (column, cell) in enumerate(zip(self.columns, r)):
                if i not in key and cell:
                    cells.add_row(f"{column}:", cell)
            print_trimmed(console, Padding(cells, (0, 0, 0, 4)))
        console.print()
