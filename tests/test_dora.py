"""PEFT's DoRA (``use_dora=True``) through the Rust block, on peft's and diffusers' own classes.

The Rust block computes PEFT's ``DoraLinearLayer.forward`` (``rust/linear.rs``, ``Linear::dora``) on
PEFT's tensors with the ops PEFT calls, in its order: the eye-based ``lora_weight``, the detached row
norm of ``W + scaling * lora_weight``, and ``(m - 1) * base_result + m * lora_result * scaling``. So the
output and every gradient (the input, the context, ``lora_A``/``lora_B`` and the magnitude vector,
which lands on PEFT's own parameter) are asserted equal bit for bit to PEFT's forward on the same
modules. Generated sequences of what PEFT and diffusers change (set_adapter, enable/disable,
merge/unmerge, scales, train/eval) check that each call equals PEFT's or is refused naming the cause
(the oracle: PEFT's public state); the swapped small UNet gets DoRA through ``unet.add_adapter``.
"""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import examples, rel_err
from plusequals import UnsupportedBlockError, swap_transformer_blocks
from plusequals.twin.swap import RustTransformerBlock

pytest.importorskip("peft", reason="needs the optional extra plusequals[diffusers]")
pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")

from support.lora import (  # noqa: E402
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


def magnitudes(module):
    """PEFT's DoRA magnitude vectors (``lora_magnitude_vector.<adapter>.weight``), by name."""
    return {n: p for n, p in module.named_parameters() if "lora_magnitude_vector" in n}


def forward_backward(module, block, x, c):
    """The output, then the gradients of x, c and every trainable parameter of ``block`` (PEFT's
    tensors, whether ``module`` is the Rust block or ``block`` itself)."""
    x, c = x.clone().requires_grad_(), c.clone().requires_grad_()
    params = [p for p in block.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    out = call(module, x, c)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return [out.detach(), x.grad, c.grad] + [p.grad for p in params]


def same(got, expected):
    return len(got) == len(expected) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(got, expected)
    )


def active_magnitudes(block):
    """The magnitude vectors of the active DoRA adapters (from PEFT's public state)."""
    return [
        layer.lora_magnitude_vector[name].weight
        for layer in layers(block)
        if not layer.disable_adapters and not layer.merged
        for name in layer.active_adapters
        if name in layer.lora_variant
    ]


ACTIVE = st.sampled_from([["a"], ["b"], ["a", "b"], ["b", "a"]])


@SLOW
@given(adapter_configs(), st.one_of(st.none(), adapter_configs()), st.booleans(), ACTIVE)
def test_dora_block_forward_and_backward_match_peft_bit_for_bit(first, second, second_dora, active):
    block = lora_block(use_dora=True, **{**first, "lora_bias": False})  # peft refuses lora_bias with DoRA
    if second is not None:
        add_adapter(
            block, "b", 7, **{**second, "use_dora": second_dora, "lora_bias": second["lora_bias"] > second_dora}
        )
        for layer in layers(block):  # with "b" after "a", "b"'s base_result is the running result: "a"'s term included
            layer.set_adapter([n for n in active if n in layer.lora_A] or ["a"])
    assume(active_magnitudes(block))
    rust = RustTransformerBlock(block)
    x, c = inputs()
    got = forward_backward(rust, block, x, c)
    expected = forward_backward(block, block, x, c)  # PEFT's forward, on the same modules
    assert same(got, expected)
    assert all(m.grad is not None for m in active_magnitudes(block))
    assert any(m.grad.abs().sum() > 0 for m in active_magnitudes(block))


@pytest.mark.parametrize("dtype", ["autocast-bf16", torch.bfloat16])
def test_dora_in_bf16_and_under_autocast_is_bitwise_peft(dtype):
    """peft casts the input to lora_A's dtype before the adapters (fp32 under autocast after a bf16
    layer), and DoRA's weight norm is taken in the input's dtype: the Rust block does the same, so a
    DoRA adapter and a plain one, both active, are bitwise peft's forward and backward."""
    block = lora_block(seed=24, use_dora=True)
    add_adapter(block, "b", 25, target_modules=["to_out.0", "net.2", "to_k"])
    for layer in layers(block):
        layer.set_adapter(["a", "b"] if "b" in layer.lora_A else ["a"])
    x, c = inputs()
    if dtype == torch.bfloat16:
        block, x, c = block.to(dtype), x.to(dtype), c.to(dtype)
    rust = RustTransformerBlock(block)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast-bf16"):
        got = forward_backward(rust, block, x, c)
        expected = forward_backward(block, block, x, c)
    assert same(got, expected)


def test_peft_input_cast_turned_off_is_refused_naming_it():
    from peft.helpers import disable_input_dtype_casting

    block = lora_block(seed=26, use_dora=True, target_modules=["to_out.0"])
    rust = RustTransformerBlock(block)
    x, c = inputs()
    with torch.no_grad():
        with disable_input_dtype_casting(block), pytest.raises(UnsupportedBlockError, match="peft's input cast off"):
            call(rust, x, c)
        assert torch.equal(call(rust, x, c), call(block, x, c))


@settings(SLOW, max_examples=examples(10))
@given(st.lists(OPS, min_size=1, max_size=8))
def test_changes_after_the_read_are_followed_or_refused_never_stale(ops):
    block = lora_block(seed=3, lora_dropout=0.0, use_dora=True)
    add_adapter(block, "b", 9, r=2, lora_alpha=3, lora_dropout=0.25, target_modules=["to_v", "proj"], use_dora=True)
    block.eval()  # peft makes the new adapter's dropouts in training mode
    followed_or_refused(block, ops, dora=True)


def test_dora_training_through_the_rust_block():
    """Three SGD steps on PEFT's DoRA parameters through the Rust block leave bitwise PEFT's weights,
    the magnitude vectors included (their gradients land on PEFT's parameters)."""
    x, c = inputs(seed=5)
    target = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(6))
    runs = []
    for through_rust in (False, True):
        block = lora_block(seed=8, lora_dropout=0.0, use_dora=True).train()
        for name, p in block.named_parameters():
            p.requires_grad_("lora_" in name)
        module = RustTransformerBlock(block) if through_rust else block
        params = [p for p in block.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.1)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            ((call(module, x, c) - target) ** 2).mean().backward()
            assert all(p.grad is not None for p in magnitudes(block).values())
            opt.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    start = lora_block(seed=8, lora_dropout=0.0, use_dora=True)
    assert all(not torch.equal(a, b) for a, b in zip(magnitudes(start).values(), magnitudes(block).values()))


