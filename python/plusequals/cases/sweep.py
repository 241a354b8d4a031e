"""The false-positive sweep: popular models audited forward and backward in train mode, where a
finding would be wrong unless it is a real write into the caller's tensor.

* every torchvision classification model (``torchvision.models.list_models``), batch 2, 32 x 32
  images (ViT at ``image_size=32``; MaxViT and Inception v3 at the smallest size they accept),
  and every detection (with targets), segmentation, video and optical flow model, at small sizes;
* timm models across its families (``pretrained=False``, the smallest image each accepts);
* torch.nn's recurrent and Transformer layers, with their fused kernels and fast paths;
* transformers architectures from tiny configs (no downloads);
* diffusers' ``UNet2DConditionModel``, ``AutoencoderKL`` and ``ControlNetModel`` from small configs.

Each runs on the CPU through :func:`.paired.paired`: a train step with backward and an eval forward
under ``no_grad``, audited and plain from the same seed, which must compute the same bits and run
the same ATen ops. The heaviest torchvision classification models (``SLOW``) are audited on the
meta device instead: no memory, no weights, and the ops and their aliasing are the real ones
(``tests/test_audit_sweep.py`` runs resnet18 on both and checks they agree), but no values to
compare. torchvision, timm, transformers and diffusers are optional; :func:`families` lists what
is installed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..auditing import AuditReport, audit
from ..twin.swap import tiny_unet_config
from .paired import paired

__all__ = [
    "MOVES",
    "SLOW",
    "SMALLEST",
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
    device: str = "cpu"  # "meta": audited without values (``SLOW``), not compared with a plain run


class SweepResult(NamedTuple):
    """The audited train step's report and the eval forward's; ``differences``: what the audited
    runs computed otherwise than the plain ones, and ``ops`` the ATen ops each phase ran, by name
    and count (None on the meta device, where nothing is compared)."""

    family: str
    name: str
    report: AuditReport
    seconds: float
    eval: AuditReport
    differences: Optional[List[str]]
    ops: Optional[Dict[str, Dict[str, int]]] = None


# The heaviest models, marked slow in tests/test_audit_sweep.py: make sweep runs them, make test
# none (sweep.representatives). The torchvision classification models
# among them are audited on the meta device (the largest hold gigabytes of weights and gradients,
# twice); the others run on the CPU beside a plain run like every model, except MViT (the meta
# device: its builders fix a 16 x 224 x 224 clip).
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
    ("torchvision", "vit_h_14"),
    ("torchvision", "vit_l_16"),
    ("torchvision", "vit_l_32"),
    ("torchvision", "convnext_large"),
    ("torchvision", "fasterrcnn_resnet50_fpn_v2"),
    ("torchvision", "keypointrcnn_resnet50_fpn"),
    ("torchvision", "maskrcnn_resnet50_fpn_v2"),
    ("torchvision", "ssd300_vgg16"),
    ("torchvision", "s3d"),
    ("torchvision", "mvit_v1_b"),
    ("torchvision", "mvit_v2_s"),
)
# The moves three CNNs give: each in-place activation overwrites a value nothing reads again (a move,
# not a finding).
MOVES = {("torchvision", "resnet18"): 17, ("torchvision", "mobilenet_v2"): 35, ("torchvision", "efficientnet_b0"): 50}

# make test's model of a torchvision architecture whose first model (by name) is a large one: its smallest
SMALLEST = {
    ("torchvision", "convnext_tiny"),
    ("torchvision", "swin_t"),
    ("torchvision", "fcn_resnet50"),
    ("torchvision", "swin3d_t"),
    ("torchvision", "raft_small"),
}

# Sizes torchvision's models need other than 32 x 32 (AlexNet's three pools need 63; ViT-H's
# patches are 14; MaxViT partitions by 7 at each of 5 strides; Inception v3's auxiliary head
# needs 17 x 17 at Mixed_6e).
_TV_SIZE = {"alexnet": 64, "vit_h_14": 28, "maxvit_t": 224, "inception_v3": 299}
# RegNet computes its widths with tensor values at construction: built on the CPU, then moved.
_TV_BUILT_ON_CPU = ("regnet_",)


def _classification(name: str) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    import torchvision

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


def _targets(size: int, keypoints: bool, masks: bool) -> List[Dict[str, torch.Tensor]]:
    """Two images' boxes and labels (and keypoints, masks) for a detection train step."""
    boxes = [torch.tensor([[0.1, 0.1, 0.5, 0.6], [0.3, 0.2, 0.9, 0.8]]), torch.tensor([[0.2, 0.2, 0.8, 0.6]])]
    out = []
    for b in boxes:
        target = {"boxes": b * size, "labels": torch.arange(1, len(b) + 1)}
        if keypoints:  # 17 points inside each box, all visible
            t = torch.rand(len(b), 17, 1)
            xy = torch.stack([b[:, None, 0] + t[..., 0] * (b[:, None, 2] - b[:, None, 0])] * 2, -1) * size
            target["keypoints"] = torch.cat([xy, torch.ones(len(b), 17, 1)], -1)
        if masks:
            target["masks"] = (torch.rand(len(b), size, size) > 0.5).to(torch.uint8)
        out.append(target)
    return out


