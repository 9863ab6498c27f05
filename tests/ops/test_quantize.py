"""Quantized models (ops/quantize.py): QDQ, dynamic quantization and the QLinear operator form.
The reference is the quantized model itself: masked weights quantize to their zero point."""

import logging

import numpy as np
import onnx
import pytest
from conftest import export_cached, half_masked, init, params, run, shapes, shrink_checked, tiny

from models.transformers import TRANSFORMERS
from models.zoo import ZOO

QDQ = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 3, 6, 6] x, int8[8, 3, 3, 3] Wq, float[8] Ws, int8[8] Wz, int8[4, 8, 1, 1] Vq, float[4] Vs, int8[4] Vz, float S, uint8 Z) => (float[1, 4, 6, 6] y) {
  w = DequantizeLinear <axis = 0> (Wq, Ws, Wz)
  v = DequantizeLinear <axis = 0> (Vq, Vs, Vz)
  xq = QuantizeLinear (x, S, Z)
  xd = DequantizeLinear (xq, S, Z)
  h = Conv <pads = [1, 1, 1, 1]> (xd, w)
  r = Relu (h)
  hq = QuantizeLinear (r, S, Z)
  hd = DequantizeLinear (hq, S, Z)
  y = Conv (hd, v)
}"""


def qdq_values(dead_filters):
    rng = np.random.default_rng(0)
    wz = rng.integers(-3, 3, 8).astype(np.int8)
    wq = rng.integers(-100, 100, (8, 3, 3, 3)).astype(np.int8)
    wq[dead_filters] = wz[dead_filters, None, None, None]  # masked: the zero point
    return {
        "Wq": wq, "Wz": wz, "Ws": rng.uniform(0.01, 0.02, 8), "Vs": rng.uniform(0.01, 0.02, 4),
        "Vz": np.zeros(4), "S": 0.05, "Z": 128,
    }  # fmt: skip


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
def test_qdq_masked_filters_go_with_their_per_channel_scales_and_zero_points(domain):
    dead = [1, 4, 5]
    model = tiny(QDQ, values=qdq_values(dead))
    if domain:  # onnxruntime's own Q/DQ ops
        model.opset_import.append(onnx.helper.make_opsetid(domain, 1))
        for n in model.graph.node:
            if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
                n.domain = domain
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == (5, 3, 3, 3) and s["Ws"] == s["Wz"] == (5,)  # per channel: sliced
    assert s["Vq"] == (4, 5, 1, 1) and s["Vs"] == s["Vz"] == (4,)
    assert s["S"] == s["Z"] == ()  # per tensor: kept
    assert not result.barriers


DYNAMIC = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 8] x, float[8, 16] W1, float[16] B1, int8[16, 8] Wq, int8 Wz, float Ws) => (float[1, 4, 8] y) {
  h = MatMul (x, W1)
  a = Add (h, B1)
  r = Relu (a)
  q, qs, qz = DynamicQuantizeLinear (r)
  p = MatMulInteger (q, Wq, qz, Wz)
  f = Cast <to = 1> (p)
  s = Mul (qs, Ws)
  y = Mul (f, s)
}"""
NEURONS = [1, 4, 6, 9, 12]


def test_dynamic_quantization_zero_features_go_and_constant_ones_stay():
    zeroed = tiny(DYNAMIC, zero={"W1": np.s_[:, NEURONS], "B1": np.s_[NEURONS]})
    result = shrink_checked(zeroed)
    assert shapes(result.model)["W1"] == (8, 11) and shapes(result.model)["Wq"] == (11, 8)
    # The bias left: relu(bias) is a constant the dynamic range sees. It stays, even with the
    # quantized weight's rows for it at the zero point (unread), and the reason says so.
    values = {
        "B1": np.linspace(0.1, 1, 16),
        "Wz": 3,
        "Wq": np.where(np.isin(np.arange(16), NEURONS)[:, None], 3, np.full((16, 8), 7)),
    }
    result = shrink_checked(tiny(DYNAMIC, zero={"W1": np.s_[:, NEURONS]}, values=values))
    assert shapes(result.model)["Wq"] == (16, 8)
    [kept] = [g for g in result.kept_zeroed if g.tensor == "W1"]
    assert kept.count == len(NEURONS) and kept.kind == "normalization"
    assert "computed from every element" in kept.reason


