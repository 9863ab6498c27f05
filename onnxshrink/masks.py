"""Masks in every pruner's format, normalized to {parameter name: 0/1 array}.

The format is detected from the content (`--masks-format` overrides it):

- flat: {"conv1.weight": mask}
- nni: {"conv1": {"weight": mask, "bias": mask}} (NNI's masks dict)
- nni-wrapped: the state dict of a model NNI 3's pruner wrapped ("m._nni_wrapper.w" + "..w_mask")
- torch-prune: a state dict of a model pruned with torch.nn.utils.prune ("w_orig" + "w_mask")
- torch-ao: a torch.ao.pruning sparsifier's state_dict() ({"state": {fqn: {"mask"}}, "groups"}),
  or the state dict of a model it prepared ("....parametrizations.weight.0.mask")
- ao-data: a torch.ao data sparsifier's state_dict() (masks of named data, e.g. embeddings)
- dpu: one output-channel mask per layer ({"conv1": {"mask": m}} or {"conv1.mask": m})
- state-dict: masked weights; their zeros are the masks

Besides the masks, `MaskSet.values` holds original weights found in the file (`_orig`,
`original`, a data sparsifier's container, a masked state dict): they let a mask bind by value
when an exporter renamed its initializer.

Files are read lazily (see onnxshrink.io.masks): each mask is read once, checked and reduced
(`compact`: a full-size mask that is one flag per slice of an axis, as a channel pruner writes it,
is kept as those flags) before the next is read; values are references, read when the binding
asks for them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxshrink.errors import ShrinkError
from onnxshrink.io.masks import Leaf, as_leaf, leaves, load_masks_file
from onnxshrink.options import MASKS_FORMATS

ONNX_SECTION = "onnx/"  # --masks-out's section of ONNX tensors the framework has no name for
_PARAM = re.compile(r"^(?P<module>.+)\.parametrizations\.(?P<param>[^.]+)\.(?:original|0\.mask)$")
# NNI 3's ModuleWrapper keeps a wrapped module's parameter and its mask under `_nni_wrapper`.
_NNI_WRAPPED = re.compile(r"^(?:(?P<module>.+)\.)?_nni_wrapper\.(?P<param>[^.]+?)(?P<mask>_mask)?$")


class Values(Mapping[str, np.ndarray]):
    """Weights by name, each read from its file when looked up (not kept): `--weights` and the
    original values in a masks file are used only for the few masks that bind by value."""

    def __init__(self, items: Mapping[str, Any] | None = None):
        self.leaves: dict[str, Leaf] = {}
        for k, v in (items or {}).items():
            leaf = as_leaf(v)
            if leaf is not None:
                self.leaves[k] = leaf

    def __getitem__(self, key: str) -> np.ndarray:
        return self.leaves[key].read()

    def __iter__(self) -> Iterator[str]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)

    def __setitem__(self, key: str, value: Any) -> None:
        leaf = as_leaf(value)
        if leaf is None:
            raise TypeError(f"{key}: not a tensor or array")
        self.leaves[key] = leaf

    def setdefault(self, key: str, value: Any) -> None:
        if key not in self.leaves:
            self[key] = value


class Chain(Mapping[str, np.ndarray]):
    """Several mappings looked up in order (the first that holds a name gives it), none merged:
    a lookup reads one value (see `Values`)."""

    def __init__(self, *maps: Mapping[str, np.ndarray]):
        self.maps = list(maps)

    def __getitem__(self, key: str) -> np.ndarray:
        for m in self.maps:
            if key in m:
                return m[key]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return any(key in m for m in self.maps)

    def __iter__(self) -> Iterator[str]:
        seen: set[str] = set()
        for m in self.maps:
            for k in m:
                if k not in seen:
                    seen.add(k)
                    yield k

    def __len__(self) -> int:
        return len(set().union(*self.maps))


def value_shape(values: Mapping[str, np.ndarray], name: str) -> tuple[int, ...] | None:
    """The shape of `values[name]` without reading it (`Values`, or a `Chain` of mappings)."""
    for m in getattr(values, "maps", [values]):
        if name in m:
            if isinstance(m, Values):
                return m.leaves[name].shape
            return tuple(np.shape(m[name]))
    return None


@dataclass
class MaskSet:
    masks: dict[str, np.ndarray] = field(default_factory=dict)
    values: Mapping[str, np.ndarray] = field(default_factory=Values)  # original weights, by name
    optional: set[str] = field(default_factory=set)  # may not exist (a layer without bias)
    format: str = "flat"


def _leaves(obj: object, prefix: str = "") -> dict[str, Leaf]:
    """Every tensor under `obj` by dotted name (entries that are not tensors skipped), unread."""
    out: dict[str, Leaf] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out |= _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        leaf = as_leaf(obj)
        if leaf is not None:
            out[prefix] = leaf
    return out


def core(a: np.ndarray) -> np.ndarray:
    """A broadcast view's distinct values: the axes it repeats (stride 0) taken once."""
    if 0 not in a.strides:
        return a
    return a[tuple(slice(0, 1) if st == 0 else slice(None) for st in a.strides)]