# SSD resizes to its own fixed size; the others to min_size / max_size
_DETECTION_SIZE = {"ssd300_vgg16": 300, "ssdlite320_mobilenet_v3_large": 320}


def _detection_kwargs(name: str, size: int) -> Dict[str, Any]:
    """Small images, and few boxes: the R-CNNs' mask and keypoint heads run on every sampled
    proposal in training and every detection in eval (100 an image by default)."""
    kwargs: Dict[str, Any] = {} if name in _DETECTION_SIZE else {"min_size": size, "max_size": size}
    if "rcnn" in name:
        return {**kwargs, "box_detections_per_img": 4, "box_batch_size_per_image": 8}
    return {**kwargs, "detections_per_img": 4}


def _detection(name: str) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    import torchvision

    def make() -> Tuple[nn.Module, tuple, dict]:
        size = _DETECTION_SIZE.get(name, 64)
        kwargs = _detection_kwargs(name, size)
        model = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=3, **kwargs)
        n = 1 if name == "ssd300_vgg16" else 2  # VGG-16 at 300 x 300: one image
        images = [torch.rand(3, size, size) for _ in range(n)]
        return model, (images, _targets(size, "keypoint" in name, "mask" in name)[:n]), {}

    return make


def _segmentation(name: str) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    import torchvision

    def make() -> Tuple[nn.Module, tuple, dict]:
        aux = {} if name.startswith("lraspp") else {"aux_loss": True}
        model = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=3, **aux)
        return model, (torch.randn(2, 3, 64, 64),), {}

    return make


# S3D pools 7 x 7 at a stride of 32 and 2 frames at 8; MViT's builders fix its clip at 16 x 224 x 224 (one clip)
_VIDEO_CLIP = {"s3d": (16, 224), "mvit_v1_b": (16, 224), "mvit_v2_s": (16, 224)}


def _video(name: str) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    import torchvision

    def make() -> Tuple[nn.Module, tuple, dict]:
        frames, size = _VIDEO_CLIP.get(name, (4, 32))
        model = torchvision.models.get_model(name, weights=None, num_classes=10)
        return model, (torch.randn(1 if size > 32 else 2, 3, frames, size, size),), {}

    return make


def _optical_flow(name: str) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    import torchvision

    def make() -> Tuple[nn.Module, tuple, dict]:
        model = torchvision.models.get_model(name, weights=None)
        # the correlation pyramid needs 16 x 16 features at a stride of 8
        return model, (torch.randn(2, 3, 128, 128), torch.randn(2, 3, 128, 128)), {"num_flow_updates": 2}

    return make


def _torchvision() -> List[SweepModel]:
    import torchvision

    tv = torchvision.models
    out = [
        SweepModel("torchvision", n, _classification(n), "meta" if ("torchvision", n) in SLOW else "cpu")
        for n in tv.list_models(module=tv)
    ]
    for module, build in (
        (tv.detection, _detection),
        (tv.segmentation, _segmentation),
        (tv.video, _video),
        (tv.optical_flow, _optical_flow),
    ):
        out += [
            SweepModel("torchvision", n, build(n), "meta" if n.startswith("mvit") else "cpu")
            for n in tv.list_models(module=module)
        ]
    return out


