"""Builds the Rust (or C++) block from CompVis-keyed weights, after the checks whose messages
Python words better than libtorch would: the mapping's types, the dimensions, one floating dtype
on one device. Used by ``RustBlock`` and by the custom ops. Imports no other twin module but
``config`` and ``donated``."""

from __future__ import annotations

import operator
from typing import Any, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .. import _rust
from ..errors import UnsupportedBlockError
from .config import BlockConfig
from .donated import DonatedTensor

__all__ = ["build", "check_dims", "validated_inner"]

_INT64_MAX = 2**63 - 1


def build(weights: Tuple[Tensor, ...], config: BlockConfig) -> Any:
    """A Rust (or C++) block on ``weights`` (in ``config.keys`` order), through the checks below."""
    inner, _ = validated_inner(dict(zip(config.keys, weights)), config)
    return inner


def validated_inner(weights: Mapping[str, Tensor], config: BlockConfig) -> Tuple[Any, Optional[torch.device]]:
    """``from_state_dict``'s checks, then the Rust (or C++) block: (block, the weights' device)."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping of str to torch.Tensor, got {type(weights).__name__}")
    for key, value in weights.items():
        _check_weight(key, value)
    dims = check_dims(dim=config.dim, n_heads=config.n_heads, d_head=config.d_head, context_dim=config.context_dim)
    device = _check_weight_types(weights)
    rust_config = _rust.Config(**config._replace(**dims)._asdict())
    # what the C++ twin does not compute, refused naming it (rust/cpp.rs, CppBlock::refusal)
    why = rust_config.cpp_refusal() if config.language == "cpp" else None
    if why is not None:
        raise UnsupportedBlockError(why)
    inner = _rust.Block(dict(weights), rust_config)
    return inner, device


def _check_weight(key: object, value: object) -> None:
    if not isinstance(key, str):
        raise TypeError(f"weight key {key!r} must be a str, got {type(key).__name__}")
    if not isinstance(value, Tensor):
        raise TypeError(f"weight {key!r} must be a torch.Tensor, got {type(value).__name__}")
    if isinstance(value, DonatedTensor):
        raise RuntimeError(f"weight {key!r} is a donated tensor: use the tensor forward_owned returned")
    # Rust refuses nested tensors too (facts.rs, dense_size); sparse and mkldnn tensors would fail
    # deep inside libtorch with messages that name no weight.
    if value.is_nested or value.layout != torch.strided:
        kind = "a nested tensor" if value.is_nested else f"layout {value.layout}"
        raise ValueError(f"weight {key!r} must be a dense (strided) tensor, got {kind}")


def check_dims(**given: object) -> dict:
    """Positive integers (int, numpy ints: anything with ``__index__``, bool excepted) whose
    products the Rust side forms (heads * head width, 8 * dim) fit in i64; returned as ints."""
    dims: dict = {}
    for name, value in given.items():
        if value is None and name == "context_dim":
            dims[name] = None
            continue
        try:
            if isinstance(value, bool):
                raise TypeError
            dims[name] = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
        if dims[name] <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if dims["n_heads"] * dims["d_head"] > _INT64_MAX:
        raise ValueError(f"n_heads * d_head overflows int64: {dims['n_heads']} * {dims['d_head']}")
    for name in ("dim", "context_dim"):
        if dims[name] is not None and 8 * dims[name] > _INT64_MAX:
            raise ValueError(f"{name} is too large: {dims[name]}")
    return dims


def _check_weight_types(weights: Mapping[str, Tensor]) -> Optional[torch.device]:
    """All weights one floating dtype on one device; names the odd ones out (the minority), and
    devices by their torch names. Returns the weights' device (None for an empty mapping)."""
    groups: dict = {}
    for key, value in weights.items():
        groups.setdefault((value.dtype, value.device), []).append(key)
    if not groups:
        return None
    (dtype, device), _ = max(groups.items(), key=lambda kv: len(kv[1]))
    for (other_dtype, other_device), keys in groups.items():
        if (other_dtype, other_device) != (dtype, device):
            raise ValueError(
                f"weight {keys[0]!r} is {other_dtype} on {other_device}, but the other weights are {dtype} on {device}"
            )
    if not dtype.is_floating_point:
        raise ValueError(f"weights must be floating point, got {dtype} (weight {groups[(dtype, device)][0]!r})")
    return device
