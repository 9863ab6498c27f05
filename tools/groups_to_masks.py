"""Masks for a framework's model from onnxshrink's groups.json, by a simple L1 rule.

    onnxshrink model.onnx --groups groups.json
    python tools/groups_to_masks.py groups.json --torch state_dict.pt -o masks.pt     # PyTorch
    python tools/groups_to_masks.py groups.json --onnx model.onnx -o masks.npz        # any exporter

Per layer, the `--fraction` exact groups with the smallest L1 over their members lose every
member's slice. With `--torch`, members are named by the state_dict parameters the exporter
recorded (`params`, in torch's layout) or by their initializer name when it is a state_dict
name; the masks are torch tensors of the parameters' shapes (apply them with
`torch.nn.utils.prune.custom_from_mask` or by multiplying). With `--onnx` (e.g. a Keras model
exported with tf2onnx: its initializers are the TensorFlow variables, already in the layout
ONNX reads), members are named by initializer and the masks are numpy arrays; `onnxshrink
model.onnx masks.npz --unmasked-input -o small.onnx` then applies and shrinks them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def choose(groups: dict, values: dict[str, np.ndarray], names, fraction: float) -> list[dict]:
    by_id = {g["id"]: g for g in groups["groups"]}
    chosen = []
    for layer in groups["layers"]:
        exact = [by_id[i] for i in layer["groups"] if by_id[i]["exact"]]

        def l1(g: dict) -> float:
            return sum(
                float(np.abs(np.take(values[n], m["indices"], axis=a)).sum())
                for m in g["members"]
                for n, a in names(m)
            )

        chosen += sorted(exact, key=l1)[: int(len(exact) * fraction)]
    return chosen


def masks_for(chosen: list[dict], values: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
    masks: dict[str, np.ndarray] = {}
    for g in chosen:
        for m in g["members"]:
            for n, a in names(m):
                mask = masks.setdefault(n, np.ones(values[n].shape, np.float32))
                index = [slice(None)] * mask.ndim
                index[a] = m["indices"]
                mask[tuple(index)] = 0
    return masks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--torch", metavar="STATE_DICT.pt", help="a PyTorch state_dict")
    src.add_argument("--onnx", metavar="MODEL.onnx", help="the ONNX model itself (any exporter)")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args()
    groups = json.loads(Path(args.groups).read_text())
    if args.torch:
        import torch

        state = torch.load(args.torch, weights_only=True)
        values = {k: v.numpy() for k, v in state.items() if v.is_floating_point()}

        def names(m: dict) -> list[tuple[str, int]]:
            found = [(q["name"], q["axis"]) for q in m["params"] if q["name"] in values]
            if not found and m["initializer"] in values:
                found = [(m["initializer"], m["axis"])]
            return found
    else:
        import onnx
        from onnx import numpy_helper

        model = onnx.load(args.onnx)
        values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}

        def names(m: dict) -> list[tuple[str, int]]:
            return [(m["initializer"], m["axis"])] if m["initializer"] in values else []

    chosen = choose(groups, values, names, args.fraction)
    masks = masks_for(chosen, values, names)
    if args.torch:
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in masks.items()}, args.output)
    else:
        np.savez(args.output, **masks)
    print(f"{len(chosen)} group(s) chosen; masks for {len(masks)} parameter(s) written to {args.output}")


if __name__ == "__main__":
    main()
