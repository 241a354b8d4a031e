"""The Stable Diffusion v1 ``BasicTransformerBlock``, as CompVis wrote it, and the residual
strategies from the "speedup from switch to +=" story.

The modules follow CompVis ``ldm/modules/attention.py`` (and ``ldm/modules/diffusionmodules/util.py``
for activation checkpointing) attribute for attribute, so that a CompVis or diffusers block's
``state_dict`` loads here with ``strict=True``::

    attn1.to_q.weight  attn1.to_k.weight  attn1.to_v.weight  attn1.to_out.0.weight/bias
    ff.net.0.proj.weight/bias  ff.net.2.weight/bias
    attn2.to_q.weight  attn2.to_k.weight  attn2.to_v.weight  attn2.to_out.0.weight/bias
    norm1.weight/bias  norm2.weight/bias  norm3.weight/bias

With IP-Adapter (``ip_adapter=`` scales), ``attn2`` also holds diffusers' ``to_k_ip``/``to_v_ip``
per adapter, under the Rust block's keys::

    attn2.ip.{i}.to_k.weight  attn2.ip.{i}.to_v.weight

The Rust twin (``rust/block.rs``) reads line for line against this file.
"""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTENTIONS = ("sdpa", "einsum")


class AttentionExtras(NamedTuple):
    """What one call gives the attentions besides ``x`` and ``context``, each field named by what
    takes it: ``attn1``'s and ``attn2``'s masks and IP-Adapter's image embeddings.

    The masks have diffusers' semantics (``attn1``: diffusers' ``attention_mask``, keys are
    ``x``'s tokens; ``attn2``: ``encoder_attention_mask``, keys are the context's tokens). Each is
    an additive bias (floating: diffusers' UNet makes ``(1 - mask) * -10000.0`` of a 0/1 or boolean
    ``(batch, key_tokens)`` mask, with a singleton query dimension, before its blocks see it) or a
    boolean mask (True: attend), of shape ``(batch, key_tokens)`` or ``(batch, 1 or query_tokens,
    key_tokens)``. The Rust block (``rust/attention_extras.rs``) and the C++ twin read line for
    line against :func:`per_head` and :func:`add_mask`."""

    attn1: Optional[Tensor] = None
    attn2: Optional[Tensor] = None
    #: IP-Adapter's image embeddings, one per adapter of ``attn2`` (:class:`IpAdapter`); empty without.
    ip_adapter: Tuple[Tensor, ...] = ()


NO_EXTRAS = AttentionExtras()


def per_head(mask: Tensor, b: int, h: int) -> Tensor:
    """diffusers' ``prepare_attention_mask`` (repeated per head over the batch) and the view before
    SDPA: ``(b, [1 or q,] k) -> (b * h, [1 or q,] k) -> (b, h, 1 or q, k)``."""
    return mask.repeat_interleave(h, dim=0, output_size=b * h).view(b, h, -1, mask.shape[-1])


def add_mask(sim: Tensor, mask: Tensor) -> Tensor:
    """``sim + mask`` for the einsum path: a boolean mask becomes the bias SDPA makes of it (0 where
    True, -inf where False)."""
    if mask.dtype == torch.bool:
        bias = torch.zeros_like(mask).to(sim.dtype).masked_fill(mask.logical_not(), float("-inf"))
        return sim + bias
    return sim + mask


class IpAdapter(nn.Module):
    """One IP-Adapter of diffusers' ``IPAdapterAttnProcessor2_0`` (``rust/ip_adapter.rs``): ``to_k_ip[i]``,
    ``to_v_ip[i]`` (bias-free) and ``scale[i]``."""

    def __init__(self, context_dim: int, inner_dim: int, scale: float = 1.0) -> None:
        super().__init__()
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.scale = scale

    def term(self, q: Tensor, image: Tensor) -> Tensor:
        """``scale * sdpa(q, to_k_ip(image), to_v_ip(image))``, heads merged: ``q`` is ``(b, h, n, d)``."""
        b, h, _, d = q.shape
        k, v = (t.reshape(b, -1, h, d).transpose(1, 2) for t in (self.to_k(image), self.to_v(image)))
        image_out = F.scaled_dot_product_attention(q, k, v)
        image_out = image_out.transpose(1, 2).reshape(b, -1, h * d)
        return image_out * self.scale


