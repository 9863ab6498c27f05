"""Elementwise ops: coupling across operands (residual Add, SE Mul), constants through activations."""

import numpy as np
import pytest
from conftest import init, shapes, shrink_checked, tiny

RESIDUAL = """
agraph (float[1, 4, 6, 6] x, float[4, 4, 3, 3] W1, float[4] B1, float[4, 4, 3, 3] W2, float[4] B2, float[3, 4, 1, 1] W3) => (float[1, 3, 6, 6] y)
{
  s = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
  r = Relu (s)
  b = Conv <pads = [1, 1, 1, 1]> (r, W2, B2)
  a = Add (b, r)
  o = Relu (a)
  y = Conv (o, W3)
}
"""


def test_residual_channel_zeroed_in_both_branches_is_removed():
    zero = {"W1": np.s_[[2]], "B1": np.s_[[2]], "W2": np.s_[[2]], "B2": np.s_[[2]]}
    result = shrink_checked(tiny(RESIDUAL, zero=zero))
    s = shapes(result.model)
    assert s["W1"] == (3, 4, 3, 3)
    assert s["W2"] == (3, 3, 3, 3)
    assert s["W3"] == (3, 3, 1, 1)


def test_residual_channel_zeroed_in_one_branch_only_is_kept_and_explained():
    result = shrink_checked(tiny(RESIDUAL, zero={"W2": np.s_[[1]], "B2": np.s_[[1]]}))
    assert shapes(result.model)["W2"] == (4, 4, 3, 3)
    [group] = [g for g in result.kept_zeroed if g.tensor == "W2" and g.axis == 0]
    assert group.kind == "meets-live" and group.count == 1
    assert "Add" in group.reason


SE = """
agraph (float[1, 4, 5, 5] x, float[6, 4, 1, 1] W1, float[6] B1, float[3, 6] F1, float[3] C1, float[6, 3] F2, float[6] C2, float[2, 6, 1, 1] W3) => (float[1, 2, 5, 5] y)
{
  c = Conv (x, W1, B1)
  h = Relu (c)
  g = GlobalAveragePool (h)
  f = Flatten (g)
  z1 = Gemm <transB = 1> (f, F1, C1)
  r1 = Relu (z1)
  z2 = Gemm <transB = 1> (r1, F2, C2)
  s = Sigmoid (z2)
  u = Unsqueeze <axes = [2, 3]> (s)
  m = Mul (h, u)
  y = Conv (m, W3)
}
"""


def test_squeeze_excite_mul_by_a_zero_channel_removes_the_gate_row():
    result = shrink_checked(tiny(SE, zero={"W1": np.s_[[0, 5]], "B1": np.s_[[0, 5]]}, opset=11))
    s = shapes(result.model)
    assert s["W1"] == (4, 4, 1, 1)
    assert s["F1"] == (3, 4)  # GAP of a zero channel is a zero constant: its column goes
    assert s["F2"] == (4, 3)  # h * sigmoid(.) is 0 there whatever the gate: the gate row goes
    assert s["W3"] == (2, 4, 1, 1)


BROADCAST_BIAS = """
agraph (float[1, 3, 4, 4] x, float[5, 3, 1, 1] W1, float[5, 1, 1] S, float[5, 1, 1] T, float[2, 5, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1)
  m = Mul (c, S)
  a = Add (m, T)
  r = LeakyRelu <alpha = 0.1> (a)
  y = Conv (r, W2)
}
"""


def test_per_channel_initializers_are_sliced_with_the_channels():
    # A zero scale makes the channel constant (T) whatever the conv; it is folded into W2's bias.
    result = shrink_checked(tiny(BROADCAST_BIAS, zero={"S": np.s_[[1, 3]]}))
    s = shapes(result.model)
    assert s["S"] == (3, 1, 1)
    assert s["T"] == (3, 1, 1)
    assert s["W1"] == (3, 3, 1, 1)
    assert [f.into for f in result.folds] == ["bias"]


ACTIVATIONS = ["Relu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Softplus", "Gelu", "LeakyRelu"]


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_constant_channel_travels_through_activation_to_a_linear_consumer(act):
    text = f"""
agraph (float[2, 5] x, float[4, 5] W1, float[4] B1, float[3, 4] W2, float[3] B2) => (float[2, 3] y)
{{
  a = Gemm <transB = 1> (x, W1, B1)
  r = {act} (a)
  y = Gemm <transB = 1> (r, W2, B2)
}}
"""
    model = tiny(text, zero={"W1": np.s_[[2]]}, values={"B1": [0.2, -0.7, 1.3, 0.4]}, opset=20)
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (3, 3)
    assert [f.into for f in result.folds] == ["bias"]


CLIP6 = """
agraph (float[1, 3, 4, 4] x, float[4, 3, 1, 1] W1, float[4] B1, float[2, 4, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  r = Clip (c, Lo, Hi)
  y = Conv (r, W2)
}
"""


def test_clip_with_scalar_bounds_as_inputs():
    model = tiny(CLIP6.replace("(float[1, 3, 4, 4] x,", "(float[1, 3, 4, 4] x, float Lo, float Hi,"),
                 zero={"W1": np.s_[[0]]}, values={"Lo": 0.0, "Hi": 6.0, "B1": [7.0, 1.0, 1.0, 1.0]})
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (2, 3, 1, 1)
    assert init(result.model, "Lo").shape == ()
