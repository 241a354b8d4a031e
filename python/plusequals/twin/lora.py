"""PEFT LoRA on the Rust block's linear layers: what :func:`plusequals.twin.faithful.read_block`
reads of a ``peft.tuners.lora.layer.Linear`` (peft 0.21.2) in place of an ``nn.Linear``.

PEFT's forward (``lora.Linear.forward``), which the Rust block reproduces (``rust/linear.rs``,
``Linear::forward``) on PEFT's own tensors:

* adapters disabled: ``base_layer(x)`` (PEFT first unmerges merged adapters, writing the base
  weight inside its forward: that is refused, naming the cause);
* an adapter merged (``merged_adapters`` not empty): ``base_layer(x)``, whose weight holds the
  merged deltas (merge and unmerge write it in place, which the Rust block sees live);
* otherwise ``base_layer(x)``, then for each active adapter that the layer has, in order, ``x``
  cast to ``lora_A``'s dtype (``_cast_input_dtype``; refused when turned off) and
  ``result + lora_B(lora_A(dropout(x))) * scaling``: a LoRA term of the Rust block
  (:attr:`plusequals.twin.config.BlockConfig.lora`).

What the reading looks at is watched (:class:`plusequals.twin.watch.Watch`): the active adapters,
``_disable_adapters``, the items of ``merged_adapters``, each active adapter's ``scaling`` entry,
``lora_variant`` entries, its dropout's ``p`` and ``training``, and the modules and parameters
of ``lora_A``/``lora_B`` (and DoRA's ``lora_magnitude_vector``); a change (``set_adapter``,
``enable_adapters``, ``merge``, ``unmerge``, ``set_scale``, ``scale_layer``, ``delete_adapter``,
``.train()``) reads the block again. Refused, naming the cause: the LoRA variants other than DoRA,
dropout with p > 0 in training mode, a base layer that is not an ``nn.Linear``, and parameters
the Rust block does not use (``lora_embedding_A``, ...).

DoRA (``use_dora=True``: the variant ``DoraLinearVariant``, peft's ``tuners/lora/dora.py``) is
a term of its own (``rust/linear.rs``, ``Linear::dora``), on PEFT's tensors, the magnitude vector
included (its gradient reaches PEFT's parameter). Like ``DoraLinearLayer.forward`` with a base
result: ``ΔW = lora_B(lora_A(eye(in))).T``, the row norm ``‖W + scaling * ΔW‖`` (``ΔW`` and the norm
detached, DoRA paper section 4.3), ``m = magnitude / norm`` as a row, and the term
``(m - 1) * (result - bias) + m * lora_B(lora_A(x)) * scaling``, added to the running result, the
same ops in the same order, so forward and backward are PEFT's bit for bit on the CPU. Refused,
naming it: peft's DoRA cache in eval mode (``ENABLE_DORA_CACHING``: a weight norm from an earlier
call), ``fan_in_fan_out``, and an ``nn.Dropout`` ``lora_dropout`` while the layer trains (PEFT then
recomputes the base result from the dropped-out input). Merged DoRA adapters are the merged base
weight, as for LoRA.

At the call (:class:`Lora`), a traced call is refused: the custom ops take the base weights only,
and a traced graph would not see the adapters change (merged or disabled ones too).
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Optional, Sequence

from torch import nn

from .adapter import Adapter
from .config import BlockConfig
from .watch import class_name

__all__ = ["LORA", "Lora", "base_of", "is_lora", "read_lora"]


def _lora_linear() -> Optional[type]:
    """peft's ``lora.Linear``, when peft is imported (a LoRA layer can only exist then)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "Linear", None)


def is_lora(m: Any) -> bool:
    """Whether ``m`` is exactly peft's ``lora.Linear``."""
    cls = _lora_linear()
    return cls is not None and type(m) is cls


