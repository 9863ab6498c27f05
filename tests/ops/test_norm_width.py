"""Zero channels through LayerNorm and RMSNorm, in every form: the residual stream's width.

Each model is a stream of width 8 (a projection of the input, a write into it, a residual Add)
through two normalizations, with channels 1 and 5 zeroed everywhere they live (the projection's
columns and bias, the write's rows, columns and bias, both norms' scales and biases, the output
projection's rows). They leave, the norms keeping the statistics of the width 8. Checked with
validation off against the input itself in onnxruntime, fp32 and fp16, with random parameters
and with the libraries' defaults (unit scales, zero biases, one scale for both norms, as
exporters merge them).
"""

import numpy as np
import pytest
from conftest import error_against, params, shapes, tiny

from onnxshrink import shrink

CUT = [1, 5]
MS = '<ir_version: 9, opset_import: ["" : {opset}, "com.microsoft" : 1]>\n'

# NORM1 (input a, scale G1, bias Z1 -> n1) and the second norm, of the residual sum of a and b
STREAM = """
g (T[2, 5, 4] x, T[4, 8] Win, T[8] Bin, T[8] G1, T[8] Z1, T[8, 8] W1, T[8] B1, T[8] G2, T[8] Z2, T[8, 3] Wout, T Two, T Eps)
  => (T[2, 5, 3] y) {
  e = MatMul (x, Win)
  a = Add (e, Bin)
  NORM1
  f = MatMul (n1, W1)
  b = Add (f, B1)
  NORM2
  y = MatMul (n2, Wout)
}
"""


def decomposed_ln(i: int, x: str) -> str:
    return f"""
  m{i} = ReduceMean <axes = [-1]> ({x})
  c{i} = Sub ({x}, m{i})
  p{i} = Pow (c{i}, Two)
  v{i} = ReduceMean <axes = [-1]> (p{i})
  ve{i} = Add (v{i}, Eps)
  sd{i} = Sqrt (ve{i})
  nz{i} = Div (c{i}, sd{i})
  ng{i} = Mul (nz{i}, G{i})
  n{i} = Add (ng{i}, Z{i})"""


def decomposed_rms(i: int, x: str, div: bool = False) -> str:
    """As HuggingFace's LlamaRMSNorm exports (x * rsqrt(mean(x²) + eps) * scale), or x / sqrt."""
    scaled = f"nz{i} = Div ({x}, sd{i})" if div else f"r{i} = Reciprocal (sd{i})\n  nz{i} = Mul ({x}, r{i})"
    return f"""
  p{i} = Pow ({x}, Two)
  v{i} = ReduceMean <axes = [-1]> (p{i})
  ve{i} = Add (v{i}, Eps)
  sd{i} = Sqrt (ve{i})
  {scaled}
  n{i} = Mul (G{i}, nz{i})"""


def legacy_rms(i: int, x: str) -> str:
    """As torch's legacy exporter writes LlamaRMSNorm: float32 statistics (a Cast), rsqrt as
    Div(1, Sqrt) with Constant nodes for 1 and epsilon, the Cast back, then the scale."""
    return f"""
  xc{i} = Cast <to = 1> ({x})
  p{i} = Pow (xc{i}, Two)
  v{i} = ReduceMean <axes = [-1]> (p{i})
  eps{i} = Constant <value = float {{1e-5}}> ()
  ve{i} = Add (v{i}, eps{i})
  sd{i} = Sqrt (ve{i})
  one{i} = Constant <value = float {{1.0}}> ()
  r{i} = Div (one{i}, sd{i})
  nz{i} = Mul (xc{i}, r{i})
  nc{i} = Cast <to = TENUM> (nz{i})
  n{i} = Mul (G{i}, nc{i})"""


def second(norm) -> str:
    return "s = Add (a, b)\n  " + norm(2, "s")


