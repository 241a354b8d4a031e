"""forward_owned at the Python boundary: grad mode, donation, and what a donated tensor becomes.
The alias routes themselves (every second name on x's memory) are in test_aliases.py."""

from __future__ import annotations

import pytest
import torch

from plusequals import DonatedTensor, DonationConsumed, OwnershipError, RustBlock, UseAfterDonation
from support.boundary import (
    DIM,
    _raw_block,
    _raw_error,
    assert_matches,
    grad_context,
    names,
    same_bits,
    small_block,
    small_inputs,
    snapshot,
    unchanged,
)


@pytest.fixture
def small():
    block = small_block()
    return block, RustBlock.from_torch(block), *small_inputs()


@pytest.mark.parametrize("which", ["x", "context"])
def test_forward_owned_refuses_requires_grad_in_grad_mode(small, which):
    _, rust, x, c = small
    if which == "x":
        x.requires_grad_(True)
    else:
        c.requires_grad_(True)
    before = snapshot(x), snapshot(c)
    assert torch.is_grad_enabled()
    with pytest.raises(RuntimeError, match="requires grad") as info:
        rust.forward_owned(x, c)
    message = str(info.value)
    assert f"refuses {which}" in message and "forward()" in message and "torch.no_grad" in message, message
    with pytest.raises(RuntimeError, match="requires grad"):
        rust.forward_owned(x.clone() if which == "x" else x, c, donate=True)
    assert unchanged(before[0], x) and unchanged(before[1], c)


@pytest.mark.parametrize("mode", ["no_grad", "inference"])
def test_forward_owned_accepts_requires_grad_without_grad_mode(small, mode):
    block, rust, x, c = small
    x.requires_grad_(True)
    c.requires_grad_(True)
    with torch.no_grad():
        expected = block(x, c)
    with grad_context(mode):
        got = rust.forward_owned(x, c)
    assert not got.requires_grad
    assert_matches(got, expected)


def test_forward_owned_donate_returns_x_buffer_and_invalidates_x(small):
    block, rust, x, c = small
    with torch.no_grad():
        expected = block(x, c)
        ptr = x.data_ptr()
        y = rust.forward_owned(x, c, donate=True)
    assert y.data_ptr() == ptr, "the result is not in x's old buffer"
    assert_matches(y, expected)
    assert isinstance(x, DonatedTensor)
    uses = {
        "x + 1": lambda: x + 1,
        "x.shape": lambda: x.shape,
        "x.sum()": lambda: x.sum(),
        "torch.add": lambda: torch.add(x, 1),
        "x.clone()": lambda: x.clone(),
        "x[0]": lambda: x[0],
        "forward(x)": lambda: rust.forward(x, c),
        "forward_owned(x)": lambda: rust.forward_owned(x, c),
        "forward(context=x)": lambda: rust.forward(y.clone(), x),
    }
    named = {"x + 1": "add", "x.shape": "shape (get)", "x.sum()": "sum", "torch.add": "add", "x.clone()": "clone"}
    for what, use in uses.items():
        with pytest.raises(RuntimeError, match="donated") as e:
            use()
        if what in named:  # a use of x itself: the class and the operation, by name
            assert isinstance(e.value, UseAfterDonation) and isinstance(e.value, DonationConsumed), what
            assert e.value.op == named[what] and f"({named[what]})" in str(e.value), what
    for show in (repr, str, "{}".format):  # debuggers and loggers print it
        assert "donated" in show(x) and "DonatedTensor" in show(x)
    with pytest.raises(RuntimeError, match="context is a donated tensor"):
        rust.forward(y.clone(), x)
    assert_matches(y, expected)  # the returned tensor is untouched by all that


@pytest.mark.parametrize("how", ["plain", "data"])
def test_a_donation_moves_the_buffer_and_leaves_x_empty_by_either_route(small, how):
    """The move (rust/python/donation.rs): without a libtorch op for a plain tensor
    (``pe_move_out``); with ``detach()`` and ``set_()`` for one whose metadata may not change
    (``.data``). Either way the result owns x's old buffer and x is left empty, shape (0,), its
    version bumped, and marked donated."""
    block, rust, x, c = small
    if how == "data":
        x = x.clone().requires_grad_().data  # allow_tensor_metadata_change is false: the ops' route
    with torch.no_grad():
        expected = block(x, c)
        ptr, version = x.data_ptr(), x._version
        y = rust.forward_owned(x, c, donate=True)
    assert y.data_ptr() == ptr
    assert_matches(y, expected)
    assert not y.requires_grad and y.grad_fn is None and y._base is None
    with torch._C.DisableTorchFunctionSubclass():
        assert isinstance(x, DonatedTensor) and x.shape == (0,) and x.untyped_storage().nbytes() == 0
        assert x._version > version
    y.resize_(y.numel())  # y is a tensor of its own: its metadata may change
    assert y.data_ptr() == ptr


