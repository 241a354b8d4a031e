"""Reads of a moved name in inner frames: a list, set or dict comprehension or a generator
expression (each its own frame on Python 3.11) or a lambda that the watched frame calls reads the
frame's cell. ``torch.cat([b(h) + shortcut for b in self.branches])`` after an in-place
activation wrote into ``shortcut``'s memory is ``E0382`` at that line, as the same read in a
plain expression is; a comprehension that does not read the moved name leaves the write a move.
"""

from __future__ import annotations

import itertools
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples
from plusequals.auditing import audit

# How the frame reads `shortcut` (or not) once `self.act` wrote into its memory; `{r}` is the read.
READS = {
    "expression": "out = self.branches[0](h) + {r}",
    "list comprehension": "out = torch.cat([b(h) + {r} for b in self.branches])",
    "generator expression": "out = sum(b(h) + {r} for b in self.branches)",
    "set comprehension": "out = sum({{b(h) + {r} for b in self.branches}})",
    "dict comprehension": "out = sum({{i: b(h) + {r} for i, b in enumerate(self.branches)}}.values())",
    "nested comprehension": "out = torch.cat([torch.cat([b(h) + {r} for _ in range(2)]) for b in self.branches])",
    "lambda": "f = lambda b: b(h) + {r}\n        out = torch.cat([f(b) for b in self.branches])",
    "lambda through map": "out = torch.cat(list(map(lambda b: b(h) + {r}, self.branches)))",
}
WRITERS = {"nn.ReLU(inplace=True)": "nn.ReLU(inplace=True)", "a module's add_": "AddOne()"}

_counter = itertools.count()


class AddOne(nn.Module):
    def forward(self, t):
        return t.add_(1.0)


def build(read: str, writer: str, reads_moved: bool) -> tuple:
    """A module whose forward moves `h` into ``writer`` while `shortcut` still names it, then
    reads `shortcut` (or a clone kept before the write) as ``read`` says; returns it and the
    read's ``path:line``."""
    name = "shortcut" if reads_moved else "kept"
    source = f"""
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = {writer}
        self.branches = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        h = x * 1.0
        shortcut = h
        kept = h.clone()
        h = self.act(h)
        {READS[read].format(r=name)}
        return out
"""
    filename = f"<inner-frames-{next(_counter)}>"
    namespace = {"torch": torch, "nn": nn, "AddOne": AddOne}
    exec(compile(source, filename, "exec"), namespace)
    line = next(i for i, s in enumerate(source.splitlines(), start=1) if name in s and ("out =" in s or "lambda" in s))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = namespace["Branchy"]()
    return model, f"{filename}:{line}"


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(sorted(READS)), st.sampled_from(sorted(WRITERS)), st.booleans(), st.booleans())
def test_a_read_of_a_moved_name_in_an_inner_frame_is_E0382_at_its_line(read, writer, reads_moved, grad):
    model, line = build(read, WRITERS[writer], reads_moved)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    before = sys.gettrace()
    with torch.set_grad_enabled(grad):
        report = audit(model, x)
    assert sys.gettrace() is before  # nothing left tracing
    assert report.error is None, report.error
    if reads_moved:
        (f,) = report.findings
        assert f.code == "E0382" and f.read_at == line and f.module == "act", f
        assert not report.moves
    else:
        assert report.clean and len(report.moves) == 1, report.findings


def test_two_names_read_in_a_comprehension_interleave():
    """``E0499`` through the same path: `h` taken before the write through `x`, read in a list
    comprehension after it."""
    source = """
def f(x):
    x = x * 1.0
    h = x
    x += 1.0
    return [h + i for i in range(2)]
"""
    namespace = {"torch": torch}
    exec(compile(source, "<inner-frames-alias>", "exec"), namespace)
    (g,) = audit(namespace["f"], torch.randn(3, generator=torch.Generator().manual_seed(0))).findings
    assert (g.code, g.where, g.read_at) == ("E0499", "<inner-frames-alias>:5", "<inner-frames-alias>:6")
