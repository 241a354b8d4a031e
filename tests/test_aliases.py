"""The alias routes at the Python boundary: every way to reach ``x``'s memory through a second
name, what PyTorch does with it (the seed's ``+=``), and what a donation to Rust does.

For each route there are three columns (``plusequals.twin.aliases.PY_ROUTES``):

* PyTorch: the ``iadd`` block on ``x`` writes through the second name, silently.
* ``RustBlock.forward_owned(x, donate=True)``: refused with ``OwnershipError`` whose ``.arg``
  names ``x`` or ``context`` and whose ``.why`` names the kind of second name, every tensor (and
  numpy array) bitwise unchanged, ``x`` still usable.
* The raw extension (``plusequals._rust.Block``, no Python checks): refused by the same Rust
  check (rust/ownership.rs), nothing written.

The Rust-side routes (shallow_clone, autograd's saved tensors, grad mode turned back on, ...) are
``tests/alias_routes.rs``; both tables are in the README and printed by ``python -m plusequals demo``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import examples
from plusequals import DonatedTensor, OwnershipError, RustBlock
from plusequals.twin import aliases
from support.boundary import RACE_ATTEMPTS, _raw_block, assert_matches, same_bits, small_block, small_inputs


@pytest.mark.parametrize("route", aliases.PY_ROUTES, ids=lambda r: r.name)
def test_pytorch_iadd_writes_through_the_second_name(route):
    """The PyTorch column: with ``+=`` inside the block, the other name reads the output."""
    block = small_block()
    x, c = small_inputs()
    x, others, c = route.make(x, c)
    before = [aliases.read(o) for o in others]
    with torch.no_grad():
        block(x, c, residual="iadd")
    changed = [not aliases.same(aliases.read(o), b) for o, b in zip(others, before)]
    assert any(changed), f"{route.name}: the seed's += did not reach the other name"
    assert route.pytorch.startswith("silent"), route.pytorch


@pytest.mark.parametrize("route", aliases.PY_ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize("entry", ["RustBlock", "raw"])
def test_donation_through_a_second_name_is_refused_and_nothing_is_written(route, entry):
    block = small_block()
    rust = RustBlock.from_torch(block)
    _, raw = _raw_block()
    x, c = small_inputs()
    x, others, c = route.make(x, c)
    before_x, before_c = x.clone(), None if c is None else c.clone()
    before = [aliases.read(o) for o in others]
    call = rust.forward_owned if entry == "RustBlock" else raw.forward_owned
    with torch.no_grad(), pytest.raises(OwnershipError) as info:
        call(x, c, donate=True)
    assert (info.value.arg, info.value.why) == (route.refused_arg, route.why), f"{route.name}: {info.value}"
    assert not isinstance(x, DonatedTensor)
    assert same_bits(x, before_x) and (c is None or same_bits(c, before_c))
    assert all(aliases.same(aliases.read(o), b) for o, b in zip(others, before)), (
        f"{route.name}: the other name changed"
    )
    with torch.no_grad():  # x is still usable and still right, without donation
        assert_matches(rust.forward_owned(x, c), block(before_x, before_c))


def test_a_python_storage_object_is_an_alias_while_someone_holds_it():
    """``x.untyped_storage()`` held in Python reads the buffer: refused. Once dropped, torch 2.11
    still keeps the object alive with the storage (PyObject preservation), but nobody can reach
    it, so the donation goes through."""
    block, raw = _raw_block()
    x, c = small_inputs()
    held = x.untyped_storage()
    before = x.clone()
    with torch.no_grad(), pytest.raises(OwnershipError) as info:
        raw.forward_owned(x, c, donate=True)
    assert (info.value.arg, info.value.why, info.value.count) == ("x", "shared_storage", 1)
    assert same_bits(x, before)
    del held
    with torch.no_grad():
        out = raw.forward_owned(x, c, donate=True)
    assert_matches(out, block(before, c))


def test_python_names_for_one_object_are_invalidated_together():
    """``y = x`` is not an alias libtorch can see (one Python object): the donation goes through,
    and every name for the object is the donated tensor afterwards."""
    block = small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs()
    y_name = x
    with torch.no_grad():
        expected = block(x.clone(), c)
        out = rust.forward_owned(x, c, donate=True)
    assert_matches(out, expected)
    with pytest.raises(RuntimeError, match="donated"):
        y_name + 1


def test_raw_donation_moves_the_buffer_out_of_the_python_object():
    """The raw extension moves and marks, as RustBlock does: the Python object lets go of the buffer
    (it becomes empty, so no Python name can read what the block writes) and becomes a
    DonatedTensor, so that every later use raises instead of reading an empty tensor."""
    block, raw = _raw_block()
    x, c = small_inputs()
    y_name = x
    ptr = x.data_ptr()
    with torch.no_grad():
        expected = block(x.clone(), c)
        out = raw.forward_owned(x, c, donate=True)
    assert out.data_ptr() == ptr
    assert_matches(out, expected)
    assert isinstance(x, DonatedTensor) and y_name is x
    with pytest.raises(RuntimeError, match="use of a donated tensor"):
        x.sum()
    with torch._C.DisableTorchFunctionSubclass():
        assert x.numel() == 0 and x.untyped_storage().nbytes() == 0


def test_no_thread_can_alias_x_between_the_check_and_the_move():
    """A second Python thread keeps taking storage handles on ``x`` while the main thread donates
    it. The check and the move happen in Rust under one hold of the GIL, so each donation either
    is refused (a handle existed) or leaves no handle of the other thread on the written buffer."""
    block = small_block()
    rust = RustBlock.from_torch(block)
    stop = threading.Event()
    shared = {"x": None}
    taken: list = []

    def alias_taker():
        while not stop.is_set():
            x = shared["x"]
            if x is not None and not isinstance(x, DonatedTensor):
                try:
                    taken.append(x.untyped_storage())  # a storage handle: holds the buffer
                except RuntimeError:
                    pass  # donated between the check above and the call
            if len(taken) > 8:
                taken.pop(0)

    thread = threading.Thread(target=alias_taker)
    thread.start()
    accepted = refused = i = 0
    try:
        # At least 300 donations, and on until both sides of the race were reached (scheduling
        # decides how often the other thread gets in first).
        while (i < 300 or not (accepted and refused)) and i < RACE_ATTEMPTS:
            i += 1
            x, c = small_inputs(seed=i)
            shared["x"] = x
            if i % 2:
                time.sleep(0.0005)  # let the other thread in: it may take a handle first
            try:
                with torch.no_grad():
                    out = rust.forward_owned(x, c, donate=True)
            except OwnershipError:
                refused += 1
                continue
            accepted += 1
            held = [s for s in list(taken) if s.nbytes() > 0]
            assert all(s.data_ptr() != out.data_ptr() for s in held), "a storage handle reads the written buffer"
    finally:
        stop.set()
        thread.join()
    assert accepted > 0 and refused > 0, (accepted, refused)  # both sides of the race were reached


def test_a_tensor_jax_holds_through_dlpack_is_refused_until_jax_lets_go():
    """``jax.dlpack.from_dlpack(x)`` shares x's memory (no copy) and holds a handle on it: the
    donation is refused while the JAX array lives, and goes through once it is gone."""
    jax_dlpack = pytest.importorskip("jax.dlpack", reason="needs the optional extra plusequals[compilers]")
    block, raw = _raw_block()
    x, c = small_inputs()
    held = jax_dlpack.from_dlpack(x)
    before = x.clone()
    with torch.no_grad(), pytest.raises(OwnershipError) as info:
        raw.forward_owned(x, c, donate=True)
    assert (info.value.arg, info.value.why) == ("x", "other_handles")
    assert same_bits(x, before)
    del held
    with torch.no_grad():
        assert_matches(raw.forward_owned(x, c, donate=True), block(before, c))


def catalogue_rows_in_readme():
    """The rows of README.md's alias catalogue table, cell by cell."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs/guide/bugs.md").read_text()
    section = text.split("### The alias catalogue", 1)[1]
    lines = [ln for ln in section.split("\n\n")[2].splitlines() if ln.startswith("|")][2:]
    return [tuple(cell.strip() for cell in ln.strip("|").split(" | ")) for ln in lines]


