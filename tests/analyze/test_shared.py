"""A weight several nodes read (analyze/shared.py): sliced two ways it is stored twice, so where
the two slices hold more than the weight, both readers read it sliced once for them all; where
two slices are smaller in all (their readers' other weights lose more), they stay two."""

import numpy as np
from conftest import error_against, init, params, shapes, shrink_checked, tiny

from onnxshrink.analyze.shared import union_if_larger

# Two LSTMs read one W, R and B (a layer applied to two sequences); the first reads features a
# MatMul computes, of which U's column 0 is zero: alone, that LSTM could drop W's column 0.
SHARED_LSTM = """
g (float[5, 2, 12] x, float[5, 2, 12] b, float[12, 12] U, float[1, 64, 12] W, float[1, 64, 16] R, float[1, 128] B)
  => (float[5, 1, 2, 16] y1, float[5, 1, 2, 16] y2) {
  a = MatMul (x, U)
  y1, h1 = LSTM <hidden_size = 16> (a, W, R, B)
  y2, h2 = LSTM <hidden_size = 16> (b, W, R, B)
}"""


def test_a_shared_lstm_weight_is_not_stored_twice_to_drop_one_of_its_columns():
    model = tiny(SHARED_LSTM, zero={"U": np.s_[:, 0]})
    result = shrink_checked(model)
    # W once, whole: two copies (64 x 11 and 64 x 12) would hold 768 more parameters than it,
    # to save U's column and 2% of the multiply-adds
    assert sorted(t.name for t in result.model.graph.initializer) == ["B", "R", "U", "W"]
    assert shapes(result.model)["W"] == (1, 64, 12) and shapes(result.model)["U"] == (12, 12)
    assert params(result.model) == params(model) == 12 * 12 + 64 * 12 + 64 * 16 + 128
    np.testing.assert_array_equal(init(result.model, "W"), init(model, "W"))


# Two Gemms read one weight: the first drops its rows 0-3 (its input's first 4 features are
# zero), the second its rows 4-7; each sliced alone holds 4 of 8 rows: stored twice, 8 rows.
SPLIT = """
g (float[2, 8] x, float[2, 8] z, float[8, 8] P, float[8, 6] W) => (float[2, 6] y1, float[2, 6] y2) {
  a = MatMul (x, P)
  c = MatMul (z, P2)
  y1 = MatMul (a, W)
  y2 = MatMul (c, W)
}""".replace("float[8, 8] P,", "float[8, 8] P, float[8, 8] P2,")


def test_two_slices_of_a_shared_weight_stay_two_when_they_hold_no_more_than_it():
    model = tiny(SPLIT, zero={"P": np.s_[:, :4], "P2": np.s_[:, 4:]})
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["P"] == s["P2"] == (8, 4) and sorted(v for k, v in s.items() if k.startswith("W")) == [(4, 6), (4, 6)]
    assert params(result.model) == params(model) - 2 * 8 * 4
    assert error_against(model, result.model) <= 1e-5


def test_union_if_larger():
    a, b = np.array([True, True, False, True]), np.array([True, True, True, True])
    full = [np.ones(3, bool)]
    # 3 x 3 + 4 x 3 = 21 > 12 elements: one slicing, the union
    got = union_if_larger([[a, *full], [b, *full]])
    assert got is not None and got[0].tolist() == [True] * 4 and got[1].tolist() == [True] * 3
    # 2 + 2 of 4 rows: no more than the weight
    assert union_if_larger([[np.array([1, 1, 0, 0], bool)], [np.array([0, 0, 1, 1], bool)]]) is None
    # the same slicing twice is stored once; one copy, or an axis of unknown size: nothing to do
    assert union_if_larger([[a], [a.copy()]]) is None
    assert union_if_larger([[a]]) is None and union_if_larger([[a], [None]]) is None
