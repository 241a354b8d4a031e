"""``RustBlock``: the Python face of the Rust twin (``rust/block.rs``, built as ``plusequals._rust``),
as a ``torch.nn.Module``.

What a block must be for the Rust block to reproduce it is :mod:`plusequals.twin.faithful` (shared with
the diffusers swap); how a RustBlock made from a module stays on that module's current weights
is :class:`plusequals.twin.follow.Follow` (which the swap's replacement, a subclass, holds too); where
a call goes is :func:`plusequals.twin.route.route`; what ``torch.compile``, ``torch.export`` and
FakeTensor see is :mod:`plusequals.twin.ops`.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import _rust
from ..errors import OwnershipError, UnsupportedBlockError
from . import ops
from .adapter import Carried
from .arguments import check_tensor, masks_of, seen
from .build import check_dims, validated_inner
from .config import BlockConfig
from .delegate import delegated
from .dispatch import autocast_dtype, converts_results, why_not_donatable
from .faithful import ADAPTERS, Reading, require_module
from .follow import Follow
from .hooks import run_under_saved_tensor_hooks
from .ip_adapter import forward_tuple
from .probe import note_call
from .route import Path, route, route_owned

# torch.compile and torch.export trace through this name too (Dynamo knows the function, not the
# name): under them it is True, and the hot path, an opaque call, is never traced.
_is_compiling = torch.compiler.is_compiling


def _constant_result(fn):  # type: ignore[no-untyped-def]
    """``torch.compiler.assume_constant_result``'s mark, without its import of Dynamo: that import
    is most of ``import plusequals`` (1.4 s of CPU), paid by every process that imports it, where
    only a process that compiles needs Dynamo (tests/test_architecture.py holds the two equal)."""
    fn._dynamo_marked_constant = True
    return fn


# from_torch and the swap's block: the module to follow comes next (_adopt)
ADOPT = object()


class RustBlock(nn.Module):
    """The Rust ``BasicTransformerBlock`` on the same weights as a PyTorch one, as a torch module.

    * ``forward(x, context=None)``: out of place (``op_plus_x``); differentiable.
    * ``forward_owned(x, context=None, donate=False)``: residuals added in place, grad off;
      the caller's tensor is never mutated unless it is donated.

    Both take ``attention_mask`` and ``encoder_attention_mask`` (keywords; diffusers' semantics:
    :class:`plusequals.model.blocks.AttentionExtras`), in eager calls on plain tensors; where the custom
    ops would run (tracing, FakeTensor, modes, subclasses) masks are refused.

    Made with :meth:`from_torch`, it takes over the PyTorch block's submodules (``norm1``,
    ``attn1``, ..., the same objects: no copies), so its ``parameters()`` and ``state_dict()``
    are the block's, under the CompVis keys, and it follows them: every call checks that what
    :func:`plusequals.twin.faithful.read_block` read is still there (submodules, parameters,
    ``eps``, dropout, processors, hooks) and that the parameters' storage, dtype and device are
    the ones its Rust block was built on; otherwise it reads the block again, rebuilds, or
    raises :class:`UnsupportedBlockError` naming the cause. It never computes with old weights.
    Made with :meth:`from_state_dict`, it computes with the tensors of that mapping (rebuilt
    if their storage, dtype or device change).

    Under ``torch.compile``, ``torch.export`` or FakeTensor, it calls the custom ops of
    :mod:`plusequals.twin.ops`, which take the weights as arguments.
    """

    LANGUAGE = "rust"  # which twin computes: rust/block.rs, or cpp/block.cpp (CppBlock)
    CASTS_LAYERWISE = False  # whether its forward runs diffusers' layerwise casting (the swap's does: twin/casting.py)

    def __init__(self, inner: Any = None, device: Optional[torch.device] = None) -> None:
        if inner is None:
            name = type(self).__name__
            raise TypeError(
                f"{name}() needs a block: {name}.from_torch(block) follows a PyTorch block, "
                f"{name}.from_state_dict(weights, dim=..., n_heads=..., d_head=...) builds one from CompVis keys"
            )
        super().__init__()
        self._twin = ops.Twin(None if inner is ADOPT else inner)
        self._slot = self._twin.id
        self._device = device
        self._config: Optional[BlockConfig] = None  # what the weights alone do not tell, and LANGUAGE
        self._weights: Optional[Tuple[Tensor, ...]] = None  # the tensors it computes with now
        # Following a module (from_torch, the swap): its source, reading, watch and probe (_adopt).
        self._follow: Optional[Follow] = None
        self._entry: Any = None  # the hot path's entry into Rust (_rebind)
        self._rebind()

    @property
    def _block(self) -> Any:
        """The Rust block it computes with (``_rust.Block``)."""
        return self._twin.inner

    @property
    def _source(self) -> Optional[nn.Module]:
        """The PyTorch block it follows (not registered: its submodules are), or None."""
        follow = self._follow
        return None if follow is None else follow.source

    @property
    def _reading(self) -> Optional[Reading]:
        """The last reading of the block it follows (None: read again at the next call)."""
        follow = self._follow
        return None if follow is None else follow.reading

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_torch(cls, block: nn.Module, *, trust: Optional[str] = None) -> "RustBlock":
        """Takes over ``block``'s submodules and parameters (no copies) and follows them: an
        optimizer step, ``load_state_dict`` (also with ``assign=True``), ``.to()``, ``.half()``,
        a replaced parameter or submodule, a changed class, a grown ``Sequential`` or a new hook
        on ``block`` is seen here, and gradients of ``forward`` reach ``block``'s parameters.
        Refuses, with an :class:`UnsupportedBlockError` (a ``ValueError``) naming the cause, a block the
        Rust block cannot reproduce exactly (:mod:`plusequals.twin.faithful`).

        ``trust``: a block whose classes this crate does not know (an independent CompVis
        implementation, a subclass) is refused by default, because nothing can watch what their
        ``forward`` reads. ``trust="probe"`` accepts it when its output agrees with the Rust
        block's on a probe input, and probes it again whenever its dtype, device or the instance
        state of those classes changes (every value on the instance, by identity). What that gives
        up: a change the watch cannot see (a value mutated inside a list or dict the forward
        reads, a class attribute, a global) is not followed; and on the meta device the probe
        cannot run (it runs in the block's dtype, on its device), so the block runs as last probed
        (or, built there, unprobed until it moves to a device where the probe can run)."""
        require_module(block)
        rb = cls(ADOPT)
        rb._adopt(block, trust=trust)  # a block it cannot reproduce is refused before it is followed
        return rb

    def _adopt(self, block: nn.Module, error: type = UnsupportedBlockError, trust: Optional[str] = None) -> None:
        """Registers ``block``'s six submodules here, reads ``block`` once (a refusal raises here,
        with ``block`` untouched), follows it, builds the Rust block."""
        follow = Follow(
            block,
            self._modules,
            self._where(),
            casts_layerwise=self.CASTS_LAYERWISE,
            holds=self._holds,
            drop=self._drop,
            trust=trust,
        )
        self._follow = follow
        follow.take_submodules()
        self._read(error)
        follow.resume()
        self._ensure_current(error)  # the reading above is current: builds and probes

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
        """Builds the block from CompVis keys; missing, extra or mis-shaped keys raise ``ValueError``.

        It follows the tensors ``weights`` holds now, not the mapping: writes into them are seen
        (in place, or ``.data =`` of another dtype or device, which rebuilds); rebinding a key of
        the mapping afterwards is not. Build it again to take new tensors."""
        config = BlockConfig(dim, n_heads, d_head, context_dim, gated_ff, attention, cls.LANGUAGE)
        inner, device = validated_inner(weights, config)
        rb = cls(inner, device)
        dims = check_dims(dim=dim, n_heads=n_heads, d_head=d_head, context_dim=context_dim)
        rb._config = config._replace(gated_ff=bool(gated_ff), **dims)
        rb._weights = tuple(weights[k] for k in rb._config.keys)
        rb._twin.set(inner, rb._weights, rb._config)
        rb._rebind()
        return rb

    # -- the Rust block and the module it follows ------------------------------------------------

    def _rebind(self) -> None:
        """The hot path's entry (``plusequals._rust.Entry``): the current Rust block bound to the
        watch of the last reading, so that a forward is one call into Rust, which checks there what
        Python would (plain tensors, no mode or saved-tensor hook that would see the ops) and then
        everything the full path checks. None (every call takes the full path, :meth:`_call`) while
        the module must be read again first: never read (a copy), or refused. Called wherever the
        Rust block or the reading changes: the block's construction, :meth:`_ensure_current`, and
        unpickling."""
        inner, follow, config = self._twin.inner, self._follow, self._config
        cold = config is not None and not all(a.hot(config) for a in ADAPTERS)  # an adapter's inputs: Python's
        if not isinstance(inner, _rust.Block) or (follow is not None and follow.reading is None) or cold:
            self._entry = None
        else:
            self._entry = _rust.Entry(inner, None if follow is None else follow.watch())

    def _where(self) -> str:
        return type(self).__name__

    def _ensure_current(self, error: type = UnsupportedBlockError) -> None:
        """The eager check before each call; a few microseconds when nothing changed. Made from a
        module: read again where the watch moved (:meth:`_read`), built again where the weights
        moved, and the code probed where it changed or the weights' dtype or device did
        (:class:`Follow`); a refusal raises ``error``, with the hot path off. From a state dict: a
        rebuild where its tensors moved."""
        follow = self._follow
        if follow is not None:
            self._entry = None  # the hot path is off until the check has finished (_rebind)
            if follow.stale():
                self._read(error)
            weights = self._weights
            if weights is not None:
                if self._rebuild():
                    follow.rebuilt(weights[0])
                follow.check_code(self._probe_forward(), self._config, weights[0], error)
        elif self._weights is not None:
            self._rebuild()
        else:
            return  # a raw Rust block (RustBlock(inner)): nothing to follow
        self._rebind()  # read, built and probed: the hot path may call it

    def _read(self, error: type = UnsupportedBlockError, traced: bool = False) -> None:
        """Reads the module it follows again (:meth:`Follow.read`; a refusal raises ``error``) and
        computes with what it read: its configuration and, in an eager call, its weights. The hot
        path is off until the check has finished (:meth:`_rebind`)."""
        self._entry = None
        reading = self._follow.read(error, traced)
        self._config = reading.spec._replace(language=self.LANGUAGE)
        if not traced:
            self._weights = tuple(reading.weights())

    def _refuse(self, why: str) -> None:
        """Refuses the call (:meth:`Follow.refuse`), with the hot path off."""
        self._entry = None
        self._follow.refuse(UnsupportedBlockError, why)

    def _holds(self, t: Any) -> bool:
        """Whether its Rust block computes with the tensor ``t`` (twin/letgo.py asks its Follow)."""
        weights = self.__dict__.get("_weights")
        return weights is not None and any(w is t for w in weights)

    def _rebuild(self) -> bool:
        """Builds the Rust block again unless it stands on exactly its weights now (storage, dtype,
        device: ``ops.Twin.fresh``); whether it did."""
        weights = self._weights
        if weights is None or self._twin.fresh(weights, self._config):
            return False
        inner, self._device = validated_inner(dict(zip(self._config.keys, weights)), self._config)
        self._twin.set(inner, weights, self._config)
        return True

    def _probe_forward(self) -> Any:
        """The Rust block's forward, for the probe (the swap casts around it: twin/casting.py)."""
        return self._twin.inner.forward

    @_constant_result
    def _check_for_trace(self) -> int:
        """Under torch.compile, run once at trace time: the block is read again if it changed
        (refusals raise there). The weights themselves reach the custom op as arguments."""
        if self._follow.stale():
            self._read(traced=True)
        return 0

    def _traced_weights(self) -> List[Tensor]:
        """The weights for a custom-op call, read through the module (so a traced graph takes
        them as inputs), after the structure check."""
        follow = self._follow
        if follow is not None:
            self._check_for_trace()
            follow.check_traced(self._config)
            # getattr, not get_parameter: functional_call puts plain tensors there (torch.func)
            return [getattr(self.get_submodule(owner), name) for owner, _, name in map(_split, follow.paths)]
        if self._weights is None:
            raise RuntimeError(
                f"this {type(self).__name__} wraps a raw Rust block and has no weights to pass to the custom ops: "
                "build it with from_torch or from_state_dict to trace it (torch.compile, torch.export, FakeTensor)"
            )
        return list(self._weights)

    def _op_args(self, x: Tensor, context: Optional[Tensor], masks: Optional[Dict[str, Tensor]] = None) -> tuple:
        if masks:
            raise UnsupportedBlockError(
                f"{self._where()}: {' and '.join(masks)} cannot be traced (torch.compile, torch.export, FakeTensor) "
                "or run under a mode or with tensor subclasses: the custom ops take no masks; call it eagerly on "
                "plain tensors"
            )
        weights = self._traced_weights()
        for name, t in (("x", x), ("context", context)):  # the fake implementations see no device
            if isinstance(t, Tensor) and t.device != weights[0].device:
                raise ValueError(f"{name} is on {t.device} but the block's weights are on {weights[0].device}")
        return (x, context, weights, *self._config.op_fields, self._slot, autocast_dtype(x))

    # -- the entry points -----------------------------------------------------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls the Rust block's ``method``. Made from a module, it passes the watch of its last
        reading, which Rust compares first (``plusequals._rust.Watch``: one pass, no Python
        loop). ``StaleBlock`` (the module changed, or a weight's metadata did) runs the full check
        (:meth:`_ensure_current`: read again, rebuild, probe, or refuse) and calls once more."""
        follow = self._follow
        if follow is not None:
            if follow.reading is None:
                self._ensure_current()  # never read (a copy), or refused last time: the full check
            kwargs["watch"] = follow.watch()
        try:
            return getattr(self._twin.inner, method)(*args, **kwargs)
        except _rust.StaleBlock:
            if self._weights is None:
                raise
        self._ensure_current()
        if follow is not None:
            kwargs["watch"] = follow.watch()
        return getattr(self._twin.inner, method)(*args, **kwargs)

    def forward(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        *,
        attention_mask: Optional[Tensor] = None,
        encoder_attention_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """``x = op(norm(x)) + x`` three times, in Rust; ``x`` is only read."""
        if attention_mask is None and encoder_attention_mask is None:
            entry = self._entry
            if entry is not None and not _is_compiling():
                try:
                    y = entry.forward(x, context)  # the hot path: see _rebind
                except _rust.StaleBlock:
                    y = NotImplemented  # the module changed: the full path reads it again
                if y is not NotImplemented:
                    return y
        masks = masks_of(attention_mask, encoder_attention_mask)
        current = functools.partial(self._noted, x, context)
        follows = self._follow is not None
        to = route(
            x, context, masks, follows=follows, current=current, functorch=self._functorch_weights, adapters=ADAPTERS
        )
        if to.path is Path.DELEGATE:
            return delegated(self._follow, self._where(), to.why, x, context, masks)
        if to.path is Path.IMAGES:
            return forward_tuple(to.now, x, context, masks)
        if to.path is Path.FUNCTORCH:
            return self._functorch_forward(x, context, masks)
        if to.path is Path.ADAPTER:
            return to.adapter.eager(to.now, x, context, masks)
        if to.path is Path.RUST:
            call = functools.partial(self._call, **masks) if masks else self._call
            return run_under_saved_tensor_hooks(call, "forward", x, context)
        return ops.block_forward(*self._op_args(x, context, masks))  # traced, or seen by Python: the custom op

    def forward_owned(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        donate: bool = False,
        *,
        attention_mask: Optional[Tensor] = None,
        encoder_attention_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """``x += op(norm(x))`` three times, in Rust, with grad mode off.

        ``donate=False``: works on a copy; the caller's ``x`` is unchanged.
        ``donate=True``: writes into ``x``'s buffer and returns it under a new handle; ``x``
        itself is invalidated (any later use raises). ``x`` must then own its storage alone. A
        refused donation leaves ``x`` exactly as it was (rust/python/donation.rs, ``donate_into``).
        """
        if not isinstance(donate, bool):
            raise TypeError(f"donate must be a bool, got {type(donate).__name__} {donate!r}")
        if attention_mask is None and encoder_attention_mask is None:
            entry = self._entry
            if entry is not None and not _is_compiling():
                try:
                    y = entry.forward_owned(x, context, donate)  # the hot path (grad off): see _rebind
                except _rust.StaleBlock:
                    y = NotImplemented  # refused before anything moved: the full path reads the module again
                if y is not NotImplemented:
                    return y
        masks = masks_of(attention_mask, encoder_attention_mask)
        to = route_owned(
            x,
            context,
            masks,
            donate,
            where=self._where(),
            follows=self._follow is not None,
            current=functools.partial(self._noted, x, context),
            functorch=self._functorch_weights,
            adapters=ADAPTERS,
        )
        if to.path is Path.DELEGATE:
            return delegated(self._follow, self._where(), to.why, x, context, masks, owned=True)
        if to.path is Path.IMAGES:
            return forward_tuple(to.now, x, context, masks, donate=donate)
        if to.path is Path.FORWARD:  # an adapter's inputs are forward's: the same sums, grad off
            with torch.no_grad():
                return RustBlock.forward(self, x, context, **masks)
        if to.path is Path.DONATE:
            return self._donate(x, context, masks)
        if to.path is Path.TRACED:
            args = self._op_args(x, context, masks)
            y = x.clone(memory_format=torch.contiguous_format)
            ops.block_forward_owned_(y, *args[1:])
            return y
        if to.path is Path.SEEN:
            # The same values, without an in-place op for Python code to see x in (a subclass's
            # __torch_dispatch__ would apply it once per inner tensor, into one x).
            with torch.no_grad():
                return ops.block_forward(*self._op_args(x, context, masks))
        return self._call("forward_owned", x, context, donate=False, **masks)

    def _carried(self) -> Optional[Carried]:
        """What an adapter's call sees of this block (twin/adapter.py), read again first if it
        changed (:meth:`_ensure_current`); None when it follows no module."""
        if self._follow is None:
            return None
        self._ensure_current()
        reading = self._follow.reading
        return Carried(self._where(), self._config, reading, self._modules, self._functorch_weights(), self._call)

    def _noted(self, x: Tensor, context: Any) -> Optional[Carried]:
        """:meth:`_carried`, once the call's shapes are noted: a check this call runs probes an input of
        its shapes too (route() calls it for an eager call after its checks, and for IP-Adapter's pair)."""
        note_call(x, context)
        return self._carried()

    def _functorch_weights(self) -> bool:
        """Whether a torch.func transform is active and the weights are functorch-wrapped
        (``functional_call`` under ``grad``/``vmap``/``jvp``): they have no storage to build on."""
        if self._follow is None or torch._C._functorch.peek_interpreter_stack() is None:
            return False
        return any(map(torch._C._functorch.is_functorch_wrapped_tensor, self.parameters()))

    def _functorch_forward(self, x: Tensor, context: Optional[Tensor], masks: Dict[str, Tensor]) -> Tensor:
        """``forward`` with functorch-wrapped weights (``torch.func`` over ``functional_call``),
        which have no storage to build on: through the custom op, and where the transform has no
        rule for it (torch 2.11: neither ``grad``, whose autograd wrapper lacks functorch support,
        nor ``vmap``), refused naming functorch."""
        try:
            return ops.block_forward(*self._op_args(x, context, masks))
        except (RuntimeError, NotImplementedError) as e:
            raise UnsupportedBlockError(
                f"{self._where()}: this torch.func (functorch) transform over functional_call is not supported: "
                f"the Rust block runs as one custom op there, and the transform has no rule for it ({e})"
            ) from e

    def _donate(self, x: Tensor, context: Optional[Tensor], masks: Dict[str, Tensor]) -> Tensor:
        """``forward_owned(x, donate=True)``: what only Python can see is refused here (modes,
        subclasses whose Python code the Rust ops would bypass); Rust checks ownership, moves the
        buffer and marks ``x`` donated, as one transaction (rust/python/donation.rs, ``donate_into``)."""
        if masks and seen(masks, dispatch_modes=True):
            self._op_args(x, context, masks)  # raises: no custom op takes masks
        refused = why_not_donatable(x, context)
        if refused:
            arg, why, message, modes = refused
            raise OwnershipError(
                f"{message}; nothing was donated: x is unchanged and usable (donate=False works on a copy)",
                arg,
                why,
                modes=modes,
            )
        cls = type(x)
        y = self._call("forward_owned", x, context, donate=True, **masks)
        if not converts_results(cls):
            return y
        # Tensor's __torch_function__ converts results to the subclass: so does the donation,
        # with a tensor that owns the buffer (as_subclass would make a view of y)
        return Tensor._make_subclass(cls, y)

    def forward_loop(self, x: Tensor, context: Optional[Tensor] = None, n: int = 1, owned: bool = False) -> Tensor:
        """``n`` forwards without returning to Python (grad off); for measuring libtorch alone."""
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        check_tensor("x", x)
        check_tensor("context", context, optional=True)
        return self._call("forward_loop", x, context, n=n, owned=owned)

    def extra_repr(self) -> str:
        spec = self._config
        if spec is None:
            return "raw"
        return (
            f"dim={spec.dim}, n_heads={spec.n_heads}, d_head={spec.d_head}, context_dim={spec.context_dim}, "
            f"gated_ff={spec.gated_ff}, attention={spec.attention!r}"
        )

    # torch.__future__.set_swap_module_params_on_conversion(True): .to(), .double(), load_state_dict
    # swap each parameter's TensorImpl (torch.utils.swap_tensors), which needs libtorch's use count
    # of it to be the Python object's alone. The Rust block holds a second one, so it lets go first
    # and builds again on the next call (only where it follows a module: from_state_dict's tensors
    # are not this module's parameters); called on the block it follows: twin/letgo.py.
    def _apply(self, fn: Any, recurse: bool = True) -> "RustBlock":
        if self._follow is None and self._weights is not None:  # from_state_dict: no parameters to convert
            raise TypeError(
                f"{type(self).__name__}.from_state_dict computes with the tensors of its mapping, which are not "
                "its parameters: .to(), .double() or .cuda() would convert nothing. Convert the tensors (in place, "
                "or .data =), or build it again from converted ones"
            )
        self._let_go_for_swap()
        return super()._apply(fn, recurse)

    def train(self, mode: bool = True) -> "RustBlock":
        """``nn.Module.train``, and the followed block's own flag too (its children are this one's)."""
        super().train(mode)
        if self._follow is not None:
            self._follow.source.train(mode)
        return self

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._let_go_for_swap()  # called before its submodules' (Module.load_state_dict's order)
        super()._load_from_state_dict(*args, **kwargs)

    def _let_go_for_swap(self) -> None:
        if self._follow is not None and torch.__future__.get_swap_module_params_on_conversion():
            self._follow.let_go()

    def _drop(self) -> None:
        """Drops the Rust block: it builds again on the next call (:meth:`Follow.let_go` calls it)."""
        self._entry = self._weights = None
        self._twin.inner = self._twin.weights = self._twin.facts = self._twin.other = None

    # The Rust handle is neither picklable nor deep-copyable: a copy (copy.deepcopy, pickle) gets
    # a new, empty twin and builds its own on first use (on the copied parameters).
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_entry"] = None
        if state.get("_follow") is not None:  # it reads its copy of the module on first use
            state["_weights"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__["_slot"] = self._twin.id
        if self._follow is not None:
            self._follow.resume()
        self._rebind()


class CppBlock(RustBlock):
    """The libtorch C++ twin (``cpp/block.cpp``), with ``RustBlock``'s interface, checks and
    donation rules: ``CppBlock.from_torch(block)``.

    C++ computes; the Rust side validates the weights and every input first, and for
    ``forward_owned`` runs the ownership check that C++ itself does not have
    (``rust/ownership.rs``): ``void f(const at::Tensor& x) { x.add_(y); }`` compiles in C++
    (``cpp/gallery.cpp``).
    """

    LANGUAGE = "cpp"


def _split(path: str) -> Tuple[str, str, str]:
    return path.rpartition(".")
