"""Where the recorder finds the function behind each code that ran (twin/record.py ``_find``): it
reads each globals dict once for every code that ran there. Checked against the plain reading, one
code at a time, on generated globals: functions held as themselves, as methods, static and class
methods and properties, in classes, dicts, lists and tuples, beside values that hold none."""

from __future__ import annotations

import types
from typing import Any, List, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from plusequals.twin import record
from plusequals.twin.forward_code import class_dict

# six functions, each with a code of its own
POOL = []
for i in range(6):
    scope: dict = {}
    exec(f"def f{i}(self=None):\n    return {i}\n", scope)
    POOL.append(scope[f"f{i}"])


class Holder:
    pass


def one_by_one(code: types.CodeType, g: dict) -> List[Tuple[Any, Any, str]]:
    """The plain reading: every global of ``g`` looked at for ``code`` alone."""
    where = g.get("__name__", "?")

    def runs(value: Any) -> bool:
        f = record._function(value) if not isinstance(value, type) else None
        return f is not None and f.__code__ is code

    found: List[Tuple[Any, Any, str]] = []
    for name, value in list(g.items()):
        if runs(value):
            found.append((g, name, f"{where}.{name}"))
        elif isinstance(value, type):
            found += [(class_dict(value), k, f"{where}.{name}.{k}") for k, v in list(vars(value).items()) if runs(v)]
        elif isinstance(value, dict):
            found += [(value, k, f"{where}.{name}[{k!r}]") for k, v in list(value.items()) if runs(v)]
        elif isinstance(value, (list, tuple)):
            found += [(None, v, f"{where}.{name}[...]") for v in value if runs(v)]
    return found


functions = st.sampled_from(POOL)
wrapped = st.one_of(
    functions,
    functions.map(staticmethod),
    functions.map(classmethod),
    functions.map(property),
    functions.map(lambda f: types.MethodType(f, Holder())),
    st.integers(),
    st.text(max_size=3),
)


@st.composite
def a_class(draw) -> type:
    attrs = draw(st.dictionaries(st.sampled_from(["a", "b", "c", "forward"]), wrapped, max_size=4))
    return type(draw(st.sampled_from(["A", "B"])), (), attrs)


values = st.one_of(
    wrapped,
    a_class(),
    st.dictionaries(st.one_of(st.text(max_size=2), st.integers(0, 3)), wrapped, max_size=4),
    st.lists(wrapped, max_size=4),
    st.lists(wrapped, max_size=4).map(tuple),
)


@st.composite
def globals_and_codes(draw) -> Tuple[List[dict], List[Tuple[types.CodeType, dict]]]:
    """One to three module globals, and the codes that ran in each (a code runs in one only)."""
    spaces = []
    for m in range(draw(st.integers(1, 3))):
        names = draw(st.lists(st.sampled_from([f"g{i}" for i in range(8)]), unique=True, max_size=8))
        spaces.append({"__name__": f"mod{m}", **{n: draw(values) for n in names}})
    codes = draw(st.permutations([f.__code__ for f in POOL]))[: draw(st.integers(0, len(POOL)))]
    return spaces, [(code, spaces[draw(st.integers(0, len(spaces) - 1))]) for code in codes]


@settings(max_examples=examples(300), deadline=None)
@given(drawn=globals_and_codes())
def test_each_code_is_found_where_reading_for_it_alone_finds_it(drawn):
    spaces, looked = drawn
    found = record._find(looked)
    for code, g in looked:
        assert found.get(id(code), []) == one_by_one(code, g)
    assert set(found) <= {id(code) for code, _ in looked}
