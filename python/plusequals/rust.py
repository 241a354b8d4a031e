"""``RustBlock``: the Python face of the Rust twin (``rust/block.rs``, built as ``plusequals._rust``)."""

from __future__ import annotations

import math
import operator
from typing import Any, List, Mapping, Optional

import torch
from torch import Tensor

from . import _rust
from .blocks import BasicTransformerBlock


class DonatedTensor(Tensor):
    """What a tensor becomes after ``forward_owned(x, donate=True)``: its buffer now belongs to
    the returned tensor, and any use of the old handle raises (the Python face of a move)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(
            f"use of a donated tensor ({name}): it was moved into RustBlock.forward_owned(..., donate=True); "
            "use the tensor that call returned, or pass donate=False to keep the input"
        )


def _check_tensor(name: str, t: object, optional: bool = False, device: Optional[torch.device] = None) -> None:
    if optional and t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, DonatedTensor):
        raise RuntimeError(
            f"{name} is a donated tensor: it was moved into RustBlock.forward_owned(..., donate=True); "
            "use the tensor that call returned, or pass donate=False to keep the input"
        )
    _check_layout(name, t)
    # libtorch's device is checked here, by name: tch reports every device other than CPU, CUDA
    # and Vulkan (meta, xpu, ...) as "Mps", which makes the Rust-side message wrong.
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the block's weights are on {device}")


def _check_layout(name: str, t: Tensor) -> None:
    # Rust refuses nested tensors too (rust/block.rs, dense_size); sparse and mkldnn tensors
    # would fail deep inside libtorch with messages that name no argument.
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise ValueError(f"{name} must be a dense (strided) tensor, got {kind}")


class RustBlock:
    """The Rust ``BasicTransformerBlock`` on the same weights as a PyTorch one.

    * ``forward(x, context=None)``: out of place (``op_plus_x``); differentiable.
    * ``forward_owned(x, context=None, donate=False)``: residuals added in place, grad off;
      the caller's tensor is never mutated unless it is donated.
    """

    LANGUAGE = "rust"  # which twin computes: rust/block.rs, or cpp/block.cpp (CppBlock)

    def __init__(self, inner: _rust.Block, device: Optional[torch.device] = None) -> None:
        self._block = inner
        self._device = device

    @classmethod
    def from_torch(cls, block: BasicTransformerBlock) -> "RustBlock":
        """Shares ``block``'s parameters (no copies): an optimizer step on ``block`` is seen here,
        and gradients of ``forward`` reach ``block``'s parameters."""
        try:
            attn1 = block.attn1
            n_heads = attn1.heads
            d_head = attn1.to_q.out_features // n_heads
            config = dict(
                dim=attn1.to_q.in_features,
                n_heads=n_heads,
                d_head=d_head,
                context_dim=block.attn2.to_k.in_features,
                gated_ff=hasattr(block.ff.net[0], "proj"),
                attention=getattr(attn1, "attention", "sdpa"),
            )
            weights = dict(block.named_parameters())
        except (AttributeError, TypeError, IndexError, ZeroDivisionError) as e:
            raise TypeError(
                f"block must be a BasicTransformerBlock (CompVis layout), got {type(block).__name__}: {e}"
            ) from e
        # What the Rust block derives rather than reads: one head count, and the softmax scale.
        attn2_heads = getattr(block.attn2, "heads", n_heads)
        if attn2_heads != n_heads:
            raise ValueError(
                f"block's attn1 has {n_heads} heads but its attn2 has {attn2_heads} heads: the Rust block "
                "uses one head count for both attentions"
            )
        for name in ("attn1", "attn2"):
            scale = getattr(getattr(block, name), "scale", None)
            if d_head > 0 and scale is not None and not math.isclose(scale, d_head**-0.5, rel_tol=1e-12):
                raise ValueError(
                    f"block's {name}.scale is {scale}, but the Rust block uses d_head ** -0.5 = {d_head**-0.5} "
                    f"(d_head {d_head})"
                )
        return cls.from_state_dict(weights, **config)

    @classmethod
    def from_state_dict(
        cls,
        weights: Mapping[str, Tensor],
        *,
        dim: int,
        n_heads: int,
        d_head: int,
        context_dim: Optional[int] = None,
        gated_ff: bool = True,
        attention: str = "sdpa",
    ) -> "RustBlock":
        """Builds the block from CompVis keys; missing, extra or mis-shaped keys raise ``ValueError``."""
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a mapping of str to torch.Tensor, got {type(weights).__name__}")
        for key, value in weights.items():
            if not isinstance(key, str):
                raise TypeError(f"weight key {key!r} must be a str, got {type(key).__name__}")
            if not isinstance(value, Tensor):
                raise TypeError(f"weight {key!r} must be a torch.Tensor, got {type(value).__name__}")
            if isinstance(value, DonatedTensor):
                raise RuntimeError(f"weight {key!r} is a donated tensor: use the tensor forward_owned returned")
            _check_layout(f"weight {key!r}", value)
        dims = _check_dims(dim=dim, n_heads=n_heads, d_head=d_head, context_dim=context_dim)
        device = _check_weight_types(weights)
        inner = _rust.Block(
            dict(weights),
            **dims,
            gated_ff=gated_ff,
            attention=attention,
            language=cls.LANGUAGE,
        )
        return cls(inner, device)

    def forward(self, x: Tensor, context: Optional[Tensor] = None) -> Tensor:
        """``x = op(norm(x)) + x`` three times, in Rust; ``x`` is only read."""
        _check_tensor("x", x, device=self._device)
        _check_tensor("context", context, optional=True, device=self._device)
        return _run_under_saved_tensor_hooks(self._block.forward, x, context)

    __call__ = forward

    def forward_owned(self, x: Tensor, context: Optional[Tensor] = None, donate: bool = False) -> Tensor:
        """``x += op(norm(x))`` three times, in Rust, with grad mode off.

        ``donate=False``: works on a copy; the caller's ``x`` is unchanged.
        ``donate=True``: writes into ``x``'s buffer and returns it under a new handle; ``x``
        itself is invalidated (any later use raises). ``x`` must then own its storage alone.
        """
        _check_tensor("x", x, device=self._device)
        _check_tensor("context", context, optional=True, device=self._device)
        if torch.is_grad_enabled():
            for name, t in (("x", x), ("context", context)):
                if t is not None and t.requires_grad:
                    raise RuntimeError(
                        f"forward_owned refuses {name}: it requires grad while grad mode is on. forward_owned adds "
                        "the residuals in place, which would overwrite activations autograd saved for backward "
                        "(the textual-inversion bug). Use forward() to train, or call forward_owned under "
                        "torch.no_grad() / torch.inference_mode()."
                    )
        if donate:
            _check_donatable(x, context)
        # With donate=True, Rust checks again from libtorch's own counts and, holding the GIL,
        # moves the buffer out of x (x becomes an empty tensor) before it writes.
        y = self._block.forward_owned(x, context, donate=bool(donate))
        if donate:
            x.__class__ = DonatedTensor
        return y

    def forward_loop(self, x: Tensor, context: Optional[Tensor] = None, n: int = 1, owned: bool = False) -> Tensor:
        """``n`` forwards without returning to Python (grad off); for measuring libtorch alone."""
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        _check_tensor("x", x, device=self._device)
        _check_tensor("context", context, optional=True, device=self._device)
        return self._block.forward_loop(x, context, n=n, owned=owned)


