"""--prune on quantized models (QDQ, the QOperator form, dynamic quantization): the integer weights
are the groups' members, zeroed to their zero points; every result is checked with validation
off, in onnxruntime, against the quantized model with the chosen groups zeroed by the test."""

import logging

import numpy as np
import onnx
import pytest
from conftest import export_cached, params, run
from onnx import helper, numpy_helper

from models.transformers import TRANSFORMERS
from models.zoo import ZOO, randomize
from onnxshrink.prune import find_groups, prune
from onnxshrink.prune.importance import magnitude

# Where an op reads a quantized input's zero point, and along which axis a vector one runs
# (None: per tensor, or none at all): the test's own reading of the ops, not onnxshrink's.
ZERO_POINT = {
    ("DequantizeLinear", 0): 2,
    ("QLinearConv", 3): 5,
    ("QLinearConv", 8): None,
    ("QLinearMatMul", 3): 5,
    ("QGemm", 3): 5,
    ("QGemm", 6): None,
    ("MatMulInteger", 1): 3,
    ("ConvInteger", 1): 3,
    ("QLinearAdd", 0): 2,
    ("QLinearAdd", 3): 5,
    ("QLinearMul", 0): 2,
    ("QLinearMul", 3): 5,
}
SCALES = {("DequantizeLinear", 1), ("QLinearConv", 4), ("QLinearMatMul", 4), ("QGemm", 4)}


def zp_axis(node: onnx.NodeProto, slot: int, rank: int) -> int:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "DequantizeLinear":
        return int(attrs.get("axis", 1)) % rank
    if node.op_type == "QGemm":
        return 0 if attrs.get("transB", 0) else 1
    return rank - 1 if node.op_type in ("QLinearMatMul", "MatMulInteger") else 0


def zeroed_by_hand(
    model: onnx.ModelProto, slices: list[tuple[str, int, np.ndarray]]
) -> onnx.ModelProto:
    """`model` with each slice set to zero: an integer weight to its zero point (per tensor or per
    channel), a float one to 0; a scale is left as it is (its channel is zero whatever it is)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    values = {name: numpy_helper.to_array(t).copy() for name, t in inits.items()}
    for name, axis, idx in slices:
        v = values[name]
        node, slot = next((n, list(n.input).index(name)) for n in out.graph.node if name in n.input)
        if node.op_type == "Gather" and slot == 0:  # an integer table: dequantized after the Gather
            node, slot = next(
                (n, list(n.input).index(node.output[0])) for n in out.graph.node if node.output[0] in n.input
            )
        if (node.op_type, slot) in SCALES:
            continue
        index = [slice(None)] * v.ndim
        index[axis] = idx
        if np.issubdtype(v.dtype, np.floating):
            v[tuple(index)] = 0
            continue
        zp_slot = ZERO_POINT[(node.op_type, slot)]
        zp = (
            values[node.input[zp_slot]]
            if zp_slot is not None and len(node.input) > zp_slot
            else np.zeros(())
        )
        if zp.size > 1:
            shape = [1] * v.ndim
            shape[zp_axis(node, slot, v.ndim)] = -1
            zp = zp.reshape(shape)
        v[tuple(index)] = np.broadcast_to(zp, v.shape)[tuple(index)]
    for name, t in inits.items():
        t.CopyFrom(numpy_helper.from_array(values[name], name))
    return out


def chosen_slices(result) -> list[tuple[str, int, np.ndarray]]:
    return [
        (m.initializer, m.axis, m.indices)
        for i in result.removed()
        for m in result.groups.groups[i].members
    ]


def same_outputs(reference: onnx.ModelProto, pruned: onnx.ModelProto, feeds: list[dict]) -> None:
    """Integer outputs equal; float outputs within 1e-5 of their magnitude."""
    for feed in feeds:
        for a, b in zip(run(reference, feed), run(pruned, feed), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            if np.issubdtype(a.dtype, np.floating):
                assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
            else:
                assert np.array_equal(a, b)


# ------------------------------------------------------------------ hand-made models
QDQ = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 3, 6, 6] x, uint8[8, 3, 3, 3] Wq, float Ws, uint8 Wz, int32[8] Bq, float[8] Bs,
   uint8[4, 8, 1, 1] Vq, float[4] Vs, uint8[4] Vz, float S, uint8 Z) => (float[1, 4, 6, 6] y) {
  w = DequantizeLinear (Wq, Ws, Wz)
  b = DequantizeLinear <axis = 0> (Bq, Bs)
  v = DequantizeLinear <axis = 0> (Vq, Vs, Vz)
  xq = QuantizeLinear (x, S, Z)
  xd = DequantizeLinear (xq, S, Z)
  h = Conv <pads = [1, 1, 1, 1]> (xd, w, b)
  r = Relu (h)
  hq = QuantizeLinear (r, S, Z)
  hd = DequantizeLinear (hq, S, Z)
  y = Conv (hd, v)
}"""