# form: (first norm, second norm, centered (has a bias), opset)
FORMS = {
    "LayerNormalization": (
        "n1 = LayerNormalization <axis = -1, epsilon = 1e-5> (a, G1, Z1)",
        "s = Add (a, b)\n  n2 = LayerNormalization <axis = -1, epsilon = 1e-5> (s, G2, Z2)",
        True, 17,
    ),
    "RMSNormalization": (
        "n1 = RMSNormalization <axis = -1, epsilon = 1e-5> (a, G1)",
        "s = Add (a, b)\n  n2 = RMSNormalization <axis = -1, epsilon = 1e-5> (s, G2)",
        False, 23,
    ),
    "SimplifiedLayerNormalization": (
        "n1 = com.microsoft.SimplifiedLayerNormalization <axis = -1, epsilon = 1e-5> (a, G1)",
        "s = Add (a, b)\n  n2 = com.microsoft.SimplifiedLayerNormalization <axis = -1, epsilon = 1e-5> (s, G2)",
        False, 17,
    ),
    "SkipLayerNormalization": (
        "n1 = LayerNormalization <axis = -1, epsilon = 1e-5> (a, G1, Z1)",
        "n2 = com.microsoft.SkipLayerNormalization <epsilon = 1e-5> (b, a, G2, Z2)",
        True, 17,
    ),
    "SkipSimplifiedLayerNormalization": (
        "n1 = com.microsoft.SimplifiedLayerNormalization <axis = -1, epsilon = 1e-5> (a, G1)",
        "n2 = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 1e-5> (b, a, G2)",
        False, 17,
    ),
    "decomposed LayerNorm": (decomposed_ln(1, "a"), second(decomposed_ln), True, 17),
    "decomposed RMSNorm": (decomposed_rms(1, "a"), second(decomposed_rms), False, 17),
    "decomposed RMSNorm, Div": (
        decomposed_rms(1, "a", div=True),
        second(lambda i, x: decomposed_rms(i, x, div=True)),
        False, 17,
    ),
    "decomposed RMSNorm, legacy rsqrt": (legacy_rms(1, "a"), second(legacy_rms), False, 17),
}  # fmt: skip


def stream(form: str, dtype: str, init: str):
    """The model, and the zeros that are its masks."""
    norm1, norm2, centered, opset = FORMS[form]
    text = STREAM.replace("NORM1", norm1).replace("NORM2", norm2).replace("T[", f"{dtype}[")
    text = text.replace("TENUM", "10" if dtype == "float16" else "1")
    text = text.replace("T Two", f"{dtype} Two").replace("T Eps", f"{dtype} Eps")
    if "Two" not in norm1:
        text = text.replace(f", {dtype} Two, {dtype} Eps", "")
    elif "Eps" not in norm1:  # a Constant node's epsilon
        text = text.replace(f", {dtype} Eps", "")
    if not centered:
        text = text.replace(f", {dtype}[8] Z1", "").replace(f", {dtype}[8] Z2", "")
    np_dtype = np.float16 if dtype == "float16" else np.float32
    values: dict = {"Two": np.asarray(2.0, np_dtype), "Eps": np.asarray(1e-5, np_dtype)}
    values = {k: v for k, v in values.items() if f"{dtype} {k}" in text}
    if init == "default":  # unit scales, zero biases, one scale (and bias) for both norms
        values |= {"G1": np.ones(8, np_dtype), "Z1": np.zeros(8, np_dtype), "Bin": np.zeros(8, np_dtype)}
        values |= {"B1": np.zeros(8, np_dtype)}
        text = text.replace(f", {dtype}[8] G2", "").replace(f", {dtype}[8] Z2", "")
        text = text.replace("G2", "G1").replace("Z2", "Z1")
    names = ["G1", "Z1", "G2", "Z2"] if centered else ["G1", "G2"]
    zero = {"Win": np.s_[:, CUT], "Bin": np.s_[CUT], "W1": np.s_[CUT, :], "B1": np.s_[CUT], "Wout": np.s_[CUT, :]}
    zero |= {n: np.s_[CUT] for n in names if f"{dtype}[8] {n}" in text}
    model = tiny(MS.format(opset=opset) + text, zero=zero, values=values, opset=opset)
    for node in model.graph.node:  # onnxruntime's optimizer writes it in the ONNX domain
        if node.op_type == "SimplifiedLayerNormalization":
            node.domain = ""
    w1 = next(t for t in model.graph.initializer if t.name == "W1")  # its columns write into the stream
    from onnx import numpy_helper

    arr = numpy_helper.to_array(w1).copy()
    arr[:, CUT] = 0
    w1.CopyFrom(numpy_helper.from_array(arr, "W1"))
    return model, centered


