"""The report's timing method: interleaved rounds and paired ratios (python/plusequals/bench/timing.py).

The round and pairing functions are exercised here on a fake machine whose speed drifts: its
clock is torch.utils.benchmark's Timer clock, and its workloads advance that clock by their cost
times the machine's current slowdown. The interleaved, paired design recovers the true ratio of
two workloads; the sequential design (all of one, then all of the other) reports the drift.

``PLUSEQUALS_LOAD_TEST=1`` adds the acceptance run: a quick CPU report while a
background load is switched on and off at random (two to four minutes on 2 cores).
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from plusequals.bench import timing
from plusequals.bench.variants import Variant, paired_iqr_settled, variant_ms, variant_probes


# ----------------------------------------------------------------------------- a drifting machine
class DriftingMachine:
    """A fake clock; each workload call advances it by its cost times ``slowdown(now)``."""

    def __init__(self, slowdown):
        self.now = 0.0
        self.slowdown = slowdown

    def clock(self) -> float:
        return self.now

    def workload(self, cost_s: float):
        def call():
            self.now += cost_s * self.slowdown(self.now)

        return call


def toggled_load(seed: int, mean_s: float, factor: float):
    """A load switched on and off at random (exponential intervals): slowdown 1 or ``factor``."""
    rng = random.Random(seed)
    switches, t = [], 0.0
    while t < 1e4 * mean_s:
        t += rng.expovariate(1 / mean_s)
        switches.append(t)

    def slowdown(now: float) -> float:
        return factor if np.searchsorted(switches, now) % 2 else 1.0

    return slowdown


DESIGNS = ("interleaved", "sequential")


def ratios_under(
    design: str, slowdown, costs: dict, reference: str, rounds: int, seed: int = 0, sample_s: float = 0.01
):
    """Each workload's paired ratio to ``reference`` (median over rounds) on a fresh machine,
    measured with the report's own functions on the fake clock; and the run's fake duration."""
    machine = DriftingMachine(slowdown)
    probes = {name: machine.workload(c) for name, c in costs.items()}
    if design == "interleaved":
        steps = timing.interleaved_steps(timing.shuffled_orders(list(probes), rounds, seed))
    else:
        steps = timing.sequential_steps(list(probes), rounds)
    _, raw = timing.measure_steps(probes, steps, sample_s, clock=machine.clock)
    return {name: timing.spread(timing.paired_ratios(raw[name], raw[reference])).median for name in costs}, machine.now


def test_a_load_that_comes_on_midway_picks_no_winner_when_interleaved():
    """B truly costs 1.05 x A. Halfway through the run, a load doubles every cost. Timed one
    after the other, B is timed on the loaded machine and reads about twice A; timed in
    interleaved rounds and paired, B reads 1.05."""
    costs = {"A": 1e-3, "B": 1.05e-3}
    _, duration = ratios_under("interleaved", lambda now: 1.0, costs, "A", rounds=9)
    step = lambda now: 1.0 if now < duration / 2 else 2.0  # noqa: E731
    got = {design: ratios_under(design, step, costs, "A", rounds=9)[0]["B"] for design in DESIGNS}
    assert got["interleaved"] == pytest.approx(1.05, rel=1e-3)
    assert got["sequential"] == pytest.approx(2.1, rel=0.05)


def test_a_load_switched_at_random_moves_no_same_work_variant_when_interleaved():
    """Seven workloads of equal cost (the eager strategies) and one 10% slower, while a load
    that doubles every cost is switched on and off at random. Interleaved and paired, every
    equal one reads 1 within 5% and the slower one 1.10; sequentially, some read 0.5 or 2.
    (The load switches every 0.2 s on average, about 16 samples of 12 ms: a load that switched
    within most rounds would defeat the pairing too.)"""
    costs = {f"same{i}": 1e-3 for i in range(7)} | {"slower": 1.1e-3}
    for seed in range(4):
        load = toggled_load(seed, mean_s=0.2, factor=2.0)
        got = {design: ratios_under(design, load, costs, "same0", rounds=9, seed=seed)[0] for design in DESIGNS}
        for name in costs:
            want = 1.1 if name == "slower" else 1.0
            assert got["interleaved"][name] == pytest.approx(want, rel=0.05), (seed, name, got["interleaved"])
        assert any(abs(got["sequential"][n] / (1.1 if n == "slower" else 1.0) - 1) > 0.2 for n in costs), got[
            "sequential"
        ]


def test_without_drift_both_designs_agree():
    for design in DESIGNS:
        assert ratios_under(design, lambda now: 1.0, {"A": 1e-3, "B": 1.5e-3}, "A", rounds=5)[0]["B"] == pytest.approx(
            1.5, rel=1e-6
        )


def test_interleaved_rounds_records_seed_orders_and_every_raw_time():
    machine = DriftingMachine(lambda now: 1.0)
    probes = {"a": machine.workload(1e-3), "b": machine.workload(2e-3), "reset:b": machine.workload(0.5e-3)}
    r = timing.interleaved_rounds(probes, rounds=6, seed=7, sample_s=0.01, clock=machine.clock)
    rec = r.record()
    assert rec["seed"] == 7 and rec["rounds"] == 6
    assert rec["orders"] == timing.shuffled_orders(list(probes), 6, 7)
    assert all(len(rec["raw_ms"][name]) == 6 for name in probes)
    assert rec["calls_per_sample"] == {"a": 10, "b": 5, "reset:b": 20}
    assert rec["raw_ms"]["a"] == pytest.approx([1.0] * 6)
    v = Variant("b", "eager", probes["b"], "note", reset=probes["reset:b"])
    assert variant_ms(r.raw_ms, v) == pytest.approx([1.5] * 6)


def test_a_smoke_runs_samples_are_one_call_each_after_one_warm_up_call():
    """sample_s 0 (--smoke): no calibration, and no Timer.timeit (which warms its statement up with
    two calls before each sample): one warm-up call per probe, then each sample is one call, so a
    probe is called once a round and once more; the times are still each call's."""
    machine = DriftingMachine(lambda now: 1.0)
    calls = {"a": 0, "b": 0}

    def probe(name, cost):
        run = machine.workload(cost)

        def call():
            calls[name] += 1
            run()

        return call

    r = timing.interleaved_rounds(
        {"a": probe("a", 1e-3), "b": probe("b", 2e-3)}, rounds=5, seed=3, sample_s=0.0, clock=machine.clock
    )
    assert r.numbers == {"a": 1, "b": 1} and calls == {"a": 6, "b": 6}
    assert r.raw_ms["a"] == pytest.approx([1.0] * 5) and r.raw_ms["b"] == pytest.approx([2.0] * 5)


