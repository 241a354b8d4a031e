"""The Python <-> Rust boundary, hardened: bad inputs, leaks, shared weights. Nothing crashes,
nothing mutates, nothing is lost. Donation is in test_donation.py, every alias route in
test_aliases.py, threads and the GIL in test_threads.py; their helpers in support/boundary.py.

1. Bad inputs (hypothesis, 500 cases per entry point: ``RustBlock.from_torch``,
   ``RustBlock.from_state_dict``, ``forward``, ``forward_owned``). Each call either equals the
   PyTorch block (fp32/fp64 CPU: ||a-b||/||b|| <= 1e-5, NaN/inf positions identical) or raises
   TypeError / ValueError / RuntimeError whose message names the offending argument (``x``,
   ``context``, the weight key, the constructor argument). Which it must be is decided by an
   oracle written here from the contract, not from the implementation. The fuzzers run in a
   child process, so an abort, a segfault or a Rust panic fails the test instead of the run.
2. No caller-visible mutation: after every call with ``donate=False`` the caller's tensors
   (and a state_dict's, a module's parameters) are bitwise unchanged; with ``donate=True``,
   a refused call leaves ``x`` unchanged and usable.
4. Leaks: 4000 calls (1000 of from_torch) grow the native heap by < 4 bytes per call, Python's allocated blocks by
   < 0.1 per call and RSS by < 1 MB (child process), and planted 8-byte-per-call leaks are
   caught; CUDA memory returns to baseline.
5. Shared weights: an optimizer step on the PyTorch block is seen by the RustBlock.
6. Determinism: same inputs, bitwise same outputs.

Run one fuzzer by hand (prints the falsifying example on failure)::

    .venv/bin/python tests/test_boundary.py forward      # or forward_owned, from_state_dict, from_torch
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import cuda, make_block, rel_err
from plusequals import BasicTransformerBlock, DonatedTensor, OwnershipError, RustBlock, UnsupportedBlockError, _rust
from support import compvis_reference
from support.boundary import (
    CTX,
    D_HEAD,
    DIM,
    HEADS,
    TOL,
    _raw_block,
    _raw_error,
    assert_matches,
    grad_context,
    names,
    same_bits,
    small_block,
    small_inputs,
    snapshot,
    unchanged,
)
from support.programs import python

FUZZ_CASES = 500
ALLOWED = (TypeError, ValueError, RuntimeError)
INT64_MAX = 2**63 - 1

FUZZ = settings(
    max_examples=FUZZ_CASES,
    deadline=None,
    derandomize=True,  # reproducible in CI: the same 500 cases every run
    database=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)


def pick(options):
    """One of ``options``, about uniformly: hypothesis' sampled_from / one_of / booleans lean
    hard towards their first choices, which starves the later kinds of bad input."""
    options = tuple(options)
    return st.integers(0, 2**32).map(lambda i: options[i % len(options)])


warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")  # the child processes
pytestmark = pytest.mark.filterwarnings("ignore:.*nested tensors is in prototype")


# ============================================================================ shared helpers: tests/support/boundary.py


def attempt(fn, problems, label, refused="valid call refused"):
    """Runs one generated call. With problems it must raise the expected error (checked);
    without, it must succeed. Returns (result, error); a Rust panic is a BaseException and is
    caught here so that it is reported, not lost."""
    try:
        result, err = fn(), None
    except BaseException as e:  # noqa: BLE001
        result, err = None, e
    STATS["cases"] += 1
    if problems:
        assert err is not None, f"{label}: accepted, expected an error"
        check_error(err, problems, label)
        STATS["error"] += 1
    else:
        assert err is None, f"{label}: {refused}: {type(err).__name__}: {err}"
    return result, err


def check_error(err: BaseException, problems, context: str) -> None:
    """``err`` is one of the allowed types, names an offending argument, and its type is one
    that one of the problems calls for."""
    assert isinstance(err, ALLOWED), f"{context}: {type(err).__module__}.{type(err).__name__}: {err}"
    message = str(err)
    labels = {label for label, _ in problems}
    assert any(names(message, label) for label in labels), (
        f"{context}: message names none of {sorted(map(str, labels))}: {type(err).__name__}: {message[:300]}"
    )
    wanted = {EXPECTED_TYPE[cat] for _, cat in problems}
    if ValueError in wanted:  # a block refused for what it is: the refusal class (a ValueError)
        wanted.add(UnsupportedBlockError)
    assert type(err) in wanted, f"{context}: {type(err).__name__} for {problems}: {message[:300]}"


# problem category -> the exception it calls for
EXPECTED_TYPE = {
    "type": TypeError,
    "donated": RuntimeError,
    "requires_grad": RuntimeError,
    "layout": ValueError,
    "device": ValueError,
    "shape": ValueError,
    "empty": ValueError,
    "dtype": ValueError,
    "batch": ValueError,
    "missing": ValueError,
    "donate": OwnershipError,
    "value": ValueError,
    "key": ValueError,
    "keytype": TypeError,
}


# ============================================================================ 1. fuzz: forward, forward_owned

BLOCK_KINDS = {
    "cross": dict(context_dim=CTX, attention="sdpa", dtype=torch.float32),
    "self": dict(context_dim=None, attention="einsum", dtype=torch.float32),
    "cross64": dict(context_dim=CTX, attention="sdpa", dtype=torch.float64),
}


@functools.lru_cache(maxsize=None)
def fuzz_block(kind: str):
    cfg = BLOCK_KINDS[kind]
    block = small_block(cfg["context_dim"], cfg["attention"], cfg["dtype"])
    return block, RustBlock.from_torch(block)


def donated_tensor() -> DonatedTensor:
    _, rust = fuzz_block("self")
    t = torch.randn(1, 2, DIM)
    with torch.no_grad():
        rust.forward_owned(t, None, donate=True)
    assert isinstance(t, DonatedTensor)
    return t


NON_TENSORS = ([[0.0] * DIM], 1.0, "x", np.zeros((2, 3, DIM), np.float32), object(), (1, 2, 3))
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)
OFFENSES = (
    "rank2",
    "rank4",
    "rank0",
    "width",
    "batch0",
    "tokens0",
    "dtype",
    "meta",
    "sparse",
    "mkldnn",
    "nested",
    "nontensor",
    "donated",
    "batch",
)  # "batch": another batch than x's (context only)
LAYOUTS = ("contiguous", "contiguous", "transposed", "expanded", "sliced")
SPECIALS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}

tensor_specs = st.fixed_dictionaries(
    {
        "offense": pick((None,) * len(OFFENSES) + OFFENSES),  # half the tensors valid
        "arg": st.integers(0, 10**6),
        "tokens": pick(range(1, 7)),
        "layout": pick(LAYOUTS),
        "requires_grad": pick([False, True]),
        "specials": st.lists(st.tuples(pick(sorted(SPECIALS)), st.integers(0, 10**6)), max_size=2),
        "seed": st.integers(0, 2**16),
    }
)
call_specs = st.fixed_dictionaries(
    {
        "block": pick(sorted(BLOCK_KINDS)),
        "batch": pick([1, 2, 3]),
        "x": tensor_specs,
        "context": tensor_specs,
        "context_none": pick([True, False, False, False]),  # context=None instead of the tensor
        "grad_mode": pick(["grad", "no_grad", "inference"]),
        "donate": pick([False, True]),  # forward_owned only
    }
)


def build_tensor(spec, batch: int, width: int, dtype: torch.dtype):
    """The tensor a spec describes, and whether it owns its storage alone, densely (donatable)."""
    off, arg = spec["offense"], spec["arg"]
    if off == "nontensor":
        return NON_TENSORS[arg % len(NON_TENSORS)], False
    if off == "donated":
        return donated_tensor(), False
    b = {"batch0": 0, "batch": batch + 1 if arg % 2 or batch == 1 else batch - 1}.get(off, batch)
    n = 0 if off == "tokens0" else spec["tokens"]
    w = width + (-1, 1, 3 - width, 7)[arg % 4] if off == "width" else width
    g = torch.Generator().manual_seed(spec["seed"])
    t = torch.randn(b, n, w, generator=g, dtype=torch.float64)
    flat = t.view(-1)
    for name, pos in spec["specials"]:
        if flat.numel():
            flat[pos % flat.numel()] = SPECIALS[name]
    t = t.to(DTYPES[arg % len(DTYPES)] if off == "dtype" else dtype)
    if spec["requires_grad"] and (t.dtype.is_floating_point or t.dtype.is_complex) and off not in ("mkldnn", "nested"):
        t.requires_grad_(True)
    t, dense = laid_out(t, spec["layout"])
    t, same = offending_form(t, off)
    return t, dense and same


# The layouts of a valid tensor: the same values, another memory (none owns its storage densely)
LAYOUTS = {
    "transposed": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),  # strides of a (b, w, n) tensor
    "expanded": lambda t: t[:, :1].expand(t.shape),  # stride 0 along the tokens
    "sliced": lambda t: t.repeat(1, 1, 2)[..., ::2],  # every other element of a wider buffer
}
# The offenses that change a tensor's form: (the change, whether the result still owns its storage)
FORMS = {
    "rank2": (lambda t: t.reshape(t.shape[0] * t.shape[1], t.shape[2]), False),
    "rank4": (lambda t: t[None], False),
    "rank0": (lambda t: t.sum(), True),
    "meta": (lambda t: t.detach().to("meta"), True),
    "sparse": (lambda t: t.detach().to_sparse(), True),
    "mkldnn": (lambda t: t.detach().float().contiguous().to_mkldnn(), True),
    "nested": (
        lambda t: torch.nested.nested_tensor([u for u in t.detach().float()] or [torch.zeros(t.shape[1:])]),
        True,
    ),
}


def laid_out(t, layout: str):
    """``t`` in ``layout``, and whether it still owns its storage alone, densely."""
    return (LAYOUTS[layout](t), False) if layout in LAYOUTS else (t, True)


def offending_form(t, off):
    """``t`` changed as the offense ``off`` says, and whether that kept it donatable."""
    return (FORMS[off][0](t), FORMS[off][1]) if off in FORMS else (t, True)


def input_problems(t, role: str, block_kind: str, x_batch):
    """The contract for x / context, written out: [(argument, category)]; [] when valid."""
    cfg = BLOCK_KINDS[block_kind]
    width = DIM if role == "x" else (cfg["context_dim"] or DIM)
    if t is None:
        if role == "context":
            return [] if cfg["context_dim"] is None else [(role, "missing")]
        return [(role, "type")]
    if not isinstance(t, torch.Tensor):
        return [(role, "type")]
    if isinstance(t, DonatedTensor):
        return [(role, "donated")]
    if t.is_nested or t.layout != torch.strided:
        return [(role, "layout")]
    problems = []
    if t.device != torch.device("cpu"):
        problems.append((role, "device"))
    if t.dim() != 3 or t.shape[-1] != width:
        problems.append((role, "shape"))
    elif t.shape[0] == 0 or t.shape[1] == 0:
        problems.append((role, "empty"))
    if t.dtype != cfg["dtype"]:
        problems.append((role, "dtype"))
    if role == "context" and not problems and x_batch is not None and t.shape[0] != x_batch:
        problems.append((role, "batch"))
    return problems


def call_problems(x, c, kind: str, owned_under_grad: bool, donate: bool, x_fresh: bool):
    """The contract for a call: the inputs', then what forward_owned adds (no input that requires
    grad under grad mode; a donated x must own its storage and not be the context too)."""
    problems = input_problems(x, "x", kind, None)
    problems += input_problems(c, "context", kind, x.shape[0] if not problems else None)
    plain = {role: t for role, t in (("x", x), ("context", c)) if is_plain(t)}
    if owned_under_grad:
        problems += [(role, "requires_grad") for role, t in plain.items() if t.requires_grad]
    if donate and "x" in plain and not x_fresh:
        problems.append(("x", "donate"))
    elif donate and "x" in plain and c is x:
        problems.append(("context", "donate"))
    return problems


def is_plain(t) -> bool:
    """A tensor, not a donated one."""
    return isinstance(t, torch.Tensor) and not isinstance(t, DonatedTensor)


STATS: collections.Counter = collections.Counter()


def fuzz_call(spec, owned: bool) -> None:
    kind, batch = spec["block"], spec["batch"]
    block, rust = fuzz_block(kind)
    cfg = BLOCK_KINDS[kind]
    x, x_fresh = build_tensor(spec["x"], batch, DIM, cfg["dtype"])
    c = None
    if not spec["context_none"]:
        c, _ = build_tensor(spec["context"], batch, cfg["context_dim"] or DIM, cfg["dtype"])
    donate = owned and spec["donate"]
    mode = spec["grad_mode"]
    problems = call_problems(x, c, kind, owned and mode == "grad", donate, x_fresh)

    x_before, c_before = snapshot(x), snapshot(c)
    expected = None
    if not problems:
        with torch.no_grad():
            expected = block(x.detach().clone(), None if c is None else c.detach().clone())
        x_ptr = x.data_ptr()

    label = f"{'forward_owned' if owned else 'forward'}(donate={donate}, {mode}) on {kind}, problems={problems}"
    with grad_context(mode):
        got, err = attempt(
            lambda: rust.forward_owned(x, c, donate=donate) if owned else rust.forward(x, c),
            problems,
            label,
            "valid input refused",
        )
    for role, cat in problems:
        STATS[f"{role}:{cat}"] += 1
    if spec["x"]["specials"] and not problems:
        STATS["valid with NaN/inf"] += 1
    if not problems:
        assert_matches(got, expected, label)
        if owned:
            assert not got.requires_grad, f"{label}: forward_owned returned a tensor that requires grad"
        elif mode == "grad":
            assert got.requires_grad, f"{label}: forward under grad mode lost the graph"
        STATS["ok"] += 1

    # 2. no caller-visible mutation; with donate, nothing is lost on a refusal
    assert unchanged(c_before, c), f"{label}: context was mutated"
    if donate and err is None:
        assert isinstance(x, DonatedTensor), f"{label}: the donated x is still usable"
        assert got.data_ptr() == x_ptr, f"{label}: donate=True did not return x's buffer"
        STATS["donated"] += 1
    else:
        assert not isinstance(x, DonatedTensor) or spec["x"]["offense"] == "donated", f"{label}: x invalidated"
        assert unchanged(x_before, x), f"{label}: x was mutated"


def sweep_every_offense(test):
    """Explicit examples (run before the 500 generated ones): each offense once as x and once as
    context, so every kind of bad input is exercised whatever the generator's luck."""
    valid = dict(offense=None, arg=1, tokens=3, layout="contiguous", requires_grad=False, specials=[], seed=0)
    for role in ("x", "context"):
        for i, offense in enumerate(OFFENSES):
            spec = dict(
                block=("cross", "self", "cross64")[i % 3],
                batch=2,
                x=dict(valid),
                context=dict(valid),
                context_none=False,
                grad_mode=("grad", "no_grad", "inference")[i % 3],
                donate=bool(i % 2),
            )
            spec[role] = dict(valid, offense=offense, arg=i, requires_grad=bool(i % 4 == 0))
            test = example(spec)(test)
    return test


