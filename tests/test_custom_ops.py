"""The Rust block as torch.library custom ops (python/plusequals/twin/ops.py): what torch.compile,
torch.export and FakeTensor see.

* ``torch.library.opcheck`` passes for ``plusequals::block_forward`` (with gradients, under an
  autocast dtype, the C++ twin), ``block_forward_owned_`` (its mutation of ``x`` declared) and
  ``block_backward``: schema, fake (meta) implementation, autograd registration, AOT dispatch.
* FakeTensor shape propagation: a RustBlock under FakeTensorMode, and on the meta device.
* ``torch.compile(fullgraph=True)`` of a swapped diffusers UNet: 0 graph breaks (counted by
  ``torch._dynamo.explain``), one graph, and the compiled output is bitwise the eager one.
  The UNet is compiled with the ``aot_eager`` backend (dynamo, AOT autograd, functionalization
  of the in-place op; inductor's code generation for the whole UNet takes a minute on 2 cores);
  inductor itself compiles a RustBlock, forward and backward.
* Gradients through the op (backward recomputes the Rust forward under autograd) are bitwise
  those of the eager RustBlock, whose graph libtorch records directly.
* ``torch.export`` (strict and not) of a RustBlock and of a swapped UNet, and a save/load round trip.
* A compiled model follows its module too: new weights reach the op as inputs; a change the Rust
  block cannot reproduce fails the recompilation with the cause named.

Every test resets dynamo before and after (its caches are process-wide).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from conftest import make_block, make_inputs, rel_err
from plusequals import CppBlock, RustBlock, UnsupportedBlockError
from plusequals.bench.timing import intra_op_threads
from plusequals.twin import ops
from support.boundary import CTX, D_HEAD, DIM, HEADS, small_block, small_inputs


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def op_args(rust: RustBlock, x, context, autocast=None, requires_grad=False):
    weights = [w.detach().clone().requires_grad_(requires_grad) for w in rust._weights]
    return (x, context, weights, *rust._config.op_fields, rust._slot, autocast)


def ops_in(graph_module) -> list:
    return [str(n.target) for n in graph_module.graph.nodes if str(n.target).startswith("plusequals.")]


# ============================================================================ the ops themselves


def test_opcheck():
    rust = RustBlock.from_torch(small_block())
    x, c = small_inputs()
    torch.library.opcheck(
        ops.block_forward,
        op_args(rust, x.clone().requires_grad_(True), c.clone().requires_grad_(True), requires_grad=True),
    )
    torch.library.opcheck(ops.block_forward, op_args(rust, x.bfloat16(), c.bfloat16(), autocast=torch.bfloat16))
    torch.library.opcheck(ops.block_forward_owned_, op_args(rust, x.clone(), c))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(ops.block_backward, (grad,) + op_args(rust, x, c)[:10] + (None, True, True, [True] * 20))
    torch.library.opcheck(
        ops.block_backward, (grad,) + op_args(rust, x, c)[:10] + (None, False, True, [False, True] * 10)
    )
    self_attention = CppBlock.from_torch(small_block(context_dim=None))
    torch.library.opcheck(
        ops.block_forward, op_args(self_attention, x.clone().requires_grad_(True), None, requires_grad=True)
    )


def test_backward_through_the_op_is_bitwise_the_eager_gradient():
    """The op's backward (the Rust forward again, under autograd) against the eager RustBlock,
    whose graph libtorch records as it runs: the same bits, for x, context and every weight."""
    block = make_block()
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(16)
    weights = [w.detach().clone().requires_grad_(True) for w in rust._weights]
    xo, co = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
    y = ops.block_forward(xo, co, weights, *rust._config.op_fields, rust._slot, None)
    y.square().sum().backward()
    xe, ce = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
    ye = rust(xe, ce)
    ye.square().sum().backward()
    assert torch.equal(y, ye) and torch.equal(xo.grad, xe.grad) and torch.equal(co.grad, ce.grad)
    assert all(torch.equal(w.grad, p.grad) for w, p in zip(weights, rust._weights))


def test_fake_tensor_shape_propagation():
    block = small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        y = rust(mode.from_tensor(x), mode.from_tensor(c))
        assert isinstance(y, FakeTensor) and y.shape == x.shape and y.dtype == x.dtype
        y = rust(torch.empty(3, 7, DIM), torch.empty(3, 2, CTX))  # new shapes, made under the mode
        assert isinstance(y, FakeTensor) and y.shape == (3, 7, DIM)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert rust(torch.empty(3, 7, DIM, dtype=torch.bfloat16), torch.empty(3, 2, CTX)).dtype == torch.bfloat16
        with pytest.raises(ValueError, match="context"):
            rust(torch.empty(3, 7, DIM), torch.empty(3, 2, CTX + 1))
    # the op on the meta device: its fake implementation
    meta = ops.block_forward(*op_args(rust, x.to("meta"), c.to("meta")))
    assert meta.device.type == "meta" and meta.shape == x.shape


# ============================================================================ torch.compile


def swapped_unet(tiny_unet, owned=False):
    from plusequals import swap_transformer_blocks
    from support.unet import run, unet_inputs

    unet = tiny_unet()
    inputs = unet_inputs()
    with torch.no_grad():
        eager_torch = run(unet, inputs)
    swap_transformer_blocks(unet, owned=owned)
    return unet, inputs, eager_torch


def test_swapped_unet_compiles_fullgraph_with_zero_graph_breaks(tiny_unet):
    unet, inputs, eager_torch = swapped_unet(tiny_unet)
    with torch.no_grad():
        eager = unet(*inputs).sample
        explained = torch._dynamo.explain(unet)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    assert ops_in(explained.graphs[0]).count("plusequals.block_forward.default") == 4
    assert torch.equal(eager, eager_torch)  # diffusers' default processor: the same ops as Rust
    torch._dynamo.reset()
    compiled = torch.compile(unet, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(*inputs).sample, eager)


def test_swapped_unet_with_forward_owned_compiles(tiny_unet):
    """owned=True: the in-place op (its mutation declared) inside the compiled UNet."""
    unet, inputs, eager_torch = swapped_unet(tiny_unet, owned=True)
    compiled = torch.compile(unet, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(*inputs).sample, eager_torch)


def test_inductor_compiles_a_rust_block_forward_and_backward():
    block = make_block()
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(16)
    compiled = torch.compile(rust, fullgraph=True)  # inductor
    with torch.no_grad():
        assert torch.equal(compiled(x, c), block(x, c))
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    compiled(xc, c).square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    rust(xe, c).square().sum().backward()
    assert torch.equal(xc.grad, xe.grad)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, block.parameters()))


def test_compiled_unet_training_matches_eager(tiny_unet):
    """Training through the compiled swapped UNet, at one intra-op thread, two, and the
    default: the output and every parameter's gradient are bitwise the eager ones.

    One thread is the case that needs care: libtorch runs a 1x1 conv with batch < 16 in THNN
    there (mkldnn from two threads on), and THNN's bias gradient sums the output gradient in
    memory order. ``block_backward`` returns x's gradient in the incoming gradient's layout, as
    the eager block does; a contiguous copy would reach each Transformer2DModel's ``proj_in``
    channels-last after the ``permute``, and the four ``proj_in.bias`` gradients would differ by up
    to 1.4e-9 (relative 1.1e-7) at one thread.

    The encoder states' gradient is within 1e-6 (measured 6.7e-8 at one thread, 7.3e-8 at two):
    the eight cross-attention contributions (to_k, to_v in four blocks) are bitwise the same,
    but eager autograd adds them one by one while each opaque ``block_backward`` returns its
    block's to_k + to_v, which the compiled graph then adds: ((k1 + v1) + k2) + v2 ... against
    (k1 + v1) + (k2 + v2) ... The plain diffusers UNet compiled matches bitwise there too."""
    unet, (sample, t, context), _ = swapped_unet(tiny_unet)
    compiled = torch.compile(unet, fullgraph=True, backend="aot_eager")

    def grads(model):
        unet.zero_grad(set_to_none=True)
        ctx = context.clone().requires_grad_(True)
        out = model(sample, t, ctx).sample
        out.square().mean().backward()
        return out, ctx.grad, [(name, p.grad) for name, p in unet.named_parameters()]

    for threads in sorted({1, 2, torch.get_num_threads()}):
        with intra_op_threads(threads):
            (out_e, ctx_e, params_e), (out_c, ctx_c, params_c) = grads(unet), grads(compiled)
        assert torch.equal(out_c, out_e), threads
        assert [n for (n, a), (_, b) in zip(params_c, params_e) if not torch.equal(a, b)] == [], threads
        assert rel_err(ctx_c, ctx_e) <= 1e-6, threads


def test_block_backward_keeps_the_gradients_layout():
    """x's gradient comes back laid out as the incoming gradient (here transposed), bitwise the
    eager RustBlock's, whose residual adds carry that layout through; the fake implementation
    says the same strides. (A contiguous copy changed the layout the ops before the block see.)"""
    rust = RustBlock.from_torch(small_block())
    x, c = small_inputs()
    grad = torch.randn(x.shape[0], x.shape[2], x.shape[1], generator=torch.Generator().manual_seed(3)).transpose(1, 2)
    args = (grad,) + op_args(rust, x, c)[:10] + (None, True, True, [True] * 20)
    torch.library.opcheck(ops.block_backward, args)
    gx = ops.block_backward(*args)[0]
    xl = x.clone().requires_grad_(True)
    (eager,) = torch.autograd.grad(rust(xl, c), xl, grad)
    assert gx.stride() == eager.stride() == grad.stride() != x.stride() and torch.equal(gx, eager)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ops.block_backward(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])[0]
    assert fake.stride() == grad.stride()


def test_compile_under_autocast():
    block = make_block()
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(16)
    compiled = torch.compile(rust, fullgraph=True, backend="aot_eager")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = block(x, c)
        for xin in (x, x.bfloat16()):
            got, eager = compiled(xin, c), rust(xin, c)
            assert got.dtype == eager.dtype == block(xin, c).dtype and torch.equal(got, eager), xin.dtype
        assert rel_err(compiled(x, c), expected) <= 2**-8  # the autocast bound of tests/test_autocast.py


def test_compiled_block_follows_its_module():
    block = make_block()
    rust = RustBlock.from_torch(block)
    compiled = torch.compile(rust, fullgraph=True, backend="aot_eager")
    x, c = make_inputs(16)
    with torch.no_grad():
        assert torch.equal(compiled(x, c), block(x, c))
        block.load_state_dict(make_block(seed=4).state_dict(), assign=True)
        assert torch.equal(compiled(x, c), block(x, c))
        block.double()
        assert torch.equal(compiled(x.double(), c.double()), block(x.double(), c.double()))
        block.float()
        block.norm2.eps = 1e-3  # the recompilation reads the block again, and refuses
        with pytest.raises(Exception, match="norm2 has eps=0.001") as info:
            compiled(x, c)
        assert isinstance(info.value, (UnsupportedBlockError, RuntimeError))
        block.norm2.eps = 1e-5
        assert torch.equal(compiled(x, c), block(x, c))


# ============================================================================ torch.export


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_rust_block(strict):
    block = small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs()
    exported = torch.export.export(rust, (x, c), strict=strict)
    assert ops_in(exported.graph_module) == ["plusequals.block_forward.default"]
    assert torch.equal(exported.module()(x, c), block(x, c))
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    assert torch.equal(loaded.module()(x, c), block(x, c))
    assert rust._weights is not None and not any(isinstance(w, FakeTensor) for w in rust._weights)


def test_export_swapped_unet(tiny_unet):
    unet, inputs, eager_torch = swapped_unet(tiny_unet)
    exported = torch.export.export(unet, inputs)
    assert ops_in(exported.graph_module).count("plusequals.block_forward.default") == 4
    with torch.no_grad():
        assert torch.equal(exported.module()(*inputs).sample, eager_torch)


def test_raw_rust_block_cannot_be_traced_and_says_why():
    from types import SimpleNamespace

    rust = RustBlock.from_torch(small_block())
    raw = RustBlock(SimpleNamespace(forward=rust._block.forward), rust._device)
    x, c = small_inputs()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(RuntimeError, match="raw Rust block"):
        raw(mode.from_tensor(x), mode.from_tensor(c))
    assert (DIM, HEADS, D_HEAD) == (16, 2, 8)
