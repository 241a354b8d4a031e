"""The alias catalogue: every way to reach ``x``'s memory through a second name, and what each
language does about it.

Two halves, one table:

* ``PY_ROUTES``: routes a Python user takes. Each ``make(x, context)`` builds the second name;
  ``tests/test_aliases.py`` shows PyTorch's ``+=`` writing through it and both the ``RustBlock``
  and the raw extension refusing the donation, nothing written.
* The Rust routes live in ``rust/aliases.rs`` (run by ``tests/alias_routes.rs``, and live here
  through ``plusequals._rust.alias_routes()``).

``TABLE`` is the README's catalogue, one row per route: PyTorch, rustc, run time, and the test.
``python -m plusequals demo`` prints it, with the run-time column measured live.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

Made = Tuple[Tensor, List[Any], Optional[Tensor]]


@dataclass(frozen=True)
class PyRoute:
    name: str
    code: str
    make: Callable[[Tensor, Optional[Tensor]], Made]  # -> (x to donate, other names, context)
    refused_arg: str  # the argument the refusal names
    why: str  # a word both the Python and the Rust refusal contain
    pytorch: str = "silent: the other name reads the block's output"


def _numpy(x: Tensor, c: Optional[Tensor]) -> Made:
    a = x.numpy().copy()
    return torch.from_numpy(a), [a], c


def _dlpack(x: Tensor, c: Optional[Tensor]) -> Made:
    a = x.numpy().copy()
    return torch.from_dlpack(a), [a], c


def _frombuffer(x: Tensor, c: Optional[Tensor]) -> Made:
    buf = bytearray(x.numpy().tobytes())
    return torch.frombuffer(buf, dtype=x.dtype).view(x.shape), [np.frombuffer(buf, dtype=np.float32)], c


def _context_overlaps(x: Tensor, c: Optional[Tensor]) -> Made:
    assert c is not None
    context = x[..., : c.shape[-1]]
    return x, [context], context


def _is_a_view(x: Tensor, c: Optional[Tensor]) -> Made:
    base = x.clone().reshape(-1)
    return base.view(x.shape), [base], c


PY_ROUTES = [
    PyRoute("view kept", "kept = x.view(-1)", lambda x, c: (x, [x.view(-1)], c), "x", "view"),
    PyRoute("x is a view", "x = base.view(shape)", _is_a_view, "x", "view"),
    PyRoute("slice kept (skip)", "skip = x[:, :3]", lambda x, c: (x, [x[:, :3]], c), "x", "view"),
    PyRoute("transpose kept", "kept = x.transpose(1, 2)", lambda x, c: (x, [x.transpose(1, 2)], c), "x", "view"),
    PyRoute("detach kept", "kept = x.detach()", lambda x, c: (x, [x.detach()], c), "x", "detach"),
    PyRoute("copy.copy kept", "kept = copy.copy(x)", lambda x, c: (x, [copy.copy(x)], c), "x", "storage"),
    PyRoute("context overlaps x", "context = x[..., :12]", _context_overlaps, "context", "overlaps x"),
    PyRoute("numpy memory", "x = torch.from_numpy(a)", _numpy, "x", "numpy"),
    PyRoute("x.numpy() kept", "a = x.numpy()", lambda x, c: (x, [x.numpy()], c), "x", "numpy"),
    PyRoute("dlpack memory", "x = torch.from_dlpack(a)", _dlpack, "x", "dlpack"),
    PyRoute("frombuffer memory", "x = torch.frombuffer(buf, ...)", _frombuffer, "x", "frombuffer"),
]


@dataclass(frozen=True)
class Row:
    route: str
    pytorch: str
    rustc: str
    run_time: str
    test: str


# The README's catalogue. "run time" is what forward_owned / add_in_place / a donation does;
# `rust:<name>` rows are measured live by the demo from plusequals._rust.alias_routes().
TABLE = [
    Row("a borrow kept across the move", "silent", "E0505", "-", "tests/ui/borrow_across_move.rs"),
    Row("use after the move", "silent", "E0382", "-", "tests/ui/use_after_move.rs"),
    Row("a second `&mut`", "silent", "E0499", "-", "tests/ui/two_mutable_paths.rs"),
    Row("`&x` mutated in place (tch `&mut self` op)", "silent", "E0596", "-", "tests/ui/mutate_borrowed_input.rs"),
    Row("`shallow_clone`", "silent (`copy.copy`)", "compiles", "rust:shallow_clone", "tests/shallow_clone.rs"),
    Row("`detach`", "silent", "compiles", "rust:detach", "tests/alias_routes.rs, tests/test_aliases.py"),
    Row("`view` / `reshape`", "silent", "compiles", "rust:view / reshape", "tests/alias_routes.rs, tests/test_aliases.py"),
    Row("`narrow` / indexing (a skip kept)", "silent", "compiles", "rust:narrow / indexing", "tests/alias_routes.rs, tests/test_aliases.py"),
    Row("`transpose` / `expand`", "silent", "compiles", "rust:transpose / expand", "tests/alias_routes.rs, tests/test_aliases.py"),
    Row("`context` overlaps `x`", "silent (context changes mid-block)", "compiles", "rust:context overlaps x", "tests/alias_routes.rs, tests/test_aliases.py"),
    Row("grad mode back on inside the proof", "loud later (backward)", "compiles (`tch::with_grad`)", "rust:grad mode back on", "tests/alias_routes.rs"),
    Row("autograd holds `x` for backward", "loud later (backward)", "compiles", "rust:autograd saved x", "tests/alias_routes.rs, tests/test_aliases.py"),
    Row("`+=` while LayerNorm saved `x` (E0502's real sequence)", "loud later (backward)", "compiles", "rust:add_in_place while autograd holds x", "tests/alias_routes.rs"),
    Row("numpy / dlpack / frombuffer memory", "silent (numpy array changes)", "compiles (`unsafe from_blob`)", "rust:foreign memory", "tests/alias_routes.rs, tests/test_aliases.py"),
    Row("a Python view kept", "silent", "n/a", "py:view kept", "tests/test_aliases.py"),
    Row("a Python slice kept (skip connection)", "silent", "n/a", "py:slice kept (skip)", "tests/test_aliases.py"),
    Row("numpy memory, donated from Python", "silent (numpy array changes)", "n/a", "py:numpy memory", "tests/test_aliases.py"),
    Row("one Python object, two names (`y = x`)", "silent", "n/a", "both names invalidated", "tests/test_aliases.py"),
    Row("the handle an in-place op returned, kept", "n/a", "compiles", "rust:in-place op's returned handle", "tests/alias_routes.rs"),
    Row("tch API: writes through that handle", "n/a", "compiles", "rust:tch API: returned handle", "tests/alias_routes.rs"),
    Row("tch API: `f_*_out(&self, out: &Tensor)`, `copy_from`", "n/a", "compiles; clippy refuses it in this crate", "rust:tch API: _out through &Tensor", "tests/alias_routes.rs, tests/test_lint.py"),
]


def rust_outcomes() -> dict:
    """Runs every Rust route now: name -> "refused (arg: reason); nothing written" or "written"
    (tch's own API)."""
    from . import _rust

    return {name: outcome for name, outcome in _rust.alias_routes()}


def python_outcomes() -> dict:
    """Donates through every Python route now (``RustBlock.forward_owned(x, donate=True)``):
    name -> "refused (arg); nothing written", or what went wrong."""
    from .blocks import BasicTransformerBlock, randomize_
    from .rust import RustBlock

    block = randomize_(BasicTransformerBlock(16, 2, 8, context_dim=12), 0).eval()
    rust = RustBlock.from_torch(block)
    g = torch.Generator().manual_seed(1)
    out = {}
    for route in PY_ROUTES:
        x, others, c = route.make(torch.randn(2, 5, 16, generator=g), torch.randn(2, 3, 12, generator=g))
        before = [torch.as_tensor(o).clone() for o in [x, *others]]
        try:
            with torch.no_grad():
                rust.forward_owned(x, c, donate=True)
            out[route.name] = "ACCEPTED"
        except ValueError as e:
            kept = all(torch.equal(torch.as_tensor(o), b) for o, b in zip([x, *others], before))
            arg = str(e).split(" ", 1)[0]
            out[route.name] = f"refused ({arg}); " + ("nothing written" if kept else "BUT SOMETHING CHANGED")
    return out


def table_rows(rust: Optional[dict] = None, python: Optional[dict] = None) -> List[Row]:
    """``TABLE`` with each ``rust:<route>`` / ``py:<route>`` cell replaced by what that route
    did just now."""
    live = {"rust": rust_outcomes() if rust is None else rust, "py": python_outcomes() if python is None else python}
    rows = []
    for row in TABLE:
        side, _, name = row.run_time.partition(":")
        if side in live and name:
            row = Row(row.route, row.pytorch, row.rustc, live[side][name], row.test)
        rows.append(row)
    return rows


def expected_outcome(row: Row, cell: str) -> bool:
    """What each run-time cell must say: the tch-API rows write (documented), every other live
    row refuses with nothing written."""
    if row.route.startswith("tch API"):
        return cell.startswith("written")
    return cell.startswith("refused") and cell.endswith("nothing written")
