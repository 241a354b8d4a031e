"""The Rust (and C++) block as ``torch.library`` custom ops: what ``torch.compile``, ``torch.export``
and FakeTensor see of a ``RustBlock``.

* ``plusequals::block_forward(x, context, weights, ...) -> Tensor``: ``op_plus_x`` in Rust. It
  has a fake (meta) implementation and an autograd formula (below).
* ``plusequals::block_forward_owned_(x!, context, weights, ...) -> ()``: the in-place residuals,
  written into ``x`` (the mutation is declared: ``mutates_args=("x",)``). It has a fake
  implementation and no autograd formula (``forward_owned`` is a no-grad entry point).
* ``plusequals::block_backward(grad, x, context, weights, ..., needs) -> Tensor[]``: the
  gradients of ``block_forward``. Its implementation runs the Rust forward again on detached
  leaves under grad mode and asks libtorch's autograd (the same graph, so the same bits as
  differentiating ``RustBlock.forward`` directly), then returns the gradients asked for. One
  forward more per backward is the price of an op that is opaque to the compiler.

The weights are arguments (a ``Tensor[]`` in :attr:`plusequals.twin.config.BlockConfig.keys` order), so a
traced graph always passes the weights the module holds *now*; ``slot`` names the :class:`Twin`
of the ``RustBlock`` that made the call, whose Rust block is reused while it still stands on
exactly those tensors (:meth:`Twin.fresh`) and rebuilt otherwise. An unknown or dead slot
(an exported program run after its module is gone) only means a build per call.

``autocast`` is the autocast dtype at the call (``None``: autocast off). Inside a custom op
libtorch turns autocast off, and a compiled graph calls the op outside the autocast region it
was traced in; the implementations therefore set autocast from this argument, so the op
computes the same function wherever it runs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import typing
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .build import build
from .config import OP_FIELDS, BlockConfig

__all__ = ["Twin", "block_backward", "block_forward", "block_forward_owned_"]


# --------------------------------------------------------------------------------------------
# Twins: a Rust block, and the tensors it was built on
# --------------------------------------------------------------------------------------------

_TWINS: "weakref.WeakValueDictionary[int, Twin]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def _facts(ws: Sequence[Tensor]) -> tuple:
    """What a Rust block bakes in about its weights: where they are (their storage), their
    shapes, dtype and device. The Rust block holds the same TensorImpls as Python, so it sees
    anything else (new values, an optimizer step) live. One dtype and device for all (the build
    checks it); a single tensor moved or cast gets new storage while its old one is still alive,
    so its address changes."""
    if not ws:
        return ((), (), None, None)
    return (tuple(map(Tensor.data_ptr, ws)), tuple(w.shape for w in ws), ws[0].dtype, ws[0].device)


class Twin:
    """One ``RustBlock``'s Rust block and what it stands on: the weight tensors, their
    :func:`_facts` at the build, and the configuration. Registered under ``id`` (weakly) for
    the custom ops. A copy (``copy.deepcopy``, pickling) is a new, empty twin.

    ``other`` is the block a custom-op call last built on other tensors than the eager one's
    (a traced graph's inputs): kept apart, so that the eager path, which trusts ``inner`` to stand
    on the module's parameters, never computes with them."""

    __slots__ = ("id", "inner", "weights", "facts", "config", "other", "__weakref__")

    def __init__(self, inner: Any = None) -> None:
        self.id = next(_IDS)
        self.inner = inner
        self.weights: Optional[Tuple[Tensor, ...]] = None
        self.facts: Optional[tuple] = None
        self.config: Optional[BlockConfig] = None
        self.other: Optional["Twin"] = None
        _TWINS[self.id] = self

    def set(self, inner: Any, weights: Sequence[Tensor], config: BlockConfig) -> None:
        weights = weights if isinstance(weights, tuple) else tuple(weights)
        self.inner, self.weights, self.facts, self.config = inner, weights, _facts(weights), config

    def fresh(self, weights: Sequence[Tensor], config: BlockConfig) -> bool:
        """Whether ``inner`` computes with exactly ``weights`` under ``config``: the tensors it was
        built on are unchanged (no ``.data =``, ``.half()``, ``.to()`` since) and ``weights`` are
        those tensors, or other handles on the same memory with the same dtype and device."""
        ws = self.weights
        if ws is None or config != self.config or len(ws) != len(weights):
            return False
        facts = _facts(ws)
        if facts != self.facts:
            return False
        return weights is ws or all(map(operator.is_, ws, weights)) or _facts(weights) == facts

    def for_op(self, weights: Sequence[Tensor], config: BlockConfig) -> Any:
        """The block a custom-op call on ``weights`` computes with: ``inner`` if it stands on them,
        else the one kept in ``other``, rebuilt when it does not."""
        if self.fresh(weights, config):
            return self.inner
        if self.other is None:
            self.other = Twin.__new__(Twin)
            self.other.weights = self.other.facts = self.other.config = self.other.other = None
        if not self.other.fresh(weights, config):
            self.other.set(build(weights, config), weights, config)
        return self.other.inner

    def __deepcopy__(self, memo: dict) -> "Twin":
        return Twin()

    def __reduce__(self):
        return (Twin, ())


def _inner_for(weights: Sequence[Tensor], config: BlockConfig, slot: int) -> Any:
    twin = _TWINS.get(slot)
    return build(weights, config) if twin is None else twin.for_op(weights, config)


@contextlib.contextmanager
def _autocast(device_type: str, dtype: Optional[torch.dtype]):
    if device_type not in ("cpu", "cuda"):
        yield
    elif dtype is None:
        with torch.autocast(device_type, enabled=False):
            yield
    else:
        with torch.autocast(device_type, dtype=dtype):
            yield


_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, k)
    for k in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")
)


