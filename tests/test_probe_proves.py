"""A change is followed only where the probe proves it equal (twin/probe.py): the attacks a single
fixed probe input misses. Each patch agrees with the original block on the seeded input the probe
used to run alone (checked first: the old probe would have followed it), and differs elsewhere: on
batch 1, on another token count, at another scale, on a value no probe input reaches (a branch
that reads a tensor's value into Python), in another dtype. Each is followed with the PyTorch
block's output or refused with the inputs unchanged, on ``RustBlock`` and ``CppBlock``; undone, it
works again.
"""

from __future__ import annotations

import contextvars
import time
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples, make_block, rel_err
from plusequals import CppBlock, RustBlock, UnsupportedBlockError
from plusequals.twin import probe as probe_module
from plusequals.twin.probe import SEEDED, _tensors, inputs, trace, value_reads

SCALE = 1.5
TOL = 1e-5


def _block_and_inputs(cls=RustBlock, batch: int = 2, tokens: int = 4):
    block = make_block(32, 4, 8, context_dim=24)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, tokens, 32, generator=g)
    c = torch.randn(batch, 7, 24, generator=g)
    return block, cls.from_torch(block), x, c


def _equal_on_the_seeded_input(block: nn.Module, change: Callable[[], None], undo: Callable[[], None]) -> None:
    """The change leaves the block's output on the seeded probe input bitwise as it was: one fixed
    probe would have followed it."""
    x, c, _ = _tensors(probe_module.BlockConfig(32, 4, 8, 24, True, "sdpa"), block.norm1.weight, SEEDED)
    with torch.no_grad():
        before = block(x, c)
        change()
        try:
            after = block(x, c)
        finally:
            undo()
    assert torch.equal(before, after), "the attack must agree on the seeded probe input"


def _followed_or_refused(block, rust, x, c, change, undo) -> str:
    """The change is followed (the PyTorch block's output) or refused (the inputs unchanged);
    undone, the twin works again. Returns which."""
    with torch.no_grad():
        assert torch.equal(rust(x, c), block(x, c))
        change()
        try:
            expected = block(x, c)
            assert rel_err(expected, rust._source(x, c)) == 0
            before = (x.clone(), c.clone())
            try:
                got = rust(x, c)
            except UnsupportedBlockError:
                assert torch.equal(x, before[0]) and torch.equal(c, before[1]), "a refusal changed the inputs"
                verdict = "refused"
            else:
                assert rel_err(got, expected) <= TOL, f"stale by {rel_err(got, expected):.3g}"
                verdict = "followed"
        finally:
            undo()
        assert torch.equal(rust(x, c), block(x, c)), "undone, it must work again"
    return verdict


def _gelu_unless(condition: Callable[[torch.Tensor], bool]):
    original = F.gelu

    def gelu(input, approximate="none"):
        out = original(input, approximate=approximate)
        return out * SCALE if condition(input) else out

    return (lambda: setattr(F, "gelu", gelu)), (lambda: setattr(F, "gelu", original))


def _layer_norm_unless(condition: Callable[[torch.Tensor], bool]):
    """``nn.LayerNorm.forward`` scaled where ``condition`` holds on its input (x itself in norm1:
    the probe's scale reaches it, not normalised yet)."""
    original = nn.LayerNorm.forward

    def forward(self, input):
        out = original(self, input)
        return out * SCALE if condition(input) else out

    return (lambda: setattr(nn.LayerNorm, "forward", forward)), (lambda: setattr(nn.LayerNorm, "forward", original))


ATTACKS = {
    # a shape: the seeded input is batch 2 of 5 tokens
    "another token count (the call's 4)": lambda: _gelu_unless(lambda t: t.shape[-2] != 5),
    "batch 1 only": lambda: _gelu_unless(lambda t: t.shape[0] == 1),
    "a batch above 3 only (the call's 4)": lambda: _gelu_unless(lambda t: t.shape[0] > 3),
    # a value: a branch on x.abs().max(), in Python (a value read) or in a tensor op (100x scale)
    "x.abs().max() > 1e4, read into Python": lambda: _layer_norm_unless(lambda t: bool(t.abs().max() > 1e4)),
    "x.abs().max() > 1e4, read with .item()": lambda: _layer_norm_unless(lambda t: t.abs().max().item() > 1e4),
    "torch.equal against the input itself": lambda: _layer_norm_unless(lambda t: not torch.equal(t, t)),
}


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_change_equal_on_the_seeded_input_only_is_followed_or_refused(cls, name):
    block, rust, x, c = _block_and_inputs(cls, batch=4 if "above 3" in name else 2)
    change, undo = ATTACKS[name]()
    _equal_on_the_seeded_input(block, change, undo)
    _followed_or_refused(block, rust, x, c, change, undo)