class CppBlock(RustBlock):
    """The libtorch C++ twin (``cpp/block.cpp``), with ``RustBlock``'s interface, checks and
    donation rules: ``CppBlock.from_torch(block)``.

    C++ computes; the Rust side validates the weights and every input first, and for
    ``forward_owned`` runs the ownership check that C++ itself does not have
    (``rust/ownership.rs``): ``void f(const at::Tensor& x) { x.add_(y); }`` compiles in C++
    (``cpp/gallery.cpp``).
    """

    LANGUAGE = "cpp"


def _check_donatable(x: Tensor, context: Optional[Tensor]) -> None:
    """The clearer, Python-side messages. The Rust side (rust/ownership.rs) checks the same
    rules and more from libtorch's own counts, atomically with the move, and is the authority."""
    if not x.untyped_storage().resizable():
        raise ValueError(
            "x cannot be donated: its memory is not libtorch's (torch.from_numpy, torch.from_dlpack, "
            "torch.frombuffer, or a shared-memory tensor): its owner, such as the numpy array, still reads it "
            "and would see the in-place writes; pass donate=False"
        )
    if x._base is not None:
        raise ValueError("x cannot be donated: it is a view of another tensor, which would see the in-place writes")
    if torch._debug_has_internal_overlap(x) != 0:  # 1: stride 0 (expanded), 2: maybe overlapping
        raise ValueError(
            f"x cannot be donated: its elements may share memory (strides {x.stride()}), so the in-place "
            "residual adds would write one location several times; pass x.contiguous() or donate=False"
        )
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            "x cannot be donated: it is an inference tensor and grad mode is not inference mode, where "
            "libtorch refuses in-place writes to it; call under torch.inference_mode() or pass donate=False"
        )
    if context is not None and context.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError(
            "context overlaps x (it shares x's storage), and x is donated: the in-place residual adds would "
            "change the context the cross-attention reads; pass context.clone() or donate=False"
        )
    # One reference from x itself, one from the temporary storage object asked for here.
    users = torch._C._storage_Use_Count(x.untyped_storage()._cdata) - 1
    if users > 1:
        raise ValueError(
            f"x cannot be donated: its storage is shared with {users - 1} other tensor(s) "
            "(views, detach(), copy.copy), which would see the in-place writes"
        )