# timm models by the module that builds them, each model's smallest image (a transformer's
# ``img_size`` set to it), with the arguments that shrink it (Swin's windows, BEiT's depth)
_TIMM: Dict[str, List[Tuple[str, int, Dict[str, Any]]]] = {
    "resnet": [
        ("resnet10t", 32, {}),
        ("resnet18", 32, {}),
        ("resnet26d", 32, {}),
        ("resnet50d", 32, {}),
        ("seresnet18", 32, {}),
        ("seresnext26d_32x4d", 32, {}),
        ("ecaresnet26t", 32, {}),
        ("resnetrs50", 32, {}),
    ],
    "byobnet": [("gernet_s", 32, {}), ("resnext26ts", 32, {}), ("repvgg_a0", 32, {}), ("regnetz_b16", 32, {})],
    "efficientnet": [
        ("tinynet_e", 32, {}),
        ("mobilenetv2_050", 32, {}),
        ("efficientnet_b0", 32, {}),
        ("efficientnet_lite0", 32, {}),
        ("tf_efficientnet_b0", 32, {}),
        ("mixnet_s", 32, {}),
        ("mnasnet_100", 32, {}),
        ("fbnetc_100", 32, {}),
        ("efficientnetv2_rw_t", 32, {}),
    ],
    "mobilenetv3": [
        ("lcnet_050", 32, {}),
        ("mobilenetv3_small_050", 32, {}),
        ("mobilenetv3_large_100", 32, {}),
        ("tf_mobilenetv3_small_minimal_100", 32, {}),
        ("mobilenetv4_conv_small", 32, {}),
    ],
    "regnet": [("regnetx_002", 32, {}), ("regnety_002", 32, {}), ("regnetv_040", 32, {})],
    "convnext": [("convnext_atto", 32, {}), ("convnextv2_atto", 32, {})],
    "vision_transformer": [("vit_tiny_patch16_224", 32, {"img_size": 32})],
    "deit": [
        ("deit_tiny_patch16_224", 32, {"img_size": 32}),
        ("deit_tiny_distilled_patch16_224", 32, {"img_size": 32}),
        ("deit3_small_patch16_224", 32, {"img_size": 32, "depth": 2}),
    ],
    "beit": [("beit_base_patch16_224", 32, {"img_size": 32, "depth": 2})],
    "eva": [("eva02_tiny_patch14_224", 28, {"img_size": 28})],
    "swin_transformer": [("swin_tiny_patch4_window7_224", 64, {"img_size": 64, "window_size": 2})],
    "mlp_mixer": [
        ("mixer_s16_224", 32, {"img_size": 32}),
        ("resmlp_12_224", 32, {"img_size": 32}),
        ("gmlp_ti16_224", 32, {"img_size": 32}),
    ],
    "coat": [("coat_lite_tiny", 32, {"img_size": 32})],
    "cait": [("cait_xxs24_224", 32, {"img_size": 32})],
    "efficientformer_v2": [("efficientformerv2_s0", 64, {"img_size": 64})],
    "densenet": [("densenet121", 32, {})],
    "dpn": [("dpn48b", 32, {}), ("dpn68", 32, {})],
    "xception_aligned": [("xception41", 32, {})],
    "nfnet": [("nf_resnet26", 32, {}), ("eca_nfnet_l0", 32, {})],
    "ghostnet": [("ghostnet_100", 32, {}), ("ghostnetv2_100", 64, {})],
    "hrnet": [("hrnet_w18_small", 64, {})],
    "levit": [("levit_128s", 64, {"img_size": 64})],
    "cspnet": [("cspresnet50", 32, {}), ("cspdarknet53", 32, {})],
    "mobilevit": [("mobilevit_xxs", 64, {})],
    "sequencer": [("sequencer2d_s", 32, {"img_size": 32})],
    "maxxvit": [("coatnet_nano_rw_224", 64, {"img_size": 64}), ("maxvit_nano_rw_256", 64, {"img_size": 64})],
    "inception_v3": [("inception_v3", 75, {})],
    "metaformer": [("poolformer_s12", 32, {})],
    "tresnet": [("tresnet_m", 64, {})],
    "rexnet": [("rexnet_100", 32, {})],
    "fastvit": [("fastvit_t8", 32, {})],
    "efficientvit_mit": [("efficientvit_b0", 32, {})],
}


