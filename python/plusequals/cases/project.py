"""The project's audits: the seven residual strategies in the two places the seed's commit broke
them (a UNet level that keeps the block's input for its skip, and textual-inversion training,
with and without CompVis checkpointing), diffusers' UNet with and without the seed's ``+=``, and
real models on the meta device. ``agreement`` checks each strategy's findings against what
:data:`plusequals.model.bugs.EXPECTED` measured with PyTorch alone.
"""

from __future__ import annotations

import types
from typing import Any, Callable, FrozenSet, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from ..auditing import AuditReport, audit
from ..model.blocks import STRATEGIES
from ..model.bugs import EXPECTED, LEAF, OUT_NO_AUTOGRAD, VERSION_COUNTER, VIEW_OF_LEAF, small_block
from ..twin.swap import sd_v1_unet_config, tiny_unet_config

__all__ = [
    "EXPECTED",
    "LEAF",
    "OUT_NO_AUTOGRAD",
    "SETTINGS",
    "VERSION_COUNTER",
    "VIEW_OF_LEAF",
    "SkipHarness",
    "TextualInversion",
    "agreement",
    "strategy_audit",
]

SETTINGS = ("skip", "training", "checkpointed")


class SkipHarness(nn.Module):
    """A UNet level: the block's input is kept for the skip connection and read after the block."""

    def __init__(self, block: nn.Module, dim: int = 32) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.block = block

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        h = self.proj_in(x)
        skip = h
        h = self.block(h, context)
        return h + skip


class TextualInversion(nn.Module):
    """The seed's training loop as a module: a frozen ``proj_in`` feeds the block, whose context
    is a learnable token embedding (see :func:`plusequals.model.bugs.textual_inversion`)."""

    def __init__(self, block: nn.Module, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj_in = nn.Linear(16, 32).requires_grad_(False)
        self.block = block
        self.embedding = nn.Parameter(torch.randn(1, 7, 24, generator=g))

    def forward(self, latent: Tensor) -> Tensor:
        x = self.proj_in(latent)
        return self.block(x, self.embedding.expand(latent.shape[0], -1, -1))


def strategy_audit(strategy: str, setting: str, seed: int = 0) -> AuditReport:
    """Audits ``strategy`` in ``setting``: ``skip`` (grad off, as the seed's inference),
    ``training`` or ``checkpointed`` (forward and backward; CompVis checkpointing trains the
    block's parameters, as in ``bugs.textual_inversion``)."""
    checkpointed = setting == "checkpointed"
    block = small_block(seed, checkpoint=checkpointed)
    block.residual = strategy
    g = torch.Generator().manual_seed(seed + 1)
    if setting == "skip":
        x, context = torch.randn(2, 16, 32, generator=g), torch.randn(2, 7, 24, generator=g)
        with torch.no_grad():
            return audit(SkipHarness(block), x, context)
    block.requires_grad_(checkpointed)
    with torch.enable_grad():
        return audit(TextualInversion(block, seed), torch.randn(2, 16, 16, generator=g), backward=True)


def agreement(strategy: str, setting: str, report: AuditReport) -> Optional[str]:
    """None when the findings agree with ``EXPECTED``, else what differs. In the skip harness,
    E0382 exactly when the caller's tensor is mutated, and nothing else (the block's input is the
    harness's temporary, not the audited call's argument: no E0596); in
    training, E0502 exactly when PyTorch's version counter refuses backward, and the error the
    model raised (or none) is the expected one."""
    expected = EXPECTED[strategy]
    codes = set(report.codes)
    if setting == "skip":
        want = {"E0382"} if expected.caller_mutated else set()
        return None if codes == want else f"expected {sorted(want) or 'clean'}, found {sorted(codes) or 'clean'}"
    error = expected.training_checkpointed if setting == "checkpointed" else expected.training
    if (error == VERSION_COUNTER) != ("E0502" in codes):
        return f"E0502 {'missing' if error == VERSION_COUNTER else 'unexpected'} (PyTorch: {error or 'trains'})"
    raised = report.error or report.backward_error
    if (error is None) != (raised is None) or (error is not None and error not in (raised or "")):
        return f"expected {error or 'no error'}, the model raised {raised or 'nothing'}"
    if "E0382" in codes:
        return "E0382 unexpected: nothing reads the block's input after it"
    return None


# --------------------------------------------------------------------------------------------
# diffusers: a small UNet2DConditionModel, with and without the seed's `+=`
# --------------------------------------------------------------------------------------------
def seed_iadd_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Optional[Tensor] = None,
    encoder_hidden_states: Optional[Tensor] = None,
    encoder_attention_mask: Optional[Tensor] = None,
    **unused: Any,
) -> Tensor:
    """diffusers' ``BasicTransformerBlock.forward`` for SD v1 (layer norms, no GLIGEN, no
    chunking) with the seed's commit applied: each ``h = op(norm(h)) + h`` written ``h += ...``."""
    hidden_states += self.attn1(self.norm1(hidden_states), attention_mask=attention_mask)
    hidden_states += self.attn2(
        self.norm2(hidden_states), encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask
    )
    hidden_states += self.ff(self.norm3(hidden_states))
    return hidden_states


