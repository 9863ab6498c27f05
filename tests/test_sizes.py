"""Sizes that run (onnxshrink.proof.sizes): the dynamic dims of the inputs no shape was given for
are drawn at the first sizes at which the input model runs in onnxruntime; none: exit 2 naming
the dims and the sizes tried."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import error_against, ort_run, tiny
from onnx import helper

from onnxshrink import shrink
from onnxshrink.cli import main

# A reflect Pad of 64 on the samples axis (onnxruntime wants more than 64 samples), then a Conv
# whose filter 1 is zeroed: runs at no size below 65.
PADDED = """
g (float[N, 1, L] x, float[4, 1, 3] W, float[4] B, float[2, 4, 1] W2) => (float[N, 2, M] y) {
  pads = Constant <value = int64[6] {0, 0, 64, 0, 0, 64}> ()
  p = Pad <mode = "reflect"> (x, pads)
  c = Conv (p, W, B)
  r = Relu (c)
  y = Conv (r, W2)
}
"""


def padded() -> onnx.ModelProto:
    return tiny(PADDED, zero={"W": np.s_[1], "B": np.s_[1]}, seed=3)


def test_dims_a_pad_needs_are_found_by_running_the_input_model(capsys):
    model = padded()
    logs: list[str] = []
    result = shrink(model, log=logs.append)
    assert result.validation is not None and result.validation.passed
    # 16 and 64 samples do not run; 224 is the first candidate that does; the batch stays 2
    assert result.validation.input_shapes == {"x": [2, 1, 224]}
    assert any("dynamic dims drawn at x:2,1,224" in m and "--input-shapes" in m for m in logs)
    assert error_against(model, result.model, {"x": [2, 1, 224]}) <= 1e-5
    w = next(t for t in result.model.graph.initializer if t.name == "W")
    assert list(w.dims) == [3, 1, 3]  # the zeroed filter went
    # the MACs are counted at the sizes drawn: (224 + 128 - 2) positions x (3 x 3 + 3 x 2)
    positions = 224 + 128 - 2
    assert result.after.macs == 2 * positions * (3 * 3 + 2 * 3)
    assert result.before.macs == 2 * positions * (4 * 3 + 2 * 4)


def test_a_model_that_runs_at_no_size_tried_is_exit_2_naming_its_dims_and_the_sizes(tmp_path, capsys):
    # a Reshape to 7 x 3 needs 21 elements: no candidate size gives them
    model = tiny(
        """g (float[L] x, float[3, 2] W) => (float[7, 2] y) {
             s = Constant <value = int64[2] {7, 3}> ()
             r = Reshape (x, s)
             y = MatMul (r, W)
           }"""
    )
    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(model, path)
    assert main([str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not run in onnxruntime at any of the sizes tried" in err
    assert "L (x axis 0): 2, 1, 16, 64, 224, 256, 512, 640, 1024, 32, 8" in err
    assert "--input-shapes" in err and "Traceback" not in err
    assert not out.exists()
    # the size given runs
    assert main([str(path), "-o", str(out), "--input-shapes", "x:21"]) == 0


def test_an_unnamed_state_batch_is_tied_to_the_input_batch():
    # a state [1, ?, 4] added to the input's rows: its unnamed dim must be the batch
    model = tiny(
        """g (float[?, 8] x, float[1, ?, 4] h, float[8, 4] W) => (float[?, 4] y) {
             a = Constant <value = int64[1] {0}> ()
             s = Squeeze (h, a)
             m = MatMul (x, W)
             y = Add (m, s)
           }""",
        zero={"W": np.s_[:, 2]},
    )
    result = shrink(model)
    assert result.validation is not None and result.validation.passed
    shapes = result.validation.input_shapes
    assert shapes["x"][0] == shapes["h"][1] == 2


def test_ultralytics_metadata_gives_the_image_size():
    # the model adds a [1, 3, 24, 40] map: it runs at 24 x 40 only, which no candidate is
    model = tiny(
        """g (float[batch, 3, height, width] images, float[1, 3, 24, 40] P, float[4, 3, 1, 1] W)
             => (float[batch, 4, height, width] y) {
             a = Add (images, P)
             y = Conv (a, W)
           }""",
        zero={"W": np.s_[1]},
    )
    onnx.helper.set_model_props(model, {"imgsz": "[24, 40]", "batch": "1", "stride": "32"})
    result = shrink(model)
    assert result.validation is not None and result.validation.passed
    assert result.validation.input_shapes == {"images": [1, 3, 24, 40]}


def test_value_info_where_a_dim_flows_unchanged_gives_its_size():
    # relu's recorded shape [2, 40] (as an exporter that traced it writes it); 40 is no candidate
    model = tiny(
        """g (float[N, L] x, float[1, 40] C, float[40, 3] W) => (float[N, 3] y) {
             r = Relu (x)
             a = Add (r, C)
             y = MatMul (a, W)
           }""",
        zero={"W": np.s_[:, 1]},
    )
    model.graph.value_info.append(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [2, 40]))
    result = shrink(model)
    assert result.validation is not None and result.validation.passed
    assert result.validation.input_shapes == {"x": [2, 40]}
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 40)).astype(np.float32)}
    np.testing.assert_allclose(ort_run(result.model, feeds)[0], ort_run(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_model_finite_at_no_size_is_drawn_at_the_first_it_runs_at_and_says_so():
    # the log of a normal draw: NaN at every size; where both models give NaN they agree
    model = tiny(
        """g (float[N, 4] x, float[4, 3] W, float[3, 2] V) => (float[N, 4] l, float[N, 2] y) {
             l = Log (x)
             m = MatMul (x, W)
             y = MatMul (m, V)
           }""",
        zero={"W": np.s_[:, 1]},
    )
    logs: list[str] = []
    result = shrink(model, log=logs.append)
    assert result.validation is not None and result.validation.passed
    assert result.validation.input_shapes == {"x": [2, 4]}  # the first size tried
    assert any("dynamic dims drawn at x:2,4" in m and "not finite at every size tried" in m for m in logs)
    assert [t.dims for t in result.model.graph.initializer if t.name == "W"] == [[4, 2]]


def test_a_feature_size_an_rnn_reads_through_other_ops_comes_from_its_weights():
    """madmom's RNN models: x [T, F] -> Relu -> Unsqueeze to [T, 1, F] -> RNN with W [1, 5, 37]:
    the RNN requires X's features to be W's input size, and F flows to them unchanged (onnx's
    shape inference carries the dim, named or not), so F is 37, which no candidate is; the initial
    state [5] (a graph input, unsqueezed) is the hidden size."""
    for dim in ("F", "?"):
        model = tiny(
            f"""g (float[T, {dim}] x, float[5] h, float[1, 5, 37] W, float[1, 5, 5] R) => (float[T, 1, 1, 5] y) {{
                 a = Constant <value = int64[1] {{1}}> ()
                 s = Constant <value = int64[2] {{0, 1}}> ()
                 r = Relu (x)
                 u = Unsqueeze (r, a)
                 h0 = Unsqueeze (h, s)
                 y, yh = RNN <hidden_size = 5> (u, W, R, , , h0)
               }}""",
            zero={"W": np.s_[:, 2], "R": np.s_[:, 2]},
        )
        logs: list[str] = []
        result = shrink(model, log=logs.append)
        assert result.validation is not None and result.validation.passed, dim
        assert result.validation.input_shapes["x"][1] == 37 and result.validation.input_shapes["h"] == [5]
        assert error_against(model, result.model, result.validation.input_shapes) <= 1e-5