@contextlib.contextmanager
def _autograd_on():
    """Undoes what a custom op's dispatch does to the thread's key set (autograd excluded), so
    that the Rust forward inside ``block_backward`` records a graph."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def out_dtype(x_dtype: torch.dtype, autocast: Optional[torch.dtype]) -> torch.dtype:
    """The dtype of the block's output: ``x``'s, or under autocast what ``op(norm(x)) + x``
    promotes to (autocast runs the linear layers in its dtype; LayerNorm in fp32)."""
    if autocast is None or x_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return x_dtype
    return torch.promote_types(x_dtype, autocast)


# --------------------------------------------------------------------------------------------
# The configuration, flat: a custom op's schema takes no tuple
# --------------------------------------------------------------------------------------------


def _unflatten(args: Sequence[Any], at: int) -> tuple:
    """``args`` of a custom op, which take :data:`OP_FIELDS` flat from position ``at``, with
    those fields as one :class:`BlockConfig`: the one place the ops' configuration is built."""
    n = len(OP_FIELDS)
    return (*args[:at], BlockConfig(*args[at : at + n]), *args[at + n :])


def _config_flat(impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl``, which takes a :class:`BlockConfig` as ``config``, as a custom op's function (or its
    fake): the same parameters with ``config`` replaced by :data:`OP_FIELDS`, typed as in
    ``BlockConfig`` (``torch.library`` reads the op's schema from this signature)."""
    sig = inspect.signature(impl)
    params = list(sig.parameters.values())
    at = list(sig.parameters).index("config")
    hints = typing.get_type_hints(BlockConfig)
    fields = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[n]) for n in OP_FIELDS]
    flat_sig = sig.replace(parameters=params[:at] + fields + params[at + 1 :])

    @functools.wraps(impl)
    def flat(*args: Any, **kwargs: Any) -> Any:
        return impl(*_unflatten(tuple(flat_sig.bind(*args, **kwargs).arguments.values()), at))

    flat.__signature__ = flat_sig  # type: ignore[attr-defined]
    return flat


# --------------------------------------------------------------------------------------------
# plusequals::block_forward
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("plusequals::block_forward", mutates_args=())
@_config_flat
def block_forward(
    x: Tensor,
    context: Optional[Tensor],
    weights: List[Tensor],
    config: BlockConfig,
    slot: int,
    autocast: Optional[torch.dtype],
) -> Tensor:
    """``RustBlock.forward``: ``x = op(norm(x)) + x`` three times, in Rust (or C++)."""
    inner = _inner_for(weights, config, slot)
    with torch.no_grad(), _autocast(x.device.type, autocast):
        y = inner.forward(x, context)
    return y.contiguous()


def check_inputs(
    x: Tensor,
    context: Optional[Tensor],
    weights: Sequence[Tensor],
    config: BlockConfig,
    autocast: Optional[torch.dtype],
) -> None:
    """What the Rust block checks first (rust/block.rs, check_inputs), for the fake
    implementations: a traced call is refused where the real one would be, with the same words."""
    dim = config.dim
    width = dim if config.context_dim is None else config.context_dim
    kind = weights[0].dtype if weights else None
    for name, t, w in (("x", x, dim), ("context", context, width)):
        if t is None:
            if name == "context" and width != dim:
                raise ValueError(f"context is required: the block's cross-attention expects width {width}")
            continue
        if t.dim() != 3 or t.shape[-1] != w:
            raise ValueError(f"{name} expected shape (batch, tokens, {w}), got {list(t.shape)}")
        if kind is not None and t.dtype != kind and t.dtype != autocast:
            raise ValueError(
                f"{name} dtype {t.dtype} does not match the block's weights ({kind}), and autocast is "
                + ("off" if autocast is None else f"{autocast}")
            )
    if context is not None and context.shape[0] != x.shape[0]:
        raise ValueError(f"context batch {context.shape[0]} does not match x's batch {x.shape[0]}")


@block_forward.register_fake
@_config_flat
def _block_forward_fake(x, context, weights, config, slot, autocast):
    check_inputs(x, context, weights, config, autocast)
    return x.new_empty(x.shape, dtype=out_dtype(x.dtype, autocast))


