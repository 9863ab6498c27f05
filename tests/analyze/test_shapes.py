"""Symbolic shape values and the dims they fill in: what lets a channel axis be known to
broadcast rather than be pinned."""

import numpy as np
from conftest import shapes, shrink_checked, tiny

# The legacy exporter's expand(n, 1): Where(Equal(target, -1), 1, target), target from Shape.
LEGACY_EXPAND = """
agraph (float[N, 6] x, float[6, 5] W1, float[5, 3] W2, int64[1] Axes, int64[1] Zero, int64[1] One, int64[2] NegOnes, int64[2] Ones) => (float[N, 3] y)
{
  s = ReduceSum <keepdims = 1> (x, Axes)
  shp = Shape (x)
  n = Gather <axis = 0> (shp, Zero)
  target = Concat <axis = 0> (n, One)
  unset = Equal (target, NegOnes)
  size = Where (unset, Ones, target)
  m = Expand (s, size)
  h = MatMul (x, W1)
  a = Add (h, m)
  r = Relu (a)
  y = MatMul (r, W2)
}
"""


def test_a_where_built_expand_target_is_understood_and_its_size_broadcasts():
    # m is [N, 1] at run time: added to every channel, it leaves channels 1 and 3 (zero in W1)
    # carrying m only, which W2 does not read. Knowing m's last dim is 1 takes following the
    # target through Equal and Where, then the Expand's dims through Add and Relu.
    values = {"Axes": [1], "Zero": [0], "One": [1], "NegOnes": [-1, -1], "Ones": [1, 1]}
    zero = {"W1": np.s_[:, [1, 3]], "W2": np.s_[[1, 3]]}
    result = shrink_checked(tiny(LEGACY_EXPAND, zero=zero, values=values), input_shapes={"x": [3, 6]})
    assert shapes(result.model)["W1"] == (6, 3)
    assert shapes(result.model)["W2"] == (3, 3)
    assert not result.barriers


# Two run-time slices joined again: shape inference knows neither part's dims, nor the join's.
SLICES_JOINED = """
agraph (float[N, T, 6] x, float[6, 5] W1, float[5, 3] W2, int64[1] Zero, int64[1] One, int64[1] Two) => (float[N, S, 3] y)
{
  h = MatMul (x, W1)
  r = Relu (h)
  shp = Shape (x)
  t = Gather <axis = 0> (shp, One)
  half = Div (t, Two)
  a = Slice (r, Zero, half, One)
  b = Slice (r, half, t, One)
  c = Concat <axis = 1> (b, a)
  y = MatMul (c, W2)
}
"""


def test_dims_of_run_time_slices_are_carried_through_their_concat():
    values = {"Zero": [0], "One": [1], "Two": [2]}
    model = tiny(SLICES_JOINED, zero={"W1": np.s_[:, [0, 4]]}, values=values)
    result = shrink_checked(model, input_shapes={"x": [2, 6, 6]})
    assert shapes(result.model)["W1"] == (6, 3)
    assert shapes(result.model)["W2"] == (3, 3)
