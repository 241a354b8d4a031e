"""Real in-place and aliasing bugs from public issues and pull requests, each a minimal module with
the original's structure (written here, not copied), its fixed twin and its URL, grouped by what
the bug does: a write into the caller's tensor (E0596), into a tensor autograd saved (E0502), a
read of a tensor an in-place op overwrote (E0382), two names for one tensor (E0499). Each
:data:`CAUGHT` case must be found with its code at the line its fix changed or at the read that
broke (:attr:`Case.line`), its fixed twin silent (``tests/test_audit_corpus.py``); :data:`MISSED`
would hold those missed. The guide's table (``scripts/audit_tables.py``) runs the same cases. To the
audit these modules are user code: it reports their lines.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..auditing import AuditReport, Finding, audit
from ..auditing.frames import short_path

__all__ = ["CAUGHT", "MISSED", "Case", "Result", "expected_line", "markdown", "results", "run_case"]


class Case(NamedTuple):
    name: str
    url: str
    pattern: str  # what the bug does, in a few words
    build: Callable[[bool], object]  # build(fixed) -> the module (or function) to audit
    inputs: Callable[[torch.Generator], Tuple[tuple, dict]]
    training: bool  # audited with grad and backward (else under no_grad)
    code: Optional[str]  # the code it must give (None: a missed bug, see MISSED)
    line: Tuple[object, str]  # (class or function, text on the line): where, or read_at for E0382


def _img(*shape: int) -> Callable[[torch.Generator], Tuple[tuple, dict]]:
    return lambda g: ((torch.randn(*shape, generator=g),), {})


# ==================================================================================================
# Writes into the caller's tensor (E0596): a module or function changes an input it was given
# ==================================================================================================


# -- NVIDIA/earth2studio #1133: StormCast writes each step back into the caller's tensor --------
class StormCastStep(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.net = nn.Conv2d(4, 2, 1)

    def forward(self, x: Tensor, conditioning: Tensor) -> Tensor:
        if self.fixed:
            x = x.clone()
        for k in range(x.shape[1]):
            x[:, k : k + 1] = self.net(torch.cat([x, conditioning], 1))[:, :1]
        return x


# -- huggingface/transformers #47741: a QA head clamps the caller's label tensors in place ------
class QaHead(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.qa_outputs = nn.Linear(8, 2)

    def forward(self, hidden: Tensor, start_positions: Tensor, end_positions: Tensor) -> Tensor:
        start_logits, end_logits = self.qa_outputs(hidden).unbind(-1)
        ignored_index = start_logits.size(1)
        if self.fixed:
            start_positions = start_positions.clamp(0, ignored_index)
            end_positions = end_positions.clamp(0, ignored_index)
        else:
            start_positions.clamp_(0, ignored_index)
            end_positions.clamp_(0, ignored_index)
        loss = F.cross_entropy(start_logits, start_positions, ignore_index=ignored_index)
        return (loss + F.cross_entropy(end_logits, end_positions, ignore_index=ignored_index)) / 2


def _qa_inputs(g: torch.Generator) -> Tuple[tuple, dict]:
    return (torch.randn(2, 5, 8, generator=g), torch.tensor([1, 9999]), torch.tensor([3, 9999])), {}


# -- huggingface/transformers #47741: CTRL scales the caller's inputs_embeds in place ----------
class CtrlEmbed(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed, self.d_model = fixed, 8
        self.w, self.layer = nn.Embedding(11, 8), nn.Linear(8, 8)

    def forward(self, input_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None) -> Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.w(input_ids)
        if self.fixed:
            inputs_embeds = inputs_embeds * math.sqrt(self.d_model)
        else:
            inputs_embeds *= math.sqrt(self.d_model)
        return self.layer(inputs_embeds)


# -- pytorch/vision #517: transforms' normalize subtracted and divided in place ----------------
def normalize_inplace(tensor: Tensor, mean: List[float], std: List[float]) -> Tensor:
    for t, m, s in zip(tensor, mean, std):
        t.sub_(m).div_(s)
    return tensor


def normalize_fixed(tensor: Tensor, mean: List[float], std: List[float]) -> Tensor:
    return (tensor - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def _normalize_inputs(g: torch.Generator) -> Tuple[tuple, dict]:
    return (torch.rand(3, 4, 4, generator=g), [0.5, 0.4, 0.3], [0.2, 0.2, 0.2]), {}


# -- pytorch/vision #217: make_grid normalises the caller's tensor in place ----------------------
def make_grid_inplace(tensor: Tensor, normalize: bool = True) -> Tensor:
    if normalize:
        low, high = float(tensor.min()), float(tensor.max())
        tensor.clamp_(min=low, max=high)
        tensor.add_(-low).div_(high - low + 1e-5)
    return torch.cat(list(tensor), dim=-1)


def make_grid_fixed(tensor: Tensor, normalize: bool = True) -> Tensor:
    tensor = tensor.clone()  # the fix: the caller's images stay as they were
    return make_grid_inplace(tensor, normalize)


# -- maxrmorrison/torchcrepe #9: threshold.At masks the caller's pitch in place ------------------
class ThresholdAt:
    def __init__(self, fixed: bool, value: float = 0.5) -> None:
        self.fixed, self.value = fixed, value

    def __call__(self, pitch: Tensor, periodicity: Tensor) -> Tensor:
        if self.fixed:
            pitch = pitch.clone()
        pitch[periodicity < self.value] = float("nan")
        return pitch


# ==================================================================================================
# Writes into a tensor autograd saved (E0502): the backward would read the overwritten values
# ==================================================================================================


# -- pytorch/vision #807: the ReLU moved before the residual add ------------------------------
class PreActOrderBlock(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.fixed:
            out += identity
            return self.relu(out)
        out = self.relu(out)
        out += identity  # ReluBackward0 saved `out`
        return out


# -- lzx1413/PytorchSSD #72: L2Norm divides its input in place -------------------------------
class L2Norm(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.weight = nn.Parameter(torch.full((4,), 20.0))

    def forward(self, x: Tensor) -> Tensor:
        norm = x.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10
        if self.fixed:
            x = x / norm
        else:
            x /= norm  # pow saved x
        return self.weight[None, :, None, None] * x


class SsdSources(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.vgg = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True))
        self.l2norm, self.extra = L2Norm(fixed), nn.Conv2d(4, 4, 3, stride=2, padding=1)

    def forward(self, image: Tensor) -> Tensor:
        x = self.vgg(image)
        source = self.l2norm(x)
        x = self.extra(x)
        return source.sum() + x.sum()


# -- lyongo/NWPU-MOC #4: an FPN adds the upsampled level into a ReLU's output in place ---------
class FpnTopDown(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.lateral = nn.ModuleList([nn.Conv2d(4, 4, 1) for _ in range(3)])

    def forward(self, c2: Tensor, c3: Tensor, c4: Tensor) -> Tensor:
        laterals = [F.relu(conv(c)) for conv, c in zip(self.lateral, (c2, c3, c4))]
        for i in range(len(laterals) - 1, 0, -1):
            up = F.interpolate(laterals[i], size=laterals[i - 1].shape[2:], mode="nearest")
            if self.fixed:
                laterals[i - 1] = laterals[i - 1] + up
            else:
                laterals[i - 1] += up  # ReluBackward0 saved laterals[i - 1]
        return sum(t.sum() for t in laterals)


def _fpn_inputs(g: torch.Generator) -> Tuple[tuple, dict]:
    return tuple(torch.randn(2, 4, s, s, generator=g) for s in (16, 8, 4)), {}


# -- Jee-King/TSAN #3: `out = x` then slice assignments into out (the fix: x.clone()) -------
class CrossSplit(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.conv1 = nn.Conv2d(16, 16, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h, w = x.size(2) // 2, x.size(3) // 2
        quarters = [x[:, :, :h, :w], x[:, :, h:, :w], x[:, :, :h, w:], x[:, :, h:, w:]]
        f_all = self.conv1(torch.cat(quarters, 1))
        out = x.clone() if self.fixed else x
        out[:, :, :h, :w] = f_all[:, :4]  # x was saved by the other branch's conv
        out[:, :, h:, :w] = f_all[:, 4:8]
        out[:, :, :h, w:] = f_all[:, 8:12]
        out[:, :, h:, w:] = f_all[:, 12:]
        return out


class TsanBranch(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.first, self.drb, self.csb = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 3, padding=1), CrossSplit(fixed)

    def forward(self, image: Tensor) -> Tensor:
        x = self.first(image)
        down = self.drb(x)
        top = self.csb(x)
        return down * torch.sigmoid(top)


# -- j-sripad/mulitresunet-pytorch #3: ResPath adds the shortcut into a ReLU's output --------
class ConvBnAct(nn.Module):
    def __init__(self, relu: bool) -> None:
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False), relu

    def forward(self, x: Tensor) -> Tensor:
        x = self.bn(self.conv(x))
        return F.relu(x) if self.relu else x


class ResPath(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.shortcut_conv, self.conv, self.bn = ConvBnAct(False), ConvBnAct(True), nn.BatchNorm2d(4, affine=False)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = self.shortcut_conv(x)
        x = self.conv(x)
        if self.fixed:
            x = x + shortcut
        else:
            x += shortcut  # ReluBackward0 saved x
        return self.bn(F.relu(x))


# -- easton-cau/SOTR #19: the mask branch sums its levels into the first level's ReLU output ----
class ConvGnRelu(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU())


class SotrMaskBranch(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.convs_all_levels = nn.ModuleList([ConvGnRelu() for _ in range(3)])

    def forward(self, p2: Tensor, p3: Tensor, p4: Tensor) -> Tensor:
        feature_add_all_level = self.convs_all_levels[0](p2)
        for i, feature in enumerate((p3, p4), start=1):
            mask_feat = F.interpolate(self.convs_all_levels[i](feature), size=p2.shape[2:], mode="nearest")
            if self.fixed:
                feature_add_all_level = feature_add_all_level + mask_feat
            else:
                feature_add_all_level += mask_feat  # ReluBackward0 saved the first level's output
        return feature_add_all_level


# -- open-mmlab/mmdetection #9450: PAFPN's bottom-up path adds into a ConvModule's ReLU output ---
class Pafpn(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.fpn_convs = nn.ModuleList([nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()) for _ in range(3)])
        self.downsample_convs = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU()) for _ in range(2)]
        )

    def forward(self, c2: Tensor, c3: Tensor, c4: Tensor) -> Tensor:
        inter_outs = [conv(c) for conv, c in zip(self.fpn_convs, (c2, c3, c4))]
        for i in range(len(inter_outs) - 1):
            if self.fixed:
                inter_outs[i + 1] = inter_outs[i + 1] + self.downsample_convs[i](inter_outs[i])
            else:
                inter_outs[i + 1] += self.downsample_convs[i](inter_outs[i])  # ReluBackward0 saved it
        return sum(t.sum() for t in inter_outs)


# -- osmr/imgclsmob #13: an Xception unit's in-place ReLU overwrites what the identity conv saved
class XceptionUnit(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.identity_conv = nn.Conv2d(4, 4, 1, stride=2)
        self.body = nn.Sequential(
            nn.ReLU(inplace=not fixed), nn.Conv2d(4, 4, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1)
        )

    def forward(self, x: Tensor) -> Tensor:
        identity = self.identity_conv(x)
        x = self.body(x)  # its first ReLU writes into x, which the identity conv saved
        return x + identity


class XceptionStage(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.init, self.unit = nn.Conv2d(3, 4, 3, padding=1), XceptionUnit(fixed)

    def forward(self, x: Tensor) -> Tensor:
        return self.unit(self.init(x))


# -- aupendu/zero-restore #7: SKConv unsqueezes a branch's ReLU output in place ----------------
class SkConv(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.convs = nn.ModuleList([nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()) for _ in range(2)])
        self.fc = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        feas = []
        for conv in self.convs:
            if self.fixed:
                fea = conv(x).clone().unsqueeze_(dim=1)
            else:
                fea = conv(x).unsqueeze_(dim=1)  # a metadata-only write: the version still moves
            feas.append(fea)
        feas_ = torch.cat(feas, dim=1)
        attention = torch.softmax(self.fc(feas_.sum(1).mean((-1, -2))), dim=1)
        return (feas_ * attention[:, :, None, None, None]).sum(1)


# -- pytorch/vision #7174: ops.MLP's in-place Dropout overwrites the ReLU's saved output -------
class OpsMlp(nn.Sequential):
    def __init__(self, fixed: bool) -> None:
        inplace = not fixed
        super().__init__(nn.Linear(3, 3), nn.ReLU(inplace=inplace), nn.Dropout(0.5, inplace=inplace), nn.Linear(3, 3))


class MlpHead(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.mlp = OpsMlp(fixed)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x)  # the MLP's Dropout writes into what its ReLU saved


# ==================================================================================================
# Reads a tensor an in-place op overwrote (E0382): the input was moved into the op
# ==================================================================================================


# -- rosinality/vq-vae-2-pytorch: ReLU(inplace=True) first in the residual stack ---------------
class VqvaeResBlock(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.ReLU(inplace=not fixed), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 1)
        )

    def forward(self, input: Tensor) -> Tensor:
        out = self.conv(input)
        out += input  # the skip reads the input the first ReLU overwrote
        return out


class VqvaeEncoder(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.conv_in, self.res = nn.Conv2d(3, 4, 3, padding=1), VqvaeResBlock(fixed)

    def forward(self, x: Tensor) -> Tensor:
        return self.res(self.conv_in(x))


# -- mapillary/inplace_abn #40: an Xception block whose rep starts with an in-place ReLU -------
class XceptionBlock(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=not fixed)
        self.rep = nn.Sequential(self.relu, nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.Conv2d(4, 4, 1))

    def forward(self, inp: Tensor) -> Tensor:
        x = self.rep(inp)
        skip = inp  # the identity skip: `inp` was overwritten by the rep's first ReLU
        x += skip
        return x


class XceptionEntry(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.stem, self.block = nn.Conv2d(3, 4, 3, padding=1), XceptionBlock(fixed)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(self.stem(x))


# -- thomasjpfan/pytorch_refinenet #2: the residual conv unit's first ReLU is in place --------
class ResidualConvUnit(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(x) if self.fixed else self.relu(x)
        out = self.conv2(self.relu(self.conv1(out)))
        return out + x  # reads x, which the first ReLU overwrote


class RefineStage(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.proj, self.rcu = nn.Conv2d(3, 4, 1), ResidualConvUnit(fixed)

    def forward(self, x: Tensor) -> Tensor:
        return self.rcu(self.proj(x))


# ==================================================================================================
# Two names for one tensor (E0499): a write through one is a write through the other
# ==================================================================================================


# -- huggingface/diffusers #3234: two names for one tensor in one function --------------------
class ControlNetResiduals(nn.Module):
    """diffusers PR #3234: the last down-block residual is the same tensor as ``sample``; adding
    the ControlNet residual in place to it also changes the mid block's input."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.down, self.mid = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, sample: Tensor, residuals: Tuple[Tensor, ...]) -> Tensor:
        sample = self.down(sample)
        res_samples = (sample,)
        new = ()
        for res, extra in zip(res_samples, residuals):
            if self.fixed:
                res = res + extra
            else:
                res += extra  # `res` is also `sample`
            new += (res,)
        return self.mid(sample) + new[0]