def _binary(a: np.ndarray) -> bool:
    a = core(a)
    return a.dtype == bool or (a.size > 0 and bool(np.isin(a, (0, 1)).all()))


def compact(mask: np.ndarray) -> np.ndarray:
    """A checked 0/1 mask as uint8, in as little memory as its structure allows: a mask that is
    constant along every axis but one (one flag per slice of that axis, as a channel pruner
    writes it at full size) is a read-only broadcast view of those flags; any other is a copy
    (never a view of the file it was read from, which is let go)."""
    m = core(mask)
    m = m if m.dtype == bool else m != 0
    if m.ndim >= 2 and m.size:
        for axis in range(m.ndim):
            others = tuple(a for a in range(m.ndim) if a != axis)
            some, every = m.any(axis=others), m.all(axis=others)
            if np.array_equal(some, every):  # each slice all 0 or all 1
                flags = some.astype(np.uint8).reshape([-1 if a == axis else 1 for a in range(m.ndim)])
                return np.broadcast_to(flags, mask.shape)
    if m.shape != mask.shape:
        return np.broadcast_to(m.astype(np.uint8), mask.shape)
    return m.astype(np.uint8)


def read_mask(name: str, value: object, source: str) -> np.ndarray:
    """One mask, read from its file, checked (0/1) and compacted; its pages let go."""
    leaf = as_leaf(value)
    if leaf is None:
        raise ShrinkError(f"{source}: entry '{name}' is not a tensor or array.")
    arr = leaf.read()
    try:
        check_binary(name, arr, source)
        return compact(arr)
    finally:
        leaf.done(arr)


def detect(raw: Mapping[str, Any]) -> str:
    keys = set(raw)
    if {"state", "data_groups"} <= keys:
        return "ao-data"
    if {"state", "groups"} <= keys:
        return "torch-ao"
    flat = _leaves(raw)
    if any((m := _NNI_WRAPPED.match(k)) and m["mask"] for k in flat):
        return "nni-wrapped"
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


def _weight_like(leaf: Leaf) -> bool:
    """Weights, not a mask with a stray value: several distinct values besides 0 and 1 (only
    floating tensors are read to tell, one at a time)."""
    if not np.issubdtype(leaf.dtype, np.floating):
        return False
    a = leaf.read()
    try:
        other = a[(a != 0) & (a != 1)]
        return np.unique(other[:4096]).size >= 3
    finally:
        leaf.done(a)


def load_maskset(
    masks: str | Path | Mapping[str, Any], fmt: str = "auto", say: Any = None
) -> MaskSet:
    """A masks file (read here, a mask at a time) or an in-memory dict, in any format, normalized."""
    if isinstance(masks, str | Path):
        return normalize(load_masks_file(masks, say=say), fmt, str(masks))
    return normalize(masks, fmt, "masks")


def read_masks(path: str | Path, fmt: str = "auto") -> dict[str, np.ndarray]:
    """{parameter name: mask} from a masks file of any supported format."""
    return load_maskset(path, fmt).masks