def test_a_branch_on_a_value_in_a_tensor_op_is_caught_by_the_scaled_inputs():
    """``torch.where(x.abs().amax() > 50, ...)`` in ``nn.LayerNorm.forward``: no value read, equal
    on the seeded input and on the call's; the probe's input at 100x scale takes it: refused."""
    original = nn.LayerNorm.forward

    def change():
        nn.LayerNorm.forward = lambda self, input: torch.where(
            input.abs().amax() > 50, original(self, input) * SCALE, original(self, input)
        )

    def undo():
        nn.LayerNorm.forward = original

    block, rust, x, c = _block_and_inputs()
    _equal_on_the_seeded_input(block, change, undo)
    assert _followed_or_refused(block, rust, x, c, change, undo) == "refused"


def _refused(rust, x, c) -> bool:
    try:
        rust(x, c)
    except UnsupportedBlockError:
        return True
    return False


def test_a_value_read_is_refused_by_name():
    block, rust, x, c = _block_and_inputs()
    change, undo = ATTACKS["x.abs().max() > 1e4, read into Python"]()
    change()
    try:
        with torch.no_grad(), pytest.raises(UnsupportedBlockError, match="_local_scalar_dense"):
            rust(x, c)
    finally:
        undo()
    with torch.no_grad():
        assert torch.equal(rust(x, c), block(x, c))


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_a_change_that_differs_only_in_another_dtype_is_probed_in_that_dtype(cls):
    """``F.gelu`` that scales only in fp64: followed in fp32 (equal there), and probed again when
    the block is converted: refused in fp64 (or its output), never stale; undone, it works again."""
    block, rust, x, c = _block_and_inputs(cls)
    change, undo = _gelu_unless(lambda t: t.dtype == torch.float64)
    with torch.no_grad():
        change()
        try:
            assert torch.equal(rust(x, c), block(x, c))  # fp32: the same maths, followed
            block.double()
            xd, cd = x.double(), c.double()
            expected = block(xd, cd)
            try:
                got = rust(xd, cd)
            except UnsupportedBlockError as e:
                assert "float64" in str(e)
            else:
                assert rel_err(got, expected) <= TOL, "stale in fp64"
        finally:
            undo()
        assert torch.equal(rust(xd, cd), block(xd, cd)), "undone, it must work again"


@settings(max_examples=examples(12), deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["tokens", "batch", "python value", "item value"]),
    threshold=st.integers(1, 9),
)
def test_generated_branches_the_seeded_input_does_not_take(kind, threshold):
    """Generated attacks: a branch on a token count or a batch the seeded input does not have (the
    call's or the probe's), or on a value (x.abs().max() above ``threshold`` times 1e3, read into
    Python), each followed or refused, never stale."""
    conditions = {
        "tokens": lambda t: t.shape[-2] != 5,
        "batch": lambda t: t.shape[0] != 2,
        "python value": lambda t: bool(t.abs().max() > threshold * 1e3),
        "item value": lambda t: t.abs().max().item() > threshold * 1e3,
    }
    batch, tokens = (1 + threshold % 4, 1 + threshold) if kind in ("tokens", "batch") else (2, 5)
    block, rust, x, c = _block_and_inputs(batch=batch, tokens=tokens)
    maker = _gelu_unless if kind in ("tokens", "batch") else _layer_norm_unless
    change, undo = maker(conditions[kind])
    _followed_or_refused(block, rust, x, c, change, undo)


FACTOR = 1.0  # read only by a helper that inputs of other than 5 tokens reach


def _helper():
    return FACTOR


def test_code_only_another_probe_input_runs_is_recorded_and_watched():
    """A wrapper set as ``F.gelu`` calls a helper only on inputs of other than 5 tokens (not the
    seeded one): every probe input's run is recorded, so the global the helper reads is watched,
    and setting it is followed or refused, never stale."""
    original = F.gelu

    def gelu(input, approximate="none"):
        out = original(input, approximate=approximate)
        return out if input.shape[-2] == 5 else out * _helper()

    def set_factor(value):
        global FACTOR
        FACTOR = value

    F.gelu = gelu
    try:
        block, rust, x, c = _block_and_inputs()
        _followed_or_refused(block, rust, x, c, lambda: set_factor(SCALE), lambda: set_factor(1.0))
    finally:
        F.gelu = original


