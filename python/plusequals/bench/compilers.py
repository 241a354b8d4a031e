"""The thread's compilers beside torch.compile: XLA through JAX (``jax.jit``, with and without
buffer donation) and ONNX Runtime (the PyTorch block exported with ``torch.onnx.export``).

Each builder returns :class:`.variants.Variant` objects like the other families' (a zero-argument
callable doing one synchronous forward, a note saying what its time includes, a ``reset`` timed in
the same round and subtracted where the variant consumes its input) and a dict of what the runtime
itself reports: compile or export seconds, the relative error against eager, peak memory, and
whether the output landed in the input's buffer. :func:`verdict` turns those into the report's
verdict data.

This module imports with neither JAX nor ONNX Runtime installed; a builder raises ``ImportError``
naming the extra (``pip install 'plusequals[compilers]'``) when it is called without them.

Peak memory here is what a call needs beyond its inputs and weights, as each runtime reports it
(:func:`.setup.peak_memory_mb` reads torch's CUDA allocator, which sees neither runtime):

* JAX: XLA's plan for the compiled program, ``temp + output - alias`` bytes from
  ``Compiled.memory_analysis()`` (any backend; a plan, not a measurement of the allocator).
* ONNX Runtime: the CPU arena's peak bytes in use during one run above what was in use before it,
  from ORT's profiler (:func:`plusequals.model.onnx_block.memory_profile`).
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any, Optional

import torch

from ..model.jax_ownership import buffer_pointer, jax_block_module, xla_input_output_alias, xla_memory
from .inductor import CALLER, REUSED
from .setup import Setup
from .variants import Variant

JAX_NAMES = ("jax/jit", "jax/jit_donate")
ORT_NAME = "onnxruntime/cpu"
EXTRA = "pip install 'plusequals[compilers]'"
# Relative error against eager op_plus_x above which a builder refuses (fp16 on CUDA included).
MAX_REL_ERR = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


# ----------------------------------------------------------------------------- imports, versions
def _jax_block():
    try:
        return jax_block_module()
    except ImportError as e:
        raise ImportError(f"the JAX variants need jax and jaxlib: {EXTRA} ({e})") from e


def _onnx_block():
    try:
        importlib.import_module("onnx")
        importlib.import_module("onnxscript")
        return importlib.import_module("plusequals.model.onnx_block")
    except ImportError as e:
        raise ImportError(f"the ONNX Runtime variant needs onnx, onnxscript and onnxruntime: {EXTRA} ({e})") from e


def _version(module: str) -> Optional[str]:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def available() -> dict[str, bool]:
    """Which of the two runtimes can be imported (without importing them)."""
    from importlib.util import find_spec

    def found(name: str) -> bool:
        try:
            return find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    return {
        "jax": found("jax") and found("jaxlib"),
        "onnxruntime": all(found(m) for m in ("onnxruntime", "onnx", "onnxscript")),
    }


def versions() -> dict[str, Any]:
    """The versions and devices of the compilers, for results.json; ``None`` where a package is
    missing. Importing JAX here starts its backends (``XLA_PYTHON_CLIENT_PREALLOCATE`` defaults
    to false first)."""
    out: dict[str, Any] = {"torch": torch.__version__}
    have = available()
    if have["jax"]:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax
        import jaxlib

        out |= {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "jax_backend": jax.default_backend(),
            "jax_devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()],
        }
    else:
        out |= {"jax": None, "jaxlib": None, "jax_backend": None, "jax_devices": None}
    if have["onnxruntime"]:
        import onnxruntime as ort

        out |= {
            "onnxruntime": ort.__version__,
            "onnxruntime_device": ort.get_device(),
            "onnxruntime_providers": ort.get_available_providers(),
            "onnx": _version("onnx"),
            "onnxscript": _version("onnxscript"),
        }
    else:
        out |= {
            "onnxruntime": None,
            "onnxruntime_device": None,
            "onnxruntime_providers": None,
            "onnx": None,
            "onnxscript": None,
        }
    return out


# ----------------------------------------------------------------------------- JAX
def jax_device(device: str):
    """The JAX device for the report's ``device`` ("cpu" or "cuda")."""
    import jax

    platform = {"cpu": "cpu", "cuda": "gpu"}.get(device)
    if platform is None:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    try:
        return jax.devices(platform)[0]
    except RuntimeError as e:
        raise RuntimeError(
            f"JAX has no {platform} backend here (jax {jax.__version__}, backends: {jax.default_backend()}): {e}"
        ) from e