def test_a_noisy_stretch_buys_more_rounds_up_to_the_cap():
    """The report's stop rule: rounds go on while a paired ratio's IQR is wide."""
    costs = {"eager/op_plus_x": 1e-3, "b": 1.05e-3}

    def run(slowdown, rounds, max_rounds, extra_s=math.inf):
        machine = DriftingMachine(slowdown)
        variants = [Variant(name, "eager", machine.workload(c), "") for name, c in costs.items()]
        settled = paired_iqr_settled(variants, max_iqr=0.1)
        r = timing.interleaved_rounds(
            variant_probes(variants),
            rounds,
            0,
            0.01,
            clock=machine.clock,
            settled=settled,
            max_rounds=max_rounds,
            extra_s=extra_s,
        )
        assert r.orders == timing.shuffled_orders(list(costs), max_rounds, 0)[: len(r.orders)]
        return len(r.orders)

    assert run(lambda now: 1.0, 5, 15) == 5
    # A load toggled every sample or so: paired ratios scatter, every extra round is taken...
    noisy = toggled_load(0, mean_s=0.01, factor=3.0)
    assert run(noisy, 5, 15) == 15
    # ... unless the time for extra rounds runs out first (a round here takes about 0.05 s).
    assert 5 < run(noisy, 5, 15, extra_s=0.2) < 15


# ----------------------------------------------------------------------------- the pure pieces
def test_shuffled_orders_are_seeded_permutations():
    names = [f"v{i}" for i in range(11)]
    orders = timing.shuffled_orders(names, 9, seed=3)
    assert len(orders) == 9 and all(sorted(o) == sorted(names) for o in orders)
    assert orders == timing.shuffled_orders(names, 9, seed=3)
    assert orders != timing.shuffled_orders(names, 9, seed=4)
    assert len({tuple(o) for o in orders}) > 1  # shuffled per round, not once


def test_steps_of_each_design():
    orders = [["b", "a"], ["a", "b"]]
    assert timing.interleaved_steps(orders) == [(0, "b"), (0, "a"), (1, "a"), (1, "b")]
    assert timing.sequential_steps(["a", "b"], 2) == [(0, "a"), (1, "a"), (0, "b"), (1, "b")]
    seen = []
    raw = timing.run_steps(timing.interleaved_steps(orders), lambda name: seen.append(name) or float(len(seen)))
    assert seen == ["b", "a", "a", "b"]
    assert raw == {"b": [1.0, 4.0], "a": [2.0, 3.0]}