def _timm_model(name: str, size: int, kwargs: Dict[str, Any]) -> Callable[[], Tuple[nn.Module, tuple, dict]]:
    def make() -> Tuple[nn.Module, tuple, dict]:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        return model, (torch.randn(2, 3, size, size),), {}

    return make


def _timm() -> List[SweepModel]:
    return [SweepModel("timm", n, _timm_model(n, size, kw)) for ms in _TIMM.values() for n, size, kw in ms]


class _Packed(nn.Module):
    """An LSTM over a padded batch of sequences of different lengths, packed and unpacked."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]


def _layer(make: Callable[[], nn.Module], *shapes: Tuple[int, ...]) -> Callable[[], tuple]:
    return lambda: (make(), tuple(torch.randn(*s) for s in shapes), {})


def _padding() -> torch.Tensor:
    """Two sequences of 6, the second padded after 4 (the encoder's nested-tensor fast path)."""
    return torch.tensor([[False] * 6, [False] * 4 + [True] * 2])


def _torch_nn() -> List[SweepModel]:
    """torch.nn's layers whose eval forward under no_grad takes a fused kernel or fast path (the
    RNNs' ``aten.lstm``/``gru``/``rnn_tanh``, ``_transformer_encoder_layer_fwd``, the encoder's
    nested tensors, ``_native_multi_head_attention``)."""
    enc = dict(d_model=16, nhead=4, dim_feedforward=32, dropout=0.1, batch_first=True)
    causal = nn.Transformer.generate_square_subsequent_mask  # made anew by each build, as every input
    builds = {
        "RNN": _layer(lambda: nn.RNN(8, 16, num_layers=2, dropout=0.1, batch_first=True), (2, 6, 8)),
        "LSTM": _layer(lambda: nn.LSTM(8, 16, num_layers=2, dropout=0.1, bidirectional=True), (6, 2, 8)),
        "LSTM proj_size": _layer(lambda: nn.LSTM(8, 16, proj_size=4, batch_first=True), (2, 6, 8)),
        "GRU": _layer(lambda: nn.GRU(8, 16, num_layers=2, dropout=0.1, bidirectional=True), (6, 2, 8)),
        "LSTM packed": lambda: (_Packed(), (torch.randn(2, 6, 8), torch.tensor([6, 3])), {}),
        "TransformerEncoderLayer": _layer(lambda: nn.TransformerEncoderLayer(**enc), (2, 6, 16)),
        "TransformerEncoderLayer norm_first causal": lambda: (
            nn.TransformerEncoderLayer(**enc, norm_first=True),
            (torch.randn(2, 6, 16),),
            {"src_mask": causal(6), "is_causal": True},
        ),
        "TransformerEncoder padded": lambda: (
            nn.TransformerEncoder(nn.TransformerEncoderLayer(**enc), 2, enable_nested_tensor=True),
            (torch.randn(2, 6, 16),),
            {"src_key_padding_mask": _padding()},
        ),
        "TransformerDecoderLayer": _layer(lambda: nn.TransformerDecoderLayer(**enc), (2, 6, 16), (2, 5, 16)),
        "Transformer": lambda: (
            nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **enc),
            (torch.randn(2, 6, 16), torch.randn(2, 6, 16)),
            {"tgt_mask": causal(6), "tgt_is_causal": True},
        ),
        "MultiheadAttention": lambda: (
            nn.MultiheadAttention(16, 4, batch_first=True),
            (torch.randn(2, 6, 16),) * 3,
            {"key_padding_mask": _padding(), "need_weights": False},
        ),
    }
    return [SweepModel("torch.nn", n, b) for n, b in builds.items()]


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


_FAMILIES = {
    "torchvision": _torchvision,
    "timm": _timm,
    "torch.nn": _torch_nn,
    "transformers": _transformers,
    "diffusers": _diffusers,
}


def families() -> List[str]:
    """The families whose library is installed."""
    import importlib.util

    return [f for f in _FAMILIES if importlib.util.find_spec(f) is not None]


