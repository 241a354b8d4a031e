"""Never stale, structurally: changes to a module's structure, made in place after the
Rust side read it, are followed or refused, for ``RustBlock``, ``CppBlock`` and the diffusers swap.

Each case shows first that the change matters (the PyTorch block's output moves), then that the
Rust side follows it (equal to the changed PyTorch block) or raises ``UnsupportedBlockError``
naming it, and that undoing the change makes it work again. What each call compares, and what it
costs, is ``plusequals.twin.watch.Watch``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
    register_module_full_backward_hook,
)
from torch.utils.flop_counter import FlopCounterMode

from conftest import CONTEXT, make_block, make_inputs, randomize_, rel_err
from plusequals import CppBlock, RustBlock, UnsupportedBlockError
from support import compvis_reference
from support.sites import SITES, TOL, Site


@pytest.fixture(params=SITES)
def site(request):
    return Site(request.param, request.getfixturevalue("tiny_unet") if request.param == "swap" else None)


def follows_or_refuses(site: Site, change, undo, names: str, matters: bool = True) -> None:
    """The case's three steps: the change matters; the Rust side follows or refuses naming it;
    undone, it works again."""
    before = site.pytorch()
    assert rel_err(site.run(), before) <= TOL
    change()
    try:
        changed = site.pytorch()
        assert (rel_err(changed, before) > TOL) == matters, "the change does (not) move the PyTorch output"
        try:
            got = site.run()
        except UnsupportedBlockError as e:
            assert names in str(e), str(e)
        else:
            assert rel_err(got, changed) <= TOL, f"stale: {rel_err(got, changed):.3g} from the changed block"
    finally:
        undo()
    assert rel_err(site.run(), site.pytorch()) <= TOL


# ----------------------------------------------------------------------------------------- global hooks


def _scale_output(module, args, output):
    return output * 1.5 if isinstance(output, torch.Tensor) else output


def _scale_input(module, args):
    return tuple(a * 1.5 if isinstance(a, torch.Tensor) else a for a in args)


GLOBAL_HOOKS = {
    "forward": lambda: register_module_forward_hook(_scale_output),
    "forward pre": lambda: register_module_forward_pre_hook(_scale_input),
}


@pytest.mark.parametrize("kind", list(GLOBAL_HOOKS))
def test_a_global_hook_registered_later_is_refused_naming_it(site, kind):
    handle = []
    follows_or_refuses(
        site,
        lambda: handle.append(GLOBAL_HOOKS[kind]()),
        lambda: handle.pop().remove(),
        f"global module {kind} hooks are registered",
    )


def test_a_global_backward_hook_is_refused_too():
    """A full backward hook changes no output, but fires on each submodule's backward, which the
    Rust block's backward bypasses."""
    block = make_block(80, 8, 10, context_dim=CONTEXT[1])
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(16)
    handle = register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        with pytest.raises(UnsupportedBlockError, match="global module backward hooks are registered"):
            rust(x, c)
    finally:
        handle.remove()
    assert torch.equal(rust(x, c), block(x, c))


@pytest.mark.parametrize("name", ["RustBlock", "CppBlock"])
def test_a_global_hook_present_before_from_torch_is_refused(name):
    block = make_block(80, 8, 10, context_dim=CONTEXT[1])
    handle = register_module_forward_hook(_scale_output)
    try:
        with pytest.raises(ValueError, match="global module forward hooks are registered"):
            (RustBlock if name == "RustBlock" else CppBlock).from_torch(block)
    finally:
        handle.remove()
    (RustBlock if name == "RustBlock" else CppBlock).from_torch(block)


def test_an_observers_global_hooks_are_accepted():
    """FlopCounterMode tracks modules with global hooks that only observe: the block runs under
    it, exact, and the mode counts the Rust block's own aten ops."""
    block = make_block(80, 8, 10, context_dim=CONTEXT[1])
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(16)
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        got = rust(x, c)
    assert torch.equal(got, block(x, c)) and flops.get_total_flops() > 0


# ----------------------------------------------------------------------------------------- structure


def _sequential(site, path):
    return site.block.get_submodule(path)


