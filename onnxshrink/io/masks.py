"""Read masks files (.pt, .npz, .safetensors): `load_masks_file` gives their content as it is
(the format is recognized in `onnxshrink.masks`)."""

from __future__ import annotations

import collections
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from onnxshrink.errors import ShrinkError, first_line

PT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def imports_torch(path: str | Path) -> bool:
    """Will reading this file import torch (a .pt file, torch not loaded yet)? Importing it takes
    seconds, and tens on a busy machine: the caller says so first."""
    return Path(path).suffix.lower() in PT_SUFFIXES and "torch" not in sys.modules


# What each kind of file read here holds, and what to give instead when it is missing.
_KINDS = {
    "masks": (
        "masks",
        "Give a .pt, .npz or .safetensors file of masks, or no masks file to use the zeros "
        "already in the model.",
    ),
    "weights": (
        "weights",
        "Give the original weights (--weights): the model's state dict as a .pt, .npz or "
        ".safetensors file.",
    ),
}


def load_masks_file(path: str | Path, kind: str = "masks") -> Mapping:
    """The content of a masks file (`kind` "masks") or of a state dict given with --weights
    ("weights"): a dict of tensors, read without running code."""
    p = Path(path)
    noun, fix = _KINDS[kind]
    if not p.exists():
        raise ShrinkError(f"{p}: no such {noun} file. {fix}")
    if p.is_dir():
        raise ShrinkError(f"{p}: is a directory, not a {noun} file. {fix}")
    suffix = p.suffix.lower()
    if suffix in PT_SUFFIXES:
        raw = _read_pt(p)
    elif suffix == ".npz":
        raw = _read_npz(p)
    elif suffix == ".safetensors":
        raw = _read_safetensors(p)
    else:
        raise ShrinkError(
            f"{p}: unknown {noun} format '{suffix}'. Use .pt (torch.save of a dict of tensors), .npz or .safetensors."
        )
    if not isinstance(raw, Mapping) or not raw:
        raise ShrinkError(
            f"{p}: expected a non-empty dict of {'mask ' if kind == 'masks' else ''}tensors, found {type(raw).__name__}."
        )
    return raw


def _read_pt(p: Path):
    import torch

    try:
        # Pruners' state dicts hold defaultdicts (torch.ao's "state"): read as plain dicts, the
        # only thing such a global may construct here. No other code can run from the file.
        safe: list[Any] = [(_plain_dict, "collections.defaultdict"), collections.OrderedDict, dict]
        with torch.serialization.safe_globals(safe):
            return torch.load(str(p), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():  # a class or function reference: could run code
            raise ShrinkError(
                f"{p}: holds objects other than tensors and plain containers, which onnxshrink will "
                "not load: masks are read with torch.load(weights_only=True) so that a file cannot "
                "run code. Save a plain dict instead: torch.save({name: mask_tensor}, path)."
            ) from exc
        raise ShrinkError(f"{p}: cannot be read as a torch file ({first_line(exc)}).") from exc
    except Exception as exc:  # a corrupt or truncated file
        raise ShrinkError(f"{p}: cannot be read as a torch file ({first_line(exc)}).") from exc


def _plain_dict(*_factory) -> dict:
    return {}


def _read_npz(p: Path):
    try:
        with np.load(str(p), allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except Exception as exc:
        raise ShrinkError(
            f"{p}: cannot be read as a .npz file of arrays ({first_line(exc)})."
        ) from exc


def _read_safetensors(p: Path):
    try:
        from safetensors.numpy import load_file
    except ImportError as exc:
        raise ShrinkError(
            f"{p}: reading .safetensors needs the 'safetensors' package (pip install safetensors)."
        ) from exc
    try:
        return load_file(str(p))
    except Exception as exc:
        raise ShrinkError(
            f"{p}: cannot be read as a .safetensors file ({first_line(exc)})."
        ) from exc


def to_numpy(v) -> np.ndarray | None:
    if isinstance(v, np.ndarray):
        return v
    if hasattr(v, "detach") and hasattr(v, "numpy"):  # torch tensor
        t = v.detach().cpu()
        if t.is_sparse:  # a data sparsifier saves its masks in sparse layout
            t = t.to_dense()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    if isinstance(v, int | float | bool):
        return np.asarray(v)
    return None


def flatten(raw: Mapping, source: Path | str) -> dict[str, np.ndarray]:
    """Nested dicts become dotted names ({"conv1": {"weight": m}} -> "conv1.weight")."""
    out: dict[str, np.ndarray] = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        arr = to_numpy(obj)
        if arr is None:
            raise ShrinkError(
                f"{source}: entry '{prefix}' is a {type(obj).__name__}, not a tensor or array."
            )
        out[prefix] = arr

    walk("", raw)
    return out
