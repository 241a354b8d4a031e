"""``RustBlock``: the Python face of the Rust twin (``rust/block.rs``, built as ``plusequals._rust``)."""

from __future__ import annotations

from typing import Mapping, Optional

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


def _check_tensor(name: str, t: object, optional: bool = False) -> None:
    if optional and t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if isinstance(t, DonatedTensor):
        DonatedTensor.__torch_function__(Tensor.size, ())


class RustBlock:
    """The Rust ``BasicTransformerBlock`` on the same weights as a PyTorch one.

    * ``forward(x, context=None)``: out of place (``op_plus_x``); differentiable.
    * ``forward_owned(x, context=None, donate=False)``: residuals added in place, grad off;
      the caller's tensor is never mutated unless it is donated.
    """

    def __init__(self, inner: _rust.Block) -> None:
        self._block = inner

    @classmethod
    def from_torch(cls, block: BasicTransformerBlock) -> "RustBlock":
        """Shares ``block``'s parameters (no copies): an optimizer step on ``block`` is seen here,
        and gradients of ``forward`` reach ``block``'s parameters."""
        attn1 = block.attn1
        d_head = attn1.to_q.out_features // attn1.heads
        return cls.from_state_dict(
            dict(block.named_parameters()),
            dim=attn1.to_q.in_features,
            n_heads=attn1.heads,
            d_head=d_head,
            context_dim=block.attn2.to_k.in_features,
            gated_ff=hasattr(block.ff.net[0], "proj"),
            attention=getattr(attn1, "attention", "sdpa"),
        )

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
            if not isinstance(value, Tensor):
                raise TypeError(f"weight {key!r} must be a torch.Tensor, got {type(value).__name__}")
        inner = _rust.Block(
            dict(weights),
            dim=dim,
            n_heads=n_heads,
            d_head=d_head,
            context_dim=context_dim,
            gated_ff=gated_ff,
            attention=attention,
        )
        return cls(inner)

    def forward(self, x: Tensor, context: Optional[Tensor] = None) -> Tensor:
        """``x = op(norm(x)) + x`` three times, in Rust; ``x`` is only read."""
        _check_tensor("x", x)
        _check_tensor("context", context, optional=True)
        return self._block.forward(x, context)

    __call__ = forward

    def forward_owned(self, x: Tensor, context: Optional[Tensor] = None, donate: bool = False) -> Tensor:
        """``x += op(norm(x))`` three times, in Rust, with grad mode off.

        ``donate=False``: works on a copy; the caller's ``x`` is unchanged.
        ``donate=True``: writes into ``x``'s buffer and returns it under a new handle; ``x``
        itself is invalidated (any later use raises). ``x`` must then own its storage alone.
        """
        _check_tensor("x", x)
        _check_tensor("context", context, optional=True)
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
            _check_donatable(x)
        y = self._block.forward_owned(x, context, donate=bool(donate))
        if donate:
            x.set_()  # drop the old handle's reference to the buffer now owned by y
            x.__class__ = DonatedTensor
        return y

    def forward_loop(self, x: Tensor, context: Optional[Tensor] = None, n: int = 1, owned: bool = False) -> Tensor:
        """``n`` forwards without returning to Python (grad off); for measuring libtorch alone."""
        _check_tensor("x", x)
        _check_tensor("context", context, optional=True)
        return self._block.forward_loop(x, context, n=n, owned=owned)


def _check_donatable(x: Tensor) -> None:
    if x._base is not None:
        raise ValueError("x cannot be donated: it is a view of another tensor, which would see the in-place writes")
    # One reference from x itself, one from the temporary storage object asked for here.
    users = torch._C._storage_Use_Count(x.untyped_storage()._cdata) - 1
    if users > 1:
        raise ValueError(
            f"x cannot be donated: its storage is shared with {users - 1} other tensor(s) "
            "(views, detach(), copy.copy), which would see the in-place writes"
        )
