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
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import OwnershipError

Made = Tuple[Tensor, List[Any], Optional[Tensor]]


@dataclass(frozen=True)
class PyRoute:
    name: str
    code: str
    make: Callable[[Tensor, Optional[Tensor]], Made]  # -> (x to donate, other names, context)
    refused_arg: str  # the argument the refusal names (OwnershipError.arg)
    why: str  # the kind of second name the refusal reports (OwnershipError.why)
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


class Upgraded:
    """A weak reference to x's storage, kept as the other name: ``read()`` upgrades it, as any
    thread holding it could at any moment, and reads the memory as x's shape (None when gone).
    ``clone()`` is a snapshot of that read, for the before/after comparisons."""

    def __init__(self, x: Tensor, weak: Any, upgrade: Callable[[Any], Optional[torch.UntypedStorage]]) -> None:
        self.weak, self.upgrade, self.like = weak, upgrade, (x.dtype, tuple(x.shape))

    def read(self) -> Optional[Tensor]:
        storage = self.upgrade(self.weak)
        if storage is None or storage.nbytes() == 0:
            return None
        dtype, shape = self.like
        return torch.tensor([], dtype=dtype).set_(storage).view(shape).clone()

    def clone(self) -> Optional[Tensor]:
        return self.read()


def _python_weakref(x: Tensor, c: Optional[Tensor]) -> Made:
    return x, [Upgraded(x, weakref.ref(x.untyped_storage()), lambda w: w())], c


def _storage_weak_ref(x: Tensor, c: Optional[Tensor]) -> Made:
    def upgrade(w: StorageWeakRef) -> Optional[torch.UntypedStorage]:
        return None if w.expired() else torch.UntypedStorage._new_with_weak_ptr(w.cdata)

    return x, [Upgraded(x, StorageWeakRef(x.untyped_storage()), upgrade)], c


PY_ROUTES = [
    PyRoute("view kept", "kept = x.view(-1)", lambda x, c: (x, [x.view(-1)], c), "x", "other_handles"),
    PyRoute("x is a view", "x = base.view(shape)", _is_a_view, "x", "view"),
    PyRoute("slice kept (skip)", "skip = x[:, :3]", lambda x, c: (x, [x[:, :3]], c), "x", "other_handles"),
    PyRoute(
        "transpose kept", "kept = x.transpose(1, 2)", lambda x, c: (x, [x.transpose(1, 2)], c), "x", "other_handles"
    ),
    PyRoute("detach kept", "kept = x.detach()", lambda x, c: (x, [x.detach()], c), "x", "shared_storage"),
    PyRoute("copy.copy kept", "kept = copy.copy(x)", lambda x, c: (x, [copy.copy(x)], c), "x", "shared_storage"),
    PyRoute("context overlaps x", "context = x[..., :12]", _context_overlaps, "context", "overlaps_x"),
    PyRoute("numpy memory", "x = torch.from_numpy(a)", _numpy, "x", "foreign_memory"),
    PyRoute("x.numpy() kept", "a = x.numpy()", lambda x, c: (x, [x.numpy()], c), "x", "not_resizable"),
    PyRoute("dlpack memory", "x = torch.from_dlpack(a)", _dlpack, "x", "foreign_memory"),
    PyRoute("frombuffer memory", "x = torch.frombuffer(buf, ...)", _frombuffer, "x", "foreign_memory"),
    PyRoute("weakref to the storage kept", "r = weakref.ref(x.untyped_storage())", _python_weakref, "x", "weak_refs"),
    PyRoute("StorageWeakRef kept", "r = StorageWeakRef(x.untyped_storage())", _storage_weak_ref, "x", "weak_refs"),
]


@dataclass(frozen=True)
class Row:
    route: str
    pytorch: str
    rustc: str
    run_time: str  # `rust:<route>` / `py:<route>`: measured live by the demo; otherwise what happens
    test: str
    says: str = ""  # the README's run-time cell, for a live row

    @property
    def readme(self) -> Tuple[str, str, str, str, str]:
        """The row as README.md's catalogue shows it (tests/test_aliases.py compares them)."""
        return (self.route, self.pytorch, self.rustc, self.says or self.run_time, self.test)


_RUST = "`tests/alias_routes.rs`"
_PY = "`tests/test_aliases.py`"
_TX = "`tests/test_transaction.py`, `tests/test_transaction_stateful.py`"

