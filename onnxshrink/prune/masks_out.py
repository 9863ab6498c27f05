"""`--masks-out` and `--weights-out`: the zeroed slices as a framework state dict, under the
parameter names the exporter recorded, written beside their name and renamed over it only once
the prune has passed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxshrink import ir
from onnxshrink.errors import ShrinkError, file_access
from onnxshrink.masks import ONNX_SECTION
from onnxshrink.prune.groups import Member, gather_slices
from onnxshrink.prune.spill import zero_slice


# ---------------------------------------------------------------------- masks out
@dataclass
class MaskSlices:
    """The slices the masks zero, per (name, shape) and axis, and the initializers left out."""

    zeroed: dict[tuple[tuple[str, tuple[int, ...]], int], np.ndarray]
    skipped: list[str]
    _made: dict[str, np.ndarray] | None = field(default=None, repr=False)

    def masks(self) -> dict[str, np.ndarray]:
        """The 0/1 masks, made once."""
        if self._made is None:
            self._made = {}
            for ((name, shape), axis), idx in self.zeroed.items():
                if name not in self._made:
                    self._made[name] = np.ones(shape, np.float32)
                zero_slice(self._made[name], axis, idx)
        return self._made


def mask_slices(model: onnx.ModelProto, members: list[Member], framework: bool = True) -> MaskSlices:
    """What the 0/1 masks of the zeroed slices are, as a framework state dict: under the
    framework parameter names the exporter recorded (in the framework's layout), and nothing
    else. A slice of a tensor with no framework name (a graph-only constant: an LSTM's packed
    weights, a product the exporter folded) goes under the tensor's ONNX name in a section of
    its own, `onnx/NAME`, which a strict loader drops and onnxshrink reads back; in a model that
    records no framework names at all (`framework` False: paddle2onnx, tf2onnx, spox exports)
    the tensors' names are the only names, and stand alone. An initializer several nodes share
    with no parameter name for its slice is listed as skipped (its name would mask every reader)."""
    shapes = {t.name: tuple(t.dims) for g in ir.all_graphs(model.graph) for t in g.initializer}
    skipped: set[str] = set()
    slices: list[tuple[tuple[str, tuple[int, ...]], int, np.ndarray]] = []
    shared = {m.initializer for m in members if m.tensor != m.initializer}
    section = ONNX_SECTION if framework else ""
    for m in members:
        for p in m.params:
            slices.append(((p.name, p.shape), p.axis, m.indices))
        if m.params:
            continue
        if m.initializer not in shared and m.initializer in shapes:
            slices.append(((section + m.initializer, shapes[m.initializer]), m.axis, m.indices))
        else:
            skipped.add(m.initializer)
    return MaskSlices(gather_slices(slices), sorted(skipped))


def stage_masks(masks: Mapping[str, np.ndarray], path: str | Path) -> Path:
    """The masks (or weights) written to a hidden file beside `path` (same directory, same
    suffix), to be renamed over it."""
    p = Path(path)
    with file_access(path):  # an unwritable place is named as the user gave it
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=p.suffix, dir=p.parent.absolute())
        os.close(fd)
        staged = Path(tmp)
        try:
            save_masks(dict(masks), staged)
            as_created(staged)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
    return staged


def as_created(path: str | Path) -> None:
    """The permissions a file created by name would have (mkstemp's are the owner's alone)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def masks_kind(path: str | Path, flag: str = "--masks-out") -> str:
    """The format `save_masks` writes to `path` (by its extension, any case), or a ShrinkError."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".npz", ".safetensors", ".pt", ".pth"):
        raise ShrinkError(f"{flag} {path}: give a .pt, .npz or .safetensors file name.")
    return suffix


def save_masks(masks: dict[str, np.ndarray], path: str | Path) -> None:
    """Write masks as .pt (torch.save of tensors), .npz or .safetensors, by the extension."""
    p = Path(path)
    suffix = masks_kind(p)
    if suffix == ".npz":
        with open(p, "wb") as f:  # a file, not a name: numpy would append ".npz" to "m.NPZ"
            np.savez(f, **masks)  # type: ignore[arg-type]  # names are keywords
    elif suffix == ".safetensors":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in masks.items()}, str(p))
    elif suffix in (".pt", ".pth"):
        import torch

        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in masks.items()}, p)
