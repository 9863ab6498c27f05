"""Models as exporters other than torch.onnx write them (issue 19): `-1` dims (paddle2onnx),
weights held by Constant nodes (paddle2onnx, spox, OpenVINO's converters), contrib domains
declared and value_info without a shape (onnxruntime.quantization), integer inputs the graph
compares with constants (Silero's sample rate). Tiny ONNX-text models of each form; the shrunk
models are checked here with onnxruntime against the input, masks applied by the test."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import run, tiny
from onnx import helper, numpy_helper

from onnxshrink import shrink
from onnxshrink.prune import prune

# Conv(3->6, 3x3, padded) -> Relu -> Conv(6->4, 1x1) -> GlobalAveragePool -> Flatten: a
# classifier head as PP-OCR's cls model ends; batch, height and width dynamic.
HEAD = """
g (float[N,3,H,W] x, float[6,3,3,3] W1, float[6] B1, float[4,6,1,1] W2, float[4] B2, int64[2] S)
  => (float[N,4] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  c = Conv(r, W2, B2)
  p = GlobalAveragePool(c)
  y = Reshape(p, S)
}
"""
HEAD_PARAMS = 6 * 27 + 6 + 4 * 6 + 4  # 196
PER_FILTER = 27 + 1 + 4  # one W1 filter, its bias, one W2 column


def paddle_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as paddle2onnx writes it: every initializer a Constant node in front of the
    graph, and the batch dims of the graph's inputs and outputs stored as -1 (H and W share
    paddle2onnx's dim name "?")."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    constants = [
        helper.make_node("Constant", [], [t.name], value=t, name=f"const_{t.name}")
        for t in g.initializer
    ]
    del g.initializer[:]
    nodes = constants + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    for vi in [*g.input, *g.output]:
        dims = vi.type.tensor_type.shape.dim
        dims[0].Clear()
        dims[0].dim_value = -1
        for d in dims[2:]:
            if d.HasField("dim_param"):
                d.dim_param = "?"
    onnx.checker.check_model(out)
    return out


def head(zero: dict | None = None, seed: int = 0) -> onnx.ModelProto:
    return paddle_form(tiny(HEAD, zero=zero, seed=seed, values={"S": [-1, 4]}))


def constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return numpy_helper.to_array(n.attribute[0].t)
    raise KeyError(name)


def with_constants(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`model` with some Constant nodes' values replaced (masks applied by the test)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        if n.op_type == "Constant" and n.output[0] in values:
            n.attribute[0].t.CopyFrom(numpy_helper.from_array(values[n.output[0]], n.attribute[0].t.name))
    return out


def interface(model: onnx.ModelProto) -> list[list]:
    return [
        [d.dim_value if d.HasField("dim_value") else d.dim_param for d in vi.type.tensor_type.shape.dim]
        for vi in [*model.graph.input, *model.graph.output]
    ]


def feed(batch: int = 3, h: int = 7, w: int = 9, seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 3, h, w)).astype(np.float32)}


# ---------------------------------------------------------------------- -1 dims
def test_minus_one_dims_are_dynamic_and_the_output_keeps_them():
    model = head(zero={"W1": np.s_[[1, 4]], "B1": np.s_[[1, 4]]})
    assert interface(model) == [[-1, 3, "?", "?"], [-1, 4]]
    for kwargs in (
        {},
        {"input_shapes": {"x": [1, 3, 8, 10]}},
        {"inputs": [feed(batch=2)]},
    ):
        result = shrink(model, **kwargs)
        assert result.validation.passed
        assert result.after.params == HEAD_PARAMS - 2 * PER_FILTER  # 132
        assert interface(result.model) == [[-1, 3, "?", "?"], [-1, 4]]
        # independently: any batch and size onnxruntime takes for -1 and "?"
        for x in (feed(batch=3, h=7, w=9), feed(batch=1, h=12, w=5, seed=2)):
            (want,), (got,) = run(model, x), run(result.model, x)
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    given = shrink(model, input_shapes={"x": [1, 3, 8, 10]})
    assert given.validation.input_shapes == {"x": [1, 3, 8, 10]}


def test_a_zero_dim_is_dynamic_where_onnxruntime_only_declares_it():
    """onnxruntime enforces a graph input's 0 (an empty axis) but only warns about an output's
    or a value_info's: those are dynamic, and kept as they were."""
    model = head(zero={"W1": np.s_[[0]], "B1": np.s_[[0]]})
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 0
    vi = model.graph.value_info.add()
    vi.CopyFrom(helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [0, 6, -1, -1]))
    result = shrink(model)
    assert result.validation.passed
    assert result.after.params == HEAD_PARAMS - PER_FILTER
    assert interface(result.model) == [[-1, 3, "?", "?"], [0, 4]]
    (want,), (got,) = run(model, feed()), run(result.model, feed())
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# ---------------------------------------------------------------------- Constant-node weights
def test_masks_bind_to_constant_node_weights_by_their_output_name():
    model = head(seed=3)
    w1, b1, w2 = constant(model, "W1"), constant(model, "B1"), constant(model, "W2")
    masks = {"W1": np.ones(6, np.float32), "B1": np.ones(6, np.float32)}
    masks["W1"][[2, 5]] = masks["B1"][[2, 5]] = 0
    result = shrink(model, masks)
    assert result.validation.passed
    assert result.masks_bound == 2
    assert result.after.params == HEAD_PARAMS - 2 * PER_FILTER
    # masks applied here, to the Constant nodes' values
    keep = masks["W1"][:, None, None, None]
    masked = with_constants(model, {"W1": w1 * keep, "B1": b1 * masks["B1"]})
    for x in (feed(), feed(batch=1, h=4, w=4, seed=5)):
        (want,), (got,) = run(masked, x), run(result.model, x)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert constant(model, "W2").tobytes() == w2.tobytes()  # the caller's model is unchanged