def base_of(m: Any) -> Any:
    """The ``nn.Linear`` a PEFT LoRA layer wraps (``m`` itself when it wraps none)."""
    if is_lora(m):
        base = m._modules.get("base_layer")
        if type(base) is nn.Linear:
            return base
    return m


def read_lora(r: Any, lin: nn.Module, name: str, bias: bool, key: str) -> bool:
    """Reads the LoRA layer ``lin`` at ``name`` (``key``: its linear's CompVis key) with the
    reader ``r`` (``faithful._Reader``): its base layer as the linear itself, then the LoRA terms
    PEFT's forward would add now (module docstring). Returns whether the base layer passed."""
    base = r.child(lin, "base_layer")
    if type(base) is not nn.Linear:
        r.no(f"{name} is a PEFT LoRA layer on {class_name(base)}, not on a plain nn.Linear")
        r.refused.append(name)
        return False
    r.wrapped.append(name)
    if not r.linear(base, f"{name}.base_layer", bias, key=key):
        return False
    modules = {part: r.child(lin, part) for part in ("lora_A", "lora_B", "lora_dropout")}
    # Every adapter's weights are the layer's own, used or not (DoRA's magnitudes: read by _magnitude)
    for part in ("lora_A", "lora_B", "lora_magnitude_vector"):
        for adapter, m in getattr(lin, part, nn.ModuleDict())._modules.items():
            r.accounted.update(f"{name}.{part}.{adapter}.{p}" for p in m._parameters)
    r.skip_dropouts.update(id(m) for m in modules["lora_dropout"].modules())
    w = r.w
    disabled = w.get(lin, "_disable_adapters")
    merged = w.items(w.get(lin, "merged_adapters"))
    if disabled:
        if merged:
            r.no(
                f"{name} has its adapters disabled while {list(merged)} are merged: PEFT's forward would unmerge "
                "them (writing the base weight) before it runs; call unmerge() (unfuse_lora) first"
            )
        return True
    if merged:
        return True  # PEFT: base_layer(x), whose weight holds the merged deltas
    if w.get(lin, "cast_input_dtype_enabled", True) is False:
        r.no(
            f"{name} has peft's input cast off (cast_input_dtype_enabled=False, disable_input_dtype_casting): "
            "the Rust block casts the input to lora_A's dtype, as peft's forward does by default"
        )
    active = w.get(lin, "_active_adapter")
    for adapter in [active] if isinstance(active, str) else list(w.items(active)):
        if w.get(modules["lora_A"], adapter) is not None:
            _term(r, lin, name, key, adapter, modules)
    return True


def _term(r: Any, lin: nn.Module, name: str, key: str, adapter: str, modules: dict) -> None:
    """One active adapter of ``lin``: a LoRA term, or the reason it is refused."""
    w = r.w
    where = f"{name} adapter {adapter!r}"
    variant = w.entry(w.get(lin, "lora_variant"), adapter)  # what PEFT's forward dispatches on (not use_dora)
    dora = variant is not None and type(variant) is _peft("variants", "DoraLinearVariant")
    if variant is not None and not dora:
        r.no(f"{where} is {class_name(variant)}, a LoRA variant: the Rust block computes plain LoRA and DoRA only")
        return
    if dora:
        w.exact(variant)
        r.called.append(variant)  # its class's forward is code PEFT's forward runs: watched
    dropout = w.get(modules["lora_dropout"], adapter)
    if type(dropout) is nn.Dropout:
        r.dropout_p(dropout, f"{name}.lora_dropout.{adapter}")
    elif type(dropout) is not nn.Identity:
        r.no(f"{name}.lora_dropout.{adapter} is {class_name(dropout)}, not nn.Dropout or nn.Identity")
    scaling = w.entry(w.get(lin, "scaling"), adapter)
    if not isinstance(scaling, numbers.Real) or isinstance(scaling, bool):
        r.no(f"{where} has scaling {scaling!r}, not a number")
        return
    a, b = w.get(modules["lora_A"], adapter), w.get(modules["lora_B"], adapter)
    if type(a) is not nn.Linear or type(b) is not nn.Linear:
        r.no(f"{where}: lora_A/lora_B are {class_name(a)}/{class_name(b)}, not nn.Linear")
        return
    i = len(r.lora)
    term = f"{key}.lora.{i}"
    if dora and _magnitude(r, lin, name, adapter, dropout, f"{term}.magnitude") is None:
        return
    weight = r.param(a, "weight", f"{name}.lora_A.{adapter}.weight", f"{term}.A.weight")
    r.param(b, "weight", f"{name}.lora_B.{adapter}.weight", f"{term}.B.weight")
    b_bias = r.param(b, "bias", f"{name}.lora_B.{adapter}.bias", f"{term}.B.bias") is not None
    if r.param(a, "bias", f"{name}.lora_A.{adapter}.bias") is not None:
        r.no(f"{name}.lora_A.{adapter} has a bias; PEFT's lora_A has none")
        return
    if weight is None:
        r.no(f"{name}.lora_A.{adapter} has no weight")
        return
    r.lora.append((key, int(weight.shape[0]), float(scaling), b_bias, dora))


