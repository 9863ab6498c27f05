"""Reading masks files: .pt / .npz / .safetensors, nesting, dtypes, and refusals."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import CONV2, init, params, tiny
from safetensors.numpy import save_file

from onnxshrink import shrink
from onnxshrink.errors import ShrinkError
from onnxshrink.io.masks import flatten
from onnxshrink.masks import read_masks

FLAGS = np.array([1, 0, 1, 0, 1, 1], np.float32)  # keep channels 0, 2, 4, 5
KEEP = np.flatnonzero(FLAGS)
AFTER = 196 - 2 * (27 + 1 + 4)


def full_masks(dtype=np.float32) -> dict[str, np.ndarray]:
    w = np.broadcast_to(FLAGS.reshape(6, 1, 1, 1), (6, 3, 3, 3)).astype(dtype)
    return {"W1": w, "B1": FLAGS.astype(dtype)}


def write(path: Path, masks: dict[str, np.ndarray]) -> Path:
    suffix = path.suffix.lower()
    if suffix == ".npz":
        np.savez(path, **masks)
    elif suffix == ".safetensors":
        save_file({k: np.ascontiguousarray(v) for k, v in masks.items()}, str(path))
    else:
        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in masks.items()}, path)
    return path


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return tiny(CONV2, seed=21)


@pytest.fixture(scope="module")
def expected(model) -> bytes:
    """The shrunk model for the masks given as an in-memory dict."""
    result = shrink(model, full_masks())
    assert params(result.model) == AFTER
    np.testing.assert_array_equal(init(result.model, "W1"), init(model, "W1")[KEEP])
    np.testing.assert_array_equal(init(result.model, "W2"), init(model, "W2")[:, KEEP])
    return result.model.SerializeToString()


class Payload:
    """Unpickling this runs open(marker, "w"), creating the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# ------------------------------------------------------------------ formats agree
@pytest.mark.parametrize(
    "name", ["m.pt", "m.pth", "m.bin", "m.ckpt", "m.PT", "m.npz", "m.safetensors"]
)
def test_every_format_reads_the_same_masks_and_shrinks_the_same(tmp_path, model, expected, name):
    path = write(tmp_path / name, full_masks())
    masks = read_masks(path)
    assert sorted(masks) == ["B1", "W1"]
    for k, v in full_masks().items():
        assert masks[k].dtype == np.uint8  # read as 0/1, reduced as read (see masks.compact)
        np.testing.assert_array_equal(masks[k], v)
    # the full-size mask of W1 is one flag per output channel: held as those 6 flags
    assert masks["W1"].strides[1:] == (0, 0, 0) and masks["W1"].base.size == 6
    result = shrink(model, path)
    assert result.masks_bound == 2
    assert result.model.SerializeToString() == expected


@pytest.mark.parametrize("suffix", [".pt", ".npz", ".safetensors"])
def test_bool_masks_are_accepted(tmp_path, model, expected, suffix):
    path = write(tmp_path / f"b{suffix}", full_masks(np.bool_))
    masks = read_masks(path)
    assert masks["W1"].dtype == np.uint8  # 0/1, as every mask is normalized
    assert int(masks["W1"].sum()) == 4 * 27
    assert shrink(model, path).model.SerializeToString() == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_other_torch_dtypes_are_accepted(tmp_path, model, expected, dtype):
    path = tmp_path / "d.pt"
    torch.save({k: torch.from_numpy(v.copy()).to(dtype) for k, v in full_masks().items()}, path)
    masks = read_masks(path)
    np.testing.assert_array_equal(masks["B1"].astype(np.float32), FLAGS)
    assert shrink(model, path).model.SerializeToString() == expected


def test_per_output_channel_mask_is_accepted_for_a_conv_weight(tmp_path, model, expected):
    path = write(tmp_path / "c.npz", {"W1": FLAGS, "B1": FLAGS})
    assert read_masks(path)["W1"].shape == (6,)
    assert shrink(model, path).model.SerializeToString() == expected


