"""The exception classes, made in Rust (``rust/python/errors.rs``, ``create_exception!``) and re-exported
here and by the package: callers and tests match on the class and its attributes, not on text.

* :class:`OwnershipError` (a ``ValueError``): a tensor an in-place entry point would write into,
  or read while writing, is not the caller's alone; nothing was written. ``.arg`` names the
  argument, ``.why`` the kind of second name (``"other_handles"``, ``"weak_refs"``, ``"view"``,
  ``"dispatch_modes"``, ...), ``.count`` how many (or None), ``.modes`` the modes' names.
* :class:`UnsupportedBlockError` (a ``ValueError``): a block, or a call, the Rust block cannot
  reproduce exactly (:mod:`plusequals.twin.faithful`).
* :class:`StaleBlock` (a ``ValueError``): the block changed since the Rust side read it;
  ``RustBlock`` reads it again and rebuilds (only the raw extension lets it through).
* :class:`WeightsChanged` (a ``RuntimeError``): a weight was written in place by another thread
  while a forward read it; the result is discarded.
* :class:`DonationConsumed` (a ``RuntimeError``): a donation failed after its first write; ``x``
  is marked donated and the result discarded.
* :class:`UseAfterDonation` (a ``DonationConsumed``): a donated tensor was used (rustc's E0382, at
  run time); ``.op`` names the operation.
"""

from __future__ import annotations

from typing import Iterable, Optional

from ._rust import DonationConsumed, OwnershipError, StaleBlock, UnsupportedBlockError, WeightsChanged

__all__ = [
    "DonationConsumed",
    "OwnershipError",
    "StaleBlock",
    "UnsupportedBlockError",
    "UseAfterDonation",
    "WeightsChanged",
    "ownership_error",
]


class UseAfterDonation(DonationConsumed):
    """A tensor given to ``forward_owned(..., donate=True)`` was used afterwards; ``.op`` is the
    operation (``"sum"``, ``"shape (get)"``)."""

    op: str = ""


def ownership_error(
    message: str, arg: str, why: str, count: Optional[int] = None, modes: Iterable[str] = ()
) -> OwnershipError:
    """An :class:`OwnershipError` with its attributes, for the refusals only Python can make (a
    TorchFunctionMode, a subclass whose ``__torch_function__`` the Rust ops would bypass)."""
    error = OwnershipError(message)
    error.arg, error.why, error.count, error.modes = arg, why, count, list(modes)
    return error
