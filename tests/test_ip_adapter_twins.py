"""IP-Adapter in the three blocks: the PyTorch block (``plusequals.model.blocks``, the
oracle), the Rust block (``rust/block.rs``, ``forward_ip``) and the C++ twin (``cpp/block.cpp``)
agree bit for bit on the same weights, forward and backward, in generated configurations (adapters,
scales, 0 included, image tokens, batch, a cross-attention mask). Against diffusers'
``IPAdapterAttnProcessor2_0``: the C++ twin (``CppBlock.from_torch``) is bitwise too, and a tensor
``encoder_hidden_states`` (diffusers' deprecated form) is computed as diffusers computes it. In
generated calls of a diffusers IP-Adapter block (tuple or tensor context, adapters, masks, ``owned``, the swap's
block, ``RustBlock`` or ``CppBlock``),
whatever diffusers computes, the Rust block computes bitwise or refuses with an
``UnsupportedBlockError`` naming the cause: never a ``TypeError`` or ``ValueError`` from the boundary.
"""

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples, outcome, randomize_
from plusequals import BasicTransformerBlock, CppBlock, RustBlock, UnsupportedBlockError, _rust

diffusers = pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
from diffusers.models.attention import BasicTransformerBlock as DiffusersBlock  # noqa: E402
from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0  # noqa: E402

FAST = settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
DIM, HEADS, CROSS = 32, 4, 24


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def grads_of(y, tensors):
    y.square().sum().backward()
    return [y] + [t.grad for t in tensors]


@FAST
@given(
    scales=st.lists(st.sampled_from([0.0, 0.5, 1.3]), min_size=1, max_size=3),
    tokens=st.integers(1, 5),
    batch=st.integers(1, 2),
    masked=st.booleans(),
    seed=st.integers(0, 99),
)
def test_pytorch_rust_and_cpp_blocks_agree_bitwise(scales, tokens, batch, masked, seed):
    with torch.random.fork_rng():
        block = BasicTransformerBlock(DIM, HEADS, DIM // HEADS, context_dim=CROSS, ip_adapter=scales)
    randomize_(block.eval(), seed)
    weights = dict(block.state_dict())
    assert sum(k.startswith("attn2.ip.") for k in weights) == 2 * len(scales)
    g = torch.Generator().manual_seed(seed)
    x, c = torch.randn(batch, 16, DIM, generator=g), torch.randn(batch, 7, CROSS, generator=g)
    images = [torch.randn(batch, tokens, CROSS, generator=g) for _ in scales]
    mask = (torch.rand(batch, 1, 7, generator=g) > 0.3).float().sub(1).mul(10000) if masked else None
    results = {}
    for name in ("torch", "rust", "cpp"):
        ins = leaves(x, c, *images)
        params = [p.detach().clone().requires_grad_() for p in weights.values()]
        if name == "torch":
            block.zero_grad(set_to_none=True)
            y = block(ins[0], ins[1], encoder_attention_mask=mask, ip_adapter=ins[2:])
            params = list(block.parameters())  # state_dict's order
        else:
            config = _rust.Config(
                dim=DIM, n_heads=HEADS, d_head=DIM // HEADS, context_dim=CROSS, ip_adapter=scales, language=name
            )
            twin = _rust.Block(dict(zip(weights, params)), config)
            y = twin.forward(ins[0], ins[1], None, None, mask, ins[2:])
        results[name] = grads_of(y, ins + params)
    expected = results["torch"]
    for name in ("rust", "cpp"):
        got = results[name]
        assert len(got) == len(expected)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, expected)), name
    skipped = [i for i, s in enumerate(scales) if s == 0.0]  # diffusers skips a 0 scale: no gradient
    assert all(results["rust"][3 + i] is None for i in skipped)