def qdq_model():
    rng = np.random.default_rng(0)
    values = {
        "Wq": rng.integers(60, 200, (8, 3, 3, 3)), "Ws": 0.01, "Wz": 131,
        "Bq": rng.integers(-400, 400, 8), "Bs": rng.uniform(1e-4, 2e-4, 8),
        "Vq": rng.integers(0, 255, (4, 8, 1, 1)), "Vs": rng.uniform(0.01, 0.02, 4),
        "Vz": rng.integers(120, 136, 4), "S": 0.05, "Z": 128,
    }  # fmt: skip
    from onnxshrink.testing import model_from_text

    return model_from_text(QDQ, values=values)


def test_qdq_groups_hold_the_integer_weights_and_go_at_their_zero_points():
    model = qdq_model()
    gset = find_groups(model)
    [layer] = [layer for layer in gset.layers if len(layer.groups) == 8]
    group = gset.groups[layer.groups[3]]
    assert group.exact
    held = {(m.initializer, m.axis, m.role, m.side) for m in group.members}
    # the uint8 weight and int32 bias in the Conv's roles (through their DequantizeLinear), the
    # next weight's columns, the bias's scale; zero points are no members (integers read as such)
    assert held == {
        ("Wq", 0, "weight", "out"), ("Bq", 0, "bias", "out"), ("Vq", 1, "weight", "in"),
        ("Bs", 0, None, "out"),
    }  # fmt: skip
    assert int(gset.zero_of("Wq")) == 131 and gset.zero_of("Vq").reshape(-1).tolist() == init_list(
        model, "Vz"
    )
    assert gset.quant_params == {"Bs", "Vs"}  # float members sliced with their channels, not zeroed

    result = prune(model, 0.5, validate=False)
    removed = sorted(int(gset.groups[i].members[0].indices[0]) for i in result.removed())
    assert len(removed) == 4
    reference = zeroed_by_hand(model, chosen_slices(result))
    same_outputs(reference, result.model, feeds(model))
    after = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    assert (
        after["Wq"] == (4, 3, 3, 3)
        and after["Bq"] == after["Bs"] == (4,)
        and after["Vq"] == (4, 4, 1, 1)
    )
    assert params(result.model) == params(model) - 4 * (27 + 1 + 1 + 4)


def init_list(model: onnx.ModelProto, name: str) -> list:
    return (
        numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))
        .reshape(-1)
        .tolist()
    )


def feeds(model: onnx.ModelProto, draws: int = 3) -> list[dict]:
    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    return make_inputs(model, resolve_shapes(model, {}), draws, seed=11)


def test_quantized_magnitude_is_that_of_the_dequantized_weights():
    model = qdq_model()
    gset = find_groups(model)
    group = next(
        g for g in gset.groups if g.exact and any(m.initializer == "Wq" for m in g.members)
    )
    j = int(next(m.indices[0] for m in group.members if m.initializer == "Wq"))
    wq, vq = (
        numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == n))
        for n in ("Wq", "Vq")
    )
    vz, vs = (np.array(init_list(model, n)) for n in ("Vz", "Vs"))
    w_real = np.abs((wq[j].astype(np.int64) - 131) * np.float64(np.float32(0.01))).sum()
    v_real = np.abs(
        (vq[:, j, 0, 0].astype(np.int64) - vz) * vs.astype(np.float32).astype(np.float64)
    ).sum()
    assert magnitude(gset, group, 1) == pytest.approx((w_real + v_real) / 2, rel=1e-12)