def test_dora_cache_in_eval_mode_is_refused_then_runs_when_off():
    """peft's DoRA cache reuses a weight norm from an earlier call in eval mode: refused, naming it,
    while it is on (the watch follows the module global), and computed again once it is off."""
    block = lora_block(seed=20, use_dora=True, target_modules=["to_q"])
    rust = RustTransformerBlock(block)
    x, c = inputs()
    with torch.no_grad():
        with dora_cache(True):
            with pytest.raises(UnsupportedBlockError, match=r"attn1.to_q adapter 'a' \(DoRA\): peft's DoRA cache"):
                call(rust, x, c)
            block.train()  # no cache in training mode
            assert torch.equal(call(rust, x, c), call(block, x, c))
            block.eval()
        assert torch.equal(call(rust, x, c), call(block, x, c))


def dora_cache(enabled):
    from peft.helpers import DoraCaching

    return DoraCaching(enabled)


def test_dora_with_a_dropout_layer_in_training_is_refused_naming_it():
    """PEFT recomputes DoRA's base result from the dropped-out input when its lora_dropout is an
    nn.Dropout and the layer trains: refused even at p == 0; eval mode runs."""
    block = lora_block(seed=21, use_dora=True, lora_dropout=0.1, target_modules=["to_v"])
    for layer in layers(block):
        layer.lora_dropout["a"].p = 0.0
    rust = RustTransformerBlock(block)
    x, c = inputs()
    with torch.no_grad():
        assert torch.equal(call(rust, x, c), call(block, x, c))
        block.train()
        with pytest.raises(UnsupportedBlockError, match=r"\(DoRA\) has an nn.Dropout lora_dropout in training mode"):
            call(rust, x, c)
        block.eval()
        assert torch.equal(call(rust, x, c), call(block, x, c))


# --------------------------------------------------------------------------------------------
# The UNet: diffusers' own adapter API on a swapped UNet
# --------------------------------------------------------------------------------------------


def test_swapped_unet_with_dora_forward_backward_and_diffusers_api(tiny_unet):
    """Adapter "a" added before the swap, "b" after it: both through ``unet.add_adapter``."""
    reference, unet = tiny_unet(), tiny_unet()
    for model in (reference, unet):
        unet_adapter(model, "a", 18, dora=True)
    swap_transformer_blocks(unet)
    pair = UnetPair(unet, reference, unet_inputs())
    assert pair.same_step()
    blocks = [m for m in unet.modules() if isinstance(m, RustTransformerBlock)]
    assert blocks and all(any(term[4] for term in m._config.lora) for m in blocks)  # DoRA, read at the call
    assert all(p.grad is not None for p in magnitudes(unet).values())
    pair.each(lambda m: (unet_adapter(m, "b", 19, dora=True, r=2), m.set_adapters(["a", "b"], weights=[0.5, 1.5])))
    assert pair.same_step(cross_attention_kwargs={"scale": 0.5})  # the UNet scales the layers, then unscales them
    assert pair.disabled_then_fused_agree()
    pair.each(lambda m: (m.unfuse_lora(), m.set_adapters("b")))
    assert pair.same_output()
    with torch.no_grad():
        plain = tiny_unet()(*pair.inputs).sample
        assert rel_err(unet(*pair.inputs).sample, plain) > 1e-4, "DoRA should change the output"
