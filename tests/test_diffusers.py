"""The Rust block as a drop-in inside a real (small, randomly initialised) diffusers UNet.

Parity, fp32 on the CPU: with diffusers' default processor (AttnProcessor2_0) the Rust block
calls the same ATen kernels as diffusers' block (layer_norm, linear, SDPA, gelu) in the same
order, so the swapped UNet's output and gradients are asserted bitwise equal (torch.equal).
Where the ops differ (AttnProcessor: baddbmm and softmax instead of SDPA) the bar is the
project's, ||a - b|| / ||b|| <= 1e-5. It is tight enough to matter: scaling one block's queries
by 1.0001 (an attention-scale error of 1e-4) already moves the UNet's output by ~4e-5, and
halving one feed-forward weight by ~0.3 (test_the_blocks_matter).

Needs diffusers (the optional extra ``plusequals[diffusers]``); the tests that import it are
skipped only when it is not installed. No hub download: the UNet config is built in code.
"""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import plusequals
from conftest import cuda, randomize_, rel_err
from plusequals import UnsupportedBlockError, swap_transformer_blocks
from plusequals.twin.swap import RustTransformerBlock, SwapHandle, unswap_transformer_blocks
from support.unet import N_BLOCKS, REPLACED, run, unet_inputs

TOL = 1e-5


def basic_blocks(model, diffusers):
    cls = diffusers.models.attention.BasicTransformerBlock
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def modules_at(model, paths):
    return [model.get_submodule(p) for p in paths]


# --------------------------------------------------------------------------------------------
# Parity and undo
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("owned", [False, True], ids=["forward", "forward_owned"])
def test_swapped_unet_matches_and_undo_restores(diffusers, tiny_unet, owned):
    unet = tiny_unet()
    inputs = unet_inputs()
    originals = basic_blocks(unet, diffusers)
    assert len(originals) == N_BLOCKS
    keys = list(unet.state_dict())
    with torch.inference_mode():
        expected = run(unet, inputs)

        handle = swap_transformer_blocks(unet, owned=owned)
        assert isinstance(handle, SwapHandle) and handle.active
        assert len(handle) == len(originals) == N_BLOCKS
        assert [s.path for s in handle] == [name for name, _ in originals]
        assert basic_blocks(unet, diffusers) == []
        for s, (name, block) in zip(handle, originals):
            assert s.original is block and getattr(s.parent, s.name) is s.replacement
            assert isinstance(s.replacement, RustTransformerBlock)
            # weights shared, not copied
            assert all(a is b for a, b in zip(s.replacement.parameters(), block.parameters()))
        assert list(unet.state_dict()) == keys, "the swap changed the model's state_dict keys"

        got = run(unet, inputs)
        assert got.shape == expected.shape == (2, 4, 16, 16)
        assert torch.equal(got, expected)  # the same ops in the same order

        unswap_transformer_blocks(handle)
        assert not handle.active
        assert all(m is block for m, (_, block) in zip(modules_at(unet, handle.paths), originals))
        assert torch.equal(run(unet, inputs), expected)
        handle.undo()  # idempotent
        assert all(m is block for m, (_, block) in zip(modules_at(unet, handle.paths), originals))


def test_the_blocks_matter(diffusers, tiny_unet):
    """Guards the parity bar against vacuity: small errors in one block show at the UNet's output."""
    inputs = unet_inputs()
    with torch.no_grad():
        expected = run(tiny_unet(), inputs)
        for name, factor, at_least in (("attn1.to_q.weight", 1.0001, 2 * TOL), ("ff.net.2.weight", 0.5, 1e3 * TOL)):
            unet = tiny_unet()
            basic_blocks(unet, diffusers)[0][1].get_parameter(name).mul_(factor)
            assert rel_err(run(unet, inputs), expected) > at_least, name


