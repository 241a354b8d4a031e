"""Times a LoRA-adapted UNet step next to the plain one, eager and with the transformer
blocks swapped for Rust ones, in interleaved rounds like the report (plusequals.bench.timing).

    python scripts/lora_unet_step.py [--full] [--rounds N] [--rank R] [--device cpu|cuda]

The default UNet is the report's --quick one (plusequals.twin.swap.tiny_unet_config); --full is
the SD v1 UNet (859.5M parameters). The adapter is rank R on to_q, to_k, to_v and to_out.0 of every
attention (diffusers' usual LoRA targets), random non-zero weights. torch.no_grad(), batch 2.
Prints one line per variant: median ms and the paired ratio to the plain eager step.
"""

from __future__ import annotations

import argparse
import copy

import torch

from plusequals import swap_transformer_blocks
from plusequals.bench.timing import interleaved_rounds, paired_ratios, spread
from plusequals.twin.swap import sd_v1_unet_config, tiny_unet_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the SD v1 UNet instead of the small one")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    config = sd_v1_unet_config() if args.full else tiny_unet_config()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        plain = UNet2DConditionModel(**config).to(args.device).eval()
        lora = copy.deepcopy(plain)
        targets = ["to_q", "to_k", "to_v", "to_out.0"]
        lora.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=targets, init_lora_weights=False))
        lora.eval()
    size = config["sample_size"]
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(2, 4, size, size, generator=g).to(args.device)
    ehs = torch.randn(2, 77, config["cross_attention_dim"], generator=g).to(args.device)
    t = torch.tensor(500, device=args.device)
    models = {"plain eager": plain, "LoRA eager": lora}
    for name, model in list(models.items()):
        # the module tree copied, the parameters and buffers shared (one copy of the weights in memory)
        memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
        swapped = copy.deepcopy(model, memo)
        swap_transformer_blocks(swapped)
        models[name.replace("eager", "Rust blocks")] = swapped
    with torch.no_grad():
        outs = {name: m(sample, t, ehs).sample for name, m in models.items()}
        for a, b in (("plain Rust blocks", "plain eager"), ("LoRA Rust blocks", "LoRA eager")):
            err = ((outs[a].double() - outs[b].double()).norm() / outs[b].double().norm()).item()
            print(f"{a} vs {b}: ||a-b||/||b|| = {err:.3g}")
        probes = {name: (lambda m=m: m(sample, t, ehs).sample) for name, m in models.items()}
        r = interleaved_rounds(probes, args.rounds, seed=0, sample_s=0.5 if args.full else 0.2)
    what = "SD v1 UNet" if args.full else "small SD-v1-shaped UNet (--quick)"
    print(f"{what}, batch 2, latent {size}x{size}, fp32 on {args.device}, rank-{args.rank} LoRA, {args.rounds} rounds")
    for name in probes:
        ms = spread(r.raw_ms[name])
        vs = spread(paired_ratios(r.raw_ms[name], r.raw_ms["plain eager"]))
        print(f"  {name:18s} {ms.median:9.2f} ms (IQR {ms.q1:.2f}-{ms.q3:.2f})  x{vs.median:.3f} plain eager")


if __name__ == "__main__":
    main()
