"""A mask on a quantized weight removes its dequantized values: its masked elements are at the
weight's zero point (per tensor or per channel, as the op reading it says), not at 0. Masks given
by the user (`input_masked=False`), the masks `--masks-out` writes and the prune's own reference
all mean this, so that the written masks applied to the input give the prune's model. Every
result is checked with validation off, in onnxruntime, against the input with the masks applied
here in numpy (zero points read by this test from the ONNX specs), with parameter counts."""

import numpy as np
import onnx
import pytest
from conftest import params, random_feeds, run, tiny
from onnx import numpy_helper

from onnxshrink import shrink
from onnxshrink.errors import ShrinkError
from onnxshrink.prune import prune

# op -> {quantized input: (its zero point's input, the axis a vector zero point runs along)}
ZERO_POINT = {
    "DequantizeLinear": {0: (2, None)},  # None: the node's `axis` attribute (default 1)
    "ConvInteger": {1: (3, 0)},
    "MatMulInteger": {1: (3, -1)},
}


def masked_by_test(model: onnx.ModelProto, masks: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`model` with each mask applied: a float initializer multiplied by it, an integer one its
    masked elements set to the zero point of the node that reads it."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    for name, m in masks.items():
        w = numpy_helper.to_array(inits[name])
        assert m.shape == w.shape
        if np.issubdtype(w.dtype, np.floating):
            new = np.where(m != 0, w, 0).astype(w.dtype)
        else:
            node = next(n for n in out.graph.node if name in n.input)
            slot = list(node.input).index(name)
            zslot, axis = ZERO_POINT[node.op_type][slot]
            z = numpy_helper.to_array(inits[node.input[zslot]]) if len(node.input) > zslot else np.zeros(())
            if z.size > 1:
                if axis is None:
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
                shape = [1] * w.ndim
                shape[axis % w.ndim] = -1
                z = z.reshape(shape)
            new = np.where(m != 0, w, np.broadcast_to(z, w.shape)).astype(w.dtype)
        inits[name].CopyFrom(numpy_helper.from_array(new, name))
    return out


def assert_same(reference: onnx.ModelProto, shrunk: onnx.ModelProto) -> None:
    for feed in random_feeds(reference, draws=2):
        for a, b in zip(run(reference, feed), run(shrunk, feed), strict=True):
            assert a.shape == b.shape
            assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-30)


# dynamic quantization (onnxruntime's quantize_dynamic form): a per-tensor ConvInteger weight, a
# per-column MatMulInteger one
DYNAMIC = """
g (float[1, 3, 6, 6] x, uint8[8, 3, 3, 3] Wq, uint8 Wz, float Ws, float[8, 1, 1] B,
   uint8[8, 5] Mq, uint8[5] Mz, float[5] Ms) => (float[1, 6, 6, 5] y) {
  xq, xs, xz = DynamicQuantizeLinear (x)
  c = ConvInteger <pads = [1, 1, 1, 1]> (xq, Wq, xz, Wz)
  cf = Cast <to = 1> (c)
  s = Mul (xs, Ws)
  h0 = Mul (cf, s)
  h1 = Add (h0, B)
  h = Relu (h1)
  t = Transpose <perm = [0, 2, 3, 1]> (h)
  tq, ts, tz = DynamicQuantizeLinear (t)
  m = MatMulInteger (tq, Mq, tz, Mz)
  mf = Cast <to = 1> (m)
  m1 = Mul (mf, ts)
  y = Mul (m1, Ms)
}"""

# QDQ with a per-channel zero point on the first conv's weight
QDQ = """
g (float[1, 3, 6, 6] x, int8[8, 3, 3, 3] Wq, float[8] Ws, int8[8] Wz, float[8] B,
   int8[4, 8, 1, 1] Vq, float Vs, int8 Vz) => (float[1, 4, 6, 6] y) {
  w = DequantizeLinear <axis = 0> (Wq, Ws, Wz)
  v = DequantizeLinear (Vq, Vs, Vz)
  h = Conv <pads = [1, 1, 1, 1]> (x, w, B)
  r = Relu (h)
  y = Conv (r, v)
}"""


def dynamic_model(zero_points: bool):
    rng = np.random.default_rng(1)
    values = {"Wq": rng.integers(0, 256, (8, 3, 3, 3)), "Mq": rng.integers(0, 256, (8, 5))}
    if zero_points:
        values |= {"Wz": 137, "Ws": 0.013, "Mz": rng.integers(100, 160, 5), "Ms": rng.uniform(0.01, 0.03, 5)}
    else:  # zero point 0, unit scales
        values |= {"Wz": 0, "Ws": 1.0, "Mz": np.zeros(5), "Ms": np.ones(5)}
    return tiny(DYNAMIC, values=values, seed=2)


