"""Helpers shared by the boundary tests (test_boundary.py, test_donation.py, test_threads.py,
test_aliases.py, test_transaction.py): a small block, its inputs, what a caller can observe of a
tensor, and a race against a thread that writes a weight."""

from __future__ import annotations

import collections
import random
import re
import threading
import time
from typing import Callable, Sequence

import torch

from conftest import make_block, rel_err
from plusequals import DonatedTensor, _rust

TOL = 1e-5
DIM, HEADS, D_HEAD, CTX = 16, 2, 8, 12  # small: 500 fuzz cases run in seconds
# A race runs until both of its outcomes were seen, at most this many attempts: a count, not a
# wall-clock limit, so that a busy machine only makes it slower.
RACE_ATTEMPTS = 50_000


def small_block(context_dim=CTX, attention="sdpa", dtype=torch.float32, seed=0):
    return make_block(DIM, HEADS, D_HEAD, context_dim=context_dim, seed=seed, attention=attention).to(dtype)


def small_inputs(batch=2, tokens=5, seed=1, dtype=torch.float32, context_dim=CTX, ctx_tokens=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, DIM, generator=g, dtype=torch.float64).to(dtype)
    c = None
    if context_dim is not None:
        c = torch.randn(batch, ctx_tokens, context_dim, generator=g, dtype=torch.float64).to(dtype)
    return x, c


def snapshot(t):
    """What the caller can observe of a tensor: metadata, and the bits of its data."""
    if not isinstance(t, torch.Tensor) or isinstance(t, DonatedTensor):
        return None
    meta = (type(t), t.dtype, t.device, t.layout, t.is_nested, t.requires_grad)
    if t.is_nested:
        return meta, [snapshot(u) for u in t.unbind()]
    if t.layout != torch.strided:
        return meta, snapshot(t.detach().to_dense())
    meta += (tuple(t.shape), t.stride(), t.storage_offset())
    if t.device.type == "meta":
        return meta, None
    return meta, t.detach().clone()


def same_bits(a, b) -> bool:
    """Bitwise equality, NaN payloads included (compares the bytes, not the values)."""
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def unchanged(before, t) -> bool:
    after = snapshot(t)
    if before is None or after is None:
        return before is after
    (m0, d0), (m1, d1) = before, after
    if m0 != m1:
        return False
    if isinstance(d0, list):
        return len(d0) == len(d1) and all(unchanged(p, q) for p, q in zip(d0, [u for u in t.unbind()]))
    if isinstance(d0, tuple):  # sparse / mkldnn: compared densified
        return unchanged(d0, t.detach().to_dense())
    return d0 is None or same_bits(d0, d1)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same shape and dtype; NaN and inf at the same positions; finite values within TOL."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, expected.shape, got.dtype)
    got, expected = got.detach(), expected.detach()
    assert torch.equal(got.isnan(), expected.isnan()), f"{what}: NaN positions differ"
    assert torch.equal(got.isposinf(), expected.isposinf()) and torch.equal(got.isneginf(), expected.isneginf()), (
        f"{what}: inf positions differ"
    )
    finite = expected.isfinite()
    if finite.any():
        err = rel_err(got[finite], expected[finite])
        assert err <= TOL, f"{what}: relative error {err:.3g} > {TOL}"


def names(message: str, label) -> bool:
    """Whether an error message names ``label`` (an argument or a weight key) as a word."""
    text = label if isinstance(label, str) else repr(label)
    if text == "":
        return "''" in message or '""' in message
    before = r"(?<![\w.])" if "." in text else r"(?<!\w)"  # a key is not the tail of a longer key
    return re.search(rf"{before}{re.escape(text)}(?!\w)", message) is not None


def grad_context(mode: str):
    return {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]()


def _raw_block(**kw):
    block = small_block(**kw)
    return block, _rust.Block(
        dict(block.named_parameters()),
        _rust.Config(dim=DIM, n_heads=HEADS, d_head=D_HEAD, context_dim=block.context_dim),
    )


def _raw_error(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
        return e
    return None


def race(weight: torch.Tensor, attempt: Callable[[], str], wanted: Sequence[str], least: int) -> collections.Counter:
    """Calls ``attempt()`` (which names its outcome) while a thread bumps ``weight``'s version
    (adding 0.0: its values never change) in bursts with pauses between them, of seeded random
    lengths: at least ``least`` attempts and until each outcome in ``wanted`` was seen (a pause
    lets some calls through untouched, a burst overlaps others), at most :data:`RACE_ATTEMPTS`.
    The outcomes, counted."""
    stop = threading.Event()

    def writer() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            burst_end = time.perf_counter() + rng.uniform(0, 2e-3)
            while time.perf_counter() < burst_end:
                with torch.no_grad():
                    weight.add_(0.0)
            time.sleep(rng.uniform(0, 2e-3))

    thread = threading.Thread(target=writer)
    thread.start()
    outcomes: collections.Counter = collections.Counter()
    try:
        while (sum(outcomes.values()) < least or min(outcomes[w] for w in wanted) == 0) and sum(
            outcomes.values()
        ) < RACE_ATTEMPTS:
            outcomes[attempt()] += 1
    finally:
        stop.set()
        thread.join()
    return outcomes
