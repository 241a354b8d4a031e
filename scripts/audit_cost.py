"""What the audit costs on a resnet18 train step (issue 31): eager, anomaly mode and
``plusequals.audit(..., backward=True)`` side by side, in interleaved rounds (the report's design,
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

from plusequals.audit import audit
from plusequals.bench.timing import interleaved_rounds, paired_ratios, spread


def probes(model: torch.nn.Module, x: torch.Tensor) -> dict:
    def eager() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    def anomaly() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autograd.detect_anomaly(check_nan=False):
            model(x).sum().backward()

    def audited() -> None:
        model.zero_grad(set_to_none=True)
        report = audit(model, x, backward=True)
        assert report.clean and report.backward_error is None, report.summary()

    return {"eager": eager, "anomaly mode": anomaly, "plusequals.audit": audited}


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
    eager = rounds.raw_ms["eager"]
    for name, times in rounds.raw_ms.items():
        s, r = spread(times), spread(paired_ratios(times, eager))
        print(f"{name:18s} {s.median:7.2f} ms [{s.q1:.2f}, {s.q3:.2f}]  x{r.median:.2f} [{r.q1:.2f}, {r.q3:.2f}] eager")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(lambda: [p["plusequals.audit"]() for _ in range(10)])
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
