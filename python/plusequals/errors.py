"""The exception classes, made in Rust (``rust/python/errors.rs``) and re-exported here and by the
package: callers and tests match on the class and its fields, not on text. A class with fields
takes them in its constructor after the message (``OwnershipError(message, arg, why, count=None,
modes=())``, ``UseAfterDonation(message, op)``) and reads them back as read-only attributes;
``str(e)`` is the message, and ``pickle`` keeps the fields.

* :class:`OwnershipError` (a ``ValueError``): a tensor an in-place entry point would write into,
  or read while writing, is not the caller's alone; nothing was written. ``.arg`` names the
  argument, ``.why`` the kind of second name (``"other_handles"``, ``"weak_refs"``, ``"view"``,
  ``"dispatch_modes"``, ...), ``.count`` how many (or None), ``.modes`` the modes' names (for
  ``"dispatch_modes"``).
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

from ._rust import (
    DonationConsumed,
    OwnershipError,
    StaleBlock,
    UnsupportedBlockError,
    UseAfterDonation,
    WeightsChanged,
)

__all__ = [
    "DonationConsumed",
    "OwnershipError",
    "StaleBlock",
    "UnsupportedBlockError",
    "UseAfterDonation",
    "WeightsChanged",
]
