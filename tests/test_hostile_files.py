"""Hostile masks files and state dicts through the real command line (the lazy readers of
onnxshrink.io.masks): each is exit 2 with one line naming the file (and the mask) at fault,
nothing written, no input changed; never an internal error, never a hang."""

from __future__ import annotations

import io
import json
import os
import struct
import warnings
import zipfile

import numpy as np
import onnx
import pytest
import torch
from conftest import CONV2, cli, snapshot, tiny
from test_user_errors import check_refused


def _safetensors(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _w1(shape, offsets, dtype="F32") -> dict:
    return {"W1": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}


# Headers whose shape or offsets are not whole numbers >= 0: negative dims whose product fits the
# bytes, a shape whose int64 product wraps around to 0, float and boolean entries.
HEADERS = {
    "negative-dims": (_w1([-6, -1], [0, 24]), b"\0" * 24, "whole number >= 0"),
    "wrapping-product": (_w1([2**32, 2**32], [0, 0]), b"", "the file is truncated or corrupt"),
    "float-dim": (_w1([6.0], [0, 24]), b"\0" * 24, "whole number >= 0"),
    "bool-dim": (_w1([True, 6], [0, 24]), b"\0" * 24, "whole number >= 0"),
    "negative-offsets": (_w1([6], [-8, -2], "U8"), b"\0" * 6, "whole number >= 0"),
}


@pytest.mark.parametrize("case", HEADERS)
def test_safetensors_header_with_bad_shape_or_offsets(tmp_path, case):
    onnx.save(tiny(CONV2, seed=3), tmp_path / "m.onnx")
    header, data, why = HEADERS[case]
    _safetensors(tmp_path / "masks.safetensors", header, data)
    before = snapshot(tmp_path)
    p = cli("m.onnx", "masks.safetensors", "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, "masks.safetensors", "cannot be read as a .safetensors file")
    assert "'W1'" in p.stderr and why in p.stderr
    assert snapshot(tmp_path) == before


def test_masks_file_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    onnx.save(tiny(CONV2, seed=3), tmp_path / "m.onnx")
    os.mkfifo(tmp_path / "masks.npz")  # nobody writes it: opening it would wait for ever
    before = snapshot_names(tmp_path)
    p = cli("m.onnx", "masks.npz", "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, "masks.npz", "not a regular file")
    assert snapshot_names(tmp_path) == before


def snapshot_names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _mask() -> np.ndarray:
    m = np.ones((6, 3, 3, 3), np.float32)
    m[[1, 3]] = 0
    return m


CONTENTS = {
    # a mask of records: not numbers
    "structured-npz": (
        lambda p: np.savez(p, W1=np.zeros(6, dtype=[("a", "f4"), ("b", "i4")])),
        ".npz",
        ("mask 'W1' has dtype", "0/1 numbers"),
    ),
    "complex-npz": (lambda p: np.savez(p, W1=_mask().astype(np.complex64)), ".npz", ("mask 'W1'",)),
    # keys that make it look like a torch.ao sparsifier's state dict, 'state' not a dict
    "ao-state-array-npz": (
        lambda p: np.savez(p, state=np.ones(3), groups=np.ones(3)),
        ".npz",
        ("'state' entry",),
    ),
    "ao-data-state-array-npz": (
        lambda p: np.savez(p, state=np.ones(3), data_groups=np.ones(3)),
        ".npz",
        ("'state' entry",),
    ),
    "ao-state-list-pt": (
        lambda p: torch.save({"state": [1], "groups": []}, p),
        ".pt",
        ("'state' entry is a list",),
    ),
    # saved from a model built on the meta device: shapes, no values
    "meta-tensor-pt": (
        lambda p: torch.save({"W1": torch.ones(6, 3, 3, 3, device="meta")}, p),
        ".pt",
        ("meta device",),
    ),
}


@pytest.mark.parametrize("case", CONTENTS)
def test_masks_file_with_odd_content(tmp_path, case):
    onnx.save(tiny(CONV2, seed=3), tmp_path / "m.onnx")
    write, suffix, culprits = CONTENTS[case]
    write(tmp_path / f"masks{suffix}")
    before = snapshot(tmp_path)
    p = cli("m.onnx", f"masks{suffix}", "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, f"masks{suffix}", *culprits)
    assert snapshot(tmp_path) == before


def test_meta_tensor_in_weights_state_dict_is_named(tmp_path):
    onnx.save(tiny(CONV2, seed=3), tmp_path / "m.onnx")
    np.savez(tmp_path / "masks.npz", W1=_mask())
    torch.save({"W1": torch.ones(6, 3, 3, 3, device="meta")}, tmp_path / "w.pt")
    before = snapshot(tmp_path)
    p = cli("m.onnx", "masks.npz", "--weights", "w.pt", "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, "w.pt", "meta device")
    assert snapshot(tmp_path) == before


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _twice_npz(path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it writes
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("W1.npy", _npy(_mask()))
            z.writestr("W1.npy", _npy(np.ones((6, 3, 3, 3), np.float32)))


def _twice_safetensors(path) -> None:
    entry = '"W1": {{"dtype": "F32", "shape": [6], "data_offsets": [{}, {}]}}'
    raw = ("{" + entry.format(0, 24) + ", " + entry.format(24, 48) + "}").encode()
    flags = np.array([1, 0, 1, 0, 1, 1], np.float32).tobytes() + np.ones(6, np.float32).tobytes()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + flags)


@pytest.mark.parametrize(
    "write, name, why",
    [
        (_twice_npz, "masks.npz", "holds array 'W1' twice"),
        (_twice_safetensors, "masks.safetensors", "names 'W1' twice"),
    ],
    ids=["npz", "safetensors"],
)
def test_a_mask_named_twice_is_refused(tmp_path, write, name, why):
    """Each reader kept the last of two masks of one name (numpy, json): exit 0 with the mask
    that another reader, taking the first, would not have applied."""
    onnx.save(tiny(CONV2, seed=3), tmp_path / "m.onnx")
    write(tmp_path / name)
    before = snapshot(tmp_path)
    p = cli("m.onnx", name, "-o", "out.onnx", cwd=tmp_path)
    check_refused(p, name, why)
    assert snapshot(tmp_path) == before