@FUZZ
@given(call_specs)
@sweep_every_offense
def fuzz_forward(spec):
    fuzz_call(spec, owned=False)


def with_valid_donations(test):
    """Explicit examples of valid donations (12, every block kind, both grad-free modes), so the
    fuzz's donations never rest on the generator's luck: how many valid ones it draws moves with
    anything its strategies read (528 cases drew 31 before the derived watch, 6 after)."""
    valid = dict(offense=None, arg=1, tokens=3, layout="contiguous", requires_grad=False, specials=[])
    for i in range(12):
        spec = dict(
            block=("cross", "self", "cross64")[i % 3],
            batch=1 + i % 3,
            x=dict(valid, seed=i),
            context=dict(valid, seed=100 + i),
            context_none=False,
            grad_mode=("no_grad", "inference")[i % 2],
            donate=True,
        )
        test = example(spec)(test)
    return test


@FUZZ
@given(call_specs)
@sweep_every_offense
@with_valid_donations
def fuzz_forward_owned(spec):
    fuzz_call(spec, owned=True)


# ============================================================================ 1. fuzz: from_state_dict

BASE_CONFIGS = [
    (gated, ctx, attention) for gated in (True, False) for ctx in (CTX, None) for attention in ("sdpa", "einsum")
]
EXTRA_KEYS = (
    "attn3.to_q.weight",
    "attn1.to_q.bias",
    "norm4.weight",
    "ff.net.1.weight",
    "ff.net.0.proj.weight.t",
    "",
    "attn1.to_out.1.weight",
    "norm1.running_mean",
    "ff.net.0.0.weight",
    "ff.net.0.proj.bias",
)
NONSTR_KEYS = (0, b"attn1.to_q.weight", ("attn1", "to_q"), 1.5, None)
WEIGHT_OPS = (
    "drop",
    "extra",
    "reshape",
    "dtype",
    "meta",
    "nontensor",
    "nonstr_key",
    "sparse",
    "nested",
    "donated",
    "noncontig",
    "expand",
    "requires_grad",
    "nan",
)  # the last four are valid
BAD_VALUES = {
    "dim": (8, 15, 32, 0, -16, 2**40, 2**62, 2**70, 16.0, "16", None, True, np.int64(16)),
    "n_heads": (1, 4, 3, 0, -2, 2**33, 2**62, 2.0, "2", None, True, np.int32(2)),
    "d_head": (4, 16, 7, 0, -8, 2**33, 2**62, 8.0, "8", None, False),
    "context_dim": (None, 12, 16, 11, 0, -1, 2**70, "12", 12.0, True),
    "gated_ff": ("flip", None, "yes", 1),
    "attention": ("flash", None, 1, "SDPA", "einsum", "sdpa"),
    "heads_split": ((1, 16), (4, 4), (8, 2), (16, 1)),
}


