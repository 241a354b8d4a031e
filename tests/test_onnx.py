"""The PyTorch block exported with torch.onnx.export and run by ONNX Runtime on the CPU
(python/plusequals/model/onnx_block.py), and the report's compiler variants and verdict.

Tolerance: fp32 on the CPU, ||a - b|| / ||b|| <= 1e-5 (the project's bar; the exported graph
measures about 3e-7 against eager at these shapes).
"""

import functools
import warnings

import numpy as np
import pytest
import torch

from conftest import CONTEXT, SHAPES, make_block, make_inputs, rel_err

ort = pytest.importorskip(
    "onnxruntime", reason="the compilers extra is not installed: pip install 'plusequals[compilers]'"
)
pytest.importorskip("onnxscript", reason="the compilers extra is not installed: pip install 'plusequals[compilers]'")

from plusequals.bench import compilers  # noqa: E402
from plusequals.bench.setup import Setup, Shape, make_setup  # noqa: E402
from plusequals.bench.variants import Variant  # noqa: E402
from plusequals.model import onnx_block as ob  # noqa: E402

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def exported(shape=SHAPES[0], attention="sdpa", with_context=True, exporter="dynamo"):
    """(block, x, context, model bytes): one export per configuration, shared by the tests."""
    tokens, dim, heads, d_head = shape
    block = make_block(dim, heads, d_head, context_dim=CONTEXT[1] if with_context else None, attention=attention)
    x, c = make_inputs(tokens, dim, context=with_context)
    return block, x, c, ob.export(block, x, c, exporter=exporter)


@pytest.mark.parametrize(
    "shape,attention,with_context",
    [(SHAPES[0], a, w) for a in ("sdpa", "einsum") for w in (True, False)] + [(s, "sdpa", True) for s in SHAPES[1:]],
    ids=lambda p: "x".join(map(str, p)) if isinstance(p, tuple) else str(p),
)
def test_onnxruntime_matches_pytorch(shape, attention, with_context):
    block, x, c, model = exported(shape, attention, with_context)
    with torch.no_grad():
        expected = block(x, c)
    runner = ob.OnnxBlock(model)
    assert runner.input_names == (["x", "context"] if with_context else ["x"])
    assert runner.session.get_providers() == ["CPUExecutionProvider"]
    got = runner(x, c)
    assert got.shape == tuple(expected.shape) and got.dtype == np.float32
    assert rel_err(torch.from_numpy(got), expected) <= TOL
    # the dynamo exporter: one ONNX op per torch op, LayerNormalization and Gelu included
    assert {"LayerNormalization", "Gelu", "Softmax", "MatMul"} <= set(runner.op_types())
    assert ("Einsum" in runner.op_types()) == (attention == "einsum")


def test_torchscript_exporter_matches_too():
    block = make_block()
    x, c = make_inputs()
    model = ob.export(block, x, c, exporter="torchscript")
    runner = ob.OnnxBlock(model)
    with torch.no_grad():
        assert rel_err(torch.from_numpy(runner(x, c)), block(x, c)) <= TOL
    assert runner.opset() == 17
    with pytest.raises(ValueError, match="exporter must be one of"):
        ob.export(block, x, c, exporter="onnxscript")


def test_an_iadd_block_exports_as_a_functional_graph():
    """``x += op(norm(x))`` exported: ONNX has no in-place ops, so the graph is op_plus_x's, and
    ORT leaves its input unchanged. The dynamo exporter traces on fake tensors and does not touch
    the example x; the legacy TorchScript tracer runs the block on it, its ``+=`` writes there, and
    the exporter warns that it removed the mutation of the block's input."""
    block = make_block()
    x0, c = make_inputs()
    with torch.no_grad():
        expected = block(x0.clone(), c)
    for exporter, writes_example in (("dynamo", False), ("torchscript", True)):
        x = x0.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = ob.export(block, x, c, residual="iadd", exporter=exporter)
        assert torch.equal(x, x0) != writes_example, exporter
        # the legacy exporter says what it did: "Removing mutation from node aten::add_ on block input"
        removed = any("Removing mutation from node aten::add_" in str(w.message) for w in caught)
        assert removed == (exporter == "torchscript"), exporter
        runner = ob.OnnxBlock(model)
        assert [o.name for o in runner.session.get_outputs()] == [ob.OUTPUT]
        xn = x0.numpy().copy()
        got = runner(xn, c)
        assert np.array_equal(xn, x0.numpy()), exporter
        assert rel_err(torch.from_numpy(got), expected) <= TOL


