"""Read masks files (.pt, .npz, .safetensors): `load_masks_file` gives their content as it is
(the format is recognized in `onnxshrink.masks`), lazily: names, shapes and dtypes first, each
tensor's values read when asked for (`Leaf.read`, or `to_numpy`), so that a masks file or state
dict larger than memory can be bound a tensor at a time.

- .safetensors: its JSON header is parsed here and each tensor memory-mapped when read (numpy
  only; bf16 comes out as float32 holding its values, as torch's bf16 tensors do);
- .pt: `torch.load(mmap=True, weights_only=True)`: tensors backed by the mapped file (an old,
  non-zipfile torch file is read whole, and `load_masks_file` says so);
- .npz: numpy's NpzFile, each member read (decompressed) when asked for.
"""

from __future__ import annotations

import collections
import ctypes
import json
import math
import mmap
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping
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


class Leaf:
    """One tensor of a file: its shape and dtype known, its values read when asked for (and
    not kept here: each `read` reads them again)."""

    __slots__ = ("_read", "dtype", "release", "shape")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        read: Callable[[], np.ndarray],
        release: Callable[[np.ndarray], None] | None = None,
    ):
        self.shape, self.dtype, self._read = tuple(shape), np.dtype(dtype), read
        self.release = release  # gives the mapped pages of a read array back

    def read(self) -> np.ndarray:
        return self._read()

    def done(self, arr: np.ndarray) -> None:
        """The caller is done with `arr` (read from this leaf): its mapped pages go back."""
        if self.release is not None:
            self.release(arr)

    def __repr__(self) -> str:
        return f"Leaf({list(self.shape)}, {self.dtype})"


def load_masks_file(
    path: str | Path, kind: str = "masks", say: Callable[[str], None] | None = None
) -> Mapping[str, Any]:
    """The content of a masks file (`kind` "masks") or of a state dict given with --weights
    ("weights"), read without running code: a dict (possibly nested) whose tensors are `Leaf`s,
    read when asked for (an old-format .pt file: torch tensors, read whole; see `to_numpy`).
    `say` is told when a file cannot be read lazily."""
    p = Path(path)
    noun, fix = _KINDS[kind]
    if not p.exists():
        raise ShrinkError(f"{p}: no such {noun} file. {fix}")
    if p.is_dir():
        raise ShrinkError(f"{p}: is a directory, not a {noun} file. {fix}")
    if not p.is_file():  # a FIFO or a device: reading it would wait, or never end
        raise ShrinkError(f"{p}: is not a regular file (a pipe or a device). {fix}")
    suffix = p.suffix.lower()
    if suffix in PT_SUFFIXES:
        raw = _read_pt(p, say)
    elif suffix == ".npz":
        raw = _read_npz(p)
    elif suffix == ".safetensors":
        raw = _read_safetensors(p)
    else:
        raise ShrinkError(
            f"{p}: unknown {noun} format '{suffix}'. Use .pt (torch.save of a dict of tensors), .npz or .safetensors."
        )
    if not isinstance(raw, Mapping) or not raw:
        found = "Tensor" if isinstance(raw, Leaf) else "dict" if isinstance(raw, Mapping) else type(raw).__name__
        raise ShrinkError(
            f"{p}: expected a non-empty dict of {'mask ' if kind == 'masks' else ''}tensors, found {found}."
        )
    return raw


def _read_pt(p: Path, say: Callable[[str], None] | None = None):
    import torch

    try:
        # Pruners' state dicts hold defaultdicts (torch.ao's "state"): read as plain dicts, the
        # only thing such a global may construct here. No other code can run from the file.
        safe: list[Any] = [(_plain_dict, "collections.defaultdict"), collections.OrderedDict, dict]
        with torch.serialization.safe_globals(safe):
            try:  # tensors backed by the mapped file: read a page at a time, when used
                return _mapped_leaves(torch.load(str(p), map_location="cpu", weights_only=True, mmap=True))
            except RuntimeError as exc:
                if "_use_new_zipfile_serialization" not in str(exc):
                    raise
            whole = torch.load(str(p), map_location="cpu", weights_only=True)
            if say is not None:
                say(
                    f"{p}: an old-format torch file (not a zip archive): read whole, not mapped "
                    "(torch.save writes the zip format since torch 1.6)."
                )
            return whole
    except pickle.UnpicklingError as exc:
        if "unsupported global" in str(exc).lower():  # a class or function reference: could run code
            raise ShrinkError(
                f"{p}: holds objects other than tensors and plain containers, which onnxshrink will "
                "not load: masks are read with torch.load(weights_only=True) so that a file cannot "
                "run code. Save a plain dict instead: torch.save({name: mask_tensor}, path)."
            ) from exc
        raise ShrinkError(_unreadable_pt(p)) from exc
    except NoValues as exc:  # a whole torch file, but no values in it: said as it is
        raise ShrinkError(f"{p}: cannot be read as a torch file of values: {exc}; save the tensors from a real device.") from exc
    except Exception as exc:  # a corrupt or truncated file
        raise ShrinkError(_unreadable_pt(p)) from exc


