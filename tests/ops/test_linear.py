"""Gemm and MatMul: features through weights; constant features folded into the bias."""

import math

import numpy as np
import pytest
from conftest import init, shapes, shrink_checked, tiny

GEMM = """
agraph (float[2, 6] x, float[5, 6] W1, float[5] B1, float[4, 5] W2, float[4] B2) => (float[2, 4] y)
{
  a = Gemm <transB = 1> (x, W1, B1)
  r = Relu (a)
  y = Gemm <transB = 1> (r, W2, B2)
}
"""


def test_gemm_rows_and_columns_go_together():
    result = shrink_checked(tiny(GEMM, zero={"W1": np.s_[[0, 3]], "B1": np.s_[[0, 3]]}))
    s = shapes(result.model)
    assert s["W1"] == (3, 6)
    assert s["B1"] == (3,)
    assert s["W2"] == (4, 3)


def test_gemm_constant_feature_folds_into_c():
    model = tiny(GEMM, zero={"W1": np.s_[[1]]}, values={"B1": [0.1, 2.0, -0.3, 0.4, 0.5]})
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (4, 4)
    assert [f.into for f in result.folds] == ["bias"]
    b2 = init(result.model, "B2")
    assert np.allclose(b2, init(model, "B2") + 2.0 * init(model, "W2")[:, 1], rtol=1e-6)


GEMM_NO_C = """
agraph (float[2, 6] x, float[6, 5] W1, float[5] B1, float[5, 4] W2) => (float[2, 4] y)
{
  a = Gemm (x, W1, B1)
  r = Sigmoid (a)
  y = Gemm <alpha = 2.0> (r, W2)
}
"""


def test_gemm_without_c_gets_one_and_sigmoid_of_zero_is_half():
    # A zeroed column of W1 (not transposed) with a zero bias gives sigmoid(0) = 0.5.
    result = shrink_checked(tiny(GEMM_NO_C, zero={"W1": np.s_[:, [2]], "B1": np.s_[[2]]}))
    s = shapes(result.model)
    assert s["W1"] == (6, 4)
    assert s["W2"] == (4, 4)
    gemm = [n for n in result.model.graph.node if n.op_type == "Gemm"][1]
    assert len(gemm.input) == 3
    c = init(result.model, gemm.input[2])
    model = tiny(GEMM_NO_C, zero={"W1": np.s_[:, [2]], "B1": np.s_[[2]]})
    assert np.allclose(c, 2.0 * 0.5 * init(model, "W2")[2], rtol=1e-6)


MATMUL = """
agraph (float[2, 7, 6] x, float[6, 5] W1, float[5] B1, float[5, 3] W2, float[3] B2) => (float[2, 7, 3] y)
{
  m = MatMul (x, W1)
  a = Add (m, B1)
  r = Gelu (a)
  n = MatMul (r, W2)
  y = Add (n, B2)
}
"""


def test_matmul_with_constant_weight_on_rank3_input():
    result = shrink_checked(tiny(MATMUL, zero={"W1": np.s_[:, [0, 4]], "B1": np.s_[[0, 4]]}, opset=20))
    s = shapes(result.model)
    assert s["W1"] == (6, 3)
    assert s["B1"] == (3,)
    assert s["W2"] == (3, 3)
    assert not result.folds


def test_matmul_constant_neuron_folds_into_the_following_bias_add():
    model = tiny(MATMUL, zero={"W1": np.s_[:, [1]]}, values={"B1": [0.3, 1.2, -0.4, 0.2, 0.9]}, opset=20)
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (4, 3)
    assert [f.into for f in result.folds] == ["bias"]
    assert result.after.ops["Add"] == 2  # folded into B2, no new node
    b2 = init(result.model, "B2")
    g = 0.5 * 1.2 * (1 + math.erf(1.2 / math.sqrt(2)))  # gelu(1.2)
    assert np.allclose(b2, init(model, "B2") + g * init(model, "W2")[1], rtol=1e-5)


TRANSPOSED_WEIGHT = """
agraph (float[3, 6] x, float[5, 6] W1, float[4, 5] W2) => (float[3, 4] y)
{
  t1 = Transpose <perm = [1, 0]> (W1)
  a = MatMul (x, t1)
  r = Relu (a)
  t2 = Transpose <perm = [1, 0]> (W2)
  y = MatMul (r, t2)
}
"""


def test_matmul_through_an_explicit_weight_transpose():
    # torch.onnx.export(optimize=False) keeps Linear weights as Transpose(W) -> MatMul.
    result = shrink_checked(tiny(TRANSPOSED_WEIGHT, zero={"W1": np.s_[[1, 2]]}))
    s = shapes(result.model)
    assert s["W1"] == (3, 6)
    assert s["W2"] == (4, 3)


BOTH_LIVE = """
agraph (float[2, 4, 6] q, float[2, 6, 5] k) => (float[2, 4, 5] y)
{
  y = MatMul (q, k)
}
"""


def test_matmul_of_two_activations_keeps_everything():
    result = shrink_checked(tiny(BOTH_LIVE))
    assert result.after.params == 0
    assert result.after.ops == {"MatMul": 1}


GEMM_SYMBOLIC_OUT = """
agraph (float[N, 6] x, float[6, 8] W1, float[8] B1, float[4, 8] W2, float[4] B2) => (float[N, M] y)
{
  h = Gemm (x, W1, B1)
  r = Relu (h)
  y = Gemm <transB = 1> (r, W2, B2)
}
"""


