"""Terminal layout shared by ``demo`` and the report's summary: tables that stay legible at 80
columns, and README-style cells (``**bold**``, ```code```) shown as terminal styles, not as
markdown."""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.markup import escape
from rich.measure import Measurement
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


class Phrases:
    """Lines of phrases (rich markup each) that wrap between phrases only: in a narrow column
    "faster 2/4 slower 1/4 ≈ 1/4" reads "faster 2/4 slower 1/4" then "≈ 1/4", never "≈" then
    "1/4". Its measure is the widest phrase (the least) and the widest line unwrapped (the most);
    a phrase wider than the column alone wraps within itself (:func:`fit_columns` sizes a table
    so that none is)."""

    def __init__(self, *lines: Sequence[str]) -> None:
        self.lines = [[Text.from_markup(p) for p in line] for line in lines]

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((p.cell_len for line in self.lines for p in line), default=1)
        longest = max((sum(p.cell_len for p in line) + len(line) - 1 for line in self.lines if line), default=1)
        return Measurement(widest, longest).with_maximum(options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        rows = []
        for line in self.lines:
            row = Text()
            for p in line:
                if row and row.cell_len + 1 + p.cell_len > options.max_width:
                    rows.append(row)
                    row = Text()
                row.append_text(Text(" ") + p if row else p)
            rows.append(row)
        yield Text("\n").join(rows)


def fit_columns(table: Table, console: Console, width: int) -> None:
    """Gives each of ``table``'s columns without a fixed width one, so that the table is at most
    ``width`` wide: every column its widest cell unwrapped if they all fit, else the narrower
    ones theirs and the rest an even share of what is left, where :class:`Phrases` cells wrap
    between their phrases. (Left to rich, a table too wide shrinks its widest columns below
    their cells' least width, and a cell wraps wherever it must.)"""
    _, right, _, left = Padding.unpack(table.padding)
    last = len(table.columns) - 1
    pads = sum(
        (left if i or table.pad_edge else 0) + (right if i < last or table.pad_edge else 0)
        for i in range(len(table.columns))
    )
    free = [c for c in table.columns if c.width is None]
    room = width - pads - sum(c.width for c in table.columns if c.width is not None)
    natural = {id(c): _widest(console, [c.header, *c.cells]) for c in free}
    for n, column in enumerate(sorted(free, key=lambda c: natural[id(c)])):
        column.width = max(1, min(natural[id(column)], room // (len(free) - n)))
        room -= column.width


def _widest(console: Console, cells: Iterable[RenderableType]) -> int:
    return max((Measurement.get(console, console.options, c).maximum for c in cells), default=1)


def say(console: Console, markup: str) -> None:
    """``console.print(markup)``, wrapped without trailing spaces."""
    print_trimmed(console, Text.from_markup(markup))


class TerminalTable:
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