def jax_variants(s: Setup, residual: str = "op_plus_x") -> tuple[list[Variant], dict]:
    """``jax/jit`` and ``jax/jit_donate`` for one setup (the block, x and context of
    ``setup.make_setup``, on ``s.device``, in the setup's dtype).

    Returns (variants, info): info has ``compile_s`` per variant (the first call: trace, compile
    and one run), ``rel_err`` against eager, ``peak_mb`` per variant (XLA's plan, see the module
    doc), ``xla`` (memory analysis and the declared input/output aliasing) and ``buffer`` (whether
    the output came back in x's buffer, by ``unsafe_buffer_pointer``, and whether the donated x
    was deleted)."""
    jb_mod = _jax_block()
    import jax.numpy as jnp

    dev = jax_device(s.device)
    jb = jb_mod.BasicTransformerBlock.from_torch(s.block, residual=residual, device=dev)
    jx = jb_mod.to_jax(s.x, device=dev)
    jc = jb_mod.to_jax(s.context, device=dev)
    with torch.no_grad():
        expected = s.block(s.x, s.context, residual="op_plus_x")

    info: dict[str, Any] = {
        "versions": versions(),
        "compile_s": {},
        "rel_err": {},
        "peak_mb": {},
        "xla": {},
        "buffer": {},
    }
    variants = []
    for name, donate in (("jax/jit", False), ("jax/jit_donate", True)):
        f = jb_mod.jit_forward(donate=donate)
        fresh = jnp.copy(jx).block_until_ready()
        ptr = buffer_pointer(fresh)
        t0 = time.perf_counter()
        out = f(jb, fresh, jc).block_until_ready()  # the first call traces, compiles and runs
        info["compile_s"][name] = time.perf_counter() - t0
        compiled = f.lower(jb, jx, jc).compile()  # the same program, for XLA's memory plan
        info["buffer"][name] = {
            "input_deleted": bool(fresh.is_deleted()),
            "output_in_input_buffer": None if ptr is None else buffer_pointer(out) == ptr,
        }
        info["rel_err"][name] = _rel_err(out, expected)
        mem = xla_memory(compiled)
        info["xla"][name] = mem | {"input_output_alias": xla_input_output_alias(compiled)}
        info["peak_mb"][name] = None if mem["call_bytes"] is None else mem["call_bytes"] / 2**20
        del fresh, out
        if info["rel_err"][name] > MAX_REL_ERR.get(s.x.dtype, 1e-5):
            raise AssertionError(f"{name}: relative error {info['rel_err'][name]:.3g} against eager op_plus_x")
        if donate:
            fn = lambda f=f: f(jb, jnp.copy(jx), jc).block_until_ready()  # noqa: E731
            note = (
                f"one jax.jit forward (XLA) of {residual} with x donated (donate_argnums): the output may take x's "
                "buffer; "
                "x is re-created by jnp.copy each call, which is timed in the same round and subtracted; "
                "block_until_ready makes it synchronous; compile time is not included (compile_s)"
            )
            variants.append(Variant(name, "jax", fn, note, reset=lambda: jnp.copy(jx).block_until_ready()))
        else:
            fn = lambda f=f: f(jb, jx, jc).block_until_ready()  # noqa: E731
            note = (
                f"one jax.jit forward (XLA) of {residual}, output in a new buffer; block_until_ready makes it "
                "synchronous; compile time is not included (compile_s)"
            )
            variants.append(Variant(name, "jax", fn, note))
    info["device"] = str(dev)
    info["residual"] = residual
    return variants, info


