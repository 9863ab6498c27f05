"""Masks files and --weights state dicts are read lazily: names and shapes first, each tensor's
values when the binding needs them, each mask once; the result is the same as an in-memory dict's."""

from __future__ import annotations

import json
import pickle
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import WIDE, WIDE_PER_CHANNEL, error_against, init, params, tiny
from onnx import numpy_helper
from safetensors.numpy import save_file

from onnxshrink import shrink
from onnxshrink.cli import main
from onnxshrink.io import masks as io_masks
from onnxshrink.masks import load_maskset

KEPT = [0, 3, 4, 9, 17, 20, 33, 41, 50, 63]  # W1 output channels kept by the channel mask


def element_masks(seed: int) -> dict[str, np.ndarray]:
    """Full-size bool masks, as torch.nn.utils.prune writes them: W1 by output channel (a
    structured prune), W2 element by element (an unstructured one)."""
    rng = np.random.default_rng(seed)
    flags = np.zeros(64, bool)
    flags[KEPT] = True
    return {
        "W1": np.ascontiguousarray(np.broadcast_to(flags.reshape(64, 1, 1, 1), (64, 16, 3, 3))),
        "B1": flags.copy(),
        "W2": rng.random((32, 64, 1, 1)) < 0.5,
    }


def write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    if path.suffix == ".npz":
        np.savez(path, **tensors)
    elif path.suffix == ".safetensors":
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path))
    else:
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, path)  # writable copies
    return path


