"""A large model in one file (no external data) is read as one with external data is: its
large initializers are found in the file by walking the protobuf wire format (io.wire) and
mapped where they lie, never parsed into memory; its shrink or prune is written as one file
again, each weight copied from the shrink's data file as the file is written. The sizes that
decide it are lowered so that small models take the large model's path."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.llama import LlamaConfig, build
from onnxshrink.api import shrink
from onnxshrink.io import wire
from onnxshrink.io.model import load_model, mapped_in_place
from onnxshrink.prune import prune


def _session(model) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    m = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _arrays(model: onnx.ModelProto, base_dir: str = "") -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t, base_dir=base_dir) for t in model.graph.initializer}


def _mixed_model(rng: np.random.Generator) -> onnx.ModelProto:
    """Initializers of several kinds: large float32 and float16 raw_data, a large int64 table,
    small ones (a shape, a bias), a large one in float_data (not raw_data: stays inline), and a
    Constant node's value."""
    w1 = rng.standard_normal((64, 300)).astype(np.float32)  # 76,800 bytes
    w2 = rng.standard_normal((300, 200)).astype(np.float16)  # 120,000 bytes
    table = rng.integers(-(2**40), 2**40, (9000,)).astype(np.int64)  # 72,000 bytes
    listed = helper.make_tensor("listed", TensorProto.FLOAT, [200, 100], rng.standard_normal(20000).astype(np.float32).tolist())
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(rng.standard_normal(300).astype(np.float32), "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(table, "table"),
        listed,
        numpy_helper.from_array(np.array([2, -1], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Cast", ["hb"], ["h16"], to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["h16", "w2"], ["y16"]),
        helper.make_node("Cast", ["y16"], ["y32"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["y32", "listed"], ["z"]),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(rng.standard_normal(100).astype(np.float32))),
        helper.make_node("Add", ["z", "c"], ["zc"]),
        helper.make_node("Reshape", ["zc", "shape"], ["out"]),
        helper.make_node("Gather", ["table", "idx"], ["picked"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]), helper.make_tensor_value_info("idx", TensorProto.INT64, [5])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 100]), helper.make_tensor_value_info("picked", TensorProto.INT64, [5])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_wire_walk_maps_each_large_raw_weight_where_it_lies_and_writes_it_back(tmp_path):
    rng = np.random.default_rng(7)
    model = _mixed_model(rng)
    path = tmp_path / "mixed.onnx"
    onnx.save(model, str(path))
    mapped = wire.read_mapped(path, path.name)
    assert mapped is not None
    external = {t.name for t in mapped.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert external == {"w1", "w2", "table"}  # raw_data of 64 KiB or more; float_data stays inline
    # their 268,800 bytes are not in it (only the entries that name them)
    assert mapped.ByteSize() <= path.stat().st_size - (76_800 + 120_000 + 72_000) + 3 * 64
    want = _arrays(model)
    got = _arrays(mapped, str(tmp_path))
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
    assert list(mapped.graph.node) == list(model.graph.node)
    # and back: one file again, its weights copied from the file they are mapped in
    back = tmp_path / "back.onnx"
    wire.write_one_file(mapped, path, back)
    again = onnx.load(str(back))
    assert all(t.data_location == TensorProto.DEFAULT and not t.external_data for t in again.graph.initializer)
    for name, value in _arrays(again).items():
        assert np.array_equal(value, want[name]), name
    assert back.stat().st_size <= path.stat().st_size + 8 * len(want)
    feed = {"x": rng.standard_normal((2, 64)).astype(np.float32), "idx": np.array([0, 5, 8999, 17, 4], np.int64)}
    for a, b in zip(_session(model).run(None, feed), _session(again).run(None, feed), strict=True):
        assert np.array_equal(a, b)
    # onnxruntime reads the mapped model itself: its weights at their offsets in the model file
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(tmp_path))
    session = ort.InferenceSession(mapped.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    for a, b in zip(_session(model).run(None, feed), session.run(None, feed), strict=True):
        assert np.array_equal(a, b)


def test_a_small_one_file_model_or_one_read_for_its_graph_is_not_mapped(tmp_path):
    model = _mixed_model(np.random.default_rng(1))
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert not mapped_in_place(path, load_model(path, keep_external=True))
    assert not mapped_in_place(path, load_model(path, keep_external=True, map_from=path.stat().st_size + 1))
    assert mapped_in_place(path, load_model(path, keep_external=True, map_from=1))
    bare = wire.read_mapped(path, None)  # the graph alone: large initializers without data
    assert bare is not None and not any(t.external_data for t in bare.graph.initializer)
    assert {t.name for t in bare.graph.initializer if not t.raw_data and not t.float_data} == {"w1", "w2", "table"}


def _large(monkeypatch) -> None:
    """Take the large model's path for any file: mapped in place, streamed, proven in segments;
    fail if the input's file is parsed whole."""
    monkeypatch.setattr("onnxshrink.stages.read.IN_MEMORY_BYTES", 1)
    monkeypatch.setattr("onnxshrink.result.IN_MEMORY_BYTES", 1)
    monkeypatch.setattr(wire, "MAPPED_FROM", 1024)
    monkeypatch.setattr("onnxshrink.proof.sessions.SEGMENT_BYTES", 64 * 1024)


def _forbid_parsing(monkeypatch, path) -> None:
    plain = onnx.load

    def guarded(f, *args, **kwargs):
        assert str(f) != str(path), "the one-file model was parsed whole"
        return plain(f, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", guarded)
    monkeypatch.setattr(onnx, "load_model", guarded)


@pytest.fixture
def one_file_llama(tmp_path):
    built = tmp_path / "built.onnx"
    build(LlamaConfig.preset("tiny", seed=5), built)
    path = tmp_path / "llama.onnx"
    onnx.save(onnx.load(str(built)), str(path))  # one file, the weights inline
    return path


def test_a_large_one_file_model_is_pruned_mapped_and_written_as_one_file(tmp_path, monkeypatch, one_file_llama):
    path = one_file_llama
    feed = {"input_ids": np.random.default_rng(0).integers(0, 128, (1, 16)).astype(np.int64)}
    held = prune(path, 0.25, tmp_path / "held.onnx", validate=False, price=False)
    with monkeypatch.context() as m:
        _large(m)
        _forbid_parsing(m, path)
        mapped = prune(path, 0.25, tmp_path / "mapped.onnx", validate=True, price=False)
    assert mapped.shrink.passed and mapped.shrink.validation is not None
    assert not (tmp_path / "mapped.onnx.data").exists()  # one file in, one file out
    want, got = onnx.load(str(tmp_path / "held.onnx")), onnx.load(str(tmp_path / "mapped.onnx"))
    assert {k: v.tobytes() for k, v in _arrays(got).items()} == {k: v.tobytes() for k, v in _arrays(want).items()}
    assert mapped.shrink.after.params == held.shrink.after.params < held.original.params
    assert np.array_equal(_session(got).run(None, feed)[0], _session(want).run(None, feed)[0])


def test_a_large_one_file_model_with_masks_is_shrunk_mapped(tmp_path, monkeypatch, one_file_llama):
    path = one_file_llama
    model = onnx.load(str(path))
    rng = np.random.default_rng(3)
    matmuls = {n.input[1] for n in model.graph.node if n.op_type == "MatMul"}
    masks = {}
    for t in model.graph.initializer:  # every FFN down projection loses a third of its rows
        if t.name in matmuls and "down" in t.name:
            keep = (rng.random(t.dims[0]) > 0.33).astype(np.float32)
            masks[t.name] = np.broadcast_to(keep[:, None], tuple(t.dims)).copy()
    assert masks
    held = shrink(path, masks, tmp_path / "held.onnx")
    with monkeypatch.context() as m:
        _large(m)
        _forbid_parsing(m, path)
        mapped = shrink(path, masks, tmp_path / "mapped.onnx")
    assert mapped.passed and not (tmp_path / "mapped.onnx.data").exists()
    with monkeypatch.context() as m:  # a result saved by the caller: one file as well
        _large(m)
        unsaved = shrink(path, masks)
    copy = tmp_path / "copy.onnx"
    assert unsaved.save(copy) == [copy.absolute()] and not copy.with_name("copy.onnx.data").exists()
    assert mapped.after.params == held.after.params < held.before.params
    feed = {"input_ids": rng.integers(0, 128, (1, 16)).astype(np.int64)}
    # against the input with the masks applied by this test
    for t in model.graph.initializer:
        if t.name in masks:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * masks[t.name], t.name))
    want = _session(model).run(None, feed)[0]
    got = _session(tmp_path / "mapped.onnx").run(None, feed)[0]
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    assert np.array_equal(got, _session(tmp_path / "held.onnx").run(None, feed)[0])
    assert np.array_equal(got, _session(copy).run(None, feed)[0])


def test_the_groups_of_a_large_one_file_model_are_found_on_its_mapped_weights(tmp_path, monkeypatch, one_file_llama):
    import json

    from onnxshrink.cli import main

    path = one_file_llama
    assert main([str(path), "--groups", str(tmp_path / "held.json"), "-q"]) == 0
    with monkeypatch.context() as m:
        _large(m)
        _forbid_parsing(m, path)
        assert main([str(path), "--groups", str(tmp_path / "mapped.json"), "-q"]) == 0
    held, mapped = (json.loads((tmp_path / f).read_text()) for f in ("held.json", "mapped.json"))
    assert mapped == held and sum(g["exact"] for g in held["groups"]) > 10


def test_a_large_one_file_model_with_a_weight_cut_short_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    from onnxshrink.cli import main

    model = _mixed_model(np.random.default_rng(2))
    w1 = next(t for t in model.graph.initializer if t.name == "w1")
    w1.raw_data = w1.raw_data[:-4]  # one float short
    path = tmp_path / "cut.onnx"
    onnx.save(model, str(path))
    monkeypatch.setattr("onnxshrink.stages.read.IN_MEMORY_BYTES", 1)
    monkeypatch.setattr("onnxshrink.result.IN_MEMORY_BYTES", 1)
    assert main([str(path), "-o", str(tmp_path / "out.onnx"), "-q"]) == 2
    assert "initializer 'w1' holds 76796 bytes of data, but its shape [64, 300] of float needs 76800" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()
