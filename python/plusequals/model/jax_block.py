"""The JAX twin of ``blocks.py``: the SD v1 ``BasicTransformerBlock`` in ``jax.numpy``.

It reads line for line against ``blocks.py`` (and ``rust/block.rs``): the same modules under the
same names (``attn1``, ``ff``, ``attn2``, ``norm1..3``; ``to_q``, ``to_out[0]``, ``net[0].proj``),
the same order of ops, and both attention paths (``"sdpa"``: softmax(q kᵀ · scale) v on
``b h n d``; ``"einsum"``: the 2022 path on ``(b h) n d``). Weights come from a PyTorch
``state_dict`` under the CompVis keys, copied into JAX arrays (never aliasing torch's memory).

Every module is a JAX pytree, so a whole block can be an argument of ``jax.jit``; the weights are
then parameters of the compiled program, not constants folded into it::

    jblock = BasicTransformerBlock.from_torch(block)            # or .from_state_dict(sd, ...)
    y = jblock(x, context)                                      # eager, op by op
    f = jax.jit(forward, donate_argnums=1)                      # forward(block, x, context)

JAX arrays are immutable. ``x += y`` on a ``jax.Array`` rebinds ``x`` to a new array (there is no
``__iadd__``), so the ``iadd`` strategy below computes what ``op_plus_x`` does and never writes
into the caller's array. Writing into a caller's buffer takes an explicit donation
(``donate_argnums``), after which the caller's array is deleted and raises on use.

Half precision: like PyTorch's LayerNorm and softmax kernels, the statistics and the softmax are
computed in float32 and the results cast back; in float32 this is the identity.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

try:
    import jax
    import jax.numpy as jnp
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "plusequals.model.jax_block needs JAX: install the optional extra, pip install 'plusequals[compilers]' "
        "(or pip install 'jax>=0.10.2,<0.12')"
    ) from e

ATTENTIONS = ("sdpa", "einsum")


# ----------------------------------------------------------------------------- pytree modules
class Module:
    """A module whose array attributes (and lists/modules holding arrays) are pytree children and
    whose ``_static`` attributes (ints, strings) are compile-time constants."""

    _static: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        jax.tree_util.register_pytree_node(cls, cls._flatten, cls._unflatten)

    def _flatten(self):
        names = tuple(sorted(k for k in vars(self) if k not in self._static))
        static = tuple((k, getattr(self, k)) for k in self._static)
        return [getattr(self, k) for k in names], (names, static)

    @classmethod
    def _unflatten(cls, aux, children):
        names, static = aux
        obj = object.__new__(cls)
        for k, v in zip(names, children):
            setattr(obj, k, v)
        for k, v in static:
            setattr(obj, k, v)
        return obj


class Linear(Module):
    """``nn.Linear``: ``x @ weight.T + bias`` (weight is ``out x in``, as PyTorch stores it)."""

    def __init__(self, weight: jax.Array, bias: Optional[jax.Array] = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.matmul(x, self.weight.T)
        return y if self.bias is None else y + self.bias


class Dropout(Module):
    """``nn.Dropout`` in eval mode (the block is only run for inference here): the identity."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class GELU(Module):
    """``nn.GELU()``: the exact (erf) GELU."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return gelu(x)


class Sequential(Module):
    def __init__(self, *mods: Module) -> None:
        self.mods = list(mods)

    def __getitem__(self, i: int) -> Module:
        return self.mods[i]

    def __call__(self, x: jax.Array) -> jax.Array:
        for m in self.mods:
            x = m(x)
        return x


class LayerNorm(Module):
    """``nn.LayerNorm(dim)``: biased variance over the last dimension, eps 1e-5."""

    _static = ("eps",)

    def __init__(self, weight: jax.Array, bias: jax.Array, eps: float = 1e-5) -> None:
        self.weight, self.bias, self.eps = weight, bias, eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = _up(x)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        return (h * _up(self.weight) + _up(self.bias)).astype(x.dtype)


def gelu(x: jax.Array) -> jax.Array:
    """``F.gelu`` (exact, through erf)."""
    return jax.nn.gelu(x, approximate=False)


def softmax(x: jax.Array) -> jax.Array:
    """``x.softmax(dim=-1)``, accumulated in at least float32."""
    return jax.nn.softmax(_up(x), axis=-1).astype(x.dtype)


def _up(x: jax.Array) -> jax.Array:
    """float16/bfloat16 -> float32 for reductions; float32 and wider unchanged."""
    return x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x


class CrossAttention(Module):
    """Multi-head attention with bias-free q/k/v projections (CompVis ``CrossAttention``)."""

    _static = ("heads", "scale", "attention")

    def __init__(
        self,
        to_q: Linear,
        to_k: Linear,
        to_v: Linear,
        to_out: Sequential,
        heads: int,
        dim_head: int,
        attention: str = "sdpa",
    ) -> None:
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.scale = dim_head**-0.5
        self.heads = heads
        self.attention = attention
        self.to_q, self.to_k, self.to_v, self.to_out = to_q, to_k, to_v, to_out

    def __call__(self, x: jax.Array, context: Optional[jax.Array] = None) -> jax.Array:
        h = self.heads
        q = self.to_q(x)
        context = x if context is None else context
        k = self.to_k(context)
        v = self.to_v(context)
        b, n, inner = q.shape
        d = inner // h
        if self.attention == "einsum":
            # 'b n (h d) -> (b h) n d'
            q, k, v = (t.reshape(b, -1, h, d).transpose(0, 2, 1, 3).reshape(b * h, -1, d) for t in (q, k, v))
            sim = jnp.einsum("b i d, b j d -> b i j", q, k) * self.scale
            attn = softmax(sim)
            out = jnp.einsum("b i j, b j d -> b i d", attn, v)
            # '(b h) n d -> b n (h d)'
            out = out.reshape(b, h, n, d).transpose(0, 2, 1, 3).reshape(b, n, h * d)
        else:
            # 'b n (h d) -> b h n d'
            q, k, v = (t.reshape(b, -1, h, d).transpose(0, 2, 1, 3) for t in (q, k, v))
            out = scaled_dot_product_attention(q, k, v, scale=self.scale)
            out = out.transpose(0, 2, 1, 3).reshape(b, n, h * d)
        return self.to_out(out)


def scaled_dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """``F.scaled_dot_product_attention(q, k, v, scale=scale)`` without mask or dropout:
    softmax(q kᵀ · scale) v over ``b h n d``."""
    return jnp.matmul(softmax(jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * scale), v)


class GEGLU(Module):
    """``proj`` to twice the width, one half gated by the exact GELU of the other."""

    def __init__(self, proj: Linear) -> None:
        self.proj = proj

    def __call__(self, x: jax.Array) -> jax.Array:
        x, gate = jnp.split(self.proj(x), 2, axis=-1)
        return x * gelu(gate)


class FeedForward(Module):
    """``net = [GEGLU | Linear+GELU, Dropout, Linear]``."""

    def __init__(self, net: Sequential) -> None:
        self.net = net

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net(x)


# ----------------------------------------------------------------------------- residual strategies
# Two of blocks.py's strategies, written the same way. In JAX both compute the same thing:
# ``x += ...`` on an immutable array is ``x = x + ...`` (tests/test_jax.py).


def op_plus_x(b: "BasicTransformerBlock", x: jax.Array, context: Optional[jax.Array]) -> jax.Array:
    """``x = op(norm(x)) + x``: the CompVis original, and the default."""
    x = b.attn1(b.norm1(x)) + x
    x = b.attn2(b.norm2(x), context=context) + x
    x = b.ff(b.norm3(x)) + x
    return x


def x_plus_op(b: "BasicTransformerBlock", x: jax.Array, context: Optional[jax.Array]) -> jax.Array:
    """``x = x + op(norm(x))``: the same sum with the operands swapped."""
    x = x + b.attn1(b.norm1(x))
    x = x + b.attn2(b.norm2(x), context=context)
    x = x + b.ff(b.norm3(x))
    return x


def iadd(b: "BasicTransformerBlock", x: jax.Array, context: Optional[jax.Array]) -> jax.Array:
    """``x += op(norm(x))``, the 2022 commit's lines. On a ``jax.Array`` each ``+=`` rebinds the
    local name to a new array; the caller's array is never written."""
    x += b.attn1(b.norm1(x))
    x += b.attn2(b.norm2(x), context=context)
    x += b.ff(b.norm3(x))
    return x