def normalize(raw: Mapping[str, Any], fmt: str = "auto", source: str = "masks") -> MaskSet:
    """A masks file's content as {parameter name: mask}, in whatever format it came."""
    fmt = _format(raw, fmt, source)
    values = Values()
    out = MaskSet(format=fmt, values=values)
    if fmt == "torch-ao" and "state" in raw:
        _from_sparsifier(raw, out, source)
    elif fmt == "ao-data":
        _from_data_sparsifier(raw, out, values, source)
    else:  # every entry must be a tensor or an array
        _FROM_LEAVES.get(fmt, _from_flat)(leaves(raw, source), out, values, source)
    _check_found(out, source)
    return out


def _format(raw: Mapping[str, Any], fmt: str, source: str) -> str:
    """The format `raw` is read as (`fmt`, or detected), once it is known to be one."""
    if fmt not in MASKS_FORMATS:
        raise ShrinkError(f"--masks-format {fmt}: choose one of {', '.join(MASKS_FORMATS)}.")
    if not isinstance(raw, Mapping) or not raw:
        raise ShrinkError(
            f"{source}: expected a non-empty dict of masks, found {type(raw).__name__}."
        )
    fmt = detect(raw) if fmt == "auto" else fmt
    if fmt in ("torch-ao", "ao-data") and "state" in raw and not isinstance(raw["state"], Mapping):
        raise ShrinkError(
            f"{source}: its 'state' entry is a {type(raw['state']).__name__}, not the dict of "
            f"{{parameter: {{'mask': tensor}}}} a torch.ao sparsifier saves (format '{fmt}'). Give "
            "the sparsifier's state_dict(), or a flat dict of {name: mask}."
        )
    return fmt


def _from_sparsifier(raw: Mapping[str, Any], out: MaskSet, source: str) -> None:
    """torch-ao: a sparsifier's state_dict(), {"state": {fqn: {"mask": m}}, "groups": ...}."""
    for fqn, st in raw["state"].items():
        if isinstance(st, Mapping) and "mask" in st:
            out.masks[fqn] = read_mask(fqn, st["mask"], source)


def _from_data_sparsifier(raw: Mapping[str, Any], out: MaskSet, values: Values, source: str) -> None:
    """ao-data: a data sparsifier's state_dict(), its data's original values in its container."""
    container = _leaves(raw.get("_container", {}))
    for name, st in raw["state"].items():
        if isinstance(st, Mapping) and "mask" in st:
            out.masks[name] = read_mask(name, st["mask"], source)
            orig = container.get(f"parametrizations.{name}.original")
            if orig is not None:
                values[name] = orig


def _from_torch_prune(flat: dict[str, Leaf], out: MaskSet, values: Values, source: str) -> None:
    """torch-prune: "w_mask" with "w_orig"."""
    for k, v in flat.items():
        if k.endswith("_mask"):
            out.masks[k[: -len("_mask")]] = read_mask(k, v, source)
        elif k.endswith("_orig"):
            values[k[: -len("_orig")]] = v


def _from_nni_wrapped(flat: dict[str, Leaf], out: MaskSet, values: Values, source: str) -> None:
    """nni-wrapped: "m._nni_wrapper.w" with "..w_mask"."""
    for k, v in flat.items():
        found = _NNI_WRAPPED.match(k)
        if found is None:
            continue
        name = ".".join(p for p in (found["module"], found["param"]) if p)
        if found["mask"]:
            out.masks[name] = read_mask(k, v, source)
        else:
            values[name] = v


def _from_parametrized(flat: dict[str, Leaf], out: MaskSet, values: Values, source: str) -> None:
    """torch-ao: the state dict of a model a sparsifier prepared (its parametrizations)."""
    for k, v in flat.items():
        found = _PARAM.match(k)
        if found is None:
            continue
        name = f"{found['module']}.{found['param']}"
        if k.endswith(".mask"):
            out.masks[name] = read_mask(k, v, source)
        else:
            values[name] = v


