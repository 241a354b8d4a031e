"""What the audit costs on one model family's train step: the report's cell
(``plusequals.bench.audit_cost``) alone, eager, anomaly mode, ``plusequals.audit(..., backward=True)``
and a dispatch mode that does nothing, side by side, in interleaved rounds (the report's design,
``plusequals.bench.timing``), compared within each round (paired ratios).

    python scripts/audit_cost.py [--model resnet18] [--rounds 15] [--profile] [--cpu-time]

``--model``: resnet18, ViT-Ti/16 (or vit), MobileNetV3-Large (or mobilenet_v3), GPT-2 (or gpt2),
or ``all``; each built as the report builds it (``audit_cost.FAMILIES``: batch 2, 64 x 64 images,
the LM 32 tokens, train mode). Each step is a forward, the sum of the outputs and a backward,
gradients dropped before the next. ``--profile`` prints where the audited step's time goes
(cProfile, by own time). ``--cpu-time``: one thread, timed on the process's CPU time
(``time.process_time``) instead of the wall clock, for a machine shared with other work.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import warnings

import torch

from plusequals.bench.audit_cost import AUDITED, EAGER, FAMILIES, Family, build, family, missing, probes
from plusequals.bench.timing import interleaved_rounds, paired_ratios, spread


def run(f: Family, rounds: int, profile: bool, clock) -> None:
    why = missing(f)
    if why is not None:
        print(f"{f.model}: skipped, {why}")
        return
    model, x = build(f)
    p = probes(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # anomaly mode warns that it is on, each time
        timed = interleaved_rounds(p, rounds=rounds, seed=0, sample_s=0.3, clock=clock)
    eager = timed.raw_ms[EAGER]
    print(f"{f.model} ({f.family}): {f.what}")
    for name, times in timed.raw_ms.items():
        s, r = spread(times), spread(paired_ratios(times, eager))
        print(f"  {name:48s} {s.median:7.2f} ms [{s.q1:.2f}, {s.q3:.2f}]  x{r.median:.2f} [{r.q1:.2f}, {r.q3:.2f}]")
    if profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [p[AUDITED]() for _ in range(10)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18", help="a family's model, or all")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    clock = None
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.process_time
    for f in FAMILIES if args.model == "all" else [family(args.model)]:
        run(f, args.rounds, args.profile, clock)


if __name__ == "__main__":
    main()
