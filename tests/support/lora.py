"""PEFT LoRA on a small diffusers block, shared by the LoRA, DoRA, layerwise-casting and
never-stale tests: the block and its adapters (seeded, the global generator left as it was), its
inputs and call, the adapter configurations and state changes that hypothesis draws."""

import warnings

import pytest
import torch
from diffusers.models.attention import BasicTransformerBlock as DiffusersBlock
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from conftest import examples
from plusequals import UnsupportedBlockError
from plusequals.model.blocks import randomize_
from plusequals.twin.swap import RustTransformerBlock

DIM, HEADS, D_HEAD, CTX = 32, 4, 8, 24
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj", "net.2"]  # every linear of the block
SLOW = settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Holder(nn.Module):
    """What PEFT injects into: a model holding the block."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block


def add_adapter(block, name, seed, **config):
    """peft initialises the adapter from the global generator: seeded here, and left as it was."""
    config = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False, **config}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        inject_adapter_in_model(LoraConfig(**config), Holder(block), adapter_name=name)
    return block


def lora_block(seed=0, **config):
    with torch.random.fork_rng():  # nn.Linear's initialisation draws from the global generator: left as it was
        block = randomize_(DiffusersBlock(DIM, HEADS, D_HEAD, cross_attention_dim=CTX), seed).eval()
    return add_adapter(block, "a", seed + 1, **config).eval()  # peft makes the adapter's dropouts in training mode


def layers(block):
    return [m for m in block.modules() if isinstance(m, LoraLayer)]


def inputs(seed=2, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 5, DIM, generator=g), torch.randn(batch, 4, CTX, generator=g)


def call(module, x, c):
    return module(x, encoder_hidden_states=c)


@st.composite
def adapter_configs(draw):
    targets = draw(st.lists(st.sampled_from(TARGETS), min_size=1, max_size=6, unique=True))
    return {
        "r": draw(st.integers(1, 8)),
        "lora_alpha": draw(st.sampled_from([1, 4, 8, 16.5])),
        "target_modules": targets,
        "lora_bias": draw(st.booleans()),
        "use_rslora": draw(st.booleans()),
    }


OPS = st.one_of(
    st.tuples(st.just("set_adapter"), st.sampled_from(["a", "b", ("a", "b"), ("b", "a")])),
    st.tuples(st.just("enable"), st.booleans()),
    st.tuples(st.just("merge"), st.sampled_from([False, True])),  # safe_merge
    st.tuples(st.just("unmerge"), st.none()),
    st.tuples(st.just("set_scale"), st.sampled_from(["a", "b"]), st.sampled_from([0.0, 0.5, 2.0])),
    st.tuples(st.just("scale_layer"), st.sampled_from([0.5, 3.0])),
    st.tuples(st.just("unscale_layer"), st.none()),
    st.tuples(st.just("train"), st.booleans()),
)


def apply(block, op):
    kind, *args = op
    if kind == "train":
        block.train(args[0])
        return
    for layer in layers(block):
        if kind == "set_adapter":
            names = [args[0]] if isinstance(args[0], str) else list(args[0])
            layer.set_adapter([n for n in names if n in layer.lora_A] or names[:1])
        elif kind == "enable":
            layer.enable_adapters(args[0])
        elif kind == "merge":
            layer.merge(safe_merge=args[0])
        elif kind == "unmerge" and layer.merged:
            layer.unmerge()
        elif kind == "set_scale":
            layer.set_scale(args[0], args[1])
        elif kind == "scale_layer":
            layer.scale_layer(args[0])
        elif kind == "unscale_layer":
            layer.unscale_layer(args[0])


def expected_refusal(block, dora: bool = False) -> str:
    """What the drop-in must refuse in PEFT's current state (from PEFT's public state), or ''. An
    active adapter's dropout in training mode is refused where it is not the identity: p > 0, or
    with DoRA at any p (DoRA recomputes the base result in training mode)."""
    for layer in layers(block):
        if layer.disable_adapters and layer.merged:
            return "disabled while"
        if layer.disable_adapters or layer.merged:
            continue
        for name in layer.active_adapters:
            drop = layer.lora_dropout[name] if name in layer.lora_A else None
            if isinstance(drop, nn.Dropout) and (layer.training if dora else drop.p > 0 and drop.training):
                return "in training mode"
    return ""


def followed_or_refused(block, ops, dora: bool = False) -> None:
    """``block``'s swapped twin, with the state changes ``ops`` applied to ``block`` one by one:
    each call equals PEFT's, or is refused naming the cause (:func:`expected_refusal`), ``x`` untouched."""
    rust = RustTransformerBlock(block)
    x, c = inputs(seed=4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns on merging a merged adapter, unmerging an unmerged one
        assert torch.equal(call(rust, x, c), call(block, x, c))
        for op in ops:
            apply(block, op)
            cause = expected_refusal(block, dora)
            if cause:
                kept = x.clone()
                with pytest.raises(UnsupportedBlockError, match=cause):
                    call(rust, x, c)
                assert torch.equal(x, kept)
            else:
                assert torch.equal(call(rust, x, c), call(block, x, c)), op


# --------------------------------------------------------------------------------------------
# A swapped UNet beside its reference, through diffusers' own adapter API
# --------------------------------------------------------------------------------------------


def unet_adapter(unet, name, seed, dora=False, **config):
    """``unet.add_adapter`` on the attentions' linears, seeded (the global generator left as it was)."""
    config = {"r": 4, "lora_alpha": 4, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], **config}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        unet.add_adapter(LoraConfig(init_lora_weights=False, use_dora=dora, **config), adapter_name=name)


def unet_inputs():
    """The tiny UNet's sample, timesteps and context (conftest's ``tiny_unet``)."""
    g = torch.Generator().manual_seed(17)
    return torch.randn(2, 4, 16, 16, generator=g), torch.tensor([10, 700]), torch.randn(2, 77, 32, generator=g)


class UnetPair:
    """A swapped UNet and its unswapped reference, driven alike and compared bit for bit."""

    def __init__(self, unet, reference, inputs):
        self.unet, self.reference, self.inputs = unet, reference, inputs

    def each(self, fn):
        for model in (self.unet, self.reference):
            fn(model)

    def _step(self, model, **kw):
        model.zero_grad(set_to_none=True)
        out = model(*self.inputs, **kw).sample
        (out**2).sum().backward()
        return [out] + [p.grad for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]

    def same_step(self, **kw):
        """A training step on each: the same output and the same gradient on every LoRA tensor."""
        a, b = self._step(self.unet, **kw), self._step(self.reference, **kw)
        return len(a) == len(b) > 1 and all(torch.equal(x, y) for x, y in zip(a, b))

    def same_output(self):
        with torch.no_grad():
            return torch.equal(self.unet(*self.inputs).sample, self.reference(*self.inputs).sample)

    def disabled_then_fused_agree(self):
        """The adapters disabled, then enabled and fused (scale 0.7): the same output each time."""
        self.each(lambda m: m.disable_lora())
        disabled = self.same_output()
        self.each(lambda m: (m.enable_lora(), m.fuse_lora(lora_scale=0.7)))
        return disabled and self.same_output()