def qdq_model(zero_points: bool):
    rng = np.random.default_rng(3)
    values = {"Wq": rng.integers(-128, 128, (8, 3, 3, 3)), "Vq": rng.integers(-128, 128, (4, 8, 1, 1))}
    if zero_points:
        values |= {"Wz": rng.integers(-20, 20, 8), "Ws": rng.uniform(0.01, 0.02, 8), "Vz": -9, "Vs": 0.02}
    else:
        values |= {"Wz": np.zeros(8), "Ws": np.ones(8), "Vz": 0, "Vs": 1.0}
    return tiny(QDQ, values=values, seed=4)


def channel_masks(model: onnx.ModelProto, gone: list[int], names: dict[str, int]) -> dict[str, np.ndarray]:
    """0/1 masks of each named initializer's shape, zero at `gone` along the axis given."""
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    out = {}
    for name, axis in names.items():
        m = np.ones(inits[name], np.float32)
        index = [slice(None)] * m.ndim
        index[axis] = gone
        m[tuple(index)] = 0
        out[name] = m
    return out


@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "zero-0-unit-scales"])
@pytest.mark.parametrize(
    "build, names, removed_per_channel",
    [
        # a channel: Wq's 27 weights, B's one, Mq's row of 5
        (dynamic_model, {"Wq": 0, "B": 0, "Mq": 0}, 27 + 1 + 5),
        # a channel: Wq's 27, its scale, zero point and bias, Vq's 4 (one input column)
        (qdq_model, {"Wq": 0, "B": 0, "Vq": 1}, 27 + 1 + 1 + 1 + 4),
    ],
    ids=["dynamic", "qdq-per-channel"],
)
def test_masks_on_quantized_weights_put_them_at_their_zero_point(build, names, removed_per_channel, zero_points):
    model = build(zero_points)
    masks = channel_masks(model, [1, 4, 6], names)
    result = shrink(model, masks, input_masked=False, validate=False)
    reference = masked_by_test(model, masks)
    assert_same(reference, result.model)
    assert params(result.model) == result.after.params == params(model) - 3 * removed_per_channel


def test_a_model_already_holding_the_zero_points_is_masked_as_given():
    """The masks' check that the model holds them measures from the zero point: a model whose
    masked channels are at it is exported masked; one holding 0 there is refused by name."""
    model = dynamic_model(True)
    masks = channel_masks(model, [2, 5], {"Wq": 0, "B": 0, "Mq": 0})
    masked = masked_by_test(model, masks)
    result = shrink(masked, masks, validate=False)
    assert result.after.params == params(model) - 2 * (27 + 1 + 5)
    assert_same(masked, result.model)
    at_zero = onnx.ModelProto()
    at_zero.CopyFrom(masked)
    for t in at_zero.graph.initializer:
        if t.name == "Wq":
            w = numpy_helper.to_array(t).copy()
            w[[2, 5]] = 0
            t.CopyFrom(numpy_helper.from_array(w, "Wq"))
    with pytest.raises(ShrinkError, match="'Wq'"):
        shrink(at_zero, masks, validate=False)


@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "zero-0-unit-scales"])
@pytest.mark.parametrize("build", [dynamic_model, qdq_model], ids=["dynamic", "qdq-per-channel"])
def test_the_masks_out_of_a_quantized_prune_give_its_model(build, zero_points, tmp_path):
    model = build(zero_points)
    result = prune(model, ratio=0.5, masks_out=tmp_path / "masks.npz", validate=False, price=False)
    assert result.removed()
    masks = {k.removeprefix("onnx/"): v for k, v in np.load(tmp_path / "masks.npz").items()}
    assert any(np.issubdtype(numpy_helper.to_array(t).dtype, np.integer) for t in model.graph.initializer if t.name in masks)
    reference = masked_by_test(model, masks)
    assert_same(reference, result.shrink.model)
    again = shrink(model, tmp_path / "masks.npz", input_masked=False, validate=False)
    assert again.after.params == result.shrink.after.params == params(result.shrink.model) < params(model)
    assert_same(reference, again.model)


# A bias the exporter merged: one initializer read by two Adds (one through an Identity, as the
# legacy exporter writes a reused parameter), whose channels a residual sum ties: the prune
# removes the same channels from both reads, and its model keeps one bias, as the masks do.
MERGED = """
g (float[1, 4, 6, 6] x, float[8, 4, 3, 3] W1, float[8, 4, 3, 3] W2, float[1, 8, 1, 1] B,
   float[3, 8, 1, 1] W3) => (float[1, 3, 6, 6] y) {
  a0 = Conv <pads = [1, 1, 1, 1]> (x, W1)
  a = Add (a0, B)
  b0 = Conv <pads = [1, 1, 1, 1]> (x, W2)
  bb = Identity (B)
  b = Add (b0, bb)
  s = Add (a, b)
  r = Relu (s)
  y = Conv (r, W3)
}"""


