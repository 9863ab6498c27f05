"""Old IRs and opsets, read as they are: IR 3 (initializers also listed as graph inputs), opset 7
to 9. Whatever the rewrite inserts is valid at the model's own opset (no ConstantOfShape before
opset 9, no Slice with bound inputs before 10, no multidirectional broadcasting before 7). Each shrunk model is checked with onnx's full
checker and, in onnxruntime, against the input."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import cli, error_against
from onnx import TensorProto, helper, numpy_helper

from onnxshrink import shrink
from onnxshrink.cli import main


def _model(nodes, inputs, outputs, arrays, opset: int, ir: int) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    if ir < 4:  # IR 3: every initializer is a graph input too
        inputs = inputs + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "old", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)
    onnx.checker.check_model(model, full_check=True)
    return model


def vgg_like(opset: int, ir: int, spatial: tuple = (8, 8)) -> onnx.ModelProto:
    """Conv(3->8)+BN -> Relu -> Conv(8->6, padded)+BN -> Relu -> GlobalAveragePool -> Flatten ->
    Gemm(6->4). Filters 1 and 5 of the first conv are zeroed, their BatchNorm left: constants
    (its shift) that the padded second conv folds with a border correction. Filters 0 and 3 of
    the second conv are zeroed with their BatchNorm's scale and shift: zero channels."""
    rng = np.random.default_rng(7)
    f32 = np.float32

    def bn(c: int) -> list[np.ndarray]:
        return [rng.uniform(0.5, 1.5, c).astype(f32), rng.standard_normal(c).astype(f32),
                rng.standard_normal(c).astype(f32), rng.uniform(0.5, 2, c).astype(f32)]  # fmt: skip

    w1, w2 = rng.standard_normal((8, 3, 3, 3)).astype(f32), rng.standard_normal((6, 8, 3, 3)).astype(f32)
    w1[[1, 5]] = 0
    bn1, bn2 = bn(8), bn(6)
    bn1[1][[1, 5]], bn1[2][[1, 5]] = 0.5, -1.0  # shift > 0: constants relu passes on
    w2[[0, 3]] = 0
    bn2[0][[0, 3]] = 0
    bn2[1][[0, 3]] = 0
    arrays = {"W1": w1, "W2": w2, "Wfc": rng.standard_normal((4, 6)).astype(f32), "Bfc": rng.standard_normal(4).astype(f32)}
    for k, values in ((1, bn1), (2, bn2)):
        arrays.update({f"{name}{k}": v for name, v in zip("sbmv", values, strict=True)})
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1"], name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"], name="bn2"),
        helper.make_node("Relu", ["n2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="gap"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "Wfc", "Bfc"], ["y"], transB=1, name="fc"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, *spatial])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    return _model(nodes, [x], [y], arrays, opset, ir)


def shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(t.dims) for t in model.graph.initializer}


def test_ir3_opset7_model_shrinks_as_it_is(tmp_path, capsys):
    model = vgg_like(opset=7, ir=3)
    path = tmp_path / "old.onnx"
    onnx.save(model, path)

    result = shrink(path, validate=False)
    small = result.model
    assert small.ir_version == 3 and [o.version for o in small.opset_import] == [7]
    onnx.checker.check_model(small, full_check=True)  # initializers listed as inputs again
    listed = {i.name for i in small.graph.input}
    assert {t.name for t in small.graph.initializer} <= listed
    got = shapes(small)
    assert got["W1"] == (6, 3, 3, 3) and got["s1"] == (6,)
    assert got["W2"] == (4, 6, 3, 3) and got["s2"] == (4,)
    assert got["Wfc"] == (4, 4)
    # the border correction at opset 7 (no ConstantOfShape): a stored map of ones, a kernel
    assert "ConstantOfShape" not in {n.op_type for n in small.graph.node}
    inserted = {n: s for n, s in got.items() if n.startswith("onnxshrink_")}
    assert sorted(inserted.values()) == [(1, 1, 8, 8), (4, 1, 3, 3)]
    assert result.after.params == 162 + 4 * 6 + 216 + 4 * 4 + 16 + 4 + 36 + 64
    assert error_against(model, small) <= 1e-5

    # with the proof, from the command line: first proof passes, nothing kept back
    assert main([str(path), "-o", str(tmp_path / "small.onnx")]) == 0
    out = capsys.readouterr().out
    assert "[I]     PASSED | All outputs matched | Outputs: ['y']" in out
    assert "first proof failed" not in out


def test_opset7_ir8_border_correction_needs_no_newer_op(tmp_path):
    model = vgg_like(opset=7, ir=8)
    result = shrink(model, validate=False)
    onnx.checker.check_model(result.model, full_check=True)
    assert [o.version for o in result.model.opset_import] == [7]
    assert "ConstantOfShape" not in {n.op_type for n in result.model.graph.node}
    assert result.model.graph.input[0].name == "x" and len(result.model.graph.input) == 1
    assert error_against(model, result.model) <= 1e-5
    # the same model at opset 9 gets its ones from ConstantOfShape (nothing stored)
    newer = shrink(vgg_like(opset=9, ir=8), validate=False).model
    assert "ConstantOfShape" in {n.op_type for n in newer.graph.node}
    assert (1, 1, 8, 8) not in shapes(newer).values()


def test_opset8_dynamic_spatial_size_tiles_its_ones(tmp_path):
    """Dynamic height and width at opset 8: the map of ones is a Tile of a one, sized from the
    input's shape (Slice with attribute bounds)."""
    model = vgg_like(opset=8, ir=4, spatial=("H", "W"))
    result = shrink(model, validate=False, input_shapes={"x": [1, 3, 8, 8]})
    small = result.model
    onnx.checker.check_model(small, full_check=True)
    ops = [n.op_type for n in small.graph.node]
    assert "Tile" in ops and "ConstantOfShape" not in ops
    slices = [n for n in small.graph.node if n.op_type == "Slice"]
    assert slices and all(len(n.input) == 1 for n in slices)  # opset < 10: bounds as attributes
    for size in ([1, 3, 8, 8], [1, 3, 11, 5]):
        assert error_against(model, small, {"x": size}) <= 1e-5


def test_opset7_ir8_through_the_command_line(tmp_path):
    """The case that was an internal error (the rewrite inserted ConstantOfShape, opset 9+):
    exit 0, the proof passes, the output stays at opset 7 and computes what the input does."""
    model = vgg_like(opset=7, ir=8)
    onnx.save(model, tmp_path / "old.onnx")
    p = cli("old.onnx", "-o", "small.onnx", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "[I]     PASSED | All outputs matched | Outputs: ['y']" in p.stdout
    small = onnx.load(tmp_path / "small.onnx")
    assert [o.version for o in small.opset_import] == [7]
    onnx.checker.check_model(small, full_check=True)
    assert shapes(small)["W2"] == (4, 6, 3, 3)
    assert error_against(model, small) <= 1e-5