def _setup_context(ctx, inputs, output) -> None:
    x, context, weights, config, slot, autocast = _unflatten(inputs, 3)
    ctx.save_for_backward(x, context, *weights)
    ctx.config = config
    ctx.autocast = autocast
    ctx.needs = (x.requires_grad, context is not None and context.requires_grad, [w.requires_grad for w in weights])


def _backward(ctx, grad: Tensor):
    x, context, *weights = ctx.saved_tensors
    need_x, need_context, need_weights = ctx.needs
    grads = block_backward(
        grad, x, context, weights, *ctx.config.op_fields, ctx.autocast, need_x, need_context, need_weights
    )
    gx = grads[0] if need_x else None
    gc = grads[1] if need_context else None
    gw = [g if n else None for g, n in zip(grads[2:], need_weights)]
    return (gx, gc, gw) + (None,) * 9


block_forward.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# plusequals::block_backward
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("plusequals::block_backward", mutates_args=())
@_config_flat
def block_backward(
    grad: Tensor,
    x: Tensor,
    context: Optional[Tensor],
    weights: List[Tensor],
    config: BlockConfig,
    autocast: Optional[torch.dtype],
    need_x: bool,
    need_context: bool,
    need_weights: List[bool],
) -> List[Tensor]:
    """The gradients of ``block_forward`` for x, context and each weight (an empty tensor where
    not asked for): the Rust forward again, on detached leaves, differentiated by libtorch.
    x's gradient has ``grad``'s memory layout (:func:`_grad_x_like`), the others are contiguous."""
    needs = [need_x, need_context and context is not None, *need_weights]
    with _autograd_on():
        xl = x.detach().requires_grad_(need_x)
        cl = None if context is None else context.detach().requires_grad_(need_context)
        wl = [w.detach().requires_grad_(n) for w, n in zip(weights, need_weights)]
        inner = build(wl, config)
        with _autocast(x.device.type, autocast):
            y = inner.forward(xl, cl)
        leaves = [t for t, n in zip([xl, cl, *wl], needs) if n]
        found = iter(torch.autograd.grad(y, leaves, grad, allow_unused=True) if leaves else ())
    out = []
    for i, (t, n) in enumerate(zip([x, context, *weights], needs)):
        if not n:
            out.append(x.new_empty(0))
            continue
        g = next(found)
        if i == 0:
            out.append(_grad_x_like(grad, x.dtype, g))
        else:
            out.append((torch.zeros_like(t) if g is None else g).contiguous())
    return out


def _grad_x_like(grad: Tensor, dtype: torch.dtype, g: Optional[Tensor]) -> Tensor:
    """x's gradient laid out as ``grad`` (``empty_like``'s preserve_format), as the eager
    RustBlock's gradient is: the residual adds carry the incoming gradient's layout through.
    A contiguous copy instead changes the strides the ops before the block see in a compiled
    backward, and kernels that reduce in memory order add in another order: in a diffusers
    UNet, Transformer2DModel's ``permute(0, 2, 3, 1)`` after ``proj_in`` (a 1x1 conv) turns it
    into a channels-last gradient, and with one thread libtorch runs a 1x1 conv with batch < 16
    in THNN, whose bias gradient sums the gradient in memory order (docs/guide/building.md).
    ``g=None`` (x unused): zeros. The fake implementation returns ``empty_like(grad)`` too."""
    out = torch.empty_like(grad, dtype=dtype)
    if g is None:
        return out.zero_()
    return g if g.stride() == out.stride() and g.data_ptr() != grad.data_ptr() else out.copy_(g)


@block_backward.register_fake
@_config_flat
def _block_backward_fake(grad, x, context, weights, config, autocast, need_x, need_context, need_weights):
    needs = [need_x, need_context and context is not None, *need_weights]
    out = [t.new_empty(t.shape) if n else x.new_empty(0) for t, n in zip([x, context, *weights], needs)]
    if need_x:
        out[0] = torch.empty_like(grad, dtype=x.dtype)
    return out


# --------------------------------------------------------------------------------------------
# plusequals::block_forward_owned_
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("plusequals::block_forward_owned_", mutates_args=("x",))
@_config_flat
def block_forward_owned_(
    x: Tensor,
    context: Optional[Tensor],
    weights: List[Tensor],
    config: BlockConfig,
    slot: int,
    autocast: Optional[torch.dtype],
) -> None:
    """``RustBlock.forward_owned``: ``x += op(norm(x))`` three times, the result left in ``x``.
    (Rust's ownership check sees the handles a dispatcher call keeps on ``x``, so Rust works on
    its own copy, and the result is copied back.)"""
    inner = _inner_for(weights, config, slot)
    with torch.no_grad(), _autocast(x.device.type, autocast):
        y = inner.forward_owned(x, context, donate=False)
        x.copy_(y)


@block_forward_owned_.register_fake
@_config_flat
def _block_forward_owned_fake(x, context, weights, config, slot, autocast):
    check_inputs(x, context, weights, config, autocast)
    return None