def test_onnxruntime_never_writes_into_its_input():
    block, x, c, model = exported()
    runner = ob.OnnxBlock(model)
    xn, cn = x.numpy().copy(), c.numpy().copy()
    binding = runner.bind(xn, cn)
    for _ in range(3):
        runner.session.run_with_iobinding(binding)
    out = binding.get_outputs()[0]
    assert out.data_ptr() != xn.ctypes.data
    assert np.array_equal(xn, x.numpy()) and np.array_equal(cn, c.numpy())
    with torch.no_grad():
        assert rel_err(torch.from_numpy(out.numpy()), block(x, c)) <= TOL
    with pytest.raises(ValueError, match="missing"):
        runner.feeds(x)


def test_memory_profile_sees_the_planners_buffer_reuse():
    """ORT's profiler, per residual Add: bytes newly allocated. Without buffer reuse every sum is
    a new allocation; the last sum is the graph output, always a new buffer for the caller."""
    block, x, c, model = exported()
    on, off = (ob.memory_profile(model, x, c, mem_reuse=r) for r in (True, False))
    assert on["available"] and off["available"]
    out_bytes = x.numel() * x.element_size()
    for prof in (on, off):
        assert [a["output_bytes"] for a in prof["residual_adds"]] == [out_bytes] * 3
        assert prof["residual_adds"][-1]["new_bytes"] >= out_bytes
        assert prof["peak_bytes"] >= 3 * out_bytes
    assert all(a["new_bytes"] >= out_bytes for a in off["residual_adds"])
    assert all(a["new_bytes"] <= b["new_bytes"] for a, b in zip(on["residual_adds"], off["residual_adds"]))


def test_onnxruntime_variant_for_the_report():
    s = make_setup(Shape(16, 80, 8, 10, 1), 2, CONTEXT, "cpu", torch.float32)
    variants, info = compilers.onnxruntime_variants(s)
    (v,) = variants
    assert isinstance(v, Variant) and v.name == "onnxruntime/cpu" and v.family == "onnxruntime" and v.reset is None
    assert "export" in v.note and "dynamo" in v.note
    v.fn()
    assert info["rel_err"]["onnxruntime/cpu"] <= TOL and info["exporter"] == "dynamo" and info["opset"] >= 18
    assert info["threads"] == torch.get_num_threads()
    assert info["peak_mb"]["onnxruntime/cpu"] > 0 and info["export_s"] > 0
    assert info["buffer"]["onnxruntime/cpu"] == {"input_deleted": False, "output_in_input_buffer": False}
    assert info["versions"]["onnxruntime"] == ort.__version__ and info["versions"]["onnxruntime_device"] == "CPU"
    with pytest.raises(ValueError, match="CPU only"):
        compilers.onnxruntime_variants(Setup(s.block, s.rust, s.x, s.context, "cuda"))


def test_verdict_from_all_compilers():
    pytest.importorskip("jax", reason="the compilers extra is not installed")
    s = make_setup(Shape(16, 80, 8, 10, 1), 2, CONTEXT, "cpu", torch.float32)
    variants, info = compilers.compiler_variants(s)
    assert [v.name for v in variants] == ["jax/jit", "jax/jit_donate", "onnxruntime/cpu"] and info["skipped"] == {}
    v = compilers.verdict(info["jax"], info["onnxruntime"])
    rows = v["rows"]
    assert set(rows) == {"jax/jit", "jax/jit_donate", "onnxruntime/cpu"}
    assert (
        rows["jax/jit"]["output_in_input_buffer"] is False
        and rows["onnxruntime/cpu"]["output_in_input_buffer"] is False
    )
    assert v["in_place"] == (["jax/jit_donate"] if rows["jax/jit_donate"]["output_in_input_buffer"] else [])
    adds = rows["onnxruntime/cpu"]["residual_adds_new_bytes"]
    assert len(adds) == 3 and ("onnxruntime/cpu" in v["reuses_buffers"]) == (adds[0] == adds[1] == 0)
    assert all(isinstance(r["peak_mb"], float) for r in rows.values())