CAUGHT: Tuple[Case, ...] = (
    # Writes into the caller's tensor (E0596)
    Case(
        "earth2studio StormCast",
        "https://github.com/NVIDIA/earth2studio/issues/1133",
        "each step is written back into the caller's input tensor (fix: `x = x.clone()`)",
        StormCastStep,
        lambda g: ((torch.randn(2, 2, 4, 4, generator=g), torch.randn(2, 2, 4, 4, generator=g)), {}),
        False,
        "E0596",
        (StormCastStep, "x[:, k : k + 1] ="),
    ),
    Case(
        "transformers QA head (canine, luke, ...)",
        "https://github.com/huggingface/transformers/issues/47741",
        "`start_positions.clamp_(...)` rewrites the caller's label tensor",
        QaHead,
        _qa_inputs,
        False,
        "E0596",
        (QaHead, "start_positions.clamp_("),
    ),
    Case(
        "transformers CTRL inputs_embeds",
        "https://github.com/huggingface/transformers/issues/47741",
        "`inputs_embeds *= sqrt(d_model)` scales the caller's embeddings",
        CtrlEmbed,
        lambda g: ((), {"inputs_embeds": torch.randn(2, 3, 8, generator=g)}),
        False,
        "E0596",
        (CtrlEmbed, "inputs_embeds *= math.sqrt"),
    ),
    Case(
        "torchvision normalize",
        "https://github.com/pytorch/vision/issues/517",
        "`t.sub_(mean).div_(std)` on the caller's image",
        lambda fixed: normalize_fixed if fixed else normalize_inplace,
        _normalize_inputs,
        False,
        "E0596",
        (normalize_inplace, "t.sub_(m).div_(s)"),
    ),
    Case(
        "torchvision make_grid",
        "https://github.com/pytorch/vision/issues/217",
        "`normalize=True` clamps and rescales the caller's images in place (fix: clone first)",
        lambda fixed: make_grid_fixed if fixed else make_grid_inplace,
        _img(2, 3, 4, 4),
        False,
        "E0596",
        (make_grid_inplace, "tensor.clamp_(min=low, max=high)"),
    ),
    Case(
        "torchcrepe threshold.At",
        "https://github.com/maxrmorrison/torchcrepe/issues/9",
        "`pitch[periodicity < value] = nan` masks the caller's pitch tensor (fix: clone first)",
        ThresholdAt,
        lambda g: ((torch.rand(2, 8, generator=g) * 400, torch.rand(2, 8, generator=g)), {}),
        False,
        "E0596",
        (ThresholdAt, "pitch[periodicity < self.value] ="),
    ),
    # Writes into a tensor autograd saved (E0502)
    Case(
        "torchvision ResNet, ReLU before the add",
        "https://github.com/pytorch/vision/issues/807",
        "`out = self.relu(out); out += identity`: the in-place add overwrites what ReLU saved",
        PreActOrderBlock,
        _img(2, 4, 8, 8),
        True,
        "E0502",
        (PreActOrderBlock, "out += identity  # ReluBackward0"),
    ),
    Case(
        "SSD L2Norm",
        "https://github.com/lzx1413/PytorchSSD/issues/72",
        "`x /= norm` overwrites the input that `pow` saved (and that the next layer reads)",
        SsdSources,
        _img(2, 3, 8, 8),
        True,
        "E0502",
        (L2Norm, "x /= norm"),
    ),
    Case(
        "FPN top-down (NWPU-MOC)",
        "https://github.com/lyongo/NWPU-MOC/issues/4",
        "`laterals[i - 1] += F.interpolate(...)` into a ReLU's saved output",
        FpnTopDown,
        _fpn_inputs,
        True,
        "E0502",
        (FpnTopDown, "laterals[i - 1] += up"),
    ),
    Case(
        "TSAN cross-split block",
        "https://github.com/Jee-King/TSAN/issues/3",
        "`out = x` then slice assignments into `out`, whose input another branch's conv saved",
        TsanBranch,
        _img(2, 3, 8, 8),
        True,
        "E0502",
        (CrossSplit, "out[:, :, :h, :w] = f_all[:, :4]"),
    ),
    Case(
        "MultiResUNet ResPath",
        "https://github.com/j-sripad/mulitresunet-pytorch/issues/3",
        "`x += shortcut` into the output of a ReLU that saved it",
        ResPath,
        _img(2, 4, 8, 8),
        True,
        "E0502",
        (ResPath, "x += shortcut  # ReluBackward0"),
    ),
    Case(
        "SOTR mask branch",
        "https://github.com/easton-cau/SOTR/issues/19",
        "`feature_add_all_level += ...` into the first level's ReLU output, which ReLU saved",
        SotrMaskBranch,
        _fpn_inputs,
        True,
        "E0502",
        (SotrMaskBranch, "feature_add_all_level += mask_feat"),
    ),
    Case(
        "mmdetection PAFPN bottom-up path",
        "https://github.com/open-mmlab/mmdetection/pull/9450",
        "`inter_outs[i + 1] += downsample(inter_outs[i])` into a ConvModule's ReLU output",
        Pafpn,
        _fpn_inputs,
        True,
        "E0502",
        (Pafpn, "inter_outs[i + 1] += self.downsample_convs[i]"),
    ),
    Case(
        "imgclsmob Xception unit",
        "https://github.com/osmr/imgclsmob/issues/13",
        "the body's first `nn.ReLU(inplace=True)` overwrites the input the identity conv saved",
        XceptionStage,
        _img(2, 3, 8, 8),
        True,
        "E0502",
        (XceptionUnit, "x = self.body(x)"),
    ),
    Case(
        "zero-restore SKConv",
        "https://github.com/aupendu/zero-restore/issues/7",
        "`conv(x).unsqueeze_(dim=1)`: a metadata-only in-place op on a ReLU output ReLU saved",
        SkConv,
        _img(2, 1, 8, 8),
        True,
        "E0502",
        (SkConv, "fea = conv(x).unsqueeze_(dim=1)"),
    ),
    Case(
        "torchvision ops.MLP dropout",
        "https://github.com/pytorch/vision/issues/7174",
        "`nn.Dropout(inplace=True)` after `nn.ReLU(inplace=True)` overwrites what ReLU saved",
        MlpHead,
        lambda g: ((torch.rand(4, 3, generator=g),), {}),
        True,
        "E0502",
        (MlpHead, "return self.mlp(x)"),
    ),
    # Reads a tensor an in-place op overwrote (E0382)
    Case(
        "VQ-VAE-2 ResBlock",
        "https://github.com/rosinality/vq-vae-2-pytorch/issues/60",
        "`nn.ReLU(inplace=True)` first in the residual stack; the skip reads the overwritten input",
        VqvaeEncoder,
        _img(2, 3, 8, 8),
        False,
        "E0382",
        (VqvaeResBlock, "out += input"),
    ),
    Case(
        "Xception block (inplace_abn)",
        "https://github.com/mapillary/inplace_abn/issues/40",
        "the rep's first `nn.ReLU(inplace=True)` overwrites the block input kept for the identity skip",
        XceptionEntry,
        _img(2, 3, 8, 8),
        False,
        "E0382",
        (XceptionBlock, "skip = inp"),
    ),
    Case(
        "RefineNet residual conv unit",
        "https://github.com/thomasjpfan/pytorch_refinenet/issues/2",
        "the unit's first `nn.ReLU(inplace=True)` overwrites `x`, which `return out + x` reads",
        RefineStage,
        _img(2, 3, 8, 8),
        False,
        "E0382",
        (ResidualConvUnit, "return out + x"),
    ),
    # Two names for one tensor (E0499)
    Case(
        "diffusers ControlNet residuals",
        "https://github.com/huggingface/diffusers/pull/3234",
        "`down_block_res_sample += residual` also writes `sample`, the mid block's input",
        ControlNetResiduals,
        lambda g: ((torch.randn(2, 4, 8, 8, generator=g), (torch.randn(2, 4, 8, 8, generator=g),)), {}),
        False,
        "E0499",
        (ControlNetResiduals, "res += extra"),
    ),
)


