"""What SD users load on a swapped UNet: IP-Adapter and layerwise casting, through
diffusers' own API (``IPAdapterMixin.load_ip_adapter`` with state dicts made in code,
``set_ip_adapter_scale``, ``unload_ip_adapter``, ``enable_layerwise_casting``), no download.

IP-Adapter (``IPAdapterAttnProcessor2_0``) runs in the Rust block: the swapped UNet's output and
gradients (image embeddings, text, every weight) are bitwise the library's, with two adapters and
their scales (0 included: diffusers skips the adapter). Layerwise casting runs in the swapped blocks
(tests/test_layerwise_casting.py); once undone the swapped UNet is bitwise the library's again.
Generated sequences of those changes check that the swapped blocks follow all of them: each call
equals an unswapped twin that went through the same changes.
diffusers 0.42 cannot undo layerwise casting (``LayerwiseCastingHook.deinitalize_hook`` raises
``NotImplementedError``): :func:`undo_layerwise_casting` puts the modules back as they were before
it (no hook registry, no instance ``forward``, the fp32 weights).
"""

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples, rel_err
from plusequals import UnsupportedBlockError, swap_transformer_blocks
from plusequals.twin.swap import RustTransformerBlock

pytest.importorskip("diffusers", reason="needs the optional extra plusequals[diffusers]")
from diffusers.loaders import IPAdapterMixin  # noqa: E402

CLIP = 16  # the image embedding's width, projected to 4 tokens of cross_attention_dim by ImageProjection
SLOW = settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Pipe(IPAdapterMixin):
    """The pipeline side of diffusers' IP-Adapter API, on a bare UNet."""

    def __init__(self, unet):
        self.unet = unet


def ip_state_dict(unet, seed):
    """An IP-Adapter checkpoint in the layout ``load_ip_adapter`` reads: the image projection, and
    ``to_k_ip``/``to_v_ip`` for every cross-attention, numbered as diffusers numbers them."""
    g = torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    ip, key = {}, 1
    for name in unet.attn_processors:
        if not name.endswith("attn1.processor"):
            width = unet.get_submodule(name.rsplit(".", 1)[0]).to_k.out_features
            ip[f"{key}.to_k_ip.weight"] = torch.randn(width, cross, generator=g) * 0.2
            ip[f"{key}.to_v_ip.weight"] = torch.randn(width, cross, generator=g) * 0.2
            key += 2
    proj = {
        "proj.weight": torch.randn(4 * cross, CLIP, generator=g) * 0.2,
        "proj.bias": torch.randn(4 * cross, generator=g) * 0.1,
        "norm.weight": 1 + torch.randn(cross, generator=g) * 0.1,
        "norm.bias": torch.randn(cross, generator=g) * 0.1,
    }
    return {"image_proj": proj, "ip_adapter": ip}


def load_ip_adapters(unet, seeds):
    dicts = [ip_state_dict(unet, s) for s in seeds]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers warns that it casts with to()
        Pipe(unet).load_ip_adapter(
            dicts, subfolder=[""] * len(dicts), weight_name=[""] * len(dicts), image_encoder_folder=None
        )


def undo_layerwise_casting(unet, state):
    """What ``enable_layerwise_casting`` changed, put back: diffusers has no way to undo it."""
    for m in unet.modules():
        m.__dict__.pop("_diffusers_hook", None)
        m.__dict__.pop("forward", None)
    unet.to(torch.float32)
    unet.load_state_dict(state)


def n_adapters(unet):
    proj = unet.encoder_hid_proj
    return 0 if proj is None else len(proj.image_projection_layers)


def run(unet, seed=1):
    g = torch.Generator().manual_seed(seed)
    sample, context = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g)
    kw = {}
    if n_adapters(unet):
        embeds = [torch.randn(2, 1, CLIP, generator=g) for _ in range(n_adapters(unet))]
        kw["added_cond_kwargs"] = {"image_embeds": embeds}
    with torch.no_grad():
        return unet(sample, torch.tensor([10, 700]), context, **kw).sample


def snapshot(unet):
    return {k: v.clone() for k, v in unet.state_dict().items()}