def test_a_mask_matching_no_weight_lists_the_constant_node_weights():
    import pytest

    from onnxshrink import ShrinkError

    with pytest.raises(ShrinkError) as err:
        shrink(head(), {"conv9.weight": np.zeros(6, np.float32)})
    text = str(err.value)
    assert "1 mask(s) match no initializer" in text
    assert "the model has e.g. 'W1', 'B1', 'W2', 'B2', 'S'" in text  # float weights first


def test_masks_out_of_constant_node_weights_apply_back_to_the_original(tmp_path):
    model = head(seed=4)
    pruned = prune(model, 0.5, masks_out=tmp_path / "m.npz")
    assert pruned.shrink.validation.passed
    with np.load(tmp_path / "m.npz") as f:
        masks = {k: f[k] for k in f.files}
    assert {"W1", "B1", "W2"} <= set(masks)
    removed = int((masks["W1"].reshape(6, -1)[:, 0] == 0).sum())
    assert removed == 3
    assert pruned.shrink.after.params == HEAD_PARAMS - removed * PER_FILTER
    again = shrink(model, tmp_path / "m.npz", input_masked=False)
    assert again.after.params == pruned.shrink.after.params
    # the masks applied to the original by hand give the pruned model's function
    by_hand = with_constants(model, {k: constant(model, k) * v for k, v in masks.items()})
    for x in (feed(), feed(batch=2, h=5, w=11, seed=6)):
        (want,), (got,), (same,) = run(by_hand, x), run(pruned.model, x), run(again.model, x)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert np.abs(same - want).max() <= 1e-5 * np.abs(want).max()


