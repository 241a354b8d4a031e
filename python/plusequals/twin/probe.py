"""The probe of :func:`plusequals.twin.faithful.read_block`'s ``trust="probe"``: for block classes
the reading does not know, the Rust block and the block are run on one small seeded input and must
agree. A leaf (imports only ``config``)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from .config import BlockConfig

__all__ = ["PROBE_BOUND", "bound", "can_probe", "differs", "probe"]

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


def probe(block: nn.Module, rust_forward, spec: BlockConfig, weight: torch.Tensor, call=None) -> Optional[str]:
    """Runs ``block`` and the Rust block on one small seeded input, in the weights' dtype and on
    their device, and returns the reason they differ (None: they agree within :func:`bound`,
    NaN and inf in the same places). Only where :func:`can_probe`. ``call(block, *args,
    **kwargs)`` runs the block (the recorder of what it ran: twin/record.py)."""
    with _outside_function_modes():
        return _probe(block, rust_forward, spec, weight, call or _call)


def _call(f, *args, **kwargs):
    return f(*args, **kwargs)


def _probe(block: nn.Module, rust_forward, spec: BlockConfig, weight: torch.Tensor, call) -> Optional[str]:
    """:func:`probe`, under no TorchFunctionMode."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, spec.dim, generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    c = torch.randn(2, 3, spec.context_dim or spec.dim, generator=g, dtype=torch.float64).to(
        weight.device, weight.dtype
    )
    # IP-Adapter (diffusers only): one image embedding (batch, images, tokens, width) per adapter
    images = [
        torch.randn(2, 1, 2, c.shape[-1], generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
        for _ in spec.ip_adapter
    ]
    with torch.no_grad():
        try:
            # diffusers' block takes the context by keyword (its second argument is the mask)
            diffusers = type(block).__module__.startswith("diffusers.")
            context = (c, images) if images else c
            expected = call(block, x, encoder_hidden_states=context) if diffusers else call(block, x, c)
        except Exception as e:  # noqa: BLE001  (reported as the reason)
            return f"its forward raised {type(e).__name__} on a probe input: {e}"
        got = rust_forward(x, c, ip_adapter=images) if images else rust_forward(x, c)
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return (
            f"its forward returns {type(expected).__name__} {getattr(expected, 'shape', '')}, not a tensor of x's shape"
        )
    why = differs(got, expected, bound(expected.dtype))
    if why:
        return (
            f"its output differs from the Rust block's by {why} on a probe input in {expected.dtype} on "
            f"{expected.device}: its forward does not compute the CompVis block"
        )
    return None
