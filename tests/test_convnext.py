"""A small ConvNeXt (torchvision's block: depthwise conv, channels-last LayerNorm, inverted
bottleneck, layer scale, residual Add; LayerNorm2d in the stem, the downsampling and the head)
with Torch-Pruning's kind of groups zeroed, norm weights and layer scales included: it shrinks
exactly to the model built natively with the kept widths, through every LayerNorm.
"""

from __future__ import annotations

import onnx
import torch
from conftest import export_cached, params, shrink_checked
from torch import nn

from models.zoo import randomize
from onnxshrink.prune import find_groups


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1))

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.pw2(nn.functional.gelu(self.pw1(y))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class TinyConvNeXt(nn.Module):
    """Two stages of widths (c1, c2), one block each with FFN widths (h1, h2)."""

    def __init__(self, c1=8, c2=16, h1=32, h2=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c1, 2, stride=2), LayerNorm2d(c1, eps=1e-6))
        self.stage1 = Block(c1, h1)
        self.down = nn.Sequential(LayerNorm2d(c1, eps=1e-6), nn.Conv2d(c1, c2, 2, stride=2))
        self.stage2 = Block(c2, h2)
        self.head_norm = LayerNorm2d(c2, eps=1e-6)
        self.fc = nn.Linear(c2, 5)

    def forward(self, x):
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.fc(self.head_norm(x).mean((2, 3)))


def zero_half(model: TinyConvNeXt) -> dict[str, int]:
    """Half of every group zeroed, every member (the stream's channels of each stage; each
    block's FFN neurons); the kept widths."""
    c1, c2 = model.stem[0].out_channels, model.down[1].out_channels
    h1, h2 = model.stage1.pw1.out_features, model.stage2.pw1.out_features
    s1, s2 = list(range(0, c1, 2)), list(range(1, c2, 2))
    n1, n2 = list(range(0, h1, 2)), list(range(1, h2, 2))
    with torch.no_grad():
        model.stem[0].weight[s1] = 0
        model.stem[0].bias[s1] = 0
        for norm, cut in ((model.stem[1], s1), (model.down[0], s1), (model.head_norm, s2)):
            norm.weight[cut] = 0
            norm.bias[cut] = 0
        for block, cut, neurons in ((model.stage1, s1, n1), (model.stage2, s2, n2)):
            block.dw.weight[cut] = 0
            block.dw.bias[cut] = 0
            block.norm.weight[cut] = 0
            block.norm.bias[cut] = 0
            block.pw1.weight[:, cut] = 0
            block.pw1.weight[neurons] = 0
            block.pw1.bias[neurons] = 0
            block.pw2.weight[:, neurons] = 0
            block.pw2.weight[cut] = 0
            block.pw2.bias[cut] = 0
            block.layer_scale[cut] = 0
        model.down[1].weight[:, s1] = 0
        model.down[1].weight[s2] = 0
        model.down[1].bias[s2] = 0
        model.fc.weight[:, s2] = 0
    return {"c1": c1 - len(s1), "c2": c2 - len(s2), "h1": h1 - len(n1), "h2": h2 - len(n2)}


def test_a_convnext_with_its_groups_zeroed_shrinks_to_the_native_model(zoo_dir):
    def masked():
        model = randomize(TinyConvNeXt(), seed=1)
        zero_half(model)
        return model, (torch.randn(1, 3, 16, 16),), {}

    kept = zero_half(randomize(TinyConvNeXt(), seed=1))
    path = export_cached(zoo_dir, ("convnext", "masked"), masked)
    native = export_cached(
        zoo_dir, ("convnext", "native"), lambda: (randomize(TinyConvNeXt(**kept), seed=2), (torch.randn(1, 3, 16, 16),), {})
    )
    result = shrink_checked(path)  # validation off; against the masked export in onnxruntime
    assert result.after.params == params(onnx.load(native))
    assert not result.kept_zeroed
    norms = [f for f in result.folds if f.into == "normalization over a zero-padded input"]
    assert sorted(f.channels for f in norms) == [4, 4, 4, 8, 8]  # stem, block 1, down; block 2, head


def test_convnext_groups_are_its_stages_widths_neurons_and_blocks(zoo_dir):
    path = export_cached(
        zoo_dir, ("convnext", "plain"), lambda: (randomize(TinyConvNeXt(), seed=1), (torch.randn(1, 3, 16, 16),), {})
    )
    gset = find_groups(onnx.load(path))
    kinds = sorted((la.kind, len(la.groups), sum(gset.groups[i].exact for i in la.groups)) for la in gset.layers)
    # the input's 3 channels and the 5 classes are the interface
    assert kinds == [
        ("block", 2, 2), ("channel", 3, 0), ("neuron", 5, 0), ("neuron", 32, 32), ("neuron", 64, 64),
        ("width", 8, 8), ("width", 16, 16),
    ]  # fmt: skip