# ---------------------------------------------------------------------- onnxruntime.quantization's form
def test_contrib_domains_declared_and_value_info_without_shapes():
    """onnxruntime.quantization declares its contrib domains (com.microsoft.nchwc, ...) and
    writes value_info entries with a type but no shape, the graph output's too: the output is
    declared as the input declared it."""
    model = tiny(HEAD, zero={"W1": np.s_[[0, 3]], "B1": np.s_[[0, 3]]}, values={"S": [-1, 4]})
    for domain in ("com.microsoft", "com.microsoft.nchwc", "com.microsoft.experimental"):
        model.opset_import.append(helper.make_opsetid(domain, 1))
    for name in ("h", "r", "c", "y"):
        model.graph.value_info.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    onnx.checker.check_model(model)
    result = shrink(model)
    assert result.validation.passed
    assert result.after.params == HEAD_PARAMS - 2 * PER_FILTER
    assert interface(result.model) == [["N", 3, "H", "W"], ["N", 4]]
    (want,), (got,) = run(model, feed()), run(result.model, feed())
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# ---------------------------------------------------------------------- integer inputs compared
# A sample rate picks the branch, as in Silero VAD: 16000 runs, any other value takes a branch
# that fails (a Reshape of 4 values into rows of 3).
RATE = """
g (float[N,6] x, int64 sr, float[6,8] W1, float[8,4] W2, int64[] Rate, int64[2] Rows) => (float[N,4] y) {
  h = MatMul(x, W1)
  r = Relu(h)
  z = MatMul(r, W2)
  is16k = Equal(sr, Rate)
  y = If(is16k) <
    then_branch = g1 () => (float[N,4] o1) { o1 = Identity(z) },
    else_branch = g2 () => (float[N,4] o2) { o2 = Reshape(z, Rows) }
  >
}
"""


def test_an_integer_input_is_drawn_among_the_values_the_graph_compares_it_with():
    model = tiny(RATE, zero={"W1": np.s_[:, [2, 5, 6]]}, values={"Rate": 16000, "Rows": [3, -1]})
    result = shrink(model)
    assert result.validation.passed
    assert result.after.params == 6 * 8 + 8 * 4 - 3 * (6 + 4)  # 50 (int64 constants are not parameters)
    x = np.random.default_rng(2).standard_normal((2, 6)).astype(np.float32)
    feeds = {"x": x, "sr": np.asarray(16000, np.int64)}
    (want,), (got,) = run(model, feeds), run(result.model, feeds)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_compared_values_are_followed_through_ops_that_move_them():
    """Silero's op18 export: Reshape(sr, [1]) -> Gather(.., 0) -> Equal(.., 16000)."""
    from onnxshrink.proof.inputs import compared_values, make_inputs

    text = RATE.replace("int64[2] Rows)", "int64[2] Rows, int64[1] One, int64 Zero)").replace(
        "is16k = Equal(sr, Rate)",
        "v = Reshape(sr, One)\n  s = Gather(v, Zero)\n  is16k = Equal(Rate2, s)",
    ).replace("int64[] Rate,", "int64[] Rate2,")
    model = tiny(text, values={"Rate2": 8000, "Rows": [3, -1], "One": [1], "Zero": 0})
    assert compared_values(model) == {"sr": [8000]}
    draws = make_inputs(model, {"x": [1, 6], "sr": []}, 3, seed=0)
    assert [int(d["sr"]) for d in draws] == [8000, 8000, 8000]


def test_given_inputs_that_run_are_not_blamed_when_the_random_draws_fail():
    """The rate is computed (Add of two constants): nothing to draw; the draws of 0 and 1 take
    the failing branch, the given 16000 does not."""
    import pytest

    from onnxshrink import ShrinkError

    text = RATE.replace("int64[] Rate,", "int64[] Half, int64[] Other,").replace(
        "is16k = Equal(sr, Rate)", "rate = Add(Half, Other)\n  is16k = Equal(sr, rate)"
    )
    model = tiny(text, zero={"W1": np.s_[:, [1]]}, values={"Half": 8000, "Other": 8000, "Rows": [3, -1]})
    x = np.random.default_rng(3).standard_normal((2, 6)).astype(np.float32)
    good = {"x": x, "sr": np.asarray(16000, np.int64)}
    with pytest.raises(ShrinkError) as err:
        shrink(model, inputs=[good])
    text = str(err.value)
    assert "on random inputs (the arrays given with --inputs run: --draws 0 proves it" in text
    assert "integer input(s) 'sr' drawn at random" in text
    assert "Check them" not in text
    with pytest.raises(ShrinkError) as err:
        shrink(model, inputs=[{"x": x, "sr": np.asarray(3, np.int64)}])
    assert "on the arrays given with --inputs. Check them against the model's inputs." in str(err.value)
    result = shrink(model, inputs=[good], draws=0)
    assert result.validation.passed and result.validation.draws == 1
    assert result.after.params == 6 * 8 + 8 * 4 - (6 + 4)
    (want,), (got,) = run(model, good), run(result.model, good)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