class NoValues(ValueError):
    """A torch file read whole whose tensors hold no values (saved from the meta device)."""


# torch's own messages for a file it cannot read advise loading it with weights_only=False,
# which would run whatever code the file holds: they are never passed on; this says instead
# what the file is and what is read.
_PT_FORMATS = (
    "Masks and weights are read from torch.save files of a dict of tensors (.pt, .pth, .bin, "
    ".ckpt: the zip format, or the pre-1.6 pickle format), .npz or .safetensors files"
)


def _unreadable_pt(p: Path) -> str:
    """Why a torch file could not be read, in terms of what its bytes are."""
    with open(p, "rb") as f:
        head = f.read(8)
    size = p.stat().st_size
    if head.startswith(b"PK\x03\x04"):
        what = (
            f"a zip archive ({size} bytes) that is not a whole torch file: truncated, damaged, or "
            "a zip of something else"
        )
    elif head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        what = f"a Python pickle ({size} bytes) that is not a torch file of tensors, or is damaged"
    elif not head:
        what = "empty (0 bytes)"
    else:
        what = f"not a torch file ({size} bytes, starting {head[:4]!r})"
    return f"{p}: cannot be read as a torch file: it is {what}. {_PT_FORMATS}; save it again as one of them."


def _plain_dict(*_factory) -> dict[Any, Any]:
    return {}


def _mapped_leaves(obj: Any) -> Any:
    """A torch file loaded with mmap=True, its tensors as `Leaf`s that give their pages back
    when the caller is done with an array read from them."""
    if isinstance(obj, Mapping):
        return {k: _mapped_leaves(v) for k, v in obj.items()}
    if hasattr(obj, "detach") and hasattr(obj, "numpy") and not obj.is_sparse:
        if obj.is_meta:  # saved from a model built on the meta device: shapes, no values
            raise NoValues("it holds a tensor on the meta device, which has no values")
        dtype = _np_dtype(obj)
        # a view of the mapped file, except bf16 (widened to a float32 copy)
        mapped = str(obj.dtype) != "torch.bfloat16"
        return Leaf(tuple(obj.shape), dtype, lambda: _tensor(obj), _drop_pages if mapped else None)
    return obj


def _tensor(t: Any) -> np.ndarray:
    arr = to_numpy(t)
    assert arr is not None
    return arr


def _np_dtype(t: Any) -> np.dtype:
    import torch

    if t.dtype == torch.bfloat16:
        return np.dtype(np.float32)  # as to_numpy gives it
    return torch.empty((), dtype=t.dtype).numpy().dtype


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4


def _drop_pages(arr: np.ndarray) -> None:
    """Give back the pages of `arr`, a view of a privately mapped file that was only read (a
    torch file loaded with mmap=True): they are read again from the file if touched. An array
    that is a copy (bf16 widened, a sparse tensor made dense) is not given here."""
    if arr.nbytes < _PAGE or not arr.flags.c_contiguous:
        return
    start = arr.__array_interface__["data"][0]
    lo, hi = -(-start // _PAGE) * _PAGE, (start + arr.nbytes) // _PAGE * _PAGE  # whole pages only
    if hi > lo:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


class _Leaves(Mapping[str, Leaf]):
    """A file's tensors by name, each a `Leaf` (subclasses fill `self.leaves`)."""

    leaves: dict[str, Leaf]

    def __getitem__(self, key: str) -> Leaf:
        return self.leaves[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)


class _Npz(_Leaves):
    """A .npz file's arrays as `Leaf`s: shapes from each member's header, values read (and
    decompressed) when asked for."""

    def __init__(self, p: Path):
        self.path = p
        self.file = np.load(str(p), allow_pickle=False)
        if not hasattr(self.file, "files"):  # a .npy file named .npz
            raise ValueError("not a zip archive of arrays")
        twice = sorted({k for k, n in collections.Counter(self.file.files).items() if n > 1})
        if twice:  # a zip may hold a name twice: which one is the mask is anyone's guess
            raise ValueError(f"it holds array '{twice[0]}' twice, with no telling which is meant")
        self.leaves = {k: self._leaf(k) for k in self.file.files}

    def _leaf(self, key: str) -> Leaf:
        member = key if key in self.file.zip.namelist() else f"{key}.npy"
        with self.file.zip.open(member) as fp:
            version = np.lib.format.read_magic(fp)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _fortran, dtype = read_header(fp)
        if dtype.hasobject:
            raise ValueError(f"array '{key}' holds Python objects, which onnxshrink does not unpickle")
        return Leaf(shape, dtype, lambda: self._read(key))

    def _read(self, key: str) -> np.ndarray:
        try:
            return self.file[key]
        except Exception as exc:
            raise ShrinkError(
                f"{self.path}: cannot be read as a .npz file of arrays (array '{key}': {first_line(exc)})."
            ) from exc


def _read_npz(p: Path):
    try:
        return _Npz(p)
    except Exception as exc:
        raise ShrinkError(
            f"{p}: cannot be read as a .npz file of arrays ({first_line(exc)})."
        ) from exc


# safetensors' dtype names -> numpy (BF16 is read as uint16 and widened to float32)
_ST_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
    "F32": np.float32, "F64": np.float64, "BF16": np.uint16,
}  # fmt: skip


