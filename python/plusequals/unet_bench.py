"""A whole UNet step: diffusers' UNet2DConditionModel in eager PyTorch, with its transformer
blocks swapped for the Rust twin, and under torch.compile; plus the share of the step spent in
the transformer blocks. Needs the optional ``diffusers`` dependency."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from . import bench


def small_unet_config() -> dict[str, Any]:
    """An SD-v1-shaped UNet small enough for --quick on two CPU cores (4 transformer blocks)."""
    return dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def measure(
    device: str, dtype: torch.dtype, quick: bool, min_run_time: float, data: Optional[dict] = None, compile: bool = True
) -> dict:
    try:
        from diffusers import UNet2DConditionModel
        from diffusers.models.attention import BasicTransformerBlock as DiffusersBlock
    except ImportError as e:
        return {"skipped": f"diffusers is not installed ({e}); `pip install plusequals[diffusers]`"}
    from .swap import sd_v1_unet_config, swap_transformer_blocks

    small = quick
    config = small_unet_config() if small else sd_v1_unet_config()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**config).to(device, dtype).eval()
    batch, size = 2, config["sample_size"]
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(batch, 4, size, size, generator=g).to(device, dtype)
    ehs = torch.randn(batch, 77, config["cross_attention_dim"], generator=g).to(device, dtype)
    t = torch.tensor(500, device=device)
    blocks = [m for m in unet.modules() if isinstance(m, DiffusersBlock)]
    what = (
        f"diffusers UNet2DConditionModel, {'a small SD-v1-shaped config (--quick)' if small else 'the SD v1 config'}, "
        f"batch {batch}, latent {size} x {size}, {str(dtype).replace('torch.', '')}, {len(blocks)} transformer blocks, torch.no_grad()."
    )
    out: dict[str, Any] = {"what": what, "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items()}, "rows": []}

    def step() -> torch.Tensor:
        return unet(sample, t, encoder_hidden_states=ehs).sample

    with torch.no_grad():
        expected = step()
        eager = bench.timeit(step, min_run_time)
        out["rows"].append({"name": "eager", "median_ms": eager.median_ms, "iqr_ms": eager.iqr_ms})
        out["block_share"] = _block_share(unet, blocks, step, device, data, eager.median_ms, small)
        out["block_share_method"] = (
            "time inside the blocks' forward (hooks; the CPU runs synchronously) over the step, median of 5 steps"
            if device == "cpu"
            else "sum of the per-block eager times measured above at the SD v1 shapes, over the step"
        )

        handle = swap_transformer_blocks(unet)
        try:
            got = step()
            out["max_rel_err_rust"] = _rel_err(got, expected)
            rust = bench.timeit(step, min_run_time)
            out["rows"].append({"name": "Rust transformer blocks", "median_ms": rust.median_ms, "iqr_ms": rust.iqr_ms})
        finally:
            handle.undo()

        if compile and (device == "cuda" or not quick):
            torch._dynamo.reset()
            compiled = torch.compile(unet)
            t0 = time.perf_counter()
            for _ in range(3):
                compiled(sample, t, encoder_hidden_states=ehs)
            bench.sync(device)
            out["compile_s"] = time.perf_counter() - t0
            c = bench.timeit(lambda: compiled(sample, t, encoder_hidden_states=ehs).sample, min_run_time)
            out["rows"].append({"name": "torch.compile (default)", "median_ms": c.median_ms, "iqr_ms": c.iqr_ms})
        else:
            out["compile_skipped"] = "--no-compile" if not compile else "--quick on the CPU"
    for r in out["rows"]:
        r["vs_eager"] = r["median_ms"] / eager.median_ms
    return out


def _block_share(unet, blocks, step, device: str, data: Optional[dict], step_ms: float, small: bool) -> Optional[float]:
    """CPU: time inside the blocks with forward hooks (the CPU runs synchronously). CUDA: the sum
    of the per-block eager times measured earlier in this run at the same SD v1 shapes."""
    if device == "cpu":
        spent = [0.0]
        starts: list[float] = []
        hooks = []
        for b in blocks:
            hooks.append(b.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter())))
            hooks.append(b.register_forward_hook(lambda *_: spent.__setitem__(0, spent[0] + time.perf_counter() - starts.pop())))
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
    if small or not data:
        return None
    total = 0.0
    for shape in data["config"]["shapes"]:
        row = next((r for r in data["results"] if r["batch"] == 2 and r["shape"] == shape["label"] and r["variant"] == "eager/op_plus_x"), None)
        if row is None:
            return None
        total += row["median_ms"] * shape["blocks"]
    return total / step_ms