def test_gemm_whose_declared_output_has_a_symbolic_last_dim():
    # y's last dim is declared "M" (it is W2's 4): that axis keeps everything; the zeroed
    # columns of W1 are constants (the bias) folded into B2.
    model = tiny(GEMM_SYMBOLIC_OUT, zero={"W1": np.s_[:, [1, 3]]})
    result = shrink_checked(model, input_shapes={"x": [2, 6]})
    assert shapes(result.model)["W1"] == (6, 6)
    assert shapes(result.model)["W2"] == (4, 6)
    assert [f.into for f in result.folds] == ["bias"]


# A constant weight multiplying from the left (W @ x, Gemm's A) whose input is a constant
# (a zeroed conv's bias, pooled): the weight's columns are absorbed as constant features and
# its row 0 goes (W3 reads nothing of channel 0 of m). The folded constant is A's columns times
# t for the KEPT rows only; it once kept every row and made Gemm's C, or the MatMul's new Add,
# the size of the unshrunk output (onnxruntime: "Invalid bias shape for broadcast").
LEFT_CONSTANT = """
agraph (float[1, 3, 4, 4] x, float[2, 3, 1, 1] W1, float[2] B1, float[2, 2] A, {c}
        int64[2] Axes, float[2, 3, 1, 1] W2, float[2] B2, float[3, 2, 1, 1] W3, float[3] B3)
  => (float[1, 3, 4, 4] y)
{{
  c = Conv (x, W1, B1)
  p = GlobalAveragePool (c)
  f = Flatten (p)
  t = Transpose <perm = [1, 0]> (f)
  z = {op}
  s = Transpose <perm = [1, 0]> (z)
  u = Unsqueeze (s, Axes)
  d = Conv (x, W2, B2)
  m = Mul (d, u)
  y = Conv (m, W3, B3)
}}
"""


@pytest.mark.parametrize("op", ["Gemm <transA = 1> (A, t, C)", "Gemm (A, t, C)", "MatMul (A, t)"])
def test_a_constant_folded_through_a_left_multiplying_weight_keeps_only_the_kept_rows(op):
    text = LEFT_CONSTANT.format(c="" if op.startswith("MatMul") else "float[2, 1] C,", op=op)
    model = tiny(text, values={"Axes": [2, 3]}, zero={"W1": np.s_[:], "W3": np.s_[:, 0]}, seed=5)
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["A"] == (1, 1)
    assert s.get("C", s.get("onnxshrink__folded")) == (1, 1)
    assert s["W2"] == (1, 3, 1, 1) and s["W3"] == (3, 1, 1, 1)
    assert [(f.op, f.into) for f in result.folds] == [(op.split()[0], "bias")]


# Gemm's A is a constant along an axis of dynamic size (H and W are symbols): that axis has no
# kept set (nothing along it can go), so there is nothing to fold; the rewrite once asked for
# its kept set and failed ("axis 1: no kept set (a dynamic size)", exit 3).
DYNAMIC_CONSTANT_A = """
agraph (float[N, 3, H, W] x, float[2, 3, 1, 1] W1, float[2] B1, float[1, 1] K, float[4, 32] W2{c})
  => (float[N, 4] y)
{{
  h = Conv (x, W1, B1)
  f = Flatten (h)
  s = Shape (f)
  e = Expand (K, s)
  a = Mul (f, e)
  y = Gemm <transB = 1> ({inputs})
}}
"""


@pytest.mark.parametrize("with_c", [True, False])
def test_gemm_of_a_constant_whose_features_axis_is_dynamic(with_c):
    text = DYNAMIC_CONSTANT_A.format(c=", float[4] B2" if with_c else "", inputs="a, W2, B2" if with_c else "a, W2")
    model = tiny(text, values={"K": [[0.0]]} if with_c else {"K": [[0.5]]})
    result = shrink_checked(model, input_shapes={"x": [2, 3, 4, 4]})
    s = shapes(result.model)
    assert s["W2"] == (4, 32) and s["W1"] == (2, 3, 1, 1)
    assert not result.folds


# Features 0, 1 and 2 of h are constant (W1's columns zeroed) and vary over its 2 rows (P's);
# y reads only feature 0 (W2's rows 1 and 2 zeroed). Folding feature 0 stores a 2 x 8 constant
# to take out one 8-wide row of W2 (and a column of W1 and of P): the count took features 1
# and 2 in, which go without a fold, and the shrink stored 16 to remove 14.
VARYING_UNREAD = """
agraph (float[1, 2, 4] x, float[4, 5] W1, float[2, 5] P, float[5, 8] W2) => (float[1, 2, 8] y)
{
  m = MatMul (x, W1)
  h = Add (m, P)
  y = MatMul (h, W2)
}
"""


def test_a_varying_constant_feature_is_folded_only_where_the_rows_it_removes_pay():
    from conftest import params

    model = tiny(VARYING_UNREAD, seed=5, zero={"W1": np.s_[:, [0, 1, 2]], "W2": np.s_[[1, 2]]})
    result = shrink_checked(model)  # equal to the input, checked there in onnxruntime
    s = shapes(result.model)
    assert s["W2"] == (3, 8) and s["W1"] == (4, 3) and s["P"] == (2, 3)
    assert not result.folds
    assert params(result.model) == params(model) - 2 * 8 - 2 * (4 + 2)
