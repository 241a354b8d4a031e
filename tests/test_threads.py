"""Threads and the GIL: many Python threads on one RustBlock give the serial bits, and Rust
releases the GIL while libtorch computes."""

from __future__ import annotations

import collections
import random
import threading
import time

import pytest
import torch

from boundary_helpers import same_bits, small_block, small_inputs, snapshot, unchanged
from conftest import make_block
from plusequals import RustBlock, WeightsChanged

# A race runs until both of its outcomes were seen, at most this many attempts: a count, not a
# wall-clock limit, so that a busy machine only makes it slower.
RACE_ATTEMPTS = 50_000


@pytest.fixture
def one_intra_op_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["1-intra-op-thread", "default-intra-op-threads"])
def intra_op_threads(request):
    """libtorch's intra-op thread count for the test: 1, and the default (the machine's cores),
    which is what a caller gets without asking."""
    n = torch.get_num_threads()
    if request.param == "1-intra-op-thread":
        torch.set_num_threads(1)
    yield request.param
    torch.set_num_threads(n)


def test_threads_bitwise_equal_to_serial(intra_op_threads):
    """8 Python threads on one RustBlock (forward, forward_owned, donation mixed, inputs shared
    between threads) give bitwise the results of serial calls: 8 x 1000 calls on small blocks
    with one intra-op thread, and 8 x 60 calls with the default thread count on inputs large
    enough (65 536 elements, twice libtorch's grain size) that each call also parallelises
    inside libtorch."""
    if intra_op_threads == "1-intra-op-thread":
        block, n_calls = small_block(), 1000
        inputs = [small_inputs(batch=1 + i % 2, tokens=2 + i % 3, seed=10 + i) for i in range(8)]
    else:
        block, n_calls = make_block(64, 4, 16, context_dim=32), 60
        inputs = [
            (torch.randn(2, 512, 64, generator=g), torch.randn(2, 7, 32, generator=g))
            for g in (torch.Generator().manual_seed(10 + i) for i in range(8))
        ]
        assert inputs[0][0].numel() >= 2 * 32768
    rust = RustBlock.from_torch(block)
    snaps = [(snapshot(x), snapshot(c)) for x, c in inputs]
    serial_forward = [rust.forward(x, c).detach() for x, c in inputs]
    with torch.no_grad():
        serial_owned = [rust.forward_owned(x, c) for x, c in inputs]
    n_threads = 8
    barrier = threading.Barrier(n_threads)
    failures, done = [], collections.Counter()

    def worker(t):
        try:
            barrier.wait()
            for j in range(n_calls):
                i = (t + j) % len(inputs)
                x, c = inputs[i]
                mode = j % 3
                if mode == 0:
                    y, want = rust.forward(x, c), serial_forward[i]
                elif mode == 1:
                    with torch.no_grad():
                        y, want = rust.forward_owned(x, c), serial_owned[i]
                else:
                    with torch.no_grad():
                        y, want = rust.forward_owned(x.clone(), c, donate=True), serial_owned[i]
                if not same_bits(y, want):
                    failures.append((t, j, mode))
                done[t] += 1
        except BaseException as e:  # noqa: BLE001
            failures.append((t, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not failures, failures[:10]
    assert sum(done.values()) == n_threads * n_calls
    for (x, c), (sx, sc) in zip(inputs, snaps):
        assert unchanged(sx, x) and unchanged(sc, c)


def _progress_rate(counter, fn) -> float:
    start, t0 = counter[0], time.perf_counter()
    fn()
    return (counter[0] - start) / (time.perf_counter() - t0)


@pytest.mark.parametrize("owned", [False, True], ids=["forward", "forward_owned"])
def test_gil_released_during_rust_call(one_intra_op_thread, owned):
    """A pure-Python thread keeps counting while the main thread is inside a ~0.5 s
    RustBlock.forward_loop: the GIL is released in Rust. Control: the same counter almost
    stops during a C call that holds the GIL (``sum(range(n))``), so the measurement can fail.
    (During a pure-Python busy loop it gets about half: the GIL shared at the switch interval;
    reported in the message.)"""
    rust = RustBlock.from_torch(small_block())
    x, c = small_inputs()
    t0 = time.perf_counter()
    rust.forward_loop(x, c, n=200, owned=owned)
    n = max(200, int(200 * 0.5 / (time.perf_counter() - t0)))
    t0 = time.perf_counter()
    sum(range(10**6))
    n_sum = max(10**6, int(10**6 * 0.5 / (time.perf_counter() - t0)))

    counter, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    def python_busy():
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        time.sleep(0.05)
        alone = _progress_rate(counter, lambda: time.sleep(0.3))  # the counter alone (sleep releases the GIL)
        during_rust = _progress_rate(counter, lambda: rust.forward_loop(x, c, n=n, owned=owned))
        during_held = _progress_rate(counter, lambda: sum(range(n_sum)))
        during_python = _progress_rate(counter, python_busy)
    finally:
        stop.set()
        th.join()
    rates = (
        f"alone {alone:.3g}/s, during Rust {during_rust:.3g}/s, GIL held {during_held:.3g}/s, "
        f"Python busy {during_python:.3g}/s"
    )
    # Held GIL: the counter only gets the switch interval (5 ms) around the call, ~1-3 % of 0.5 s.
    assert during_held < 0.1 * alone, f"control failed: the measurement cannot see a held GIL ({rates})"
    # Released: the counter runs beside Rust (~100 % on an idle 2-core machine, ~50 % when a
    # concurrent build takes a core, like the pure-Python control).
    assert during_rust > 0.25 * alone, f"the counter stalled during the Rust call: GIL held? ({rates})"
    assert during_rust > 3 * during_held, rates


def test_a_weight_written_during_a_forward_discards_the_result():
    """The threading contract (rust/python/twins.rs, SharedBlock): the weights are shared with the
    PyTorch module, and an in-place write to one while a forward reads them makes that forward
    raise instead of returning a result from torn weights. Deterministic: a saved-tensor hook runs
    inside the Rust forward, on its thread, and writes a weight there."""
    block = small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs()
    x.requires_grad_(True)

    written = []

    def pack(t):
        if not written:  # once, on a weight no op has saved yet (libtorch refuses writes to t)
            with torch.no_grad():
                block.ff.net[2].bias.add_(0.0)  # an in-place write: the version counter moves
            written.append(True)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with pytest.raises(WeightsChanged):
            rust(x, c)
    assert written
    assert same_bits(rust(x, c), block(x, c))  # usable afterwards, with the same bits as eager


def test_concurrent_in_place_writes_raise_or_give_exact_results(one_intra_op_thread):
    """A writer thread bumps a weight's version (adding 0.0, so the values never change) in bursts
    with pauses between them, of seeded random lengths, while the reader calls forward: each call
    returns the exact serial bits or raises WeightsChanged, never anything else. The reader goes
    on until it has seen both (a pause lets some calls through untouched; a burst overlaps
    others), so the check is never vacuous, whatever the machine's scheduling."""
    block = small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs()
    with torch.no_grad():
        expected = rust(x, c)
    stop = threading.Event()

    def writer():
        rng = random.Random(0)
        while not stop.is_set():
            burst_end = time.perf_counter() + rng.uniform(0, 2e-3)
            while time.perf_counter() < burst_end:
                with torch.no_grad():
                    block.attn1.to_q.weight.add_(0.0)
            time.sleep(rng.uniform(0, 2e-3))

    w = threading.Thread(target=writer)
    w.start()
    outcomes = collections.Counter()
    try:
        with torch.no_grad():
            while (sum(outcomes.values()) < 500 or min(outcomes["refused"], outcomes["exact"]) == 0) and sum(
                outcomes.values()
            ) < RACE_ATTEMPTS:
                try:
                    y = rust(x, c)
                except WeightsChanged:
                    outcomes["refused"] += 1
                    continue
                assert same_bits(y, expected)
                outcomes["exact"] += 1
    finally:
        stop.set()
        w.join()
    assert outcomes["refused"] > 0 and outcomes["exact"] > 0, outcomes
