"""The proof runs QDQ products in integers (onnxshrink/proof/qdq.py): exact when zero terms are
removed, where float32 sums move by an ulp and a QuantizeLinear after them can round the other way."""

import numpy as np
import onnx
import pytest
from conftest import tiny

from onnxshrink.proof.qdq import integer_products

PRODUCTS = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 16, 5, 5] x, float[1, 16] v, int8[32, 16, 3, 3] Wq, float[32] Ws, int8[32] Wz, int32[32] Bq,
   float[32] Bs, uint8[16, 12] Mq, float[12] Ms, uint8[12] Mz, int8[16, 6] Gq, float Gs, int8 Gz, float[6] C,
   float S, int8 Z, float T, uint8 U) => (float[1, 32, 5, 5] y, float[1, 12] m, float[1, 6] k) {
  xq = QuantizeLinear (x, S, Z)
  xd = DequantizeLinear (xq, S, Z)
  w = DequantizeLinear <axis = 0> (Wq, Ws, Wz)
  b = DequantizeLinear <axis = 0> (Bq, Bs)
  y = Conv <pads = [1, 1, 1, 1]> (xd, w, b)
  vq = QuantizeLinear (v, T, U)
  vd = DequantizeLinear (vq, T, U)
  md = DequantizeLinear <axis = 1> (Mq, Ms, Mz)
  m = MatMul (vd, md)
  g = DequantizeLinear (Gq, Gs, Gz)
  k = Gemm <alpha = 0.5, beta = 2.0> (vd, g, C)
}"""


def run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    """onnxruntime without its graph rewrites, as the proof runs (a Conv-Mul fusion would fold
    the scale into the integer weights)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    ).run(None, feed)


def products(weight_scale: float) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    values = {
        "Wq": rng.integers(-128, 128, (32, 16, 3, 3)), "Ws": rng.uniform(0.5, 1, 32) * weight_scale,
        "Wz": np.zeros(32), "Bq": rng.integers(-500, 500, 32), "Bs": rng.uniform(1e-4, 2e-4, 32),
        "Mq": rng.integers(0, 256, (16, 12)), "Ms": rng.uniform(0.01, 0.02, 12), "Mz": rng.integers(100, 150, 12),
        "Gq": rng.integers(-128, 128, (16, 6)), "Gs": 0.02, "Gz": 3, "C": rng.standard_normal(6),
        "S": 0.03, "Z": -5, "T": 0.02, "U": 128,
    }  # fmt: skip
    return tiny(PRODUCTS, values=values)


@pytest.mark.parametrize("weight_scale", [1e-2, 1.0])
def test_integer_products_compute_the_dequantized_products(weight_scale):
    model = products(weight_scale)
    integer = integer_products(model)
    assert integer is not None
    ops = sorted(
        n.op_type
        for n in integer.graph.node
        if n.op_type in ("Conv", "ConvInteger", "MatMul", "MatMulInteger", "Gemm")
    )
    # The Conv's partial sums reach 128 * sum |w - zp| = 128 * ~18,000 < 2**24: a float Conv of
    # the integers, exact; MatMul and Gemm in MatMulInteger.
    assert ops == ["Conv", "MatMulInteger", "MatMulInteger"]
    rng = np.random.default_rng(4)
    feed = {
        "x": rng.standard_normal((1, 16, 5, 5)).astype(np.float32),
        "v": rng.standard_normal((1, 16)).astype(np.float32),
    }
    for a, b in zip(run(model, feed), run(integer, feed), strict=True):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()  # the same products, rounded once


def test_a_conv_whose_sums_may_pass_float32s_integers_accumulates_in_int32():
    wide = PRODUCTS.replace("16, 5, 5] x", "512, 5, 5] x").replace(
        "[32, 16, 3, 3] Wq", "[32, 512, 3, 3] Wq"
    )
    rng = np.random.default_rng(5)
    wq = rng.integers(-128, 128, (32, 512, 3, 3))  # 128 * sum |w| ~ 128 * 300,000 > 2**24
    model = tiny(
        wide,
        values={
            "Wq": wq,
            "Wz": np.zeros(32),
            "Ws": np.full(32, 1e-3),
            "S": 0.03,
            "Z": -5,
            "T": 0.02,
            "U": 128,
            "Gz": 0,
            "Mz": np.full(12, 128),
        },
    )
    integer = integer_products(model)
    assert integer is not None and "ConvInteger" in {n.op_type for n in integer.graph.node}
    feed = {
        "x": rng.standard_normal((1, 512, 5, 5)).astype(np.float32),
        "v": rng.standard_normal((1, 16)).astype(np.float32),
    }
    a, b = run(model, feed)[0], run(integer, feed)[0]
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def test_removing_channels_at_the_zero_point_gives_the_same_integer_products_exactly():
    """The point of it: the reference with input channels at their zero point and the model
    without them compute equal products, bit for bit."""
    model = products(1.0)
    keep = np.arange(16) % 3 != 0
    wq = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "Wq"))
    smaller = onnx.ModelProto()
    smaller.CopyFrom(model)
    for t in smaller.graph.initializer:
        if t.name == "Wq":
            t.CopyFrom(onnx.numpy_helper.from_array(wq[:, keep], "Wq"))
    for vi in smaller.graph.input:
        if vi.name == "x":
            vi.type.tensor_type.shape.dim[1].dim_value = int(keep.sum())
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 16, 5, 5)).astype(np.float32)
    x[:, ~keep] = 0  # quantized to its zero point: exactly 0 after DequantizeLinear
    v = rng.standard_normal((1, 16)).astype(np.float32)
    feed_full, feed_small = {"x": x, "v": v}, {"x": np.ascontiguousarray(x[:, keep]), "v": v}
    full, small = integer_products(model), integer_products(smaller)
    assert full is not None and small is not None
    assert np.array_equal(run(full, feed_full)[0], run(small, feed_small)[0])
