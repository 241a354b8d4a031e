"""``audit --help`` and ``audit run --help`` piped (no terminal: argparse wraps at ``COLUMNS``)
wrap between phrases: no line wider than the width, and no phrase that fits on a line is cut
(an option with its metavar, a command, a parenthesized aside, "that need grad")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from plusequals.cli import main
from plusequals.cli.helptext import phrases, wrap

WHOLE = [
    "audit run --help",
    "python -m plusequals audit run [options] SCRIPT [ARGS...]",
    "(of the strategies, or with --models of the models)",
    "--output FILE",
    "python -m MODULE",
    "that need grad",
    "(default: the git work tree, else the cwd)",
    "(1 if it raised)",
    "(as python -m cProfile does)",
]


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("command", [["audit", "--help"], ["audit", "run", "--help"]])
def test_help_wraps_between_phrases_when_piped(capsys, monkeypatch, columns, command):
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as exit_:
        main(command)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    body = [line for line in out.splitlines() if not line.startswith(("usage:", "       python -m"))]
    assert all(len(line) <= columns - 2 for line in body), out  # argparse's width: COLUMNS - 2
    joined = " ".join(line.strip() for line in out.splitlines())
    for phrase in WHOLE:
        if phrase in joined:  # each help names some of them
            assert any(phrase in line for line in out.splitlines()), (phrase, out)
    assert sum(phrase in joined for phrase in WHOLE) >= 3


_WORD = st.text("abcdefghij", min_size=1, max_size=9)
_CONNECTIVE = st.sampled_from(["that", "from", "else", "when", "with", "and", "or"])
_ATOM = st.builds(lambda o, m: f"--{o} {m.upper()}", _WORD, _WORD)
_GROUP = st.lists(_WORD, min_size=1, max_size=5).map(lambda ws: "(" + " ".join(ws) + ")")
_PUNCT = st.builds(lambda w, p: w + p, _WORD, st.sampled_from([",", ";", ":", "."]))
_TEXT = st.lists(st.one_of(_WORD, _WORD, _CONNECTIVE, _ATOM, _GROUP, _PUNCT), min_size=1, max_size=40).map(" ".join)


@settings(max_examples=examples(200), deadline=None)
@given(text=_TEXT, width=st.integers(30, 100))
def test_wrap_breaks_only_between_phrases(text, width):
    lines = wrap(text, width)
    assert " ".join(lines) == " ".join(text.split())  # nothing lost, nothing added
    found = phrases(text)
    assert " ".join(found) == " ".join(text.split())
    for phrase in found:
        if len(phrase) <= width:  # a phrase that fits on a line is on one line
            assert any(phrase in line for line in lines), (phrase, lines)
    for line in lines:
        assert len(line) <= width or " " not in line or _unbreakable(line), (line, width)


def _unbreakable(line: str) -> bool:
    """A line wider than the width only when it is one word, or one option with its metavar."""
    parts = line.split(" ")
    return len(parts) == 2 and parts[0].startswith("--") and parts[1].isupper()


@settings(max_examples=examples(100), deadline=None)
@given(before=st.lists(_WORD, max_size=12).map(" ".join), atom=_ATOM, after=st.lists(_WORD, max_size=12).map(" ".join))
def test_an_option_and_its_metavar_stay_together(before, atom, after):
    text = " ".join(p for p in (before, atom, after) if p)
    for width in (len(atom), len(atom) + 5, 40, 80):
        assert any(atom in line for line in wrap(text, width))
