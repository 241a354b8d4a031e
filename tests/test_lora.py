"""PEFT LoRA through the Rust block, on peft's and diffusers' own classes.

The Rust block computes ``base(x) + lora_B(lora_A(x)) * scaling`` per active adapter on PEFT's
tensors, the ops PEFT's ``lora.Linear.forward`` calls in the same order: outputs and gradients are
asserted equal bit for bit against the library's block *on the same modules* (the reference is the
PEFT-carrying block itself, called after the Rust block read it). The adapters' state is then
changed the ways PEFT and diffusers change it (set_adapter, enable/disable, merge/unmerge, scales,
train/eval with dropout), in generated sequences: every call after a change either equals the
library's output in that state or is refused naming the cause; the oracle of which is PEFT's
public state, not the reader's.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import randomize_, rel_err
from plusequals import BasicTransformerBlock, CppBlock, RustBlock, UnsupportedBlockError
from plusequals.twin.swap import RustTransformerBlock

peft = pytest.importorskip("peft", reason="needs the optional extra plusequals[diffusers]")
pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")

from support.lora import (  # noqa: E402
    CTX,
    D_HEAD,
    DIM,
    HEADS,
    OPS,
    SLOW,
    UnetPair,
    adapter_configs,
    add_adapter,
    call,
    followed_or_refused,
    inputs,
    layers,
    lora_block,
    unet_adapter,
    unet_inputs,
)


@SLOW
@given(adapter_configs(), st.one_of(st.none(), adapter_configs()), st.booleans())
def test_lora_block_matches_the_library_bit_for_bit(first, second, both_active):
    block = lora_block(**first)
    if second is not None:
        add_adapter(block, "b", 7, **second)
        if both_active:
            for layer in layers(block):
                layer.set_adapter(["a", "b"] if "b" in layer.lora_A else ["a"])
    rust = RustTransformerBlock(block)
    assert rust._config.lora, "no LoRA term read"
    x, c = inputs()
    with torch.no_grad():
        got = call(rust, x, c)
        expected = call(block, x, c)  # PEFT's forward, on the same modules
        for layer in layers(block):
            layer.enable_adapters(False)
        plain = call(block, x, c)
    assert torch.equal(got, expected)
    assert rel_err(expected, plain) > 1e-3, "the adapters should change the output"


@SLOW
@given(st.lists(OPS, min_size=1, max_size=8))
def test_changes_after_the_read_are_followed_or_refused_never_stale(ops):
    block = lora_block(seed=3, lora_dropout=0.0)
    add_adapter(block, "b", 9, r=2, lora_alpha=3, lora_dropout=0.25, target_modules=["to_v", "proj"])
    block.eval()  # peft makes the new adapter's dropouts in training mode
    followed_or_refused(block, ops)


def test_lora_training_through_the_rust_block():
    """Gradients reach PEFT's LoRA weights through the Rust block, equal to the library's; three SGD
    steps through each leave the same adapter weights."""
    x, c = inputs(seed=5)
    target = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(6))
    runs = []
    for through_rust in (False, True):
        block = lora_block(seed=8, lora_dropout=0.0).train()
        module = RustTransformerBlock(block) if through_rust else block
        params = [p for p in block.parameters() if p.requires_grad]
        assert params and all("lora_" in n for n, p in block.named_parameters() if p.requires_grad)
        opt = torch.optim.SGD(params, lr=0.1)
        grads = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = ((call(module, x, c) - target) ** 2).mean()
            loss.backward()
            grads.append([p.grad.clone() for p in params])
            opt.step()
        runs.append((grads, [p.detach().clone() for p in params]))
    (g0, p0), (g1, p1) = runs
    assert all(torch.equal(a, b) for step0, step1 in zip(g0, g1) for a, b in zip(step0, step1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert any(g.abs().sum() > 0 for g in g1[0])


def test_dropout_is_the_identity_in_eval_and_refused_in_training():
    block = lora_block(seed=10, lora_dropout=0.1)
    rust = RustTransformerBlock(block)
    x, c = inputs()
    with torch.no_grad():
        assert torch.equal(call(rust, x, c), call(block, x, c))
        block.train()
        with pytest.raises(UnsupportedBlockError, match=r"lora_dropout.a has dropout p=0.1 in training mode"):
            call(rust, x, c)
        block.eval()
        assert torch.equal(call(rust, x, c), call(block, x, c))


def test_lora_variants_other_than_dora_are_refused_naming_them():
    """DoRA runs in the Rust block (tests/test_dora.py); another variant (MiCA here) is refused by its
    class, read or added after the read, and the block runs again once it is inactive."""
    variant = r"attn1.to_q adapter 'a' is peft.tuners.lora.variants.MiCALinearVariant, a LoRA variant"
    with pytest.raises(UnsupportedBlockError, match=variant):
        RustTransformerBlock(lora_block(seed=11, init_lora_weights="mica"))
    plain = lora_block(seed=12)
    rust = RustTransformerBlock(plain)
    add_adapter(plain, "mica", 13, init_lora_weights="mica", target_modules=["to_k"])  # after the read; active
    x, c = inputs()
    with torch.no_grad():
        with pytest.raises(UnsupportedBlockError, match="attn1.to_k adapter 'mica' is .*MiCALinearVariant"):
            call(rust, x, c)
        for layer in layers(plain):
            layer.set_adapter("a")
        assert torch.equal(call(rust, x, c), call(plain, x, c))  # 'mica' is there, inactive
        for layer in layers(plain):
            if "mica" in layer.lora_A:
                layer.set_adapter("mica")
        with pytest.raises(UnsupportedBlockError, match="adapter 'mica' is .*a LoRA variant"):
            call(rust, x, c)


def test_compvis_block_with_lora_and_the_cpp_twin():
    """The reading is shared: PEFT injected into plusequals' own block runs in RustBlock.from_torch;
    the C++ twin computes no LoRA terms, and says so."""
    with torch.random.fork_rng():
        block = randomize_(BasicTransformerBlock(DIM, HEADS, D_HEAD, context_dim=CTX), 14).eval()
    add_adapter(block, "a", 15, target_modules=["to_q", "to_v", "net.2"])
    x, c = inputs()
    with torch.no_grad():
        assert torch.equal(RustBlock.from_torch(block)(x, c), block(x, c))
    with pytest.raises(ValueError, match="the C\\+\\+ twin computes no LoRA terms"):
        CppBlock.from_torch(block)


def test_lora_is_refused_where_the_custom_ops_would_run():
    from torch._subclasses.fake_tensor import FakeTensorMode

    block = lora_block(seed=16)
    rust = RustTransformerBlock(block)
    for merged in (False, True):  # merged too: a traced graph would not see an unmerge
        if merged:
            for layer in layers(block):
                layer.merge()
        with FakeTensorMode():
            x, c = torch.empty(2, 5, DIM), torch.empty(2, 4, CTX)
            with pytest.raises(UnsupportedBlockError, match=r"a block with LoRA adapters \(attn1.to_q, "):
                call(rust, x, c)


# --------------------------------------------------------------------------------------------
# The UNet: diffusers' own adapter API on a swapped UNet
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter_after_swap", [False, True])
def test_swapped_unet_with_lora_forward_backward_and_diffusers_api(tiny_unet, adapter_after_swap):
    from plusequals import swap_transformer_blocks

    reference, unet = tiny_unet(), tiny_unet()
    for model in (reference, unet) if not adapter_after_swap else (reference,):
        unet_adapter(model, "a", 18)
    swap_transformer_blocks(unet)
    if adapter_after_swap:
        unet_adapter(unet, "a", 18)
    pair = UnetPair(unet, reference, unet_inputs())
    assert pair.same_step()
    assert all(m._config.lora for m in unet.modules() if isinstance(m, RustTransformerBlock))  # read at the call
    assert pair.same_step(cross_attention_kwargs={"scale": 0.5})  # the UNet scales the layers, then unscales them
    pair.each(lambda m: (unet_adapter(m, "b", 19, r=2), m.set_adapters(["a", "b"], weights=[0.5, 1.5])))
    assert pair.same_step()
    assert pair.disabled_then_fused_agree()
    pair.each(lambda m: m.disable_lora())  # disabled while fused: PEFT would unmerge inside its forward
    with torch.no_grad(), pytest.raises(UnsupportedBlockError, match="disabled while"):
        unet(*pair.inputs)
    pair.each(lambda m: (m.unfuse_lora(), m.enable_lora()))
    assert pair.same_step()