def grads(unet, seed=5):
    """The output and the gradients of a loss for the text, the image embeddings and every weight."""
    g = torch.Generator().manual_seed(seed)
    sample, text = torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 77, 32, generator=g).requires_grad_()
    images = [torch.randn(2, 1, CLIP, generator=g).requires_grad_() for _ in range(n_adapters(unet))]
    unet.zero_grad(set_to_none=True)
    y = unet(sample, torch.tensor([10, 700]), text, added_cond_kwargs={"image_embeds": images}).sample
    y.square().sum().backward()
    return [y, text.grad, *(i.grad for i in images)] + [p.grad for _, p in sorted(unet.named_parameters())]


def same(a, b):
    """Bitwise equal, or both None (the parameters of an adapter whose scale is 0 get no gradient)."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("after_the_swap", [False, True])
def test_ip_adapter_runs_in_rust_bitwise_forward_and_backward(tiny_unet, after_the_swap):
    unet, reference = tiny_unet(), tiny_unet()
    if after_the_swap:
        swap_transformer_blocks(unet)
    for u in (unet, reference):
        load_ip_adapters(u, [3, 4])
        Pipe(u).set_ip_adapter_scale([0.7, 0.0])  # one per adapter; 0: diffusers skips the adapter
    if not after_the_swap:
        swap_transformer_blocks(unet)
    blocks = [m for m in unet.modules() if isinstance(m, RustTransformerBlock)]
    assert len(blocks) == 4
    got, expected = grads(unet), grads(reference)
    assert all(b._config.ip_adapter == (0.7, 0.0) for b in blocks)  # read from the processors, in Rust
    assert len(got) == len(expected) and all(same(a, b) for a, b in zip(got, expected))
    ip_grads = [p.grad for n, p in unet.named_parameters() if "_ip.0." in n]
    assert len(ip_grads) == 8 and all(g is not None and g.abs().sum() > 0 for g in ip_grads)
    assert not torch.equal(run(unet), run(tiny_unet()))  # the adapters matter
    for u in (unet, reference):
        Pipe(u).set_ip_adapter_scale([1.5, 0.5])  # written in place into each processor's list: followed
    assert torch.equal(run(unet), run(reference))
    for u in (unet, reference):
        Pipe(u).unload_ip_adapter()
    assert torch.equal(run(unet), run(reference))


def test_ip_adapter_without_sdpa_is_within_the_bound(tiny_unet):
    """diffusers' IPAdapterAttnProcessor (baddbmm and softmax, as AttnProcessor) on the same weights:
    ||a - b|| / ||b|| <= 1e-5 against the Rust block's SDPA, as for AttnProcessor."""
    from diffusers.models.attention_processor import IPAdapterAttnProcessor, IPAdapterAttnProcessor2_0

    unet, reference = tiny_unet(), tiny_unet()
    for u in (unet, reference):
        load_ip_adapters(u, [3, 4])
        for name, proc in u.attn_processors.items():
            if isinstance(proc, IPAdapterAttnProcessor2_0):
                slow = IPAdapterAttnProcessor(proc.hidden_size, proc.cross_attention_dim, proc.num_tokens, [0.5, 1.0])
                slow.load_state_dict(proc.state_dict())
                u.get_submodule(name.rsplit(".", 1)[0]).set_processor(slow)
    swap_transformer_blocks(unet)
    assert rel_err(run(unet), run(reference)) <= 1e-5