@pytest.mark.parametrize("path", ["attn1.to_out", "ff.net"])
def test_a_grown_sequential_is_refused(site, path):
    """Refused in every case. In diffusers the processor calls ``to_out[0]`` and ``to_out[1]`` by
    index, so a module appended there changes nothing: that refusal is stricter than needed."""
    seq = _sequential(site, path)
    matters = not (site.name == "swap" and path == "attn1.to_out")
    follows_or_refuses(site, lambda: seq.append(nn.Tanh()), lambda: seq.__delitem__(len(seq) - 1), f"{path} ", matters)


class DoubledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class ShiftedLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) + 1


@pytest.mark.parametrize(
    "path,cls", [("attn1.to_q", DoubledLinear), ("norm1", ShiftedLayerNorm)], ids=["to_q", "norm1"]
)
def test_a_swapped_class_is_refused(site, path, cls):
    module = site.block.get_submodule(path)
    original = type(module)

    def change():
        module.__class__ = cls

    def undo():
        module.__class__ = original

    follows_or_refuses(site, change, undo, f"{path} is {cls.__module__}.{cls.__qualname__}")


def test_an_added_submodule_or_parameter_is_seen():
    """Appended submodules are the cases above; a parameter registered later on a submodule (the
    Rust block would not use it) is seen too: refused, naming it."""
    block = make_block(80, 8, 10, context_dim=CONTEXT[1])
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(16)
    block.attn1.register_parameter("temperature", nn.Parameter(torch.ones(1)))
    with pytest.raises(UnsupportedBlockError, match="attn1.temperature"):
        rust(x, c)
    del block.attn1.temperature
    assert torch.equal(rust(x, c), block(x, c))


# ----------------------------------------------------------------------------------------- unknown classes