MISSED: Tuple[Case, ...] = ()  # real bugs the audit misses: none found (zero-restore's `unsqueeze_` is E0502)


def expected_line(case: Case) -> str:
    """``path:line`` of the line the case names, as the audit writes it."""
    obj, text = case.line
    src, start = inspect.getsourcelines(obj)
    offset = next(i for i, s in enumerate(src) if text in s)
    return f"{short_path(inspect.getsourcefile(obj) or '')}:{start + offset}"


def run_case(case: Case, fixed: bool, seed: int = 0) -> AuditReport:
    """Audits the bug (or its fixed twin) once, as the original ran: training (forward and
    backward) or under ``no_grad``."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = case.build(fixed)
    if isinstance(model, nn.Module):
        model.train(case.training)
    args, kwargs = case.inputs(g)
    with torch.enable_grad() if case.training else torch.no_grad():
        return audit(model, *args, backward=case.training, **kwargs)


class Result(NamedTuple):
    case: Case
    bug: AuditReport
    fixed: AuditReport

    @property
    def hit(self) -> Optional[Finding]:
        """The finding with the case's code at the case's line (``read_at`` for ``E0382``)."""
        want = expected_line(self.case)
        for f in self.bug.by_code(self.case.code or ""):
            if (f.read_at if f.code == "E0382" else f.where) == want:
                return f
        return None


def results(cases: Tuple[Case, ...] = CAUGHT) -> List[Result]:
    return [Result(c, run_case(c, False), run_case(c, True)) for c in cases]


def _codes(report: AuditReport) -> str:
    return ", ".join(f"{c} x{len(report.by_code(c))}" for c in report.codes) or "clean"


def markdown(rows: List[Result]) -> str:
    """The README's corpus table."""
    lines = [
        "| bug | source | what it does | the audit (bug) | at | fixed twin |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        hit = r.hit
        at = "missed" if hit is None else f"{hit.code} at `{hit.read_at if hit.code == 'E0382' else hit.where}`"
        source = r.case.url.replace("https://github.com/", "").replace("/issues/", "#").replace("/pull/", "#")
        fixed = _codes(r.fixed) + (f", {len(r.fixed.moves)} moves" if r.fixed.moves else "")
        lines.append(
            f"| {r.case.name} | [{source}]({r.case.url}) | {r.case.pattern} | {_codes(r.bug)} | {at} | {fixed} |"
        )
    return "\n".join(lines)
