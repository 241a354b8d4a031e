"""Custom Diffusion in the Rust block, against diffusers' own processors
(``CustomDiffusionAttnProcessor2_0``: bitwise, forward and backward; ``CustomDiffusionAttnProcessor``:
baddbmm instead of SDPA, ||a - b|| / ||b|| <= 1e-5), on a block (generated configurations: which
attention, ``train_kv``, ``train_q_out``, ``out_bias``, with or without a context) and on a swapped
small UNet through diffusers' API (``set_attn_processor``, ``save_attn_procs``/``load_attn_procs``).
The crossattn trick (the first context token's key and value detached) is reproduced op for op,
so the gradients are the library's bit for bit. Generated sequences of changes after the swap
(processors set and set back, ``train_kv``/``train_q_out`` flipped, weights written in place or
replaced) are followed: each call equals an unswapped twin that went through the same changes.
What the Rust block cannot take is refused with an ``UnsupportedBlockError`` naming the cause.
"""

import copy
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples, outcome, randomize_, rel_err
from plusequals import CppBlock, RustBlock, UnsupportedBlockError, _rust, swap_transformer_blocks
from plusequals.twin.config import BlockConfig
from plusequals.twin.swap import RustTransformerBlock

pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402
from diffusers.models.attention_processor import (  # noqa: E402
    AttnProcessor2_0,
    CustomDiffusionAttnProcessor,
    CustomDiffusionAttnProcessor2_0,
)

FAST = settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLASSES = (CustomDiffusionAttnProcessor2_0, CustomDiffusionAttnProcessor)
DIM, HEADS, CROSS = 32, 4, 24


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return module


def processor(cls, name, train_kv=True, train_q_out=True, out_bias=True, seed=0, cross=CROSS):
    """diffusers' Custom Diffusion processor for ``name`` of a block of width DIM, random weights."""
    with torch.random.fork_rng():
        proc = cls(train_kv, train_q_out, DIM, None if name == "attn1" else cross, out_bias)
    return _randomize(proc, seed)