def test_context_manager_undoes(diffusers, tiny_unet):
    unet = tiny_unet()
    originals = [m for _, m in basic_blocks(unet, diffusers)]
    with swap_transformer_blocks(unet) as handle:
        assert len(handle) == N_BLOCKS and basic_blocks(unet, diffusers) == []
    assert [m for _, m in basic_blocks(unet, diffusers)] == originals


def test_gradients_match(diffusers, tiny_unet):
    """loss.backward() through the swapped UNet: same gradient w.r.t. the encoder states and
    the blocks' (shared) weights, with and without diffusers' gradient checkpointing."""
    inputs = unet_inputs()
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(2, 4, 16, 16, generator=g)

    def grads(unet, checkpointing):
        unet.train()  # dropout is 0 everywhere: train mode only matters for checkpointing
        if checkpointing:
            unet.enable_gradient_checkpointing()
        unet.zero_grad(set_to_none=True)
        sample, t, context = inputs
        context = context.clone().requires_grad_(True)
        loss = (unet(sample, t, context).sample * weight).sum()
        loss.backward()
        blocks = [m for m in unet.modules() if isinstance(m, (RustTransformerBlock, bt))]
        return context.grad, [p.grad for b in blocks for p in (b.attn2.to_k.weight, b.norm1.weight, b.ff.net[2].bias)]

    bt = diffusers.models.attention.BasicTransformerBlock
    for checkpointing in (False, True):
        unet = tiny_unet()
        expected_ctx, expected_w = grads(unet, checkpointing)
        swap_transformer_blocks(unet)
        got_ctx, got_w = grads(unet, checkpointing)
        assert expected_ctx.abs().sum() > 0 and len(got_w) == 3 * N_BLOCKS
        assert torch.equal(got_ctx, expected_ctx), f"checkpointing={checkpointing}"
        for got, exp in zip(got_w, expected_w):
            assert got is not None and torch.equal(got, exp), f"checkpointing={checkpointing}"


# --------------------------------------------------------------------------------------------
# Refusals: unsupported kinds (all-or-nothing), and calls the Rust block cannot honour
# --------------------------------------------------------------------------------------------


def plant_block(diffusers, unet, **kw):
    """Puts a freshly built diffusers block of some kind at REPLACED (dim 32, 8 heads of 4)."""
    block = diffusers.models.attention.BasicTransformerBlock(32, 8, 4, cross_attention_dim=32, **kw)
    parent_path, name = REPLACED.rsplit(".", 1)
    setattr(unet.get_submodule(parent_path), name, block)
    return block


def _subclass(diffusers, unet):
    class MyBlock(diffusers.models.attention.BasicTransformerBlock):
        pass

    parent_path, name = REPLACED.rsplit(".", 1)
    setattr(unet.get_submodule(parent_path), name, MyBlock(32, 8, 4, cross_attention_dim=32))


def _ada_norm(diffusers, unet):
    plant_block(diffusers, unet, norm_type="ada_norm", num_embeds_ada_norm=10)


def _only_cross(diffusers, unet):
    plant_block(diffusers, unet, only_cross_attention=True)


def _double_self(diffusers, unet):
    plant_block(diffusers, unet, double_self_attention=True)


def _pos_embed(diffusers, unet):
    plant_block(diffusers, unet, positional_embeddings="sinusoidal", num_positional_embeddings=256)


def _gelu_tanh_ff(diffusers, unet):
    plant_block(diffusers, unet, activation_fn="gelu-approximate")


def _swiglu_ff(diffusers, unet):
    plant_block(diffusers, unet, activation_fn="swiglu")


def _dropout(diffusers, unet):
    plant_block(diffusers, unet, dropout=0.1)


def _attention_bias(diffusers, unet):
    plant_block(diffusers, unet, attention_bias=True)


def _ip_adapter_scales(diffusers, unet):
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0

    processor = IPAdapterAttnProcessor2_0(32, cross_attention_dim=32, scale=[[0.5, 1.0]])  # per-image scales
    unet.get_submodule(REPLACED).attn2.set_processor(processor)