@pytest.mark.parametrize("init", ["random", "default"])
@pytest.mark.parametrize("dtype", ["float", "float16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_zero_channels_leave_the_normalized_stream_exactly(form, dtype, init):
    model, centered = stream(form, dtype, init)
    result = shrink(model, validate=False)
    tol = 1e-5 if dtype == "float" else 9.8e-3  # the proof's default: ten machine epsilons
    assert error_against(model, result.model) <= tol
    s = shapes(result.model)
    assert s["Win"] == (4, 6) and s["W1"] == (6, 6) and s["Wout"] == (6, 3) and s["G1"] == (6,)
    # every zeroed slice is gone (a scale or bias of 2 per norm, the weights' rows and columns)
    norms = 1 if init == "default" else 2
    removed = 2 * 4 + 2 + (8 * 8 - 6 * 6) + 2 + 2 * 3 + norms * 2 * (2 if centered else 1)
    added = 3 * 2 if form == "decomposed LayerNorm" else 0  # its means' factors (scalars)
    assert result.before.params - result.after.params == removed - added
    assert not result.kept_zeroed


def test_a_zero_channel_whose_layernorm_scale_is_not_zero_stays_and_explain_says_why():
    # LayerNorm of a zero channel is -mean / std x scale + bias: read downstream, it stays.
    model, _ = stream("LayerNormalization", "float", "random")
    from onnx import numpy_helper

    g1 = next(t for t in model.graph.initializer if t.name == "G1")
    g1.CopyFrom(numpy_helper.from_array(np.full(8, 0.7, np.float32), "G1"))
    w1 = next(t for t in model.graph.initializer if t.name == "W1")
    read = numpy_helper.to_array(w1).copy()
    read[CUT, :] = 0.3  # W1 reads the norm's output there
    read[:, CUT] = 0  # (and writes zeros into the stream)
    w1.CopyFrom(numpy_helper.from_array(read, "W1"))
    result = shrink(model, validate=False)
    assert error_against(model, result.model) <= 1e-5
    assert shapes(result.model)["Win"] == (4, 8)
    [group] = [g for g in result.kept_zeroed if g.tensor == "Win" and g.axis == 1]
    assert group.count == 2 and group.kind == "normalization"
    assert "LayerNormalization" in group.reason and "its scale is not zero" in group.reason


def test_an_rmsnorm_outputs_zero_for_a_zero_channel_whatever_its_scale():
    model, _ = stream("RMSNormalization", "float", "random")
    from onnx import numpy_helper

    for t in model.graph.initializer:
        if t.name in ("G1", "G2"):
            t.CopyFrom(numpy_helper.from_array(np.full(8, 0.7, np.float32), t.name))
    result = shrink(model, validate=False)
    assert error_against(model, result.model) <= 1e-5
    assert shapes(result.model)["Win"] == (4, 6) and shapes(result.model)["G1"] == (6,)
    [norm] = [n for n in result.model.graph.node if n.op_type == "RMSNormalization"][:1]
    eps = next(a.f for a in norm.attribute if a.name == "epsilon")
    assert eps == pytest.approx(1e-5 * 8 / 6, rel=1e-6)  # epsilon x d / (d - k)
    g1 = next(numpy_helper.to_array(t) for t in result.model.graph.initializer if t.name == "G1")
    np.testing.assert_allclose(g1, 0.7 * np.sqrt(8 / 6), rtol=1e-6)  # scale x sqrt(d / (d - k))


def test_the_forms_used_are_in_the_report():
    folds = {}
    for form in ("LayerNormalization", "RMSNormalization", "decomposed LayerNorm", "decomposed RMSNorm"):
        model, _ = stream(form, "float", "random")
        folds[form] = sorted({(f.into, f.channels) for f in shrink(model, validate=False).folds})
    assert folds == {
        "LayerNormalization": [("normalization over a zero-padded input", 2)],
        "RMSNormalization": [("normalization with epsilon and scale rescaled", 2)],
        "decomposed LayerNorm": [
            ("mean with its original divisor", 2), ("variance with its original divisor", 2)
        ],
        "decomposed RMSNorm": [("normalization with epsilon and scale rescaled", 2)],
    }  # fmt: skip


@pytest.mark.parametrize("form", ["decomposed RMSNorm", "decomposed RMSNorm, legacy rsqrt"])
def test_a_decomposed_rmsnorm_is_rescaled_in_place_with_no_node_added(form):
    # rsqrt(mean + eps) as Reciprocal or Div(1, .): epsilon x d/(d-k), scale x sqrt(d/(d-k));
    # not the mean's divisor kept by a Mul after it
    model, _ = stream(form, "float", "random")
    result = shrink(model, validate=False)
    assert error_against(model, result.model) <= 1e-5
    ops = sorted(n.op_type for n in model.graph.node if n.op_type != "Constant")
    assert sorted(n.op_type for n in result.model.graph.node if n.op_type != "Constant") == ops
    assert {(f.into, f.channels) for f in result.folds} == {("normalization with epsilon and scale rescaled", 2)}
    from onnx import numpy_helper

    values = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    g1 = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "G1")
    kept = [c for c in range(8) if c not in CUT]
    np.testing.assert_allclose(values["G1"], g1[kept] * np.sqrt(8 / 6), rtol=1e-6)  # x sqrt(d / (d - k))


GROUPNORM = """
g (float[2, 3, 5, 5] x, float[8, 3, 1, 1] W1, float[8] B1, float[8] S, float[8] T, float[2, 8, 1, 1] W2) => (float[2, 2, 5, 5] y)
  <float[2, 8, 5, 5] n>
{
  c = Conv (x, W1, B1)
  n = GroupNormalization <num_groups = 4> (c, S, T)
  y = Conv (n, W2)
}
"""


def test_a_zero_group_leaves_a_group_norm_whole():
    # Group 1 (channels 2 and 3) is zero: its outputs are the bias T, folded into W2's bias.
    # (onnx infers no shape for GroupNormalization-21's output: exporters record it, as here.)
    model = tiny(GROUPNORM, zero={"W1": np.s_[2:4], "B1": np.s_[2:4]}, opset=21)
    result = shrink(model, validate=False)
    assert error_against(model, result.model) <= 1e-5
    s = shapes(result.model)
    assert s["W1"] == (6, 3, 1, 1) and s["S"] == s["T"] == (6,) and s["W2"] == (2, 6, 1, 1)
    [gn] = [n for n in result.model.graph.node if n.op_type == "GroupNormalization"]
    assert next(a.i for a in gn.attribute if a.name == "num_groups") == 3
    assert params(result.model) == params(model) - 2 * (3 + 1 + 1 + 1 + 2) + 2  # W2's new bias


SKIP_WITH_BIAS = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[2, 4, 6] x, float[6, 8] We, float[8, 8] W1, float[8, 8] W3, float[8] G, float[8] Bt,
   float[8] G2, float[8] Bt2, float[8] Bd, float[8, 3] W2) => (float[2, 4, 3] out) {
  e = MatMul (x, We)
  a = MatMul (e, W1)
  y0, m, iv, s = com.microsoft.SkipLayerNormalization <epsilon = 1e-5> (a, e, G, Bt)
  c = MatMul (y0, W3)
  y1, m2, iv2, s2 = com.microsoft.SkipLayerNormalization <epsilon = 1e-5> (c, s, G2, Bt2, Bd)
  out = MatMul (y1, W2)
}"""


@pytest.mark.parametrize("init", ["random", "default"])
def test_a_skip_layernorm_with_its_bias_input_keeps_the_statistics_of_its_width(init):
    """The fifth input (a bias added before normalizing) is a summand: once sliced, the norm must
    still be padded back to its original width (it was left unpadded: error 0.58)."""
    values = {}
    if init == "default":  # unit scales, zero biases
        values = {"G": np.ones(8, np.float32), "G2": np.ones(8, np.float32)}
        values |= {n: np.zeros(8, np.float32) for n in ("Bt", "Bt2", "Bd")}
    zero = {"We": np.s_[:, CUT], "W1": np.s_[:, CUT], "W3": np.s_[:, CUT]}
    zero |= {n: np.s_[CUT] for n in ("G", "Bt", "G2", "Bt2", "Bd")}
    model = tiny(SKIP_WITH_BIAS, zero=zero, values=values)
    result = shrink(model, validate=False)
    assert error_against(model, result.model) <= 1e-5
    s = shapes(result.model)
    assert s["We"] == (6, 6) and s["W1"] == (6, 6) and s["W3"] == (6, 6) and s["W2"] == (6, 3)
    assert s["Bd"] == (6,) and s["G2"] == (6,)
