"""The Rust twin against the PyTorch block, and every residual strategy against the original.

Tolerance: fp32 on the CPU, relative error ||a - b|| / ||b|| <= 1e-5 (the project's bar).
"""

import pytest
import torch

from conftest import BATCH, CONTEXT, SHAPES, cuda, make_block, make_inputs, rel_err
from plusequals import BasicTransformerBlock, RustBlock
from plusequals.model.blocks import STRATEGIES
from support import compvis_reference

TOL = 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
@pytest.mark.parametrize("with_context", [True, False], ids=["context", "self"])
@pytest.mark.parametrize("tokens,dim,heads,d_head", SHAPES)
def test_rust_matches_pytorch(tokens, dim, heads, d_head, with_context, attention):
    block = make_block(dim, heads, d_head, context_dim=CONTEXT[1] if with_context else None, attention=attention)
    x, c = make_inputs(tokens, dim, context=with_context)
    rust = RustBlock.from_torch(block)
    with torch.no_grad():
        expected = block(x, c)
        x_before = x.clone()
        got = rust.forward(x, c)
        got_owned = rust.forward_owned(x, c)
    assert got.shape == expected.shape == (BATCH, tokens, dim)
    assert rel_err(got, expected) <= TOL
    assert rel_err(got_owned, expected) <= TOL
    assert torch.equal(x, x_before), "forward/forward_owned(donate=False) mutated the caller's x"


def test_rust_forward_owned_donate(block, rust):
    x, c = make_inputs()
    with torch.no_grad():
        expected = block(x, c)
        ptr = x.data_ptr()
        got = rust.forward_owned(x, c, donate=True)
    assert rel_err(got, expected) <= TOL
    assert got.data_ptr() == ptr, "donate=True should reuse the caller's buffer"


def test_einsum_and_sdpa_agree():
    x, c = make_inputs()
    a, b = make_block(attention="einsum"), make_block(attention="sdpa")
    with torch.no_grad():
        assert rel_err(a(x, c), b(x, c)) <= TOL


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_every_strategy_equals_op_plus_x_in_inference(strategy, attention):
    block = make_block(attention=attention)
    x, c = make_inputs()
    with torch.no_grad():
        expected = block(x.clone(), c, residual="op_plus_x")
        got = block(x.clone(), c, residual=strategy)
        # and selected per block rather than per call
        block.residual = strategy
        got_block = block(x.clone(), c)
    assert torch.equal(got, expected) or rel_err(got, expected) <= TOL
    assert rel_err(got_block, expected) <= TOL


def test_unknown_strategy_is_rejected(block):
    with pytest.raises(ValueError, match="residual must be one of"):
        block(*make_inputs(), residual="inplace")
    with pytest.raises(ValueError, match="residual must be one of"):
        BasicTransformerBlock(64, 4, 16, residual="nope")


def test_gradients_match_pytorch(block, rust):
    """Gradients through RustBlock.forward (an autograd graph built by libtorch from Rust, returned
    through pyo3-tch) equal PyTorch's for the input, the context and every parameter."""
    x0, c0 = make_inputs()
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7))

    def grads(fn):
        block.zero_grad(set_to_none=True)
        x, c = x0.clone().requires_grad_(True), c0.clone().requires_grad_(True)
        y = fn(x, c)
        assert y.requires_grad and y.grad_fn is not None
        y.backward(grad_out)
        return {"x": x.grad, "context": c.grad, **{n: p.grad.clone() for n, p in block.named_parameters()}}

    expected = grads(lambda x, c: block(x, c))
    got = grads(lambda x, c: rust.forward(x, c))
    assert set(got) == set(expected) and len(got) == 2 + len(list(block.parameters()))
    for name in expected:
        assert got[name] is not None, name
        assert rel_err(got[name], expected[name]) <= TOL, name


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
def test_independent_compvis_state_dict_loads_strictly(attention):
    """A state_dict from a separately written CompVis-style module loads with strict=True, into the
    PyTorch block and from there into Rust, and all three compute the same function."""
    from conftest import randomize_

    ref = randomize_(compvis_reference.BasicTransformerBlock(80, 8, 10, context_dim=CONTEXT[1]), seed=3).eval()
    ours = BasicTransformerBlock(80, 8, 10, context_dim=CONTEXT[1], attention=attention)
    result = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert "attn1.to_out.0.weight" in ref.state_dict() and "ff.net.0.proj.weight" in ref.state_dict()
    rust = RustBlock.from_state_dict(
        ref.state_dict(), dim=80, n_heads=8, d_head=10, context_dim=CONTEXT[1], attention=attention
    )
    x, c = make_inputs()
    with torch.no_grad():
        expected = ref(x, c)
        assert rel_err(ours(x, c), expected) <= TOL
        assert rel_err(rust.forward(x, c), expected) <= TOL