def make_block(specs, cross=CROSS, seed=0):
    """A diffusers block with ``specs``: {attn name: (class, train_kv, train_q_out, out_bias)}."""
    with torch.random.fork_rng():
        block = BasicTransformerBlock(DIM, HEADS, DIM // HEADS, cross_attention_dim=cross).eval()
    randomize_(block, seed)
    for i, (name, (cls, kv, q_out, bias)) in enumerate(sorted(specs.items())):
        getattr(block, name).set_processor(processor(cls, name, kv, q_out, bias, seed=seed + 10 + i, cross=cross))
    return block


def outputs(module, call, inputs):
    """The output, the inputs' gradients and every parameter's (by name) of a loss."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    module.zero_grad(set_to_none=True)
    y = call(module, *leaves)
    y.square().sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return y, [t.grad if t is not None else None for t in leaves], grads


def inputs(context, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, DIM, generator=g)
    return x, torch.randn(2, 7, CROSS, generator=g) if context else None


def diffusers_call(m, x, c):
    return m(x, encoder_hidden_states=c)


def rust_call(m, x, c):
    return m(x, c)


SPEC = st.tuples(st.booleans(), st.booleans(), st.booleans())  # train_kv, train_q_out, out_bias


@FAST
@given(
    cls=st.sampled_from(CLASSES),
    attn1=st.one_of(st.none(), SPEC),
    attn2=st.one_of(st.none(), SPEC),
    context=st.booleans(),
)
def test_block_forward_and_backward_match_diffusers(cls, attn1, attn2, context):
    specs = {name: (cls, *spec) for name, spec in (("attn1", attn1), ("attn2", attn2)) if spec is not None}
    cross = CROSS if context else DIM  # no context: attn2 attends to x (no detach: not a cross-attention)
    reference = make_block(specs, cross=cross)
    rust = RustBlock.from_torch(copy.deepcopy(reference))
    assert {s[1] for s in rust._config.processors if s[0] == "custom_diffusion"} == set(specs)  # in Rust
    x, c = inputs(context)
    got, expected = outputs(rust, rust_call, (x, c)), outputs(reference, diffusers_call, (x, c))
    assert got[2].keys() == expected[2].keys()
    pairs = [(got[0], expected[0]), *zip(got[1], expected[1]), *((got[2][k], expected[2][k]) for k in got[2])]
    pairs = [(a, b) for a, b in pairs if b is not None]
    assert all(a is not None for a, _ in pairs)
    if cls is CustomDiffusionAttnProcessor2_0:
        assert all(torch.equal(a, b) for a, b in pairs)
    else:
        assert max(rel_err(a, b) for a, b in pairs if b.abs().sum() > 0) <= 1e-5
    if context and "attn2" in specs:  # the crossattn trick: the first token gets no gradient through attn2
        assert torch.equal(got[1][1][:, 0], torch.zeros_like(got[1][1][:, 0])) and got[1][1][:, 1:].abs().sum() > 0


@pytest.mark.parametrize("train_kv,train_q_out", [(True, True), (True, False), (False, True)])
def test_autocast_casts_as_diffusers_does(train_kv, train_q_out):
    """Under autocast (bf16 on the CPU) the processor's casts (the states to its layers' dtype, keys and
    values to to_q's, the attention to the query's) are the same ops: bitwise the library's."""
    specs = {name: (CustomDiffusionAttnProcessor2_0, train_kv, train_q_out, True) for name in ("attn1", "attn2")}
    reference = make_block(specs)
    rust = RustBlock.from_torch(copy.deepcopy(reference))
    x, c = inputs(True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(rust(x, c), reference(x, encoder_hidden_states=c))


def test_unused_layers_and_flags_are_followed():
    """train_kv/train_q_out flipped after the reading: the processor keeps its layers, unused (as in
    diffusers), and the next call computes with the attention's own."""
    reference = make_block({"attn2": (CustomDiffusionAttnProcessor2_0, True, True, True)})
    block = copy.deepcopy(reference)
    rust = RustBlock.from_torch(block)
    x, c = inputs(True)
    for flag in ("train_kv", "train_q_out"):
        for m in (block, reference):
            setattr(m.attn2.processor, flag, False)
        with torch.no_grad():
            assert torch.equal(rust(x, c), reference(x, encoder_hidden_states=c)), flag
    assert rust._config.processors == (("custom_diffusion", "attn2", ()),)


# ------------------------------------------------------------------------------------------------
# A small UNet through diffusers' API
# ------------------------------------------------------------------------------------------------


def custom_diffusion_processors(unet, cls=CustomDiffusionAttnProcessor2_0, train_q_out=True, seed=0):
    """One processor per attention, as diffusers' tests make them (create_custom_diffusion_layers):
    the cross-attentions train k/v (and q/out), the self-attentions nothing."""
    procs = {}
    for i, name in enumerate(unet.attn_processors):
        width = unet.get_submodule(name.rsplit(".", 1)[0]).to_q.out_features
        cross = unet.config.cross_attention_dim
        with torch.random.fork_rng():
            if name.endswith("attn1.processor"):
                procs[name] = cls(train_kv=False, train_q_out=False, hidden_size=width, cross_attention_dim=None)
            else:
                procs[name] = cls(True, train_q_out, hidden_size=width, cross_attention_dim=cross)
        _randomize(procs[name], seed + i)
    return procs


def unet_outputs(unet, seed=5):
    g = torch.Generator().manual_seed(seed)
    sample, text = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g).requires_grad_()
    unet.zero_grad(set_to_none=True)
    y = unet(sample, torch.tensor([10, 700]), text).sample
    y.square().sum().backward()
    return [y, text.grad] + [p.grad for _, p in sorted(unet.named_parameters())]


def same(a, b):
    """Bitwise equal, or both None (the layers Custom Diffusion replaces get no gradient)."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("after_the_swap", [False, True])
def test_swapped_unet_with_custom_diffusion_is_bitwise(tiny_unet, after_the_swap):
    unet, reference = tiny_unet(), tiny_unet()
    if after_the_swap:
        swap_transformer_blocks(unet)
    for u in (unet, reference):
        u.set_attn_processor(custom_diffusion_processors(u))
    if not after_the_swap:
        swap_transformer_blocks(unet)
    blocks = [m for m in unet.modules() if isinstance(m, RustTransformerBlock)]
    all_on = ("train_kv", "train_q_out", "out_bias")
    expected = (("custom_diffusion", "attn1", ()), ("custom_diffusion", "attn2", all_on))  # attn1: its own layers
    assert all(b.rust_block()._config.processors == expected for b in blocks)
    got, expected = unet_outputs(unet), unet_outputs(reference)
    assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected))
    cd_grads = [p.grad for n, p in unet.named_parameters() if "custom_diffusion" in n]
    assert len(cd_grads) == 4 * 5 and all(g.abs().sum() > 0 for g in cd_grads)
    for u in (unet, reference):
        u.set_attn_processor(AttnProcessor2_0())  # back to the default: followed
    assert all(same(a, b) for a, b in zip(unet_outputs(unet), unet_outputs(reference)))


def test_load_attn_procs_round_trip_is_within_the_bound(tiny_unet, tmp_path):
    """save_attn_procs then load_attn_procs (which makes diffusers' CustomDiffusionAttnProcessor, the
    baddbmm one): the swapped UNet within 1e-5 of the library's, forward and backward."""
    source = tiny_unet()
    source.set_attn_processor(custom_diffusion_processors(source, train_q_out=False, seed=7))
    source.save_attn_procs(tmp_path, weight_name="cd.bin", safe_serialization=False)
    unet, reference = tiny_unet(), tiny_unet()
    swap_transformer_blocks(unet)
    stub = types.SimpleNamespace(components={}, hf_device_map=None)  # diffusers sets them only for a pipeline
    for u in (unet, reference):
        u.load_attn_procs(tmp_path, weight_name="cd.bin", _pipeline=stub)
    assert {type(p) for p in unet.attn_processors.values()} == {CustomDiffusionAttnProcessor}
    got, expected = unet_outputs(unet), unet_outputs(reference)
    assert [a is None for a in got] == [b is None for b in expected]
    weights = [torch.cat([t.flatten() for t in ts[2:] if t is not None]) for ts in (got, expected)]
    # each of the output, the text's gradient and the weights' gradients (together: some are ~0, cancelled)
    assert max(rel_err(got[0], expected[0]), rel_err(got[1], expected[1]), rel_err(*weights)) <= 1e-5