# The README's catalogue, one row per route. "run time" is what forward_owned / add_in_place / a
# donation does; `rust:<name>` and `py:<name>` rows are measured live by the demo
# (plusequals._rust.alias_routes(), python_outcomes()).
TABLE = [
    Row("a borrow kept across the move", "silent", "E0505", "-", "`tests/ui/borrow_across_move.rs`"),
    Row("use after the move", "silent", "E0382", "-", "`tests/ui/use_after_move.rs`"),
    Row("a second `&mut`", "silent", "E0499", "-", "`tests/ui/two_mutable_paths.rs`"),
    Row("`&x` mutated with a tch `&mut self` op", "silent", "E0596", "-", "`tests/ui/mutate_borrowed_input.rs`"),
    Row(
        "`shallow_clone`",
        "silent (`copy.copy`)",
        "compiles",
        "rust:shallow_clone",
        f"`tests/shallow_clone.rs`, {_RUST}",
        "refused: 1 other handle",
    ),
    Row("`detach`", "silent", "compiles", "rust:detach", f"{_RUST}, {_PY}", "refused: storage shared with 1"),
    Row(
        "`view` / `reshape`",
        "silent",
        "compiles",
        "rust:view / reshape",
        f"{_RUST}, {_PY}",
        "refused: 1 other handle (the view holds its base)",
    ),
    Row(
        "`narrow` / indexing (a skip connection kept)",
        "silent",
        "compiles",
        "rust:narrow / indexing",
        f"{_RUST}, {_PY}",
        "refused: 2 other handles",
    ),
    Row(
        "`transpose` / `expand`",
        "silent",
        "compiles",
        "rust:transpose / expand",
        f"{_RUST}, {_PY}",
        "refused: 2 other handles",
    ),
    Row(
        "`context` overlaps `x`",
        "silent (context changes mid-block)",
        "compiles",
        "rust:context overlaps x",
        f"{_RUST}, {_PY}",
        "refused, naming `context`",
    ),
    Row(
        "grad mode turned back on inside the proof",
        "loud later (backward)",
        "compiles (`tch::with_grad`)",
        "rust:grad mode back on",
        f"{_RUST}, `tests/entry_points.rs`",
        "refused: grad mode on",
    ),
    Row(
        "autograd holds `x` for backward (`y = x * w`)",
        "loud later (backward)",
        "compiles",
        "rust:autograd saved x",
        _RUST,
        "refused: 1 other handle; the gradient stays right",
    ),
    Row(
        "`+=` while LayerNorm saved `x` (E0502's real sequence)",
        "loud later (backward)",
        "compiles",
        "rust:add_in_place while autograd holds x",
        _RUST,
        "`add_in_place` refused: 1 other handle",
    ),
    Row(
        "numpy / dlpack / `frombuffer` / `from_blob` memory",
        "silent (the numpy array changes)",
        "compiles (`unsafe from_blob`)",
        "rust:foreign memory",
        f"{_RUST}, {_PY}",
        "refused: foreign memory",
    ),
    Row(
        "a weak reference to `x`'s storage (`weak_intrusive_ptr`)",
        "silent (upgraded, it reads the output)",
        "compiles",
        "rust:weak reference kept",
        _RUST,
        "refused: 1 weak reference; `try_forward_owned` hands `x` back",
    ),
    Row(
        "`CppBlock::forward_owned` with a `shallow_clone` kept",
        "n/a",
        "compiles (C++ would write through it)",
        "rust:C++ twin: shallow_clone kept",
        f"{_RUST}, `tests/entry_points.rs`",
        "refused: 1 other handle (the C++ twin has the Rust contract)",
    ),
    Row(
        "a Python view, slice, `detach` or `copy.copy` kept",
        "silent",
        "n/a",
        "py:view kept",
        _PY,
        "refused by `RustBlock` and by the raw extension",
    ),
    Row(
        "`a = x.numpy()` kept (or taken earlier)",
        "silent (the numpy array changes)",
        "n/a",
        "py:x.numpy() kept",
        _PY,
        "refused: non-resizable storage (taking `x.numpy()` marks it for good)",
    ),
    Row(
        "`x` exported by DLPack (`jax.dlpack.from_dlpack(x)`)",
        "silent",
        "n/a",
        "refused while JAX holds it (its handle counts)",
        _PY,
    ),
    Row("a Python `UntypedStorage` held", "silent", "n/a", "refused while it is held", _PY),
    Row(
        "a weakref or `StorageWeakRef` to `x`'s storage kept",
        "silent (upgraded, it reads the output)",
        "n/a",
        "py:StorageWeakRef kept",
        f"{_PY}, {_TX}",
        "refused: weak reference(s) (`weakref.ref(x.untyped_storage())` too); once dropped, `x` is donated",
    ),
    Row(
        "one Python object, two names (`y = x`, `weakref.ref(x)`)",
        "silent",
        "n/a",
        "donated: every name is invalidated together",
        f"{_PY}, {_TX}",
    ),
    Row(
        "a TorchDispatchMode active (`FlopCounterMode`, a mode keeping every tensor)",
        "silent (the mode may keep `x`)",
        "n/a",
        "donation refused, naming the mode; `forward` exact (the mode sees its aten ops), `donate=False` exact "
        "through the custom op (the raw extension refuses it)",
        _TX,
    ),
    Row(
        "a TorchFunctionMode active",
        "silent",
        "n/a",
        "donation refused, naming the mode (`torch.device(...)` excepted); `forward` and `donate=False` run the "
        "PyTorch block the twin follows, whose calls the mode sees and may change (refused, naming the mode, where "
        "there is none: `from_state_dict`)",
        _TX + ", `tests/test_never_stale.py`",
    ),
    Row(
        "a `__torch_dispatch__` or `__torch_function__` subclass as `x` or `context` (`TwoTensor`)",
        "silent",
        "n/a",
        "donation refused, naming it; `forward` and `donate=False` run the PyTorch block the twin follows (its "
        "`TwoTensor`), whose ops the subclass sees (the custom op where there is none: `from_state_dict`)",
        "`tests/test_transaction.py`, `tests/test_never_stale.py`",
    ),
    Row(
        "a functorch wrapper as `x` (`vmap`, `jvp`, `grad`)",
        "n/a",
        "n/a",
        "`forward_owned` refused: no storage of its own (it was a Rust panic); `forward` runs under the transform",
        "`tests/test_transaction.py`",
    ),
    Row(
        "a dual tensor as `x` (forward-mode AD, `make_dual`)",
        "silent (the tangent was dropped)",
        "n/a",
        'donation refused (`.why == "tangent"`), `x` and its tangent kept; `forward` and `donate=False` keep the '
        "tangent",
        "`tests/test_holes.py`",
    ),
    Row(
        "a weakref to `x`'s storage made by a subclass's `__init_subclass__` (run when the donated class is made)",
        "silent (it was made after the check)",
        "n/a",
        "refused: the donated class is made before the check, which counts it; no Python code runs from the check "
        "to the move",
        "`tests/test_holes.py`",
    ),
    Row(
        "saved-tensor hooks that keep the Python object (`save_on_cpu`, an identity hook)",
        "loud later (backward)",
        "n/a",
        "donated: the hook holds the object, which is marked; the backward that unpacks it raises",
        _TX,
    ),
    Row(
        "the handle an in-place op returned, kept",
        "n/a",
        "compiles",
        "rust:in-place op's returned handle",
        _RUST,
        "refused: 1 other handle (`h = x.f_mul_scalar_(..)`, kept)",
    ),
    Row(
        "**tch API:** writing through that returned handle",
        "n/a",
        "compiles",
        "rust:tch API: returned handle",
        _RUST,
        "**written**: tch's own API, out of this crate's reach",
    ),
    Row(
        "**tch API:** `f_*_out(.., out: &Tensor)`, `copy_from(dst: &Tensor)`",
        "n/a",
        "compiles; **clippy refuses it in this crate**",
        "rust:tch API: _out through &Tensor",
        f"{_RUST}, `tests/test_lint.py`",
        "**written** in user code",
    ),
]