STATIC_A = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 8] x, float[8, 16] W1, float S, uint8 Z, int8[16, 8] Wq, int8 Wz) => (int32[1, 4, 8] y) {
  h = MatMul (x, W1)
  q = QuantizeLinear (h, S, Z)
  y = MatMulInteger (q, Wq, Z, Wz)
}"""


def test_matmul_integer_unread_features_go_with_their_weight_rows():
    # The features' rows of the quantized weight are at its zero point: unread. (Quantized
    # statically: with DynamicQuantizeLinear the range would still see them.)
    rows = np.isin(np.arange(16), NEURONS)[:, None]
    values = {"S": 0.05, "Z": 128, "Wz": 3, "Wq": np.where(rows, 3, np.full((16, 8), 7))}
    result = shrink_checked(tiny(STATIC_A, values=values))
    assert shapes(result.model)["Wq"] == (11, 8) and shapes(result.model)["W1"] == (8, 11)


CONV_INTEGER = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 3, 6, 6] x, float[8, 3, 3, 3] W, int8[4, 8, 3, 3] Vq, int8 Vz) => (int32[1, 4, 6, 6] y) {
  h = Conv <pads = [1, 1, 1, 1]> (x, W)
  r = Relu (h)
  q, qs, qz = DynamicQuantizeLinear (r)
  y = ConvInteger <pads = [1, 1, 1, 1]> (q, Vq, qz, Vz)
}"""


def test_conv_integer_a_channel_at_its_zero_point_goes_even_with_padding():
    # onnxruntime pads ConvInteger's input with its zero point (as onnx's reference does):
    # the integer output is exactly equal after the channels are removed.
    model = tiny(CONV_INTEGER, zero={"W": np.s_[[0, 3, 7]]})
    result = shrink_checked(model)
    assert shapes(result.model)["W"] == (5, 3, 3, 3) and shapes(result.model)["Vq"] == (4, 5, 3, 3)
    feed = {"x": np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32)}
    [a], [b] = run(model, feed), run(result.model, feed)
    assert a.dtype == np.int32 and np.array_equal(a, b)  # integer outputs: equal


QLINEAR = """<ir_version: 8, opset_import: ["" : 17]>
g (uint8[1, 3, 3, 3] x, float Xs, uint8 Xz, int8[8, 3, 3, 3] Wq, float[8] Ws, int8[8] Wz, float Ys, uint8 Yz, int32[8] B, int8[8, 4] Mq, float Ms, int8 Mz, float Os, uint8 Oz) => (uint8[1, 1, 4] y) {
  c = QLinearConv (x, Xs, Xz, Wq, Ws, Wz, Ys, Yz, B)
  shape = Constant <value = int64[3] {1, 1, 8}> ()
  s = Reshape (c, shape)
  y = QLinearMatMul (s, Ys, Yz, Mq, Ms, Mz, Os, Oz)
}"""


def test_qlinear_conv_dead_filters_are_their_zero_point_and_go():
    rng = np.random.default_rng(2)
    wz = rng.integers(-2, 2, 8).astype(np.int8)
    wq = rng.integers(-60, 60, (8, 3, 3, 3)).astype(np.int8)
    dead = [2, 5]
    wq[dead] = wz[dead, None, None, None]
    values = {
        "Wq": wq, "Wz": wz, "Ws": rng.uniform(0.01, 0.02, 8), "Xs": 0.02, "Xz": 120, "Ys": 0.05,
        "Yz": 128, "B": np.where(np.isin(np.arange(8), dead), 0, rng.integers(-50, 50, 8)),
        "Ms": 0.01, "Mz": 0, "Os": 0.1, "Oz": 100,
    }  # fmt: skip
    model = tiny(QLINEAR, values=values)
    # the dead channels' output is the zero point (bias 0): QLinearMatMul's rows for them need
    # not be masked, the features equal their zero point
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == (6, 3, 3, 3) and s["Ws"] == s["Wz"] == s["B"] == (6,) and s["Mq"] == (6, 4)
    feed = {"x": np.random.default_rng(3).integers(0, 255, (1, 3, 3, 3)).astype(np.uint8)}
    [a], [b] = run(model, feed), run(result.model, feed)
    assert np.array_equal(a, b)