@functools.lru_cache(maxsize=None)
def base_block(gated, ctx, attention):
    return make_block(DIM, HEADS, D_HEAD, context_dim=ctx, gated_ff=gated, attention=attention, seed=3)


def expected_shapes(dim, n_heads, d_head, context_dim, gated_ff):
    """The CompVis state_dict layout (checked against the PyTorch block in fuzz_from_state_dict)."""
    inner, cd, ff = n_heads * d_head, context_dim or dim, 4 * dim
    shapes = {}
    for attn, kv in (("attn1", dim), ("attn2", cd)):
        shapes.update(
            {
                f"{attn}.to_q.weight": (inner, dim),
                f"{attn}.to_k.weight": (inner, kv),
                f"{attn}.to_v.weight": (inner, kv),
                f"{attn}.to_out.0.weight": (dim, inner),
                f"{attn}.to_out.0.bias": (dim,),
            }
        )
    proj = "ff.net.0.proj" if gated_ff else "ff.net.0.0"
    shapes.update(
        {
            f"{proj}.weight": (2 * ff if gated_ff else ff, dim),
            f"{proj}.bias": (2 * ff if gated_ff else ff,),
            "ff.net.2.weight": (dim, ff),
            "ff.net.2.bias": (dim,),
        }
    )
    for norm in ("norm1", "norm2", "norm3"):
        shapes.update({f"{norm}.weight": (dim,), f"{norm}.bias": (dim,)})
    return shapes


def config_problems(cfg):
    problems = []
    for name in ("dim", "n_heads", "d_head", "context_dim"):
        v = cfg[name]
        if name == "context_dim" and v is None:
            continue
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            problems.append((name, "type"))
        elif v <= 0:
            problems.append((name, "value"))
    if not problems:
        cfg = {k: int(v) if isinstance(v, np.integer) else v for k, v in cfg.items()}
        if cfg["n_heads"] * cfg["d_head"] > INT64_MAX:
            problems += [("n_heads", "value"), ("d_head", "value")]
        for name in ("dim", "context_dim"):
            if cfg[name] is not None and 8 * cfg[name] > INT64_MAX:
                problems.append((name, "value"))
    if not isinstance(cfg["gated_ff"], bool):
        problems.append(("gated_ff", "type"))
    if not isinstance(cfg["attention"], str):
        problems.append(("attention", "type"))
    elif cfg["attention"] not in ("sdpa", "einsum"):
        problems.append(("attention", "value"))
    return problems


def weight_problems(weights, cfg):
    """The contract for a state_dict, in the order it is checked: each entry alone, then the
    entries' dtypes and devices together, then the keys and shapes the config asks for."""
    return entry_problems(weights) or dtype_problems(weights) or shape_problems(weights, cfg)


