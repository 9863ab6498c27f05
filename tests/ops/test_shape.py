"""Shape and Size: a size used as a reshape target follows the pruned axis; a size used as a
number (a mean written by hand, a scale) keeps the axis it measures whole."""

import numpy as np
from conftest import shapes, shrink_checked, tiny

# A mean over channels written by hand: sum / C, with C read from the shape at run time.
MEAN_BY_HAND = """
agraph (float[1, 3, 4, 4] x, float[6, 3, 1, 1] W1, float[6] B1, float[2, 6, 1, 1] W2, int64 I) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  s = Shape (r)
  n = Gather <axis = 0> (s, I)
  f = Cast <to = 1> (n)
  m = Div (r, f)
  y = Conv (m, W2)
}
"""

SIZE_SCALE = """
agraph (float[1, 3, 4, 4] x, float[6, 3, 1, 1] W1, float[6] B1, float[2, 6, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  n = Size (r)
  f = Cast <to = 1> (n)
  m = Div (r, f)
  y = Conv (m, W2)
}
"""

# C * H * W computed from the shape, used as a number.
PRODUCT = """
agraph (float[1, 3, 4, 4] x, float[6, 3, 1, 1] W1, float[6] B1, float[2, 6, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  s = Shape <start = 1> (r)
  p = ReduceProd <keepdims = 0> (s)
  f = Cast <to = 1> (p)
  m = Mul (r, f)
  y = Conv (m, W2)
}
"""

# Channels 1 and 4 are dead: the last conv never reads them.
ZERO = {"W2": np.s_[:, [1, 4]]}


def test_a_channel_count_used_as_a_divisor_keeps_the_channels():
    # Removing channels 1 and 4 would divide by 4 instead of 6: the axis stays whole.
    result = shrink_checked(tiny(MEAN_BY_HAND, zero=ZERO, values={"I": 1}))
    assert shapes(result.model)["W1"] == (6, 3, 1, 1)
    [kept] = [g for g in result.kept_zeroed if g.tensor == "W2"]
    assert (kept.axis, kept.count, kept.kind) == (1, 2, "shape")
    assert "Cast" in kept.reason or "Gather" in kept.reason  # the node using the size as a number


def test_a_spatial_size_used_as_a_divisor_leaves_the_channels_free():
    # The same graph dividing by H: channels 1 and 4 go.
    result = shrink_checked(tiny(MEAN_BY_HAND, zero=ZERO, values={"I": 2}))
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)
    assert shapes(result.model)["W2"] == (2, 4, 1, 1)


def test_the_element_count_used_as_a_number_keeps_every_axis_it_counts():
    result = shrink_checked(tiny(SIZE_SCALE, zero=ZERO, opset=13))
    assert shapes(result.model)["W1"] == (6, 3, 1, 1)


def test_a_product_of_sizes_used_as_a_number_keeps_the_channels():
    result = shrink_checked(tiny(PRODUCT, zero=ZERO, opset=18))
    assert shapes(result.model)["W1"] == (6, 3, 1, 1)


def test_the_shape_of_a_tensor_of_unknown_rank_is_not_taken_for_one_size():
    """Shape of a tensor whose rank nothing says has a length nobody knows. It was read as one
    size: its slice [1:2] was empty, and a Reshape target built from it lost an axis (PP-OCRv4's
    recognizer, paddle2onnx: an internal error, a Transpose's perm longer than the rank it was
    given). Now such a value, and any opaque shape value of unknown length, is not modelled."""
    import onnx_graphsurgeon as gs

    from onnxshrink.analyze import lookup
    from onnxshrink.analyze.constants import ConstContext
    from onnxshrink.analyze.shapes import propagate_shapes

    h = gs.Variable("h", dtype=np.float32)  # no shape: rank unknown
    s, n = gs.Variable("s", dtype=np.int64), gs.Variable("n", dtype=np.int64, shape=[1])
    known = gs.Variable("k", dtype=np.float32, shape=[2, 6, 24])
    nodes = [gs.Node("Shape", inputs=[h], outputs=[s]), gs.Node("Shape", inputs=[known], outputs=[n])]
    graph = gs.Graph(nodes=nodes, inputs=[h, known], outputs=[s, n], opset=17)
    syms = propagate_shapes(graph, ConstContext(graph, 17, lookup(17)), lookup(17))
    assert "s" not in syms  # its length is the unknown rank of h
    assert len(syms["n"].items) == 3  # a known rank: one size per axis
