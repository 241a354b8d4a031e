"""What JAX does with ownership, measured: the story's moves (``+=``, a second name, donation,
training) in JAX (:func:`jax_ownership`), the alias catalogue's routes under donation
(:func:`jax_alias_routes`), and the readings they and the report's JAX rows rest on: the address
of an array's buffer (:func:`buffer_pointer`) and what XLA declares for a compiled program, its
memory plan (:func:`xla_memory`) and input/output aliasing (:func:`xla_input_output_alias`).

This module imports without JAX; its functions import it (``pip install 'plusequals[compilers]'``).
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import warnings
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Optional

import torch

from .blocks import BasicTransformerBlock, randomize_


def jax_block_module() -> ModuleType:
    """:mod:`plusequals.model.jax_block`, imported with JAX told not to take 75% of a GPU at
    start-up (``XLA_PYTHON_CLIENT_PREALLOCATE``, unless set): the report shares the GPU with torch."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return importlib.import_module("plusequals.model.jax_block")


# ----------------------------------------------------------------------------- readings
def buffer_pointer(a: Any) -> Optional[int]:
    """The address of a JAX array's buffer (``unsafe_buffer_pointer``), or None where the array or
    the JAX version does not give one."""
    try:
        return int(a.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001
        return None


def xla_memory(compiled: Any) -> dict[str, Optional[int]]:
    """XLA's plan for a compiled program: argument, output, temp and alias bytes, and the bytes a
    call needs beyond its arguments (``temp + output - alias``)."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        ma = None
    if ma is None:
        return {
            "argument_bytes": None,
            "output_bytes": None,
            "temp_bytes": None,
            "alias_bytes": None,
            "call_bytes": None,
        }
    m = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
    }
    m["call_bytes"] = m["temp_bytes"] + m["output_bytes"] - m["alias_bytes"]
    return m


def xla_input_output_alias(compiled: Any) -> Optional[list[dict]]:
    """The aliasing the compiled HLO module declares (``input_output_alias={ {}: (P, {}, may-alias) }``):
    which flat parameter each output may share its buffer with. ``None`` if the text has no such
    header (it is XLA's text format, not an API)."""
    try:
        header = compiled.as_text().split("\n", 1)[0]
    except Exception:  # noqa: BLE001
        return None
    if "input_output_alias" not in header:
        return []
    return [
        {"output": out, "parameter": int(p), "kind": kind}
        for out, p, kind in re.findall(r"\{([\d, ]*)\}: \((\d+), \{[\d, ]*\}, ([\w-]+)\)", header)
    ]


def _raises(fn: Callable[[], Any]) -> dict:
    """What calling ``fn`` (and waiting for its result) raises: the exception's class and first line."""
    try:
        r = fn()
        if hasattr(r, "block_until_ready"):
            r.block_until_ready()
    except Exception as e:  # noqa: BLE001 - the point is to record which
        return {
            "raises": type(e).__name__,
            "is_runtime_error": isinstance(e, RuntimeError),
            "message": str(e).split("\n", 1)[0][:160],
        }
    return {"raises": None}


def _rel(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------- the story's moves
def jax_ownership(
    shape: tuple[int, int, int, int] = (256, 80, 8, 10), batch: int = 2, context: tuple[int, int] = (77, 192)
) -> dict:
    """What JAX does with each of the story's moves, measured now on JAX's default CPU device,
    fp32, at a small shape (``shape``: tokens, dim, heads, head dim; default 256 x 80, 8 heads;
    the tests' shape). For the README and demo.

    * ``iadd_rebinds``: the block written with ``x += op(norm(x))`` leaves the caller's array
      unchanged, eager and under jit, and computes what ``op_plus_x`` does;
    * ``alias_sees_no_write``: ``h = x; x += a`` leaves ``h`` unchanged;
    * ``numpy_iadd_defers``: ``n += jax_array`` with a numpy ``n`` gives a new JAX array and leaves
      the numpy array unchanged;
    * ``donation``: under ``jax.jit(..., donate_argnums)``, whether the output took x's buffer,
      XLA's declared aliasing, and what each later use of the donated x (and of a second name for
      it) raises;
    * ``unusable_donation``: a donation XLA cannot use (no output of x's shape) warns and leaves
      x alive;
    * ``training``: gradients through the ``+=`` block (``jax.grad``) against PyTorch's autograd,
      and a donated forward inside ``jax.grad``;
    * ``alias_routes``: :func:`jax_alias_routes`.
    """
    jb_mod = jax_block_module()
    import jax
    import jax.numpy as jnp
    import numpy as np

    t = _twins(jb_mod, shape, batch, context)
    x, c = t.x, t.c
    before = np.array(x)
    ref = t.jb(x, c, residual="op_plus_x")
    iadd_eager = t.jb(x, c, residual="iadd")
    iadd_jit = jax.jit(lambda b, x, c: b(x, c, residual="iadd"))(t.jb, x, c)
    h = x  # a second name for the caller's array
    z = x
    z += 1.0  # rebinds z; h and x still name the old array
    n = np.zeros(4, np.float32)
    n_before = n
    n += jnp.ones(4, jnp.float32)
    donation = _donation(jb_mod, t, ref)
    unusable = _unusable_donation()
    training = _training(jb_mod, t)
    return {
        "jax": jax.__version__,
        "jaxlib": importlib.import_module("jaxlib").__version__,
        "backend": t.dev.platform,
        "shape": [batch, shape[0], shape[1]],
        "iadd_rebinds": {
            "caller_unchanged_eager": bool(np.array_equal(np.asarray(x), before)),
            "caller_unchanged_jit": bool(np.array_equal(np.asarray(x), before)) and not x.is_deleted(),
            "rel_err_vs_op_plus_x": max(_rel(iadd_eager, ref), _rel(iadd_jit, ref)),
        },
        "alias_sees_no_write": bool(np.array_equal(np.asarray(h), before)) and h is x and z is not x,
        "numpy_iadd_defers": {"numpy_unchanged": bool((n_before == 0).all()), "result_type": type(n).__name__},
        "donation": donation,
        "unusable_donation": unusable,
        "training": training,
        "alias_routes": jax_alias_routes(),
    }


def _twins(
    jb_mod: ModuleType, shape: tuple[int, int, int, int], batch: int, context: tuple[int, int]
) -> SimpleNamespace:
    """The PyTorch block and its JAX twin on JAX's CPU device, their inputs (torch ``xt``, ``ct``;
    JAX ``x``, ``c``) and the generator that made them (the training facts draw from it next)."""
    import jax

    tokens, dim, heads, d_head = shape
    dev = jax.devices("cpu")[0]
    block = randomize_(BasicTransformerBlock(dim, heads, d_head, context_dim=context[1]), 0).eval()
    g = torch.Generator().manual_seed(1)
    xt = torch.randn(batch, tokens, dim, generator=g)
    ct = torch.randn(batch, *context, generator=g)
    jb = jb_mod.BasicTransformerBlock.from_torch(block, device=dev)
    x, c = jb_mod.to_jax(xt, device=dev), jb_mod.to_jax(ct, device=dev)
    return SimpleNamespace(dev=dev, block=block, g=g, xt=xt, ct=ct, jb=jb, x=x, c=c)


def _donation(jb_mod: ModuleType, t: SimpleNamespace, ref: Any) -> dict:
    """A donated forward (a copy of x): where its output went, XLA's plan, and what each later use
    of the donated array (and of a second name for it) raises."""
    import jax.numpy as jnp
    import numpy as np

    jb, c = t.jb, t.c
    f = jb_mod.jit_forward(donate=True)
    compiled = f.lower(jb, t.x, c).compile()
    donated = jnp.copy(t.x)
    second_name = donated
    ptr = buffer_pointer(donated)
    out = f(jb, donated, c).block_until_ready()
    uses = {
        "x + 1": lambda: donated + 1,
        "np.asarray(x)": lambda: np.asarray(donated),
        "repr(x)": lambda: repr(donated),
        "x[0]": lambda: donated[0],
        "second name (y = x) * 1": lambda: second_name * 1,
        "x.block_until_ready()": lambda: donated.block_until_ready(),
        "f(block, x, context) again": lambda: f(jb, donated, c),
        "x.shape": lambda: donated.shape,
    }
    return {
        "input_deleted": bool(donated.is_deleted()),
        "second_name_deleted": bool(second_name.is_deleted()),
        "output_in_input_buffer": None if ptr is None else buffer_pointer(out) == ptr,
        "rel_err_vs_op_plus_x": _rel(out, ref),
        "xla": xla_memory(compiled) | {"input_output_alias": xla_input_output_alias(compiled)},
        "use_after_donation": {k: _raises(fn) for k, fn in uses.items()},
    }


def _unusable_donation() -> dict:
    """A donation XLA cannot use (no output of x's shape): its warnings, and x left alive."""
    import jax
    import jax.numpy as jnp

    small = jnp.ones((8, 8), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda a: a.sum(0), donate_argnums=0)(small).block_until_ready()
    return {"input_deleted": bool(small.is_deleted()), "warnings": [str(w.message).split("\n", 1)[0] for w in caught]}


def _training(jb_mod: ModuleType, t: SimpleNamespace) -> dict:
    """Gradients through the ``+=`` block under ``jax.grad`` against PyTorch's autograd of
    op_plus_x, and a donated forward inside ``jax.grad``."""
    import jax
    import jax.numpy as jnp

    jb, x, c, block = t.jb, t.x, t.c, t.block
    gy_t = torch.randn(t.xt.shape, generator=t.g)
    gy = jb_mod.to_jax(gy_t, device=t.dev)
    xg, cg = t.xt.clone().requires_grad_(True), t.ct.clone().requires_grad_(True)
    block(xg, cg).backward(gy_t)
    grad = jax.jit(jax.grad(lambda b, x, c, r: jnp.vdot(b(x, c, residual=r), gy), argnums=(0, 1)), static_argnums=3)
    gb_iadd, gx_iadd = grad(jb, x, c, "iadd")
    torch_grads = {
        "x": xg.grad,
        "attn1.to_q.weight": block.attn1.to_q.weight.grad,
        "norm1.weight": block.norm1.weight.grad,
    }
    jax_grads = {"x": gx_iadd, "attn1.to_q.weight": gb_iadd.attn1.to_q.weight, "norm1.weight": gb_iadd.norm1.weight}
    f = jb_mod.jit_forward(donate=True)
    x_train = jnp.copy(x)
    g_donated = jax.grad(lambda x: jnp.vdot(f(jb, x, c), gy))(x_train)
    return {
        # the += block under jax.grad against PyTorch's autograd of op_plus_x
        "iadd_grad_rel_err_vs_torch": {k: _rel(jax_grads[k], torch_grads[k].numpy()) for k in jax_grads},
        # a donated forward inside jax.grad: still donated, and the gradient is unchanged
        "donated_forward_under_grad": {
            "input_deleted": bool(x_train.is_deleted()),
            "grad_rel_err_vs_iadd": _rel(g_donated, gx_iadd),
        },
    }


# ----------------------------------------------------------------------------- the alias catalogue
def jax_alias_routes() -> dict:
    """The alias catalogue's routes in JAX: for each way to get a second name for ``x``, whether it
    shares x's buffer, and what it is after ``x`` is donated (``jax.jit(lambda x: x * 2 + 1,
    donate_argnums=0)``, 64 x 64 fp32 on the CPU). Plus a call that passes x twice, donated once
    (the block's ``context`` overlapping ``x``), and the two foreign-memory routes: a numpy view of
    x held while x is donated, and a JAX array made from a torch tensor by dlpack."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    step = jax.jit(lambda a: a * 2 + 1, donate_argnums=0)
    routes = {
        "copy.copy(x)": lambda x: copy.copy(x),
        "x.reshape(-1)": lambda x: x.reshape(-1),
        "x[:1]": lambda x: x[:1],
        "x.T": lambda x: x.T,
        "lax.stop_gradient(x)": lambda x: jax.lax.stop_gradient(x),
        "jnp.asarray(x)": lambda x: jnp.asarray(x),
        "y = x": lambda x: x,
    }
    out: dict[str, Any] = {}
    for name, make in routes.items():
        x = jnp.ones((64, 64), jnp.float32)
        alias = make(x)
        shares = buffer_pointer(alias) == buffer_pointer(x)
        step(x).block_until_ready()
        out[name] = {
            "shares_buffer": shares,
            "x_deleted": bool(x.is_deleted()),
            "after_donation": _raises(lambda: np.asarray(alias)),
        }
    out["np.asarray(x) held"] = _numpy_view_held(step)
    out["context is x"] = _passed_twice_donated_once()
    out["dlpack from torch"] = _dlpack_from_torch(step)
    return out


def _numpy_view_held(step: Callable[[Any], Any]) -> dict:
    """A numpy view of x (np.asarray shares the CPU buffer, read-only) held across the donation."""
    import jax.numpy as jnp
    import numpy as np

    x = jnp.ones((64, 64), jnp.float32)
    view = np.asarray(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = step(x).block_until_ready()
    return {
        "shares_buffer": view.ctypes.data == buffer_pointer(x),
        "view_writeable": bool(view.flags.writeable),
        "x_deleted": bool(x.is_deleted()),
        "output_in_x_buffer": buffer_pointer(r) == view.ctypes.data,
        "view_unchanged": bool((view == 1).all()),
        "warnings": [str(w.message).split("\n", 1)[0] for w in caught],
    }


def _passed_twice_donated_once() -> dict:
    """The same array as x and as context in one call, x donated: ``f(donate(x), x)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.ones((64, 64), jnp.float32)
    refused = _raises(lambda: jax.jit(lambda a, b: a * 2 + b, donate_argnums=0)(x, x))
    return {
        "x_deleted": bool(x.is_deleted()),
        "call": refused,
        "x_usable": _raises(lambda: np.asarray(x)) == {"raises": None},
    }


def _dlpack_from_torch(step: Callable[[Any], Any]) -> dict:
    """A JAX array on a torch tensor's memory (dlpack), donated."""
    import jax.numpy as jnp

    t = torch.ones(64, 64)
    j = jnp.from_dlpack(t)
    shares = buffer_pointer(j) == t.data_ptr()
    r = step(j).block_until_ready()
    return {
        "shares_buffer": shares,
        "x_deleted": bool(j.is_deleted()),
        "output_in_torch_buffer": buffer_pointer(r) == t.data_ptr(),
        "torch_unchanged": bool((t == 1).all()),
    }
