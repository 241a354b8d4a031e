"""Attention masks: ``attention_mask`` and ``encoder_attention_mask`` with diffusers'
semantics in the PyTorch block, the Rust block and the C++ twin, and in the drop-in.

The masks are generated (hypothesis): boolean or an additive float bias (random, all zeros, the
UNet's ``(1 - mask) * -10000.0`` of 0/1 masks with all-ones and all-zeros rows), of shape
``(batch, keys)``, ``(batch, 1, keys)`` or ``(batch, queries, keys)``, batch 1 to 3. The twins
call the same ATen ops in the same order, so their outputs are asserted equal bit for bit (a
boolean row that masks every key gives NaN in all of them, in the same places); where diffusers'
ops differ (AttnProcessor, SlicedAttnProcessor: baddbmm) the bar is the project's 1e-5.
"""

import copy
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples, randomize_, rel_err
from plusequals import BasicTransformerBlock, CppBlock, RustBlock, UnsupportedBlockError
from plusequals.twin.swap import RustTransformerBlock

DIM, HEADS, D_HEAD, CTX = 32, 4, 8, 24
TOL = 1e-5
SLOW = settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs in the same places (a fully masked boolean row)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def make_mask(g: torch.Generator, kind: str, shape: tuple) -> torch.Tensor:
    keep = torch.rand(shape, generator=g) > 0.4
    if kind == "bool":
        return keep
    if kind == "bool_all_false_row":
        keep[0, ..., :] = False
        return keep
    if kind == "random_bias":
        return torch.randn(shape, generator=g)
    ones = keep.float()
    if kind == "unet_all_ones_row":
        ones[0] = 1.0
    if kind == "unet_all_zeros_row":
        ones[-1] = 0.0
    return (1 - ones) * -10000.0  # what UNet2DConditionModel.forward makes of a 0/1 mask


KINDS = ["bool", "bool_all_false_row", "random_bias", "unet", "unet_all_ones_row", "unet_all_zeros_row"]


@st.composite
def masked_call(draw):
    batch, tokens, ctx_tokens = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    layouts = {"2d": lambda q, k: (batch, k), "1qk": lambda q, k: (batch, 1, k), "qk": lambda q, k: (batch, q, k)}
    g = torch.Generator().manual_seed(seed)
    masks = []
    for keys in (tokens, ctx_tokens):
        if draw(st.booleans()):
            shape = layouts[draw(st.sampled_from(sorted(layouts)))](tokens, keys)
            masks.append(make_mask(g, draw(st.sampled_from(KINDS)), shape))
        else:
            masks.append(None)
    x = torch.randn(batch, tokens, DIM, generator=g)
    c = torch.randn(batch, ctx_tokens, CTX, generator=g)
    return x, c, masks[0], masks[1]


def compvis_block(attention: str, seed: int = 0) -> BasicTransformerBlock:
    with torch.random.fork_rng():  # nn.Linear's initialisation draws from the global generator: left as it was
        block = BasicTransformerBlock(DIM, HEADS, D_HEAD, context_dim=CTX, attention=attention)
    return randomize_(block, seed).eval()


BLOCKS = {a: compvis_block(a) for a in ("sdpa", "einsum")}
TWINS = {
    (a, cls.LANGUAGE): cls.from_torch(copy.deepcopy(b)) for a, b in BLOCKS.items() for cls in (RustBlock, CppBlock)
}


@SLOW
@given(masked_call(), st.sampled_from(["sdpa", "einsum"]), st.sampled_from(["rust", "cpp"]))
def test_twins_agree_with_the_pytorch_block_on_masks(call, attention, language):
    x, c, m1, m2 = call
    kept = [t.clone() for t in (x, c, m1, m2) if t is not None]
    with torch.no_grad():
        expected = BLOCKS[attention](x, c, attention_mask=m1, encoder_attention_mask=m2)
        twin = TWINS[(attention, language)]
        got = twin(x, c, attention_mask=m1, encoder_attention_mask=m2)
        owned = twin.forward_owned(x, c, attention_mask=m1, encoder_attention_mask=m2)
    assert same(got, expected) and same(owned, expected)
    assert all(torch.equal(a, b) for a, b in zip(kept, [t for t in (x, c, m1, m2) if t is not None]))


