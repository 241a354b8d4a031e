"""A whole UNet step: diffusers' UNet2DConditionModel in eager PyTorch, with its transformer
blocks swapped for the Rust twin, and under torch.compile; plus the share of the step spent in
the transformer blocks. Needs the optional ``diffusers`` dependency."""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .results import StepTiming, UnetRow
from .timing import interleaved_rounds, paired_ratios, spread, sync

BATCH = 2


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def measure(
    device: str,
    dtype: torch.dtype,
    quick: bool,
    rounds: int,
    sample_s: float,
    seed: int,
    blocks_ms: Optional[float] = None,
    compile: bool = True,
) -> dict:
    """Eager, the Rust-block UNet (a swapped copy) and torch.compile, timed in interleaved rounds
    like the blocks (``timing.interleaved_rounds``); each ratio to eager is paired per round.
    ``blocks_ms``: the eager transformer blocks' ms per step at batch 2 measured earlier in this
    run, at the same SD v1 shapes (the block share on CUDA). Returns results.json's
    ``unet_step``."""
    try:
        from diffusers import UNet2DConditionModel
        from diffusers.models.attention import BasicTransformerBlock as DiffusersBlock
    except ImportError as e:
        return {"skipped": f"diffusers is not installed ({e}); `pip install plusequals[diffusers]`"}
    from ..twin.swap import sd_v1_unet_config, tiny_unet_config

    config = tiny_unet_config() if quick else sd_v1_unet_config()
    unet = _make_unet(UNet2DConditionModel, config, device, dtype)
    size = config["sample_size"]
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(BATCH, 4, size, size, generator=g).to(device, dtype)
    ehs = torch.randn(BATCH, 77, config["cross_attention_dim"], generator=g).to(device, dtype)
    t = torch.tensor(500, device=device)
    blocks = [m for m in unet.modules() if isinstance(m, DiffusersBlock)]
    what = (
        f"diffusers UNet2DConditionModel, {'a small SD-v1-shaped config (--quick)' if quick else 'the SD v1 config'}, "
        f"batch {BATCH}, latent {size} x {size}, {str(dtype).replace('torch.', '')}, {len(blocks)} transformer "
        "blocks, torch.no_grad(). "
        "Timed in interleaved rounds like the blocks; the Rust row is a copy of the UNet with its blocks swapped; "
        "the audited row is the eager UNet called through `plusequals.audit` (hooks, modes and checks included)."
    )
    out: dict[str, Any] = {
        "what": what,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()},
        "rows": [],
    }

    def step(model) -> Callable[[], torch.Tensor]:
        return lambda: model(sample, t, encoder_hidden_states=ehs).sample

    with torch.no_grad():
        probes = _rust_and_eager(unet, step, out)
        probes[AUDITED] = audited(unet, (sample, t), {"encoder_hidden_states": ehs}, out)
        if compile and (device == "cuda" or not quick):
            probes["torch.compile (default)"] = step(_compiled(unet, step, device, out))
        else:
            out["compile_skipped"] = "--no-compile" if not compile else "--quick on the CPU"
        r = interleaved_rounds(probes, rounds, seed, sample_s)
        out["rounds"] = r.record()
        out["rows"] = [step_row(name, r.raw_ms).to_json() for name in probes]
        step_ms = out["rows"][0]["median_ms"]
        out["block_share"] = (
            _block_share_cpu(blocks, step(unet)) if device == "cpu" else _block_share_cuda(blocks_ms, step_ms, quick)
        )
        out["block_share_method"] = (
            "time inside the blocks' forward (hooks; the CPU runs synchronously) over the step, median of 5 steps"
            if device == "cpu"
            else "sum of the per-block eager times measured above at the SD v1 shapes, over the step"
        )
    return out


def _make_unet(cls: type, config: dict[str, Any], device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    # diffusers logs "modules ... should be kept in float32: []" on every .to(dtype): an empty list, noise
    quiet = logging.getLogger("diffusers.models.modeling_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return cls(**config).to(device, dtype).eval()
    finally:
        quiet.setLevel(level)


def _rust_and_eager(unet: torch.nn.Module, step: Callable, out: dict) -> dict[str, Callable[[], torch.Tensor]]:
    """The eager step and a copy of the UNet with its blocks swapped for Rust ones; records the
    Rust UNet's relative error against eager in ``out``."""
    from ..twin.swap import swap_transformer_blocks

    expected = step(unet)()
    rust_unet = copy.deepcopy(unet)
    swap_transformer_blocks(rust_unet)
    out["max_rel_err_rust"] = _rel_err(step(rust_unet)(), expected)
    return {"eager": step(unet), "Rust transformer blocks": step(rust_unet)}


AUDITED = "eager under plusequals.audit"


def audited(unet: torch.nn.Module, args: tuple, kwargs: dict, out: dict) -> Callable[[], object]:
    """The eager step run by ``plusequals.audit`` (what one audited forward costs: the hooks, the
    modes and their checks); records what that audit found in ``out``."""
    from ..auditing import audit

    def call() -> object:
        return audit(unet, *args, **kwargs)

    out["audit"] = call().summary()
    return call


def _compiled(unet: torch.nn.Module, step: Callable, device: str, out: dict) -> Callable:
    """torch.compile of the UNet, compiled by three calls (their seconds in ``out``)."""
    torch._dynamo.reset()
    compiled = torch.compile(unet)
    t0 = time.perf_counter()
    for _ in range(3):
        step(compiled)()
    sync(device)
    out["compile_s"] = time.perf_counter() - t0
    return compiled


def step_row(name: str, raw_ms: dict[str, list[float]], kind: type[StepTiming] = UnetRow) -> StepTiming:
    """One probe of a whole step, as a ``kind`` row: its time over the rounds and its ratio to
    ``eager``, paired per round."""
    ms = spread(raw_ms[name])
    vs = spread(paired_ratios(raw_ms[name], raw_ms["eager"]))
    return kind(
        name=name,
        median_ms=ms.median,
        iqr_ms=ms.iqr,
        vs_eager=vs.median,
        vs_eager_q1=vs.q1,
        vs_eager_q3=vs.q3,
        within_noise=vs.contains(1.0),
    )


def _block_share_cpu(blocks: Sequence[torch.nn.Module], step: Callable[[], torch.Tensor]) -> float:
    """Time inside the blocks with forward hooks (the CPU runs synchronously) over the step,
    median of 5 steps."""
    spent = [0.0]
    starts: list[float] = []
    hooks = []
    for b in blocks:
        hooks.append(b.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())))
        hooks.append(
            b.register_forward_hook(lambda *_: spent.__setitem__(0, spent[0] + time.perf_counter() - starts.pop()))
        )
    try:
        runs = []
        for _ in range(5):
            spent[0] = 0.0
            t0 = time.perf_counter()
            step()
            runs.append((spent[0], time.perf_counter() - t0))
    finally:
        for h in hooks:
            h.remove()
    runs.sort(key=lambda r: r[1])
    inside, total = runs[len(runs) // 2]
    return inside / total


def _block_share_cuda(blocks_ms: Optional[float], step_ms: float, small: bool) -> Optional[float]:
    """The eager blocks' time per step measured in this run's cells, over the step (None for the
    small UNet: its blocks are not the cells' shapes)."""
    if small or blocks_ms is None:
        return None
    return blocks_ms / step_ms