# ---------------------------------------------------------------------- validation shapes
# Five stride-2 convs (a stride of 32), the last map upsampled x2 and concatenated with the one
# before it (a YOLO neck): at 16x16 the maps are 1x1 and 2x2 after the Resize, which the Concat
# refuses; any multiple of 32 works.
NECK = """
g (float[N,3,H,W] x, float[4,3,3,3] W1, float[4,4,3,3] W2, float[4,4,3,3] W3, float[4,4,3,3] W4,
   float[4,4,3,3] W5, float[6,8,1,1] W6, float[4] Scales) => (float[N,6,A,B] y) {
  c1 = Conv<strides=[2,2], pads=[1,1,1,1]>(x, W1)
  c2 = Conv<strides=[2,2], pads=[1,1,1,1]>(c1, W2)
  c3 = Conv<strides=[2,2], pads=[1,1,1,1]>(c2, W3)
  c4 = Conv<strides=[2,2], pads=[1,1,1,1]>(c3, W4)
  c5 = Conv<strides=[2,2], pads=[1,1,1,1]>(c4, W5)
  u = Resize<mode="nearest">(c5, , Scales)
  k = Concat<axis=1>(u, c4)
  y = Conv(k, W6)
}
"""
NECK_PARAMS = 4 * 27 + 4 * 4 * 36 + 6 * 8 + 4  # 736


def test_dynamic_sizes_are_chosen_so_the_models_downsampling_survives():
    from onnxshrink.proof.inputs import resolve_shapes

    model = tiny(NECK, values={"Scales": [1, 1, 2, 2]}, zero={"W2": np.s_[[1, 3]]})
    assert resolve_shapes(model, {}) == {"x": [2, 3, 32, 32]}
    assert resolve_shapes(model, {"x": [1, 3, 64, 96]}) == {"x": [1, 3, 64, 96]}
    result = shrink(model)
    assert result.validation.passed
    assert result.validation.input_shapes == {"x": [2, 3, 32, 32]}
    assert "| random inputs x:2,3,32,32" in result.validation.lines()[0]
    assert result.to_dict()["validation"]["input_shapes"] == {"x": [2, 3, 32, 32]}
    # W2's filters 1 and 3 and W3's input channels 1 and 3
    assert result.after.params == NECK_PARAMS - 2 * 4 * 9 - 2 * 4 * 9
    x = np.random.default_rng(4).standard_normal((1, 3, 64, 96)).astype(np.float32)
    (want,), (got,) = run(model, {"x": x}), run(result.model, {"x": x})
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_chosen_size_leaves_every_map_an_element():
    """Three stride-2 convs, then a 3x3 pooling without padding: 16 leaves it a 2x2 map, which
    the pooling cannot take; 24 (the first multiple of 8 where it has 3x3) can."""
    from onnxshrink.proof.inputs import resolve_shapes

    text = """
    g (float[N,2,H,W] x, float[2,2,3,3] W1, float[2,2,3,3] W2, float[2,2,3,3] W3) => (float[N,2,A,B] y) {
      c1 = Conv<strides=[2,2], pads=[1,1,1,1]>(x, W1)
      c2 = Conv<strides=[2,2], pads=[1,1,1,1]>(c1, W2)
      c3 = Conv<strides=[2,2], pads=[1,1,1,1]>(c2, W3)
      y = AveragePool<kernel_shape=[3,3]>(c3)
    }
    """
    assert resolve_shapes(tiny(text), {}) == {"x": [2, 2, 24, 24]}
    assert resolve_shapes(tiny(text.replace("[3,3]>", "[2,2]>")), {}) == {"x": [2, 2, 16, 16]}