def test_masks_change_the_result():
    """Guards the parity tests against vacuity: a mask that hides keys changes every twin's output,
    and an all-ones (zero-bias) mask changes nothing beyond rounding."""
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(2, 5, DIM, generator=g), torch.randn(2, 4, CTX, generator=g)
    hide = torch.tensor([[True, True, False, False], [True, False, True, True]])
    for (attention, _), twin in TWINS.items():
        with torch.no_grad():
            plain = twin(x, c)
            masked = twin(x, c, encoder_attention_mask=hide)
            zero = twin(x, c, encoder_attention_mask=torch.zeros(2, 1, 4))
        assert rel_err(masked, plain) > 1e-2, attention
        assert rel_err(zero, plain) <= TOL, attention


def test_masked_gradients_match_the_pytorch_block():
    g = torch.Generator().manual_seed(4)
    x, c = torch.randn(2, 5, DIM, generator=g), torch.randn(2, 4, CTX, generator=g)
    m1 = (1 - (torch.rand(2, 5, generator=g) > 0.3).float()).unsqueeze(1) * -10000.0
    m2 = torch.rand(2, 5, 4, generator=g) > 0.3
    m2[..., 0] = True
    for attention, block in BLOCKS.items():
        rust = RustBlock.from_torch(copy.deepcopy(block))
        grads = []
        for module in (block, rust):
            xl, cl = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
            module.zero_grad(set_to_none=True)
            (module(xl, cl, attention_mask=m1, encoder_attention_mask=m2) ** 2).sum().backward()
            grads.append([xl.grad, cl.grad] + [p.grad for p in module.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), attention
        block.zero_grad(set_to_none=True)


BAD = [
    ("attention_mask", torch.zeros(2, 4), "attention_mask expected shape (2, 5) or (2, 1 or 5, 5)"),
    ("attention_mask", torch.zeros(1, 1, 5), "expected shape"),  # another batch
    ("encoder_attention_mask", torch.zeros(2, 3, 4), "expected shape (2, 4) or (2, 1 or 5, 4)"),
    ("encoder_attention_mask", torch.zeros(2, 1, 1, 4), "expected shape"),
    ("encoder_attention_mask", torch.zeros(2, 4, dtype=torch.int64), "neither bool nor floating point"),
    ("attention_mask", torch.zeros(2, 5).to_sparse(), "has no dense shape"),
]


@pytest.mark.parametrize("language", ["rust", "cpp"])
@pytest.mark.parametrize("arg, mask, match", BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD)])
def test_bad_masks_are_refused_and_change_nothing(language, arg, mask, match):
    twin = TWINS[("sdpa", language)]
    g = torch.Generator().manual_seed(5)
    x, c = torch.randn(2, 5, DIM, generator=g), torch.randn(2, 4, CTX, generator=g)
    kept, version = x.clone(), x._version
    for call in (
        lambda: twin(x, c, **{arg: mask}),
        lambda: twin.forward_owned(x, c, **{arg: mask}),
        lambda: twin.forward_owned(x, c, donate=True, **{arg: mask}),
    ):
        with torch.no_grad(), pytest.raises((ValueError, plusequals_ownership_error()), match=re.escape(match)):
            call()
        assert type(x) is torch.Tensor and torch.equal(x, kept) and x._version == version


def plusequals_ownership_error():
    from plusequals import OwnershipError

    return OwnershipError  # a refused donation says why, with the block's own message


def test_masks_are_refused_where_the_custom_ops_would_run():
    from torch._subclasses.fake_tensor import FakeTensorMode

    twin = TWINS[("sdpa", "rust")]
    with FakeTensorMode():
        x, c, m = torch.empty(2, 5, DIM), torch.empty(2, 4, CTX), torch.zeros(2, 1, 4)
        with pytest.raises(UnsupportedBlockError, match="encoder_attention_mask cannot be traced"):
            twin(x, c, encoder_attention_mask=m)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor, got list"):
        twin(torch.zeros(2, 5, DIM), torch.zeros(2, 4, CTX), attention_mask=[[1.0]])


# --------------------------------------------------------------------------------------------
# The drop-in: diffusers' block and UNet
# --------------------------------------------------------------------------------------------