def test_non_gated_feed_forward():
    block = make_block(gated_ff=False)
    assert "ff.net.0.0.weight" in block.state_dict()
    x, c = make_inputs()
    with torch.no_grad():
        assert rel_err(RustBlock.from_torch(block).forward(x, c), block(x, c)) <= TOL


def test_checkpoint_forward_matches(block):
    x, c = make_inputs()
    ckpt = make_block(checkpoint=True)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y1, y2 = block(x1, c), ckpt(x2, c)
    assert rel_err(y2, y1) <= TOL
    y1.sum().backward()
    y2.sum().backward()
    assert rel_err(x2.grad, x1.grad) <= TOL


@pytest.mark.parametrize("key", ["attn1.to_q.weight", "ff.net.2.bias", "norm3.weight"])
def test_missing_extra_misshaped_weights(block, key):
    params = dict(block.named_parameters())
    kw = dict(dim=80, n_heads=8, d_head=10, context_dim=CONTEXT[1])
    missing = {k: v for k, v in params.items() if k != key}
    with pytest.raises(ValueError, match=f"missing weight .*{key}"):
        RustBlock.from_state_dict(missing, **kw)
    with pytest.raises(ValueError, match="unexpected weight .*attn3.to_q.weight"):
        RustBlock.from_state_dict({**params, "attn3.to_q.weight": params[key]}, **kw)
    bad = {**params, key: torch.zeros(*params[key].shape[:-1], params[key].shape[-1] + 1)}
    with pytest.raises(ValueError, match=f"weight .*{key}.* has shape"):
        RustBlock.from_state_dict(bad, **kw)


# ---------------------------------------------------------------------------- CUDA, fp16
# fp16 tolerance 2e-3 relative: both sides call the same cuBLAS and SDPA kernels, but libtorch
# may pick different algorithms (workspace, split-K) between calls, and each fp16 rounding is
# worth up to 2^-11 ~ 4.9e-4 of a value; a residual chain of ~10 such ops stays within 2e-3.
FP16_TOL = 2e-3


@cuda
@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
@pytest.mark.parametrize(
    "tokens,dim,heads,d_head", [(4096, 320, 8, 40), (1024, 640, 8, 80), (256, 1280, 8, 160), (64, 1280, 8, 160)]
)
def test_cuda_fp16_parity(tokens, dim, heads, d_head, attention):
    block = make_block(dim, heads, d_head, context_dim=768, attention=attention).to("cuda", torch.float16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, tokens, dim, generator=g).to("cuda", torch.float16)
    c = torch.randn(2, 77, 768, generator=g).to("cuda", torch.float16)
    rust = RustBlock.from_torch(block)
    with torch.no_grad():
        expected = block(x, c)
        assert rel_err(rust.forward(x, c), expected) <= FP16_TOL
        assert rel_err(rust.forward_owned(x, c), expected) <= FP16_TOL


@cuda
def test_cuda_gradients():
    block = make_block().to("cuda")
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(device="cuda")
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    block(x1, c).square().sum().backward()
    rust.forward(x2, c).square().sum().backward()
    assert rel_err(x2.grad, x1.grad) <= 1e-4  # TF32 may be used by cuBLAS for fp32 on Hopper


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_rust_forward_under_torch_checkpoint(block, rust, use_reentrant):
    """torch.utils.checkpoint around the Rust call: the non-reentrant kind stops its recomputation
    by raising from a saved-tensor hook inside a libtorch op, which must cross the Rust frames."""
    from torch.utils.checkpoint import checkpoint

    x, c = make_inputs()
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    checkpoint(block, x1, c, use_reentrant=use_reentrant).square().sum().backward()
    checkpoint(rust.forward, x2, c, use_reentrant=use_reentrant).square().sum().backward()
    assert rel_err(x2.grad, x1.grad) <= TOL


def test_pack_hook_exceptions_cross_the_rust_call_with_their_type(rust):
    """tch turns an exception raised by a Python saved-tensor hook inside a libtorch op into
    RuntimeError('Internal torch error'); RustBlock.forward hands it back with its own type."""

    class Boom(Exception):
        pass

    def pack(t):
        raise Boom("from the pack hook")

    x, c = make_inputs()
    x.requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p):
        with pytest.raises(Boom, match="from the pack hook"):
            rust.forward(x, c)
    # hooks that do not raise still see every saved tensor, and backward unpacks through them
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda p: p):
        y = rust.forward(x, c)
    y.square().sum().backward()
    assert packed and x.grad is not None
