"""The hot path: ``RustBlock.forward`` and ``forward_owned`` are one call into Rust
(``RustBlock._entry``, a ``plusequals._rust.Entry``), which takes the call exactly when no Python
code could see it and otherwise hands it back (``NotImplemented``) to the full path. The predicate
is checked against an oracle written from its definition on generated combinations of argument
classes, modes, grad mode and saved-tensor hooks; the two paths give the same bits; and the entry
always holds the block's current Rust block and last reading's watch."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import examples, make_block, make_inputs
from plusequals import CppBlock, RustBlock


class Sub(torch.Tensor):
    pass


class PassFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class PassDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _tensor(kind, seed):
    t = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(seed))
    return {"tensor": t, "parameter": nn.Parameter(t, requires_grad=False), "subclass": t.as_subclass(Sub)}.get(kind)


TINY = make_block(dim=32, heads=4, d_head=8, context_dim=32)


@settings(max_examples=examples(120), deadline=None)
@given(
    x_kind=st.sampled_from(["tensor", "parameter", "subclass"]),
    c_kind=st.sampled_from(["none", "tensor", "parameter", "subclass"]),
    function_mode=st.booleans(),
    device_mode=st.booleans(),
    dispatch_mode=st.booleans(),
    grad=st.booleans(),
    saved_hooks=st.booleans(),
    owned=st.booleans(),
)
def test_the_hot_path_takes_the_call_exactly_when_no_python_code_can_see_it(
    x_kind, c_kind, function_mode, device_mode, dispatch_mode, grad, saved_hooks, owned
):
    rb = RustBlock.from_torch(TINY)
    x, c = _tensor(x_kind, 1), _tensor(c_kind, 2)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))  # restored on exit
        if saved_hooks:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        if function_mode:
            stack.enter_context(PassFunctions())
        if device_mode:
            stack.enter_context(torch.device("cpu"))
        if dispatch_mode:
            stack.enter_context(PassDispatch())
        y = rb._entry.forward_owned(x, c) if owned else rb._entry.forward(x, c)
    plain = (torch.Tensor, nn.Parameter)
    taken = (
        type(x) in plain
        and (c is None or type(c) in plain)
        and not (function_mode or device_mode or dispatch_mode)
        and not (grad and saved_hooks)
        and not (owned and grad)  # forward_owned under grad mode: the full path refuses what requires grad
    )
    if not taken:
        assert y is NotImplemented
    else:
        assert isinstance(y, torch.Tensor) and torch.equal(y, TINY(x.detach(), None if c is None else c.detach()))


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_the_hot_path_and_the_full_path_give_the_same_bits(cls):
    """A TorchFunctionMode that passes every call through sends the same call down the full path
    (the custom op), which runs the same twin: the outputs are bitwise equal, out of place and in place."""
    block = make_block()
    rb = cls.from_torch(block)
    x, c = make_inputs()
    with torch.no_grad():
        hot, hot_owned = rb.forward(x, c), rb.forward_owned(x, c)
        with PassFunctions():
            full, full_owned = rb.forward(x, c), rb.forward_owned(x, c)
    assert torch.equal(hot, full) and torch.equal(hot_owned, full_owned)


def test_the_hot_path_follows_the_module_and_refuses_what_the_full_path_refuses():
    """After a change the watch sees (a weight replaced, a forward hook added), the hot path's
    next call reads the block again: the new weight is used, the hook is refused."""
    block = make_block()
    rb = RustBlock.from_torch(block)
    x, c = make_inputs()
    with torch.no_grad():
        before = rb.forward(x, c)
        block.attn1.to_q.weight = nn.Parameter(block.attn1.to_q.weight * 2)
        after = rb.forward(x, c)
        assert not torch.equal(before, after) and torch.equal(after, block(x, c))
        block.ff.register_forward_hook(lambda *a: None)
        with pytest.raises(Exception, match="hook"):
            rb.forward(x, c)
        x2 = x.clone()
        with pytest.raises(Exception, match="hook"):
            rb.forward_owned(x2, c, donate=True)
        assert torch.equal(x2, x) and type(x2) is torch.Tensor  # refused: x2 untouched and usable


def test_the_entry_always_holds_the_current_block_and_the_last_readings_watch():
    """After each change that makes the RustBlock read the module again or rebuild (a weight
    replaced, a cast, a refusal and its undoing), the entry it calls is the current Rust block with
    the last reading's watch, or None while the block is refused."""
    block = make_block()
    rb = RustBlock.from_torch(block)
    x, c = make_inputs()

    def current():
        if rb._reading is None:
            return rb._entry is None
        return rb._entry.block is rb._twin.inner and rb._entry.watch is rb._reading.watch.rust

    with torch.no_grad():
        assert current()
        block.norm1.weight = nn.Parameter(block.norm1.weight + 1)
        rb.forward(x, c)
        assert current()
        block.double()
        rb.forward(x.double(), c.double())
        assert current()
        handle = block.attn2.register_forward_pre_hook(lambda *a: None)
        with pytest.raises(Exception, match="hook"):
            rb.forward(x.double(), c.double())
        assert rb._entry is None and current()
        handle.remove()
        assert torch.equal(rb.forward(x.double(), c.double()), block(x.double(), c.double()))
        assert current()