STRATEGIES: dict[str, Callable[..., jax.Array]] = {f.__name__: f for f in (op_plus_x, x_plus_op, iadd)}


class BasicTransformerBlock(Module):
    """Self-attention, cross-attention and GEGLU feed-forward, each behind a LayerNorm and a
    residual add (CompVis ``BasicTransformerBlock``, SD v1), in jax.numpy."""

    _static = ("residual", "dim", "n_heads", "d_head", "context_dim", "gated_ff")

    def __init__(
        self,
        attn1: CrossAttention,
        ff: FeedForward,
        attn2: CrossAttention,
        norm1: LayerNorm,
        norm2: LayerNorm,
        norm3: LayerNorm,
        *,
        dim: int,
        n_heads: int,
        d_head: int,
        context_dim: int,
        gated_ff: bool,
        residual: str = "op_plus_x",
    ) -> None:
        _check_strategy(residual)
        self.attn1, self.ff, self.attn2 = attn1, ff, attn2
        self.norm1, self.norm2, self.norm3 = norm1, norm2, norm3
        self.residual = residual
        self.dim, self.n_heads, self.d_head = dim, n_heads, d_head
        self.context_dim, self.gated_ff = context_dim, gated_ff

    @property
    def attention(self) -> str:
        return self.attn1.attention

    def __call__(self, x: jax.Array, context: Optional[jax.Array] = None, residual: Optional[str] = None) -> jax.Array:
        residual = self.residual if residual is None else _check_strategy(residual)
        return STRATEGIES[residual](self, x, context)

    # ------------------------------------------------------------------------- loading
    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, Any],
        *,
        n_heads: int,
        d_head: int,
        attention: str = "sdpa",
        residual: str = "op_plus_x",
        dtype: Any = None,
        device: Any = None,
    ) -> "BasicTransformerBlock":
        """A block from CompVis-keyed weights (torch tensors or arrays). ``dim``, ``context_dim``
        and the feed-forward kind are read from the shapes; a missing, extra or mis-shaped key is
        a ``ValueError`` naming it. ``dtype`` defaults to the weights' own; ``device`` is a
        ``jax.Device`` (default: JAX's default device)."""
        sd = {k: _to_jax(v, dtype, device) for k, v in state_dict.items()}
        if "norm1.weight" not in sd:
            raise ValueError("missing weight 'norm1.weight'")
        dim = int(sd["norm1.weight"].shape[0])
        inner = n_heads * d_head
        gated_ff = "ff.net.0.proj.weight" in sd
        ctx = sd.get("attn2.to_k.weight")
        context_dim = int(ctx.shape[1]) if ctx is not None else dim
        ff_in = "ff.net.0.proj" if gated_ff else "ff.net.0.0"
        expected = {
            **{f"norm{i}.{p}": (dim,) for i in (1, 2, 3) for p in ("weight", "bias")},
            "attn1.to_q.weight": (inner, dim),
            "attn1.to_k.weight": (inner, dim),
            "attn1.to_v.weight": (inner, dim),
            "attn1.to_out.0.weight": (dim, inner),
            "attn1.to_out.0.bias": (dim,),
            "attn2.to_q.weight": (inner, dim),
            "attn2.to_k.weight": (inner, context_dim),
            "attn2.to_v.weight": (inner, context_dim),
            "attn2.to_out.0.weight": (dim, inner),
            "attn2.to_out.0.bias": (dim,),
            f"{ff_in}.weight": ((8 if gated_ff else 4) * dim, dim),
            f"{ff_in}.bias": ((8 if gated_ff else 4) * dim,),
            "ff.net.2.weight": (dim, 4 * dim),
            "ff.net.2.bias": (dim,),
        }
        for k in expected:
            if k not in sd:
                raise ValueError(f"missing weight {k!r}")
        for k in sd:
            if k not in expected:
                raise ValueError(f"unexpected weight {k!r}")
        for k, shape in expected.items():
            if tuple(sd[k].shape) != shape:
                raise ValueError(f"weight {k!r} has shape {tuple(sd[k].shape)}, expected {shape}")

        def attn(p: str) -> CrossAttention:
            lin = lambda k: Linear(sd[f"{p}.{k}.weight"])  # noqa: E731
            to_out = Sequential(Linear(sd[f"{p}.to_out.0.weight"], sd[f"{p}.to_out.0.bias"]), Dropout())
            return CrossAttention(lin("to_q"), lin("to_k"), lin("to_v"), to_out, n_heads, d_head, attention)

        project_in: Module = Linear(sd[f"{ff_in}.weight"], sd[f"{ff_in}.bias"])
        project_in = GEGLU(project_in) if gated_ff else Sequential(project_in, GELU())
        ff = FeedForward(Sequential(project_in, Dropout(), Linear(sd["ff.net.2.weight"], sd["ff.net.2.bias"])))
        norm = lambda i: LayerNorm(sd[f"norm{i}.weight"], sd[f"norm{i}.bias"])  # noqa: E731
        return cls(
            attn("attn1"), ff, attn("attn2"), norm(1), norm(2), norm(3),
            dim=dim, n_heads=n_heads, d_head=d_head, context_dim=context_dim, gated_ff=gated_ff, residual=residual,
        )  # fmt: skip

    @classmethod
    def from_torch(
        cls, block: Any, *, residual: Optional[str] = None, dtype: Any = None, device: Any = None
    ) -> "BasicTransformerBlock":
        """The twin of a ``plusequals.BasicTransformerBlock`` (weights copied from its
        ``state_dict()``; later changes to the PyTorch block are not seen)."""
        return cls.from_state_dict(
            block.state_dict(),
            n_heads=block.n_heads,
            d_head=block.d_head,
            attention=block.attention,
            residual=block.residual if residual is None else residual,
            dtype=dtype,
            device=device,
        )