def patch_seed_iadd(model: nn.Module) -> int:
    """Gives each SD-v1-kind diffusers ``BasicTransformerBlock`` of ``model`` the seed's forward
    (on the instance: the class stays as it is). Returns how many were patched."""
    from diffusers.models.attention import BasicTransformerBlock

    n = 0
    for m in model.modules():
        if isinstance(m, BasicTransformerBlock):
            if m.norm_type != "layer_norm" or m.only_cross_attention or m.pos_embed is not None:
                raise ValueError(f"not an SD v1 block (norm_type={m.norm_type!r}): the seed's forward would differ")
            m.forward = types.MethodType(seed_iadd_forward, m)
            n += 1
    return n


def tiny_unet(seed: int = 0, patched: bool = False) -> Tuple[nn.Module, Tuple[Tensor, Tensor, Tensor]]:
    import diffusers

    with torch.random.fork_rng(devices=[]):  # diffusers initialises from the global generator: left as it was
        torch.manual_seed(seed)
        unet = diffusers.UNet2DConditionModel(**tiny_unet_config()).eval()
    if patched:
        patch_seed_iadd(unet)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = (torch.randn(2, 4, 16, 16, generator=g), torch.tensor([10, 700]), torch.randn(2, 77, 32, generator=g))
    return unet, inputs


def unet_audit(patched: bool, training: bool, seed: int = 0) -> AuditReport:
    unet, inputs = tiny_unet(seed, patched)
    if training:
        with torch.enable_grad():
            return audit(unet, *inputs, backward=True)
    with torch.no_grad():
        return audit(unet, *inputs)


# --------------------------------------------------------------------------------------------
# Real models, full size, on the meta device (no memory, no weights: the ops and their aliasing
# are the real ones)
# --------------------------------------------------------------------------------------------


class RealModel(NamedTuple):
    name: str
    source: str  # the class, as the README names it
    build: Callable[[], Tuple[nn.Module, tuple]]
    expected: FrozenSet[str] = frozenset()  # the codes it must give (none: the library is clean)


def _sd_unet() -> Tuple[nn.Module, tuple]:
    import diffusers

    unet = diffusers.UNet2DConditionModel(**sd_v1_unet_config())
    return unet, (torch.randn(2, 4, 64, 64), torch.tensor([10, 700]), torch.randn(2, 77, 768))


def _sd_vae() -> Tuple[nn.Module, tuple]:
    import diffusers

    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=512,
    )
    return vae, (torch.randn(1, 3, 512, 512),)


def _clip_text() -> Tuple[nn.Module, tuple]:
    import transformers

    config = transformers.CLIPTextConfig(
        vocab_size=49408,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
    )
    model = transformers.CLIPTextModel(config)
    return model, (torch.randint(0, 49408, (2, 77)),)


def _sd_unet_seed_iadd() -> Tuple[nn.Module, tuple]:
    unet, inputs = _sd_unet()
    patch_seed_iadd(unet)
    return unet, inputs


REAL_MODELS = (
    RealModel("SD v1 UNet", "diffusers UNet2DConditionModel (SD v1.5 config)", _sd_unet),
    RealModel(
        "SD v1 UNet, seed's `+=`",
        "the same, its 16 transformer blocks patched (seed_iadd_forward)",
        _sd_unet_seed_iadd,
        frozenset({"E0502"}),
    ),
    RealModel("SD v1 VAE", "diffusers AutoencoderKL (SD v1.5 config), encode and decode", _sd_vae),
    RealModel("SD v1 text encoder", "transformers CLIPTextModel (ViT-L/14 text config)", _clip_text),
)


def real_model_audit(model: RealModel, training: bool = True) -> AuditReport:
    """Builds ``model`` at full size on the meta device and audits one forward (and backward)."""
    with torch.device("meta"):
        module, inputs = model.build()
    with torch.enable_grad() if training else torch.no_grad():
        return audit(module, *inputs, backward=training)


def all_strategy_audits() -> List[Tuple[str, str, AuditReport, Optional[str]]]:
    rows = []
    for setting in SETTINGS:
        for strategy in STRATEGIES:
            report = strategy_audit(strategy, setting)
            rows.append((setting, strategy, report, agreement(strategy, setting, report)))
    return rows