QOP = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (uint8[1, 4, 5, 5] x, int8[8, 4, 3, 3] Wq, float[8] Ws, int8[8] Wz, int32[8] Wb,
   int8[8, 4, 1, 1] Dq, float[8] Ds, int8[8] Dz, int32[8] Db, int8[8, 8, 3, 3] Cq, float[8] Cs,
   int8[8] Cz, int32[8] Cb, int8[6, 8] Fq, float Fs, int8 Fz, int32[6] Fb, float Xs, uint8 Xz,
   float Hs, uint8 Hz, float Rs, uint8 Rz, float Ps, uint8 Pz, int64[2] Flat) => (float[1, 6] y) {
  h = QLinearConv <pads = [1, 1, 1, 1]> (x, Xs, Xz, Wq, Ws, Wz, Hs, Hz, Wb)
  d = QLinearConv (x, Xs, Xz, Dq, Ds, Dz, Hs, Hz, Db)
  c = QLinearConv <pads = [1, 1, 1, 1]> (h, Hs, Hz, Cq, Cs, Cz, Hs, Hz, Cb)
  s = com.microsoft.QLinearAdd (c, Hs, Hz, d, Hs, Hz, Rs, Rz)
  p = com.microsoft.QLinearGlobalAveragePool (s, Rs, Rz, Ps, Pz)
  f = Reshape (p, Flat)
  y = com.microsoft.QGemm <transB = 1> (f, Ps, Pz, Fq, Fs, Fz, Fb)
}"""


def qop_model():
    from onnxshrink.testing import model_from_text

    rng = np.random.default_rng(1)

    def conv(name: str, shape: tuple) -> dict:
        n = shape[0]
        return {
            f"{name}q": rng.integers(-60, 60, shape), f"{name}s": rng.uniform(0.005, 0.01, n),
            f"{name}z": rng.integers(-3, 3, n), f"{name}b": rng.integers(-300, 300, n),
        }  # fmt: skip

    values = {
        **conv("W", (8, 4, 3, 3)), **conv("D", (8, 4, 1, 1)), **conv("C", (8, 8, 3, 3)),
        "Fq": rng.integers(-60, 60, (6, 8)), "Fs": 0.01, "Fz": 2, "Fb": rng.integers(-300, 300, 6),
        "Xs": 0.02, "Xz": 120, "Hs": 0.05, "Hz": 128, "Rs": 0.08, "Rz": 125, "Ps": 0.04, "Pz": 130,
        "Flat": [1, 8],
    }  # fmt: skip
    return model_from_text(QOP, values=values)


def test_qoperator_residual_channels_go_through_qlinearadd_global_pool_and_qgemm():
    model = qop_model()
    gset = find_groups(model)
    exact = {
        layer.name: len(layer.groups)
        for layer in gset.layers
        if all(gset.groups[i].exact for i in layer.groups)
    }
    assert exact == {
        "Wq": 8,
        "Cq (+1)": 8,
    }  # h's channels; the residual stream's (C and D write it)
    stream = next(
        gset.groups[i] for layer in gset.layers if layer.name == "Cq (+1)" for i in layer.groups[:1]
    )
    assert {(m.initializer, m.axis) for m in stream.members} >= {
        ("Cq", 0),
        ("Dq", 0),
        ("Cb", 0),
        ("Db", 0),
        ("Fq", 1),
    }
    result = prune(model, 0.5, validate=False)
    reference = zeroed_by_hand(model, chosen_slices(result))
    same_outputs(reference, result.model, feeds(model))
    s = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    assert (
        s["Wq"] == (4, 4, 3, 3)
        and s["Cq"] == (4, 4, 3, 3)
        and s["Dq"] == (4, 4, 1, 1)
        and s["Fq"] == (6, 4)
    )
    assert not result.shrink.barriers


DYNAMIC = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 4, 8] x, int8[8, 16] Uq, int8 Uz, float Us, float[16] Ub, int8[16, 8] Dq, int8 Dz, float Ds) => (float[1, 4, 8] y) {
  q, qs, qz = DynamicQuantizeLinear (x)
  u = MatMulInteger (q, Uq, qz, Uz)
  uf = Cast <to = 1> (u)
  us = Mul (qs, Us)
  h = Mul (uf, us)
  hb = Add (h, Ub)
  r = Relu (hb)
  p, ps, pz = DynamicQuantizeLinear (r)
  d = MatMulInteger (p, Dq, pz, Dz)
  df = Cast <to = 1> (d)
  ds = Mul (ps, Ds)
  y = Mul (df, ds)
}"""


