"""Concat, Split, Slice, Gather: index ranges move with offsets; sizes are rewritten."""

import numpy as np
import pytest
from conftest import init, shapes, shrink_checked, tiny

from onnxshrink.prepare import inferred_shapes

CONCAT = """
agraph (float[1, 3, 4, 4] x, float[4, 3, 1, 1] Wa, float[4] Ba, float[3, 3, 3, 3] Wb, float[3] Bb, float[2, 7, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  a = Conv (x, Wa, Ba)
  b = Conv <pads = [1, 1, 1, 1]> (x, Wb, Bb)
  c = Concat <axis = 1> (a, b)
  r = Relu (c)
  y = Conv (r, W2)
}
"""


def test_concat_branches_lose_their_own_channels():
    zero = {"Wa": np.s_[[1]], "Ba": np.s_[[1]], "Wb": np.s_[[0, 2]], "Bb": np.s_[[0, 2]]}
    result = shrink_checked(tiny(CONCAT, zero=zero))
    s = shapes(result.model)
    assert s["Wa"] == (3, 3, 1, 1)
    assert s["Wb"] == (1, 3, 3, 3)
    assert s["W2"] == (2, 4, 1, 1)


def test_a_whole_branch_leaves_the_concat():
    result = shrink_checked(tiny(CONCAT, zero={"Wb": np.s_[:], "Bb": np.s_[:]}))
    assert "Wb" not in shapes(result.model)
    assert shapes(result.model)["W2"] == (2, 4, 1, 1)
    concat = next(n for n in result.model.graph.node if n.op_type == "Concat")
    assert len(concat.input) == 1


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_split_sizes_follow_the_kept_channels(opset):
    split = {11: "Split <axis = 1, split = [2, 4]> (r)", 13: "Split <axis = 1> (r, Sizes)",
             18: "Split <axis = 1, num_outputs = 2> (r)"}[opset]
    sizes = "[2, 4]" if opset < 18 else "[3, 3]"
    extra = ", int64[2] Sizes" if opset == 13 else ""
    text = f"""
agraph (float[1, 3, 4, 4] x, float[6, 3, 1, 1] W1, float[6] B1, float[2, {sizes[1]}, 1, 1] Wp, float[2, {sizes[-2]}, 1, 1] Wq{extra}) => (float[1, 2, 4, 4] y)
{{
  c = Conv (x, W1, B1)
  r = Relu (c)
  p, q = {split}
  u = Conv (p, Wp)
  v = Conv (q, Wq)
  y = Add (u, v)
}}
"""
    model = tiny(text, zero={"W1": np.s_[[1, 4]], "B1": np.s_[[1, 4]]}, values={"Sizes": [2, 4]}, opset=opset)
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["W1"] == (4, 3, 1, 1)
    first = 1 if opset < 18 else 2
    assert s["Wp"] == (2, first, 1, 1)
    assert s["Wq"] == (2, 4 - first, 1, 1)


SLICE = """
agraph (float[1, 3, 4, 4] x, float[6, 3, 1, 1] W1, float[6] B1, int64[1] St, int64[1] En, int64[1] Ax, float[2, 3, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  s = Slice (r, St, En, Ax)
  y = Conv (s, W2)
}
"""