def forward(block: BasicTransformerBlock, x: jax.Array, context: Optional[jax.Array] = None) -> jax.Array:
    """``block(x, context)`` as a free function, for ``jax.jit`` (``donate_argnums=1`` donates x)."""
    return block(x, context)


def jit_forward(donate: bool = False) -> Callable[..., jax.Array]:
    """``jax.jit(forward)``; with ``donate=True`` x's buffer is donated (``donate_argnums=1``)."""
    return jax.jit(forward, donate_argnums=(1,) if donate else ())


def to_jax(t: Any, dtype: Any = None, device: Any = None) -> jax.Array:
    """A torch tensor or array as a new JAX array (a copy: it never aliases torch's memory)."""
    return _to_jax(t, dtype, device)


def _to_jax(t: Any, dtype: Any, device: Any) -> jax.Array:
    import numpy as np

    if hasattr(t, "detach"):  # a torch tensor; numpy has no bfloat16, so go through float32
        import torch

        src = t.detach().to("cpu")
        if dtype is None:
            dtype = {
                torch.float32: jnp.float32,
                torch.float16: jnp.float16,
                torch.bfloat16: jnp.bfloat16,
                torch.float64: jnp.float64,
            }.get(src.dtype)
            if dtype is None:
                raise ValueError(f"unsupported dtype {src.dtype}")
        t = src.to(torch.float64 if src.dtype == torch.float64 else torch.float32).numpy()
    arr = jnp.array(np.asarray(t), dtype=dtype, copy=True)
    return jax.device_put(arr, device) if device is not None else arr


def _check_strategy(name: str) -> str:
    if name not in STRATEGIES:
        raise ValueError(f"residual must be one of {sorted(STRATEGIES)}, got {name!r}")
    return name