def test_dynamic_quantization_neurons_go_with_their_float_bias():
    from onnxshrink.testing import model_from_text

    rng = np.random.default_rng(2)
    values = {
        "Uq": rng.integers(-100, 100, (8, 16)), "Uz": 3, "Us": 0.02, "Ub": rng.uniform(-0.5, 0.5, 16),
        "Dq": rng.integers(-100, 100, (16, 8)), "Dz": -2, "Ds": 0.01,
    }  # fmt: skip
    model = model_from_text(DYNAMIC, values=values)
    gset = find_groups(model)
    [layer] = [layer for layer in gset.layers if len(layer.groups) == 16]
    assert all(gset.groups[i].exact for i in layer.groups) and layer.kind == "neuron"
    # Ranked by the dequantized weights: the scales are those the graph applies after each
    # MatMulInteger (times the scale DynamicQuantizeLinear computed for its input).
    group = gset.groups[layer.groups[5]]
    j = int(group.members[0].indices[0])
    up = np.abs((values["Uq"][:, j] - 3) * np.float64(np.float32(0.02))).sum()
    down = np.abs((values["Dq"][j] + 2) * np.float64(np.float32(0.01))).sum()
    assert magnitude(gset, group, 1) == pytest.approx((up + down) / 2, rel=1e-12)
    result = prune(model, 0.5, validate=False)
    assert len(result.removed()) == 8
    reference = zeroed_by_hand(model, chosen_slices(result))
    same_outputs(reference, result.model, feeds(model))
    s = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    assert s["Uq"] == (8, 8) and s["Ub"] == (8,) and s["Dq"] == (8, 8)


# The hidden width of a transformer whose embedding tables are integers a Gather reads (the
# dynamic and QOperator forms of onnxruntime.quantization): each table is dequantized after the
# Gather (DequantizeLinear; QLinearAdd with the position table), per tensor, so its columns are
# width members zeroed to that zero point. Library-default init: zero biases, unit norm scales.
DYNAMIC_WIDTH = """<ir_version: 8, opset_import: ["" : 17]>
g (int64[1, 4] ids, uint8[10, 8] Tq, float Ts, uint8 Tz, uint8[4, 8] Pq, float Ps, uint8 Pz,
   int64[4] Pos, float[8] G0, float[8] B0, int8[8, 8] Wq, float Ws, int8 Wz, float[8] Wb,
   float[8] G1, float[8] B1, int8[8, 3] Hq, float Hs, int8 Hz) => (float[1, 4, 3] y) {
  te = Gather (Tq, ids)
  t = DequantizeLinear (te, Ts, Tz)
  pe = Gather (Pq, Pos)
  p = DequantizeLinear (pe, Ps, Pz)
  e = Add (t, p)
  h0 = LayerNormalization (e, G0, B0)
  q0, q0s, q0z = DynamicQuantizeLinear (h0)
  m = MatMulInteger (q0, Wq, q0z, Wz)
  mf = Cast <to = 1> (m)
  ms = Mul (q0s, Ws)
  mm = Mul (mf, ms)
  o = Add (mm, Wb)
  r = Add (h0, o)
  h1 = LayerNormalization (r, G1, B1)
  q1, q1s, q1z = DynamicQuantizeLinear (h1)
  k = MatMulInteger (q1, Hq, q1z, Hz)
  kf = Cast <to = 1> (k)
  ks = Mul (q1s, Hs)
  y = Mul (kf, ks)
}"""