def test_slice_bounds_are_rewritten():
    # Channels 2..4 are read; channel 0 (outside) and 3 (inside, zeroed) go.
    model = tiny(SLICE, zero={"W1": np.s_[[0, 3]], "B1": np.s_[[0, 3]]}, values={"St": [2], "En": [5], "Ax": [1]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (2, 3, 1, 1)  # only 2 and 4 remain: 1 and 5 unread
    slc = next(n for n in result.model.graph.node if n.op_type == "Slice")
    assert init(result.model, slc.input[1]).tolist() == [0]
    assert init(result.model, slc.input[2]).tolist() == [2]


def test_slice_to_a_run_time_length_keeps_the_sliced_axis_and_prunes_the_others():
    # A causal-mask style slice: positions 0..T-1 of the sequence axis, T read from the input.
    text = """
agraph (float[1, T, 8] x, float[8, 6] W1, float[6, 4] W2, int64[1] Zero, int64[1] One) => (float[1, S, 4] y)
{
  h = MatMul (x, W1)
  r = Relu (h)
  shp = Shape (x)
  t = Gather <axis = 0> (shp, One)
  end = Sub (t, One)
  s = Slice (r, Zero, end, One)
  y = MatMul (s, W2)
}
"""
    model = tiny(text, zero={"W1": np.s_[:, [1, 4]]}, values={"Zero": [0], "One": [1]})
    result = shrink_checked(model, input_shapes={"x": [1, 5, 8]})
    assert not result.barriers
    assert shapes(result.model)["W1"] == (8, 4)
    assert shapes(result.model)["W2"] == (4, 4)


# A Slice with a negative step and a start before the first element starts at the first element
# in ONNX (and onnxruntime): x[-10:-100:-1] of 2 channels is channel 0. onnx's reference
# evaluator (numpy's slicing) selects nothing; the constant s was folded with 0 channels and the
# Conv reading the Concat failed ("could not be broadcast ... (1,0,4,4) ... (1,1,4,4)").
REVERSED_FROM_BEFORE_THE_START = """
agraph (float[1, 3, 4, 4] x, float[3, 3, 1, 1] W1, float[3] B1, float[2, 3, 1, 1] Wz, float[2] Bz,
        int64[1] S, int64[1] E, int64[1] A, int64[1] P, float[2, 4, 1, 1] W2, float[2] B2)
  => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  k = Conv (x, Wz, Bz)
  s = Slice (k, S, E, A, P)
  t = Concat <axis = 1> (c, s)
  y = Conv (t, W2, B2)
}
"""


def test_a_slice_with_a_negative_step_from_before_the_start_takes_the_first_element():
    values = {"S": [-10], "E": [-100], "A": [1], "P": [-1], "Bz": [0.5, -1.5]}
    model = tiny(REVERSED_FROM_BEFORE_THE_START, values=values, zero={"Wz": np.s_[:], "W1": np.s_[1], "B1": np.s_[1]})
    result = shrink_checked(model)
    # the zero channel of c goes; s (channel 0 of k: Bz[0] everywhere) is folded into B2
    assert shapes(result.model) == {"W1": (2, 3, 1, 1), "B1": (2,), "W2": (2, 2, 1, 1), "B2": (2,)}
    w2 = init(model, "W2")[:, 3, 0, 0]
    assert np.allclose(init(result.model, "B2"), init(model, "B2") + 0.5 * w2, rtol=1e-6)


# x[-1:7] along a dynamic H has 1 row while H <= 7 and none past it. The dims that do not
# depend on the input sizes are found by inferring shapes at two large sizes, where this slice
# is empty at both: it was taken as a static 0, the Slice (of nothing) was dropped and the
# ReduceSum reading it was left without an input ("Nodes in a graph must be topologically
# sorted").
CLAMPED_ON_A_DYNAMIC_AXIS = """
agraph (float[N, 3, H, W] x, float[3, 3, 1, 1] W1, float[3] B1, int64[1] S, int64[1] E, int64[1] A,
        int64[1] R, float[2, 3, 1, 1] W2, float[2] B2) => (float[N, 2, H, W] y)
{
  c = Conv (x, W1, B1)
  s = Slice (c, S, E, A)
  r = ReduceSum (s, R)
  g = Sigmoid (r)
  m = Mul (c, g)
  y = Conv (m, W2, B2)
}
"""


def test_a_slice_clamped_on_a_dynamic_axis_has_a_dynamic_size():
    values = {"S": [-1], "E": [7], "A": [2], "R": [2]}
    model = tiny(CLAMPED_ON_A_DYNAMIC_AXIS, values=values, zero={"W1": np.s_[[1]]})
    for h in (5, 9):  # a row, and none
        result = shrink_checked(model, input_shapes={"x": [2, 3, h, 4]})
        assert shapes(result.model)["W1"] == (3, 3, 1, 1)
    inferred = {vi.name: vi.type.tensor_type.shape.dim for vi in inferred_shapes(model)}
    assert not inferred["s"][2].HasField("dim_value") and inferred["s"][1].dim_value == 3
    assert not inferred["r"][2].HasField("dim_value") or inferred["r"][2].dim_value == 1


GATHER = """
agraph (float[1, 3, 4, 4] x, float[5, 3, 1, 1] W1, float[5] B1, int64[3] Idx, float[2, 3, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  g = Gather <axis = 1> (c, Idx)
  y = Conv (g, W2)
}
"""


def test_gather_of_channels_remaps_its_indices():
    model = tiny(GATHER, zero={"W2": np.s_[:, [1]]}, values={"Idx": [4, 0, 2]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (2, 3, 1, 1)  # channels 4 and 2
    g = next(n for n in result.model.graph.node if n.op_type == "Gather")
    assert init(result.model, g.input[1]).tolist() == [1, 0]