def test_ip_adapter_where_the_rust_block_cannot_run_it_is_refused_naming_it(tiny_unet):
    """The custom ops take no image embeddings, and per-image scales (lists, for ip_adapter_masks) are
    refused: each says so. (The C++ twin computes IP-Adapter: tests/test_ip_adapter_twins.py.)"""
    unet = tiny_unet()
    load_ip_adapters(unet, [3])
    swap_transformer_blocks(unet)
    rust = next(m for m in unet.modules() if isinstance(m, RustTransformerBlock))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, text, image = torch.empty(2, 16, 32), torch.empty(2, 77, 32), torch.empty(2, 1, 4, 32)
        with pytest.raises(UnsupportedBlockError, match="a block with an IP-Adapter cannot be traced"):
            rust(x, encoder_hidden_states=(text, [image]))
    state = snapshot(unet)
    Pipe(unet).set_ip_adapter_scale([[0.5]])  # per-image scales
    with pytest.raises(UnsupportedBlockError, match=r"attn2.processor.scale\[0\] is \[0.5\]: per-image scales"):
        run(unet)
    assert all(torch.equal(v, state[k]) for k, v in unet.state_dict().items())  # the refusal wrote nothing
    Pipe(unet).set_ip_adapter_scale(0.5)
    assert run(unet).isfinite().all()  # and the UNet runs again once the scale is one number


def test_a_tuple_for_a_processor_that_takes_one_tensor_is_refused_naming_ip_adapter(tiny_unet):
    """The tuple reaching a block whose processors are the plain ones (not diffusers' UNet's doing,
    a caller's): a named refusal, not ``context must be a torch.Tensor, got tuple``."""
    unet = tiny_unet()
    swap_transformer_blocks(unet)
    block = next(m for m in unet.modules() if isinstance(m, RustTransformerBlock))
    x, text, image = torch.randn(2, 16, 32), torch.randn(2, 77, 32), torch.randn(2, 1, 4, 32)
    before = [t.clone() for t in (x, text, image)]
    with pytest.raises(UnsupportedBlockError, match="encoder_hidden_states is a tuple, IP-Adapter's"):
        block(x, encoder_hidden_states=(text, [image]))
    assert all(torch.equal(t, b) for t, b in zip((x, text, image), before))  # nothing written
    with torch.no_grad():
        assert torch.equal(block(x, encoder_hidden_states=text), block.original(x, encoder_hidden_states=text))


def test_layerwise_casting_runs_in_rust_then_undone_is_followed(tiny_unet):
    """Layerwise casting runs in the swapped blocks (tests/test_layerwise_casting.py); undone, the
    swapped UNet is bitwise the uncast library's again."""
    unet, reference = tiny_unet(), tiny_unet()
    state, uncast = snapshot(unet), run(reference)
    swap_transformer_blocks(unet)
    for u in (unet, reference):
        u.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    got = run(unet)
    assert torch.equal(got, run(reference)) and rel_err(got, uncast) > 1e-3  # fp8 storage changes the values
    undo_layerwise_casting(unet, state)
    assert torch.equal(run(unet), uncast)


OPS = st.one_of(
    st.tuples(st.just("load"), st.lists(st.integers(0, 9), min_size=1, max_size=2)),
    st.tuples(st.just("scale"), st.sampled_from([0.0, 0.5, 1.5])),
    st.tuples(st.just("unload"), st.none()),
    st.tuples(st.just("cast"), st.sampled_from([torch.float8_e4m3fn, torch.bfloat16])),
    st.tuples(st.just("uncast"), st.none()),
)


def apply(unet, op, state):
    kind, arg = op
    casting = any("_diffusers_hook" in m.__dict__ for m in unet.modules())
    if kind == "load" and not casting:
        load_ip_adapters(unet, arg)
    elif kind == "scale" and n_adapters(unet):
        Pipe(unet).set_ip_adapter_scale([arg] * n_adapters(unet))  # diffusers wants one per adapter
    elif kind == "unload":
        Pipe(unet).unload_ip_adapter()
    elif kind == "cast" and not casting and not n_adapters(unet):
        unet.enable_layerwise_casting(storage_dtype=arg, compute_dtype=torch.float32)
    elif kind == "uncast" and casting:
        undo_layerwise_casting(unet, state)


@SLOW
@given(st.lists(OPS, min_size=1, max_size=5))
def test_changes_after_the_swap_are_followed_or_refused_naming_them(tiny_unet, ops):
    unet, reference = tiny_unet(), tiny_unet()
    state = snapshot(unet)
    swap_transformer_blocks(unet)
    for op in ops:
        apply(unet, op, state)
        apply(reference, op, state)
        assert torch.equal(run(unet), run(reference)), op