def _custom_diffusion_xformers(diffusers, unet):
    from diffusers.models.attention_processor import CustomDiffusionXFormersAttnProcessor

    processor = CustomDiffusionXFormersAttnProcessor(hidden_size=32, cross_attention_dim=32)
    unet.get_submodule(REPLACED).attn2.set_processor(processor)


def _hook(diffusers, unet):
    unet.get_submodule(REPLACED).attn1.register_forward_hook(lambda *a: None)


def _chunking(diffusers, unet):
    unet.get_submodule(REPLACED).set_chunk_feed_forward(16, dim=1)


def _eps(diffusers, unet):
    unet.get_submodule(REPLACED).norm3.eps = 1e-6


REFUSED = {
    "subclass": (_subclass, "a subclass of BasicTransformerBlock"),
    "ada_norm": (_ada_norm, "norm_type='ada_norm'"),
    "only_cross_attention": (_only_cross, "only_cross_attention=True"),
    "double_self_attention": (_double_self, "double_self_attention=True"),
    "positional_embeddings": (_pos_embed, "positional_embeddings='sinusoidal'"),
    "gelu_tanh_ff": (_gelu_tanh_ff, "ff.net.0 is GELU(approximate='tanh')"),
    "swiglu_ff": (_swiglu_ff, "ff.net.0 is diffusers.models.activations.SwiGLU"),
    "dropout": (_dropout, "dropout p=0.1"),
    "attention_bias": (_attention_bias, "attn1.to_q has a bias"),
    # IP-Adapter runs (tests/test_sd_features.py) but not with per-image scales (ip_adapter_masks');
    # Custom Diffusion runs (tests/test_custom_diffusion.py) but not its xformers processor.
    "ip_adapter_per_image_scales": (_ip_adapter_scales, "attn2.processor.scale[0] is [0.5, 1.0]: per-image scales"),
    "custom_diffusion_xformers": (
        _custom_diffusion_xformers,
        "attn2 uses attention processor diffusers.models.attention_processor.CustomDiffusionXFormersAttnProcessor "
        "(Custom Diffusion with xformers: use CustomDiffusionAttnProcessor2_0",
    ),
    "forward_hook": (_hook, "attn1 has forward_hooks"),
    "ff_chunking": (_chunking, "feed-forward chunking"),
    "layer_norm_eps": (_eps, "norm3 has eps=1e-06"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_unsupported_block_is_refused_and_nothing_swapped(diffusers, tiny_unet, kind):
    plant, reason = REFUSED[kind]
    unet = tiny_unet()
    plant(diffusers, unet)
    before = list(unet.named_modules())
    with pytest.raises(UnsupportedBlockError) as info:
        swap_transformer_blocks(unet)
    message = str(info.value)
    assert f"{REPLACED}: " in message and reason in message, message
    assert "nothing was swapped" in message
    assert "refused 1 of 4" in message, "only the planted block should be named"
    after = list(unet.named_modules())
    assert len(after) == len(before) and all(n1 == n2 and m1 is m2 for (n1, m1), (n2, m2) in zip(before, after))
    assert not any(isinstance(m, RustTransformerBlock) for m in unet.modules())


def test_exact_gelu_feed_forward_is_swapped(diffusers, tiny_unet):
    """activation_fn="gelu" (a linear layer and the exact GELU) is the Rust block's non-gated
    feed-forward: swapped, and equal to diffusers' block, like RustBlock.from_torch on a
    CompVis block with gated_ff=False (the same definition: plusequals.twin.faithful)."""
    unet = tiny_unet()
    planted = plant_block(diffusers, unet, activation_fn="gelu")
    randomize_(planted.eval(), seed=9)
    inputs = unet_inputs()
    with torch.no_grad():
        expected = run(unet, inputs)
        handle = swap_transformer_blocks(unet)
        replacement = unet.get_submodule(REPLACED)
        assert replacement.original is planted and replacement._config.gated_ff is False
        assert torch.equal(run(unet, inputs), expected)
        handle.undo()


def test_no_block_to_swap(diffusers, tiny_unet):
    with pytest.raises(ValueError, match="no diffusers BasicTransformerBlock"):
        swap_transformer_blocks(nn.Sequential(nn.Linear(2, 2)))
    unet = tiny_unet()
    swap_transformer_blocks(unet)
    with pytest.raises(ValueError, match="4 are already swapped"):
        swap_transformer_blocks(unet)


def test_calls_it_cannot_honour_raise(diffusers, tiny_unet):
    unet = tiny_unet()
    inputs = unet_inputs()
    with torch.no_grad():
        expected = run(unet, inputs)
        swap_transformer_blocks(unet)
        with pytest.raises(UnsupportedBlockError, match=r"cross_attention_kwargs \['ip_adapter_masks'\]"):
            run(unet, inputs, cross_attention_kwargs={"ip_adapter_masks": None})
        # The UNet itself pops a LoRA "scale" (applied to PEFT layers, of which there are none here)
        # before the blocks see the kwargs, exactly as for the original blocks.
        assert rel_err(run(unet, inputs, cross_attention_kwargs={"scale": 0.5}), expected) <= TOL

        block = unet.get_submodule(REPLACED)
        x, context = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(7)), inputs[2]
        with pytest.raises(
            UnsupportedBlockError, match="encoder_attention_mask is a boolean mask, which attn2.s AttnProcessor cannot"
        ):
            block.attn2.set_processor(diffusers.models.attention_processor.AttnProcessor())
            block(x, encoder_attention_mask=torch.ones(2, 1, 77, dtype=torch.bool), encoder_hidden_states=context)
        block.attn2.set_processor(diffusers.models.attention_processor.AttnProcessor2_0())
        with pytest.raises(UnsupportedBlockError, match="LoRA scale"):
            block(x, encoder_hidden_states=context, cross_attention_kwargs={"scale": 0.5})
        with pytest.raises(TypeError, match="unexpected keyword arguments \\['temb'\\]"):
            block(x, encoder_hidden_states=context, temb=x)
        with pytest.raises(UnsupportedBlockError, match="feed-forward chunking"):
            block.set_chunk_feed_forward(8)

        # Changed after the swap: a processor (set through diffusers' own API), LoRA-like layers.
        from diffusers.models.attention_processor import AttnProcessor, SlicedAttnProcessor

        unet.set_attn_processor(AttnProcessor())  # the same maths (other ops: within the bound): still runs
        assert rel_err(run(unet, inputs), expected) <= TOL
        unet.set_attn_processor(SlicedAttnProcessor(2))  # AttnProcessor's maths, a slice at a time: runs
        assert rel_err(run(unet, inputs), expected) <= TOL
        unet.set_attn_processor(AttnProcessor())
        handle = block.attn2.register_forward_hook(lambda *a: None)  # would be bypassed: refused
        with pytest.raises(UnsupportedBlockError, match="attn2 has forward_hooks"):
            run(unet, inputs)
        handle.remove()
        calls = []
        handle = block.register_forward_hook(lambda *a: calls.append(1))  # on the replacement: runs
        assert rel_err(run(unet, inputs), expected) <= TOL and calls == [1]
        handle.remove()
        block.attn1.to_q = nn.Sequential(block.attn1.to_q)  # what PEFT injection looks like to the block
        with pytest.raises(UnsupportedBlockError, match="attn1.to_q is nn.Sequential, not a plain nn.Linear"):
            run(unet, inputs)


# --------------------------------------------------------------------------------------------
# Shared weights: dtype/device moves, load_state_dict, deepcopy
# --------------------------------------------------------------------------------------------


def test_weights_stay_shared_after_swap(tiny_unet):
    unet = tiny_unet()
    reference = copy.deepcopy(unet)
    other = tiny_unet(3)
    inputs = unet_inputs()
    handle = swap_transformer_blocks(unet)
    with torch.no_grad():
        # in-place weight update (optimizer step, load_state_dict): seen by the Rust blocks
        unet.load_state_dict(other.state_dict())
        assert rel_err(run(unet, inputs), run(other, inputs)) <= TOL
        # .double() replaces every parameter's data: the Rust blocks are rebuilt on it
        unet.double(), other.double()
        got = run(unet, unet_inputs(dtype=torch.float64))
        assert got.dtype == torch.float64
        assert rel_err(got, run(other, unet_inputs(dtype=torch.float64))) <= 1e-12
        unet.float(), other.float()
        # a deep copy of a swapped UNet runs on its own copy of the weights
        twin = copy.deepcopy(unet)
        assert all(isinstance(twin.get_submodule(p), RustTransformerBlock) for p in handle.paths)
        twin.load_state_dict(reference.state_dict())
        assert rel_err(run(twin, inputs), run(reference, inputs)) <= TOL
        assert rel_err(run(unet, inputs), run(other, inputs)) <= TOL
        # the originals restored by undo carry what happened to the shared weights meanwhile
        handle.undo()
        assert torch.equal(run(unet, inputs), run(other, inputs))


@cuda
@pytest.mark.parametrize("owned", [False, True], ids=["forward", "forward_owned"])
def test_cuda_fp16_swap_then_move(diffusers, tiny_unet, owned):
    """Swapped on the CPU, then moved: the blocks rebuild their Rust twin on the CUDA fp16 weights.
    fp16 bar as tests/test_parity.py (2e-3); both sides call the same kernels, so it is loose."""
    unet = tiny_unet()
    inputs = [t.to("cuda") for t in unet_inputs()]
    inputs = [inputs[0].half(), inputs[1], inputs[2].half()]
    reference = copy.deepcopy(unet).to("cuda", torch.float16)
    swap_transformer_blocks(unet, owned=owned)
    unet.to("cuda", torch.float16)
    with torch.inference_mode():
        assert rel_err(run(unet, inputs), run(reference, inputs)) <= 2e-3


# --------------------------------------------------------------------------------------------
# The full-size config, and diffusers staying optional
# --------------------------------------------------------------------------------------------


def test_sd_v1_config_builds_the_sd_v1_unet_on_meta(diffusers):
    config = plusequals.sd_v1_unet_config()
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**config)
    assert sum(p.numel() for p in unet.parameters()) == 859_520_964  # SD v1.x UNet
    blocks = [b for _, b in basic_blocks(unet, diffusers)]
    assert len(blocks) == 16
    assert {(b.attn1.heads, b.attn1.to_q.out_features // b.attn1.heads) for b in blocks} == {(8, 40), (8, 80), (8, 160)}
    assert {b.attn2.to_k.in_features for b in blocks} == {768}
    # On the meta device the swap works as RustBlock.from_torch does (one definition), and the
    # swapped UNet propagates shapes: the custom op's fake implementation, no data anywhere.
    handle = swap_transformer_blocks(unet)
    assert len(handle) == 16
    with torch.device("meta"), torch.no_grad():
        out = unet(torch.empty(2, 4, 64, 64), torch.tensor([1, 2]), torch.empty(2, 77, 768)).sample
    assert out.shape == (2, 4, 64, 64) and out.device.type == "meta"


def test_diffusers_stays_optional():
    code = (
        "import sys; sys.modules['diffusers'] = None\n"  # makes `import diffusers` raise ImportError
        "import plusequals, torch\n"
        "assert plusequals.sd_v1_unet_config()['cross_attention_dim'] == 768\n"
        "try:\n"
        "    plusequals.swap_transformer_blocks(torch.nn.Linear(2, 2))\n"
        "except ImportError as e:\n"
        "    assert 'plusequals[diffusers]' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
