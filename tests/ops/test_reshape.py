"""Layout ops: Flatten/Reshape into Linear (whole blocks), shape subgraphs, channel shuffle."""

import numpy as np
from conftest import init, shapes, shrink_checked, tiny

from onnxshrink.ops.reshape import reshape_groups

FLATTEN = """
agraph (float[1, 3, 4, 4] x, float[5, 3, 3, 3] W1, float[5] B1, float[6, 20] F, float[6] C) => (float[1, 6] y)
{
  c = Conv <pads = [1, 1, 1, 1], strides = [2, 2]> (x, W1, B1)
  r = Relu (c)
  f = Flatten (r)
  y = Gemm <transB = 1> (f, F, C)
}
"""


def test_flatten_into_gemm_removes_whole_channel_blocks():
    result = shrink_checked(tiny(FLATTEN, zero={"W1": np.s_[[1, 3]], "B1": np.s_[[1, 3]]}))
    s = shapes(result.model)
    assert s["W1"] == (3, 3, 3, 3)
    assert s["F"] == (6, 12)  # 3 channels x 2 x 2 positions


def test_gemm_columns_of_a_whole_channel_zeroed_remove_the_channel():
    # The Linear ignores all 4 positions of channel 2: the conv filter goes too.
    result = shrink_checked(tiny(FLATTEN, zero={"F": np.s_[:, 8:12]}))
    assert shapes(result.model)["W1"] == (4, 3, 3, 3)


def test_gemm_columns_of_part_of_a_channel_keep_it():
    result = shrink_checked(tiny(FLATTEN, zero={"F": np.s_[:, 8:11]}))
    assert shapes(result.model)["W1"] == (5, 3, 3, 3)


RESHAPE_CONST = """
agraph (float[N, 3, 4, 4] x, float[5, 3, 3, 3] W1, float[5] B1, int64[2] Shape, float[6, 20] F, float[6] C) => (float[N, 6] y)
{
  c = Conv <pads = [1, 1, 1, 1], strides = [2, 2]> (x, W1, B1)
  r = Relu (c)
  f = Reshape (r, Shape)
  y = Gemm <transB = 1> (f, F, C)
}
"""


def test_constant_reshape_target_is_rewritten():
    model = tiny(RESHAPE_CONST, zero={"W1": np.s_[[0]], "B1": np.s_[[0]]}, values={"Shape": [-1, 20]})
    result = shrink_checked(model)
    assert shapes(result.model)["F"] == (6, 16)
    reshape = next(n for n in result.model.graph.node if n.op_type == "Reshape")
    assert init(result.model, reshape.input[1]).tolist() == [-1, 16]


RESHAPE_SHAPE_OF = """
agraph (float[N, 3, 4, 4] x, float[5, 3, 3, 3] W1, float[5] B1, int64[1] I0, int64[1] Minus1, float[6, 20] F) => (float[N, 6] y)
{
  c = Conv <pads = [1, 1, 1, 1], strides = [2, 2]> (x, W1, B1)
  r = Relu (c)
  s = Shape (r)
  b = Gather <axis = 0> (s, I0)
  t = Concat <axis = 0> (b, Minus1)
  f = Reshape (r, t)
  y = Gemm <transB = 1> (f, F)
}
"""


def test_shape_computed_target_with_dynamic_batch():
    # x.view(x.size(0), -1) as the legacy exporter writes it.
    model = tiny(RESHAPE_SHAPE_OF, zero={"W1": np.s_[[2, 4]], "B1": np.s_[[2, 4]]}, values={"I0": [0], "Minus1": [-1]})
    result = shrink_checked(model, input_shapes={"x": [3, 3, 4, 4]})
    assert shapes(result.model)["F"] == (6, 12)


RESHAPE_LITERAL_FROM_SUBGRAPH = """
agraph (float[N, 3, 4, 4] x, float[5, 3, 3, 3] W1, float[5] B1, int64[1] I0, int64[1] Lit, float[6, 20] F) => (float[N, 6] y)
{
  c = Conv <pads = [1, 1, 1, 1], strides = [2, 2]> (x, W1, B1)
  r = Relu (c)
  s = Shape (x)
  b = Gather <axis = 0> (s, I0)
  t = Concat <axis = 0> (b, Lit)
  f = Reshape (r, t)
  y = Gemm <transB = 1> (f, F)
}
"""


def test_literal_inside_a_computed_target_is_rewritten():
    model = tiny(RESHAPE_LITERAL_FROM_SUBGRAPH, zero={"W1": np.s_[[1]], "B1": np.s_[[1]]}, values={"I0": [0], "Lit": [20]})
    result = shrink_checked(model, input_shapes={"x": [2, 3, 4, 4]})
    assert shapes(result.model)["F"] == (6, 16)


SHUFFLE = """
agraph (float[1, 4, 3, 3] x, float[6, 4, 1, 1] W1, float[6] B1, int64[5] S1, int64[4] S2, float[2, 6, 1, 1] W2) => (float[1, 2, 3, 3] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  a = Reshape (r, S1)
  t = Transpose <perm = [0, 2, 1, 3, 4]> (a)
  b = Reshape (t, S2)
  y = Conv (b, W2)
}
"""