class Holder(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block


def diffusers_block(diffusers, processor: str, seed: int = 0):
    with torch.random.fork_rng():
        block = diffusers.models.attention.BasicTransformerBlock(DIM, HEADS, D_HEAD, cross_attention_dim=CTX)
    randomize_(block.eval(), seed)
    processors = diffusers.models.attention_processor
    for attn in (block.attn1, block.attn2):
        p = getattr(processors, processor)
        attn.set_processor(p(2) if processor == "SlicedAttnProcessor" else p())
    return block


@SLOW
@given(masked_call(), st.sampled_from(["AttnProcessor2_0", "AttnProcessor", "SlicedAttnProcessor"]))
def test_drop_in_matches_diffusers_block_on_masks(diffusers, call, processor):
    x, c, m1, m2 = call
    if processor != "AttnProcessor2_0":  # baddbmm takes a 3-d float bias only: the others are refused (below)
        m1, m2 = (None if m is None or m.dtype == torch.bool or m.dim() == 2 else m for m in (m1, m2))
    block = diffusers_block(diffusers, processor)
    kwargs = dict(attention_mask=m1, encoder_hidden_states=c, encoder_attention_mask=m2)
    with torch.no_grad():
        expected = block(x, **kwargs)
        got = RustTransformerBlock(block)(x, **kwargs)
    if processor == "AttnProcessor2_0":
        assert same(got, expected)
    else:  # other ops (baddbmm, softmax): the project's bar
        assert not got.isnan().any() and rel_err(got, expected) <= TOL


@pytest.mark.parametrize("processor", ["AttnProcessor", "SlicedAttnProcessor"])
def test_drop_in_refuses_masks_that_other_processors_read_otherwise(diffusers, processor):
    """AttnProcessor's baddbmm raises on a boolean mask, and reads a (batch, keys) one as (queries,
    keys) (here 5 queries, 5 keys and batch * heads 8: it raises). The drop-in refuses both, naming why."""
    block = diffusers_block(diffusers, processor)
    g = torch.Generator().manual_seed(8)
    x, c = torch.randn(2, 5, DIM, generator=g), torch.randn(2, 4, CTX, generator=g)
    for mask, what in ((torch.ones(2, 1, 5, dtype=torch.bool), "a boolean mask"), (torch.zeros(2, 5), "2-d")):
        with pytest.raises(RuntimeError):
            block(x, attention_mask=mask, encoder_hidden_states=c)
        with pytest.raises(UnsupportedBlockError, match=f"attention_mask is {what}.*attn1's {processor} cannot"):
            RustTransformerBlock(block)(x, attention_mask=mask, encoder_hidden_states=c)


@pytest.mark.parametrize("kind", ["01", "bool", "all_ones", "all_zeros_row"])
def test_swapped_unet_runs_encoder_attention_mask_forward_and_backward(tiny_unet, kind):
    """The UNet turns the (batch, 77) mask into a bias before its blocks see it; the swapped UNet's
    output, and the gradients to the encoder states and the blocks' weights, equal the library's."""
    from plusequals import swap_transformer_blocks

    g = torch.Generator().manual_seed(6)
    sample, t, context = (
        torch.randn(2, 4, 16, 16, generator=g),
        torch.tensor([10, 700]),
        torch.randn(2, 77, 32, generator=g),
    )
    keep = torch.rand(2, 77, generator=g) > 0.5
    mask = {"01": keep.float(), "bool": keep, "all_ones": torch.ones(2, 77), "all_zeros_row": keep.float()}[kind]
    if kind == "all_zeros_row":
        mask[1] = 0.0

    def step(unet):
        unet.zero_grad(set_to_none=True)
        ctx = context.clone().requires_grad_(True)
        out = unet(sample, t, ctx, encoder_attention_mask=mask).sample
        (out**2).sum().backward()
        return [out, ctx.grad] + [p.grad for p in unet.parameters() if p.grad is not None]

    unet = tiny_unet()
    expected = step(unet)
    swap_transformer_blocks(unet)
    got = step(unet)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    if kind != "all_ones":
        assert rel_err(unet(sample, t, context).sample, expected[0]) > 1e-3  # the mask mattered
