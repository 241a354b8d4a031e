"""What a tensor becomes once donated: the Python face of a move.

``forward_owned(x, donate=True)`` (``RustBlock``, ``CppBlock`` and the raw extension alike) moves
``x``'s buffer into the call and turns ``x`` into a :class:`DonatedTensor`, or, for a tensor
subclass, into a donated class made for it (:func:`donated_class`), before the first write.
Any later use of ``x`` raises. A leaf: it imports only torch, and the extension imports it.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = ["DonatedTensor", "donated_class"]


class DonatedTensor(Tensor):
    """What a tensor becomes after ``forward_owned(x, donate=True)``: its buffer now belongs to
    the returned tensor, and any use of the old handle raises (the Python face of a move)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(
            f"use of a donated tensor ({name}): it was moved into forward_owned(..., donate=True); "
            "use the tensor that call returned, or pass donate=False to keep the input"
        )


_CLASSES: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def donated_class(cls: type) -> type:
    """The class an instance of ``cls`` becomes when donated: :class:`DonatedTensor` for a plain
    tensor, and for a subclass a class deriving from both, with ``cls``'s memory layout (a
    ``__slots__`` subclass cannot simply become a ``DonatedTensor``). Raises ``TypeError``
    before anything moves when ``cls`` instances cannot change class at all."""
    if cls is Tensor:
        return DonatedTensor
    if isinstance(cls, type) and issubclass(cls, DonatedTensor):
        raise TypeError("x is a donated tensor already: use the tensor forward_owned returned")
    made = _CLASSES.get(cls)
    if made is None:
        made = type(f"Donated{cls.__name__}", (DonatedTensor, cls), {"__slots__": (), "__module__": __name__})
        probe = torch.empty(0).as_subclass(cls)
        try:
            probe.__class__ = made  # the check __class__ assignment makes, on a throwaway instance
        except TypeError as e:
            raise TypeError(
                f"x is a {cls.__qualname__}, whose instances cannot be marked donated ({e}): pass donate=False"
            ) from None
        _CLASSES[cls] = made
    return made