QOP_WIDTH = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (int64[1, 4] ids, uint8[10, 8] Tq, float Ts, uint8 Tz, uint8[4, 8] Pq, float Ps, uint8 Pz,
   int64[4] Pos, float Es, uint8 Ez, float[8] G0, float[8] B0, float Hs, uint8 Hz,
   uint8[8, 8] Wq, float Ws, uint8 Wz, float Ms, uint8 Mz, uint8[8] Bq, float Bs, uint8 Bz,
   float Os, uint8 Oz, float Rs, uint8 Rz, float[8] G1, float[8] B1, float Ks, uint8 Kz,
   uint8[8, 3] Kq, float Kws, uint8 Kwz, float Ys, uint8 Yz) => (float[1, 4, 3] y) {
  te = Gather (Tq, ids)
  pe = Gather (Pq, Pos)
  e = com.microsoft.QLinearAdd (te, Ts, Tz, pe, Ps, Pz, Es, Ez)
  ed = DequantizeLinear (e, Es, Ez)
  h0 = LayerNormalization (ed, G0, B0)
  hq = QuantizeLinear (h0, Hs, Hz)
  m = QLinearMatMul (hq, Hs, Hz, Wq, Ws, Wz, Ms, Mz)
  o = com.microsoft.QLinearAdd (m, Ms, Mz, Bq, Bs, Bz, Os, Oz)
  r = com.microsoft.QLinearAdd (hq, Hs, Hz, o, Os, Oz, Rs, Rz)
  rd = DequantizeLinear (r, Rs, Rz)
  h1 = LayerNormalization (rd, G1, B1)
  h1q = QuantizeLinear (h1, Ks, Kz)
  y8 = QLinearMatMul (h1q, Ks, Kz, Kq, Kws, Kwz, Ys, Yz)
  y = DequantizeLinear (y8, Ys, Yz)
}"""


def width_values(form: str, default_init: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    hidden = 8
    if default_init:  # zero biases (quantized: at their zero point), unit norm scales
        norms = {"G0": np.ones(hidden), "B0": np.zeros(hidden), "G1": np.ones(hidden), "B1": np.zeros(hidden)}
    else:
        norms = {n: rng.uniform(0.5, 1.5, hidden) for n in ("G0", "G1")} | {
            n: rng.uniform(-0.3, 0.3, hidden) for n in ("B0", "B1")
        }
    values = {
        "Tq": rng.integers(0, 256, (10, hidden)), "Ts": 0.02, "Tz": int(rng.integers(100, 156)),
        "Pq": rng.integers(0, 256, (4, hidden)), "Ps": 0.01, "Pz": int(rng.integers(100, 156)),
        "Pos": np.arange(4), **norms,
    }  # fmt: skip
    if form == "dynamic":
        values |= {
            "Wq": rng.integers(-100, 100, (hidden, hidden)), "Ws": 0.02, "Wz": int(rng.integers(-4, 4)),
            "Wb": np.zeros(hidden) if default_init else rng.uniform(-0.3, 0.3, hidden),
            "Hq": rng.integers(-100, 100, (hidden, 3)), "Hs": 0.03, "Hz": int(rng.integers(-4, 4)),
        }  # fmt: skip
    else:
        bz = int(rng.integers(120, 136))
        values |= {
            "Es": 0.03, "Ez": 128, "Hs": 0.04, "Hz": 127, "Wq": rng.integers(0, 256, (hidden, hidden)),
            "Ws": 0.01, "Wz": int(rng.integers(120, 136)), "Ms": 0.1, "Mz": 129,
            "Bq": np.full(hidden, bz) if default_init else rng.integers(0, 256, hidden), "Bs": 0.002,
            "Bz": bz, "Os": 0.1, "Oz": 126, "Rs": 0.08, "Rz": 130, "Ks": 0.04, "Kz": 125,
            "Kq": rng.integers(0, 256, (hidden, 3)), "Kws": 0.01, "Kwz": 128, "Ys": 0.1, "Yz": 128,
        }  # fmt: skip
    return values


@pytest.mark.parametrize("form", ["dynamic", "qop"])
@pytest.mark.parametrize("default_init", [False, True])
def test_hidden_width_goes_through_integer_embedding_tables(form, default_init):
    from onnxshrink.testing import model_from_text

    text = DYNAMIC_WIDTH if form == "dynamic" else QOP_WIDTH
    model = model_from_text(text, values=width_values(form, default_init, seed=7))
    gset = find_groups(model)
    [layer] = [layer for layer in gset.layers if layer.kind == "width"]
    assert len(layer.groups) == 8 and all(gset.groups[i].exact for i in layer.groups)
    tables = {(m.initializer, m.axis) for i in layer.groups[:1] for m in gset.groups[i].members}
    assert {("Tq", 1), ("Pq", 1)} <= tables
    assert int(gset.zero_of("Tq")) == width_values(form, default_init, seed=7)["Tz"]
    result = prune(model, 0.5, validate=False, units=["width"])
    assert len(result.removed()) == 4
    reference = zeroed_by_hand(model, chosen_slices(result))
    rng = np.random.default_rng(3)
    same_outputs(reference, result.model, [{"ids": rng.integers(0, 10, (1, 4))} for _ in range(3)])
    s = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    w = "Wq"
    head = "Hq" if form == "dynamic" else "Kq"
    assert s["Tq"] == (10, 4) and s["Pq"] == (4, 4) and s[w] == (4, 4) and s[head] == (4, 3)
    assert s["G0"] == s["B1"] == (4,)



def test_a_dynamically_quantized_block_goes_with_its_integer_weights():
    """A block group holds its branch's integer weights (zeroed to their zero points) and float
    bias: MatMulInteger of zero-point weights is 0, so is its Cast and its product with the
    scale, and the residual Add goes with the branch."""
    import onnxshrink
    from onnxshrink.testing import model_from_text

    model = model_from_text(DYNAMIC_WIDTH, values=width_values("dynamic", True, seed=7))
    gset = find_groups(model)
    [block] = [gset.groups[i] for layer in gset.layers if layer.kind == "block" for i in layer.groups]
    assert block.exact and {(m.initializer, m.axis, len(m.indices)) for m in block.members} == {
        ("Wq", 1, 8),
        ("Wb", 0, 8),
    }
    reference = zeroed_by_hand(model, [(m.initializer, m.axis, m.indices) for m in block.members])
    result = onnxshrink.shrink(reference, validate=False)
    rng = np.random.default_rng(4)
    same_outputs(reference, result.model, [{"ids": rng.integers(0, 10, (1, 4))} for _ in range(3)])
    assert params(result.model) == params(model) - 8 * 8 - 8 - 2  # Wq, Wb, Ws and Wz
    assert [n.op_type for n in result.model.graph.node].count("MatMulInteger") == 1


def test_a_table_whose_gathered_rows_are_also_measured_has_one_zero_for_mask_and_prune():
    """The groups and a mask find a quantized weight's zero point by one walk
    (`quantized.dequant_reads`): a Shape of the gathered rows reads their sizes, not their
    values, so the table is still quantized for both (the groups used to read it as plain
    integers and leave it out, while a mask on it went to its zero point)."""
    from onnxshrink.bind.graph import ModelIndex
    from onnxshrink.testing import model_from_text

    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (int64[1, S] ids, uint8[10, 8] Tq, float Ts, uint8 Tz, float[8, 3] W) => (float[1, S, 3] y) {
      te = Gather (Tq, ids)
      t = DequantizeLinear (te, Ts, Tz)
      n = Shape (te)
      r = Reshape (t, n)
      y = MatMul (r, W)
    }"""
    rng = np.random.default_rng(3)
    model = model_from_text(text, values={"Tq": rng.integers(0, 256, (10, 8)), "Ts": 0.02, "Tz": 131})
    gset = find_groups(model)
    assert int(gset.zero_of("Tq")) == int(ModelIndex(model).zero_of("Tq")) == 131
    assert ("Tq", 1) in {(m.initializer, m.axis) for g in gset.groups for m in g.members}


