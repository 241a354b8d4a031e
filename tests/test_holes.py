"""Holes in the checks, each closed: Python code run between a donation's ownership
check and its move, a dual tensor's tangent dropped by a donation, ``torch.__future__``'s
parameter swapping on conversion, and ``torch.func`` transforms over ``functional_call``."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call

from conftest import CONTEXT, make_block, make_inputs, rel_err
from plusequals import CppBlock, OwnershipError, RustBlock, UnsupportedBlockError

# jvp and vmap register decompositions with torch.jit.script (deprecated) inside torch
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

TOL = 1e-5
CLASSES = {"RustBlock": RustBlock, "CppBlock": CppBlock}


@pytest.fixture(params=list(CLASSES))
def made(request):
    block = make_block(32, 4, 8, context_dim=CONTEXT[1])
    return block, CLASSES[request.param].from_torch(block)


def _inputs():
    return make_inputs(4, dim=32)


def test_a_weakref_made_while_the_donated_class_is_made_is_counted(made):
    """The donated class of a subclass is made by ``type()``, which runs the subclass's
    ``__init_subclass__``: a weakref to x's storage made there must be counted by the ownership
    check (it ran after the check), and x left as it was."""
    _, rust = made
    x, c = _inputs()
    kept = []

    class Sneaky(torch.Tensor):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            kept.append(weakref.ref(sneaky.untyped_storage()))

    sneaky = torch.Tensor._make_subclass(Sneaky, x.clone())  # its own storage (as_subclass makes a view)
    before = sneaky.as_subclass(torch.Tensor).clone()
    with torch.no_grad(), pytest.raises(OwnershipError) as info:
        rust.forward_owned(sneaky, c, donate=True)
    assert info.value.why == "weak_refs" and kept and kept[0]() is not None
    assert type(sneaky) is Sneaky and torch.equal(sneaky.as_subclass(torch.Tensor), before)


def test_a_dual_tensor_is_refused_for_donation_with_its_tangent_kept(made):
    """``forward_owned(dual, donate=True)`` would move the buffer to a handle without the
    tangent: refused, naming it, with x and its tangent as they were; ``donate=False`` and
    ``forward`` keep the tangent (the PyTorch block's)."""
    _, rust = made
    block = make_block(32, 4, 8, context_dim=CONTEXT[1], attention="einsum")  # CPU SDPA has no forward AD
    rust = type(rust).from_torch(block)
    x, c = _inputs()
    tangent = torch.ones_like(x)
    with torch.no_grad(), fwAD.dual_level():
        dual = fwAD.make_dual(x.clone(), tangent)
        with pytest.raises(OwnershipError, match="dual tensor") as info:
            rust.forward_owned(dual, c, donate=True)
        assert info.value.why == "tangent"
        primal, kept = fwAD.unpack_dual(dual)
        assert torch.equal(primal, x) and torch.equal(kept, tangent)
        expected = fwAD.unpack_dual(block(dual, c)).tangent
        for got in (rust.forward_owned(dual, c, donate=False), rust(dual, c)):
            assert rel_err(fwAD.unpack_dual(got).tangent, expected) <= TOL
    y = rust.forward_owned(x.clone(), c, donate=True)  # outside a dual level: donations as before
    assert rel_err(y, block(x, c)) <= TOL


def test_swap_module_params_on_conversion_works(made, swapping):
    """With parameters swapped on conversion (``torch.utils.swap_tensors``, which needs the
    parameter's only handle to be Python's), ``.double()`` and ``load_state_dict`` work on the
    wrapped block and it follows them."""
    block, rust = made
    x, c = _inputs()
    assert rel_err(rust(x, c), block(x, c)) <= TOL
    rust.double()
    xd, cd = x.double(), c.double()
    assert rust(xd, cd).dtype == torch.float64 and rel_err(rust(xd, cd), block(xd, cd)) <= TOL
    state = {k: v * 0.5 for k, v in make_block(32, 4, 8, context_dim=CONTEXT[1], seed=3).double().state_dict().items()}
    rust.load_state_dict(state)
    assert rel_err(rust(xd, cd), block(xd, cd)) <= TOL
    assert torch.equal(block.norm1.weight, state["norm1.weight"])


def test_torch_func_over_functional_call_works_or_names_functorch(made):
    """``torch.func.grad`` and ``vmap`` over ``functional_call`` hand the block functorch-wrapped
    parameters, which have no storage: the gradient is the PyTorch block's, or the call is
    refused naming functorch (never libtorch's "Cannot access data pointer")."""
    block, rust = made
    x, c = _inputs()
    params = {k: v.detach() for k, v in rust.named_parameters()}

    def loss(module):
        return lambda p: functional_call(module, p, (x, c)).sum()

    expected = torch.func.grad(loss(block))({k: v.detach() for k, v in block.named_parameters()})
    try:
        got = torch.func.grad(loss(rust))(params)
    except UnsupportedBlockError as e:
        assert "functorch" in str(e), str(e)
    else:
        for key, g in got.items():
            assert rel_err(g, expected[key.replace("ff.net.0.0.", "ff.net.0.proj.")]) <= 1e-4, key
    stacked = {k: torch.stack([v, v * 0.5]) for k, v in params.items()}
    try:
        torch.func.vmap(lambda p: functional_call(rust, p, (x, c)))(stacked)
    except UnsupportedBlockError as e:
        assert "functorch" in str(e), str(e)
    except RuntimeError as e:
        pytest.fail(f"not refused naming functorch: {e}")
    assert rel_err(rust(x, c), block(x, c)) <= TOL  # outside the transforms, as before
