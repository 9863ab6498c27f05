"""The proof's sessions given a model with its large weights apart (sessions.Serialized): the
same outputs, bit for bit, as the model serialized whole, at every optimization level."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import ort_run
from onnx import helper, numpy_helper

from onnxshrink.proof import sessions


def _model(seed: int, zeros: bool = False) -> onnx.ModelProto:
    """x[1,64] -> MatMul W (float32, 16 KiB) + B (small) -> Cast float16 -> MatMul H (float16,
    8 KiB) -> Cast float32 -> Where(M (bool, 4 KiB), ., 0) -> Gather(I (int64, 4.7 KiB), axis 1)
    -> + S, an initializer that is also a graph input (may be fed: never given apart)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    if zeros:  # a pruning reference's: zeroed rows and columns, a -0.0
        w[::3] = 0.0
        w[:, 5] = -0.0
    inits = {
        "W": w,
        "B": np.zeros(64, np.float32) if zeros else rng.standard_normal(64).astype(np.float32),
        "H": (rng.standard_normal((64, 64)) / 8).astype(np.float16),
        "M": rng.random((64, 64)) > 0.3,
        "I": rng.integers(0, 64, 600).astype(np.int64),
        "S": rng.standard_normal((64, 600)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"]),
        helper.make_node("Add", ["a", "B"], ["b"]),
        helper.make_node("Cast", ["b"], ["c"], to=onnx.TensorProto.FLOAT16),
        helper.make_node("MatMul", ["c", "H"], ["d"]),
        helper.make_node("Cast", ["d"], ["e"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Constant", [], ["zero"], value_float=0.0),
        helper.make_node("Where", ["M", "e", "zero"], ["f"]),
        helper.make_node("Gather", ["f", "I"], ["g"], axis=1),
        helper.make_node("Add", ["g", "S"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64]),
         helper.make_tensor_value_info("S", onnx.TensorProto.FLOAT, [64, 600])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [64, 600])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_model_with_its_weights_apart_computes_what_it_computes_serialized_whole():
    for seed, zeros in ((0, False), (1, True)):
        model = _model(seed, zeros)
        before = model.SerializeToString()
        data = sessions.weights_apart(model)
        assert data is not None
        assert model.SerializeToString() == before  # the model itself is left as it was
        # the large ones of numpy dtypes; B is small, S may be fed
        assert sorted(data.weights) == ["H", "I", "M", "W"]
        for name, values in data.weights.items():
            t = next(t for t in model.graph.initializer if t.name == name)
            assert values.dtype == numpy_helper.to_array(t).dtype
            assert values.tobytes() == t.raw_data
        apart = sum(v.nbytes for v in data.weights.values())
        assert len(before) - apart < len(data.skeleton) < len(before) - apart + 512  # stubs only
        rng = np.random.default_rng(seed + 10)
        feeds = [{"x": rng.standard_normal((1, 64)).astype(np.float32)} for _ in range(2)]
        expected = [ort_run(model, f)[0] for f in feeds]  # onnxruntime, independently
        for level in sessions.levels():
            whole = sessions.session(model, "cpu", None, level)
            apart = sessions.session(model, "cpu", None, level, data)
            for f, e in zip(feeds, expected, strict=True):
                got = apart.run(None, f)[0]
                assert got.tobytes() == whole.run(None, f)[0].tobytes(), level
                assert np.allclose(got, e, rtol=1e-2, atol=1e-2)  # (float16 products between levels)
            # an initializer that is a graph input is still the model's, and may be fed
            fed = {**feeds[0], "S": np.zeros((64, 600), np.float32)}
            assert apart.run(None, fed)[0].tobytes() == whole.run(None, fed)[0].tobytes()


def test_weights_kept_in_external_data_are_read_from_the_data_directory(tmp_path):
    """Only inline bytes go apart: a weight the model keeps in a file stays there."""
    model = _model(2)
    path = tmp_path / "m.onnx"
    onnx.save(_model(2), path, save_as_external_data=True, all_tensors_to_one_file=True, location="m.data", size_threshold=10_000)
    stored = onnx.load(path, load_external_data=False)  # W and S (16 KiB, 150 KiB) in m.data
    data = sessions.weights_apart(stored)
    assert data is not None and sorted(data.weights) == ["H", "I", "M"]  # inline, and large enough
    feed = {"x": np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)}
    expected = ort_run(model, feed)[0]
    got = sessions.session(stored, "cpu", tmp_path, sessions.OFF, data).run(None, feed)[0]
    assert got.tobytes() == sessions.session(stored, "cpu", tmp_path, sessions.OFF).run(None, feed)[0].tobytes()
    assert np.allclose(got, expected, rtol=1e-2, atol=1e-2)