def entry_problems(weights):
    problems = []
    for key, value in weights.items():
        if not isinstance(key, str):
            problems.append((key, "keytype"))
        elif not isinstance(value, torch.Tensor):
            problems.append((key, "type"))
        elif isinstance(value, DonatedTensor):
            problems.append((key, "donated"))
        elif value.is_nested or value.layout != torch.strided:
            problems.append((key, "layout"))
    return problems


def dtype_problems(weights):
    """One (dtype, device) for every weight, a floating one: the minority groups are named."""
    problems = []
    groups = collections.defaultdict(list)
    for key, value in weights.items():
        groups[(value.dtype, value.device)].append(key)
    if len(groups) > 1:
        largest = max(len(keys) for keys in groups.values())
        for keys in groups.values():
            if len(keys) < largest or sum(len(k) == largest for k in groups.values()) > 1:
                problems += [(key, "dtype") for key in keys]
        return problems
    if groups and not next(iter(groups))[0].is_floating_point:
        return [(key, "dtype") for key in weights]
    return problems


def shape_problems(weights, cfg):
    problems = []
    if config_problems(cfg):
        return problems
    shapes = expected_shapes(cfg["dim"], cfg["n_heads"], cfg["d_head"], cfg["context_dim"], cfg["gated_ff"])
    for key in shapes:
        if key not in weights:
            problems.append((key, "missing"))
        elif tuple(weights[key].shape) != shapes[key]:
            problems.append((key, "shape"))
    problems += [(key, "key") for key in weights if key not in shapes]
    return problems


state_dict_specs = st.fixed_dictionaries(
    {
        "base": pick(BASE_CONFIGS),
        "ops": st.lists(st.tuples(pick(WEIGHT_OPS), st.integers(0, 10**6), st.integers(0, 10**6)), max_size=3),
        "config": pick([None] * len(BAD_VALUES) + sorted(BAD_VALUES)).flatmap(
            lambda name: st.just(None) if name is None else st.tuples(st.just(name), st.integers(0, 10**6))
        ),
    }
)


def apply_weight_op(weights, op, i, j):
    keys = sorted(k for k in weights if isinstance(k, str))
    if not keys and op not in ("extra", "nonstr_key"):
        return
    key = keys[i % len(keys)] if keys else None
    value = weights.get(key)
    if op == "drop":
        del weights[key]
    elif op == "extra":
        weights[EXTRA_KEYS[j % len(EXTRA_KEYS)]] = torch.randn(3, DIM)
    elif op == "nonstr_key":
        weights[NONSTR_KEYS[j % len(NONSTR_KEYS)]] = torch.randn(DIM)
    elif not is_plain(value) or value.is_nested or value.layout != torch.strided:
        return
    elif value.device.type == "meta" and op in ("sparse", "nested", "noncontig", "expand", "nan"):
        return
    elif op in WEIGHT_CHANGES:
        weights[key] = WEIGHT_CHANGES[op](value, j)


def reshaped(value, j):
    shape = list(value.shape)
    variants = [shape + [1], shape[::-1], [3], [2], [], [0]]
    if shape:
        variants[2:4] = [[shape[0] + 1] + shape[1:], shape[:-1] + [max(shape[-1] - 1, 0)]]
    return torch.randn(variants[j % len(variants)])


def with_nan(value, j):
    if value.device.type != "cpu" or not value.dtype.is_floating_point or not value.numel():
        return value
    value = value.clone()
    value.view(-1)[j % value.numel()] = float("nan")
    return value


# What each op puts in a weight's place: (the weight, the op's second number) -> the new value
WEIGHT_CHANGES = {
    "reshape": reshaped,
    "dtype": lambda value, j: value.to(DTYPES[j % len(DTYPES)]),
    "meta": lambda value, j: value.to("meta"),
    "nontensor": lambda value, j: NON_TENSORS[j % len(NON_TENSORS)],
    "sparse": lambda value, j: value.to_sparse(),
    "nested": lambda value, j: torch.nested.nested_tensor([value.reshape(-1, value.shape[-1]).float()]),
    "donated": lambda value, j: donated_tensor(),
    "noncontig": lambda value, j: torch.stack([value, value], dim=-1)[..., 0],  # same shape and values, strides doubled
    "expand": lambda value, j: value.reshape(-1)[:1].expand(value.shape) if value.dim() and value.numel() else value,
    "requires_grad": lambda value, j: value.detach().clone().requires_grad_(True),
    "nan": with_nan,
}


def sweep_state_dicts(test):
    """Explicit examples: every weight mutation and every bad constructor value once."""
    for i, op in enumerate(WEIGHT_OPS):
        test = example(dict(base=BASE_CONFIGS[i % len(BASE_CONFIGS)], ops=[(op, 7 * i, i)], config=None))(test)
    for name, values in BAD_VALUES.items():
        for k in range(len(values)):
            test = example(dict(base=BASE_CONFIGS[k % len(BASE_CONFIGS)], ops=[], config=(name, k)))(test)
    return test


@FUZZ
@given(state_dict_specs)
@sweep_state_dicts
def fuzz_from_state_dict(spec):
    gated, ctx, attention = spec["base"]
    block = base_block(gated, ctx, attention)
    shapes = expected_shapes(DIM, HEADS, D_HEAD, ctx, gated)
    assert shapes == {k: tuple(v.shape) for k, v in block.state_dict().items()}, "expected_shapes is not CompVis'"
    weights = {k: v.detach().clone() for k, v in block.state_dict().items()}
    for op, i, j in spec["ops"]:
        apply_weight_op(weights, op, i, j)
        STATS[f"op:{op}"] += 1
    cfg = dict(dim=DIM, n_heads=HEADS, d_head=D_HEAD, context_dim=ctx, gated_ff=gated, attention=attention)
    perturbed = None
    if spec["config"] is not None:
        perturbed, k = spec["config"]
        value = BAD_VALUES[perturbed][k % len(BAD_VALUES[perturbed])]
        if perturbed == "heads_split":
            cfg["n_heads"], cfg["d_head"] = value
        elif perturbed == "gated_ff" and value == "flip":
            cfg["gated_ff"] = not gated
        else:
            cfg[perturbed] = value
        STATS[f"config:{perturbed}"] += 1

    problems = config_problems(cfg) + weight_problems(weights, cfg)
    # A well-formed config that disagrees with the weights shows up as weight problems; the
    # message may then name the argument instead of a key.
    if perturbed not in (None, "heads_split") and not config_problems(cfg):
        if any(cat in ("shape", "missing", "key") for _, cat in problems):
            problems.append((perturbed, "shape"))
    items_before = list(weights.items())
    snaps = {k: snapshot(v) for k, v in weights.items()}
    label = f"from_state_dict(ops={spec['ops']}, config={cfg}), problems={problems}"

    rust, _ = attempt(lambda: RustBlock.from_state_dict(weights, **cfg), problems, label, "valid state_dict refused")
    if not problems:
        ref = BasicTransformerBlock(
            cfg["dim"],
            cfg["n_heads"],
            cfg["d_head"],
            context_dim=cfg["context_dim"],
            gated_ff=cfg["gated_ff"],
            attention=cfg["attention"],
        )
        ref.load_state_dict(weights, strict=True)
        x, c = small_inputs(context_dim=cfg["context_dim"])
        with torch.no_grad():
            assert_matches(rust.forward(x, c), ref(x, c), label)
        STATS["ok"] += 1
    assert list(weights.items()) == items_before, f"{label}: the state_dict mapping was changed"
    for key, value in weights.items():
        assert unchanged(snaps[key], value), f"{label}: weight {key!r} was mutated"


