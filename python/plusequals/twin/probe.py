"""The probe: the PyTorch block and the Rust block run on the same inputs and must agree. It runs
at each check (``from_torch``, :func:`plusequals.twin.faithful.read_block`'s ``trust="probe"``, and
after every change of the code the forward runs), never on the hot path.

A change is followed only where the probe proves it equal, as far as running it can:

* **Several inputs**, not one, each run recorded (twin/record.py: a helper only some token
  counts call is watched once one ran it): a seeded input (batch 2, 5 tokens), then fresh random
  ones (seeds from the OS, named in a refusal) of batch 1 and 3, of other token counts, at 100x
  and 1/100x the scale (a branch on ``x.abs().max() > k``), and one of the shapes of the call
  that found the change (:func:`note_call`; a branch on a shape). Each in the block's dtype, on
  its device, in the call's autocast state.
* **The ATen ops** the PyTorch block runs on the seeded input (a ``TorchDispatchMode``: names,
  overloads and non-tensor arguments), compared with the Rust block's (on this crate's CompVis
  block they are the same sequence) and with those of the last run that was proven: an op that
  reads a tensor's value into Python (``bool(t)``, ``t.item()``, ``torch.equal``: any op whose
  schema returns no tensor) that neither of those ran is a branch on values no probe can cover,
  and is refused, named.

A leaf (imports only ``config``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import random
from typing import Any, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .config import BlockConfig

__all__ = [
    "PROBE_BOUND",
    "Input",
    "Trace",
    "bound",
    "can_probe",
    "differs",
    "for_call",
    "inputs",
    "note_call",
    "probe",
    "trace",
    "value_reads",
]

PROBE_BOUND = 1e-5  # the parity bar (README): ||a - b|| / ||b||, fp32 and fp64


def bound(dtype: torch.dtype) -> float:
    """The probe's bound in ``dtype``: :data:`PROBE_BOUND` in fp32 and fp64; in a narrower dtype,
    the larger of that and one unit of the dtype's precision (``finfo.eps``: 2**-7 in bf16, 2**-10
    in fp16), as ||a - b|| / ||b||. The twin runs libtorch's ops in the block's order, so on the
    CPU the two agree bitwise in bf16 and fp16 too (measured: 0, CompVis and diffusers blocks);
    the bound is headroom for kernels that round differently elsewhere, and far below what a
    change of the code moves (a scaled op: ~0.5)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(PROBE_BOUND, eps) if dtype not in (torch.float32, torch.float64) else PROBE_BOUND


def can_probe(weight: torch.Tensor) -> bool:
    """Whether the probe can run on weights like ``weight``: anywhere they have values (not on
    the meta device), in their own dtype and on their own device (:func:`bound`)."""
    return weight.device.type != "meta"


def differs(got: torch.Tensor, expected: torch.Tensor, limit: float) -> Optional[str]:
    """How ``got`` differs from ``expected`` beyond ``limit``, or None. NaN and +-inf must sit in
    the same places (a NaN is equal to a NaN there: a block whose weights hold inf gives NaN in
    both); the finite values agree within ``limit`` (||a - b|| / ||b||)."""
    a, b = got.detach().double(), expected.detach().double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return f"NaN in {int((nan_a ^ nan_b).sum())} places where the other has none"
    inf = torch.isinf(a) | torch.isinf(b)
    if not torch.equal(a[inf], b[inf]):
        return f"+-inf in {int((a[inf] != b[inf]).sum())} places where the other has another value"
    finite = ~(nan_a | inf)
    a, b = a[finite], b[finite]
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if a.numel() else 0.0
    if not err <= limit:
        return f"{err:.3g} (||a-b||/||b||, bound {limit:.3g})"
    return None


@contextlib.contextmanager
def _outside_function_modes() -> Iterator[None]:
    """The active TorchFunctionModes taken off for the probe, and put back after: it checks the
    block's code, not what a mode around one call does with its torch calls (a block made under
    a mode that changes ``F.linear`` is no other block)."""
    modes = []
    while torch._C._len_torch_function_stack():
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


class Input(NamedTuple):
    """One probe input: x is (batch, tokens, dim), the context (batch, context_tokens, width), drawn
    from ``seed`` and multiplied by ``scale``."""

    batch: int
    tokens: int
    context_tokens: int
    scale: float
    seed: int

    def __str__(self) -> str:
        return (
            f"batch {self.batch}, {self.tokens} tokens, context {self.context_tokens}, "
            f"scale {self.scale:g}, seed {self.seed}"
        )


#: The input the recorder watches the block run on, whose ATen ops are compared: seeded, so the
#: op sequences of two checks are comparable.
SEEDED = Input(2, 5, 3, 1.0, 0)

#: The most elements of x for which the probe also runs the call's own shapes (4 Mi: SD v1's
#: 64 x 64 latent at width 320, batch 2, is 2.6 Mi).
CALL_LIMIT = 1 << 22

