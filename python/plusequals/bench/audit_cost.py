"""What ``plusequals.audit`` costs on a training step, on one model of each family people train:

* a CNN with in-place activations: torchvision's resnet18;
* a vision transformer: torchvision's ViT at ViT-Ti/16's widths;
* a MobileNetV3 (in-place hard-swish, squeeze-excite with hard-sigmoid): torchvision's
  mobilenet_v3_large;
* a transformer LM: a small GPT-2 (Hugging Face transformers).

Each in train mode, batch 2, images 64 x 64 (the LM: 32 tokens), each step a forward, the sum of
the outputs and a backward, on the CPU with one intra-op thread (restored after, as the host-cost
cell). Five probes per family, timed in interleaved rounds like every other cell and each
compared with eager within each round:

* eager;
* eager under anomaly mode (``torch.autograd.detect_anomaly(check_nan=False)``), PyTorch's own
  debugging aid and the yardstick of the report's targets (the audit within 1.25x of eager);
* ``plusequals.audit(model, x, backward=True)``: hooks, the write watch and its checks, included;
* eager with a TorchDispatchMode that does nothing over the forward: what any dispatch mode costs;
* the same with torch's global module hooks that do nothing (a forward pre-hook and an always-called
  forward hook, as the audit registers): what seeing every op and every module call costs through
  PyTorch's Python extension points, the floor under the audit's own work (where the time goes).

The CNNs and the ViT need torchvision (the ``test`` extra), the LM transformers (the ``diffusers``
extra); a family whose library is missing is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from .results import ANOMALY, AUDITED, BARE, EAGER, OBSERVED, AuditCost, AuditFamily, AuditRow
from .timing import SMOKE_ROUNDS, interleaved_rounds, intra_op_threads, paired_ratios, spread
from .unet import step_row

BATCH, SIZE, CLASSES, TOKENS = 2, 64, 10, 32
THREADS = 1
TARGET = 1.25  # the report's: the audit within 1.25x of an eager train step, as anomaly mode
ROUNDS = 15
SETTLED_IQR = 0.1  # more rounds (up to 3x, for at most EXTRA_S) while a paired ratio's IQR is wider
EXTRA_S = 5.0


class _LM(nn.Module):
    """A causal LM's train step as the others': token ids in, the logits out (no cache)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def _images() -> torch.Tensor:
    return torch.randn(BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))


def _resnet18() -> tuple[nn.Module, torch.Tensor]:
    import torchvision

    return torchvision.models.resnet18(num_classes=CLASSES), _images()


def _vit() -> tuple[nn.Module, torch.Tensor]:
    import torchvision

    vit = torchvision.models.VisionTransformer(
        image_size=SIZE, patch_size=16, num_layers=12, num_heads=3, hidden_dim=192, mlp_dim=768, num_classes=CLASSES
    )
    return vit, _images()


def _mobilenet_v3() -> tuple[nn.Module, torch.Tensor]:
    import torchvision

    return torchvision.models.mobilenet_v3_large(num_classes=CLASSES), _images()


VOCAB = 8192


def _gpt2() -> tuple[nn.Module, torch.Tensor]:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=TOKENS, n_embd=192, n_layer=6, n_head=3, bos_token_id=0, eos_token_id=0
    )
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    return _LM(transformers.GPT2LMHeadModel(config)), ids


@dataclass(frozen=True)
class Family:
    """One model family's train step: its model (as the targets name it), what it is, and how it
    is built (a fresh model in train mode and its input, from seed 0)."""

    model: str
    family: str
    what: str
    build: Callable[[], tuple[nn.Module, torch.Tensor]]
    needs: str  # the library it is built with
    extra: str  # plusequals' extra that installs it


_IMAGES = f"batch {BATCH}, {SIZE} x {SIZE} images, {CLASSES} classes"
FAMILIES = [
    Family(
        "resnet18",
        "a CNN with in-place activations",
        f"torchvision resnet18 (in-place ReLUs, BatchNorm), {_IMAGES}",
        _resnet18,
        "torchvision",
        "test",
    ),
    Family(
        "ViT-Ti/16",
        "a vision transformer",
        f"torchvision VisionTransformer at ViT-Ti/16's widths (12 layers, 3 heads, width 192, MLP 768), {_IMAGES} "
        "(16 patches and a class token)",
        _vit,
        "torchvision",
        "test",
    ),
    Family(
        "MobileNetV3-Large",
        "a MobileNetV3 with hard-swish and squeeze-excite",
        f"torchvision mobilenet_v3_large (in-place hard-swish and ReLU, squeeze-excite with hard-sigmoid), {_IMAGES}",
        _mobilenet_v3,
        "torchvision",
        "test",
    ),
    Family(
        "GPT-2",
        "a transformer LM",
        f"transformers GPT2LMHeadModel (6 layers, 3 heads, width 192, vocabulary {VOCAB}), batch {BATCH}, "
        f"{TOKENS} tokens, the logits summed",
        _gpt2,
        "transformers",
        "diffusers",
    ),
]