def masked_by_hand(model: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name in masks:
            t.CopyFrom(numpy_helper.from_array(np.where(masks[t.name], init(model, t.name), 0).astype(np.float32), t.name))
    return out


class Reads:
    """Counts every tensor read from a file (Leaf.read), by the leaf's shape and identity."""

    def __init__(self, monkeypatch):
        self.shapes: Counter = Counter()
        self.leaves: Counter = Counter()
        real = io_masks.Leaf.read

        def read(leaf):
            self.shapes[leaf.shape] += 1
            self.leaves[id(leaf)] += 1
            return real(leaf)

        monkeypatch.setattr(io_masks.Leaf, "read", read)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
@pytest.mark.parametrize("seed", [3, 8])
def test_a_file_read_lazily_binds_and_shrinks_as_the_dict_does(tmp_path, monkeypatch, suffix, seed):
    model = tiny(WIDE, seed=seed)
    masks = element_masks(seed)
    in_memory = shrink(model, masks)
    reads = Reads(monkeypatch)
    result = shrink(model, write(tmp_path / f"m{suffix}", masks))
    # each mask read once (bool masks: nothing is read to detect the format)
    assert sorted(reads.leaves.values()) == [1, 1, 1]
    assert result.masks_bound == in_memory.masks_bound == 3
    assert params(result.model) == params(in_memory.model) == len(KEPT) * WIDE_PER_CHANNEL + 32
    assert result.model.SerializeToString() == in_memory.model.SerializeToString()
    assert error_against(masked_by_hand(model, masks), result.model) < 1e-6
    assert result.validation is not None and result.validation.passed


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_masks_are_held_reduced_not_as_read(tmp_path, suffix):
    masks = element_masks(5)
    got = load_maskset(write(tmp_path / f"m{suffix}", masks)).masks
    for k, v in masks.items():
        np.testing.assert_array_equal(got[k], v)
    assert got["W1"].base is not None and got["W1"].base.size == 64  # its 64 channel flags
    assert got["W1"].strides[1:] == (0, 0, 0)
    assert got["W2"].flags.owndata and got["W2"].dtype == np.uint8  # unstructured: a copy


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_weights_are_read_only_for_the_masks_that_bind_by_them(tmp_path, monkeypatch, suffix):
    """Masks named after the framework's parameters bind by value (the model's initializers are
    W1, W2): only conv1.weight's and conv2.weight's values are read, never the large tensor
    nothing needs."""
    model = tiny(WIDE, seed=11)
    state = {
        "conv1.weight": init(model, "W1"),
        "conv1.bias": init(model, "B1"),
        "conv2.weight": init(model, "W2"),
        "conv2.bias": init(model, "B2"),
        "embed.weight": np.ones((512, 4096), np.float32),  # 8 MiB nobody binds
    }
    weights = write(tmp_path / f"w{suffix}", state)
    flags = np.zeros(64, np.float32)
    flags[KEPT] = 1
    masks = {"conv1.weight": flags, "conv1.bias": flags}
    reads = Reads(monkeypatch)
    result = shrink(model, masks, weights=weights)
    assert result.masks_bound == 2
    assert params(result.model) == len(KEPT) * WIDE_PER_CHANNEL + 32
    assert reads.shapes[(512, 4096)] == 0
    assert reads.shapes[(64, 16, 3, 3)] >= 1  # conv1.weight, to bind by value
    assert set(reads.shapes) <= {(64, 16, 3, 3), (64,)}


def result_params(model: onnx.ModelProto, weights: Path) -> int:
    flags = np.zeros(64, np.float32)
    flags[KEPT] = 1
    return params(shrink(model, {"conv1.weight": flags, "conv1.bias": flags}, weights=weights).model)


def _sparse_safetensors(path: Path, small: dict[str, np.ndarray], huge: int) -> Path:
    """`small` then a float32 tensor "huge" of `huge` bytes of zeros, the file written by hand
    and sparse (safetensors' save_file would need the tensor in memory)."""
    header, offset = {}, 0
    for k, v in small.items():
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [offset, offset + v.nbytes]}
        offset += v.nbytes
    header["huge"] = {"dtype": "F32", "shape": [huge // 4], "data_offsets": [offset, offset + huge]}
    with open(path, "wb") as f:
        text = json.dumps(header).encode()
        f.write(len(text).to_bytes(8, "little") + text + b"".join(v.tobytes() for v in small.values()))
        f.truncate(8 + len(text) + offset + huge)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_an_unneeded_tensor_is_never_paged_in(tmp_path, suffix):
    """The laziness seen from outside: a state dict with a 256 MiB tensor nobody binds adds
    nothing like its size to the process (VmHWM)."""
    model = tiny(WIDE, seed=2)
    small = {"conv1.weight": init(model, "W1"), "conv1.bias": init(model, "B1")}
    huge = 2**28
    if suffix == ".safetensors":
        weights = _sparse_safetensors(tmp_path / "w.safetensors", small, huge)
    else:
        weights = write(tmp_path / f"w{suffix}", {**small, "huge": np.zeros(huge // 4, np.float32)})
    assert weights.stat().st_size >= huge or suffix == ".safetensors"
    assert result_params(model, weights) == len(KEPT) * WIDE_PER_CHANNEL + 32
    flags = np.zeros(64, np.float32)
    flags[KEPT] = 1
    grown = peak_growth(lambda: shrink(model, {"conv1.weight": flags, "conv1.bias": flags}, weights=weights))
    assert grown < huge // 4, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_truncated_safetensors_is_refused_naming_the_file(tmp_path, capsys):
    model_path = tmp_path / "m.onnx"
    onnx.save(tiny(WIDE, seed=4), model_path)
    whole = write(tmp_path / "whole.safetensors", element_masks(4)).read_bytes()
    for cut, what in ((len(whole) - 100, "truncated or corrupt"), (5, "too short")):
        (tmp_path / "t.safetensors").write_bytes(whole[:cut])
        assert main([str(model_path), str(tmp_path / "t.safetensors"), "-o", str(tmp_path / "o.onnx")]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 't.safetensors'}: cannot be read as a .safetensors file" in err
        assert what in err and "Traceback" not in err
        assert not (tmp_path / "o.onnx").exists()


def peak_growth(fn) -> int:
    """How far this process' peak RSS rose above its RSS while `fn` ran (Linux /proc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from _proc import proc_status, reset_peak

    if not reset_peak():
        pytest.fail("cannot reset VmHWM (/proc/self/clear_refs) to measure the peak")
    before = proc_status()["VmRSS"]
    fn()
    return proc_status()["VmHWM"] - before


class Payload:
    """Unpickling this runs open(marker, "w")."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("flag", ["masks", "--weights"])
def test_a_malicious_pt_is_still_refused_and_never_run(tmp_path, capsys, flag):
    model_path = tmp_path / "m.onnx"
    model = tiny(WIDE, seed=6)
    onnx.save(model, model_path)
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"W1": torch.ones(2), "x": Payload(marker)}, evil)
    ok = write(tmp_path / "ok.npz", {"B1": element_masks(6)["B1"]})
    args = [str(model_path), str(evil)] if flag == "masks" else [str(model_path), str(ok), "--weights", str(evil)]
    assert main([*args, "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"{evil}: holds objects other than tensors" in err
    assert not marker.exists() and not (tmp_path / "o.onnx").exists()
    assert pickle.dumps(1)  # (pickle itself untouched)


def test_an_old_format_pt_is_read_whole_and_says_so(tmp_path):
    model = tiny(WIDE, seed=7)
    masks = element_masks(7)
    path = tmp_path / "old.pt"
    torch.save({k: torch.from_numpy(v) for k, v in masks.items()}, path, _use_new_zipfile_serialization=False)
    said: list[str] = []
    result = shrink(model, path, log=said.append)
    assert any("old-format torch file" in s and "read whole" in s for s in said)
    assert result.model.SerializeToString() == shrink(model, masks).model.SerializeToString()


def test_bf16_in_safetensors_reads_as_torch_widens_it(tmp_path):
    from safetensors.torch import save_file as save_torch

    t = torch.randn(7, 5).to(torch.bfloat16)
    save_torch({"w": t}, str(tmp_path / "b.safetensors"))
    leaf = io_masks.load_masks_file(tmp_path / "b.safetensors", "weights")["w"]
    assert leaf.shape == (7, 5) and leaf.dtype == np.float32
    np.testing.assert_array_equal(leaf.read(), t.float().numpy())