class CrossAttention(nn.Module):
    """Multi-head attention with bias-free q/k/v projections (CompVis ``CrossAttention``).

    ``attention="einsum"`` is the 2022 path (two einsums and a softmax, the score matrix
    materialised); ``"sdpa"`` is ``F.scaled_dot_product_attention``. ``ip_adapter``: one scale per
    IP-Adapter (``self.ip``, SDPA only), whose decoupled cross-attention on the image embeddings
    :meth:`forward_ip` adds.
    """

    def __init__(
        self,
        query_dim: int,
        context_dim: Optional[int] = None,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        attention: str = "sdpa",
        ip_adapter: Sequence[float] = (),
    ) -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        inner_dim = dim_head * heads
        context_dim = query_dim if context_dim is None else context_dim
        self.scale = dim_head**-0.5
        self.heads = heads
        self.attention = attention
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))
        if ip_adapter:  # registered only then: a block without IP-Adapter has exactly CompVis' modules
            if attention != "sdpa":
                raise ValueError("IP-Adapter needs attention='sdpa' (diffusers' processor calls SDPA)")
            self.ip = nn.ModuleList(IpAdapter(context_dim, inner_dim, s) for s in ip_adapter)

    def forward(
        self, x: Tensor, context: Optional[Tensor] = None, mask: Optional[Tensor] = None, images: Sequence[Tensor] = ()
    ) -> Tensor:
        """The attention; with IP-Adapter's images (or adapters), :meth:`forward_ip`."""
        if self._modules.get("ip") is not None or images:
            return self.forward_ip(x, context, mask, images)
        if self.attention == "sdpa":
            return self.to_out(self.attend(x, context, mask)[1])
        h = self.heads
        q, k, v, mask = self.project(x, context, mask)
        b, n, inner = q.shape
        d = inner // h
        # The einsum path. 'b n (h d) -> (b h) n d'
        q, k, v = (t.reshape(b, -1, h, d).permute(0, 2, 1, 3).reshape(b * h, -1, d) for t in (q, k, v))
        sim = torch.einsum("b i d, b j d -> b i j", q, k) * self.scale
        if mask is not None:
            # '(b h) 1|i j' against sim's '(b h) i j'
            sim = add_mask(sim, mask.flatten(0, 1))
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b i j, b j d -> b i d", attn, v)
        # '(b h) n d -> b n (h d)'
        return self.to_out(out.reshape(b, h, n, d).permute(0, 2, 1, 3).reshape(b, n, h * d))

    def forward_ip(
        self, x: Tensor, context: Optional[Tensor], mask: Optional[Tensor], images: Sequence[Tensor]
    ) -> Tensor:
        """:meth:`forward` plus IP-Adapter's decoupled cross-attention on ``images`` (one embedding per
        adapter), as diffusers' ``IPAdapterAttnProcessor2_0`` computes it: the text attention, then
        ``+ scale * sdpa(q, to_k_ip(image), to_v_ip(image))`` per adapter whose scale is not 0, then ``to_out``."""
        adapters = self._modules.get("ip") or ()
        if len(images) != len(adapters):
            raise ValueError(
                f"encoder_hidden_states carries {len(images)} image embeddings for {len(adapters)} IP-Adapters"
            )
        q, out = self.attend(x, context, mask)
        for ip, image in zip(adapters, images):
            if ip.scale == 0.0:
                continue  # diffusers skips it
            out = out + ip.term(q, image)
        return self.to_out(out)

    def project(
        self, x: Tensor, context: Optional[Tensor], mask: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """Where both attention paths start: ``to_q(x)``, ``to_k``/``to_v`` of the context (``x`` when
        None), each (b, n, h * d), and the mask per head."""
        q = self.to_q(x)
        context = x if context is None else context
        k = self.to_k(context)
        v = self.to_v(context)
        mask = None if mask is None else per_head(mask, q.shape[0], self.heads)
        return q, k, v, mask

    def attend(self, x: Tensor, context: Optional[Tensor], mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """The text attention of the SDPA path before ``to_out``: (q split per head, the attention)."""
        h = self.heads
        q, k, v, mask = self.project(x, context, mask)
        b, n, inner = q.shape
        d = inner // h
        # 'b n (h d) -> b h n d'
        q, k, v = (t.reshape(b, -1, h, d).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return q, out.transpose(1, 2).reshape(b, n, h * d)


class GEGLU(nn.Module):
    """``proj`` to twice the width, one half gated by the exact GELU of the other."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x: Tensor) -> Tensor:
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    """``net = [GEGLU | Linear+GELU, Dropout, Linear]``, inner width ``mult * dim``."""

    def __init__(
        self, dim: int, dim_out: Optional[int] = None, mult: int = 4, glu: bool = False, dropout: float = 0.0
    ) -> None:
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = dim if dim_out is None else dim_out
        project_in = GEGLU(dim, inner_dim) if glu else nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU())
        self.net = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(inner_dim, dim_out))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


# --------------------------------------------------------------------------------------------
# Residual strategies: each writes the three residual lines of ``_forward`` one way.
# In inference they all compute the same numbers (tests/test_parity.py); they differ in what
# they do to the caller's tensor and to autograd (tests/test_bugs.py).
# --------------------------------------------------------------------------------------------


def op_plus_x(
    b: "BasicTransformerBlock", x: Tensor, context: Optional[Tensor], extras: AttentionExtras = NO_EXTRAS
) -> Tensor:
    """``x = op(norm(x)) + x``: the CompVis original, and the default."""
    x = b.attn1(b.norm1(x), mask=extras.attn1) + x
    x = b.attn2(b.norm2(x), context=context, mask=extras.attn2, images=extras.ip_adapter) + x
    x = b.ff(b.norm3(x)) + x
    return x


def x_plus_op(
    b: "BasicTransformerBlock", x: Tensor, context: Optional[Tensor], extras: AttentionExtras = NO_EXTRAS
) -> Tensor:
    """``x = x + op(norm(x))``: the same sum with the operands swapped (does the order matter?)."""
    x = x + b.attn1(b.norm1(x), mask=extras.attn1)
    x = x + b.attn2(b.norm2(x), context=context, mask=extras.attn2, images=extras.ip_adapter)
    x = x + b.ff(b.norm3(x))
    return x


def iadd(
    b: "BasicTransformerBlock", x: Tensor, context: Optional[Tensor], extras: AttentionExtras = NO_EXTRAS
) -> Tensor:
    """``x += op(norm(x))``: the 2022 "Speedup from switch to +=" commit (~7%, 1.57 -> 1.69 it/s).

    Mutates the caller's tensor, and overwrites the input that each ``norm`` saved for backward.
    """
    x += b.attn1(b.norm1(x), mask=extras.attn1)
    x += b.attn2(b.norm2(x), context=context, mask=extras.attn2, images=extras.ip_adapter)
    x += b.ff(b.norm3(x))
    return x


def iadd_clone(
    b: "BasicTransformerBlock", x: Tensor, context: Optional[Tensor], extras: AttentionExtras = NO_EXTRAS
) -> Tensor:
    """``x += op(norm(x.clone()))``: how the commit was re-landed after it broke training.

    The norms now save a clone, so autograd is satisfied; the first ``+=`` still writes into
    the caller's tensor.
    """
    x += b.attn1(b.norm1(x.clone()), mask=extras.attn1)
    x += b.attn2(b.norm2(x.clone()), context=context, mask=extras.attn2, images=extras.ip_adapter)
    x += b.ff(b.norm3(x.clone()))
    return x


def first_out_of_place(
    b: "BasicTransformerBlock", x: Tensor, context: Optional[Tensor], extras: AttentionExtras = NO_EXTRAS
) -> Tensor:
    """First line ``x = x + op(norm(x))``, the other two ``+=``: the caller's tensor is safe,
    since ``x`` is a fresh tensor after the first line."""
    x = x + b.attn1(b.norm1(x), mask=extras.attn1)
    x += b.attn2(b.norm2(x), context=context, mask=extras.attn2, images=extras.ip_adapter)
    x += b.ff(b.norm3(x))
    return x


def copy_iadd(
    b: "BasicTransformerBlock", x: Tensor, context: Optional[Tensor], extras: AttentionExtras = NO_EXTRAS
) -> Tensor:
    """``x = copy.copy(x)`` and then ``+=``: a Python-level copy of the tensor *object*.

    Whether ``copy.copy`` copies the data is answered by tests/test_bugs.py.
    """
    x = copy.copy(x)
    x += b.attn1(b.norm1(x), mask=extras.attn1)
    x += b.attn2(b.norm2(x), context=context, mask=extras.attn2, images=extras.ip_adapter)
    x += b.ff(b.norm3(x))
    return x


def preallocated(
    b: "BasicTransformerBlock", x: Tensor, context: Optional[Tensor], extras: AttentionExtras = NO_EXTRAS
) -> Tensor:
    """Residual sums written with ``out=`` into one buffer the module keeps between calls.

    No allocation for the residual stream, and no autograd (``out=`` does not record); the
    returned tensor *is* the buffer, so the next call overwrites it.
    """
    out = b.residual_buffer(x)
    torch.add(b.attn1(b.norm1(x), mask=extras.attn1), x, out=out)
    torch.add(b.attn2(b.norm2(out), context=context, mask=extras.attn2, images=extras.ip_adapter), out, out=out)
    torch.add(b.ff(b.norm3(out)), out, out=out)
    return out


Strategy = Callable[..., Tensor]  # (block, x, context, extras=NO_EXTRAS) -> Tensor

STRATEGIES: dict[str, Strategy] = {
    f.__name__: f for f in (op_plus_x, x_plus_op, iadd, iadd_clone, first_out_of_place, copy_iadd, preallocated)
}


# --------------------------------------------------------------------------------------------
# Activation checkpointing, as CompVis ldm/modules/diffusionmodules/util.py does it: forward
# under no_grad, and backward re-runs the function on detached inputs.
# --------------------------------------------------------------------------------------------


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, length, *args):  # type: ignore[override]
        ctx.run_function = run_function
        ctx.input_tensors = list(args[:length])
        ctx.input_params = list(args[length:])
        with torch.no_grad():
            output_tensors = ctx.run_function(*ctx.input_tensors)
        return output_tensors

    @staticmethod
    def backward(ctx, *output_grads):  # type: ignore[override]
        ctx.input_tensors = [x.detach().requires_grad_(True) for x in ctx.input_tensors]
        with torch.enable_grad():
            # CompVis: "Fixes a bug where the first op in run_function modifies the Tensor
            # storage in place, which is not allowed for detach()'d Tensors."
            shallow_copies = [x.view_as(x) for x in ctx.input_tensors]
            output_tensors = ctx.run_function(*shallow_copies)
        input_grads = torch.autograd.grad(
            output_tensors, ctx.input_tensors + ctx.input_params, output_grads, allow_unused=True
        )
        del ctx.input_tensors, ctx.input_params, output_tensors
        return (None, None) + input_grads


def checkpoint(func, inputs, params, flag):
    """CompVis ``checkpoint``: ``func(*inputs)``, recomputed in backward when ``flag``."""
    if flag:
        args = tuple(inputs) + tuple(params)
        return CheckpointFunction.apply(func, len(inputs), *args)
    return func(*inputs)


class BasicTransformerBlock(nn.Module):
    """Self-attention, cross-attention and GEGLU feed-forward, each behind a LayerNorm and a
    residual add (CompVis ``BasicTransformerBlock``, SD v1).

    ``residual`` picks one of :data:`STRATEGIES` for the block; ``forward(..., residual=...)``
    overrides it for one call.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        d_head: int,
        dropout: float = 0.0,
        context_dim: Optional[int] = None,
        gated_ff: bool = True,
        checkpoint: bool = False,
        attention: str = "sdpa",
        residual: str = "op_plus_x",
        ip_adapter: Sequence[float] = (),
    ) -> None:
        super().__init__()
        _check_strategy(residual)
        self.attn1 = CrossAttention(query_dim=dim, heads=n_heads, dim_head=d_head, dropout=dropout, attention=attention)
        self.ff = FeedForward(dim, dropout=dropout, glu=gated_ff)
        self.attn2 = CrossAttention(
            query_dim=dim,
            context_dim=context_dim,
            heads=n_heads,
            dim_head=d_head,
            dropout=dropout,
            attention=attention,
            ip_adapter=ip_adapter,
        )
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.checkpoint = checkpoint
        self.residual = residual
        self.dim, self.n_heads, self.d_head = dim, n_heads, d_head
        self.context_dim = dim if context_dim is None else context_dim
        self.gated_ff = gated_ff
        self._out: Optional[Tensor] = None

    @property
    def attention(self) -> str:
        return self.attn1.attention

    def forward(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        residual: Optional[str] = None,
        *,
        attention_mask: Optional[Tensor] = None,
        encoder_attention_mask: Optional[Tensor] = None,
        ip_adapter: Sequence[Tensor] = (),
    ) -> Tensor:
        """``attention_mask`` (self-attention) and ``encoder_attention_mask`` (cross-attention):
        see :class:`AttentionExtras`; ``ip_adapter``: IP-Adapter's image embeddings, one per adapter (with
        ``checkpoint``, they get no gradient: they are not among its inputs)."""
        residual = self.residual if residual is None else _check_strategy(residual)
        extras = AttentionExtras(attention_mask, encoder_attention_mask, tuple(ip_adapter))
        inputs = (x,) if context is None else (x, context)
        run = lambda *xs: self._forward(*xs, residual=residual, extras=extras)  # noqa: E731
        return checkpoint(run, inputs, self.parameters(), self.checkpoint)

    def _forward(
        self,
        x: Tensor,
        context: Optional[Tensor] = None,
        *,
        residual: str = "op_plus_x",
        extras: AttentionExtras = NO_EXTRAS,
    ) -> Tensor:
        return STRATEGIES[residual](self, x, context, extras)

    def residual_buffer(self, like: Tensor) -> Tensor:
        """The buffer ``preallocated`` writes into, reallocated when shape, dtype or device change."""
        out = self._out
        if out is None or out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
            out = self._out = torch.empty_like(like, memory_format=torch.contiguous_format)
        return out


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial random weights everywhere (LayerNorm affine included), deterministic per seed:
    norms near identity, linear weights scaled by fan-in."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.startswith("norm"):
                p.copy_(1.0 + 0.1 * r if name.endswith("weight") else 0.1 * r)
            else:
                p.copy_(r * p.shape[-1] ** -0.5)
    return module


def _check_strategy(name: str) -> str:
    if name not in STRATEGIES:
        raise ValueError(f"residual must be one of {sorted(STRATEGIES)}, got {name!r}")
    return name