_CALL: contextvars.ContextVar[Optional[Tuple[int, int, int]]] = contextvars.ContextVar("probe_call", default=None)


def note_call(x: Any, context: Any = None) -> None:
    """Notes the shapes of a call that left the hot path (the one whose check may probe): x's batch
    and tokens, the context's tokens (x's where there is none). The probe, run by that call's check,
    adds an input of those shapes; a later probe on this thread (another block's ``from_torch``)
    may add them too, which proves no less."""
    x_shape, context_shape = _shape3(x), _shape3(context)
    shapes = None
    if x_shape is not None:
        shapes = (x_shape[0], x_shape[1], (context_shape or x_shape)[1])
    _CALL.set(shapes)


def _shape3(t: Any) -> Optional[Tuple[int, ...]]:
    """``t``'s shape when it is a plain 3-d tensor, else None: noting a call's shapes runs before the
    call's checks, so it must take anything they would refuse (a nested tensor has no sizes, a
    subclass may raise) without raising."""
    if not isinstance(t, torch.Tensor) or t.is_nested or t.layout != torch.strided:
        return None
    try:
        shape = tuple(int(n) for n in t.shape)
    except (RuntimeError, TypeError, ValueError):
        return None
    return shape if len(shape) == 3 else None


@contextlib.contextmanager
def for_call(x: Any, context: Any = None) -> Iterator[None]:
    """:func:`note_call` for the duration of the block."""
    token = _CALL.set(None)
    note_call(x, context)
    try:
        yield
    finally:
        _CALL.reset(token)


def inputs(spec: BlockConfig, seeds: Optional[List[int]] = None) -> List[Input]:
    """The probe's inputs (module docstring): :data:`SEEDED` first, then four drawn from ``seeds``
    (fresh from the OS when None): batch 1 and 3, other token counts, 100x and 1/100x the scale,
    and the call's shapes (:func:`note_call`) where there is a call and x has at most
    :data:`CALL_LIMIT` elements."""
    rng = random.SystemRandom()
    seeds = list(seeds) if seeds is not None else [rng.getrandbits(62) for _ in range(4)]
    out = [
        SEEDED,
        Input(1, 7, 4, 1.0, seeds[0]),
        Input(3, 2, 6, 100.0, seeds[1]),
        Input(2, 5, 3, 0.01, seeds[2]),
    ]
    call = _CALL.get()
    if call is not None and call[0] * call[1] * spec.dim <= CALL_LIMIT and call[0] > 0 and call[1] > 0:
        out.append(Input(call[0], call[1], max(call[2], 1), 1.0, seeds[3]))
    return out


def _tensors(spec: BlockConfig, weight: torch.Tensor, at: Input) -> Tuple[torch.Tensor, torch.Tensor, list]:
    """x, the context and IP-Adapter's image embeddings (diffusers only: one (batch, images,
    tokens, width) per adapter) of ``at``, in the weights' dtype and on their device."""
    g = torch.Generator().manual_seed(at.seed)

    def draw(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * at.scale
        return t.to(weight.device, weight.dtype)

    x = draw(at.batch, at.tokens, spec.dim)
    c = draw(at.batch, at.context_tokens, spec.context_dim or spec.dim)
    return x, c, [draw(at.batch, 1, 2, c.shape[-1]) for _ in spec.ip_adapter]


# --------------------------------------------------------------------------------------------
# The ATen ops
# --------------------------------------------------------------------------------------------

#: One op: its name with the overload, and its non-tensor arguments (a tensor is "T").
Op = Tuple[str, tuple]


class Trace(NamedTuple):
    """The ATen ops one run dispatched, in order, and where it ran (dtype, device)."""

    ops: Tuple[Op, ...]
    dtype: torch.dtype
    device: torch.device


def _arg(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return "T"
    if isinstance(a, (list, tuple)):
        return tuple(_arg(b) for b in a)
    if isinstance(a, (int, float, bool, str, type(None))):
        return a
    return type(a).__name__  # a dtype, a device, a layout: the run's, not the op's


class _Ops(TorchDispatchMode):
    """Records each op's name and non-tensor arguments, and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        self.ops.append((str(func), _arg(args) + tuple(sorted((k, _arg(v)) for k, v in kwargs.items()))))
        return func(*args, **kwargs)


def trace(f, *args: Any, **kwargs: Any) -> Tuple[Any, List[Op]]:
    """``f(*args, **kwargs)`` and the ATen ops it dispatched."""
    with _Ops() as mode:
        out = f(*args, **kwargs)
    return out, mode.ops


def value_reads(ops: Any) -> List[str]:
    """The ops of ``ops`` that hand a tensor's value to Python (their schema returns no tensor, nor
    a list or optional of one: ``_local_scalar_dense`` for ``bool(t)`` and ``t.item()``, ``equal``,
    ``allclose``), by name."""
    return [name for name, _ in ops if _reads_value(name)]


@functools.lru_cache(maxsize=4096)
def _reads_value(name: str) -> bool:
    """Whether the op named ``name`` (``namespace.op.overload``) returns no tensor (its schema, read
    once per name)."""
    packet = name.split(".")
    op = getattr(getattr(torch.ops, packet[0], None), packet[1], None) if len(packet) == 3 else None
    overload = getattr(op, packet[2], None) if op is not None else None
    schema = getattr(overload, "_schema", None)
    return schema is not None and not any("Tensor" in str(r.type) for r in schema.returns)


def _new_value_reads(ops: List[Op], *known: Optional[List[Op]]) -> List[str]:
    """The value reads of ``ops`` beyond those of each known trace (by count, per op)."""
    reads = value_reads(ops)
    allowed: dict = {}
    for k in known:
        counts: dict = {}
        for name in value_reads(k or ()):
            counts[name] = counts.get(name, 0) + 1
        for name, n in counts.items():
            allowed[name] = max(allowed.get(name, 0), n)
    new = []
    for name in reads:
        if allowed.get(name, 0):
            allowed[name] -= 1
        else:
            new.append(name)
    return new


# --------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------


def probe(block: nn.Module, rust_forward, spec: BlockConfig, weight: torch.Tensor, call=None) -> Optional[str]:
    """Runs ``block`` and the Rust block on the probe's inputs (:func:`inputs`), in the weights'
    dtype and on their device, and returns the reason they differ (None: they agree within
    :func:`bound` on every input, NaN and inf in the same places, and the block read no tensor's
    value that neither the Rust block nor the last proven run read). Only where :func:`can_probe`.
    ``call(block, *args, **kwargs)`` runs the block on each input: a recorder's (of what it ran:
    twin/record.py), whose ``proven`` trace (the last run proven equal) is compared and
    whose ``ops`` is set to this run's."""
    with _outside_function_modes(), _disable_current_modes():  # a FakeTensorMode's call: real inputs here
        return _probe(block, rust_forward, spec, weight, call or _call)