# ------------------------------------------------------------------ onnxruntime.quantization
class _Calibration:
    def __init__(self, path):
        from onnxshrink.proof.inputs import make_inputs, resolve_shapes

        model = onnx.load(path)
        self.feeds = iter(make_inputs(model, resolve_shapes(model, {}), 4, seed=5))

    def get_next(self):
        return next(self.feeds, None)


def quantized(zoo_dir, name: str, form: str):
    """A zoo model with random weights, exported, and quantized by onnxruntime.quantization."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        quantize_dynamic,
        quantize_static,
    )

    entry = ZOO[name] if name in ZOO else TRANSFORMERS[name]
    path = export_cached(
        zoo_dir, ("pq", name), lambda: (randomize(entry.build(), seed=4), entry.inputs(), {})
    )
    if form == "float":
        return path
    out = path.with_name(f"{path.stem}_{form}.onnx")
    if not out.exists():
        logging.disable(logging.WARNING)
        try:
            if form == "dynamic":
                quantize_dynamic(path, out)
            else:
                reader = type("Reader", (_Calibration, CalibrationDataReader), {})(path)
                fmt = QuantFormat.QDQ if form.startswith("qdq") else QuantFormat.QOperator
                quantize_static(
                    path, out, reader, quant_format=fmt, per_channel=form.endswith("_pc")
                )
        finally:
            logging.disable(logging.NOTSET)
    return out


@pytest.mark.parametrize(
    "name, form",
    [("resnet_basic", "qdq"), ("resnet_basic", "qop_pc"), ("resnet_basic", "dynamic"),
     ("bert", "qdq_pc"), ("bert", "qop"), ("bert", "dynamic")],
)  # fmt: skip
def test_onnxruntime_quantized_zoo_models_prune_as_their_float_model(zoo_dir, name, form):
    path = quantized(zoo_dir, name, form)
    model = onnx.load(path)
    # The default units, the hidden width through LayerNorm too (every form's embedding tables
    # are its members: integers a Gather reads, dequantized after it, in the dynamic and
    # QOperator forms).
    float_result = prune(quantized(zoo_dir, name, "float"), 0.5, validate=False)
    result = prune(model, 0.5, validate=False)
    reference = zeroed_by_hand(model, chosen_slices(result))
    same_outputs(reference, result.model, feeds(model, 2))
    removed = params(model) - params(result.model)
    float_removed = float_result.shrink.before.params - float_result.shrink.after.params
    if form.endswith("_pc"):  # per-channel scales and zero points go too
        assert float_removed < removed < 1.1 * float_removed
    else:
        assert removed == float_removed
    assert not [b for b in result.shrink.barriers if b["unsupported"]]


def run_unoptimized(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    """onnxruntime without its graph rewrites, as the proof runs a QDQ model: at its default
    level it fuses Q/DQ pairs around an Add into an int8 kernel whose rounding differs from
    the graph's (one quantization step here), so a model whose Add is gone computes the same
    function but not the same bits as the fused one."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_qdq_transformer_has_a_block_group_a_layer(zoo_dir, name):
    """quantize_static (QDQ) writes every weight's DequantizeLinear at the top of the graph; the
    layers are still found where they read their weights (segment.blocks): a block group a
    layer with its attention and MLP branches, as the float model's, and a block removed
    exactly (the input with that block's integer weights at their zero points, its biases 0)."""
    model = onnx.load(quantized(zoo_dir, name, "qdq"))

    def block_groups(m: onnx.ModelProto) -> list:
        gset = find_groups(m)
        return [gset.groups[i] for layer in gset.layers if layer.kind == "block" for i in layer.groups]

    blocks = block_groups(model)
    float_blocks = block_groups(onnx.load(quantized(zoo_dir, name, "float")))
    assert len(blocks) == 2 and all(b.exact and b.unit.branches == 2 for b in blocks)
    assert [b.params for b in blocks] == [b.params for b in float_blocks]
    result = prune(model, 0.5, units=["block"], validate=False)
    [removed] = [result.groups.groups[i] for i in result.removed()]
    assert removed.unit.kind == "block"
    reference = zeroed_by_hand(model, chosen_slices(result))
    for feed in feeds(model, 2):
        for a, b in zip(run_unoptimized(reference, feed), run_unoptimized(result.model, feed), strict=True):
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    # the block's weights and biases go, and the per-tensor scales and zero points of the
    # quantized activations only its nodes read
    kept = {t.name for t in result.model.graph.initializer}
    gone = [t for t in model.graph.initializer if t.name not in kept]
    members = {m.initializer for m in removed.members}
    assert members <= {t.name for t in gone}
    others = [t for t in gone if t.name not in members]
    assert others and all(int(np.prod(t.dims)) == 1 for t in others)
    assert params(model) - params(result.model) == removed.params + len(others)
    # the proof of the first layer only compares what that layer hands on (the stream), not
    # the later layer's dequantized weights, which are written before it
    first = prune(model, 0.3, units=["head", "kv_group", "neuron"], validate_layers=1)
    assert first.shrink.passed and first.shrink.validation.kind == "first 1 of 2 repeated blocks"
    assert first.shrink.after.params < first.shrink.before.params


