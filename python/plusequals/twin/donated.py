"""What a tensor becomes once donated: the Python face of a move.

``forward_owned(x, donate=True)`` (``RustBlock``, ``CppBlock`` and the raw extension alike) moves
``x``'s buffer into the call and turns ``x`` into a :class:`DonatedTensor`, or, for a tensor
subclass, into a donated class made for it (:func:`donated_class`), before the first write.
Any later use of ``x`` raises :class:`plusequals.errors.UseAfterDonation` naming the operation;
``repr``/``str``/``format`` say that it was donated instead (debuggers and loggers print it). It
imports only torch and, when a use raises, :mod:`plusequals.errors`; the extension imports it.
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
        if func in _SHOWN:
            return f"{cls.__name__}(donated: its buffer was moved into forward_owned(..., donate=True))"
        from ..errors import UseAfterDonation

        op = operation_name(func)
        raise UseAfterDonation(
            f"use of a donated tensor ({op}): it was moved into forward_owned(..., donate=True); "
            "use the tensor that call returned, or pass donate=False to keep the input",
            op,
        )


# What prints a tensor: a donated one says so instead of raising.
_SHOWN = (Tensor.__repr__, Tensor.__str__, Tensor.__format__)


def operation_name(func) -> str:
    """``add``, ``sum``; for an attribute (``x.shape``, ``x.grad``), its name, not ``__get__``."""
    name = getattr(func, "__name__", None) or str(func)
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__", "__delete__") and getattr(owner, "__name__", None):
        return f"{owner.__name__} ({name.strip('_')})"
    return name


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