# ---------------------------------------------------------------------- reports
def test_prune_reports_the_input_as_its_file_holds_it_at_the_proofs_shapes():
    """Before/after on the same footing: the unpruned input's nodes and parameters as the file
    holds them (Constant-node weights are nodes there; the reference makes some initializers),
    and MACs of both at the shapes the proof drew."""
    from onnxshrink.report import model_stats

    model = head(seed=4)
    pruned = prune(model, 0.5)
    before, after = pruned.shrink.before, pruned.shrink.after
    shapes = pruned.shrink.validation.input_shapes
    assert shapes == {"x": [2, 3, 16, 16]}
    assert before.input_shapes == after.input_shapes == shapes
    assert before.nodes == len(model.graph.node) == 10  # 5 of them Constant nodes
    assert before.params == HEAD_PARAMS
    assert before.macs == model_stats(model, shapes).macs == 2 * 16 * 16 * (6 * 27 + 4 * 6)
    assert after.macs == 2 * 16 * 16 * (3 * 27 + 4 * 3)
    assert after.params == HEAD_PARAMS - 3 * PER_FILTER
    assert pruned.original == before
    assert pruned.to_dict()["shrink"]["before"]["input_shapes"] == shapes


def test_a_weight_untied_for_a_mask_is_counted_once_before():
    """Two convs read one initializer (an exporter merged their equal weights); a mask on one
    of them unties it in the reference. The table's before is the file: the weight once."""
    text = """
    g (float[1,3,8,8] x, float[4,3,3,3] W, float[2,4,1,1] W3) => (float[1,2,8,8] y) {
      a = Conv<pads=[1,1,1,1]>(x, W)
      b = Conv<pads=[1,1,1,1]>(x, W)
      s = Add(a, b)
      y = Conv(s, W3)
    }
    """
    model = tiny(text)
    for n, name in zip(model.graph.node, ["/conv1/Conv", "/conv2/Conv", "/Add", "/conv3/Conv"], strict=True):
        n.name = name
    for t in model.graph.initializer:
        t.name = {"W": "conv1.weight", "W3": "conv3.weight"}[t.name]
    for n in model.graph.node:
        n.input[:] = [{"W": "conv1.weight", "W3": "conv3.weight"}.get(i, i) for i in n.input]
    mask = np.ones(4, np.float32)
    mask[1] = 0
    result = shrink(model, {"conv2.weight": mask})
    assert result.shared_initializers == {"conv1.weight": ["conv2.weight"]}
    assert result.validation.passed
    assert result.before.params == 4 * 27 + 2 * 4 == 116  # the file's: W once
    assert result.before.nodes == 4
    assert result.after.params == 2 * 4 * 27 + 2 * 4  # the shrunk model holds both copies whole


def test_a_failed_run_writes_a_report_with_the_keys_of_a_passing_one(tmp_path, monkeypatch):
    """--keep-failed: the model and the report are written; the report has every key a passing
    run's has, a prune's as a prune's. The proof is made to fail by a negative tolerance."""
    import json

    import onnxshrink.stages.attempt
    from onnxshrink.api import ShrinkResult
    from onnxshrink.cli import main

    onnx.save(head(seed=4), tmp_path / "m.onnx")
    base = [str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"), "--no-recover", "--keep-failed"]

    def report(*extra: str) -> tuple[int, dict]:
        code = main([*base, "--report", str(tmp_path / "r.json"), *extra])
        return code, json.loads((tmp_path / "r.json").read_text())

    passed_prune, passed_shrink = report("--prune", "0.5"), report()
    assert passed_prune[0] == passed_shrink[0] == 0
    real = onnxshrink.stages.attempt.compare
    monkeypatch.setattr(onnxshrink.stages.attempt, "compare", lambda ref, new, opts, *a: real(ref, new, opts.but(rtol=-1.0), *a))
    failed_prune, failed_shrink = report("--prune", "0.5"), report()
    assert failed_prune[0] == failed_shrink[0] == 1
    for ok, bad in ((passed_prune[1], failed_prune[1]), (passed_shrink[1], failed_shrink[1])):
        assert ok["error"] is None and "does not match the reference" in bad["error"]
        assert set(ok) == set(bad)
    assert set(passed_prune[1]["shrink"]) == set(failed_prune[1]["shrink"]) == set(passed_shrink[1]) - {"error"}
    assert failed_prune[1]["shrink"]["passed"] is False
    assert failed_prune[1]["shrink"]["before"]["params"] == HEAD_PARAMS  # the input, as a passing one says
    assert failed_prune[1]["layers"] == passed_prune[1]["layers"]
    assert set(ShrinkResult.empty_report()) == set(passed_shrink[1]) - {"error"}