# ------------------------------------------------------------------ the zoo, quantized
class _Calibration:
    def __init__(self, model: onnx.ModelProto):
        from onnxshrink.proof.inputs import make_inputs, resolve_shapes

        self.feeds = iter(make_inputs(model, resolve_shapes(model, {}), 4, seed=5))

    def get_next(self):
        return next(self.feeds, None)


def quantized(zoo_dir, name: str, which: str, how: str):
    """A zoo model with half its channel groups masked (or natively built with the rest),
    exported, then quantized by onnxruntime.quantization: static QDQ per channel, or dynamic."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        quantize_dynamic,
        quantize_static,
    )

    entry = ZOO[name] if name in ZOO else TRANSFORMERS[name]
    build = half_masked(entry, which, dynamo=False)
    path = export_cached(zoo_dir, ("q", name, which), build)
    out = path.with_name(f"{path.stem}_{how}.onnx")
    if not out.exists():
        logging.disable(logging.WARNING)
        try:
            if how == "static":
                reader = type("Reader", (_Calibration, CalibrationDataReader), {})(onnx.load(path))
                quantize_static(path, out, reader, quant_format=QuantFormat.QDQ, per_channel=True)
            else:
                quantize_dynamic(path, out, per_channel=True)
        finally:
            logging.disable(logging.NOTSET)
    return out


@pytest.mark.parametrize("name", ["resnet_basic", "bert"])
@pytest.mark.parametrize("how", ["static", "dynamic"])
def test_quantized_zoo_models_reach_the_quantized_native_size(zoo_dir, name, how):
    masked = quantized(zoo_dir, name, "masked", how)
    native = quantized(zoo_dir, name, "native", how)
    ops = {n.op_type for n in onnx.load(masked).graph.node}
    assert ({"QuantizeLinear", "DequantizeLinear"} if how == "static" else {"DynamicQuantizeLinear"}) <= ops
    result = shrink_checked(masked)  # against the quantized model: its zero points are the masks
    assert params(result.model) == result.after.params == params(onnx.load(native))
    assert result.after.params < 0.7 * result.before.params
    assert not result.barriers


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32])
@pytest.mark.parametrize("axis", [None, 1])
def test_dequantize_of_constants_is_onnxruntimes_bit_for_bit(dtype, axis):
    """DequantizeLinear of a constant is computed in numpy (no session per weight): the same
    float32 bits as onnxruntime's kernel."""
    import onnx_graphsurgeon as gs

    from onnxshrink.core.evaluate import evaluate
    from onnxshrink.ops.quantize import QuantizeDequantize

    rng = np.random.default_rng(7)
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max, (3, 5, 4), endpoint=True).astype(dtype)
    shape = (5,) if axis is not None else ()
    scale = rng.uniform(1e-4, 3, shape).astype(np.float32)
    zp = rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dtype)
    node = gs.Node(
        "DequantizeLinear",
        inputs=[gs.Variable("x", dtype=dtype), gs.Variable("s"), gs.Variable("z")],
        outputs=[gs.Variable("y", dtype=np.float32)],
        attrs={"axis": axis} if axis is not None else {},
    )
    ours = QuantizeDequantize.dequantized(node, v, [scale, zp], axis, 3)
    theirs = evaluate(node, [v, scale, zp], 21, ort=True)[0]
    assert ours is not None and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