def entries(family: str) -> List[SweepModel]:
    return _FAMILIES[family]()


def architecture(entry: SweepModel) -> str:
    """The code a model runs: for torchvision the module its builder lives in (``resnet`` holds
    ResNet, ResNeXt and Wide ResNet, ``efficientnet`` B0-B7 and V2, ``detection.faster_rcnn``
    every Faster R-CNN), for timm the module that builds it (``_TIMM``'s keys), elsewhere the
    model itself (every torch.nn, transformers and diffusers entry is an architecture of its own)."""
    if entry.family == "timm":
        return next(module for module, models in _TIMM.items() if any(n == entry.name for n, _, _ in models))
    if entry.family != "torchvision":
        return entry.name
    import torchvision

    return torchvision.models.get_model_builder(entry.name).__module__.removeprefix("torchvision.models.")


def representatives() -> List[SweepModel]:
    """One model of each architecture of the installed families, in the sweep's order: a model
    whose moves are counted (``MOVES``) or the smallest (``SMALLEST``) where the architecture has
    one, else its first model not in ``SLOW``. An architecture whose every model is in ``SLOW``
    (SSD300, Keypoint R-CNN, S3D, MViT: 8 to 18 CPU seconds each, audited and plain) has none: its
    kind (detection with targets, video) is tested by the others. ``make test`` runs these;
    ``make sweep`` runs every model."""
    by_architecture: Dict[Tuple[str, str], List[SweepModel]] = {}
    for family in families():
        for e in entries(family):
            by_architecture.setdefault((family, architecture(e)), []).append(e)

    def pick(models: List[SweepModel]) -> Optional[SweepModel]:
        counted = [e for e in models if (e.family, e.name) in MOVES or (e.family, e.name) in SMALLEST]
        return (counted or [e for e in models if (e.family, e.name) not in SLOW] or [None])[0]

    return [e for e in map(pick, by_architecture.values()) if e is not None]


def _built(entry: SweepModel, device: str) -> Tuple[nn.Module, tuple, dict]:
    with torch.device(device):
        return entry.build()


def run(entry: SweepModel, device: Optional[str] = None, seed: int = 0) -> SweepResult:
    """Audits ``entry`` on ``device`` (its own by default): a train step (forward and backward) and
    an eval forward under ``no_grad``; on the CPU each beside a plain run from the same seed
    (:func:`.paired.paired`), on the meta device alone."""
    device = device or entry.device
    start = time.perf_counter()
    if device != "meta":
        # built under the device (a TorchFunctionMode), run outside it: under any such mode
        # torch.nn's Transformer layers leave their fast path, audited or not
        pair = paired(lambda: _built(entry, device), seed)
        seconds = time.perf_counter() - start
        return SweepResult(entry.family, entry.name, pair.train, seconds, pair.eval, pair.differences, pair.ops)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model, args, kwargs = entry.build()
        with torch.enable_grad():
            report = audit(model.train(), *args, backward=True, **kwargs)
        with torch.no_grad():
            evaluated = audit(model.eval(), *args, **kwargs)
    return SweepResult(entry.family, entry.name, report, time.perf_counter() - start, evaluated, None)


def _findings(report: AuditReport) -> str:
    raised = report.error or report.backward_error
    if report.findings:
        verdict = ", ".join(f"{c} x{len(report.by_code(c))}" for c in report.codes)
    else:
        verdict = "clean" if raised is None else "no findings"
    return verdict + (f"; raised: {raised[:60]}" if raised else "")


def _as_plain(differences: Optional[List[str]]) -> str:
    if differences is None:
        return "not compared (meta)"
    return "same bits, same ops" if not differences else f"differs: {'; '.join(differences[:3])[:80]}"


def markdown(rows: List[SweepResult]) -> str:
    """The guide's sweep table: one line per model."""
    lines = [
        "| family | model | train: forward and backward | eval, `no_grad` | audited as plain | moves | ops | modules |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        moves = sum(m.count for m in r.report.moves)
        lines.append(
            f"| {r.family} | {r.name} | {_findings(r.report)} | {_findings(r.eval)} | {_as_plain(r.differences)} "
            f"| {moves} | {r.report.ops} | {r.report.modules} |"
        )
    return "\n".join(lines)