OPS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(CLASSES), st.integers(0, 9)),
    st.tuples(st.just("default"), st.none(), st.none()),
    st.tuples(st.just("flag"), st.sampled_from(["train_kv", "train_q_out"]), st.booleans()),
    st.tuples(st.just("write"), st.sampled_from(["to_k", "to_q", "to_out"]), st.floats(-1, 1)),
    st.tuples(st.just("replace"), st.sampled_from(["to_k", "to_v"]), st.integers(0, 9)),
)


def apply(unet, op):
    kind, what, arg = op
    if kind == "set":
        unet.set_attn_processor(custom_diffusion_processors(unet, cls=what, seed=arg))
    elif kind == "default":
        unet.set_attn_processor(AttnProcessor2_0())
    for name, proc in unet.attn_processors.items():
        if not isinstance(proc, CLASSES) or name.endswith("attn1.processor"):
            continue
        if kind == "flag":
            setattr(proc, what, arg)
        elif kind == "write":
            layer = getattr(proc, f"{what}_custom_diffusion")
            with torch.no_grad():
                (layer[0] if isinstance(layer, nn.ModuleList) else layer).weight.add_(arg)
        elif kind == "replace":
            old = getattr(proc, f"{what}_custom_diffusion")
            with torch.random.fork_rng():
                new = nn.Linear(old.in_features, old.out_features, bias=False)
            setattr(proc, f"{what}_custom_diffusion", _randomize(new, arg))


def run(unet):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        return unet(
            torch.randn(2, 4, 16, 16, generator=g), torch.tensor([10, 700]), torch.randn(2, 77, 32, generator=g)
        )


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])  # two UNets an example
@given(st.lists(OPS, min_size=1, max_size=4))
def test_changes_after_the_swap_are_followed(tiny_unet, ops):
    unet, reference = tiny_unet(), tiny_unet()
    swap_transformer_blocks(unet)
    for op in ops:
        apply(unet, op)
        apply(reference, op)
        got, expected = run(unet).sample, run(reference).sample
        if all(isinstance(p, CustomDiffusionAttnProcessor) for p in reference.attn_processors.values()):
            assert rel_err(got, expected) <= 1e-5, op
        else:
            assert torch.equal(got, expected), op


# ------------------------------------------------------------------------------------------------
# What the Rust block cannot take: refused, naming the cause
# ------------------------------------------------------------------------------------------------


def test_masks_tracing_and_the_cpp_twin_are_refused_naming_custom_diffusion():
    block = make_block({"attn2": (CustomDiffusionAttnProcessor2_0, True, True, True)})
    with pytest.raises(UnsupportedBlockError, match=r"the C\+\+ twin computes no Custom Diffusion \(attn2"):
        CppBlock.from_torch(copy.deepcopy(block))
    rust = RustBlock.from_torch(block)
    x, c = inputs(True)
    before = [p.clone() for p in rust.parameters()]
    mask = torch.zeros(2, 1, 7)
    for kw in ({"encoder_attention_mask": mask}, {"attention_mask": torch.zeros(2, 1, 16)}):
        with pytest.raises(UnsupportedBlockError, match=r"with Custom Diffusion \(attn2\): diffusers' Custom"):
            rust(x, c, **kw)
        with torch.no_grad(), pytest.raises(UnsupportedBlockError, match=r"with Custom Diffusion \(attn2\)"):
            rust.forward_owned(x, c, **kw)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(UnsupportedBlockError, match=r"Custom Diffusion \(attn2\) cannot be traced"):
        rust(torch.empty(2, 16, DIM), torch.empty(2, 7, CROSS))
    assert all(torch.equal(a, b) for a, b in zip(before, rust.parameters()))
    with torch.no_grad():  # and it runs again without them
        assert torch.equal(rust(x, c), rust.forward_owned(x, c))