def _call(f, *args, **kwargs):
    return f(*args, **kwargs)


def _run_block(block: nn.Module, call, x: torch.Tensor, c: torch.Tensor, images: list) -> Any:
    # diffusers' block takes the context by keyword (its second argument is the mask)
    if type(block).__module__.startswith("diffusers."):
        return call(block, x, encoder_hidden_states=(c, images) if images else c)
    return call(block, x, c)


def _run_rust(rust_forward, x: torch.Tensor, c: torch.Tensor, images: list) -> Any:
    return rust_forward(x, c, ip_adapter=images) if images else rust_forward(x, c)


def _compare(expected: Any, got: torch.Tensor, at: Input) -> Optional[str]:
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return (
            f"its forward returns {type(expected).__name__} {getattr(expected, 'shape', '')}, not a tensor of x's shape"
        )
    why = differs(got, expected, bound(expected.dtype))
    if why:
        return (
            f"its output differs from the Rust block's by {why} on a probe input ({at}) in {expected.dtype} on "
            f"{expected.device}: its forward does not compute the CompVis block"
        )
    return None


def _probe(block: nn.Module, rust_forward, spec: BlockConfig, weight: torch.Tensor, call) -> Optional[str]:
    """:func:`probe`, under no TorchFunctionMode."""
    recorder = getattr(call, "__self__", None)
    with torch.no_grad():
        for i, at in enumerate(inputs(spec)):
            x, c, images = _tensors(spec, weight, at)
            try:
                expected = _run_block(block, call, x, c, images)  # recorded, every input
            except Exception as e:  # noqa: BLE001  (reported as the reason)
                return f"its forward raised {type(e).__name__} on a probe input ({at}): {e}"
            why = _compare(expected, _run_rust(rust_forward, x, c, images), at)
            if why:
                return why
            if i == 0:
                why = _check_ops(block, rust_forward, recorder, x, c, images)
                if why:
                    return why
    return None


def _check_ops(
    block: nn.Module, rust_forward, recorder: Any, x: torch.Tensor, c: torch.Tensor, images: list
) -> Optional[str]:
    """The seeded input's ATen ops (module docstring): None, or the reason to refuse. The block's
    trace is kept on ``recorder`` (``ops``) for the next check to compare with."""
    _, ops = trace(_run_block, block, _call, x, c, images)
    _, twin = trace(_run_rust, rust_forward, x, c, images)
    proven = getattr(recorder, "proven", None)
    same_place = proven is not None and (proven.dtype, proven.device) == (x.dtype, x.device)
    new = _new_value_reads(ops, twin, proven.ops if same_place else None)
    if new:
        return (
            f"its forward reads a tensor's value into Python ({', '.join(sorted(set(new)))}), which neither the "
            "Rust block nor its last proven run did: a branch on values, which no probe can cover"
        )
    if recorder is not None and hasattr(recorder, "ops"):
        recorder.ops = Trace(tuple(ops), x.dtype, x.device)
        recorder.same_as_twin = ops == twin
    return None
