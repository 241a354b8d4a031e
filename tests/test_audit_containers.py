"""Writes outside ATen: a module or function that mutates a list or dict of tensors it was given,
when someone else keeps that list or dict (the audited call's argument, a module's attribute), is
``E0596`` at the line that mutates it: in Rust a ``&Vec<Tensor>`` or ``&HashMap<_, Tensor>``
cannot be mutated. A list or dict the caller made for the call (a temporary, a copy) is the
callee's to change, as a ``&mut`` it was lent (torchvision's FPN appends to its own lists).
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from plusequals.auditing import audit

# Mutations of a list `c` or a dict `c` (each changes what it holds), and reads that do not.
LIST = {
    "append": "c.append(c[0] * 2.0)",
    "extend": "c.extend([c[0] * 2.0])",
    "insert": "c.insert(0, c[0] * 2.0)",
    "pop": "c.pop()",
    "__setitem__": "c[0] = c[0] * 2.0",
    "__delitem__": "del c[0]",
    "clear": "c.clear()",
    "reverse": "c.reverse()",
}
DICT = {
    "__setitem__": "c['new'] = c['a'] * 2.0",
    "__delitem__": "del c['a']",
    "update": "c.update({'a': c['a'] * 2.0})",
    "setdefault": "c.setdefault('new', c['a'])",
    "pop": "c.pop('a')",
    "clear": "c.clear()",
}
READS = {"list": "s = sum(t.sum() for t in c)", "dict": "s = sum(t.sum() for t in c.values())"}

_counter = itertools.count()
PARENT = "class Parent(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.child = Child()\n"


def _compile(source: str) -> tuple:
    filename = f"<containers-{next(_counter)}>"
    namespace = {"torch": torch, "nn": nn}
    exec(compile(source, filename, "exec"), namespace)
    lines = {s.rsplit("# ", 1)[1]: f"{filename}:{i}" for i, s in enumerate(source.splitlines(), start=1) if "# " in s}
    return namespace, lines


def _given(kind: str, g: torch.Generator):
    if kind == "list":
        return [torch.randn(3, generator=g), torch.randn(3, generator=g)]
    return {"a": torch.randn(3, generator=g), "b": torch.randn(3, generator=g)}


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from(["list", "dict"]), st.data(), st.sampled_from(["function", "child module", "nested"]))
def test_mutating_a_list_or_dict_the_caller_keeps_is_E0596_at_its_line(kind, data, who):
    how = data.draw(st.sampled_from(sorted(LIST if kind == "list" else DICT)))
    mutation = (LIST if kind == "list" else DICT)[how]
    if who == "nested":  # the function is given a list of them (torchvision's targets)
        source = f"def f(cs):\n    for c in cs:\n        {mutation}  # write\n    return cs\n"
    elif who == "function":
        source = f"def f(c):\n    {READS[kind]}\n    {mutation}  # write\n    return s\n"
    else:
        source = (
            f"class Child(nn.Module):\n    def forward(self, c):\n        {mutation}  # write\n        return c\n"
            + PARENT
            + "    def forward(self, c):\n        return self.child(c)\n"
        )
    namespace, lines = _compile(source)
    g = torch.Generator().manual_seed(0)
    given = [_given(kind, g)] if who == "nested" else _given(kind, g)
    model = namespace["Parent"]() if who == "child module" else namespace["f"]
    report = audit(model, given)
    assert report.error is None, report.error
    (f,) = report.findings
    assert f.code == "E0596" and f.where == lines["write"] and f.op == f"{kind}.{how}", f
    assert f.module == ("child" if who == "child module" else "")
    assert "audited call's argument" in f.message


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(["list", "dict"]), st.data(), st.sampled_from(["copy", "temporary", "read only"]))
def test_a_list_or_dict_the_caller_made_for_the_call_is_the_callees_to_change(kind, data, made):
    """The caller copies the user's container (as torchvision's detection transform does) or builds
    one of its own, and the child mutates that: a `&mut` it was lent, no finding; a child that
    only reads the user's container: nothing either."""
    how = data.draw(st.sampled_from(sorted(LIST if kind == "list" else DICT)))
    mutation = (LIST if kind == "list" else DICT)[how]
    build = {
        "copy": f"{kind}(c)",
        "temporary": "[t * 1.0 for t in c]" if kind == "list" else "{k: t for k, t in c.items()}",
    }
    body = READS[kind] if made == "read only" else mutation
    arg = "c" if made == "read only" else build[made]
    source = (
        f"class Child(nn.Module):\n    def forward(self, c):\n        {body}\n        return c\n"
        + PARENT
        + f"    def forward(self, c):\n        mine = {arg}\n        self.child(mine)\n        return mine\n"
    )
    namespace, _ = _compile(source)
    report = audit(namespace["Parent"](), _given(kind, torch.Generator().manual_seed(0)))
    assert report.error is None and report.clean, (report.error, report.findings)


def test_a_modules_list_attribute_mutated_by_a_child_it_is_given_to():
    class Child(nn.Module):
        def forward(self, c):
            c.append(c[-1] + 1.0)  # write
            return c[-1]

    class Keeper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Child()
            self.memory = [torch.zeros(3)]

        def forward(self, x):
            return self.child(self.memory) + x

    report = audit(Keeper(), torch.randn(3, generator=torch.Generator().manual_seed(0)))
    (f,) = report.findings
    assert f.code == "E0596" and f.module == "child" and "the attribute `memory`" in f.message, f
    assert f.where.endswith(str(Child.forward.__code__.co_firstlineno + 1))
