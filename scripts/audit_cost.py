"""What the audit costs on a resnet18 train step: the report's cell
(``plusequals.bench.audit_cost``) alone, eager, anomaly mode, ``plusequals.audit(..., backward=True)``
and a dispatch mode that does nothing, side by side, in interleaved rounds (the report's design,
``plusequals.bench.timing``), compared within each round (paired ratios).

    python scripts/audit_cost.py [--rounds 15] [--profile] [--cpu-time]

Batch 2, 64 x 64 images, CPU, train mode; each step is a forward, the sum of the logits and a
backward, gradients dropped before the next. ``--profile`` prints where the audited step's time
goes (cProfile, by own time). ``--cpu-time``: one thread, timed on the process's CPU time
(``time.process_time``) instead of the wall clock, for a machine shared with other work.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torchvision

from plusequals.bench.audit_cost import AUDITED, EAGER, probes
from plusequals.bench.timing import interleaved_rounds, paired_ratios, spread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cpu-time", action="store_true")
    args = parser.parse_args()
    clock = None
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.process_time
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(2, 3, 64, 64)
    p = probes(model, x)
    rounds = interleaved_rounds(p, rounds=args.rounds, seed=0, sample_s=0.3, clock=clock)
    eager = rounds.raw_ms[EAGER]
    for name, times in rounds.raw_ms.items():
        s, r = spread(times), spread(paired_ratios(times, eager))
        print(f"{name:48s} {s.median:7.2f} ms [{s.q1:.2f}, {s.q3:.2f}]  x{r.median:.2f} [{r.q1:.2f}, {r.q3:.2f}] eager")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [p[AUDITED]() for _ in range(10)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
