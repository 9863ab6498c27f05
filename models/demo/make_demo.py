"""Write the README's demo: a small ResNet as ONNX plus the masks a structured pruner made for it.

    python models/demo/make_demo.py

The masks zero 50% of the filters of every convolution, chosen per channel group (a residual
stage's channels are pruned alike in every conv that writes them, as DepGraph/Torch-Pruning
groups do), and leave the BatchNorms alone, as NNI's L1NormPruner or
torch.nn.utils.prune.ln_structured do. After the exporter folds BatchNorm into the convs, a
pruned channel is not zero but BatchNorm's shift: onnxshrink removes it and folds the constant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from models.zoo import ResNet, choose_kept, export, randomize, zero_groups  # noqa: E402


def main() -> None:
    model = randomize(ResNet(block="basic", layers=(2, 2, 2), base=16), seed=7)
    probe = randomize(ResNet(block="basic", layers=(2, 2, 2), base=16), seed=7)
    masks = zero_groups(probe, choose_kept(probe, 0.5, seed=11))
    conv_masks = {
        name: m.bool()
        for name, m in masks.items()
        if isinstance(model.get_submodule(name.rsplit(".", 1)[0]), torch.nn.Conv2d)
    }
    export(model, HERE / "resnet_demo.onnx", (1, 3, 32, 32))
    torch.save(conv_masks, HERE / "resnet_demo_masks.pt")
    print(f"wrote {HERE / 'resnet_demo.onnx'} and {len(conv_masks)} masks")


if __name__ == "__main__":
    main()
