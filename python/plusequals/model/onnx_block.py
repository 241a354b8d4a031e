"""The PyTorch block exported to ONNX (``torch.onnx.export``) and run by ONNX Runtime on the CPU.

Two exporters, both offline:

* ``"dynamo"`` (the default, and torch's default since 2.9): ``torch.export`` traces the block
  on fake tensors, functionalises it and onnxscript translates it (opset 18+; LayerNormalization
  and Gelu are single ONNX ops). A block whose residuals are ``+=`` exports as the same functional
  graph, and the example input is not touched.
* ``"torchscript"`` (``dynamo=False``, deprecated by torch): the legacy tracer runs the block on
  the real example inputs. For the ``+=`` strategies that run writes into the example ``x``
  (``tests/test_onnx.py`` records it); the exported graph is functional all the same.

ONNX has no in-place ops and ONNX Runtime never writes into a graph input: its allocation planner
may reuse the buffer of an intermediate that is dead, but the caller's ``x`` is always read-only.
What the planner did is visible in ORT's profiler (per node: bytes newly allocated, arena bytes
in use and the peak), which :func:`memory_profile` reads.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
import warnings
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

try:
    import onnxruntime as ort
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "plusequals.model.onnx_block needs onnx, onnxscript and onnxruntime: install the optional extra, "
        "pip install 'plusequals[compilers]'"
    ) from e

EXPORTERS = ("dynamo", "torchscript")
INPUTS = ("x", "context")
OUTPUT = "out"


class _Forward(nn.Module):
    """``block(x, context, residual=...)`` as a module with plain tensor arguments (what the
    exporters take)."""

    def __init__(self, block: nn.Module, residual: Optional[str]) -> None:
        super().__init__()
        self.block = block
        self.residual = residual

    def forward(self, x: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.block(x, context, residual=self.residual)


def export(
    block: nn.Module,
    x: torch.Tensor,
    context: Optional[torch.Tensor] = None,
    *,
    residual: Optional[str] = None,
    exporter: str = "dynamo",
    opset: Optional[int] = None,
) -> bytes:
    """The block as a serialized ONNX model with static shapes (those of ``x`` and ``context``),
    inputs ``x`` (and ``context`` when given) and output ``out``.

    ``exporter="torchscript"`` runs the block on ``x`` and ``context`` themselves: pass copies if
    the block writes into its input (``residual="iadd"`` and the other ``+=`` strategies)."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
    module = _Forward(block, residual).eval()
    args = (x,) if context is None else (x, context)
    names = list(INPUTS[: len(args)])
    with warnings.catch_warnings():
        # torch's deprecation notes for the legacy exporter and pytree, printed on every export
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        if exporter == "dynamo":
            # its registry logs one warning per torchvision op it cannot find: noise here
            registry = logging.getLogger("torch.onnx._internal.exporter._registration")
            level = registry.level
            registry.setLevel(logging.ERROR)
            try:
                program = torch.onnx.export(
                    module,
                    args,
                    dynamo=True,
                    input_names=names,
                    output_names=[OUTPUT],
                    opset_version=opset,
                    verbose=False,
                )
            finally:
                registry.setLevel(level)
            return program.model_proto.SerializeToString()
        buf = io.BytesIO()
        torch.onnx.export(
            module, args, buf, dynamo=False, input_names=names, output_names=[OUTPUT], opset_version=opset or 17
        )
        return buf.getvalue()


