"""The JAX twin (python/plusequals/model/jax_block.py) against the PyTorch block, and what JAX does with
the story's moves: ``x += y`` rebinds, and donation deletes the caller's array.

Tolerance: fp32 on the CPU, ||a - b|| / ||b|| <= 1e-5 (the project's bar). fp32 only: nothing here
touches JAX's x64 flag or any other process-wide setting.
"""

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import BATCH, CONTEXT, SHAPES, make_block, make_inputs, rel_err

jax = pytest.importorskip("jax", reason="the compilers extra is not installed: pip install 'plusequals[compilers]'")
jnp = jax.numpy

from plusequals.bench import compilers  # noqa: E402
from plusequals.bench.setup import Shape, make_setup  # noqa: E402
from plusequals.bench.variants import Variant  # noqa: E402
from plusequals.model import jax_block as jb  # noqa: E402
from plusequals.model.jax_ownership import jax_alias_routes, jax_ownership, xla_input_output_alias, xla_memory  # noqa: E402

TOL = 1e-5


def to_torch(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def jax_inputs(x, c):
    return jb.to_jax(x), None if c is None else jb.to_jax(c)


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
@pytest.mark.parametrize("with_context", [True, False], ids=["context", "self"])
@pytest.mark.parametrize("tokens,dim,heads,d_head", SHAPES)
def test_jit_matches_pytorch(tokens, dim, heads, d_head, with_context, attention):
    block = make_block(dim, heads, d_head, context_dim=CONTEXT[1] if with_context else None, attention=attention)
    x, c = make_inputs(tokens, dim, context=with_context)
    with torch.no_grad():
        expected = block(x, c)
    twin = jb.BasicTransformerBlock.from_torch(block)
    jx, jc = jax_inputs(x, c)
    got = jb.jit_forward()(twin, jx, jc)
    assert got.shape == (BATCH, tokens, dim) and got.dtype == jnp.float32
    assert rel_err(to_torch(got), expected) <= TOL


@pytest.mark.parametrize("attention", ["sdpa", "einsum"])
@pytest.mark.parametrize("with_context", [True, False], ids=["context", "self"])
def test_eager_and_donated_match_pytorch(with_context, attention):
    """Op by op (no jit), and under jit with x donated, at the first shape."""
    block = make_block(context_dim=CONTEXT[1] if with_context else None, attention=attention)
    x, c = make_inputs(context=with_context)
    with torch.no_grad():
        expected = block(x, c)
    twin = jb.BasicTransformerBlock.from_torch(block)
    jx, jc = jax_inputs(x, c)
    assert rel_err(to_torch(twin(jx, jc)), expected) <= TOL
    assert rel_err(to_torch(jb.jit_forward(donate=True)(twin, jnp.copy(jx), jc)), expected) <= TOL


def test_twin_has_the_compvis_modules_and_copies_the_weights():
    block = make_block()
    twin = jb.BasicTransformerBlock.from_torch(block)
    sd = block.state_dict()
    # the same module path for every CompVis key
    assert isinstance(twin.ff.net[0], jb.GEGLU) and isinstance(twin.attn1.to_out[1], jb.Dropout)
    assert np.array_equal(np.asarray(twin.attn1.to_out[0].weight), sd["attn1.to_out.0.weight"].numpy())
    assert np.array_equal(np.asarray(twin.ff.net[0].proj.bias), sd["ff.net.0.proj.bias"].numpy())
    assert np.array_equal(np.asarray(twin.norm3.weight), sd["norm3.weight"].numpy())
    assert twin.attention == "sdpa" and twin.attn2.scale == block.attn2.scale
    # a copy: changing the PyTorch weights afterwards does not reach the twin
    before = np.array(twin.attn1.to_q.weight)
    with torch.no_grad():
        block.attn1.to_q.weight.add_(1.0)
    assert np.array_equal(np.asarray(twin.attn1.to_q.weight), before)


def test_non_gated_feed_forward_and_compvis_reference():
    from conftest import randomize_
    from support import compvis_reference

    x, c = make_inputs()
    block = make_block(gated_ff=False)
    assert "ff.net.0.0.weight" in block.state_dict()
    with torch.no_grad():
        assert (
            rel_err(
                to_torch(jb.jit_forward()(jb.BasicTransformerBlock.from_torch(block), *jax_inputs(x, c))), block(x, c)
            )
            <= TOL
        )
    ref = randomize_(compvis_reference.BasicTransformerBlock(80, 8, 10, context_dim=CONTEXT[1]), seed=3).eval()
    twin = jb.BasicTransformerBlock.from_state_dict(ref.state_dict(), n_heads=8, d_head=10)
    with torch.no_grad():
        assert rel_err(to_torch(jb.jit_forward()(twin, *jax_inputs(x, c))), ref(x, c)) <= TOL


@pytest.mark.parametrize("key", ["attn1.to_q.weight", "ff.net.2.bias", "norm3.weight"])
def test_missing_extra_misshaped_weights(key):
    sd = make_block().state_dict()
    kw = dict(n_heads=8, d_head=10)
    with pytest.raises(ValueError, match=f"missing weight .*{key}"):
        jb.BasicTransformerBlock.from_state_dict({k: v for k, v in sd.items() if k != key}, **kw)
    with pytest.raises(ValueError, match="unexpected weight .*attn3.to_q.weight"):
        jb.BasicTransformerBlock.from_state_dict({**sd, "attn3.to_q.weight": sd[key]}, **kw)
    bad = {**sd, key: torch.zeros(*sd[key].shape[:-1], sd[key].shape[-1] + 1)}
    with pytest.raises(ValueError, match=f"weight .*{key}.* has shape"):
        jb.BasicTransformerBlock.from_state_dict(bad, **kw)
    with pytest.raises(ValueError, match="attention must be one of"):
        jb.BasicTransformerBlock.from_state_dict(sd, attention="flash", **kw)
    with pytest.raises(ValueError, match="residual must be one of"):
        jb.BasicTransformerBlock.from_state_dict(sd, residual="copy_iadd", **kw)


# ---------------------------------------------------------------------------- ownership
def test_iadd_rebinds_and_leaves_the_callers_array_unchanged():
    """The 2022 lines, ``x += op(norm(x))``, in JAX: each ``+=`` makes a new array. The caller's
    array (and a second name for it) keep their values, eager and under jit, and the result is
    op_plus_x's."""
    block = make_block()
    twin = jb.BasicTransformerBlock.from_torch(block)
    jx, jc = jax_inputs(*make_inputs())
    skip = jx  # the UNet's skip connection: a second name for x
    before = np.array(jx)
    expected = twin(jx, jc, residual="op_plus_x")
    eager = twin(jx, jc, residual="iadd")
    jitted = jax.jit(lambda b, x, c: b(x, c, residual="iadd"))(twin, jx, jc)
    assert not hasattr(jax.Array, "__iadd__")
    assert np.array_equal(np.asarray(jx), before) and np.array_equal(np.asarray(skip), before)
    assert rel_err(to_torch(eager), to_torch(expected)) <= TOL
    assert rel_err(to_torch(jitted), to_torch(expected)) <= TOL
    # the same per block rather than per call
    twin_iadd = jb.BasicTransformerBlock.from_torch(block, residual="iadd")
    assert rel_err(to_torch(twin_iadd(jx, jc)), to_torch(expected)) <= TOL
    assert np.array_equal(np.asarray(jx), before)


def module_param(tree, key: str):
    """The JAX twin's array at a CompVis key: ``attn1.to_out.0.weight`` is
    ``tree.attn1.to_out[0].weight``, as in PyTorch."""
    for part in key.split("."):
        tree = tree[int(part)] if part.isdigit() else getattr(tree, part)
    return tree


def test_the_iadd_block_trains_like_pytorch():
    """What broke textual inversion in PyTorch is a plain sum in JAX: jax.grad through the ``+=``
    block gives PyTorch's op_plus_x gradients for x, the context and every CompVis parameter."""
    block = make_block()
    x, c = make_inputs()
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    xg, cg = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
    block(xg, cg).backward(grad_out)
    expected = {"x": xg.grad, "context": cg.grad, **{k: p.grad for k, p in block.named_parameters()}}
    twin = jb.BasicTransformerBlock.from_torch(block)
    gy = jb.to_jax(grad_out)
    loss = lambda b, x, c: jnp.vdot(b(x, c, residual="iadd"), gy)  # noqa: E731
    gb, gx, gc = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(twin, *jax_inputs(x, c))
    got = {"x": gx, "context": gc, **{k: module_param(gb, k) for k, _ in block.named_parameters()}}
    assert len(got) == 2 + len(list(block.parameters()))
    for k in expected:
        assert rel_err(to_torch(got[k]), expected[k]) <= TOL, k


def test_a_donated_forward_under_grad_still_donates_and_differentiates():
    twin = jb.BasicTransformerBlock.from_torch(make_block())
    jx, jc = jax_inputs(*make_inputs())
    f = jb.jit_forward(donate=True)
    expected = jax.grad(lambda x: jb.jit_forward()(twin, x, jc).sum())(jx)
    x = jnp.copy(jx)
    got = jax.grad(lambda x: f(twin, x, jc).sum())(x)
    assert x.is_deleted()
    assert rel_err(to_torch(got), to_torch(expected)) <= TOL


def test_alias_routes_under_donation():
    """JAX's copies (copy.copy, reshape, slices, transposes) are new buffers and outlive a donation;
    the routes that return the same array (a second name, jnp.asarray, stop_gradient) are deleted
    with it. Passing x twice with one of them donated is refused at the call and leaves x alive. A
    numpy view held on x makes JAX skip the donation (x stays alive, no warning); a JAX
    array on a torch tensor's memory (dlpack) is deleted by donation, but XLA does not write into
    the torch tensor."""
    routes = jax_alias_routes()
    for name in ("copy.copy(x)", "x.reshape(-1)", "x[:1]", "x.T"):
        assert routes[name]["x_deleted"] and not routes[name]["shares_buffer"], name
        assert routes[name]["after_donation"] == {"raises": None}, name
    for name in ("y = x", "jnp.asarray(x)", "lax.stop_gradient(x)"):
        r = routes[name]
        assert r["x_deleted"] and r["shares_buffer"], name
        assert r["after_donation"]["raises"] == "RuntimeError" and "deleted" in r["after_donation"]["message"], name
    view = routes["np.asarray(x) held"]
    assert view["shares_buffer"] and not view["view_writeable"]
    assert not view["x_deleted"] and not view["output_in_x_buffer"] and view["view_unchanged"]
    same = routes["context is x"]  # f(donate(x), x): refused, and x is left alive
    assert (
        same["call"]["raises"] is not None and same["call"]["is_runtime_error"] and "donated" in same["call"]["message"]
    )
    assert not same["x_deleted"] and same["x_usable"]
    dl = routes["dlpack from torch"]
    assert dl["shares_buffer"] and dl["x_deleted"] and not dl["output_in_torch_buffer"] and dl["torch_unchanged"]


def test_numpy_iadd_with_a_jax_operand_rebinds_too():
    """``n += jax_array`` with a numpy ``n``: numpy defers to JAX, and its array is not written."""
    n = np.zeros(4, np.float32)
    keep = n
    n += jnp.ones(4, jnp.float32)
    assert isinstance(n, jax.Array) and not isinstance(keep, jax.Array)
    assert (keep == 0).all() and (np.asarray(n) == 1).all()


def test_donation_reuses_the_buffer_where_xla_aliases_it_and_the_donated_array_raises():
    twin = jb.BasicTransformerBlock.from_torch(make_block())
    jx, jc = jax_inputs(*make_inputs())
    f = jb.jit_forward(donate=True)
    compiled = f.lower(twin, jx, jc).compile()
    mem = xla_memory(compiled)
    x = jnp.copy(jx)
    also_x = x
    ptr = x.unsafe_buffer_pointer()
    out = f(twin, x, jc).block_until_ready()
    assert x.is_deleted() and also_x.is_deleted()
    # What XLA declared and what happened agree (on the CPU with jax 0.10: the output takes x's buffer).
    assert mem["alias_bytes"] in (0, x.nbytes)
    assert (out.unsafe_buffer_pointer() == ptr) == (mem["alias_bytes"] == x.nbytes)
    aliases = xla_input_output_alias(compiled)
    if aliases is not None and mem["alias_bytes"]:
        assert [a["parameter"] for a in aliases] == [len(jax.tree_util.tree_leaves(twin))]  # x, after the weights
    # Every use of the donated array raises, under either name; its metadata stays readable.
    for use in (lambda: x + 1, lambda: np.asarray(x), lambda: repr(x), lambda: x[0], lambda: also_x * 2):
        with pytest.raises(RuntimeError, match="deleted"):
            use()
    with pytest.raises((RuntimeError, ValueError), match="deleted"):
        f(twin, x, jc)
    assert x.shape == jx.shape
    # and the caller's other arrays are untouched: plain jit never deletes or writes its input
    before = np.array(jx)
    y = jb.jit_forward()(twin, jx, jc)
    assert not jx.is_deleted() and np.array_equal(np.asarray(jx), before)
    assert y.unsafe_buffer_pointer() != jx.unsafe_buffer_pointer()


def test_an_unusable_donation_warns_and_keeps_the_array():
    x = jnp.ones((8, 8), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda a: a.sum(0), donate_argnums=0)(x).block_until_ready()
    assert any("donated buffers were not usable" in str(w.message) for w in caught)
    assert not x.is_deleted() and float(x.sum()) == 64.0


def test_jax_ownership_facts():
    facts = jax_ownership()
    assert facts["jax"] == jax.__version__ and facts["backend"] == "cpu"
    assert facts["iadd_rebinds"]["caller_unchanged_eager"] and facts["iadd_rebinds"]["caller_unchanged_jit"]
    assert facts["iadd_rebinds"]["rel_err_vs_op_plus_x"] <= TOL
    assert facts["alias_sees_no_write"]
    assert facts["numpy_iadd_defers"] == {"numpy_unchanged": True, "result_type": "ArrayImpl"}
    d = facts["donation"]
    assert d["input_deleted"] and d["second_name_deleted"] and d["rel_err_vs_op_plus_x"] <= TOL
    assert d["output_in_input_buffer"] == (d["xla"]["alias_bytes"] > 0)
    uses = d["use_after_donation"]
    assert uses["x.shape"] == {"raises": None}
    for k in (
        "x + 1",
        "np.asarray(x)",
        "repr(x)",
        "x[0]",
        "second name (y = x) * 1",
        "x.block_until_ready()",
        "f(block, x, context) again",
    ):
        assert uses[k]["raises"] is not None and "delete" in uses[k]["message"], k
    assert uses["x + 1"]["raises"] == "RuntimeError"
    assert facts["unusable_donation"]["input_deleted"] is False
    assert any("not usable" in w for w in facts["unusable_donation"]["warnings"])
    t = facts["training"]
    assert max(t["iadd_grad_rel_err_vs_torch"].values()) <= TOL
    assert (
        t["donated_forward_under_grad"]["input_deleted"]
        and t["donated_forward_under_grad"]["grad_rel_err_vs_iadd"] <= TOL
    )
    assert facts["alias_routes"]["y = x"]["x_deleted"]


# ---------------------------------------------------------------------------- report variants
def test_jax_variants_for_the_report():
    shape = Shape(16, 80, 8, 10, 1)
    s = make_setup(shape, 2, CONTEXT, "cpu", torch.float32)
    variants, info = compilers.jax_variants(s)
    assert [v.name for v in variants] == ["jax/jit", "jax/jit_donate"]
    assert all(isinstance(v, Variant) and v.family == "jax" and v.per_call == 1 for v in variants)
    plain, donated = variants
    assert plain.reset is None and donated.reset is not None
    assert "subtracted" in donated.note and "jnp.copy" in donated.note and "compile" in plain.note
    for v in variants:
        out = v.fn()
        assert out.shape == tuple(s.x.shape) and out.dtype == jnp.float32
        assert info["rel_err"][v.name] <= TOL
        assert info["peak_mb"][v.name] > 0 and info["compile_s"][v.name] > 0
    donated.reset()
    assert info["buffer"]["jax/jit"] == {"input_deleted": False, "output_in_input_buffer": False}
    assert info["buffer"]["jax/jit_donate"]["input_deleted"] is True
    assert info["buffer"]["jax/jit_donate"]["output_in_input_buffer"] == (
        info["xla"]["jax/jit_donate"]["alias_bytes"] > 0
    )
    assert info["versions"]["jax"] == jax.__version__ and info["versions"]["jax_backend"] == "cpu"
    v = compilers.verdict(info)
    assert set(v["rows"]) == {"jax/jit", "jax/jit_donate"}
    assert ("jax/jit_donate" in v["in_place"]) == bool(info["buffer"]["jax/jit_donate"]["output_in_input_buffer"])
    assert "jax/jit" not in v["in_place"]


def test_compilers_imports_without_the_extra():
    """plusequals.bench.compilers imports when jax and onnxruntime cannot be imported; the builders then
    raise an ImportError that names the extra."""
    code = """
import sys
for name in ('jax', 'jaxlib', 'onnxruntime', 'onnx', 'onnxscript'):
    sys.modules[name] = None  # as if not installed: import raises ImportError, find_spec gives None
import torch
from plusequals.bench import compilers
from plusequals.bench.setup import Shape, make_setup
assert compilers.available() == {'jax': False, 'onnxruntime': False}, compilers.available()
v = compilers.versions()
assert v['jax'] is None and v['onnxruntime'] is None
s = make_setup(Shape(4, 80, 8, 10, 1), 1, (77, 192), 'cpu', torch.float32)
variants, info = compilers.compiler_variants(s)
assert variants == [] and set(info['skipped']) == {'jax', 'onnxruntime'}, info
for build in (compilers.jax_variants, compilers.onnxruntime_variants):
    try:
        build(s)
    except ImportError as e:
        assert 'plusequals[compilers]' in str(e), e
    else:
        raise AssertionError('no ImportError')
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