@pytest.mark.parametrize("bias", ["random", "zero"])
def test_an_exporter_merged_initializer_stays_one_in_the_prune_and_its_masks(bias, tmp_path):
    values = {"B": np.zeros((1, 8, 1, 1))} if bias == "zero" else None
    model = tiny(MERGED, values=values, seed=5)
    result = prune(model, ratio=0.5, masks_out=tmp_path / "masks.npz", validate=False, price=False)
    kept = 8 - len(result.removed())
    assert 0 < kept < 8
    # W1 and W2's kept filters, B's kept channels once, W3's kept columns
    assert params(result.shrink.model) == result.shrink.after.params == kept * (36 + 36 + 1 + 3)
    masks = {k.removeprefix("onnx/"): v for k, v in np.load(tmp_path / "masks.npz").items()}
    again = shrink(model, masks, input_masked=False, validate=False)
    assert again.after.params == result.shrink.after.params
    reference = masked_by_test(model, masks)
    assert_same(reference, result.shrink.model)
    assert_same(reference, again.model)


def test_masks_on_a_quantized_weight_whose_readers_disagree_are_refused():
    text = """
    g (float[1, 4] x, uint8[4, 3] Mq, uint8 Za, uint8 Zb) => (int32[1, 3] y, int32[1, 3] z) {
      xq, xs, xz = DynamicQuantizeLinear (x)
      y = MatMulInteger (xq, Mq, xz, Za)
      z = MatMulInteger (xq, Mq, xz, Zb)
    }"""
    model = tiny(text, values={"Za": 3, "Zb": 9}, seed=6)
    masks = {"Mq": np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 1, 1]], np.float32)}
    with pytest.raises(ShrinkError, match="'Mq'.*zero points differ"):
        shrink(model, masks, input_masked=False, validate=False)


def test_zero_point_of_reads_what_the_graph_says():
    from onnxshrink.bind.graph import ModelIndex

    model = qdq_model(True)
    index = ModelIndex(model)
    wz = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "Wz"))
    assert index.zero_of("Wq").shape == (8, 1, 1, 1)
    assert index.zero_of("Wq").reshape(-1).tolist() == wz.tolist()
    assert int(index.zero_of("Vq")) == -9
    assert index.zero_of("B") is None  # a float weight: 0


# a quantized conv whose channels a float conv reads: the compensation folds the removed
# channels' means into the float conv's bias, and the quantized rows go to their zero point
MIXED = """
g (float[1, 3, 6, 6] x, int8[8, 3, 3, 3] Wq, float[8] Ws, int8[8] Wz, float[8] B,
   float[4, 8, 1, 1] V, float[4] C) => (float[1, 4, 6, 6] y) {
  w = DequantizeLinear <axis = 0> (Wq, Ws, Wz)
  h = Conv <pads = [1, 1, 1, 1]> (x, w, B)
  r = Relu (h)
  y = Conv (r, V, C)
}"""


@pytest.mark.parametrize("zero_points", [True, False], ids=["zero-points", "zero-0-unit-scales"])
def test_compensation_puts_quantized_rows_at_their_zero_point(zero_points, tmp_path):
    rng = np.random.default_rng(7)
    values = {"Wq": rng.integers(-128, 128, (8, 3, 3, 3))}
    if zero_points:
        values |= {"Wz": rng.integers(-20, 20, 8), "Ws": rng.uniform(0.01, 0.02, 8)}
    else:
        values |= {"Wz": np.zeros(8), "Ws": np.ones(8)}
    model = tiny(MIXED, values=values, seed=8)
    data = random_feeds(model, draws=4, seed=9)
    result = prune(
        model, ratio=0.5, compensate="bias", data=data, masks_out=tmp_path / "m.npz",
        weights_out=tmp_path / "w.npz", validate=False, price=False,
    )  # fmt: skip
    gone = len(result.removed())
    assert gone == 4
    masks = {k.removeprefix("onnx/"): v for k, v in np.load(tmp_path / "m.npz").items()}
    weights = {k.removeprefix("onnx/"): v for k, v in np.load(tmp_path / "w.npz").items()}
    assert sorted(weights) == ["C"]  # only zeroed otherwise: the quantized rows are the masks'
    reference = masked_by_test(model, masks)
    for t in reference.graph.initializer:
        if t.name in weights:
            t.CopyFrom(numpy_helper.from_array(weights[t.name].astype(np.float32), t.name))
    assert_same(reference, result.shrink.model)
    # the model the prune proved against is that one, quantized rows included (the removed
    # channels' outputs go unread, so the outputs alone would not tell rows at 0 apart)
    proved = {t.name: numpy_helper.to_array(t) for t in result.shrink.reference.graph.initializer}
    assert np.array_equal(proved["Wq"], numpy_helper.to_array(next(t for t in reference.graph.initializer if t.name == "Wq")))
    # a channel: Wq's 27, its scale, zero point and bias, V's 4 columns
    assert params(result.shrink.model) == result.shrink.after.params == params(model) - gone * (27 + 3 + 4)