def session_options(
    threads: Optional[int] = None,
    *,
    mem_reuse: bool = True,
    mem_pattern: bool = True,
    profile_prefix: Optional[str] = None,
) -> "ort.SessionOptions":
    """ORT session options: ``threads`` intra-op threads (default: torch's, so that the report
    compares like with like), ORT's own defaults otherwise."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads() if threads is None else threads
    so.inter_op_num_threads = 1
    so.enable_mem_reuse = mem_reuse
    so.enable_mem_pattern = mem_pattern
    so.log_severity_level = 3  # errors only (the optimizer warns about saving optimized models)
    # ORT's pool threads spin after each run by default; on a small CPU that spin steals the cores
    # from whatever runs next (the report interleaves variants), so they sleep instead.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


class OnnxBlock:
    """An ONNX Runtime CPU session on an exported block.

    ``block(x, context)`` takes torch tensors or numpy arrays and returns a numpy array. ``bind``
    gives the zero-copy path the benchmark times: inputs bound once from their own memory,
    the output allocated by ORT on every run."""

    def __init__(self, model: bytes, options: Optional["ort.SessionOptions"] = None) -> None:
        self.model = model
        self.session = ort.InferenceSession(model, options or session_options(), providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]

    @classmethod
    def from_torch(
        cls,
        block: nn.Module,
        x: torch.Tensor,
        context: Optional[torch.Tensor] = None,
        *,
        residual: Optional[str] = None,
        exporter: str = "dynamo",
        options: Optional["ort.SessionOptions"] = None,
    ) -> "OnnxBlock":
        return cls(export(block, x, context, residual=residual, exporter=exporter), options)

    def feeds(self, x: Any, context: Any = None) -> dict[str, np.ndarray]:
        arrays = {"x": _numpy(x), "context": None if context is None else _numpy(context)}
        missing = [n for n in self.input_names if arrays.get(n) is None]
        if missing:
            raise ValueError(f"the exported model takes {self.input_names}; missing {missing}")
        return {n: arrays[n] for n in self.input_names}

    def __call__(self, x: Any, context: Any = None) -> np.ndarray:
        return self.session.run([OUTPUT], self.feeds(x, context))[0]

    def bind(self, x: Any, context: Any = None) -> "ort.IOBinding":
        """An IOBinding with the inputs bound in place (numpy views of ``x`` and ``context``, no
        copy) and the output left to ORT's allocator. Keep ``x`` and ``context`` alive while it is
        used; run it with ``self.session.run_with_iobinding(binding)``."""
        binding = self.session.io_binding()
        for name, arr in self.feeds(x, context).items():
            binding.bind_cpu_input(name, arr)
        binding.bind_output(OUTPUT, "cpu")
        return binding

    def op_types(self) -> list[str]:
        """The ONNX op types of the exported graph (before ORT's own graph optimisations)."""
        import onnx

        return sorted({n.op_type for n in onnx.load_from_string(self.model).graph.node})

    def opset(self) -> int:
        import onnx

        return next(o.version for o in onnx.load_from_string(self.model).opset_import if o.domain in ("", "ai.onnx"))


def memory_profile(
    model: bytes, x: Any, context: Any = None, *, mem_reuse: bool = True, threads: Optional[int] = None
) -> dict:
    """What ORT's allocation planner did on one run, from ORT's own profiler (memory patterns
    off, so that the run allocates node by node):

    * ``residual_adds``: for each residual ``Add`` (both inputs of x's shape), in graph order, the
      bytes of its output and the bytes newly allocated in the arena while it ran (0: the sum was
      written into a buffer the plan already held, that is a dead intermediate's; the last one is
      the graph output, which ORT always allocates fresh for the caller);
    * ``peak_bytes``: the arena's peak bytes in use during the run, above what was in use before
      its first node (weights are ORT's own initializers and are not counted; the inputs are the
      caller's numpy memory and are not in the arena);
    * ``arena_held_bytes``: what the arena held after the run.
    """
    prefix = os.path.join(tempfile.mkdtemp(prefix="plusequals-ort-"), "profile")
    so = session_options(threads, mem_reuse=mem_reuse, mem_pattern=False, profile_prefix=prefix)
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = {"x": _numpy(x), "context": None if context is None else _numpy(context)}
    sess.run([OUTPUT], {n: feeds[n] for n in names})
    path = sess.end_profiling()
    try:
        with open(path) as f:
            events = json.load(f)
    finally:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    if not nodes or "mem_in_use_delta" not in nodes[0].get("args", {}):
        return {"available": False, "why": f"onnxruntime {ort.__version__}'s profiler reports no arena statistics"}
    shape = list(np.shape(feeds["x"]))
    adds = []
    for e in nodes:
        a = e["args"]
        ins = [next(iter(s.values())) for s in a.get("input_type_shape", [])]
        if a.get("op_name") == "Add" and len(ins) == 2 and ins[0] == ins[1] == shape:
            adds.append(
                {
                    "node": e["name"][: -len("_kernel_time")],
                    "output_bytes": int(a["output_size"]),
                    "new_bytes": int(a["mem_in_use_delta"]),
                }
            )
    first = nodes[0]["args"]
    base = int(first["mem_bytes_in_use"]) - int(first["mem_in_use_delta"])
    return {
        "available": True,
        "mem_reuse": mem_reuse,
        "residual_adds": adds,
        "peak_bytes": max(int(e["args"]["mem_in_use_peak"]) for e in nodes) - base,
        "arena_held_bytes": int(nodes[-1]["args"]["mem_arena_held"]),
    }


def _numpy(t: Any) -> np.ndarray:
    """A C-contiguous numpy array on ``t``'s memory where it can be (a CPU torch tensor shares it)."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.device.type != "cpu":
            raise ValueError(f"ONNX Runtime runs on the CPU here; got a tensor on {t.device}")
        t = t.numpy()
    return np.ascontiguousarray(t)
