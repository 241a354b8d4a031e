"""RustBlock as a torch module: faithful or refused (one definition, plusequals.twin.faithful), and
never stale (one mechanism, RustBlock._ensure_current, for from_torch and the swap).

1. Faithful or refused. Every block the Rust block cannot reproduce is refused by
   ``RustBlock.from_torch`` with a ``ValueError`` naming the cause, and each refused case is
   shown to matter: the Rust block on the same weights would compute something else. Where
   Python and Rust run the same ops in the same order (CPU fp32, ``plusequals.model.blocks`` and
   diffusers' default processor), outputs and gradients are bitwise equal (``torch.equal``).
   An independent CompVis implementation (another formulation of attention) is held to the
   documented bound, ||a-b||/||b|| <= 1e-5.
2. Never stale. After ``load_state_dict(assign=True)``, a replaced parameter, ``p.data = ..``,
   ``.to()``, ``.half()``, ``.double()``, the meta device, new Parameter objects from a
   conversion, a replaced submodule, and optimizer steps, the wrapper computes bitwise what the
   PyTorch block computes, for ``RustBlock``, ``CppBlock`` and the swap's replacement alike.
   A change it cannot follow raises, naming the cause, and undoing the change makes it work again.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import SHAPES, make_block, make_inputs, randomize_, rel_err
from plusequals import BasicTransformerBlock, CppBlock, RustBlock, UnsupportedBlockError
from plusequals.twin.faithful import read_block
from support import compvis_reference

TOL = 1e-5  # the documented bound where the ops differ (README)


def rust_on_same_weights(block: nn.Module, gated_ff: bool = True) -> RustBlock:
    """What the Rust block computes on ``block``'s weights, whatever the block's own semantics
    (from_state_dict reads only the tensors): to show that a refused case would be wrong."""
    attn1 = block.attn1
    return RustBlock.from_state_dict(
        {k: v.detach() for k, v in block.state_dict().items()},
        dim=attn1.to_q.in_features,
        n_heads=attn1.heads,
        d_head=attn1.to_q.out_features // attn1.heads,
        context_dim=block.attn2.to_k.in_features,
        gated_ff=gated_ff,
    )


# ============================================================================ 1. faithful or refused


def _dropout_train():
    return make_block(dropout=0.3).train(), "dropout p=0.3 in training mode"


def _eps():
    block = make_block()
    block.norm2.eps = 1e-3
    return block, "norm2 has eps=0.001"


def _tanh_gelu():
    block = make_block(gated_ff=False)
    block.ff.net[0][1] = nn.GELU(approximate="tanh")
    return block, "ff.net.0.1 is GELU(approximate='tanh')"


def _silu():
    block = make_block(gated_ff=False)
    block.ff.net[0][1] = nn.SiLU()
    return block, "ff.net.0.1 is nn.SiLU"


def _no_affine():
    block = make_block()
    block.norm3 = nn.LayerNorm(80, elementwise_affine=False)
    return block, "norm3 has no affine weight"


def _scale():
    block = make_block()
    block.attn1.scale = 0.5
    return block, "attn1.scale is 0.5"


def _attn_heads():
    block = make_block()
    block.attn2.heads = 4
    return block, "attn1 has 8 heads but attn2 has 4 heads"


def _qkv_bias():
    block = make_block()
    block.attn2.to_v = nn.Linear(192, 80)
    randomize_(block)
    return block, "attn2.to_v has a bias"


def _hook():
    block = make_block()
    block.ff.register_forward_hook(lambda m, i, o: o * 2)
    return block, "ff has forward_hooks"


def _buffer():
    block = make_block()
    block.norm1.register_buffer("running_mean", torch.zeros(80))
    return block, "buffers ['norm1.running_mean']"


def _unknown_geglu():
    """A CompVis-layout block whose GEGLU is a class this crate does not know, gating with SiLU:
    the layout passes, the probe does not."""

    class SiluGate(nn.Module):
        def __init__(self, proj):
            super().__init__()
            self.proj = proj

        def forward(self, x):
            x, gate = self.proj(x).chunk(2, dim=-1)
            return x * F.silu(gate)

    block = randomize_(compvis_reference.BasicTransformerBlock(80, 8, 10, context_dim=192)).eval()
    block.ff.net[0] = SiluGate(block.ff.net[0].proj)
    return block, "its output differs from the Rust block's"


REFUSED = {
    "dropout_train": _dropout_train,
    "layer_norm_eps": _eps,
    "tanh_gelu": _tanh_gelu,
    "silu": _silu,
    "no_affine": _no_affine,
    "scale": _scale,
    "attn2_heads": _attn_heads,
    "qkv_bias": _qkv_bias,
    "hook": _hook,
    "buffer": _buffer,
    "unknown_class_probe": _unknown_geglu,
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_from_torch_refuses_what_it_cannot_reproduce_and_names_the_cause(kind):
    block, cause = REFUSED[kind]()
    before = {k: v.detach().clone() for k, v in block.state_dict().items()}
    with pytest.raises(ValueError) as info:
        RustBlock.from_torch(block, trust="probe" if kind == "unknown_class_probe" else None)
    assert type(info.value) is UnsupportedBlockError and cause in str(info.value), str(info.value)
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())
    # The refusal is not vacuous: on the same weights, the Rust block computes something else.
    if kind not in ("no_affine", "qkv_bias", "buffer", "attn2_heads"):  # these weights do not fit it at all
        x, c = make_inputs(16)
        with torch.no_grad():
            expected = block(x, c)
            got = rust_on_same_weights(block, gated_ff=kind not in ("tanh_gelu", "silu"))(x, c)
        assert rel_err(got, expected) > TOL, f"{kind}: the refused block is reproduced after all"


def test_the_issues_cases_are_refused_by_cpp_too():
    for kind in ("dropout_train", "layer_norm_eps", "tanh_gelu", "silu"):
        block, cause = REFUSED[kind]()
        with pytest.raises(ValueError, match=cause.replace("(", r"\(").replace(")", r"\)")):
            CppBlock.from_torch(block)


def test_dropout_is_faithful_in_eval_mode_and_refused_in_training():
    """ "Dropout probability and mode": p > 0 is the identity in eval mode (accepted, bitwise),
    refused once the module is put in training mode, and accepted again in eval mode."""
    block = make_block(dropout=0.3).eval()
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(16)
    assert torch.equal(rust(x, c), block(x, c))
    block.train()
    with pytest.raises(UnsupportedBlockError, match="dropout p=0.3 in training mode"):
        rust(x, c)
    block.eval()
    assert torch.equal(rust(x, c), block(x, c))
    # the same block with p = 0 trains through Rust
    rust = RustBlock.from_torch(make_block().train())
    rust(x, c)


@pytest.mark.parametrize("twin", [RustBlock, CppBlock], ids=["rust", "cpp"])
@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_cpu_fp32_bitwise_equal_to_pytorch(twin, attention):
    """Same ops, same order: forward, forward_owned and every gradient (x, context, each
    parameter) are torch.equal to the PyTorch block, at the four scaled SD v1 shapes, with and
    without context."""
    for tokens, dim, heads, d_head in SHAPES:
        for with_context in (True, False):
            block = make_block(dim, heads, d_head, context_dim=192 if with_context else None, attention=attention)
            x, c = make_inputs(tokens, dim, context=with_context)
            rust = twin.from_torch(block)
            where = f"{twin.__name__} {attention} {tokens}x{dim} context={with_context}"

            def grads(fn):
                block.zero_grad(set_to_none=True)
                xg = x.clone().requires_grad_(True)
                cg = None if c is None else c.clone().requires_grad_(True)
                y = fn(xg, cg)
                y.square().sum().backward()
                return [y, xg.grad] + ([] if cg is None else [cg.grad]) + [p.grad for p in block.parameters()]

            expected, got = grads(block), grads(rust)
            assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), where
            with torch.no_grad():
                assert torch.equal(rust.forward_owned(x, c), expected[0]), where


def test_independent_compvis_implementation_within_the_bound():
    """Another formulation (einsum over views; the Rust block uses SDPA): classes this crate does
    not know, so refused by default; with trust="probe", accepted after the probe, within the
    documented bound, not bitwise."""
    block = randomize_(compvis_reference.BasicTransformerBlock(80, 8, 10, context_dim=192)).eval()
    with pytest.raises(ValueError, match="compvis_reference.BasicTransformerBlock.*are not ones this crate knows"):
        RustBlock.from_torch(block)
    rust = RustBlock.from_torch(block, trust="probe")
    x, c = make_inputs(64)
    assert rel_err(rust(x, c), block(x, c)) <= TOL


def test_one_definition_for_from_torch_and_the_swap():
    """RustBlock.from_torch takes a diffusers block too, and refuses exactly what the swap
    refuses, with the same reasons: both ask plusequals.twin.faithful.read_block."""
    diffusers = pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
    from diffusers.models.attention import BasicTransformerBlock as DiffusersBlock

    from plusequals import swap_transformer_blocks

    def diffusers_block(**kw):
        return randomize_(DiffusersBlock(32, 4, 8, cross_attention_dim=24, **kw)).eval()

    block = diffusers_block()
    rust = RustBlock.from_torch(block)
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(2, 9, 32, generator=g), torch.randn(2, 7, 24, generator=g)
    assert torch.equal(rust(x, c), block(x, encoder_hidden_states=c))
    refused = [
        dict(activation_fn="gelu-approximate"),
        dict(norm_eps=1e-6),
        dict(attention_bias=True),
        dict(only_cross_attention=True),
        dict(dropout=0.1),
    ]
    for kw in refused:
        block = diffusers_block(**kw).train()
        reasons = read_block(block).reasons
        assert reasons, kw
        with pytest.raises(ValueError) as from_torch_error:
            RustBlock.from_torch(block)
        holder = nn.ModuleDict({"block": block})
        with pytest.raises(UnsupportedBlockError) as swap_error:
            swap_transformer_blocks(holder)
        for reason in reasons:
            assert reason in str(from_torch_error.value) and reason in str(swap_error.value), (kw, reason)
    assert diffusers is not None


def test_non_blocks_are_type_errors_naming_block():
    for obj in (None, {}, nn.Linear(4, 4), make_block().attn1, RustBlock.from_torch(make_block())):
        with pytest.raises(TypeError, match="block"):
            RustBlock.from_torch(obj)


# ============================================================================ 2. never stale


def _plusequals(twin):
    def make(seed=0):
        block = make_block(seed=seed)
        return block, twin.from_torch(block), lambda m, x, c: m(x, c)

    return make


def _swapped(seed=0):
    diffusers = pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
    from diffusers.models.attention import BasicTransformerBlock as DiffusersBlock

    from plusequals.twin.swap import RustTransformerBlock

    block = randomize_(DiffusersBlock(80, 8, 10, cross_attention_dim=192), seed=seed).eval()
    assert diffusers is not None
    return block, RustTransformerBlock(block, path="blocks.0"), lambda m, x, c: m(x, encoder_hidden_states=c)


WRAPPERS = {"rust": _plusequals(RustBlock), "cpp": _plusequals(CppBlock), "swap": _swapped}


def _assign(block):
    other = make_block(seed=5) if isinstance(block, BasicTransformerBlock) else randomize_(copy.deepcopy(block), seed=5)
    block.load_state_dict(other.state_dict(), assign=True)


def _replace_parameter(block):
    block.norm1.weight = nn.Parameter(torch.randn(80, generator=torch.Generator().manual_seed(1)))
    block.attn2.to_k.weight = nn.Parameter(block.attn2.to_k.weight.detach() * 1.5)


def _set_data(block):
    w = block.ff.net[2].weight
    w.data = torch.randn(w.shape, generator=torch.Generator().manual_seed(2))


def _replace_submodule(block):
    fresh = copy.deepcopy(block.attn1)
    randomize_(fresh, seed=7)
    block.attn1 = fresh


def _new_parameter_objects(block):
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        block.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


CHANGES = {
    "load_state_dict_assign": (_assign, torch.float32),
    "replace_parameter": (_replace_parameter, torch.float32),
    "p.data=": (_set_data, torch.float32),
    "replace_submodule": (_replace_submodule, torch.float32),
    "to_float64": (lambda b: b.to(torch.float64), torch.float64),
    "double": (lambda b: b.double(), torch.float64),
    "half": (lambda b: b.half(), torch.float16),
    "double_then_float": (lambda b: b.double().float(), torch.float32),
    "overwrite_params_on_conversion": (_new_parameter_objects, torch.float64),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_follows_the_module_bitwise(wrapper, change):
    block, wrapped, call = WRAPPERS[wrapper]()
    x, c = make_inputs(16)
    with torch.no_grad():
        assert torch.equal(call(wrapped, x, c), call(block, x, c))
        before = call(block, x, c)
        apply, dtype = CHANGES[change]
        apply(block)
        x, c = x.to(dtype), c.to(dtype)
        expected = call(block, x, c)
        assert not torch.equal(expected.float(), before) or change == "double_then_float"
        assert torch.equal(call(wrapped, x, c), expected), change
        assert torch.equal(wrapped.forward_owned(x, c), expected) if wrapper != "swap" else True
    # gradients reach the parameters the block holds now
    if dtype != torch.float16:
        block.zero_grad(set_to_none=True)
        call(wrapped, x, c).sum().backward()
        assert all(p.grad is not None for p in block.parameters())


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_optimizer_steps_are_seen_without_a_rebuild(wrapper, optimizer):
    """An optimizer step writes the shared tensors in place: the Rust block sees it live, so it
    is not rebuilt (the same Rust block object), and the results stay bitwise equal."""
    block, wrapped, call = WRAPPERS[wrapper]()
    x, c = make_inputs(16)
    call(wrapped, x, c)
    inner = wrapped._block
    opt = (
        torch.optim.SGD(block.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.Adam(block.parameters(), lr=1e-2)
    )
    for _ in range(2):
        opt.zero_grad()
        call(wrapped, x, c).square().mean().backward()
        opt.step()
        with torch.no_grad():
            assert torch.equal(call(wrapped, x, c), call(block, x, c))
    assert wrapped._block is inner


@pytest.mark.parametrize("wrapper", ["rust", "swap"])
def test_meta_device_is_followed(wrapper):
    block, wrapped, call = WRAPPERS[wrapper]()
    x, c = make_inputs(16)
    block.to("meta")
    y = call(wrapped, x.to("meta"), c.to("meta"))
    assert y.device.type == "meta" and y.shape == x.shape
    with pytest.raises(ValueError, match="x is on cpu but the block's weights are on meta"):
        call(wrapped, x, c)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_change_it_cannot_follow_raises_and_undoing_it_recovers(wrapper):
    block, wrapped, call = WRAPPERS[wrapper]()
    x, c = make_inputs(16)
    expected = call(block, x, c)
    block.norm3.eps = 1e-3
    with pytest.raises(UnsupportedBlockError, match="norm3 has eps=0.001"):
        call(wrapped, x, c)
    block.norm3.eps = 1e-5
    assert torch.equal(call(wrapped, x, c), expected)
    handle = block.attn2.to_q.register_forward_pre_hook(lambda m, a: None)
    with pytest.raises(UnsupportedBlockError, match="attn2.to_q has forward_pre_hooks"):
        call(wrapped, x, c)
    handle.remove()
    block.attn1.to_k = nn.Sequential(block.attn1.to_k)  # what a LoRA/PEFT injection looks like
    with pytest.raises(UnsupportedBlockError, match="attn1.to_k is nn.Sequential, not a plain nn.Linear"):
        call(wrapped, x, c)
    block.attn1.to_k = block.attn1.to_k[0]
    assert torch.equal(call(wrapped, x, c), expected)
    block.norm1.weight = nn.Parameter(torch.ones(81))  # a shape it cannot take: the key is named
    with pytest.raises(ValueError, match="norm1.weight"):
        call(wrapped, x, c)


def test_state_dict_parameters_and_copies():
    """The module face: the CompVis keys, the block's own parameters, a deep copy that runs on
    its own copy of the weights."""
    block = make_block()
    rust = RustBlock.from_torch(block)
    assert list(rust.state_dict()) == list(block.state_dict())
    assert [id(p) for p in rust.parameters()] == [id(p) for p in block.parameters()]
    x, c = make_inputs(16)
    twin = copy.deepcopy(rust)
    assert twin._slot != rust._slot and twin.attn1 is not block.attn1
    assert torch.equal(twin(x, c), block(x, c))
    with torch.no_grad():
        for p in block.parameters():
            p.mul_(1.1)
    assert torch.equal(rust(x, c), block(x, c)) and not torch.equal(twin(x, c), block(x, c))
    rust.load_state_dict(make_block(seed=3).state_dict())  # through the RustBlock: the block sees it
    assert torch.equal(rust(x, c), block(x, c)) and torch.equal(block(x, c), make_block(seed=3)(x, c))


def test_from_state_dict_follows_its_tensors():
    """A RustBlock from a state_dict computes with that mapping's tensors: a tensor cast in
    place (.data =) is followed too (the same mechanism, without a module)."""
    block = make_block()
    weights = {k: v.detach().clone() for k, v in block.state_dict().items()}
    rust = RustBlock.from_state_dict(weights, dim=80, n_heads=8, d_head=10, context_dim=192)
    x, c = make_inputs(16)
    assert torch.equal(rust(x, c), block(x, c))
    for t in weights.values():
        t.data = t.data.double()
    assert torch.equal(rust(x.double(), c.double()), block.double()(x.double(), c.double()))


# ------------------------------------------------------------------------------ nn.Module conventions
@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
def test_train_and_eval_reach_the_block_it_follows(cls):
    """eval()/train() on the twin set the followed block's own flag too, not only the shared
    children's: the two never disagree about the mode."""
    block = make_block()
    rust = cls.from_torch(block)
    for mode in (True, False, True):
        rust.train(mode)
        assert block.training is rust.training is mode
        assert all(m.training is mode for m in block.modules())
    rust.eval()
    assert block.training is False