def _peft(module: str, name: str) -> Optional[type]:
    """``peft.tuners.lora.{module}.{name}``, when peft has imported it."""
    return getattr(sys.modules.get(f"peft.tuners.lora.{module}"), name, None)


def _magnitude(r: Any, lin: nn.Module, name: str, adapter: str, dropout: Any, key: str) -> Any:
    """DoRA's magnitude vector of ``adapter`` (its slot is ``key``), or None with the reason the
    Rust block cannot compute PEFT's ``DoraLinearLayer.forward`` here."""
    w = r.w
    where = f"{name} adapter {adapter!r} (DoRA)"
    layer = w.get(w.get(lin, "lora_magnitude_vector"), adapter)
    if type(layer) is not _peft("dora", "DoraLinearLayer"):
        r.no(f"{where}: lora_magnitude_vector.{adapter} is {class_name(layer)}, not peft's DoraLinearLayer")
        return None
    if w.get(layer, "fan_in_fan_out"):
        r.no(f"{where} has fan_in_fan_out=True: its weight norm would be taken over the other dimension")
        return None
    if w.get(sys.modules[type(layer).__module__], "ENABLE_DORA_CACHING") and not w.get(layer, "training"):
        r.no(
            f"{where}: peft's DoRA cache is on (ENABLE_DORA_CACHING, peft.helpers.DoraCaching) in eval mode: "
            "PEFT reuses a weight norm computed on an earlier call; turn the cache off to run it in the Rust block"
        )
        return None
    if type(dropout) is not nn.Identity and w.get(lin, "training"):
        r.no(
            f"{where} has an nn.Dropout lora_dropout in training mode: PEFT then computes its base result "
            "again from the dropped-out input; call .eval() (or use lora_dropout=0, an nn.Identity)"
        )
        return None
    return r.param(layer, "weight", f"{name}.lora_magnitude_vector.{adapter}.weight", key)


class Lora(Adapter):
    """PEFT LoRA and DoRA on the block's linear layers (module docstring): read where the reader finds
    a LoRA layer in place of an ``nn.Linear`` (``faithful._Reader.linear``)."""

    name = "LoRA"

    def untraceable(self, config: BlockConfig, casting: bool, lora_layers: Sequence[str]) -> Optional[str]:
        if lora_layers:  # merged or disabled too: a traced graph would not see them change
            return (
                f"a block with LoRA adapters ({', '.join(lora_layers)}) cannot be traced (torch.compile, "
                "torch.export, FakeTensor) or run under a mode or with tensor subclasses: the custom ops take the "
                "base weights only; call it eagerly on plain tensors, or remove the adapters (merge_and_unload, "
                "unload_lora)"
            )
        return None


LORA = Lora()