# ============================================================================ 1. fuzz: from_torch

NON_BLOCKS = (
    "none",
    "dict",
    "state_dict",
    "linear",
    "module",
    "str",
    "int",
    "cross_attention",
    "rust_block",
    "compvis",
)
MODULE_OPS = (
    "param_dtype",
    "param_shape",
    "param_meta",
    "extra_param",
    "extra_sub_param",
    "no_bias",
    "heads",
    "attn2_heads",
    "scale",
    "frozen",
    "train",
)

from_torch_specs = st.fixed_dictionaries(
    {
        "object": pick(("block",) * 2 * len(NON_BLOCKS) + NON_BLOCKS),
        "dim": pick([8, 16, 24]),
        "heads": pick([1, 2, 4]),
        "d_head": pick([4, 8]),
        "context_dim": pick([None, 12, 20]),
        "gated": pick([False, True]),
        "attention": pick(["sdpa", "einsum"]),
        "dtype": pick([torch.float32, torch.float64]),
        "meta": pick([True] + [False] * 9),
        "checkpoint": pick([False, True]),
        "op": pick((None,) * len(MODULE_OPS) + MODULE_OPS),
        "arg": st.integers(0, 10**6),
        "seed": st.integers(0, 1000),
        "trust": pick([None, "probe"]),
    }
)


def make_fuzz_module(spec):
    """The object to hand to from_torch, and its problems ([] when it is a valid block)."""
    kind = spec["object"]
    if kind in NOT_BLOCKS:
        return NOT_BLOCKS[kind](spec), [("block", "type")]
    if kind == "compvis":  # another CompVis implementation: valid after a probe, refused by default
        from conftest import randomize_

        block = randomize_(
            compvis_reference.BasicTransformerBlock(
                spec["dim"], spec["heads"], spec["d_head"], context_dim=spec["context_dim"]
            ),
            spec["seed"],
        ).eval()
        return block, [] if spec["trust"] else [("support.compvis_reference.BasicTransformerBlock", "value")]

    block = make_block(
        spec["dim"],
        spec["heads"],
        spec["d_head"],
        context_dim=spec["context_dim"],
        gated_ff=spec["gated"],
        seed=spec["seed"],
        attention=spec["attention"],
        checkpoint=spec["checkpoint"],
    ).to(spec["dtype"])
    params = sorted(block.named_parameters())
    key, p = params[spec["arg"] % len(params)]
    change = BLOCK_CHANGES.get(spec["op"])
    problems = change(block, spec, key, p) if change else []
    if spec["meta"]:
        block = block.to("meta")
        if spec["op"] == "param_meta":  # on meta, a meta parameter is no longer the odd one out
            problems = []
    return block, problems


# Objects that are not a block: from_torch refuses each as ("block", "type")
NOT_BLOCKS = {
    "none": lambda spec: None,
    "dict": lambda spec: {},
    "str": lambda spec: "block",
    "int": lambda spec: 3,
    "state_dict": lambda spec: small_block().state_dict(),
    "linear": lambda spec: nn.Linear(spec["dim"], spec["dim"]),
    "module": lambda spec: nn.Module(),
    "cross_attention": lambda spec: small_block().attn1,
    "rust_block": lambda spec: fuzz_block("cross")[1],
}


def _param_dtype(block, spec, key, p):
    p.data = p.data.to(torch.float32 if spec["dtype"] == torch.float64 else torch.float64)
    return [(key, "dtype")]


def _replaced_param(block, key, value):
    owner, leaf = key.rsplit(".", 1)
    setattr(block.get_submodule(owner), leaf, nn.Parameter(value))


def _param_shape(block, spec, key, p):
    _replaced_param(block, key, torch.randn(*p.shape[:-1], p.shape[-1] + 1, dtype=spec["dtype"]))
    return [(key, "shape")]


def _param_meta(block, spec, key, p):
    _replaced_param(block, key, p.detach().to("meta"))
    return [(key, "device")]


def _extra_param(block, spec, key, p):
    block.register_parameter("extra", nn.Parameter(torch.zeros(spec["dim"], dtype=spec["dtype"])))
    return [("extra", "key")]


def _extra_sub_param(block, spec, key, p):
    block.attn1.register_parameter("temperature", nn.Parameter(torch.ones(1, dtype=spec["dtype"])))
    return [("attn1.temperature", "key")]


def _no_bias(block, spec, key, p):
    block.attn2.to_out[0].bias = None
    return [("attn2.to_out.0.bias", "missing")]