@pytest.mark.parametrize("cls", [RustBlock, CppBlock])
@pytest.mark.parametrize("inner", ["missing", None])
def test_a_twin_without_a_block_is_refused_at_construction(cls, inner):
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) needs a block: .*from_torch\(block\)"):
        cls() if inner == "missing" else cls(inner)


@pytest.mark.parametrize("convert", ["double", "to_float64", "half", "to_cpu", "float"])
def test_from_state_dict_refuses_to_convert_loudly_and_keeps_computing(convert):
    """A from_state_dict block has no parameters of its own: .to()/.double() would convert nothing
    and the next call would refuse its input. It says so at once, and nothing changed."""
    block = make_block()
    weights = {k: v.detach().clone() for k, v in block.state_dict().items()}
    rust = RustBlock.from_state_dict(weights, dim=80, n_heads=8, d_head=10, context_dim=192)
    x, c = make_inputs(16)
    before = {k: v.clone() for k, v in weights.items()}
    apply = {
        "double": lambda: rust.double(),
        "to_float64": lambda: rust.to(torch.float64),
        "half": lambda: rust.half(),
        "to_cpu": lambda: rust.to("cpu"),
        "float": lambda: rust.float(),
    }[convert]
    with pytest.raises(TypeError, match="from_state_dict computes with the tensors of its mapping"):
        apply()
    assert all(torch.equal(weights[k], before[k]) and weights[k].dtype == before[k].dtype for k in weights)
    assert torch.equal(rust(x, c), block(x, c))


def test_dtypes_are_named_as_torch_names_them():
    rust = RustBlock.from_torch(make_block())
    x, c = make_inputs(16)
    with pytest.raises(ValueError) as e:
        rust(x.double(), c)
    assert "torch.float64" in str(e.value) and "torch.float32" in str(e.value)
    assert "Double" not in str(e.value) and "Float" not in str(e.value)