_INT64_MAX = 2**63 - 1


def _check_dims(**given: object) -> dict:
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
                f"weight {keys[0]!r} is {other_dtype} on {other_device}, but the other weights are "
                f"{dtype} on {device}"
            )
    if not dtype.is_floating_point:
        raise ValueError(f"weights must be floating point, got {dtype} (weight {groups[(dtype, device)][0]!r})")
    return device


# --------------------------------------------------------------------------------------------
# Python exceptions from saved-tensor hooks, across the Rust call
# --------------------------------------------------------------------------------------------


class _Unhooked:
    """A tensor saved after an outer pack hook raised (the recomputation stops there anyway)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _run_under_saved_tensor_hooks(fn, *args):
    """``fn(*args)`` (a call into Rust), with any exception an active saved-tensor pack hook
    raises delivered to Python with its own type once ``fn`` returns.

    Without this, an exception raised by a Python pack hook inside a libtorch op called from
    Rust is flattened by tch into ``RuntimeError('Internal torch error: ')``. That breaks
    non-reentrant ``torch.utils.checkpoint`` (diffusers' gradient checkpointing), whose
    recomputation stops early by raising ``_StopRecomputationError`` from its pack hook once
    every tensor it needs is recomputed. Here the outer hooks are wrapped: the first exception
    is held, the rest of ``fn`` runs without calling the outer pack hook again (what it saves
    then is discarded with the stopped recomputation), and the exception is raised after.
    """
    if not torch.is_grad_enabled() or not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return fn(*args)
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return fn(*args)
    outer_pack, outer_unpack = top
    raised: List[BaseException] = []

    def pack(t: Tensor) -> Any:
        if raised:
            return _Unhooked(t)
        try:
            return outer_pack(t)
        except BaseException as e:  # noqa: BLE001  (re-raised below, type intact)
            raised.append(e)
            return _Unhooked(t)

    def unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Unhooked) else outer_unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*args)
    if raised:
        raise raised[0]
    return out
