"""torch.compile (Inductor, default mode) in the report: the compiled ``op_plus_x`` and ``iadd``
as timed variants, and what Inductor does with the residual add, read from the code it
generates (``torch._inductor.utils.run_and_get_code``, on the first compile of each, so reading
costs no extra compile).

:func:`residual_destination` reads the wrapper's ``call``: the tensor it returns is the last
residual sum, and where that tensor came from says where the add wrote:

* ``"caller's x"``: the returned tensor is the graph input bound to ``x`` (AOTAutograd kept the
  input mutation; a fused ``add`` + ``copy_`` kernel stores the sum over x's memory);
* ``"reused buffer"``: a buffer of Inductor's own, taken over from a dead intermediate
  (``bufN = reinterpret_tensor(bufM, ...); del bufM  # reuse``), stored into by the add kernel;
* ``"new buffer"``: a fresh ``empty_strided_cpu``/``empty_strided_cuda`` of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from .setup import Setup
from .timing import sync
from .variants import RESTORED, Variant

STRATEGIES = ("op_plus_x", "iadd")
CALLER, REUSED, NEW = "caller's x", "reused buffer", "new buffer"
_SIZE = re.compile(r"assert_size_stride\((\w+), \(([0-9, ]+)\)")


@dataclass(frozen=True)
class Residual:
    """Where the compiled block's last residual sum lands, with the lines that show it."""

    destination: str  # CALLER | REUSED | NEW
    returned: str  # the wrapper's returned name
    x_arg: str  # the wrapper's name for the caller's x
    defined: Optional[str]  # the line that binds the returned buffer (None for the caller's x)
    kernel: str  # the kernel call that stores the sum
    fused_adds: list[str]  # every generated kernel that adds

    def to_json(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def isa_checks_remembered() -> Iterator[None]:
    """While it is entered, each of Inductor's vector-ISA checks that passed once is not run again.

    Before it first compiles C++ kernels, a process checks each vector ISA it may compile for
    (AVX2, AVX-512, AMX: ten checks on this project's host) by building a small library (cached
    by torch, with its kernels) and loading it in a new ``python -c "import torch; ..."``: 1.1 s
    of CPU each, 11 s of a quick smoke report's 46 (pytorch/pytorch#100378). Whether that library
    loads depends only on what built it and what loads it, so a check that passed is remembered
    in Inductor's cache dir, keyed by the check's code, torch's fingerprint of the compiler, the
    flags and torch's version, and the interpreter; a later check of the same key passes at once.
    A check that failed is not remembered: it runs again each time, as without this. Which ISAs
    pass, and so every kernel, is what the checks would give."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    check = cpu_vec_isa.VecISA.check_build

    def check_build(isa: "cpu_vec_isa.VecISA", code: str) -> bool:
        fingerprint = cpu_vec_isa._get_isa_dry_compile_fingerprint(isa.build_arch_flags())
        key = hashlib.sha256("\0".join((code, fingerprint, sys.executable)).encode()).hexdigest()
        passed = Path(cache_dir()) / "isa-checks" / key
        if passed.is_file():
            return True
        ok = check(isa, code)
        if ok:
            passed.parent.mkdir(parents=True, exist_ok=True)
            passed.touch()
        return ok

    cpu_vec_isa.VecISA.check_build = check_build
    try:
        yield
    finally:
        cpu_vec_isa.VecISA.check_build = check


def _call_body(code: str) -> list[str]:
    start = code.index("def call(self, args):")
    body = code[start:].splitlines()
    end = next(i for i, line in enumerate(body) if line.strip().startswith("return ("))
    return body[: end + 1]


def residual_destination(code: str, x_shape: tuple[int, ...]) -> Residual:
    """Reads Inductor's wrapper (``code``, the first of ``run_and_get_code``'s outputs) for a
    block whose ``x`` has ``x_shape`` (a shape no other input has)."""
    body = _call_body(code)
    shape = ", ".join(str(d) for d in x_shape)
    xs = [m.group(1) for line in body if (m := _SIZE.search(line)) and m.group(2).strip(", ") == shape]
    if len(xs) != 1:
        raise ValueError(f"expected one input of x's shape ({shape}), found {xs}")
    x_arg = xs[0]
    returned = re.fullmatch(r"return \((\w+), \)", body[-1].strip())
    if returned is None:
        raise ValueError(f"expected one returned tensor, found {body[-1].strip()!r}")
    name = returned.group(1)
    kernels = [line.strip() for line in body if re.match(r"\s*cpp_fused_\w*add\w*\(|\s*triton_\w*add\w*", line)]
    writer = next(k for k in reversed(kernels) if re.search(rf"\b{name}\b", k))
    if name == x_arg:
        return Residual(CALLER, name, x_arg, None, writer, kernels)
    defined = next(line.strip() for line in body if re.match(rf"\s*{name} = ", line))
    destination = REUSED if defined.endswith("# reuse") else NEW
    if destination == NEW and "empty_strided" not in defined:
        raise ValueError(f"cannot tell where {name} comes from: {defined!r}")
    return Residual(destination, name, x_arg, defined, writer, kernels)


# ----------------------------------------------------------------------------- the report's variants
def _block_fn(s: Setup, strategy: str) -> Callable:
    return torch.compile(lambda x, c: s.block(x, c, residual=strategy), mode="default", dynamic=False)


def _first_call(fn: Callable, x: torch.Tensor, s: Setup, read: bool) -> tuple[float, Optional[Residual]]:
    """Compiles ``fn`` by calling it (twice: the second call shows no recompile is left);
    returns the seconds and, if ``read``, where the residual sum lands."""
    from torch._inductor.utils import run_and_get_code

    t0 = time.perf_counter()
    if read:
        _, codes = run_and_get_code(fn, x, s.context)
    else:
        fn(x, s.context)
    fn(x, s.context)
    sync(s.device)
    seconds = time.perf_counter() - t0
    if not read:
        return seconds, None
    try:
        return seconds, residual_destination(codes[0], tuple(x.shape))
    except (ValueError, StopIteration, IndexError) as e:  # a wrapper this reader does not know: said, not hidden
        return seconds, Residual(f"unread ({type(e).__name__}: {e})", "", "", None, "", [])


def compile_variants(s: Setup, read: bool = False) -> tuple[list[Variant], dict[str, float], dict[str, dict]]:
    """``compile/op_plus_x`` and ``compile/iadd`` (Inductor, default mode, static shapes), and on
    CUDA ``compile/reduce-overhead`` (op_plus_x). Returns (variants, compile seconds by the
    name after ``compile/``, and, if ``read``, ``residual_destination`` per strategy).
    ``compile/iadd`` writes into its input, so it runs on a copy restored each call (timed in the
    same round and subtracted), as ``eager/iadd`` does."""
    torch._dynamo.reset()  # one cache per setup: no recompile limit across shapes
    out, seconds, residual = [], {}, {}
    work = s.x.clone()
    for strategy in STRATEGIES:
        fn = _block_fn(s, strategy)
        x = work if strategy == "iadd" else s.x
        seconds[strategy], r = _first_call(fn, x, s, read)
        if r is not None:
            residual[f"compile/{strategy}"] = r.to_json()
        if strategy == "iadd":
            note = "one compiled iadd forward (Inductor, default), += into its input; " + RESTORED.format(how="copy_")
            call = lambda fn=fn: (work.copy_(s.x), fn(work, s.context))  # noqa: E731
            out.append(Variant("compile/iadd", "compile", call, note, reset=lambda: work.copy_(s.x)))
        else:
            note = "one compiled op_plus_x forward (Inductor, default)"
            out.append(Variant("compile/op_plus_x", "compile", lambda fn=fn: fn(s.x, s.context), note))
    if s.device == "cuda":
        fn = torch.compile(lambda x, c: s.block(x, c, residual="op_plus_x"), mode="reduce-overhead", dynamic=False)
        t0 = time.perf_counter()
        for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
            fn(s.x, s.context)
        sync(s.device)
        seconds["reduce-overhead"] = time.perf_counter() - t0
        note = "one compiled op_plus_x forward (reduce-overhead: a CUDA graph)"
        out.append(Variant("compile/reduce-overhead", "compile", lambda fn=fn: fn(s.x, s.context), note))
    for v in out:
        v.note += "; compile time is not included (compile_s)"
    return out, seconds, residual


# ----------------------------------------------------------------------------- the README's bullet
def read_small_block(strategy: str, seed: int = 0) -> tuple[Residual, bool]:
    """Compiles ``bugs.small_block``'s forward with ``strategy`` (grad off) and reads its code:
    (where the last residual sum lands, whether the returned tensor is the caller's x)."""
    from torch._inductor.utils import run_and_get_code

    from ..model.bugs import small_block

    block = small_block(seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, context = torch.randn(2, 16, 32, generator=g), torch.randn(2, 7, 24, generator=g)
    fn = torch.compile(lambda x, c: block(x, c, residual=strategy), mode="default", dynamic=False)
    with torch.no_grad():
        y, codes = run_and_get_code(fn, x, context)
    return residual_destination(codes[0], tuple(x.shape)), y.data_ptr() == x.data_ptr()


def markdown(read: dict[str, Residual]) -> str:
    """The README's Inductor bullet, from what :func:`residual_destination` read per strategy."""
    said = {
        CALLER: "into the caller's `x`",
        REUSED: "in place into a buffer of its own that a dead intermediate held",
        NEW: "into a new buffer",
    }
    op, ia = read["op_plus_x"], read["iadd"]
    verdict = "reuses a buffer, but never writes into x" if op.destination != CALLER else "writes into x"
    return (
        f"* **Inductor (torch.compile, default mode): {verdict} unless the source says `+=`.** "
        f"In the code it generates for `op_plus_x`, the three residual adds are fused into {len(op.fused_adds)} "
        f"kernels and the last sum is stored {said[op.destination]}: `{op.defined or op.returned}`, then "
        f"`{op.kernel}`, returning `{op.returned}`; the caller's `{op.x_arg}` is only read. For `iadd` the last "
        f"sum is stored {said[ia.destination]}: `{ia.kernel}` returns `{ia.returned}`, because AOTAutograd "
        "keeps the input mutation the source asked for."
    )