# ------------------------------------------------------------------ nesting
def rename(model: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name == old:
            t.name = new
    for n in out.graph.node:
        for i, name in enumerate(n.input):
            if name == old:
                n.input[i] = new
    return out


def test_nested_dicts_flatten_to_dotted_names(tmp_path, model, expected):
    dotted = rename(rename(model, "W1", "conv1.weight"), "B1", "conv1.bias")
    m = full_masks()
    path = tmp_path / "n.pt"
    torch.save(
        {"conv1": {"weight": torch.from_numpy(m["W1"]), "bias": torch.from_numpy(m["B1"])}}, path
    )
    masks = read_masks(path)
    assert sorted(masks) == ["conv1.bias", "conv1.weight"]
    np.testing.assert_array_equal(masks["conv1.weight"], m["W1"])
    result = shrink(dotted, path)
    assert result.masks_bound == 2
    assert (
        result.model.SerializeToString()
        == rename(
            rename(onnx.load_from_string(expected), "W1", "conv1.weight"), "B1", "conv1.bias"
        ).SerializeToString()
    )


def test_flatten_handles_deep_nesting_numbers_and_non_string_keys():
    flat = flatten({"a": {"b": {"c": np.ones(2)}}, 3: torch.zeros(1), "s": 1.0}, "src")
    assert sorted(flat) == ["3", "a.b.c", "s"]
    np.testing.assert_array_equal(flat["a.b.c"], [1.0, 1.0])
    assert flat["3"].dtype == np.float32 and flat["3"].tolist() == [0.0]
    assert flat["s"].shape == () and float(flat["s"]) == 1.0


# ------------------------------------------------------------------ refusals
def test_missing_file(tmp_path):
    with pytest.raises(ShrinkError) as info:
        read_masks(tmp_path / "none.npz")
    assert str(info.value).startswith(f"{tmp_path / 'none.npz'}: no such masks file.")


@pytest.mark.parametrize("name", ["m.json", "m.txt", "masks"])
def test_unknown_suffix(tmp_path, name):
    (tmp_path / name).write_text("{}")
    with pytest.raises(ShrinkError) as info:
        read_masks(tmp_path / name)
    suffix = Path(name).suffix
    assert str(info.value).startswith(f"{tmp_path / name}: unknown masks format '{suffix}'.")


@pytest.mark.parametrize(
    "content, found",
    [(torch.ones(3), "Tensor"), ([torch.ones(3)], "list"), ({}, "dict"), (None, "NoneType")],
)
def test_pt_must_hold_a_non_empty_dict(tmp_path, content, found):
    torch.save(content, tmp_path / "x.pt")
    with pytest.raises(ShrinkError) as info:
        read_masks(tmp_path / "x.pt")
    assert str(info.value) == (
        f"{tmp_path / 'x.pt'}: expected a non-empty dict of mask tensors, found {found}."
    )


def test_empty_npz_is_refused(tmp_path):
    np.savez(tmp_path / "e.npz")
    with pytest.raises(ShrinkError, match="expected a non-empty dict of mask tensors, found dict"):
        read_masks(tmp_path / "e.npz")


@pytest.mark.parametrize("value, kind", [("hello", "str"), (None, "NoneType"), ([1, 0], "list")])
def test_entry_that_is_not_a_tensor_is_named(tmp_path, value, kind):
    torch.save({"ok": torch.ones(2), "block": {"gate": value}}, tmp_path / "e.pt")
    with pytest.raises(ShrinkError) as info:
        read_masks(tmp_path / "e.pt")
    assert str(info.value) == (
        f"{tmp_path / 'e.pt'}: entry 'block.gate' is a {kind}, not a tensor or array."
    )


@pytest.mark.parametrize(
    "name, message",
    [
        # random bytes in a .pt are reported by the weights_only branch (reported separately)
        ("r.pt", ""),
        ("r.npz", "cannot be read as a .npz file of arrays ("),
        ("r.safetensors", "cannot be read as a .safetensors file ("),
    ],
)
def test_corrupt_files(tmp_path, name, message):
    path = tmp_path / name
    path.write_bytes(np.random.default_rng(3).bytes(300))
    with pytest.raises(ShrinkError) as info:
        read_masks(path)
    assert str(info.value).startswith(f"{path}: {message}")
    assert "\n" not in str(info.value)


def test_truncated_and_non_torch_pt_are_refused(tmp_path):
    write(tmp_path / "ok.pt", full_masks())
    data = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ShrinkError, match=r"t\.pt: cannot be read as a torch file"):
        read_masks(tmp_path / "t.pt")
    (tmp_path / "n.pt").write_text("a text file, not a checkpoint")
    with pytest.raises(ShrinkError, match=r"n\.pt: cannot be read as a torch file: it is not a torch file"):
        read_masks(tmp_path / "n.pt")


@pytest.mark.parametrize(
    "content, what",
    [
        # a pickle torch's weights-only unpickler rejects with its advice to set weights_only=False
        (b"\x80\x02garbage" + bytes(range(256)), "a Python pickle (265 bytes)"),
        (b"PK\x03\x04" + bytes(40), "a zip archive (44 bytes)"),
        (b"", "empty (0 bytes)"),
    ],
    ids=["pickle", "zip", "empty"],
)
def test_corrupt_pt_says_what_it_is_and_never_advises_an_unsafe_load(tmp_path, content, what):
    path = tmp_path / "c.pt"
    path.write_bytes(content)
    with pytest.raises(ShrinkError) as info:
        read_masks(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: cannot be read as a torch file: it is {what}")
    assert ".npz or .safetensors" in msg and "weights_only" not in msg and "\n" not in msg


@pytest.mark.parametrize("how", ["torch-zip", "plain-pickle"])
def test_pickled_code_is_refused_and_never_run(tmp_path, how):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    payload = {"W1": torch.ones(2), "x": Payload(marker)}
    if how == "torch-zip":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(ShrinkError) as info:
        read_masks(path)
    assert str(info.value).startswith(f"{path}: holds objects other than tensors")
    assert "torch.load(weights_only=True)" in str(info.value)
    assert not marker.exists()
    if how == "torch-zip":  # an unsafe load does run it
        torch.load(path, weights_only=False)
    else:
        pickle.loads(path.read_bytes())
    assert marker.exists()


def test_pickled_object_array_in_npz_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.npz"
    np.savez(path, W1=np.ones(2), x=np.array([Payload(marker)], dtype=object))
    with pytest.raises(ShrinkError, match=r"evil\.npz: cannot be read as a \.npz file of arrays"):
        read_masks(path)
    assert not marker.exists()
    with np.load(path, allow_pickle=True) as f:
        f["x"]
    assert marker.exists()
