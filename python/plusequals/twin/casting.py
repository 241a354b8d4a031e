"""diffusers' layerwise casting (``enable_layerwise_casting``, ``apply_layerwise_casting``) around the
Rust block: what the reading accepts of it, and the cast around each call of a swapped block.

diffusers stores each leaf layer's weights in a low-precision dtype (``storage_dtype``, e.g.
``torch.float8_e4m3fn``) and casts them for the call: its ``LayerwiseCastingHook`` is a
``HookRegistry`` entry (``module._diffusers_hook``) whose ``pre_forward`` runs
``module.to(compute_dtype)`` and whose ``post_forward`` runs ``module.to(storage_dtype)``, both
through ``param.data = ...``, so the parameters stay the same objects and only their data is
replaced (the Rust block holds the same tensors, and sees it). The hook does not rewrite the
forward's maths: between the two casts the layer computes on weights of the compute dtype whose
values are the stored ones. So the swapped block (``RustTransformerBlock``, twin/swap.py) runs the
hooks' own ``pre_forward`` on every hooked module of the block, computes in Rust on those weights,
and runs their ``post_forward`` after (also when the call raises): the same values in the same
dtype, bitwise diffusers' output and gradients on the CPU (``tests/test_layerwise_casting.py``). The casts
happen together around the block instead of layer by layer, which changes no value: a tensor a
layer saves for backward is a view taken at that layer's call in both, of the compute-dtype data.

Accepted (:func:`accepted`): a registry holding only ``LayerwiseCastingHook`` entries, and on a
peft LoRA layer diffusers' ``PeftInputAutocastDisableHook`` (it turns off peft's cast of the input
to ``lora_A``'s dtype, which the Rust block never does). Refused, naming layerwise casting
(:func:`refusals`): a LoRA layer whose ``lora_A`` is cast without that hook (peft would cast the
input to the storage dtype), DoRA under casting (peft's DoRA reads the stored weights directly), and,
at the call (:func:`mixed_dtypes`), weights of more than one dtype once cast: a compute dtype other
than the uncast layers' dtype, or a LoRA adapter added after the casting (peft stores it in the
storage dtype, outside the hooks); diffusers' own forward fails in both. ``RustBlock.from_torch``
does not cast: it refuses a block with layerwise casting, naming the swap. A traced call is refused
too (:class:`Casting`): the custom ops would take the stored low-precision weights. A leaf: imports
nothing of the package but ``adapter`` and ``config``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from .adapter import Adapter
from .config import BlockConfig

__all__ = ["CASTING_ADAPTER", "Casting", "accepted", "mixed_dtypes", "recast", "refusals", "window"]

#: diffusers' registry names of the hooks that layerwise casting installs.
CASTING, PEFT_INPUT = "layerwise_casting", "peft_autocast_disable"


def _hook_class(name: str) -> Any:
    return getattr(sys.modules.get("diffusers.hooks.layerwise_casting"), name, None)


def accepted(name: str, hook: Any) -> bool:
    """Whether the registry entry ``name`` is one of layerwise casting's hooks, exactly."""
    if name == CASTING:
        return type(hook) is _hook_class("LayerwiseCastingHook")
    if name == PEFT_INPUT:
        return type(hook) is _hook_class("PeftInputAutocastDisableHook")
    return False


def refusals(casting: Sequence[Tuple[str, Any, Any]], lora: Sequence[tuple]) -> List[str]:
    """The reasons the Rust block cannot reproduce this layerwise casting: ``casting`` holds the
    accepted hooks as (module path, module, hook); ``lora``, the LoRA terms read (BlockConfig.lora)."""
    paths = {path for path, _, hook in casting if type(hook) is _hook_class("LayerwiseCastingHook")}
    unhooked = {path for path, _, hook in casting if type(hook) is _hook_class("PeftInputAutocastDisableHook")}
    reasons = []
    for path in sorted({p.rsplit(".lora_A.", 1)[0] for p in paths if ".lora_A." in p} - unhooked):
        reasons.append(
            f"{path} is a peft LoRA layer whose lora_A is under diffusers' layerwise casting without diffusers' "
            "PeftInputAutocastDisableHook: peft would cast its input to the storage dtype (apply the casting "
            "through enable_layerwise_casting / apply_layerwise_casting, which add that hook)"
        )
    if paths and any(term[4] for term in lora):
        reasons.append(
            "DoRA under diffusers' layerwise casting: peft's DoRA reads the stored (low-precision) weights "
            "directly, outside the casting hooks; enable layerwise casting after fusing the DoRA adapters, or not"
        )
    return reasons


def mixed_dtypes(paths: Sequence[str], weights: Sequence[Any]) -> Optional[str]:
    """Why the cast weights (``paths``, in the same order) cannot run: more than one dtype among them
    during the call; None when they share one."""
    dtypes: dict = {}
    for path, weight in zip(paths, weights):
        dtypes.setdefault(weight.dtype, []).append(path)
    if len(dtypes) < 2:
        return None
    (common, _), *others = sorted(dtypes.items(), key=lambda kv: -len(kv[1]))
    shown = "; ".join(f"{', '.join(names[:3])} {dtype}" for dtype, names in others)
    return (
        f"under diffusers' layerwise casting its weights are {common} during the call but {shown}: weights stored "
        "outside the casting hooks (a LoRA adapter added after enable_layerwise_casting) or a compute dtype other "
        "than the uncast layers' (diffusers' own forward fails there too); enable the casting last, in the "
        "model's dtype"
    )


def _hooks(casting: Sequence[Tuple[str, Any, Any]]) -> List[Tuple[Any, Any]]:
    return [(module, hook) for _, module, hook in casting if hasattr(hook, "compute_dtype")]


def recast(casting: Sequence[Tuple[str, Any, Any]]) -> None:
    """The hooks' ``pre_forward`` again (the weights to the compute dtype), inside a :func:`window`
    after the library's own block ran (the probe), whose hooks stored them again."""
    for module, hook in _hooks(casting):
        hook.pre_forward(module)


@contextlib.contextmanager
def window(casting: Sequence[Tuple[str, Any, Any]]) -> Iterator[None]:
    """The hooks' ``pre_forward`` on their modules (weights to the compute dtype), then, after the
    body, even when it raises, their ``post_forward`` (back to the storage dtype), in reverse."""
    hooks = _hooks(casting)
    done = []
    try:
        for module, hook in hooks:
            hook.pre_forward(module)
            done.append((module, hook))
        yield
    finally:
        for module, hook in reversed(done):
            hook.post_forward(module, None)


class Casting(Adapter):
    """diffusers' layerwise casting (module docstring): read where the reader finds its hooks
    (``Watch.hooks_of``), computed by the swap's block, which casts around each call."""

    name = "layerwise casting"

    def untraceable(self, config: BlockConfig, casting: bool, lora_layers: Sequence[str]) -> Optional[str]:
        if casting:
            return (
                "a block under diffusers' layerwise casting cannot be traced (torch.compile, torch.export, "
                "FakeTensor) or run under a mode or with tensor subclasses: the custom ops would take the stored "
                "low-precision weights; call it eagerly on plain tensors"
            )
        return None


CASTING_ADAPTER = Casting()
