"""Every hypothesis budget in the tests goes through ``conftest.examples``: the ``ci`` profile
(``make test``) runs each test's own budget, and the ``dev`` profile (``make check``) a quarter of
each, as docs/guide/building.md says. A literal ``settings(max_examples=60)`` would ignore the
profile and run its 60 examples in ``make check`` too.

Two budgets are fixed, by name (:data:`FIXED`): tests that count what was generated (every kind of
bad input at least once, 200 modules checked, 100 accepted and 100 refused donations) against the
500 cases those counts were set for. Both are marked slow, which ``make check`` leaves out."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Tuple

TESTS = Path(__file__).resolve().parent
FIXED = {("test_boundary.py", "FUZZ_CASES"), ("test_transaction_stateful.py", "EXAMPLES")}


def literal_budgets(source: str) -> List[Tuple[int, str]]:
    """The ``max_examples`` of each ``settings(...)`` call in ``source`` that is not
    ``examples(n)``: (line, the value as written)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name != "settings":
            continue
        for kw in node.keywords:
            value = kw.value
            through_profile = (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "examples"
            )
            if kw.arg == "max_examples" and not through_profile:
                found.append((node.lineno, ast.unparse(value)))
    return found


def test_every_budget_follows_the_profile():
    found = {
        f"{path.relative_to(TESTS)}:{line}": value
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "conftest.py"  # where the profiles themselves are made
        for line, value in literal_budgets(path.read_text())
        if (str(path.relative_to(TESTS)), value) not in FIXED
    }
    assert not found, f"budgets that skip conftest.examples (the dev profile would not scale them): {found}"


def test_the_check_finds_a_budget_written_as_a_number_or_a_name():
    source = (
        "@settings(max_examples=60, deadline=None)\ndef a(): ...\n"
        "@hypothesis.settings(max_examples=N)\ndef b(): ...\n"
        "@settings(max_examples=examples(60))\ndef c(): ...\n"
        "settings.register_profile('ci', max_examples=100)\n"
    )
    assert literal_budgets(source) == [(1, "60"), (3, "N")]