GROUPED_QDQ = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 5, 5] x, int8[8, 4, 3, 3] Aq, float As, int8[4, 2, 3, 3] Gq, float[4] Gs, int8[4] Gz) => (float[1, 4, 5, 5] y) {
  a = DequantizeLinear (Aq, As)
  h = Conv <pads = [1, 1, 1, 1]> (x, a)
  r = Relu (h)
  w = DequantizeLinear <axis = 0> (Gq, Gs, Gz)
  y = Conv <group = 4, pads = [1, 1, 1, 1]> (r, w)
}"""


def test_a_grouped_conv_of_a_dequantized_weight_is_cut_per_group_at_its_integers():
    # One input channel of each group of two is masked: every group keeps one, and the weight
    # (held by the DequantizeLinear, per output channel) is cut per group.
    rng = np.random.default_rng(8)
    values = {"Aq": rng.integers(-90, 90, (8, 4, 3, 3)), "As": 0.02, "Gq": rng.integers(-90, 90, (4, 2, 3, 3)),
              "Gs": rng.uniform(0.01, 0.02, 4), "Gz": rng.integers(-3, 3, 4)}  # fmt: skip
    model = tiny(GROUPED_QDQ, values=values, zero={"Aq": np.s_[[0, 2, 5, 7]]})
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Aq"] == (4, 4, 3, 3) and s["Gq"] == (4, 1, 3, 3) and s["Gs"] == s["Gz"] == (4,)
    gq = [n for n in onnx.load_from_string(result.model.SerializeToString()).graph.initializer if n.name == "Gq"][0]
    kept = np.asarray([1, 1, 0, 0])  # the unmasked channel of each group (0 2 | 5 7 masked)
    assert np.array_equal(onnx.numpy_helper.to_array(gq), values["Gq"][np.arange(4), kept][:, None])


DEPTHWISE_QOP = """<ir_version: 8, opset_import: ["" : 17]>
g (uint8[1, 3, 6, 6] x, int8[4, 3, 3, 3] Wq, float[4] Ws, int8[4] Wz, int32[4] Wb, int8[4, 1, 3, 3] Dq, float[4] Ds,
   int8[4] Dz, int32[4] Db, int8[2, 4, 1, 1] Pq, float Ps, int8 Pz, float Xs, uint8 Xz, float Hs, uint8 Hz) => (uint8[1, 2, 6, 6] y) {
  h = QLinearConv <pads = [1, 1, 1, 1]> (x, Xs, Xz, Wq, Ws, Wz, Hs, Hz, Wb)
  d = QLinearConv <group = 4, pads = [1, 1, 1, 1]> (h, Hs, Hz, Dq, Ds, Dz, Hs, Hz, Db)
  y = QLinearConv (d, Hs, Hz, Pq, Ps, Pz, Hs, Hz)
}"""


def test_a_depthwise_qlinearconv_loses_the_channels_at_their_zero_point():
    rng = np.random.default_rng(9)
    wz, dz = rng.integers(-3, 3, 4), rng.integers(-3, 3, 4)
    wq, dq = rng.integers(-60, 60, (4, 3, 3, 3)), rng.integers(-60, 60, (4, 1, 3, 3))
    wq[1], wb, db = wz[1], rng.integers(-200, 200, 4), rng.integers(-200, 200, 4)
    wb[1] = db[1] = 0  # channel 1: its filter at the zero point, no bias: the output zero point
    values = {"Wq": wq, "Ws": rng.uniform(0.005, 0.01, 4), "Wz": wz, "Wb": wb, "Dq": dq, "Ds": rng.uniform(0.01, 0.02, 4),
              "Dz": dz, "Db": db, "Pq": rng.integers(-60, 60, (2, 4, 1, 1)), "Ps": 0.01, "Pz": 1, "Xs": 0.02,
              "Xz": 120, "Hs": 0.05, "Hz": 128}  # fmt: skip
    model = tiny(DEPTHWISE_QOP, values=values)
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == (3, 3, 3, 3) and s["Dq"] == (3, 1, 3, 3) and s["Db"] == (3,) and s["Pq"] == (2, 3, 1, 1)
    [depthwise] = [n for n in result.model.graph.node if n.input[3:4] == ["Dq"]]
    assert [a.i for a in depthwise.attribute if a.name == "group"] == [3]
    feed = {"x": rng.integers(0, 255, (1, 3, 6, 6)).astype(np.uint8)}
    assert np.array_equal(run(model, feed)[0], run(result.model, feed)[0])  # integer output: equal


# onnxruntime's older dynamic quantizer (ddddocr's common_old.onnx): the float bias is rounded
# into ConvInteger's int32 accumulator at run time, Cast(Floor(bias / (x_scale * w_scale))), and
# the sum is scaled back by the same product. A filter at its zero point with a zero bias adds 0 /
# scale there: 0, or NaN where the scale is 0 (an input whose range underflows it), which the
# cast to int32 leaves undefined: 0 wherever it is defined. So the channel is 0 and goes.
OLD_DYNAMIC = """<ir_version: 8, opset_import: ["" : 13]>
g (float[1, 3, 6, 6] x, uint8[8, 3, 3, 3] Wq, float Ws, uint8 Wz, float[8] Wb, int64[4] Shape,
   uint8[4, 8, 1, 1] Vq, float Vs, uint8 Vz, float[4] Vb) => (float[1, 4, 6, 6] y) {
  xq, xs, xz = DynamicQuantizeLinear (x)
  bs = Mul (xs, Ws)
  bd = Div (Wb, bs)
  bf = Floor (bd)
  bi = Cast <to = 6> (bf)
  br = Reshape (bi, Shape)
  acc = ConvInteger <pads = [1, 1, 1, 1]> (xq, Wq, xz, Wz)
  a = Add (acc, br)
  af = Cast <to = 1> (a)
  os = Mul (xs, Ws)
  h = Mul (af, os)
  r = Relu (h)
  rq, rs, rz = DynamicQuantizeLinear (r)
  cs = Mul (rs, Vs)
  cd = Div (Vb, cs)
  cf = Floor (cd)
  ci = Cast <to = 6> (cf)
  cr = Reshape (ci, Shape)
  acc2 = ConvInteger (rq, Vq, rz, Vz)
  a2 = Add (acc2, cr)
  af2 = Cast <to = 1> (a2)
  os2 = Mul (rs, Vs)
  y = Mul (af2, os2)
}"""


def old_dynamic_values(zero_bias: bool, dead: list[int]) -> dict:
    rng = np.random.default_rng(10)
    wq = rng.integers(0, 256, (8, 3, 3, 3))
    wb = np.zeros(8) if zero_bias else rng.uniform(-0.5, 0.5, 8)
    wq[dead], wb[dead] = 131, 0  # masked: the weight zero point, the bias 0
    return {
        "Wq": wq, "Ws": 0.004, "Wz": 131, "Wb": wb, "Shape": [1, -1, 1, 1],
        "Vq": rng.integers(0, 256, (4, 8, 1, 1)), "Vs": 0.003, "Vz": 126,
        "Vb": np.zeros(4) if zero_bias else rng.uniform(-0.5, 0.5, 4),
    }  # fmt: skip


@pytest.mark.parametrize("zero_bias", [False, True])
def test_a_bias_rounded_into_the_accumulator_at_run_time_goes_with_its_filter(zero_bias):
    model = tiny(OLD_DYNAMIC, values=old_dynamic_values(zero_bias, dead=[1, 4, 6]))
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == (5, 3, 3, 3) and s["Vq"] == (4, 5, 1, 1)
    if zero_bias:  # every bias 0: each rounded bias is 0 where defined, and its Add goes
        assert "Wb" not in s and "Vb" not in s
        assert [n.op_type for n in result.model.graph.node].count("Add") == 0
        assert params(result.model) == params(model) - 3 * (27 + 4) - 8 - 4
    else:
        assert s["Wb"] == (5,) and s["Vb"] == (4,)
        assert params(result.model) == params(model) - 3 * (27 + 1 + 4)
    # An input whose range underflows the scale to 0 (onnxruntime gives 0 for 1e-45 / 255): the
    # masked channels' biases are 0 / 0 = NaN in the input model, its cast to int32 undefined,
    # and every channel is then multiplied by that zero scale: the outputs agree still.
    tiny_x = np.zeros((1, 3, 6, 6), np.float32)
    tiny_x[0, 1, 2, 3] = 1e-45
    a, b = run(model, {"x": tiny_x})[0], run(result.model, {"x": tiny_x})[0]
    assert np.isfinite(a).all() and np.array_equal(a, b)


def test_only_a_cast_to_integers_of_zero_over_a_run_time_value_is_zero():
    """0 / d is 0 or NaN whatever d is: its cast to an integer type is 0 where defined, while the
    float itself (NaN where d is 0) and a non-zero numerator over d are not constants."""
    from onnxshrink.analyze import analyze, lookup
    from onnxshrink.prepare import prepare

    text = """<ir_version: 8, opset_import: ["" : 13]>
    g (float[4] d, float[4] N) => (int32[4] i, float[4] f, int32[4] j) {
      q = Div (N, d)
      f = Neg (q)
      g2 = Floor (f)
      i = Cast <to = 6> (g2)
      j = Cast <to = 6> (d)
    }"""
    model = tiny(text, values={"N": [0.0, 1.5, 0.0, -2.0]})
    graph, _ = prepare(model)
    consts = analyze(graph, 13, lookup(13)).consts
    tensors = {t.name: t for n in graph.nodes for t in n.outputs}
    i = consts.const(tensors["i"])
    assert i is not None
    mask, value = np.broadcast_arrays(i.mask, i.value)
    assert mask.tolist() == [True, False, True, False] and value[mask].tolist() == [0, 0]
    assert consts.const(tensors["f"]) is None and consts.const(tensors["j"]) is None


# ------------------------------------------------------------------ QOperator ops that join and map
# channels: onnxruntime.quantization's QLinearConcat (DenseNet, Inception), QLinearAveragePool,
# QLinearSigmoid (squeeze-excitation) and QLinearLeakyRelu; each maps a channel at its zero point
# to the output's zero point, so the next integer product does not read it.
JOINED_QOP = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (uint8[1, 3, 6, 6] x, int8[8, 3, 3, 3] Wq, float[8] Ws, int8[8] Wz, int32[8] Wb,
   int8[4, 3, 1, 1] Vq, float[4] Vs, int8[4] Vz, int32[4] Vb, int8[3, 12, 1, 1] Fq, float[3] Fs,
   int8[3] Fz, int32[3] Fb, float Xs, uint8 Xz, float As, uint8 Az, float Bs, uint8 Bz, float Cs,
   uint8 Cz, float Ps, uint8 Pz, float Ls, uint8 Lz, float Gs, uint8 Gz, float Ms, uint8 Mz,
   float Os, uint8 Oz) => (uint8[1, 3, 4, 4] y) {
  a = QLinearConv <pads = [1, 1, 1, 1]> (x, Xs, Xz, Wq, Ws, Wz, As, Az, Wb)
  b = QLinearConv (x, Xs, Xz, Vq, Vs, Vz, Bs, Bz, Vb)
  c = com.microsoft.QLinearConcat <axis = 1> (Cs, Cz, a, As, Az, b, Bs, Bz)
  p = com.microsoft.QLinearAveragePool <kernel_shape = [2, 2], strides = [2, 2], pads = [1, 1, 1, 1]> (c, Cs, Cz, Ps, Pz)
  l = com.microsoft.QLinearLeakyRelu <alpha = 0.1> (p, Ps, Pz, Ls, Lz)
  s = com.microsoft.QLinearSigmoid (l, Ls, Lz, Gs, Gz)
  m = com.microsoft.QLinearMul (l, Ls, Lz, s, Gs, Gz, Ms, Mz)
  y = QLinearConv (m, Ms, Mz, Fq, Fs, Fz, Os, Oz, Fb)
}"""


