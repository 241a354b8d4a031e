"""The false-positive sweep: popular models audited forward and backward in train mode, where a
finding would be wrong unless it is a real write into the caller's tensor.

* every torchvision classification model (``torchvision.models.list_models``), batch 2, 32 x 32
  images (ViT at ``image_size=32``; MaxViT and Inception v3 at the smallest size they accept);
* transformers architectures from tiny configs (no downloads);
* diffusers' ``UNet2DConditionModel``, ``AutoencoderKL`` and ``ControlNetModel`` from small configs.

torchvision's models are built and run on the meta device: no memory, no weights, and the ops
and their aliasing are the real ones (``tests/test_audit_sweep.py`` runs some on the CPU too and
checks they agree); the tiny transformers and diffusers models run on the CPU. torchvision,
transformers and diffusers are optional; :func:`families` lists what is installed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..auditing import AuditReport, audit
from ..twin.swap import tiny_unet_config

__all__ = [
    "MOVES",
    "SLOW",
    "SweepModel",
    "SweepResult",
    "architecture",
    "entries",
    "families",
    "markdown",
    "representatives",
    "run",
]


class SweepModel(NamedTuple):
    family: str
    name: str
    build: Callable[[], Tuple[nn.Module, tuple, dict]]
    device: str = "meta"  # tiny configs run on the CPU (real values; BART reads one with .item())


class SweepResult(NamedTuple):
    family: str
    name: str
    report: AuditReport
    seconds: float


# The heaviest torchvision models, marked slow in tests/test_audit_sweep.py (make sweep runs them)
# and never a representative: these 21 take about as long as the other 77 together (every
# transformers and diffusers model among them).
SLOW = (
    ("torchvision", "regnet_y_128gf"),
    ("torchvision", "efficientnet_v2_l"),
    ("torchvision", "efficientnet_b7"),
    ("torchvision", "efficientnet_v2_m"),
    ("torchvision", "efficientnet_b6"),
    ("torchvision", "efficientnet_b5"),
    ("torchvision", "efficientnet_b4"),
    ("torchvision", "regnet_x_32gf"),
    ("torchvision", "densenet201"),
    ("torchvision", "regnet_y_16gf"),
    ("torchvision", "regnet_y_32gf"),
    ("torchvision", "efficientnet_v2_s"),
    ("torchvision", "swin_v2_b"),
    ("torchvision", "densenet169"),
    ("torchvision", "regnet_x_16gf"),
    ("torchvision", "resnext101_64x4d"),
    ("torchvision", "regnet_y_1_6gf"),
    ("torchvision", "efficientnet_b3"),
    ("torchvision", "efficientnet_b1"),
    ("torchvision", "efficientnet_b2"),
    ("torchvision", "wide_resnet101_2"),
)
# The moves three CNNs give: each in-place activation overwrites a value nothing reads again (a move,
# not a finding).
MOVES = {"resnet18": 17, "mobilenet_v2": 35, "efficientnet_b0": 50}

# Sizes torchvision's models need other than 32 x 32 (AlexNet's three pools need 63; ViT-H's
# patches are 14; MaxViT partitions by 7 at each of 5 strides; Inception v3's auxiliary head
# needs 17 x 17 at Mixed_6e).
_TV_SIZE = {"alexnet": 64, "vit_h_14": 28, "maxvit_t": 224, "inception_v3": 299}
# RegNet computes its widths with tensor values at construction: built on the CPU, then moved.
_TV_BUILT_ON_CPU = ("regnet_",)


def _torchvision() -> List[SweepModel]:
    import torchvision

    def build(name: str) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
        def make() -> Tuple[nn.Module, tuple, dict]:
            size = _TV_SIZE.get(name, 32)
            kwargs: Dict[str, Any] = {"image_size": size} if name.startswith("vit_") else {}
            if name.startswith(_TV_BUILT_ON_CPU):
                device = torch.get_default_device()
                with torch.device("cpu"):
                    model = torchvision.models.get_model(name, weights=None, num_classes=10).to(device)
            else:
                model = torchvision.models.get_model(name, weights=None, num_classes=10, **kwargs)
            return model, (torch.randn(2, 3, size, size),), {}

        return make

    return [SweepModel("torchvision", n, build(n)) for n in torchvision.models.list_models(module=torchvision.models)]


_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, vocab_size=99)


def _text(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    def make() -> Tuple[nn.Module, tuple, dict]:
        import transformers

        config = getattr(transformers, config_cls)(**{**_TINY, **overrides})
        model = getattr(transformers, model_cls)(config)
        ids = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(0))
        return model, (), {"input_ids": ids.to(torch.get_default_device())}

    return make


def _seq2seq(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    def make() -> Tuple[nn.Module, tuple, dict]:
        model, _, kwargs = _text(config_cls, model_cls, **overrides)()
        return model, (), {**kwargs, "decoder_input_ids": kwargs["input_ids"][:, :5]}

    return make


def _vision(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    def make() -> Tuple[nn.Module, tuple, dict]:
        import transformers

        fields = {k: v for k, v in _TINY.items() if k != "vocab_size"}
        config = getattr(transformers, config_cls)(**{**fields, **overrides})
        return getattr(transformers, model_cls)(config), (torch.randn(2, 3, 32, 32),), {}

    return make


def _transformers() -> List[SweepModel]:
    kv = dict(num_key_value_heads=2)
    builds = {
        "bert": _text("BertConfig", "BertForMaskedLM"),
        "roberta": _text("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1),
        "distilbert": _text("DistilBertConfig", "DistilBertForMaskedLM", dim=32, n_layers=2, n_heads=4, hidden_dim=37),
        "albert": _text("AlbertConfig", "AlbertForMaskedLM", embedding_size=16),
        "electra": _text("ElectraConfig", "ElectraForMaskedLM", embedding_size=16),
        "gpt2": _text("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4),
        "gpt_neox": _text("GPTNeoXConfig", "GPTNeoXForCausalLM"),
        "opt": _text("OPTConfig", "OPTForCausalLM", ffn_dim=37, word_embed_proj_dim=32),
        "llama": _text("LlamaConfig", "LlamaForCausalLM", **kv),
        "mistral": _text("MistralConfig", "MistralForCausalLM", **kv),
        "qwen2": _text("Qwen2Config", "Qwen2ForCausalLM", **kv),
        "t5": _seq2seq(
            "T5Config", "T5ForConditionalGeneration", d_model=32, d_ff=37, num_layers=2, num_heads=4, d_kv=8
        ),
        "bart": _seq2seq(
            "BartConfig",
            "BartForConditionalGeneration",
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
        ),
        "vit": _vision("ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8),
        "clip_vision": _vision("CLIPVisionConfig", "CLIPVisionModel", image_size=32, patch_size=8),
    }
    return [SweepModel("transformers", n, b, "cpu") for n, b in builds.items()]


# the project's tiny UNet (twin.swap.tiny_unet_config) at 8 x 8 latents
_UNET: Dict[str, Any] = {**tiny_unet_config(), "sample_size": 8}


def _unet() -> Tuple[nn.Module, tuple, dict]:
    import diffusers

    unet = diffusers.UNet2DConditionModel(**_UNET)
    return unet, (torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 7, 32)), {}


def _vae() -> Tuple[nn.Module, tuple, dict]:
    import diffusers

    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
    )
    return vae, (torch.randn(2, 3, 16, 16),), {}


def _controlnet() -> Tuple[nn.Module, tuple, dict]:
    import diffusers

    fields = {k: v for k, v in _UNET.items() if k not in ("sample_size", "out_channels", "up_block_types")}
    net = diffusers.ControlNetModel(**fields, conditioning_embedding_out_channels=(16, 32))
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([10, 700]), torch.randn(2, 7, 32), torch.randn(2, 3, 16, 16))
    return net, inputs, {}


def _diffusers() -> List[SweepModel]:
    return [
        SweepModel("diffusers", "UNet2DConditionModel", _unet, "cpu"),
        SweepModel("diffusers", "AutoencoderKL", _vae, "cpu"),
        SweepModel("diffusers", "ControlNetModel", _controlnet, "cpu"),
    ]


_FAMILIES = {"torchvision": _torchvision, "transformers": _transformers, "diffusers": _diffusers}


def families() -> List[str]:
    """The families whose library is installed."""
    import importlib.util

    return [f for f in _FAMILIES if importlib.util.find_spec(f) is not None]


def entries(family: str) -> List[SweepModel]:
    return _FAMILIES[family]()


def architecture(entry: SweepModel) -> str:
    """The code a model runs: for torchvision the module its builder lives in (``resnet`` holds
    ResNet, ResNeXt and Wide ResNet, ``efficientnet`` B0-B7 and V2), elsewhere the model itself
    (every transformers and diffusers entry is an architecture of its own)."""
    if entry.family != "torchvision":
        return entry.name
    import torchvision

    return torchvision.models.get_model_builder(entry.name).__module__.rsplit(".", 1)[-1]


def representatives() -> List[SweepModel]:
    """One model of each architecture of the installed families, in the sweep's order: a model
    whose moves are counted (``MOVES``) where the architecture has one, else its first model not
    in ``SLOW``. ``make test`` runs these; ``make sweep`` runs every model."""
    by_architecture: Dict[Tuple[str, str], List[SweepModel]] = {}
    for family in families():
        for e in entries(family):
            by_architecture.setdefault((family, architecture(e)), []).append(e)

    def pick(models: List[SweepModel]) -> SweepModel:
        counted = [e for e in models if e.name in MOVES]
        return (counted or [e for e in models if (e.family, e.name) not in SLOW] or models)[0]

    return [pick(models) for models in by_architecture.values()]


def run(entry: SweepModel, device: Optional[str] = None, seed: int = 0) -> SweepResult:
    """Builds ``entry`` on ``device`` (its own by default) in train mode and audits one forward
    and backward."""
    device = device or entry.device
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model, args, kwargs = entry.build()
    model.train()
    with torch.enable_grad():
        report = audit(model, *args, backward=True, **kwargs)
    return SweepResult(entry.family, entry.name, report, time.perf_counter() - start)


def _findings(report: AuditReport) -> str:
    if report.findings:
        return ", ".join(f"{c} x{len(report.by_code(c))}" for c in report.codes)
    return "clean" if report.error is None and report.backward_error is None else "no findings"


def markdown(rows: List[SweepResult]) -> str:
    """The README's sweep table: one line per model."""
    lines = [
        "| family | model | findings (forward and backward, train mode) | moves | ops | modules |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        raised = r.report.error or r.report.backward_error
        verdict = _findings(r.report) + (f"; raised: {raised[:60]}" if raised else "")
        moves = sum(m.count for m in r.report.moves)
        lines.append(f"| {r.family} | {r.name} | {verdict} | {moves} | {r.report.ops} | {r.report.modules} |")
    return "\n".join(lines)