def family(model: str) -> Family:
    """The family whose model is named ``model`` (its name in the targets, or its lower case)."""
    for f in FAMILIES:
        if model in (f.model, f.model.lower(), f.build.__name__.lstrip("_")):
            return f
    raise KeyError(f"no family with the model {model!r}: one of {', '.join(f.model for f in FAMILIES)}")


class _Bare(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _nothing(*args: Any) -> None:
    return None


@contextlib.contextmanager
def _observing() -> Iterator[None]:
    """A dispatch mode and global module hooks that do nothing (the hook without kwargs: torch
    leaves no mark of it behind once removed)."""
    handles = [register_module_forward_pre_hook(_nothing), register_module_forward_hook(_nothing, always_call=True)]
    try:
        with _Bare():
            yield
    finally:
        for h in handles:
            h.remove()


def probes(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The steps (``AUDIT_PROBES``), each dropping the gradients of the one before."""
    from ..auditing import audit

    def eager() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    def anomaly() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autograd.detect_anomaly(check_nan=False):
            model(x).sum().backward()

    def audited() -> None:
        model.zero_grad(set_to_none=True)
        audit(model, x, backward=True)

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        with _Bare():
            y = model(x).sum()
        y.backward()

    def observed() -> None:
        model.zero_grad(set_to_none=True)
        with _observing():
            y = model(x).sum()
        y.backward()

    return {EAGER: eager, ANOMALY: anomaly, AUDITED: audited, BARE: bare, OBSERVED: observed}


def _settled(raw: dict[str, list[float]]) -> bool:
    return all(spread(paired_ratios(ts, raw[EAGER])).iqr <= SETTLED_IQR for name, ts in raw.items() if name != EAGER)


def missing(f: Family) -> Optional[str]:
    """Why ``f`` cannot be built here (its library is not installed), or None."""
    try:
        __import__(f.needs)
    except ImportError as e:
        return f"{f.needs} is not installed ({e}); `pip install plusequals[{f.extra}]`"
    return None


def build(f: Family) -> tuple[nn.Module, torch.Tensor]:
    """``f``'s model in train mode and its input, from seed 0 (the caller's RNG left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, x = f.build()
    return model.train(), x


def measure_family(f: Family, sample_s: float, seed: int, smoke: bool = False) -> AuditFamily:
    """One family's step, its probes in interleaved rounds (one thread)."""
    why = missing(f)
    if why is not None:
        return AuditFamily(family=f.family, model=f.model, what=f.what, skipped=why)
    from ..auditing import audit

    with intra_op_threads(THREADS), torch.random.fork_rng():
        model, x = build(f)
        found = audit(model, x, backward=True)
        rounds = SMOKE_ROUNDS if smoke else ROUNDS
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # anomaly mode warns that it is on, each time
            timed = interleaved_rounds(
                probes(model, x),
                rounds,
                seed,
                sample_s,
                settled=_settled,
                max_rounds=rounds if smoke else 3 * rounds,
                extra_s=0.0 if smoke else EXTRA_S,
            )
    moves = sum(m.count for m in found.moves)
    return AuditFamily(
        family=f.family,
        model=f.model,
        what=f.what,
        rows=[step_row(name, timed.raw_ms, AuditRow) for name in timed.raw_ms],
        audit=f"{found.summary()}, {moves} moves",
        rounds=timed.record(),
    )


WHAT = (
    f"Train mode, float32, CPU, {THREADS} intra-op thread; a step is a forward, the sum of the outputs and a backward "
    "(gradients dropped before each). Each family is timed in its own interleaved rounds, like the cells; each ratio "
    "to eager is paired per round."
)


def measure(sample_s: float, seed: int, smoke: bool = False, say: Callable[[str], None] = lambda what: None) -> dict:
    """The cell; returns results.json's ``audit_cost``: each family in ``FAMILIES`` (seeds
    ``seed``, ``seed + 1``, ...). ``smoke``: SMOKE_ROUNDS rounds, no more; ``say``: which family
    is being timed."""
    families = []
    for i, f in enumerate(FAMILIES):
        say(f.model)
        families.append(measure_family(f, sample_s, seed + i, smoke))
    return AuditCost(what=WHAT, threads=THREADS, target=TARGET, families=families).to_json()