def _from_dpu(flat: dict[str, Leaf], out: MaskSet, values: Values, source: str) -> None:
    """dpu: one output-channel mask per layer, for its weight and (if it has one) its bias."""
    for k, v in flat.items():
        module = k[: -len(".mask")] if k.endswith(".mask") else k
        arr = v.read()
        check_binary(k, arr, source)
        flags = np.array(arr.reshape(-1))  # one flag per output channel: small
        v.done(arr)
        out.masks[f"{module}.weight"] = flags
        out.masks[f"{module}.bias"] = flags
        out.optional.add(f"{module}.bias")


def _from_state_dict(flat: dict[str, Leaf], out: MaskSet, values: Values, source: str) -> None:
    """state-dict: masked weights, whose zeros are the masks."""
    for k, v in flat.items():
        if np.issubdtype(v.dtype, np.floating):
            arr = v.read()
            out.masks[k] = compact(arr != 0)
            v.done(arr)
            values[k] = v


def _from_flat(flat: dict[str, Leaf], out: MaskSet, values: Values, source: str) -> None:
    """flat, nni; `onnx/NAME`: an ONNX tensor with no framework name (--masks-out)."""
    out.masks = {k.removeprefix(ONNX_SECTION): read_mask(k, v, source) for k, v in flat.items()}


# the formats whose entries are tensors, each read by its own reader (others: `_from_flat`)
_FROM_LEAVES: dict[str, Callable[[dict[str, Leaf], MaskSet, Values, str], None]] = {
    "torch-prune": _from_torch_prune,
    "nni-wrapped": _from_nni_wrapped,
    "torch-ao": _from_parametrized,
    "dpu": _from_dpu,
    "state-dict": _from_state_dict,
}


def _check_found(out: MaskSet, source: str) -> None:
    """Masks were found (else an error that says what was)."""
    values = out.values
    if not out.masks and out.format == "torch-ao" and len(values):
        raise ShrinkError(
            f"{source}: holds the original weights of a model a torch.ao sparsifier prepared "
            f"(e.g. '{next(iter(values))}'), but not its masks (torch.ao keeps them out of the "
            "model's state_dict). If the model was exported with the parametrizations attached, "
            "omit the masks file: the zeros in the model are the masks; or give the "
            "sparsifier's state_dict()."
        )
    if not out.masks:
        raise ShrinkError(
            f"{source}: no masks found in it as format '{out.format}'. Name the format with --masks-format."
        )


def weight_values(raw: Mapping[str, Any], source: str = "weights") -> Values:
    """The original weights of a `--weights` file by parameter name: a state dict as it is; the
    state dict of a model pruned with torch.nn.utils.prune (`w_orig` with `w_mask`) or prepared
    by a torch.ao sparsifier (`...parametrizations.w.original`) also gives each pruned
    parameter's original values under its own name. Nothing is read here: each value is read
    when the binding looks it up (see `Values`)."""
    flat = leaves(raw, source)
    out = Values(flat)
    for k, v in flat.items():
        if k.endswith("_orig") and k[: -len("_orig")] + "_mask" in flat:
            out.setdefault(k[: -len("_orig")], v)
        found = _PARAM.match(k)
        if found is not None and k.endswith(".original"):
            out.setdefault(f"{found['module']}.{found['param']}", v)
    return out


def check_binary(name: str, mask: np.ndarray, source: str) -> None:
    if mask.dtype.kind not in "biuf":  # structured, string, complex, datetime: not 0/1 numbers
        raise ShrinkError(
            f"{source}: mask '{name}' has dtype {mask.dtype}; masks must be 0/1 numbers (or "
            "boolean)."
        )
    if mask.size and not _binary(mask):
        mask = core(mask)
        bad = mask[~np.isin(mask, (0, 1))].reshape(-1)[0]
        raise ShrinkError(
            f"{source}: mask '{name}' holds {bad.item()!r}; masks must be 0/1 (or boolean). If "
            "these are masked weights rather than masks, use --masks-format state-dict."
        )
