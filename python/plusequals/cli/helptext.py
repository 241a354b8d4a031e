"""argparse help that wraps between phrases, never inside one: not after ``need`` in "that need
grad", nor inside ``--output FILE``, ``audit run --help`` or a parenthesized aside that fits on a
line. argparse's own formatter wraps at any space, wherever the width falls (on a terminal or,
piped, at ``COLUMNS``).

A phrase ends after ``,`` ``;`` ``:`` or ``.``, and before a connective (``that``, ``from``,
``else``...); a parenthesized group is one phrase. Phrases are packed greedily into lines; one
longer than the line is split into its own phrases, then into words.
"""

from __future__ import annotations

import argparse
import re
from typing import List

__all__ = ["PhraseFormatter", "phrases", "wrap"]

_NBSP = "\u00a0"
_CONNECTIVES = frozenset(
    "that which who whose where when while if unless else or and but than as from with without for because so".split()
)
# what never breaks: an option with its metavars, and commands
_ATOMS = [
    re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*(?: [A-Z][A-Z0-9_]*(?:\.\.\.)?)+\b(?:\.\.\.)?"),
    re.compile(r"\bpython -m [\w.]+(?: (?:audit|run|report|demo|summary)\b)*"),
    re.compile(r"\baudit run(?: --help| SCRIPT)?"),
    re.compile(r"\bpip install \S+"),
]


def _protect(text: str) -> str:
    for atom in _ATOMS:
        text = atom.sub(lambda m: m.group(0).replace(" ", _NBSP), text)
    return text


def _groups(text: str) -> List[str]:
    """Top-level pieces: a parenthesized group (with the punctuation that follows it) is one,
    and each word outside one is one."""
    out: List[str] = []
    depth, current = 0, ""
    for word in text.split(" "):
        if depth == 0:
            if current:
                out.append(current)
            current = word
        else:
            current += " " + word
        depth = max(0, depth + word.count("(") - word.count(")"))
    if current:
        out.append(current)
    return [w for w in out if w]


def phrases(text: str) -> List[str]:
    """The phrases of ``text`` (whitespace normalized), in order; joined by spaces they give it back."""
    text = " ".join(text.split())
    found: List[str] = []
    current: List[str] = []
    for piece in _groups(_protect(text)):
        group = piece.startswith("(")
        first = piece.split(_NBSP)[0].lower()
        if current and (group or first in _CONNECTIVES):
            found.append(" ".join(current))
            current = []
        current.append(piece)
        if group or piece.endswith((",", ";", ":", ".")):
            found.append(" ".join(current))
            current = []
    if current:
        found.append(" ".join(current))
    return [p.replace(_NBSP, " ") for p in found]


def _split(phrase: str) -> List[str]:
    """A phrase too long for a line: a group's inner phrases, else its words (atoms whole)."""
    if phrase.startswith("(") and " " in phrase:
        head, _, rest = phrase.partition(" ")
        inner = phrases(rest)
        if len(inner) > 1:
            return [head + " " + inner[0], *inner[1:]]
    words = _protect(phrase).split(" ")
    return [w.replace(_NBSP, " ") for w in words]


def wrap(text: str, width: int) -> List[str]:
    """``text`` in lines of at most ``width`` (unless one word is wider), broken between phrases."""
    lines: List[str] = []
    line = ""
    todo = phrases(text)
    while todo:
        phrase = todo.pop(0)
        candidate = f"{line} {phrase}" if line else phrase
        if len(candidate) <= width:
            line = candidate
        elif len(phrase) > width and _split(phrase) != [phrase]:
            todo[:0] = _split(phrase)
        else:
            if line:
                lines.append(line)
            line = phrase
    if line:
        lines.append(line)
    return lines


class PhraseFormatter(argparse.HelpFormatter):
    """argparse's formatter, wrapping descriptions, epilogs and each option's help by :func:`wrap`."""

    def _split_lines(self, text: str, width: int) -> List[str]:
        return wrap(text, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in wrap(text, width))