def _heads(block, spec, key, p):
    """Both attentions re-split into other heads (scale to match): valid if they divide."""
    heads = (1, 3, 4, 16)[spec["arg"] % 4]
    inner = spec["heads"] * spec["d_head"]
    for attn in (block.attn1, block.attn2):
        attn.heads, attn.scale = heads, max(inner // heads, 1) ** -0.5
    return [("attn1.to_q.weight", "shape"), ("heads", "shape"), ("d_head", "value")] if inner % heads else []


def _attn2_heads(block, spec, key, p):
    """attn1 and attn2 disagree: the Rust block has one head count."""
    block.attn2.heads = spec["heads"] * 2
    return [("heads", "value")]


def _scale(block, spec, key, p):
    """A softmax scale other than d_head ** -0.5: the Rust block derives it."""
    (block.attn1 if spec["arg"] % 2 else block.attn2).scale = 1.0 / spec["d_head"]
    return [("scale", "value")]


# The changes to a valid block: (block, spec, a parameter's key, the parameter) -> its problems
BLOCK_CHANGES = {
    "param_dtype": _param_dtype,
    "param_shape": _param_shape,
    "param_meta": _param_meta,
    "extra_param": _extra_param,
    "extra_sub_param": _extra_sub_param,
    "no_bias": _no_bias,
    "heads": _heads,
    "attn2_heads": _attn2_heads,
    "scale": _scale,
    "frozen": lambda block, spec, key, p: _valid(block.requires_grad_(False)),
    "train": lambda block, spec, key, p: _valid(block.train()),
}


def _valid(block) -> list:
    """A change that leaves the block valid: no problems."""
    return []


def sweep_modules(test):
    """Explicit examples: every non-block object and every module change once (the latter also
    on the meta device)."""
    valid = dict(
        object="block",
        dim=16,
        heads=2,
        d_head=8,
        context_dim=12,
        gated=True,
        attention="sdpa",
        dtype=torch.float32,
        meta=False,
        checkpoint=False,
        op=None,
        arg=0,
        seed=0,
        trust=None,
    )
    for obj in NON_BLOCKS:
        test = example(dict(valid, object=obj))(test)
    test = example(dict(valid, object="compvis", trust="probe"))(test)
    for i, op in enumerate(MODULE_OPS):
        for meta in (False, True):
            test = example(dict(valid, op=op, arg=i, meta=meta, dtype=(torch.float32, torch.float64)[i % 2]))(test)
    return test


REFUSED: list = []  # the modules from_torch refused in this process


def refused_yet_followed() -> int:
    """How many modules from_torch refused are still followed once everything is collected: a
    refusal follows nothing, so no twin of it lets go of the module's parameters (twin/letgo.py)."""
    from plusequals.twin import letgo

    gc.collect()
    refused = {id(m) for m in REFUSED}
    return sum(1 for f in list(letgo._FOLLOWS) if id(f.source) in refused)


def module_state(module: nn.Module) -> list:
    """What from_torch must leave as it was on the module it reads: every submodule (by identity,
    in order), its training flag, and each attribute and each entry of its dicts (parameters,
    buffers, submodules, hooks) by identity. The objects are held, so no id can be reused."""
    return [
        (name, m, m.training, dict(vars(m)), {k: dict(d) for k, d in vars(m).items() if isinstance(d, dict)})
        for name, m in module.named_modules(remove_duplicate=False)
    ]


def same_module_state(before: list, after: list) -> str | None:
    """None when ``after`` is ``before``; else what differs."""
    if [(n, m) for n, m, *_ in before] != [(n, m) for n, m, *_ in after]:
        return "its submodules"
    for (name, m, training, attrs, dicts), (_, _, training2, attrs2, dicts2) in zip(before, after):
        where = name or "the block"
        if training != training2:
            return f"{where}.training"
        changed = sorted(set(attrs) ^ set(attrs2)) + [k for k in attrs if k in attrs2 and attrs[k] is not attrs2[k]]
        changed += [
            f"{k}[{e!r}]"
            for k in dicts
            for e in set(dicts[k]) | set(dicts2.get(k, {}))
            if dicts[k].get(e) is not dicts2.get(k, {}).get(e)
        ]
        if changed:
            return f"{where}: {', '.join(map(str, changed))}"
    return None


@FUZZ
@given(from_torch_specs)
@sweep_modules
def fuzz_from_torch(spec):
    module, problems = make_fuzz_module(spec)
    STATS[f"object:{spec['object']}"] += 1
    if spec["object"] == "block":
        STATS[f"op:{spec['op']}"] += 1
    snaps = {k: snapshot(v) for k, v in module.named_parameters()} if isinstance(module, nn.Module) else {}
    state = module_state(module) if isinstance(module, nn.Module) else None
    label = f"from_torch({spec}), problems={problems}"
    adopt = functools.partial(RustBlock.from_torch, module, trust=spec["trust"])
    rust, err = attempt(adopt, problems, label, "valid block refused")
    del err  # its traceback holds the refused twin's frames
    if state is not None:  # read, built and probed, or refused: the module is as it was
        differs = same_module_state(state, module_state(module))
        assert differs is None, f"{label}: from_torch changed {differs}"
        if problems:  # checked once at the end (refused_yet_followed): a collection per case costs 30 s
            REFUSED.append(module)
        STATS["module unchanged"] += 1

    if not problems:
        device = next(module.parameters()).device
        dtype = next(module.parameters()).dtype
        ctx = spec["context_dim"]
        x = torch.randn(2, 3, spec["dim"], dtype=dtype)
        c = None if ctx is None else torch.randn(2, 4, ctx, dtype=dtype)
        x, c = x.to(device), None if c is None else c.to(device)
        with torch.no_grad():
            got = rust.forward(x, c)
            if device.type == "meta":
                assert got.shape == (2, 3, spec["dim"]) and got.device.type == "meta", label
            else:
                module.eval()  # dropout is 0 anyway; train() only flips the flag
                assert_matches(got, module(x, c), label)
        STATS["ok"] += 1
    for k, v in module.named_parameters() if isinstance(module, nn.Module) else ():
        assert unchanged(snaps[k], v), f"{label}: parameter {k} was mutated"


def test_the_module_state_check_sees_each_change_from_torch_must_not_make():
    """fuzz_from_torch's check of the module it read can fail: an attribute set, a hook added, a
    training flag flipped, a parameter or a submodule replaced, each named."""
    changes = {
        "the block: extra": lambda b: setattr(b, "extra", 1),
        "attn1: _forward_pre_hooks": lambda b: b.attn1.register_forward_pre_hook(lambda m, a: None),
        "norm1.training": lambda b: b.norm1.train(not b.norm1.training),
        "_parameters['weight']": lambda b: setattr(b.norm2, "weight", nn.Parameter(b.norm2.weight.detach().clone())),
        "its submodules": lambda b: setattr(b.attn2, "to_q", nn.Linear(b.attn2.to_q.in_features, 1, bias=False)),
    }
    for named, change in changes.items():
        block = small_block()
        before = module_state(block)
        assert same_module_state(before, module_state(block)) is None
        change(block)
        differs = same_module_state(before, module_state(block))
        assert differs is not None and named in differs, (named, differs)


FUZZERS = {
    "forward": fuzz_forward,
    "forward_owned": fuzz_forward_owned,
    "from_state_dict": fuzz_from_state_dict,
    "from_torch": fuzz_from_torch,
}


# ============================================================================ child processes

REPO = Path(__file__).resolve().parent.parent


def run_child(args, timeout=None) -> dict:
    """Runs ``python <args>`` in a child process; a crash (negative return code: killed by a
    signal, e.g. SIGABRT from a C++ abort or SIGSEGV) or any failure fails the caller. Returns
    the JSON report the child printed last. No time limit by default: the work is counted (cases,
    calls), and a hang is pytest-timeout's (pyproject.toml), however busy the machine."""
    proc = python(REPO, *args, timeout=timeout)
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    assert proc.returncode == 0, (
        f"child {args} failed ({how})\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_child_harness_reports_crashes():
    """The harness itself can fail: a child that aborts (SIGABRT), as a C++ ``std::terminate``
    or a Rust ``panic = "abort"`` would, and a child that segfaults, both fail the test."""
    with pytest.raises(AssertionError, match="killed by signal 6"):
        run_child(["-c", "import os; os.abort()"], timeout=30)
    with pytest.raises(AssertionError, match="killed by signal 11"):
        run_child(["-c", "import ctypes; ctypes.string_at(0)"], timeout=30)


# Every kind of bad input the contract names must actually be generated (a generator that drifted
# to only valid cases would pass vacuously).
REQUIRED_TENSOR_PROBLEMS = [
    "x:shape",
    "x:dtype",
    "x:device",
    "x:layout",
    "x:empty",
    "x:type",
    "x:donated",
    "context:shape",
    "context:dtype",
    "context:device",
    "context:batch",
    "context:type",
    "context:missing",
    "context:empty",
]


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted(FUZZERS))
def test_fuzz_bad_inputs(entry):
    """500 generated cases per entry point, in a child process: each call equals the PyTorch
    block or raises TypeError/ValueError/RuntimeError naming the offending argument, and
    leaves the caller's tensors bitwise unchanged; from_torch leaves the module it read as it
    was (its submodules, attributes, hooks, flags), and a refusal follows nothing."""
    stats = run_child([str(Path(__file__).resolve()), entry])
    assert stats["cases"] >= FUZZ_CASES, stats
    assert stats["ok"] >= 50 and stats["error"] >= 100, f"too few valid or invalid cases: {stats}"
    if entry in ("forward", "forward_owned"):
        required = REQUIRED_TENSOR_PROBLEMS + (
            ["x:requires_grad", "context:requires_grad", "x:donate"] if entry == "forward_owned" else []
        )
        missing = [p for p in required if stats.get(p, 0) < 1]
        assert not missing, f"bad inputs never generated: {missing}: {stats}"
        assert stats.get("valid with NaN/inf", 0) >= 10, stats
        assert entry == "forward" or stats.get("donated", 0) >= 10, stats
    if entry == "from_state_dict":
        missing = [op for op in WEIGHT_OPS if stats.get(f"op:{op}", 0) < 1]
        missing += [c for c in BAD_VALUES if stats.get(f"config:{c}", 0) < len(BAD_VALUES[c])]
        assert not missing, f"mutations never generated: {missing}: {stats}"
    if entry == "from_torch":
        assert stats.get("module unchanged", 0) >= 200, f"too few modules checked after from_torch: {stats}"
        assert stats["refused"] >= 50 and stats["refused yet followed"] == 0, stats
        missing = [f"op:{op}" for op in MODULE_OPS if stats.get(f"op:{op}", 0) < 2]
        missing += [f"object:{o}" for o in NON_BLOCKS if stats.get(f"object:{o}", 0) < 1]
        assert not missing, f"never generated: {missing}: {stats}"


# ============================================================================ 4. leaks


LEAK_WINDOW = 2000  # calls per measurement window; two windows per kind, 4000 calls
# from_torch reads the module's code (or takes the reading it kept) and probes it (about 13 ms a
# call, 80 times a forward's): two windows of 500 after 1000 calls of warm-up, which its caches
# need to settle (its heap grows in the first 500 calls, then by about 0 bytes a call). Its
# threshold per call is the same.
LEAK_CALLS = {"from_torch": (1000, 500)}  # kind: (warm-up calls, calls per window); the rest (500, LEAK_WINDOW)
LEAK_BYTES_PER_CALL = 4  # the threshold: a kind leaks if the heap grows this much per call in every window
LEAK_BLOCKS_PER_CALL = 0.1  # the same for Python objects (sys.getallocatedblocks)


def _native_heap():
    """glibc's count of the bytes malloc has handed out and not had back (mallinfo2: in-use
    chunks plus mmap'd chunks), or None where there is no mallinfo2. Exact to the chunk, where
    RSS moves in pages and only when the heap needs new ones (it misses a 320 KB leak)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (f, ctypes.c_size_t)
            for f in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def leak_main() -> dict:
    import ctypes

    import psutil

    from plusequals.twin import ops

    torch.set_num_threads(1)
    block = small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs(tokens=8)
    xg = x.clone().requires_grad_(True)
    bad = torch.randn(2, 8, DIM + 1)
    params = dict(block.named_parameters())
    kept = []
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]

    def refused():
        try:
            rust.forward(bad, c)
        except ValueError:
            pass
        else:
            raise AssertionError("bad input accepted")

    def owned():
        with torch.no_grad():
            return rust.forward_owned(x, c)

    def donated():
        with torch.no_grad():
            return rust.forward_owned(x.clone(), c, donate=True)

    def custom_op():
        with torch.no_grad():
            return ops.block_forward(x, c, list(rust._weights), *rust._config.op_fields, rust._slot, None)

    kinds = {
        "forward": lambda: rust.forward(x, c),
        "forward_owned": owned,
        "forward_owned_donate": donated,
        "forward_backward": lambda: rust.forward(xg, c).sum().backward(),
        "refused_input": refused,
        "from_state_dict": lambda: RustBlock.from_state_dict(
            params, dim=DIM, n_heads=HEADS, d_head=D_HEAD, context_dim=CTX
        ),
        "from_torch": lambda: RustBlock.from_torch(block),
        "custom_op_forward": custom_op,
        # The controls, which must be detected: a native 8-byte allocation never freed (a leaked
        # Box<u64>, a leaked handle struct), and an 8-byte handle kept per call in Python.
        "control_native_8_bytes": lambda: libc.malloc(8),
        "control_python_handle_8_bytes": lambda: kept.append(x),
        # 4 KiB a call, 16 MB in all: more than the free heap earlier kinds leave behind
        "control_rss_4k": lambda: kept.append(torch.empty(1024)),
    }
    native = _native_heap()
    proc = psutil.Process()
    report = {"native_available": native is not None, "kinds": {}}
    for name, fn in kinds.items():
        warm_up, window = LEAK_CALLS.get(name, (500, LEAK_WINDOW))
        for _ in range(warm_up):
            fn()
        windows = []
        rss0 = proc.memory_info().rss
        for _ in range(2):
            gc.collect()
            heap0, blocks0 = (native() if native else 0), sys.getallocatedblocks()
            for _ in range(window):
                fn()
            gc.collect()
            windows.append(
                {
                    "heap_per_call": ((native() if native else 0) - heap0) / window,
                    "blocks_per_call": (sys.getallocatedblocks() - blocks0) / window,
                }
            )
        report["kinds"][name] = {"windows": windows, "rss": proc.memory_info().rss - rss0}
    return report


@pytest.mark.slow
def test_no_leak_over_4000_calls_cpu():
    """After warm-up, 4000 calls of each entry point (and of a refused call, a backward
    through Rust, block construction, the custom op) in two windows of 2000 (from_torch: 1000
    after 1000 of warm-up, LEAK_CALLS): the native heap
    (glibc's in-use bytes) grows by < 4 bytes per call and Python's allocated blocks by < 0.1 per
    call in at least one window (a leak grows in both; a cache filling up or a table resizing
    does not), and RSS by < 1 MB. The controls are detected: an 8-byte native allocation per
    call (32 bytes of heap: glibc's smallest chunk) and an 8-byte handle kept per call in
    Python (a list slot: ~9 bytes of heap), and a 4 KiB-per-call leak in RSS. In a child
    process, for a clean heap."""
    report = run_child([str(Path(__file__).resolve()), "leak"])
    if not report["native_available"]:
        pytest.skip("needs glibc's mallinfo2 to count heap bytes (RSS alone misses leaks below a page per call)")
    kinds = dict(report["kinds"])
    controls = {name: kinds.pop(name) for name in list(kinds) if name.startswith("control_")}

    def rate(name, key):
        return min(w[key] for w in report["kinds"][name]["windows"])  # a leak shows in every window

    assert len(kinds) == 8 and len(controls) == 3
    for name in ("control_native_8_bytes", "control_python_handle_8_bytes"):
        assert rate(name, "heap_per_call") >= LEAK_BYTES_PER_CALL, f"the measurement missed {name}: {controls[name]}"
    assert controls["control_rss_4k"]["rss"] > 4 * 2**20, (
        f"the RSS measurement missed a 16 MB leak: {controls['control_rss_4k']}"
    )
    assert rate("control_rss_4k", "blocks_per_call") >= LEAK_BLOCKS_PER_CALL, "missed a Python object kept per call"
    leaks = {
        name: kind
        for name, kind in kinds.items()
        if rate(name, "heap_per_call") >= LEAK_BYTES_PER_CALL
        or rate(name, "blocks_per_call") >= LEAK_BLOCKS_PER_CALL
        or kind["rss"] >= 2**20
    }
    margins = {name: round(rate(name, "heap_per_call"), 2) for name in controls if name != "control_rss_4k"}
    assert not leaks, (
        f"leaks: {leaks} (thresholds {LEAK_BYTES_PER_CALL} B, {LEAK_BLOCKS_PER_CALL} blocks per call; "
        f"controls measured {margins} B per call)"
    )


@cuda
def test_no_leak_cuda_memory_returns_to_baseline():
    block = small_block().cuda()
    rust = RustBlock.from_torch(block)
    x, c = (t.cuda() for t in small_inputs(tokens=8))
    xg = x.clone().requires_grad_(True)

    def calls():
        rust.forward(x, c)
        with torch.no_grad():
            rust.forward_owned(x, c)
            rust.forward_owned(x.clone(), c, donate=True)
        rust.forward(xg, c).sum().backward()
        try:
            rust.forward(x.cpu(), c)
        except ValueError:
            pass

    def settled_allocation():
        xg.grad = None
        block.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        gc.collect()
        return torch.cuda.memory_allocated()

    for _ in range(50):
        calls()
    baseline = settled_allocation()
    for _ in range(2000):
        calls()
    assert settled_allocation() == baseline


# ============================================================================ 5. shared weights


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_optimizer_step_on_torch_block_is_seen_by_rust(optimizer):
    block = small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs()
    ptrs = [p.data_ptr() for p in block.parameters()]
    before = rust.forward(x, c).detach()
    opt = (
        torch.optim.SGD(block.parameters(), lr=0.5)
        if optimizer == "sgd"
        else torch.optim.Adam(block.parameters(), lr=0.05)
    )
    for _ in range(2):
        opt.zero_grad()
        block(x, c).square().mean().backward()
        opt.step()
    assert [p.data_ptr() for p in block.parameters()] == ptrs, "the optimizer replaced the parameters"
    with torch.no_grad():
        expected = block(x, c)
        assert rel_err(expected, before) > 1e-2, "the step did not change the block"
        assert_matches(rust.forward(x, c), expected)
        assert_matches(rust.forward_owned(x, c), expected)


def test_training_through_rust_updates_torch_block():
    """The other direction: gradients through RustBlock.forward land on the PyTorch block's
    parameters, and its optimizer step changes both."""
    block, twin = small_block(), small_block()
    rust = RustBlock.from_torch(block)
    x, c = small_inputs()
    for b, fwd in ((block, rust.forward), (twin, twin)):
        opt = torch.optim.SGD(b.parameters(), lr=0.5)
        opt.zero_grad()
        fwd(x, c).square().mean().backward()
        opt.step()
    with torch.no_grad():
        for (name, p), q in zip(block.named_parameters(), twin.parameters()):
            assert rel_err(p, q) <= TOL, name
        assert_matches(rust.forward(x, c), twin(x, c))


# ============================================================================ 6. determinism


def test_cpu_outputs_bitwise_identical_across_calls():
    from conftest import SHAPES, make_inputs

    tokens, dim, heads, d_head = SHAPES[0]
    block = make_block(dim, heads, d_head)
    rust = RustBlock.from_torch(block)
    x, c = make_inputs(tokens, dim)
    first = rust.forward(x, c).detach()
    for _ in range(3):
        assert same_bits(rust.forward(x, c), first)
    with torch.no_grad():
        owned = rust.forward_owned(x, c)
        for _ in range(3):
            assert same_bits(rust.forward_owned(x, c), owned)
            assert same_bits(rust.forward_owned(x.clone(), c, donate=True), owned)
        assert same_bits(rust.forward_loop(x, c, n=3), first)
        assert_matches(owned, block(x, c))


# ======================================================================= the raw extension, without the Python guards
# The Rust side checks these itself (rust/block.rs, rust/ownership.rs, rust/facts.rs).


def test_raw_extension_nested_input_raises_not_panics():
    _, raw = _raw_block()
    x, c = small_inputs()
    err = _raw_error(lambda: raw.forward(torch.nested.nested_tensor(list(x)), c))
    assert isinstance(err, ValueError) and names(str(err), "x"), repr(err)


def test_raw_extension_nested_weight_raises_not_panics():
    block = small_block()
    weights = dict(block.named_parameters())
    weights["norm1.weight"] = torch.nested.nested_tensor([torch.ones(DIM)])
    err = _raw_error(lambda: _rust.Block(weights, _rust.Config(dim=DIM, n_heads=HEADS, d_head=D_HEAD, context_dim=CTX)))
    assert isinstance(err, ValueError) and "norm1.weight" in str(err), repr(err)


def test_raw_extension_names_the_meta_device():
    """Rust reads devices through libtorch's own names (rust/facts.rs), not tch's Device, which
    calls every device other than CPU, CUDA and Vulkan "Mps"."""
    _, raw = _raw_block()
    x, c = small_inputs()
    err = _raw_error(lambda: raw.forward(x.to("meta"), c))
    assert isinstance(err, ValueError) and str(err) == "x is on meta but the block's weights are on cpu", repr(err)


def test_raw_extension_reports_overflowing_dims():
    block = small_block()
    weights = dict(block.named_parameters())
    err = _raw_error(lambda: _rust.Block(weights, _rust.Config(dim=DIM, n_heads=2**32, d_head=2**32, context_dim=CTX)))
    assert isinstance(err, ValueError) and ("n_heads" in str(err) or "overflow" in str(err)), repr(err)


# ============================================================================ child entry point

if __name__ == "__main__":
    what = sys.argv[1]
    if what == "leak":
        print(json.dumps(leak_main()))
    else:
        torch.set_num_threads(1)  # tiny shapes: a second intra-op thread only adds wake-ups
        FUZZERS[what]()
        if what == "from_torch":
            STATS["refused"], STATS["refused yet followed"] = len(REFUSED), refused_yet_followed()
        print(json.dumps(dict(STATS)))
