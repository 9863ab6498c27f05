"""Reading models (plain and with external data) and writing them atomically."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import init, params, tiny
from onnx import numpy_helper

from onnxshrink.errors import ShrinkError
from onnxshrink.io.model import load_model, save_model, uses_external_data

# W is 32x16x3x3 floats (18 KiB): big enough for external data; B is 128 bytes.
NET = """
g (float[1,16,6,6] x, float[32,16,3,3] W, float[32] B) => (float[1,32,4,4] y) {
  y = Conv(x, W, B)
}
"""
NET_PARAMS = 32 * 16 * 9 + 32


@pytest.fixture
def model() -> onnx.ModelProto:
    return tiny(NET, seed=3)


def save_external(model: onnx.ModelProto, path: Path, location: str | None = None, **kw) -> None:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(
        copy,
        path,
        save_as_external_data=True,
        location=location or path.name + ".data",
        size_threshold=0,
        **kw,
    )


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


# ------------------------------------------------------------------ load_model
def test_load_plain_model_returns_its_values(tmp_path, model):
    onnx.save(model, tmp_path / "m.onnx")
    loaded = load_model(tmp_path / "m.onnx")
    assert [n.op_type for n in loaded.graph.node] == ["Conv"]
    np.testing.assert_array_equal(init(loaded, "W"), init(model, "W"))
    np.testing.assert_array_equal(init(loaded, "B"), init(model, "B"))
    assert uses_external_data(tmp_path / "m.onnx") is False


def test_load_external_data_model_reads_the_data(tmp_path, model, monkeypatch):
    sub = tmp_path / "deep" / "dir"
    sub.mkdir(parents=True)
    save_external(model, sub / "m.onnx", location="weights.bin")
    assert listing(sub) == ["m.onnx", "weights.bin"]
    assert uses_external_data(sub / "m.onnx") is True

    monkeypatch.chdir(tmp_path)  # the data is found beside the model, not in the cwd
    loaded = load_model(Path("deep/dir/m.onnx"))
    assert not any(is_external(t) for t in loaded.graph.initializer)
    np.testing.assert_array_equal(init(loaded, "W"), init(model, "W"))
    np.testing.assert_array_equal(init(loaded, "B"), init(model, "B"))
    assert params(loaded) == NET_PARAMS


def test_uses_external_data_is_false_for_unreadable_files(tmp_path):
    assert uses_external_data(tmp_path / "absent.onnx") is False
    (tmp_path / "junk.onnx").write_bytes(b"\xff" * 64)
    assert uses_external_data(tmp_path / "junk.onnx") is False


def _corrupt(tmp_path: Path, model: onnx.ModelProto, kind: str) -> Path:
    path = tmp_path / f"{kind}.onnx"
    good = model.SerializeToString()
    if kind == "random":
        path.write_bytes(np.random.default_rng(7).bytes(4096))
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 3])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("this is not a model\n")
    elif kind == "no-nodes":
        empty = onnx.ModelProto()
        empty.CopyFrom(model)
        del empty.graph.node[:]
        path.write_bytes(empty.SerializeToString())
    return path


@pytest.mark.parametrize(
    "kind, message",
    [
        ("random", "not a valid ONNX model ("),
        ("truncated", "not a valid ONNX model ("),
        ("text", "not a valid ONNX model ("),
        ("empty", "not a valid ONNX model (it has no nodes or no outputs)"),
        ("no-nodes", "not a valid ONNX model (it has no nodes or no outputs)"),
    ],
)
def test_load_refuses_corrupt_files_naming_them(tmp_path, model, kind, message):
    path = _corrupt(tmp_path, model, kind)
    with pytest.raises(ShrinkError) as info:
        load_model(path)
    assert str(info.value).startswith(f"{path}: {message}")
    assert info.value.exit_code == 2
    assert "\n" not in str(info.value)


def test_load_refuses_missing_file_and_directory(tmp_path):
    with pytest.raises(ShrinkError, match=r"absent\.onnx: no such file\. Give the path"):
        load_model(tmp_path / "absent.onnx")
    (tmp_path / "d.onnx").mkdir()
    with pytest.raises(ShrinkError, match=r"d\.onnx: is a directory, not an ONNX model file"):
        load_model(tmp_path / "d.onnx")


def test_load_refuses_missing_external_data_naming_the_location(tmp_path, model):
    save_external(model, tmp_path / "m.onnx", location="weights.bin")
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(ShrinkError) as info:
        load_model(tmp_path / "m.onnx")
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'm.onnx'}: its weights are stored in 'weights.bin'")
    assert "not next to the model" in msg


def test_load_refuses_short_external_data(tmp_path, model):
    save_external(model, tmp_path / "m.onnx")
    data = tmp_path / "m.onnx.data"
    full = data.read_bytes()
    assert len(full) == NET_PARAMS * 4
    data.write_bytes(full[:1000])
    with pytest.raises(ShrinkError) as info:
        load_model(tmp_path / "m.onnx")
    assert str(info.value).startswith(f"{tmp_path / 'm.onnx'}: its external data could not be read")


# ------------------------------------------------------------------ save_model
def test_save_plain_writes_one_file_and_no_temp(tmp_path, model):
    out = tmp_path / "o.onnx"
    written = save_model(model, out)
    assert written == [out]
    assert listing(tmp_path) == ["o.onnx"]
    back = onnx.load(out)
    assert not any(is_external(t) for t in back.graph.initializer)
    np.testing.assert_array_equal(init(back, "W"), init(model, "W"))


def test_save_external_writes_data_beside_and_keeps_the_proto(tmp_path, model):
    out = tmp_path / "o.onnx"
    before = model.SerializeToString()
    written = save_model(model, out, external=True)
    assert written == [out, tmp_path / "o.onnx.data"]
    assert listing(tmp_path) == ["o.onnx", "o.onnx.data"]
    assert model.SerializeToString() == before  # the caller's proto is not rewritten

    skeleton = onnx.load(out, load_external_data=False)
    w = next(t for t in skeleton.graph.initializer if t.name == "W")
    b = next(t for t in skeleton.graph.initializer if t.name == "B")
    assert is_external(w)
    assert {e.key: e.value for e in w.external_data}["location"] == "o.onnx.data"
    assert not is_external(b)  # 128 bytes: below the 1 KiB threshold, stays inline
    assert (tmp_path / "o.onnx.data").stat().st_size == 32 * 16 * 9 * 4
    np.testing.assert_array_equal(init(load_model(out), "W"), init(model, "W"))


def test_save_external_with_only_small_tensors_writes_no_data_file(tmp_path):
    small = tiny("g (float[1,4] x, float[4,3] W) => (float[1,3] y) { y = MatMul(x, W) }")
    out = tmp_path / "s.onnx"
    assert save_model(small, out, external=True) == [out]
    assert listing(tmp_path) == ["s.onnx"]
    np.testing.assert_array_equal(init(onnx.load(out), "W"), init(small, "W"))


def test_save_replaces_an_existing_output(tmp_path, model):
    out = tmp_path / "o.onnx"
    out.write_bytes(b"old")
    save_model(model, out)
    assert out.read_bytes() == model.SerializeToString()
    assert listing(tmp_path) == ["o.onnx"]


def test_save_failure_leaves_no_temp_and_old_output_intact(tmp_path, model, monkeypatch):
    """A full disk mid-write: a ShrinkError naming the output and what to do (bad input, exit 2),
    no temporary file left, the previous output intact."""
    out = tmp_path / "o.onnx"
    out.write_bytes(b"previous result")

    def broken(proto, path, *args, **kwargs):
        Path(path).write_bytes(b"half a mod")  # a partial write inside the temp dir
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(onnx, "save_model", broken)
    for external in (False, True):
        with pytest.raises(ShrinkError) as info:
            save_model(model, out, external=external)
        assert str(info.value) == (
            f"cannot write {out} (No space left on device): free some space on that disk or "
            "write elsewhere. Nothing was written."
        )
        assert listing(tmp_path) == ["o.onnx"]
        assert out.read_bytes() == b"previous result"


def test_save_refuses_missing_output_directory(tmp_path, model):
    with pytest.raises(ShrinkError) as info:
        save_model(model, tmp_path / "nodir" / "o.onnx")
    assert str(info.value) == f"{tmp_path / 'nodir'}: the output directory does not exist."
    assert listing(tmp_path) == []


@pytest.mark.parametrize("spelling", ["same", "dotdot", "symlink", "data"])
def test_save_refuses_protected_paths(tmp_path, model, spelling):
    src = tmp_path / "m.onnx"
    save_external(model, src)
    (tmp_path / "sub").mkdir()
    os.symlink(src, tmp_path / "link.onnx")
    before = {p: p.read_bytes() for p in (src, tmp_path / "m.onnx.data")}
    protect = [src, tmp_path / "m.onnx.data"]
    out = {
        "same": src,
        "dotdot": tmp_path / "sub" / ".." / "m.onnx",
        "symlink": tmp_path / "link.onnx",
        # "m.onnx" is protected only through its data file: <out>.data would be m.onnx.data
        "data": src,
    }[spelling]
    if spelling == "data":
        protect = [tmp_path / "m.onnx.data"]

    with pytest.raises(ShrinkError, match="refusing to overwrite the input model or its data"):
        save_model(tiny(NET, seed=9), out, external=True, protect=protect)
    assert {p: p.read_bytes() for p in before} == before
    assert listing(tmp_path) == ["link.onnx", "m.onnx", "m.onnx.data", "sub"]


def test_save_protects_data_file_of_another_name(tmp_path, model):
    # the input keeps its weights in "b.onnx.data": writing b.onnx would overwrite them
    save_external(model, tmp_path / "a.onnx", location="b.onnx.data")
    data = (tmp_path / "b.onnx.data").read_bytes()
    with pytest.raises(ShrinkError, match=r"b\.onnx\.data: refusing to overwrite"):
        save_model(
            model, tmp_path / "b.onnx", protect=[tmp_path / "a.onnx", tmp_path / "b.onnx.data"]
        )
    assert (tmp_path / "b.onnx.data").read_bytes() == data
    assert listing(tmp_path) == ["a.onnx", "b.onnx.data"]
    # another name is fine, and the input still loads
    save_model(model, tmp_path / "c.onnx", protect=[tmp_path / "a.onnx", tmp_path / "b.onnx.data"])
    assert listing(tmp_path) == ["a.onnx", "b.onnx.data", "c.onnx"]
    np.testing.assert_array_equal(init(load_model(tmp_path / "a.onnx"), "W"), init(model, "W"))


def test_saved_model_round_trips_through_load(tmp_path, model):
    for external in (False, True):
        out = tmp_path / f"r{int(external)}.onnx"
        save_model(model, out, external=external)
        back = load_model(out)
        for t in model.graph.initializer:
            np.testing.assert_array_equal(init(back, t.name), numpy_helper.to_array(t))
    assert listing(tmp_path) == ["r0.onnx", "r1.onnx", "r1.onnx.data"]