class SwitchableGate(nn.Module):
    """A GEGLU this crate does not know, whose forward reads an attribute."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj
        self.activation = "gelu"

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * (F.gelu(gate) if self.activation == "gelu" else F.silu(gate))


def unknown_block(dtype=torch.float32):
    block = randomize_(compvis_reference.BasicTransformerBlock(80, 8, 10, context_dim=CONTEXT[1])).eval()
    block.ff.net[0] = SwitchableGate(block.ff.net[0].proj)
    return block.to(dtype)


@pytest.mark.parametrize("name", ["RustBlock", "CppBlock"])
def test_unknown_classes_are_refused_unless_trusted_to_a_probe(name):
    cls = RustBlock if name == "RustBlock" else CppBlock
    block = unknown_block()
    with pytest.raises(ValueError, match="are not ones this crate knows.*trust='probe'"):
        cls.from_torch(block)
    with pytest.raises(ValueError, match="trust must be one of"):
        cls.from_torch(block, trust="yes")
    rust = cls.from_torch(block, trust="probe")
    x, c = make_inputs(16)
    assert rel_err(rust(x, c), block(x, c)) <= TOL


@pytest.mark.parametrize("name", ["RustBlock", "CppBlock"])
def test_an_unknown_classs_state_changed_is_probed_again(name):
    """The probe's verdict holds for what it probed: the attribute the unknown GEGLU's forward
    reads is flipped (the PyTorch block moves): probed again, refused; flipped back, accepted."""
    block = unknown_block()
    rust = (RustBlock if name == "RustBlock" else CppBlock).from_torch(block, trust="probe")
    x, c = make_inputs(16)
    before = block(x, c)
    assert rel_err(rust(x, c), before) <= TOL
    block.ff.net[0].activation = "silu"
    assert rel_err(block(x, c), before) > TOL
    with pytest.raises(UnsupportedBlockError, match="its output differs from the Rust block's"):
        rust(x, c)
    block.ff.net[0].activation = "gelu"
    assert rel_err(rust(x, c), block(x, c)) <= TOL


def test_an_unknown_class_built_where_the_probe_cannot_run_is_probed_once_it_can():
    """Built on the meta device (no values to probe), an unknown SiLU gate runs unprobed, as
    trust='probe' says; given values on the CPU, the Rust block is rebuilt and the probe runs:
    refused. In bf16 the probe runs at once, in bf16."""
    block = unknown_block().to("meta")
    block.ff.net[0].activation = "silu"
    rust = RustBlock.from_torch(block, trust="probe")
    x, c = make_inputs(16)
    assert rust(x.to("meta"), c.to("meta")).shape == x.shape  # unprobed: documented
    block.to_empty(device="cpu")
    block.load_state_dict(unknown_block().state_dict())
    assert rel_err(block(x, c), unknown_block()(x, c)) > TOL  # silu: not the CompVis block
    with pytest.raises(UnsupportedBlockError, match="its output differs from the Rust block's"):
        rust(x, c)
    half = unknown_block(torch.bfloat16)
    half.ff.net[0].activation = "silu"
    with pytest.raises(UnsupportedBlockError, match=r"differs from the Rust block's .* in torch.bfloat16 on cpu"):
        RustBlock.from_torch(half, trust="probe")


# ----------------------------------------------------------------------------------------- from_state_dict


def test_from_state_dict_follows_its_tensors_not_the_mapping():
    """What from_state_dict follows, exactly (its docstring, the README): the tensors the mapping
    held at the call. Writes into them are seen (in place, or ``.data =`` of another dtype:
    rebuilt); rebinding a key of the mapping afterwards is not."""
    block = make_block(80, 8, 10, context_dim=CONTEXT[1])
    weights = dict(block.state_dict(keep_vars=True))
    rust = RustBlock.from_state_dict(weights, dim=80, n_heads=8, d_head=10, context_dim=CONTEXT[1])
    x, c = make_inputs(16)
    with torch.no_grad():
        weights["norm1.weight"].mul_(2)
    assert torch.equal(rust(x, c), block(x, c))  # an in-place write: seen
    kept = rust(x, c)
    weights["norm1.weight"] = torch.zeros(80)  # a rebound key: not followed
    assert torch.equal(rust(x, c), kept)


# ----------------------------------------------------------------------------------------- honest messages


def test_a_peft_layer_it_does_not_compute_is_refused_with_its_qualified_class_and_only_true_causes():
    """LoRA runs in Rust (tests/test_lora.py); LoHa, another peft tuner, is refused for its class,
    named with its module, with no second-hand reasons about its parameters or widths; MiCA, a
    LoRA variant other than DoRA (which runs: tests/test_dora.py), is refused with its one cause."""
    pytest.importorskip("peft", reason="needs the optional extra plusequals[diffusers]")
    pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
    from diffusers.models.attention import BasicTransformerBlock as DiffusersBlock
    from peft import LoHaConfig, LoraConfig, inject_adapter_in_model

    from plusequals import swap_transformer_blocks

    block = DiffusersBlock(32, 4, 8, cross_attention_dim=24, activation_fn="geglu").eval()
    inject_adapter_in_model(LoHaConfig(r=4, target_modules=["attn1.to_q"]), block)
    with pytest.raises(ValueError) as info:
        RustBlock.from_torch(block)
    message = str(info.value)
    assert "attn1.to_q is peft.tuners.loha.layer.Linear, not a plain nn.Linear" in message, message
    assert "normalises over" not in message and "missing" not in message and "does not use" not in message, message
    assert message.count(";") == 0, message  # one cause: the LoHa layer

    unet = nn.Module()
    unet.block = block
    with pytest.raises(UnsupportedBlockError, match="peft.tuners.loha.layer.Linear") as info:
        swap_transformer_blocks(unet)
    assert "normalises over" not in str(info.value)

    mica = DiffusersBlock(32, 4, 8, cross_attention_dim=24, activation_fn="geglu").eval()
    with torch.random.fork_rng():  # peft initialises the adapter from the global generator: left as it was
        inject_adapter_in_model(LoraConfig(r=4, target_modules=["attn1.to_q"], init_lora_weights="mica"), mica)
    with pytest.raises(ValueError) as info:
        RustBlock.from_torch(mica.eval())
    message = str(info.value)
    variant = "attn1.to_q adapter 'default' is peft.tuners.lora.variants.MiCALinearVariant, a LoRA variant"
    assert variant in message and message.count(";") == 0, message