def test_the_probe_inputs_are_fresh_and_include_the_calls_shapes():
    spec = probe_module.BlockConfig(32, 4, 8, 24, True, "sdpa")
    a, b = inputs(spec), inputs(spec)
    assert a[0] == b[0] == SEEDED and a[1:] != b[1:], "seeded first, then fresh seeds"
    assert {i.batch for i in a} >= {1, 2, 3} and {i.scale for i in a} == {0.01, 1.0, 100.0}
    with probe_module.for_call(torch.empty(6, 11, 32), torch.empty(6, 13, 24)):
        assert inputs(spec)[-1][:3] == (6, 11, 13)
    with probe_module.for_call(torch.empty(64, 4096, 32)):  # past CALL_LIMIT: not run
        assert len(inputs(spec)) == 4


def test_the_compvis_block_runs_the_rust_blocks_aten_ops_and_reads_no_value():
    """On this crate's CompVis block, the PyTorch block's ATen ops on the seeded input are the
    Rust block's, op for op (names, overloads, non-tensor arguments): the first check records
    that, and no value read."""
    block, rust, x, c = _block_and_inputs()
    assert rust._follow.ran is not None and rust._follow.ran.ops is not None
    xs, cs, _ = _tensors(rust._config, block.norm1.weight, SEEDED)
    with torch.no_grad():
        _, ops = trace(block, xs, cs)
        _, twin = trace(rust._twin.inner.forward, xs, cs)
    assert ops == twin == list(rust._follow.ran.ops.ops)
    assert value_reads(ops) == []
    assert value_reads([("aten._local_scalar_dense.default", ()), ("aten.equal.default", ())]) == [
        "aten._local_scalar_dense.default",
        "aten.equal.default",
    ]


def test_the_recheck_cost_is_a_few_forwards_and_the_hot_path_is_unchanged():
    """A change costs the probe's runs (5 inputs, the op traces, the recorder), a few milliseconds
    for the test block; an unchanged call takes the hot path (no probe)."""
    block, rust, x, c = _block_and_inputs()
    calls = []
    original = probe_module._probe
    probe_module._probe = lambda *a: calls.append(1) or original(*a)
    try:
        with torch.no_grad():
            for _ in range(50):
                rust(x, c)
            assert calls == [] and rust._entry is not None
            old = nn.LayerNorm.forward.__code__
            start = time.perf_counter()
            nn.LayerNorm.forward.__code__ = old.replace()
            try:
                rust(x, c)
            finally:
                nn.LayerNorm.forward.__code__ = old
            assert calls == [1]
            assert time.perf_counter() - start < 5.0
    finally:
        probe_module._probe = original


def test_a_swapped_unet_probes_the_calls_shapes_too(tiny_unet):
    """The swap's blocks note the call's shapes for the probe, as ``RustBlock``'s do: ``F.gelu``
    changed for a batch above 3 only is equal on every default probe input, and differs on the
    call's batch of 4; the swapped UNet refuses it (never stale), the inputs unchanged, and
    undone it gives the library's output again. Run in an empty context, where no earlier call's
    shapes are noted."""
    from plusequals import swap_transformer_blocks
    from support.unet import unet_inputs

    unet, reference = tiny_unet(), tiny_unet()
    swap_transformer_blocks(unet)
    sample, _, context = unet_inputs(batch=4)
    t = torch.tensor(10)
    change, undo = _gelu_unless(lambda x: x.shape[0] > 3)
    spec = probe_module.BlockConfig(32, 4, 8, 32, True, "sdpa")
    assert all(at.batch <= 3 for at in inputs(spec)), "no default probe input has the call's batch"

    def scenario() -> str:
        with torch.no_grad():
            assert rel_err(unet(sample, t, context).sample, reference(sample, t, context).sample) <= TOL
            change()
            try:
                expected = reference(sample, t, context).sample
                before = (sample.clone(), context.clone())
                with pytest.raises(UnsupportedBlockError, match="batch 4") as refusal:
                    unet(sample, t, context)
                assert torch.equal(sample, before[0]) and torch.equal(context, before[1])
            finally:
                undo()
            assert rel_err(expected, unet(sample, t, context).sample) > TOL, "the change must show at batch 4"
            assert rel_err(unet(sample, t, context).sample, reference(sample, t, context).sample) <= TOL
        return str(refusal.value)

    why = contextvars.Context().run(scenario)
    assert "torch.nn.functional.gelu" in why, why