def joined_qop(default: bool):
    """Filters 2 and 5 of W and 1 of V at their zero points with no bias (channels 2, 5 and 9
    of the join). `default`: zero points 0 and unit scales wherever onnxruntime allows them."""
    rng = np.random.default_rng(11)

    def conv(name: str, shape: tuple, dead: list[int]) -> dict:
        n = shape[0]
        z = np.zeros(n, np.int64) if default else rng.integers(-3, 3, n)
        q = rng.integers(-60, 60, shape)
        q[dead] = z[dead].reshape(-1, *[1] * (len(shape) - 1))
        b = np.zeros(n, np.int64) if default else rng.integers(-300, 300, n)
        b[dead] = 0
        s = np.ones(n) * 0.01 if default else rng.uniform(0.005, 0.01, n)
        return {f"{name}q": q, f"{name}s": s, f"{name}z": z, f"{name}b": b}

    act = {k: (1.0 if default else rng.uniform(0.02, 0.1), 0 if default else int(rng.integers(100, 150)))
           for k in "XABCPLGMO"}  # fmt: skip
    values = {**conv("W", (8, 3, 3, 3), [2, 5]), **conv("V", (4, 3, 1, 1), [1]), **conv("F", (3, 12, 1, 1), [])}
    for k, (s, z) in act.items():
        values[f"{k}s"], values[f"{k}z"] = s, z
    return tiny(JOINED_QOP, values=values)