def test_channel_shuffle_prunes_only_whole_product_sets_and_stays_exact():
    # 6 channels as 2 groups x 3; shuffle makes channel 2*j + g of the output channel 3*g + j.
    # Zeroing j = 1 in both groups (channels 1 and 4) is a product set: both go.
    vals = {"S1": [1, 2, 3, 3, 3], "S2": [1, 6, 3, 3]}
    result = shrink_checked(tiny(SHUFFLE, zero={"W1": np.s_[[1, 4]], "B1": np.s_[[1, 4]]}, values=vals))
    s = shapes(result.model)
    assert s["W1"] == (4, 4, 1, 1)
    assert s["W2"] == (2, 4, 1, 1)
    targets = [init(result.model, n.input[1]).tolist() for n in result.model.graph.node if n.op_type == "Reshape"]
    assert targets == [[1, 2, 2, 3, 3], [1, 4, 3, 3]]


def test_channel_shuffle_with_an_uneven_mask_keeps_what_the_shuffle_needs():
    # Channel 1 only (group 0, j = 1): removing it alone would break the block structure.
    vals = {"S1": [1, 2, 3, 3, 3], "S2": [1, 6, 3, 3]}
    result = shrink_checked(tiny(SHUFFLE, zero={"W1": np.s_[[1]], "B1": np.s_[[1]]}, values=vals))
    assert shapes(result.model)["W1"] == (6, 4, 1, 1)


SQUEEZE = """
agraph (float[1, 3, 1, 1] x, float[5, 3, 1, 1] W1, float[5] B1, float[2, 5] F) => (float[1, 2] y)
{
  c = Conv (x, W1, B1)
  s = Squeeze (c, Axes)
  u = Unsqueeze (s, Axes0)
  v = Squeeze (u, Axes0)
  y = Gemm <transB = 1> (v, F)
}
"""


def test_squeeze_and_unsqueeze_map_axes():
    text = SQUEEZE.replace("float[2, 5] F)", "float[2, 5] F, int64[2] Axes, int64[1] Axes0)")
    model = tiny(text, zero={"W1": np.s_[[0, 2]], "B1": np.s_[[0, 2]]}, values={"Axes": [2, 3], "Axes0": [0]}, opset=13)
    result = shrink_checked(model)
    assert shapes(result.model)["F"] == (2, 3)


def test_reshape_groups_pairs_dims_of_equal_product():
    assert reshape_groups([2, 6, 4], [2, 2, 3, 4]) == [([0], [0]), ([1], [1, 2]), ([2], [3])]
    assert reshape_groups(["N", 8, 4, 4], ["N", 128]) == [([0], [0]), ([1, 2, 3], [1])]
    assert reshape_groups([6, 1], [6]) == [([0], [0]), ([1], [])]
    assert reshape_groups([4, 6], [6, 4]) == [([0, 1], [0, 1])]
    # Sizes that shape inference named apart (N, M): matched from both ends, the rest is one group
    assert reshape_groups(["N", 4], ["M", 4]) == [([0], [0]), ([1], [1])]
    assert reshape_groups(["u1", "u2", 64], ["b", "s", 4, 16]) == [([0, 1], [0, 1]), ([2], [2, 3])]
    assert reshape_groups([4, 6], [5, 5]) is None


def test_range_of_a_run_time_length_is_no_barrier():
    # Position ids 0..T-1 added to every hidden channel: channels 1 and 4 then carry positions
    # only, and go because W2 does not read them.
    text = """
agraph (float[1, T, 8] x, float[8, 6] W1, float[6, 4] W2, int64 Zero, int64 One, int64[1] Ax) => (float[1, T, 4] y)
{
  h = MatMul (x, W1)
  shp = Shape (x)
  t = Gather <axis = 0> (shp, One)
  ids = Range (Zero, t, One)
  f = Cast <to = 1> (ids)
  pos = Unsqueeze (f, Ax)
  a = Add (h, pos)
  r = Relu (a)
  y = MatMul (r, W2)
}
"""
    zero = {"W1": np.s_[:, [1, 4]], "W2": np.s_[[1, 4]]}
    model = tiny(text, zero=zero, values={"Zero": 0, "One": 1, "Ax": [1]})
    result = shrink_checked(model, input_shapes={"x": [1, 5, 8]})
    assert not result.barriers
    assert shapes(result.model)["W1"] == (8, 4)
    assert shapes(result.model)["W2"] == (4, 4)


# A Reshape whose target is the shape of another tensor (`Reshape(m, Shape(h))`, as exporters
# write a view back to the map it came from) ties its output's axes to h's. h gains channels
# after the Reshape was visited (here once the MatMul, live only when the closure keeps one
# channel of b, reads both of r's rows): the Reshape's rule must run again, or b keeps fewer
# channels than Shape(h) says at run time ("The input tensor cannot be reshaped").
SHAPE_OF_ANOTHER = """
agraph (float[N, 3, 4, 4] x, float[2, 3, 1, 1] W1, float[2] B1, int64[3] T, float[2, 2] W,
        float[3, 2, 1, 1] W3, float[3] B3) => (float[N, 3, 4, 4] y)
{
  h = Conv (x, W1, B1)
  r = Reshape (h, T)
  m = MatMul (W, r)
  s = Shape (h)
  b = Reshape (m, s)
  y = Conv (b, W3, B3)
}
"""


def test_a_reshape_to_the_shape_of_another_tensor_follows_that_tensor_to_the_end():
    model = tiny(SHAPE_OF_ANOTHER, values={"T": [0, 2, -1]}, zero={"W3": np.s_[:]})
    result = shrink_checked(model, input_shapes={"x": [2, 3, 4, 4]})
    s = shapes(result.model)
    assert s["W1"] == (2, 3, 1, 1) and s["W"] == (2, 2) and s["W3"] == (3, 2, 1, 1)
