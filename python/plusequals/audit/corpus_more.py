"""Real bugs of the corpus (:mod:`.corpus`) added for issue 41, each a minimal module or function
with the original's structure (written here, not copied) and a ``fixed`` switch for its twin; the
cases, with their URLs, are in :data:`.corpus.CAUGHT`. Like :mod:`.corpus` it is user code to the
audit (:data:`.frames._HARNESSES`), and imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MlpHead", "Pafpn", "SkConv", "SotrMaskBranch", "ThresholdAt", "XceptionStage", "XceptionUnit"]
__all__ += ["make_grid_fixed", "make_grid_inplace"]


# -- 14. easton-cau/SOTR #19: the mask branch sums its levels into the first level's ReLU output ----
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


# -- 15. open-mmlab/mmdetection #9450: PAFPN's bottom-up path adds into a ConvModule's ReLU output ---
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


# -- 16. pytorch/vision #217: make_grid normalises the caller's tensor in place ----------------------
def make_grid_inplace(tensor: Tensor, normalize: bool = True) -> Tensor:
    if normalize:
        low, high = float(tensor.min()), float(tensor.max())
        tensor.clamp_(min=low, max=high)
        tensor.add_(-low).div_(high - low + 1e-5)
    return torch.cat(list(tensor), dim=-1)


def make_grid_fixed(tensor: Tensor, normalize: bool = True) -> Tensor:
    tensor = tensor.clone()  # the fix: the caller's images stay as they were
    return make_grid_inplace(tensor, normalize)


# -- 17. maxrmorrison/torchcrepe #9: threshold.At masks the caller's pitch in place ------------------
class ThresholdAt:
    def __init__(self, fixed: bool, value: float = 0.5) -> None:
        self.fixed, self.value = fixed, value

    def __call__(self, pitch: Tensor, periodicity: Tensor) -> Tensor:
        if self.fixed:
            pitch = pitch.clone()
        pitch[periodicity < self.value] = float("nan")
        return pitch


# -- 18. osmr/imgclsmob #13: an Xception unit's in-place ReLU overwrites what the identity conv saved
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


# -- 19. aupendu/zero-restore #7: SKConv unsqueezes a branch's ReLU output in place ----------------
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


# -- 20. pytorch/vision #7174: ops.MLP's in-place Dropout overwrites the ReLU's saved output -------
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