@pytest.mark.parametrize("default", [False, True])
def test_qlinear_concat_pool_and_activations_pass_channels_at_their_zero_point(default):
    model = joined_qop(default)
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == (6, 3, 3, 3) and s["Ws"] == s["Wz"] == s["Wb"] == (6,)
    assert s["Vq"] == (3, 3, 1, 1) and s["Vs"] == s["Vz"] == s["Vb"] == (3,)
    assert s["Fq"] == (3, 9, 1, 1) and s["Fs"] == (3,)
    assert s["Cs"] == s["Cz"] == s["As"] == ()  # per-tensor parameters stay whole
    assert params(result.model) == params(model) - 2 * (27 + 3) - (3 + 3) - 3 * 3
    assert not result.barriers
    rng = np.random.default_rng(12)
    for _ in range(3):
        feed = {"x": rng.integers(0, 256, (1, 3, 6, 6)).astype(np.uint8)}
        assert np.array_equal(run(model, feed)[0], run(result.model, feed)[0])


def test_qlinear_concat_part_removed_whole_leaves_with_its_parameters():
    rng = np.random.default_rng(13)
    model = joined_qop(False)
    vq, vz = init(model, "Vq").copy(), init(model, "Vz")
    vq[:] = vz.reshape(-1, 1, 1, 1)  # every filter of V at its zero point, no bias
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    values |= {"Vq": vq, "Vb": np.zeros(4, np.int32)}
    model = tiny(JOINED_QOP, values=values)
    result = shrink_checked(model)
    [join] = [n for n in result.model.graph.node if n.op_type == "QLinearConcat"]
    assert list(join.input) == ["Cs", "Cz", "a", "As", "Az"]
    assert "Vq" not in shapes(result.model) and shapes(result.model)["Fq"] == (3, 6, 1, 1)
    feed = {"x": rng.integers(0, 256, (1, 3, 6, 6)).astype(np.uint8)}
    assert np.array_equal(run(model, feed)[0], run(result.model, feed)[0])