def test_net_times_subtract_the_same_rounds_reset_and_divide_by_forwards():
    raw = {"v": [10.0, 20.0, 12.0], "reset:v": [1.0, 9.0, 2.0], "loop": [50.0, 60.0, 55.0]}
    assert timing.net_ms(raw, "v", "reset:v") == [9.0, 11.0, 10.0]
    assert timing.net_ms(raw, "loop", per_call=5) == [10.0, 12.0, 11.0]
    assert timing.paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]


@pytest.mark.parametrize(
    "xs", [[3.0, 1.0, 2.0, 5.0, 4.0], [1.0, 2.0, 4.0, 8.0, 9.0, 10.0], [0.9, 1.1, 1.0, 1.2, 0.95, 1.05, 1.0]]
)
def test_spread_is_median_and_quartiles(xs):
    sp = timing.spread(xs)
    assert sp.median == pytest.approx(np.median(xs))
    assert (sp.q1, sp.q3) == pytest.approx(tuple(np.quantile(xs, [0.25, 0.75])))
    assert sp.iqr == pytest.approx(sp.q3 - sp.q1) and sp.n == len(xs)


def test_within_noise_is_the_paired_interval_containing_one():
    assert timing.spread([0.97, 0.99, 1.01, 1.02, 1.04]).contains(1.0)
    assert not timing.spread([0.90, 0.92, 0.93, 0.95, 0.96]).contains(1.0)


# ----------------------------------------------------------------------------- the acceptance run
BURNER = textwrap.dedent(
    """
    import os, random, sys, time
    from multiprocessing import Process, Value

    def burn(flag):
        while True:
            if flag.value:
                x = 0
                for _ in range(20000):
                    x += 1
            else:
                time.sleep(0.002)

    if __name__ == "__main__":
        seed, mean_s, log = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
        flag = Value("b", 0)
        for _ in range(os.cpu_count()):
            Process(target=burn, args=(flag,), daemon=True).start()
        rng = random.Random(seed)
        with open(log, "w") as f:
            while True:
                f.write(f"{time.time()} {flag.value}\\n")
                f.flush()
                time.sleep(rng.expovariate(1 / mean_s))
                flag.value = 1 - flag.value
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("PLUSEQUALS_LOAD_TEST") != "1", reason="set PLUSEQUALS_LOAD_TEST=1 (two to four minutes)"
)
def test_quick_report_under_a_load_switched_at_random(tmp_path):
    """The report's acceptance run: a quick CPU report, run while a load on every core is switched on
    and off at random, puts every same-work eager strategy within +-10% of op_plus_x in every
    cell, and says which differences are within noise."""
    script, log, out = tmp_path / "burner.py", tmp_path / "load.log", tmp_path / "report"
    script.write_text(BURNER)
    burner = subprocess.Popen([sys.executable, str(script), "0", "1.0", str(log)], start_new_session=True)
    try:
        t0 = time.time()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "plusequals",
                "report",
                "--quick",
                "--device",
                "cpu",
                "--out",
                str(out),
                "--no-unet",
                "--no-audit-cost",  # the cells' noise is what this test reads
            ],
            capture_output=True,
            text=True,
        )
        t1 = time.time()
    finally:
        os.killpg(burner.pid, signal.SIGTERM)
        burner.wait()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    switches = [(float(t), int(on)) for t, on in (line.split() for line in log.read_text().splitlines())]
    on_s = sum(min(t1, b[0]) - max(t0, a[0]) for a, b in zip(switches, switches[1:] + [(t1, 0)]) if a[1] and b[0] > t0)
    data = json.loads((out / "results.json").read_text())
    report = (out / "REPORT.md").read_text()
    lines = [f"load on {on_s / (t1 - t0):.0%} of {t1 - t0:.0f} s, {len(switches)} switches"]
    worst = 0.0
    for p in data["paired"]:
        if p["variant"] in data["config"]["same_work"] and p["vs"] == "eager/op_plus_x":
            lines.append(
                f"batch {p['batch']} {p['shape']} {p['variant']}: {p['median']:.3f} [{p['q1']:.3f}, "
                f"{p['q3']:.3f}]{' within noise' if p['within_noise'] else ''}"
            )
            worst = max(worst, abs(p["median"] - 1))
    drift = [f"batch {d['batch']} {d['shape']}: max/min {d['max_over_min']:.2f}" for d in data["drift"]]
    print("\n".join(lines + drift))
    Path(os.environ.get("PLUSEQUALS_LOAD_TEST_LOG", tmp_path / "summary.txt")).write_text(
        "\n".join(lines + drift) + "\n"
    )
    assert 0.2 < on_s / (t1 - t0) < 0.8 and len(switches) > 10, lines[0]
    assert worst <= 0.10, "\n".join(lines)
    for sw in data["same_work"]:
        assert sw["inside_band"] == sw["cells"] == 16
    assert "Same work, spelled differently (batch 2)" in report and "within noise in" in report
