"""Which path a call takes, decided from what Python code can see of it: tracing (FakeTensor,
torch.compile, torch.export), TorchDispatchModes and TorchFunctionModes, tensor subclasses.

The Rust block's ops never reach Python, so a mode or a subclass would not see them: such calls
go through the custom ops (``plusequals::block_forward``), which modes and subclasses see as one
op, as they see any other. A donation cannot be an op, so it is refused there instead (Rust
refuses what libtorch can tell; :func:`why_not_donatable` adds what only Python knows)."""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor, nn

__all__ = ["autocast_dtype", "own_hook", "seen_by_python", "symbolic", "tracing_tensor", "why_not_donatable"]

_MODE_KEYS = tuple(
    getattr(torch._C._TorchDispatchModeKey, k)
    for k in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, k)
)

_PLAIN = (Tensor, nn.Parameter, type(None))


def _func(method: Any) -> Any:
    return getattr(method, "__func__", method)


_TENSOR_TF = _func(Tensor.__torch_function__)


def plain_torch_function(cls: type) -> bool:
    """Whether ``cls``'s torch calls are libtorch's own: its ``__torch_function__`` is Tensor's
    (which only converts the results to ``cls``) or the disabled one (``nn.Parameter``'s)."""
    tf = _func(cls.__torch_function__)
    return tf is _TENSOR_TF or tf is torch._C._disabled_torch_function_impl


def own_hook(cls: type) -> Optional[str]:
    """The hook through which a tensor subclass's own Python code sees the ops it takes part in
    (``"__torch_dispatch__"``: ATen ops; ``"__torch_function__"``: torch calls), or None where its
    ops are libtorch's own (a plain tensor, ``nn.Parameter``, a subclass that only converts
    results) or ``cls`` is no tensor's."""
    if cls in _PLAIN or not issubclass(cls, Tensor):
        return None
    if cls.__torch_dispatch__ is not Tensor.__torch_dispatch__:
        return "__torch_dispatch__"
    if not plain_torch_function(cls):
        return "__torch_function__"
    return None


def converts_results(cls: type) -> bool:
    """Whether ``cls`` has Tensor's own ``__torch_function__``, which converts results to ``cls``."""
    return cls is not Tensor and _func(cls.__torch_function__) is _TENSOR_TF


def symbolic(x: object, context: object) -> bool:
    """Whether the call is traced or fake (a FakeTensor or functional tensor, or a fake, proxy or
    functional dispatch mode active): then the custom op runs, with its fake implementation."""
    if torch._C._len_torch_dispatch_stack() and any(torch._C._get_dispatch_mode(k) is not None for k in _MODE_KEYS):
        return True
    if type(x) in _PLAIN and type(context) in _PLAIN:
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(x, (FakeTensor, FunctionalTensor)) or isinstance(context, (FakeTensor, FunctionalTensor))


def tracing_tensor(t: object) -> bool:
    """A FakeTensor or FunctionalTensor: a parameter as torch.export and torch.compile trace it
    (the custom op runs then, on what it stands for)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    device_type = x.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _user_function_modes() -> List[Any]:
    """The active TorchFunctionModes, less ``torch.device``'s (which only picks factories' device)."""
    if not torch._C._is_torch_function_mode_enabled():
        return []
    from torch.utils._device import DeviceContext

    return [m for m in torch.overrides._get_current_function_mode_stack() if not isinstance(m, DeviceContext)]


def seen_by_python(x: object, context: object, dispatch_modes: bool) -> bool:
    """Whether Python code must see this call as an op: a TorchFunctionMode is active (it sees
    torch calls, never Rust's), x or context is a tensor subclass (its ``__torch_function__`` or
    ``__torch_dispatch__`` would be bypassed), or, with ``dispatch_modes``, a TorchDispatchMode is
    active (an in-place op would hand it ``x``)."""
    if type(x) not in _PLAIN or type(context) not in _PLAIN:
        return True
    if dispatch_modes and torch._C._len_torch_dispatch_stack():
        return True
    return bool(_user_function_modes())


def why_not_donatable(x: Tensor, context: Optional[Tensor]) -> Optional[tuple]:
    """``(arg, why, message, modes)`` when Python code would see (or miss) a donation of ``x``,
    else None."""
    modes = _user_function_modes()
    if modes:
        names = [type(m).__qualname__ for m in modes]
        return (
            "x",
            "function_modes",
            f"x cannot be donated while a TorchFunctionMode is active ({', '.join(names)}): "
            "the mode sees torch calls, and a donation is none (the Rust ops would bypass it)",
            names,
        )
    if torch._C._len_torch_dispatch_stack():
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        names = [type(m).__qualname__ for m in _get_current_dispatch_mode_stack()]
        return (
            "x",
            "dispatch_modes",
            f"x cannot be donated while a TorchDispatchMode is active ({', '.join(names)}): "
            "the mode sees every op's tensors, x included, and may keep them",
            names,
        )
    for name, t in (("x", x), ("context", context)):
        reason = _subclass_reason(name, type(t))
        if reason:
            return reason
    return None


def _subclass_reason(name: str, cls: type) -> Optional[tuple]:
    hook = own_hook(cls)
    if hook == "__torch_dispatch__":
        return (
            name,
            "python_subclass",
            f"{name} is a {cls.__qualname__}, a tensor subclass with __torch_dispatch__: "
            "its Python code would be handed x by the in-place ops, and may keep it",
            [],
        )
    if hook == "__torch_function__":
        return (
            name,
            "torch_function_subclass",
            f"{name} is a {cls.__qualname__}, a tensor subclass with its own "
            "__torch_function__, which the Rust ops would bypass",
            [],
        )
    return None