POOLED_QOP_DYNAMIC = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (uint8[1, 3, 6, width] x, int8[8, 3, 3, 3] Wq, float[8] Ws, int8[8] Wz, int32[8] Wb,
   int8[4, 8, 1, 1] Fq, float[4] Fs, int8[4] Fz, int32[4] Fb, float Xs, uint8 Xz, float As,
   uint8 Az, float Ps, uint8 Pz, float Os, uint8 Oz) => (uint8[1, 4, 3, pooled] y) {
  a = QLinearConv <pads = [1, 1, 1, 1]> (x, Xs, Xz, Wq, Ws, Wz, As, Az, Wb)
  p = com.microsoft.QLinearAveragePool <kernel_shape = [2, 2], strides = [2, 2]> (a, As, Az, Ps, Pz)
  y = QLinearConv (p, Ps, Pz, Fq, Fs, Fz, Os, Oz, Fb)
}"""


def test_qlinear_conv_and_pool_shapes_are_known_with_a_dynamic_width():
    """onnx's QLinearConv inference gives nothing when a spatial dim is symbolic (an OCR model's
    width), and onnxruntime's symbolic inference has no rule for it or for QLinearAveragePool:
    their shapes are Conv's and AveragePool's, else every channel after them is kept."""
    rng = np.random.default_rng(14)
    wz, wq = rng.integers(-3, 3, 8), rng.integers(-60, 60, (8, 3, 3, 3))
    wb = rng.integers(-300, 300, 8)
    wq[[0, 6]], wb[[0, 6]] = wz[[0, 6], None, None, None], 0
    values = {"Wq": wq, "Ws": rng.uniform(0.005, 0.01, 8), "Wz": wz, "Wb": wb, "Fq": rng.integers(-60, 60, (4, 8, 1, 1)),
              "Fs": rng.uniform(0.005, 0.01, 4), "Fz": rng.integers(-3, 3, 4), "Fb": rng.integers(-300, 300, 4),
              "Xs": 0.02, "Xz": 120, "As": 0.05, "Az": 128, "Ps": 0.04, "Pz": 125, "Os": 0.1, "Oz": 100}  # fmt: skip
    model = tiny(POOLED_QOP_DYNAMIC, values=values)
    result = shrink_checked(model, input_shapes={"x": [1, 3, 6, 10]})
    s = shapes(result.model)
    assert s["Wq"] == (6, 3, 3, 3) and s["Wb"] == (6,) and s["Fq"] == (4, 6, 1, 1)
    assert not result.barriers
    for width in (6, 9):
        feed = {"x": rng.integers(0, 256, (1, 3, 6, width)).astype(np.uint8)}
        assert np.array_equal(run(model, feed)[0], run(result.model, feed)[0])