# case -> the argument and the kind of second name the refusal reports (OwnershipError.arg, .why)
REFUSALS = {
    "view": ("x", "view"),
    "slice": ("x", "view"),
    "detach": ("x", "shared_storage"),
    "view_as": ("x", "other_handles"),
    "expanded_storage": ("x", "not_dense"),
    "context_is_x": ("context", "overlaps_x"),
    "context_view_of_x": ("context", "overlaps_x"),
    "inference_tensor": ("x", None),  # not an alias: libtorch refuses the write itself (a ValueError)
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_forward_owned_donate_refuses_shared_storage(case):
    """Refused donations raise OwnershipError naming the argument and the kind of second name
    (an inference tensor outside inference mode: a ValueError naming x), and leave every tensor
    as it was (x still usable)."""
    block = small_block(context_dim=None)  # self-attention: x may be passed as context
    rust = RustBlock.from_torch(block)
    base, _ = small_inputs(batch=4, context_dim=None)
    others = []
    c = None
    if case == "view":
        x = base.view(4, 5, DIM)
    elif case == "slice":
        x = base[:2]
    elif case == "detach":
        x, others = base, [base.detach()]
    elif case == "view_as":
        x, others = base, [base.view_as(base)]
    elif case == "expanded_storage":  # stride 0 but not a view: only the strides tell
        x = torch.empty(0).set_(base[0].clone().untyped_storage(), 0, (2, 5, DIM), (0, DIM, 1))
    elif case == "context_is_x":
        x = base.clone()
        c = x
    elif case == "context_view_of_x":
        x = base.clone()
        c = x[:, :3]
    elif case == "inference_tensor":
        with torch.inference_mode():
            x = base.clone()
    arg, why = REFUSALS[case]
    before = snapshot(x), snapshot(base), snapshot(c)
    with torch.no_grad(), pytest.raises(ValueError) as info:
        rust.forward_owned(x, c, donate=True)
    if why is None:
        assert type(info.value) is ValueError and names(str(info.value), arg), str(info.value)
    else:
        assert isinstance(info.value, OwnershipError) and (info.value.arg, info.value.why) == (arg, why), info.value
    assert not isinstance(x, DonatedTensor)
    assert unchanged(before[0], x) and unchanged(before[1], base) and unchanged(before[2], c)
    with torch.no_grad():  # x is still usable, and gives the right answer without donation
        assert_matches(rust.forward_owned(x, c), block(x.clone(), None if c is None else c.clone()))
    for o in others:
        assert same_bits(o, before[1][1])


@pytest.mark.parametrize("entry", ["forward", "forward_owned", "forward_loop"])
def test_device_mismatch_names_the_devices(small, entry):
    """A tensor on another device (meta, on a CPU-only machine) is refused naming the argument
    and both devices by their torch names (tch alone would call meta "Mps")."""
    _, rust, x, c = small
    call = getattr(rust, entry)
    with pytest.raises(ValueError, match=r"^x is on meta but the block's weights are on cpu$"):
        call(x.to("meta"), c)
    with pytest.raises(ValueError, match=r"^context is on meta but the block's weights are on cpu$"):
        call(x, c.to("meta"))
    meta_rust = RustBlock.from_torch(small_block().to("meta"))
    with pytest.raises(ValueError, match=r"^x is on cpu but the block's weights are on meta$"):
        getattr(meta_rust, entry)(x, c)
    y = getattr(meta_rust, entry)(x.to("meta"), c.to("meta"))  # shape inference runs through Rust too
    assert y.device.type == "meta" and y.shape == x.shape


def test_forward_owned_donate_false_never_mutates(small):
    """With donate=False the caller's x is unchanged, even when x is the only owner of its storage
    (the case donate=True would write into)."""
    block, rust, x, c = small
    before = snapshot(x), snapshot(c)
    with torch.no_grad():
        for _ in range(3):
            y = rust.forward_owned(x, c)
    assert y.data_ptr() != x.data_ptr()
    assert unchanged(before[0], x) and unchanged(before[1], c)


def test_raw_extension_donate_with_context_aliasing_x():
    block, raw = _raw_block(context_dim=None)
    x, _ = small_inputs(context_dim=None)
    with torch.no_grad():
        expected = block(x, x)
        err = _raw_error(lambda: raw.forward_owned(x, x, donate=True))
    if err is None:  # either refuse, or compute with the context as passed
        assert_matches(x, expected)
    else:
        assert isinstance(err, OwnershipError) and err.arg == "context", repr(err)


def test_raw_extension_donate_overlapping_x_names_x():
    _, raw = _raw_block()
    _, c = small_inputs()
    x = torch.empty(0).set_(torch.randn(5 * DIM).untyped_storage(), 0, (2, 5, DIM), (0, DIM, 1))
    with torch.no_grad():
        err = _raw_error(lambda: raw.forward_owned(x, c, donate=True))
    assert isinstance(err, OwnershipError) and (err.arg, err.why) == ("x", "not_dense"), repr(err)
