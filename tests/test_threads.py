"""Threads and the GIL: many Python threads on one RustBlock give the serial bits, and Rust
releases the GIL while libtorch computes."""

from __future__ import annotations

import collections
import sys
import threading

import pytest
import torch

from conftest import make_block
from plusequals import RustBlock, WeightsChanged
from support.boundary import race, same_bits, small_block, small_inputs, snapshot, unchanged


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


def _main_ran_beside(call) -> bool:
    """Whether this thread got the GIL back while another thread was inside ``call``. The switch
    interval is put out of reach (1000 s, restored after), so a thread gives up the GIL only where
    it blocks or a C call releases it: the other thread starts, signals and enters ``call`` holding
    the GIL, and this thread, waiting for it, runs before ``call`` returns only if ``call``
    released it. An order, not a rate: a busy machine cannot change the answer for a call that
    holds the GIL."""
    started, done = threading.Event(), threading.Event()

    def run():
        started.set()
        call()
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000)
    try:
        th = threading.Thread(target=run)
        th.start()
        started.wait()
        beside = not done.is_set()
        th.join()
    finally:
        sys.setswitchinterval(interval)
    return beside


@pytest.mark.parametrize("owned", [False, True], ids=["forward", "forward_owned"])
def test_gil_released_during_rust_call(one_intra_op_thread, owned):
    """Python runs while another thread is inside RustBlock.forward_loop: the GIL is released in
    Rust. Control: the same check never runs beside a C call that holds the GIL (``sum(range(n))``),
    so it can fail. A released GIL is taken by the waiting thread unless the call ends first, so the
    Rust call is long (200 forwards) and gets a few attempts; a held one never is."""
    rust = RustBlock.from_torch(small_block())
    x, c = small_inputs()
    attempts = 5
    assert not any(_main_ran_beside(lambda: sum(range(10**6))) for _ in range(attempts)), "control failed"
    beside = [_main_ran_beside(lambda: rust.forward_loop(x, c, n=200, owned=owned)) for _ in range(attempts)]
    assert any(beside), f"no Python ran beside the Rust call in {attempts} attempts: GIL held? {beside}"


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

    def attempt():
        try:
            y = rust(x, c)
        except WeightsChanged:
            return "refused"
        assert same_bits(y, expected)
        return "exact"

    with torch.no_grad():
        outcomes = race(block.attn1.to_q.weight, attempt, ("refused", "exact"), least=500)
    assert outcomes["refused"] > 0 and outcomes["exact"] > 0, outcomes
