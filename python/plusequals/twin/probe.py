"""The probe of :func:`plusequals.twin.faithful.read_block`'s ``trust="probe"``: for block classes
the reading does not know, the Rust block and the block are run on one small seeded input and must
agree. A leaf (imports only ``config``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .config import BlockConfig

__all__ = ["PROBE_BOUND", "can_probe", "probe"]

PROBE_BOUND = 1e-5  # the parity bar (README): ||a - b|| / ||b||, fp32 and fp64


def can_probe(weight: torch.Tensor) -> bool:
    """Whether the probe can run on weights like ``weight``: not on the meta device (no values),
    and only in fp32 or fp64 (where :data:`PROBE_BOUND` is the parity bar)."""
    return weight.device.type != "meta" and weight.dtype in (torch.float32, torch.float64)


def probe(block: nn.Module, rust_forward, spec: BlockConfig, weight: torch.Tensor) -> Optional[str]:
    """Runs ``block`` and the Rust block on one small seeded input and returns the reason they
    differ (None: they agree within :data:`PROBE_BOUND`). Only where :func:`can_probe`."""
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
            expected = block(x, encoder_hidden_states=(c, images) if images else c) if diffusers else block(x, c)
        except Exception as e:  # noqa: BLE001  (reported as the reason)
            return f"its forward raised {type(e).__name__} on a probe input: {e}"
        got = rust_forward(x, c, ip_adapter=images) if images else rust_forward(x, c)
    if not isinstance(expected, torch.Tensor) or expected.shape != got.shape:
        return (
            f"its forward returns {type(expected).__name__} {getattr(expected, 'shape', '')}, not a tensor of x's shape"
        )
    err = ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
    if not err <= PROBE_BOUND:
        return (
            f"its output differs from the Rust block's by {err:.3g} (||a-b||/||b||, bound {PROBE_BOUND}) on a "
            "probe input: its forward does not compute the CompVis block"
        )
    return None