# ------------------------------------------------------------------ a prune that cannot shrink
def test_a_prune_whose_every_removal_is_kept_back_writes_nothing(tmp_path, monkeypatch, capsys):
    """The issue's QDQ BERT: every removal failed its proof and was kept back, and the model was
    written with the chosen groups zeroed, the size of the input. A proof that fails whenever a
    channel is removed stands for it here."""
    from onnxshrink import cli
    from onnxshrink.proof.verdict import OutputCheck
    from onnxshrink.stages import attempt as api

    def failing(reference, source, rewritten, opts, *more, **named):
        report = original(reference, source, rewritten, opts, *more, **named)
        if params(rewritten.model) < params(reference):
            report.passed = False
            report.outputs = [OutputCheck("y", [1, 4, 6, 6], 1.0, 1.0, False)]
        return report

    original = api.prove
    monkeypatch.setattr(api, "prove", failing)
    path, out = tmp_path / "qdq.onnx", tmp_path / "out.onnx"
    onnx.save(qdq_model(), path)
    code = cli.main(
        [str(path), "--prune", "0.5", "-o", str(out), "--masks-out", str(tmp_path / "m.npz")]
    )
    err = capsys.readouterr().err
    assert code == 1 and not out.exists() and not (tmp_path / "m.npz").exists()
    # the proof's recovery refuses a result no smaller than the input (before the prune's own
    # check that the chosen groups went): either says that nothing was written
    assert "nothing was written" in err.lower()


def test_a_qdq_model_is_proven_with_its_products_emulated_and_optimizations_off():
    """onnxruntime's default level fuses the remaining Q/DQ pairs into int8 kernels whose
    requantization moves a deep network by whole steps at any change of float order (a QDQ
    ResNet-50's reference differed from itself by 0.1 between levels, and its correct prune
    failed): the emulated integer products run with optimizations off, for both models."""
    model = qdq_model()
    result = prune(model, 0.5, validate=True, price=False)
    v = result.shrink.validation
    assert v.passed and "accumulated in integers" in v.detail and "ORT_DISABLE_ALL" in v.detail
    assert max(o.max_rel_error for o in v.outputs) <= 1e-5
    assert params(result.model) < params(model)
