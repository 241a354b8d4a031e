"""The C++ twin (cpp/block.cpp) from Python: ``CppBlock.from_torch(block)``.

Parity with the PyTorch block (fp32 CPU, ||a-b||/||b|| <= 1e-5, with and without context, both
attention paths; in fact bitwise equal to the Rust twin, which runs the same ATen ops in the
same order), gradients through ``forward`` (libtorch's autograd records the C++ ops), the same
donation rules as RustBlock, and the C++ bug gallery: every case compiled, every bug happened.
"""

import pytest
import torch

from conftest import make_block, make_inputs, rel_err
from plusequals import CppBlock, DonatedTensor, OwnershipError, RustBlock, _rust
from plusequals.cli.demo import read_cases
from plusequals.twin import aliases

TOL = 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
@pytest.mark.parametrize("with_context", [True, False], ids=["context", "self"])
def test_cpp_forward_matches_pytorch_and_equals_rust_bitwise(attention, with_context):
    block = make_block(context_dim=None if not with_context else 192, attention=attention)
    x, c = make_inputs(tokens=64, context=with_context)
    with torch.no_grad():
        expected = block(x, c)
        got = CppBlock.from_torch(block)(x, c)
        rust = RustBlock.from_torch(block)(x, c)
        owned = CppBlock.from_torch(block).forward_owned(x, c)
    assert rel_err(got, expected) <= TOL
    assert torch.equal(got, rust), "the C++ and Rust twins run the same ops: the bits should agree"
    assert torch.equal(owned, got)


def test_gradients_flow_through_cpp_forward():
    block = make_block()
    x, c = make_inputs(tokens=16)
    x.requires_grad_(True)
    c.requires_grad_(True)
    torch_grads = torch.autograd.grad(block(x, c).square().mean(), [x, c, *block.parameters()])
    cpp = CppBlock.from_torch(block)
    cpp_grads = torch.autograd.grad(cpp(x, c).square().mean(), [x, c, *block.parameters()])
    for a, b in zip(cpp_grads, torch_grads):
        assert rel_err(a, b) <= TOL


def test_cpp_forward_loop_and_donation_follow_the_rust_rules():
    block = make_block()
    cpp = CppBlock.from_torch(block)
    x, c = make_inputs(tokens=16)
    with torch.no_grad():
        expected = block(x, c)
        assert rel_err(cpp.forward_loop(x, c, n=3, owned=True), expected) <= TOL
        kept = x.view(-1)  # an alias: C++ alone would write through it
        before = x.clone()
        with pytest.raises(OwnershipError) as info:
            cpp.forward_owned(x, c, donate=True)
        assert (info.value.arg, info.value.why) == ("x", "other_handles")
        assert torch.equal(kept.view_as(x), before)
        del kept
        ptr = x.data_ptr()
        y = cpp.forward_owned(x, c, donate=True)
    assert y.data_ptr() == ptr and rel_err(y, expected) <= TOL
    assert isinstance(x, DonatedTensor)


@pytest.mark.parametrize(
    "route", [r for r in aliases.PY_ROUTES if r.name in ("detach kept", "numpy memory")], ids=lambda r: r.name
)
def test_cpp_donation_refuses_aliases_like_rust(route):
    block = make_block(16, 2, 8, context_dim=12)
    x, others, c = route.make(torch.randn(2, 5, 16), torch.randn(2, 3, 12))
    with torch.no_grad(), pytest.raises(OwnershipError) as info:
        CppBlock.from_torch(block).forward_owned(x, c, donate=True)
    assert (info.value.arg, info.value.why) == (route.refused_arg, route.why)


def test_cpp_errors_are_exceptions_not_crashes():
    block = make_block()
    cpp = CppBlock.from_torch(block)
    with pytest.raises(ValueError, match="^x "):
        cpp(torch.randn(2, 4, 81), torch.randn(2, 77, 192))
    with pytest.raises(ValueError, match="language"):
        _rust.Block(
            dict(block.named_parameters()), _rust.Config(dim=80, n_heads=8, d_head=10, context_dim=192, language="go")
        )


def test_every_cpp_gallery_case_compiles_and_its_bug_happens():
    """One C++ case per tests/ui case: rustc refuses each, g++ compiles each (cpp/gallery.cpp is
    part of the build) and the bug happens at run time. The clone guard is the C++ twin of a fix."""
    cases = {name: (happened, what) for name, happened, what in _rust.cpp_gallery()}
    for case in read_cases():
        happened, what = cases.pop(case.name)
        assert happened, f"{case.name}: {what}"
    assert cases == {"clone_guard": (False, cases["clone_guard"][1])}