class _Safetensors(_Leaves):
    """A .safetensors file (an 8-byte header length, a JSON header, then each tensor's raw
    little-endian bytes) as `Leaf`s: the header is read here, and each tensor memory-mapped when
    asked for (its pages go back when the array is dropped)."""

    def __init__(self, p: Path):
        self.path = p
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes: too short for a header")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"its header claims {n} bytes, the file has {size - 8} after the length")
            header = json.loads(f.read(n), object_pairs_hook=_no_repeats)
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        base = 8 + n
        self.leaves: dict[str, Leaf] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype_name, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if dtype_name not in _ST_DTYPES:
                raise ValueError(f"tensor '{name}' has dtype {dtype_name}, which onnxshrink does not read")
            if not all(_whole(d) for d in (*shape, begin, end)):
                raise ValueError(
                    f"tensor '{name}' has shape {list(shape)} at data offsets {[begin, end]}: "
                    "each must be a whole number >= 0"
                )
            dtype = np.dtype(_ST_DTYPES[dtype_name]).newbyteorder("<")
            count = math.prod(shape)  # Python ints: a hostile shape cannot wrap around to fit
            if end - begin != count * dtype.itemsize or base + end > size:
                raise ValueError(
                    f"tensor '{name}' ({list(shape)} {dtype_name}) lies at bytes {begin}..{end} of "
                    f"the data, which holds {size - base}: the file is truncated or corrupt"
                )
            self.leaves[name] = Leaf(
                shape,
                np.dtype(np.float32) if dtype_name == "BF16" else dtype,
                self._reader(base + begin, shape, dtype, dtype_name == "BF16"),
            )

    def _reader(self, offset: int, shape: tuple[int, ...], dtype: np.dtype, bf16: bool):
        def read() -> np.ndarray:
            if int(np.prod(shape, dtype=np.int64)) == 0:
                return np.empty(shape, dtype)
            arr = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape).view(np.ndarray)
            if bf16:  # numpy has no bfloat16: float32 holding its values, as to_numpy gives it
                return (arr.astype(np.uint32) << 16).view(np.float32)
            return arr

        return read


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of a .safetensors header, refused when it names a key twice (json keeps
    the last, another reader may take the first)."""
    seen = collections.Counter(k for k, _ in pairs)
    twice = sorted(k for k, n in seen.items() if n > 1)
    if twice:
        raise ValueError(f"its header names '{twice[0]}' twice, with no telling which is meant")
    return dict(pairs)


def _whole(v: object) -> bool:
    """A shape entry or data offset of a .safetensors header: an int >= 0 (JSON true is not)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_safetensors(p: Path):
    try:
        return _Safetensors(p)
    except Exception as exc:
        raise ShrinkError(
            f"{p}: cannot be read as a .safetensors file ({first_line(exc)}). Write it with "
            "safetensors' save_file, and check that it was copied whole."
        ) from exc


def to_numpy(v) -> np.ndarray | None:
    """The values of a tensor, an array, a `Leaf` (read now) or a number; None for anything else."""
    if isinstance(v, np.ndarray):
        return v
    if isinstance(v, Leaf):
        return v.read()
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


def as_leaf(v: Any) -> Leaf | None:
    """A tensor, an array or a number as a `Leaf` (not read yet); None for anything else."""
    if isinstance(v, Leaf):
        return v
    if isinstance(v, np.ndarray):
        return Leaf(v.shape, v.dtype, lambda: v)
    if isinstance(v, np.generic):  # a numpy scalar: what numpy gives for a 0-d mask's `w != 0`
        return Leaf((), v.dtype, lambda: np.asarray(v))
    if hasattr(v, "detach") and hasattr(v, "numpy"):
        return Leaf(tuple(v.shape), _np_dtype(v), lambda: _tensor(v))
    if isinstance(v, int | float | bool):
        return Leaf((), np.asarray(v).dtype, lambda: np.asarray(v))
    return None


def leaves(raw: Mapping[str, Any], source: Path | str) -> dict[str, Leaf]:
    """Nested dicts as dotted names, like `flatten`, each tensor a `Leaf`: nothing is read."""
    out: dict[str, Leaf] = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        leaf = as_leaf(obj)
        if leaf is None:
            raise ShrinkError(
                f"{source}: entry '{prefix}' is a {type(obj).__name__}, not a tensor or array."
            )
        out[prefix] = leaf

    walk("", raw)
    return out


def flatten(raw: Mapping[str, Any], source: Path | str) -> dict[str, np.ndarray]:
    """Nested dicts become dotted names ({"conv1": {"weight": m}} -> "conv1.weight"), read now."""
    return {name: leaf.read() for name, leaf in leaves(raw, source).items()}
