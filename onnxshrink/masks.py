"""Masks in every pruner's format, normalized to {parameter name: 0/1 array}.

The format is detected from the content (`--masks-format` overrides it):

- flat: {"conv1.weight": mask}
- nni: {"conv1": {"weight": mask, "bias": mask}} (NNI's masks dict)
- torch-prune: a state dict of a model pruned with torch.nn.utils.prune ("w_orig" + "w_mask")
- torch-ao: a torch.ao.pruning sparsifier's state_dict() ({"state": {fqn: {"mask"}}, "groups"}),
  or the state dict of a model it prepared ("....parametrizations.weight.0.mask")
- ao-data: a torch.ao data sparsifier's state_dict() (masks of named data, e.g. embeddings)
- dpu: one output-channel mask per layer ({"conv1": {"mask": m}} or {"conv1.mask": m})
- state-dict: masked weights; their zeros are the masks

Besides the masks, `MaskSet.values` holds original weights found in the file (`_orig`,
`original`, a data sparsifier's container, a masked state dict): they let a mask bind by value
when an exporter renamed its initializer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxshrink.errors import ShrinkError
from onnxshrink.io.masks import flatten, load_masks_file, to_numpy
from onnxshrink.options import MASKS_FORMATS

FORMATS = MASKS_FORMATS
_PARAM = re.compile(r"^(?P<module>.+)\.parametrizations\.(?P<param>[^.]+)\.(?:original|0\.mask)$")


@dataclass
class MaskSet:
    masks: dict[str, np.ndarray] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)  # original weights, by name
    optional: set[str] = field(default_factory=set)  # may not exist (a layer without bias)
    format: str = "flat"


def _leaves(obj: object, prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out |= _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        arr = to_numpy(obj)
        if arr is not None:
            out[prefix] = arr
    return out


def _binary(a: np.ndarray) -> bool:
    return a.dtype == bool or (a.size > 0 and bool(np.isin(a, (0, 1)).all()))


def detect(raw: Mapping) -> str:
    keys = set(raw)
    if {"state", "data_groups"} <= keys:
        return "ao-data"
    if {"state", "groups"} <= keys:
        return "torch-ao"
    flat = _leaves(raw)
    if any(k.endswith("_mask") for k in flat) and any(k.endswith("_orig") for k in flat):
        return "torch-prune"
    if any(_PARAM.match(k) for k in flat):
        return "torch-ao"
    if flat and all(k.endswith(".mask") or k == "mask" for k in flat):
        return "dpu"
    if any(isinstance(v, Mapping) for v in raw.values()):
        return "nni"
    if any(_weight_like(v) for v in flat.values()):
        return "state-dict"
    return "flat"


def _weight_like(a: np.ndarray) -> bool:
    """Weights, not a mask with a stray value: several distinct values besides 0 and 1."""
    if not np.issubdtype(a.dtype, np.floating):
        return False
    other = a[(a != 0) & (a != 1)]
    return np.unique(other[:4096]).size >= 3


def load_maskset(masks: str | Path | Mapping, fmt: str = "auto") -> MaskSet:
    """A masks file (read here) or an in-memory dict, in any format, normalized."""
    if isinstance(masks, str | Path):
        return normalize(load_masks_file(masks), fmt, str(masks))
    return normalize(masks, fmt, "masks")


def read_masks(path: str | Path, fmt: str = "auto") -> dict[str, np.ndarray]:
    """{parameter name: mask} from a masks file of any supported format."""
    return load_maskset(path, fmt).masks


def normalize(raw: Mapping, fmt: str = "auto", source: str = "masks") -> MaskSet:
    """A masks file's content as {parameter name: mask}, in whatever format it came."""
    if fmt not in FORMATS:
        raise ShrinkError(f"--masks-format {fmt}: choose one of {', '.join(FORMATS)}.")
    if not isinstance(raw, Mapping) or not raw:
        raise ShrinkError(
            f"{source}: expected a non-empty dict of masks, found {type(raw).__name__}."
        )
    fmt = detect(raw) if fmt == "auto" else fmt
    out = MaskSet(format=fmt)
    if fmt == "torch-ao" and "state" in raw:
        for fqn, st in raw["state"].items():
            if isinstance(st, Mapping) and "mask" in st:
                out.masks[fqn] = _array(fqn, st["mask"], source)
    elif fmt == "ao-data":
        container = _leaves(raw.get("_container", {}))
        for name, st in raw["state"].items():
            if isinstance(st, Mapping) and "mask" in st:
                out.masks[name] = _array(name, st["mask"], source)
                orig = container.get(f"parametrizations.{name}.original")
                if orig is not None:
                    out.values[name] = orig
    else:
        flat = flatten(raw, source)  # every entry must be a tensor or an array
        if fmt == "torch-prune":
            for k, v in flat.items():
                if k.endswith("_mask"):
                    out.masks[k[: -len("_mask")]] = v
                elif k.endswith("_orig"):
                    out.values[k[: -len("_orig")]] = v
        elif fmt == "torch-ao":
            for k, v in flat.items():
                found = _PARAM.match(k)
                if found is None:
                    continue
                name = f"{found['module']}.{found['param']}"
                (out.masks if k.endswith(".mask") else out.values)[name] = v
        elif fmt == "dpu":
            for k, v in flat.items():
                module = k[: -len(".mask")] if k.endswith(".mask") else k
                out.masks[f"{module}.weight"] = v.reshape(-1)
                out.masks[f"{module}.bias"] = v.reshape(-1)
                out.optional.add(f"{module}.bias")
        elif fmt == "state-dict":
            for k, v in flat.items():
                if np.issubdtype(v.dtype, np.floating):
                    out.masks[k] = (v != 0).astype(np.uint8)
                    out.values[k] = v
        else:  # flat, nni
            out.masks = flat
    if not out.masks:
        raise ShrinkError(
            f"{source}: no masks found in it as format '{fmt}'. Name the format with --masks-format."
        )
    for name, mask in out.masks.items():
        check_binary(name, mask, source)
    return out


def weight_values(raw: Mapping, source: str = "weights") -> dict[str, np.ndarray]:
    """The original weights of a `--weights` file by parameter name: a state dict as it is; the
    state dict of a model pruned with torch.nn.utils.prune (`w_orig` with `w_mask`) or prepared
    by a torch.ao sparsifier (`...parametrizations.w.original`) also gives each pruned
    parameter's original values under its own name."""
    flat = flatten(raw, source)
    out = dict(flat)
    for k, v in flat.items():
        if k.endswith("_orig") and k[: -len("_orig")] + "_mask" in flat:
            out.setdefault(k[: -len("_orig")], v)
        found = _PARAM.match(k)
        if found is not None and k.endswith(".original"):
            out.setdefault(f"{found['module']}.{found['param']}", v)
    return out


def _array(name: str, value: object, source: str) -> np.ndarray:
    arr = to_numpy(value)
    if arr is None:
        raise ShrinkError(f"{source}: entry '{name}' is not a tensor or array.")
    return arr


def check_binary(name: str, mask: np.ndarray, source: str) -> None:
    if mask.size and not _binary(mask):
        bad = mask[~np.isin(mask, (0, 1))].reshape(-1)[0]
        raise ShrinkError(
            f"{source}: mask '{name}' holds {bad.item()!r}; masks must be 0/1 (or boolean). If "
            "these are masked weights rather than masks, use --masks-format state-dict."
        )