def test_a_configuration_names_the_processors_rust_computes():
    """``BlockConfig.processors`` names a processor by its kind and its options that are on: the Rust
    block's list of kinds (rust/processor/mod.rs) is the one place, and an unknown kind or option, a
    second processor on one attention or an attention the block lacks is a ``ValueError`` naming it.
    The C++ twin's refusal is Rust's, worded once (``CppBlock::refusal``)."""
    base = BlockConfig(DIM, HEADS, DIM // HEADS, CROSS, True, "sdpa")
    cd = lambda attn, *on: ("custom_diffusion", attn, on)  # noqa: E731
    for processors, why in (
        ((("sliced", "attn2", ()),), r'no attention processor "sliced": this crate computes \["custom_diffusion"\]'),
        ((cd("attn2", "train_q"),), r'Custom Diffusion has no option "train_q"'),
        ((cd("attn3"),), r'custom_diffusion on "attn3"'),
        ((cd("attn1"), cd("attn1")), r"attn1 carries two processors"),
    ):
        with pytest.raises(ValueError, match=why):
            base._replace(processors=processors).keys
    keys = base._replace(processors=(cd("attn1", "train_q_out"), cd("attn2", "train_kv"))).keys
    assert [k for k in keys if "custom_diffusion" in k] == [
        "attn1.custom_diffusion.to_q.weight",
        "attn1.custom_diffusion.to_out.0.weight",
        "attn2.custom_diffusion.to_k.weight",
        "attn2.custom_diffusion.to_v.weight",
    ]
    assert _rust.Config(**base._asdict()).cpp_refusal() is None
    config = base._replace(processors=(cd("attn2"),), language="cpp")
    assert _rust.Config(**config._asdict()).cpp_refusal() == (
        "the C++ twin computes no Custom Diffusion (attn2 carries it): use the Rust block (RustBlock)"
    )


def test_what_diffusers_computes_otherwise_is_refused_naming_it():
    block = make_block({"attn2": (CustomDiffusionAttnProcessor2_0, True, True, True)})
    block.attn2.processor.train_kv = 1  # diffusers reads it as a truth value; the reading wants a bool
    with pytest.raises(UnsupportedBlockError, match=r"attn2.processor.train_kv is 1, not a bool"):
        RustBlock.from_torch(block)
    with torch.random.fork_rng():
        wide = BasicTransformerBlock(DIM, HEADS, 16, cross_attention_dim=CROSS)  # heads * d_head = 64, not 32
    wide.attn2.set_processor(CustomDiffusionAttnProcessor2_0(True, False, 64, CROSS))
    with pytest.raises(
        UnsupportedBlockError, match="diffusers' processor splits the heads by the hidden states' width"
    ):
        RustBlock.from_torch(wide)


MASKS = st.sampled_from([None, "float", "bool", "2d"])


def _mask(kind, keys):
    return {
        None: None,
        "float": torch.zeros(2, 1, keys),
        "bool": torch.ones(2, 1, keys, dtype=torch.bool),
        "2d": torch.zeros(2, keys),
    }[kind]


@FAST
@given(
    cls=st.sampled_from(CLASSES),
    context=st.booleans(),
    self_mask=MASKS,
    cross_mask=MASKS,
    owned=st.booleans(),
    swap=st.booleans(),
)
def test_whatever_diffusers_computes_runs_or_is_a_named_refusal(cls, context, self_mask, cross_mask, owned, swap):
    """Generated calls (context or none, each mask kind on either attention, owned, swapped or from_torch):
    where diffusers computes, the Rust block gives its result (bitwise for the 2_0 processor) or refuses
    with an UnsupportedBlockError naming the cause; never a TypeError or ValueError from the boundary."""
    cross = CROSS if context else DIM
    reference = make_block({"attn1": (cls, True, True, True), "attn2": (cls, True, False, True)}, cross=cross)
    x, c = inputs(context)
    m1, m2 = _mask(self_mask, 16), _mask(cross_mask, 7 if context else 16)
    kw = {"attention_mask": m1, "encoder_attention_mask": m2}
    expected = outcome(lambda: reference(x, encoder_hidden_states=c, **kw))
    block = copy.deepcopy(reference)
    if swap:
        twin = RustTransformerBlock(block, owned=owned)
        got = outcome(lambda: twin(x, encoder_hidden_states=c, **kw))
    else:
        twin = RustBlock.from_torch(block)
        got = outcome(lambda: (twin.forward_owned if owned else twin.forward)(x, c, **kw))
    if isinstance(got, torch.Tensor):
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(got, expected) if cls is CustomDiffusionAttnProcessor2_0 else rel_err(got, expected) <= 1e-5
    elif not isinstance(expected, Exception):
        assert isinstance(got, UnsupportedBlockError), repr(got)
        assert "Custom Diffusion" in str(got) or "mask" in str(got), str(got)