def test_the_readme_catalogue_is_the_table_the_demo_runs():
    """README.md's catalogue says only what plusequals.twin.aliases.TABLE (run live by the demo, its
    outcomes checked by tests/test_demo.py) says, row for row."""
    assert catalogue_rows_in_readme() == [row.readme for row in aliases.TABLE]


_VIEWS = {
    "view": lambda x: x.view(-1),
    "reshape": lambda x: x.reshape(x.shape[0], -1),
    "slice": lambda x: x[:, :1],
    "transpose": lambda x: x.transpose(1, 2),
    "unsqueeze": lambda x: x.unsqueeze(0),
    "narrow": lambda x: x.narrow(-1, 0, 2),
}
# Ops autograd records with grad on that keep x itself for the backward of w. (``x @ w`` on a 3-D x
# saves a 2-D view of x: the refusal then names a view, rightly.)
_SAVED = {
    "x * w": lambda x, w: x * w,
    "x.sin() * w": lambda x, w: x.sin() * w * x,
    "w.mul(x)": lambda x, w: w.mul(x),
}


@settings(max_examples=examples(20), deadline=None)
@given(
    views=st.lists(st.sampled_from(sorted(_VIEWS)), max_size=2),
    saved=st.lists(st.sampled_from(sorted(_SAVED)), max_size=2),
)
def test_the_other_handles_refusal_names_the_holder_that_applied(views, saved):
    """``other_handles`` says who holds the handle, from libtorch's counts: a view of
    x that is alive (other tensors share its storage), else C++ code holding x itself (autograd's
    saved tensor), never the list of every possible cause."""
    assume(views or saved)
    _, raw = _raw_block()
    x, c = small_inputs()
    w = torch.ones_like(x).requires_grad_(True)
    kept = [_VIEWS[v](x) for v in views]
    with torch.enable_grad():
        graphs = [_SAVED[s](x, w) for s in saved]
    before = x.clone()
    with torch.no_grad(), pytest.raises(OwnershipError) as info:
        raw.forward_owned(x, c, donate=True)
    message = str(info.value)
    assert (info.value.arg, info.value.why) == ("x", "other_handles"), message
    assert same_bits(x, before)
    names_views, names_autograd = "a view of it is alive" in message, "autograd saved x" in message
    assert (names_views, names_autograd) == (bool(views), not views), message
    assert "shallow_clone" not in message, message  # a Rust-only holder is not named to Python
    del kept, graphs