def diffusers_block(n_adapters, seed=0, tokens=4):
    with torch.random.fork_rng():
        block = DiffusersBlock(DIM, HEADS, DIM // HEADS, cross_attention_dim=CROSS).eval()
        proc = IPAdapterAttnProcessor2_0(DIM, CROSS, num_tokens=(tokens,) * n_adapters, scale=[0.8] * n_adapters)
    block.attn2.set_processor(proc)
    return randomize_(block, seed)


def test_cpp_twin_and_the_tensor_context_match_diffusers_bitwise():
    """CppBlock and RustBlock made from a diffusers IP-Adapter block, called with a tensor context (diffusers'
    deprecated form: its last num_tokens tokens are the image's): bitwise the library's, not a ValueError
    ("carries 0 image embeddings")."""
    reference = diffusers_block(1)
    g = torch.Generator().manual_seed(4)
    x, c = torch.randn(2, 16, DIM, generator=g), torch.randn(2, 7 + 4, CROSS, generator=g)
    for cls in (RustBlock, CppBlock):
        twin = cls.from_torch(copy.deepcopy(reference))
        ins, ref_ins = leaves(x, c), leaves(x, c)
        got = grads_of(twin(*ins), ins + list(twin.parameters()))
        with pytest.warns(FutureWarning, match="encoder_hidden_states"):
            y = reference(ref_ins[0], encoder_hidden_states=ref_ins[1])
        expected = grads_of(y, ref_ins + list(reference.parameters()))
        reference.zero_grad(set_to_none=True)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, expected)), cls
        with torch.no_grad():  # forward_owned: the same sums, on a copy
            assert torch.equal(twin.forward_owned(x, c), got[0])


CONTEXTS = st.sampled_from(["tuple", "tuple_short", "tensor", "none"])
MASKS = st.sampled_from([None, "float", "bool", "2d"])


def call_args(kind, n_adapters, mask, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, text = torch.randn(batch, 16, DIM, generator=g), torch.randn(batch, 7, CROSS, generator=g)
    images = [torch.randn(batch, 4, CROSS, generator=g) for _ in range(n_adapters)]
    context = {
        "tuple": (text, images),
        "tuple_short": (text, images[:-1]),
        "tensor": torch.cat([text, images[0]], dim=1),
        "none": None,
    }[kind]
    keys = 7 + 4 * (kind == "tensor")
    masks = {
        None: None,
        "float": torch.zeros(batch, 1, keys),
        "bool": torch.ones(batch, 1, keys, dtype=torch.bool),
        "2d": torch.zeros(batch, keys),
    }
    return x, context, masks[mask]


@FAST
@given(
    kind=CONTEXTS,
    n_adapters=st.integers(1, 2),
    mask=MASKS,
    owned=st.booleans(),
    twin_kind=st.sampled_from(["swap", "rust", "cpp"]),
)
def test_whatever_diffusers_computes_runs_bitwise_or_is_a_named_refusal(kind, n_adapters, mask, owned, twin_kind):
    from plusequals.twin.swap import RustTransformerBlock

    reference = diffusers_block(n_adapters)
    x, context, m = call_args(kind, n_adapters, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # diffusers' deprecated tensor form
        expected = outcome(lambda: reference(x, encoder_hidden_states=context, encoder_attention_mask=m))
        block = copy.deepcopy(reference)
        if twin_kind == "swap":
            twin = RustTransformerBlock(block, owned=owned)
            got = outcome(lambda: twin(x, encoder_hidden_states=context, encoder_attention_mask=m))
        else:
            twin = (RustBlock if twin_kind == "rust" else CppBlock).from_torch(block)
            call = twin.forward_owned if owned else twin.forward
            got = outcome(lambda: call(x, context, encoder_attention_mask=m))
    if isinstance(got, torch.Tensor):
        assert isinstance(expected, torch.Tensor) and torch.equal(got, expected)
    elif not isinstance(expected, Exception):  # diffusers computes it: a refusal must name its cause
        assert isinstance(got, UnsupportedBlockError), repr(got)