def rust_outcomes() -> dict:
    """Runs every Rust route now: name -> "refused (arg: reason); nothing written" or "written"
    (tch's own API)."""
    from .. import _rust

    return {name: outcome for name, outcome in _rust.alias_routes()}


def python_outcomes() -> dict:
    """Donates through every Python route now (``RustBlock.forward_owned(x, donate=True)``):
    name -> "refused (arg); nothing written", or what went wrong."""
    from ..model.blocks import BasicTransformerBlock, randomize_
    from .block import RustBlock

    block = randomize_(BasicTransformerBlock(16, 2, 8, context_dim=12), 0).eval()
    rust = RustBlock.from_torch(block)
    g = torch.Generator().manual_seed(1)
    out = {}
    for route in PY_ROUTES:
        x, others, c = route.make(torch.randn(2, 5, 16, generator=g), torch.randn(2, 3, 12, generator=g))
        before = [read(o) for o in [x, *others]]
        try:
            with torch.no_grad():
                rust.forward_owned(x, c, donate=True)
            out[route.name] = "ACCEPTED"
        except OwnershipError as e:
            kept = all(same(read(o), b) for o, b in zip([x, *others], before))
            out[route.name] = f"refused ({e.arg}: {e.why}); " + ("nothing written" if kept else "BUT SOMETHING CHANGED")
    return out


def read(name: Any) -> Any:
    """A snapshot of what a kept name reads now: a tensor, a numpy array, or None (a weak
    reference whose storage is gone)."""
    if isinstance(name, Upgraded):
        return name.read()
    return name.copy() if isinstance(name, np.ndarray) else name.clone()


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two snapshots (``read``)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, np.ndarray):
        return np.array_equal(a.view(np.uint8), b.view(np.uint8))
    a, b = (torch.as_tensor(t).detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b))
    return torch.equal(a, b)


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
    if row.route.startswith("**tch API"):
        return cell.startswith("written")
    return cell.startswith("refused") and cell.endswith("nothing written")