def _rel_err(out: Any, expected: torch.Tensor) -> float:
    import numpy as np

    a = torch.from_numpy(np.asarray(out).astype("float64"))
    b = expected.detach().to("cpu", torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- ONNX Runtime
def onnxruntime_variants(s: Setup, exporter: str = "dynamo") -> tuple[list[Variant], dict]:
    """``onnxruntime/cpu`` for one setup: the block exported by ``torch.onnx.export`` (static
    shapes) and run by ONNX Runtime's CPUExecutionProvider with torch's thread count. CPU only:
    the GPU image's onnxruntime is the CPU build, and a GPU build is too large to carry.

    Returns (variants, info): ``export_s``, ``session_s``, the exporter, opset and op types,
    ``rel_err`` against eager, ``peak_mb`` (ORT's profiler), ``memory`` (per residual Add, the
    bytes newly allocated, with ORT's buffer reuse on and off) and ``buffer`` (the output is never
    in x's buffer: ORT does not write into graph inputs)."""
    if s.device != "cpu":
        raise ValueError(
            "the ONNX Runtime variant runs on the CPU only (this onnxruntime is the CPU build); got device "
            f"{s.device!r}"
        )
    ob_mod = _onnx_block()
    t0 = time.perf_counter()
    model = ob_mod.export(s.block, s.x, s.context, residual="op_plus_x", exporter=exporter)
    export_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ob = ob_mod.OnnxBlock(model)
    session_s = time.perf_counter() - t0
    xn, cn = ob_mod._numpy(s.x), ob_mod._numpy(s.context)
    binding = ob.bind(xn, cn)
    ob.session.run_with_iobinding(binding)
    out = binding.get_outputs()[0]
    with torch.no_grad():
        expected = s.block(s.x, s.context, residual="op_plus_x")
    rel = _rel_err(out.numpy(), expected)
    if rel > MAX_REL_ERR.get(s.x.dtype, 1e-5):
        raise AssertionError(f"{ORT_NAME}: relative error {rel:.3g} against eager op_plus_x")
    buffer = {"input_deleted": False, "output_in_input_buffer": out.data_ptr() == xn.ctypes.data}
    memory = {reuse: ob_mod.memory_profile(model, xn, cn, mem_reuse=reuse) for reuse in (True, False)}
    peak = memory[True].get("peak_bytes")
    info = {
        "versions": versions(),
        "exporter": exporter,
        "opset": ob.opset(),
        "op_types": ob.op_types(),
        "threads": ob.session.get_session_options().intra_op_num_threads,
        "export_s": export_s,
        "session_s": session_s,
        "rel_err": {ORT_NAME: rel},
        "peak_mb": {ORT_NAME: None if peak is None else peak / 2**20},
        "memory": {"mem_reuse_on": memory[True], "mem_reuse_off": memory[False]},
        "buffer": {ORT_NAME: buffer},
    }
    del out
    note = (
        f"one ONNX Runtime CPU run of the exported op_plus_x ({exporter} exporter, opset {info['opset']}, "
        f"{info['threads']} threads): inputs bound once in place (no copy), output allocated by ORT each run; "
        "export and session creation are not included (export_s, session_s)"
    )
    run = ob.session.run_with_iobinding
    return [Variant(ORT_NAME, "onnxruntime", lambda: run(binding), note)], info


# ----------------------------------------------------------------------------- all of them
def compiler_variants(s: Setup) -> tuple[list[Variant], dict]:
    """Every compiler variant that can run here: JAX where it is installed (on ``s.device``), ONNX
    Runtime where it is installed and ``s.device`` is the CPU. info maps each family to its builder's
    info, and ``skipped`` to the reasons for what did not run."""
    have = available()
    variants: list[Variant] = []
    info: dict[str, Any] = {"skipped": {}}
    if have["jax"]:
        v, info["jax"] = jax_variants(s)
        variants += v
    else:
        info["skipped"]["jax"] = f"jax is not installed ({EXTRA})"
    if not have["onnxruntime"]:
        info["skipped"]["onnxruntime"] = f"onnxruntime, onnx or onnxscript is not installed ({EXTRA})"
    elif s.device != "cpu":
        info["skipped"]["onnxruntime"] = "CPU only: the GPU image's onnxruntime is the CPU build"
    else:
        v, info["onnxruntime"] = onnxruntime_variants(s)
        variants += v
    return variants, info


def verdict(jax_info: Optional[dict] = None, ort_info: Optional[dict] = None, inductor: Optional[dict] = None) -> dict:
    """Which compiler turns ``x = op(norm(x)) + x`` into an in-place add, as data.

    Per variant: ``output_in_input_buffer`` (measured: the block's result came back in the
    caller's x buffer, i.e. the last residual sum was written over x), ``residual_adds_new_bytes``
    (ORT: bytes each residual Add newly allocated; 0 means the sum went into a buffer the plan
    already held), ``peak_mb`` (see the module doc) and, for donation, ``saved_mb`` against plain
    jit. ``inductor``: :func:`.inductor.residual_destination` per torch.compile variant, read from
    the code Inductor generated (``residual_destination``: the caller's x, a buffer it reused, or a
    new one). ``in_place`` lists the variants whose output took x's buffer; ``reuses_buffers`` the
    ones whose residual sums (except the returned one) allocated nothing new, or (Inductor) whose
    last sum went into a buffer it reused."""
    rows: dict[str, dict] = {}
    if jax_info:
        for name in JAX_NAMES:
            rows[name] = {
                "output_in_input_buffer": jax_info["buffer"][name]["output_in_input_buffer"],
                "input_deleted": jax_info["buffer"][name]["input_deleted"],
                "alias_bytes": jax_info["xla"][name]["alias_bytes"],
                "peak_mb": jax_info["peak_mb"][name],
                "residual_adds_new_bytes": None,  # XLA reports its plan as a whole, not per op
                "evidence": "unsafe_buffer_pointer; Compiled.memory_analysis",
            }
        a, b = rows["jax/jit"]["peak_mb"], rows["jax/jit_donate"]["peak_mb"]
        rows["jax/jit_donate"]["saved_mb"] = None if a is None or b is None else a - b
        if rows["jax/jit_donate"]["output_in_input_buffer"] is None and rows["jax/jit_donate"]["alias_bytes"]:
            rows["jax/jit_donate"]["output_in_input_buffer"] = True  # the pointer is gone with x; XLA's alias says so
    if ort_info:
        on = ort_info["memory"]["mem_reuse_on"]
        adds = [a["new_bytes"] for a in on.get("residual_adds", [])] if on.get("available") else None
        rows[ORT_NAME] = {
            "output_in_input_buffer": ort_info["buffer"][ORT_NAME]["output_in_input_buffer"],
            "input_deleted": False,
            "alias_bytes": None,
            "peak_mb": ort_info["peak_mb"][ORT_NAME],
            "residual_adds_new_bytes": adds,
            "residual_adds_new_bytes_without_reuse": [
                a["new_bytes"] for a in ort_info["memory"]["mem_reuse_off"].get("residual_adds", [])
            ]
            or None,
            "evidence": "OrtValue.data_ptr; ORT profiler arena statistics",
        }
    for name, r in (inductor or {}).items():
        rows[name] = {
            "output_in_input_buffer": r["destination"] == CALLER,
            "input_deleted": False,
            "alias_bytes": None,
            "peak_mb": None,
            "residual_adds_new_bytes": None,  # Inductor's plan is its code: read, not profiled
            "residual_destination": r["destination"],
            "returned": r["returned"],
            "defined": r["defined"],
            "kernel": r["kernel"],
            "fused_adds": r["fused_adds"],
            "evidence": "torch._inductor.utils.run_and_get_code: the wrapper's returned buffer and its add kernel",
        }
    return {
        "rows": rows,
        "in_place": sorted(n for n, r in rows.items() if r["output_in_input_buffer"]),
        "reuses_buffers": sorted(
            n
            for n, r in rows.items()
            if (r.get("residual_adds_new_bytes") and all(b == 0 for b in r["residual_adds_new_bytes"][:-1]))
            or r.get("residual_destination") == REUSED
        ),
    }
